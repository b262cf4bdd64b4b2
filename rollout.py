"""
RL rollouts: the generator thread that turns prompts into graded, grouped batches while the learner trains.
One default RL step is told down to "beyond one RL step"; after that line come eval, the warm-up's rows, agents,
failures and dynamic sampling, and the helpers the step calls by name there (Rounds and batch_groups, which in
one default round keep every group as played; single_turn, with which start-up binds data.reward).

One batch, the default way (data.env unset): draw this rank's share of rollout.prompts_per_step prompts, sample
rollout.n completions of each in one engine call, and grade each completion as it finishes with the reward hook

    reward = data.reward(response_text, example)       # default data.math_reward; any "module:function"

(response_text: the completion decoded without special tokens; example: the prompt's whole JSONL object, every
field kept; startup.start loads data.reward and checks its signature: data.load_reward). It runs on a worker
thread with a deadline, rollout.env_timeout_s: a reward that raises, hangs or is not a finite number fails its
trajectory, not the run (unless failures pile up: rollout.max_failure_fraction of a batch, or a pool out of threads,
stop it with one line). The calls: Generator._run -> _make_batch -> _rounds (one round by default) ->
_generate_groups -> play -> play_single_turn, then _sample for each trajectory.

    prompts --> [Generator thread: n completions per prompt, graded] --> RolloutBatch --> queue --> learner
                        ^                                                                            |
                        +-------------------------- publish(weights, version) -----------------------+

Staleness, told once here, with one name per counter:
    version     the learner's RL steps done (a skipped step too) = the weight version it holds; it trains batch i
                at step i (RolloutBatch.index == version, asserted); publish(weights, version) gives them to the engine
    opened      Generator.opened, the gate: the version of the learner's last open(), called after the step's
                publish, eval and checkpoint
    next_batch  Generator.next_batch, the batch the thread makes next
The thread starts batch next_batch only once opened >= next_batch - max_staleness, and publish(v) first waits until
next_batch >= v + max_staleness, so no batch is in flight while the engine copies the new weights in. Batch i is
thus sampled wholly by version max(0, i - max_staleness): 0 is synchronous RL; 1 (the recipe) makes batch i+1 while
the learner trains on batch i, one step off-policy:

    learner    | get b0 | train b0 | publish 1, open 1 | train b1 | publish 2, open 2 | train b2 | ...
    generator  | b0 (v0)| b1 (v0)                      | b2 (v1)                      | b3 (v2)  | ...

So two runs with one seed are identical and a resumed run continues exactly. With rollout.partial_rollout (as in
slime and AReaL) the weights land at once, between two decode steps of the batch in flight (its KV kept, or
prefilled again: rollout.update_mode); each sample records the (oldest, newest) versions it spans and is judged on
its oldest. The learner checks the bound again per sample (grpo.fresh_mask in train.rl_step): a guard that never
fires while this gate holds, there so that a broken gate shows as staleness/dropped, not as silent off-policy
training.
"""
import contextlib
import json
import math
import os
import queue
import random
import threading
import time
from dataclasses import dataclass, field, replace

import grpo
from data import eval_metrics, math_reward, render_prompt
from machinery import env
from machinery.engine import SamplingParams
from machinery.env import Episode, TooManyFailures, dump_record
from machinery.parallel import all_gather, rank, world

# Dynamic sampling draws new prompts to replace groups whose samples all got the same reward. A run
# whose model solves nothing (or everything) would redraw forever: after this many rounds the batch
# is topped up with such groups (zero advantage, so they add nothing to the gradient).
MAX_SAMPLING_ROUNDS = 4
MAX_WARNINGS = 5  # failed trajectories printed per batch (all are counted: rollout/env_failures)


# ----------------------------------------------------------------------------- the records: a sample, a batch

@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    gen_logprobs: list[float]  # the generator's logprob of each model token of the response
    reward: float
    group: int  # index of the prompt's group within its batch
    versions: tuple[int, int]  # (oldest, newest) weight version; staleness is judged on the oldest
    finish_reason: str
    example: dict  # the dataset entry (prompt, label, ...)
    masked: bool = False  # dropped from the loss (rollout.truncated: mask, or a void turn); its reward still counts
    spans: list | None = None  # agents: (start, length) of each model turn in response_ids; None: one turn, all scored
    turns: int = 1
    routes: object = None  # MoE: the generator's experts [positions fed, n_moe, k] (engine.Completion.routes); None: dense
    teacher_logprobs: list[float] | None = None  # distillation: the teacher's logprob of each model token

    def row(self):
        """(prompt + response ids, the (start, length) spans the learner scores: the model's tokens)."""
        at = len(self.prompt_ids)
        spans = [(at, len(self.response_ids))] if self.spans is None else [(at + a, n) for a, n in self.spans]
        return self.prompt_ids + self.response_ids, spans


@dataclass
class RolloutBatch:
    samples: list[Sample]  # this rank's prompts_per_step / world groups (fewer only if failures outlast
    # MAX_SAMPLING_ROUNDS), each contiguous; a group may have lost failed trajectories (fewer than n, more than n / 2 left)
    index: int  # batch number: the learner trains batch i at step i
    stream_state: dict  # PromptStream state after this batch's prompts were drawn (for resume)
    metrics: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- one turn, graded: the default trajectory
# (what the thread below plays for each prompt: Generator._generate_groups calls play)


def play(engine, eps, env_cls, tokenizer, sampling, limits, seed, *, chat_template=True, stopping=lambda: False,
         each=False):
    """Play the episodes to their end, yielding (i, episode) as each one ends: one graded turn each without
    data.env (play_single_turn), else the env's turns through machinery/env.py's episode loop (env.run_episodes;
    each: the env answers each turn as it arrives on an engine without sessions)."""
    if issubclass(env_cls, SingleTurn):
        return play_single_turn(engine, eps, env_cls, tokenizer, sampling, limits, seed, chat_template=chat_template,
                                stopping=stopping)
    return env.run_episodes(engine, eps, env_cls, tokenizer, sampling, limits, seed, chat_template=chat_template,
                            stopping=stopping, each=each)


def play_single_turn(engine, eps, hook, tokenizer, sampling: SamplingParams, limits: env.Limits, seed, *,
                     chat_template=True, stopping=lambda: False):
    """The default path: each Episode (machinery/env.py's trajectory record; eps: every prompt's n of a round, a
    prompt's side by side: 32 x 8 by default) is its prompt and one sampled response. One engine call samples them
    all (env.generate: request i seeded by request_seeds(seed, len(eps))[i]). The responses that finish in one engine
    iteration are graded at once (env.guarded), each hook.reward_fn(its text, the example) on one of a pool's 64
    threads, with a deadline from its start (limits.timeout_s: rollout.env_timeout_s). A reward that raises, misses
    the deadline (its thread is written off; over 256 such still running stop the run) or is not a finite number within
    +-env.REWARD_LIMIT (env.reward_value) fails its trajectory (ep.failure), not the run. Sets each episode's prompt,
    response, logprobs, spans, versions, routes, reward and finish ("stop", "length"); yields (i, episode) as each
    ends."""
    what = f"{hook.__name__}.step"
    for ep in eps:
        ep.prompt = render_prompt(tokenizer, ep.example["prompt"], chat_template)
    budget = replace(sampling, max_new_tokens=min(limits.max_new_tokens, limits.max_total_tokens))
    completions = env.generate(engine, [ep.prompt for ep in eps], [budget] * len(eps), seed, stopping)
    try:
        with contextlib.closing(completions):  # closed early (dynamic sampling has enough, a stop): the rest cancelled
            for part in completions:  # [(i, Completion: token_ids and their logprobs, as sampled)] of one iteration
                calls = []  # their reward calls, run at once on the pool
                for i, c in part:
                    ep = eps[i]
                    ep.response, ep.logprobs, ep.routes = list(c.token_ids), list(c.logprobs), c.routes
                    ep.spans, ep.versions, ep.turns = [(0, len(c.token_ids))], list(c.versions), 1
                    text = tokenizer.decode(c.token_ids, skip_special_tokens=True)
                    calls.append((ep, what, _reward, (hook.reward_fn, text, ep.example)))
                for (i, c), (graded, reward) in zip(part, env.guarded(calls, limits.timeout_s)):  # all at once
                    if graded:
                        eps[i].reward, eps[i].finish = reward, "length" if c.finish_reason == "length" else "stop"
                    yield i, eps[i]
    finally:
        for ep in eps:
            ep.finish = ep.finish or "cancelled"


def _reward(fn, text, example):
    return env.reward_value(fn(text, example))  # a float, or ValueError: not a finite number within +-REWARD_LIMIT


# ----------------------------------------------------------------------------- the generator thread


class Generator:
    """The generation loop in a background thread, handing RolloutBatches to the learner behind the staleness gate
    (this file's docstring). Before start() the engine must hold the learner's weights (the first publish). Do not
    evaluate on the engine while stop() runs: it aborts in-flight work."""

    def __init__(self, engine, stream, tokenizer, r, sampling: SamplingParams, *, env_cls, seed: int = 0,
                 first_index: int = 0, end: int | None = None, rank: int = 0, world: int = 1, run_dir: str | None = None,
                 ready: list = (), teacher=None):
        """r: config.RolloutConfig; sampling: its SamplingParams; env_cls: data.env's class, or single_turn(data.reward);
        first_index: the learner's version (on resume: the checkpoint's); end: the batch to stop at (None: until stop());
        ready: batches a checkpoint kept; rank, world: this process's share (its stream holds examples rank::world);
        run_dir: where failures' tracebacks and the rollout dump go; teacher: distillation's machinery/teacher.Teacher."""
        self.engine, self.stream, self.tokenizer = engine, stream, tokenizer
        self.prompts_per_step, self.n, self.sampling = r.prompts_per_step // world, r.n, sampling
        self.max_staleness, self.oversample, self.teacher = r.max_staleness, r.oversample, teacher
        # distillation alone gives every token its own advantage: no group is uninformative, none is redrawn
        self.dynamic_sampling = r.dynamic_sampling and (teacher is None or teacher.outcome)
        self.chat_template, self.streams = r.chat_template, hasattr(engine, "session") or hasattr(engine, "stream")
        self.env_cls, self.limits = env_cls, env.limits_of(r, sampling.max_new_tokens)
        self.seed, self.partial_rollout, self.truncated = seed, r.partial_rollout, r.truncated
        self.max_failures, self.run_dir, self.dump_fraction = r.max_failure_fraction, run_dir, r.dump_fraction
        self.rank, self.seen_failures, self.close_failures, self.spec_seen = rank, set(), 0, {}
        self.index_of = {id(ex): rank + world * i for i, ex in enumerate(stream.examples)}
        self.queue = queue.Queue(maxsize=self.max_staleness + 1)
        for batch in ready:
            self.queue.put(batch)
        self.next_batch, self.end = first_index + len(ready), end  # the batch the thread makes next; the one to stop at
        self.opened = first_index  # the gate: the version of the learner's last open() (the engine's runs ahead of it)
        self.gate = threading.Condition()
        self.stopping = threading.Event()
        self.error = None
        self.waited = 0.0  # seconds spent blocked on the staleness gate or a full queue
        self.started = None
        self.thread = threading.Thread(target=self._run, name="generator", daemon=True)

    def start(self):
        self.started = time.perf_counter()
        self.thread.start()

    def publish(self, named_tensors, version: int):
        """Called by the learner after each optimizer step: the new weights reach the engine. By default they land
        between batches: first wait until the batches that older weights must sample are done (next_batch reaches
        version + max_staleness; this file's docstring), after which the thread waits at the gate for open(version):
        no batch is in flight while engine.update_weights copies each tensor into its model, in place. With
        partial_rollout, at once (the engine takes them between two decode steps); and before start() too (the
        first publish: no thread, so no batch to wait for). With max_staleness 1: publish(v) returns once batch v is
        queued, and batch v + 1 starts only after open(v)."""
        with self.gate:
            until = version + self.max_staleness if self.end is None else min(version + self.max_staleness, self.end)
            while not (self.partial_rollout or self.next_batch >= until or self.stopping.is_set()
                       or self.error is not None or not self.thread.is_alive()):
                self.gate.wait(0.1)
        self.engine.update_weights(named_tensors, version)

    def open(self, version: int):
        """The staleness gate: batches up to version + max_staleness may start. The learner opens it after its
        step's eval and checkpoint, so those never share the engine (co-located: the GPU) with a batch that has not
        started yet (with rollout.partial_rollout a batch in flight goes on decoding beside them)."""
        with self.gate:
            self.opened = version
            self.gate.notify_all()

    def get(self, timeout: float | None = None) -> RolloutBatch:
        """The next batch; re-raises at once if the generator thread failed (a FloatingPointError or
        TooManyFailures as it is: a one-line diagnosis, not a bug)."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        while True:
            if isinstance(self.error, (FloatingPointError, TooManyFailures)):
                raise self.error
            if self.error is not None:
                raise RuntimeError("the generator thread failed (see the error above)") from self.error
            try:
                return self.queue.get(timeout=0.1)
            except queue.Empty:
                if deadline is not None and time.perf_counter() > deadline:
                    raise TimeoutError("no rollout batch arrived in time") from None
                if not self.thread.is_alive() and self.error is None:
                    raise RuntimeError("the generator thread has stopped")

    def _run(self):
        try:
            while not self.stopping.is_set() and (self.end is None or self.next_batch < self.end):
                t0 = time.perf_counter()
                with self.gate:  # bounded staleness: wait for opened >= next_batch - max_staleness
                    while self.opened < self.next_batch - self.max_staleness and not self.stopping.is_set():
                        self.gate.wait(0.1)
                self.waited += time.perf_counter() - t0
                if self.stopping.is_set():
                    return
                batch = self._make_batch()
                if batch is None:
                    return
                t0 = time.perf_counter()
                while not self.stopping.is_set():
                    try:
                        self.queue.put(batch, timeout=0.1)
                        break
                    except queue.Full:
                        pass
                self.waited += time.perf_counter() - t0
                with self.gate:  # a publish may be waiting for this batch
                    self.next_batch += 1
                    self.gate.notify_all()
        except BaseException as e:  # surfaced in the learner by get()
            self.error = e

    def _make_batch(self):
        """Batch next_batch: prompts_per_step groups of n graded samples, numbered in prompt order. By default one
        round: draw the prompts, play them (_generate_groups), keep every group. Further rounds (_rounds) replace
        groups lost to failures and, with dynamic sampling, uniform ones. None if the generator is stopping."""
        t0 = time.perf_counter()
        self.close_failures = 0
        r = self._rounds()
        if r is None:
            return None
        failures = [ep for ep in r.episodes if ep.failure is not None]  # data: warnings, tracebacks, a stop if too many
        env.report_failures(failures, len(r.episodes), self.next_batch, self.max_failures, self.run_dir, self.rank,
                            self.seen_failures, MAX_WARNINGS)
        kept, dropped = batch_groups(r, self.prompts_per_step)  # by default every group of the one round, none dropped
        samples = []
        for gi, g in enumerate(kept):
            for s in g:
                s.group = gi
                samples.append(s)
        metrics = self._metrics(r, samples, failures, dropped, time.perf_counter() - t0)
        if self.teacher is not None:  # on-policy distillation: the teacher's logprob of every model token of the batch
            metrics["perf/teacher_s"] = self.teacher.score(samples)
        if self.dump_fraction > 0 and self.run_dir is not None:
            self._dump(r.episodes)
        return RolloutBatch(samples, self.next_batch, self.stream.state_dict(), metrics)

    def _rounds(self):
        """Draw prompts and play them, round after round, until prompts_per_step groups are kept (one round unless
        groups fail or dynamic sampling sets uniform ones aside as spare) or MAX_SAMPLING_ROUNDS have run. Returns a
        Rounds (None if the generator is stopping)."""
        r = Rounds()
        while len(r.kept) < self.prompts_per_step and r.rounds < MAX_SAMPLING_ROUNDS:
            need = self.prompts_per_step - len(r.kept)
            draw = math.ceil(need * (1 + self.oversample)) if self.dynamic_sampling else need
            examples = self.stream.next(draw)
            r.rounds += 1
            groups = self._generate_groups(examples, r.episodes, seed=self.seed * 1_000_003 + self.next_batch * 101 + r.rounds,
                                           need=need if self.dynamic_sampling else None)
            if groups is None:
                return None
            for g in groups:
                if g is None:  # half or more of its trajectories failed
                    r.failed_groups += 1
                    continue
                r.generated += g
                (r.spare if self.dynamic_sampling and not grpo.informative([s.reward for s in g]) else r.kept).append(g)
            r.cancelled += len(examples) - len(groups)
            if sum(ep.failure is not None for ep in r.episodes) > self.max_failures * len(r.episodes):
                break  # too many failed already (an env that is down): stop now (report_failures), not after more rounds
        return r

    def _generate_groups(self, examples, episodes, seed, need=None):
        """n trajectories per prompt, played to their end (play: one graded turn each by default): a list of
        groups (lists of Samples) in prompt order, None for a group that lost half of its trajectories or more to
        failures (a failed trajectory is dropped; its group trains at its reduced size while more than half
        remains). Its finished episodes are added to `episodes`. need (dynamic sampling with an engine that
        streams): stop once the groups done so far, taken in prompt order, hold `need` informative ones, and
        cancel the prompts after them. Prompt order, not the order groups finish in, so that which prompts
        train never favours short answers. Returns None if the generator is stopping."""
        n = self.n
        eps = [Episode(ex, self.index_of.get(id(ex), -1)) for ex in examples for _ in range(n)]
        done = []  # groups, a prefix of the prompts

        def settle():  # the groups whose n trajectories have all ended, while they form a prefix
            while len(done) < len(examples) and all(ep.finish is not None for ep in eps[len(done) * n:(len(done) + 1) * n]):
                p = len(done)
                ok = [ep for ep in eps[p * n:(p + 1) * n] if ep.failure is None]
                done.append([self._sample(ep, p) for ep in ok] if 2 * len(ok) > n else None)

        runs = play(self.engine, eps, self.env_cls, self.tokenizer, self.sampling, self.limits, seed,
                    chat_template=self.chat_template, stopping=self.stopping.is_set, each=need is not None and self.streams)
        try:
            with contextlib.closing(runs):
                for _, ep in runs:
                    episodes.append(ep)
                    settle()
                    if need is not None and self.streams and informative_groups(done) >= need:
                        return done  # dynamic sampling has its groups: the prompts after them are cancelled
        finally:  # (closing an env's episode loop closed every env, cancelled ones too)
            self.close_failures += sum(ep.close_failure is not None for ep in eps)
        if self.stopping.is_set():
            return None
        return done

    def _sample(self, ep: Episode, group):
        """The Sample of a trajectory; a cut one follows rollout.truncated, a void one is masked ("beyond one RL
        step", below)."""
        cut = ep.finish == "length"
        reward = 0.0 if cut and self.truncated == "zero" else ep.reward
        spans = None if ep.spans == [(0, len(ep.response))] else list(ep.spans)  # None: every token the model's
        return Sample(ep.prompt, ep.response, ep.logprobs, reward, group, tuple(ep.versions), ep.finish, ep.example,
                      masked=(cut and self.truncated == "mask") or ep.finish == "void", spans=spans, turns=ep.turns,
                      routes=ep.routes)

    # ------------------------------------------------------------------------- the rest of the thread's life

    def stop(self):
        self.stopping.set()
        self.engine.abort()
        with self.gate:
            self.gate.notify_all()
        if self.thread.is_alive():
            self.thread.join()
        self.engine.resume()

    def pending(self, version: int) -> list:
        """The finished batches the learner has not taken yet, from batch `version` on (they go into a
        checkpoint: sampled by older weights, they could not be sampled again after a resume)."""
        with self.queue.mutex:
            return [b for b in self.queue.queue if version <= b.index < version + self.max_staleness]

    def idle_fraction(self) -> float:
        return self.waited / max(1e-9, time.perf_counter() - self.started) if self.started else 0.0

    def _metrics(self, r, samples, failures, dropped, secs):
        """rollout/*: the batch's rewards, lengths and rounds; its trajectories' env side (one turn and no tool calls
        without data.env); failures."""
        generated, n_tok = r.generated, sum(len(s.response_ids) for s in r.generated)
        played = [ep for ep in r.episodes if ep.failure is None]

        def mean(f):  # over the trajectories played to their end
            return sum(map(f, played)) / max(1, len(played))

        metrics = {
            "rollout/reward": sum(s.reward for s in generated) / max(1, len(generated)),
            "rollout/reward_trained": sum(s.reward for s in samples) / max(1, len(samples)),
            "rollout/response_len": n_tok / max(1, len(generated)),
            "rollout/truncated": sum(s.finish_reason == "length" for s in generated) / max(1, len(generated)),
            "rollout/groups_dropped": dropped, "rollout/rounds": r.rounds, "rollout/prompts_cancelled": r.cancelled,
            "rollout/gen_s": secs, "rollout/gen_tokens_per_s": n_tok / max(secs, 1e-9),
            "rollout/turns": mean(lambda ep: ep.turns), "rollout/tool_calls": mean(lambda ep: ep.tool_calls),
            "rollout/tool_call_rate": mean(lambda ep: ep.tool_calls > 0), "rollout/void": mean(lambda ep: ep.finish == "void"),
            "rollout/model_tokens": mean(lambda ep: ep.model_tokens),
            "rollout/env_tokens": mean(lambda ep: len(ep.response) - ep.model_tokens),
            "rollout/env_failures": len(failures), "rollout/groups_failed": r.failed_groups,
            "perf/env_s": sum(ep.env_s for ep in r.episodes),
        }
        if not issubclass(self.env_cls, SingleTurn):  # (the reward hook has no close: single-turn rows stay as is)
            metrics["rollout/env_close_failures"] = self.close_failures  # counted apart: they changed no trajectory
        if getattr(self.engine, "stats", {}).get("spec_calls"):  # rollout.speculative_tokens: this file's end
            metrics |= speculation_metrics(self.engine, self.spec_seen)
        return metrics

    def _dump(self, episodes):
        """A sampled fraction of the batch's trajectories (the same ones on a rerun: the draws are seeded by the
        batch) as JSON lines in run_dir/rollouts/, for debugging an env."""
        draw = random.Random(self.seed * 1_000_003 + self.next_batch)
        picked = [ep for ep in episodes if draw.random() < self.dump_fraction]
        folder = os.path.join(self.run_dir, "rollouts")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"batch_{self.next_batch:06d}" + (f"_rank{self.rank}" if self.rank else "") + ".jsonl")
        with open(path + ".tmp", "w") as f:
            for ep in picked:
                f.write(json.dumps(dump_record(ep, self.tokenizer)) + "\n")
        os.replace(path + ".tmp", path)


# ============================================================================= beyond one RL step
#
# A response cut by the length limit (finish_reason "length") follows rollout.truncated: `keep` its
# graded reward, score it `zero`, or `mask` it (DAPO's overlong filtering): a masked sample is dropped
# from the loss (no gradient, in no denominator), but its reward still counts in its group's mean and std,
# so its siblings' advantages are those of the group as it was sampled.
#
# Failures are data: a trajectory whose reward hook (or env) raised or timed out is dropped; its group trains at
# its reduced size while more than half of it remains, else the whole group is dropped and a fresh prompt takes
# its place in a further round (at most MAX_SAMPLING_ROUNDS in all: then the batch trains short), as dynamic
# sampling refills (GLM-5 pads a group with repeated samples instead,
# which would count their gradients twice). Each failure is one warning line naming the hook, the example and
# the exception; the first traceback of each kind is saved in run_dir/env_failures/; more than
# rollout.max_failure_fraction of a batch failing stops the run with one line (checked after each round of
# prompts: a batch over it plays no further round). rollout.dump_fraction of each batch's trajectories go to
# run_dir/rollouts/ as JSON lines.
#
# Agents (data.env: "module:Class", the README's Lookup is an example): a trajectory is many turns, played by
# machinery/env.py's episode loop (env.run_episodes) instead of play_single_turn; the env's reward replaces
# data.reward. The contract, one instance per trajectory:
#
#         class MyEnv:
#             tools: list[dict] = []             # optional JSON schemas, passed to apply_chat_template(tools=...)
#             def __init__(self, example): ...   # one episode; the whole JSONL object, every field kept
#             def reset(self) -> list[dict]: ... # the opening chat messages: [{"role": "user", "content": ...}]
#             def step(self, text): ...          # after each model turn, its decoded text -> (messages to append,
#                                                #   reward, done) or (..., info): {"tool_calls", "void", "tool_io"};
#                                                #   reward a finite number, done a bool (numpy or torch scalars: their
#                                                #   value), info a dict or None: anything else fails the trajectory
#             def close(self): ...               # optional; called for every episode, finished, cut or cancelled (one
#                                                #   that raises or hangs changes no trajectory: rollout/env_close_failures)
#             @classmethod
#             def setup(cls, **env_args): ...    # optional; once per process, before the model loads (data.env_args)
#             @classmethod
#             def teardown(cls): ...             # optional; at exit
#     The reward is the one of the step that ends the trajectory. A tool's answer enters the trajectory as the
#     ids its messages add to the conversation (rendered once, never re-tokenized; machinery/env.py): context for
#     the next turn, never scored: Sample.spans marks the model's turns, the only tokens the learner scores. A
#     trajectory ended by a void turn (machinery/env.py) is masked like a cut one under `mask`.


@dataclass
class Rounds:
    """What a batch's rounds of prompts gave (Generator._rounds): groups of Samples kept for training, uniform ones set
    aside (dynamic sampling), every Sample generated, every trajectory played (failed ones too, for the failure
    report, the metrics and the dump), and counts."""
    kept: list = field(default_factory=list)
    spare: list = field(default_factory=list)
    generated: list = field(default_factory=list)
    episodes: list = field(default_factory=list)
    rounds: int = 0
    cancelled: int = 0
    failed_groups: int = 0


def single_turn(reward_fn):
    """SingleTurn bound to a reward function, and named after it (warnings say "math_reward.step raised ...")."""
    return type(getattr(reward_fn, "__name__", "reward"), (SingleTurn,), {"reward_fn": staticmethod(reward_fn)})


class SingleTurn:
    """The reward hook as an env class: what stands for data.env when it is not set (single_turn binds
    data.reward). play_single_turn calls its reward_fn; machinery/env.py's episode loop can play it too (one
    turn, graded, done), which tests use to compare the two paths."""
    tools: list = []
    trusted = True  # our own __init__ and reset run inline; step (the reward hook) runs guarded
    one_turn = True  # nothing follows the first turn: its KV is never parked
    reward_fn = staticmethod(math_reward)

    def __init__(self, example):
        self.example = example

    def reset(self):
        return self.example["prompt"]  # a string or messages

    def step(self, text):
        return [], self.reward_fn(text, self.example), True


def batch_groups(r: Rounds, want: int):
    """The groups a batch trains on (at most `want`), and how many it dropped. One round without dynamic sampling:
    every group kept, none dropped. Dynamic sampling keeps the first `want` informative groups in prompt order (an
    engine that cannot stream finished every over-sampled prompt: the surplus is dropped) and tops them up with
    uniform ones (r.spare: zero advantage) when too few were informative; the unused uniform ones are dropped."""
    kept, surplus = r.kept[:want], r.kept[want:]
    top_up = r.spare[:want - len(kept)]
    return kept + top_up, len(r.spare) - len(top_up) + len(surplus)


def evaluate(engine, examples, tokenizer, *, n: int, sampling: SamplingParams, limits: env.Limits, env_cls,
             chat_template: bool, seed=0) -> dict:
    """Accuracy and pass@k of the engine's current weights on held-out examples: n trajectories each, played
    with the env as in RL (a failed one scores 0). With an env also its turns per trajectory, the share of
    trajectories that called a tool and the env failure rate."""
    eps = [Episode(ex, i) for i, ex in enumerate(examples) for _ in range(n)]
    for _ in play(engine, eps, env_cls, tokenizer, sampling, limits, seed, chat_template=chat_template):
        pass
    rewards = [[ep.reward if ep.failure is None else 0.0 for ep in eps[i * n:(i + 1) * n]] for i in range(len(examples))]
    out = eval_metrics(rewards, ks=tuple(k for k in (1, 2, 4, 8, 16, 32, 64) if k <= n))
    if not issubclass(env_cls, SingleTurn):  # a real env (not the reward hook): how it was played; rates, which
        out |= {"turns": sum(ep.turns for ep in eps) / len(eps),  # the ranks' prompt-weighted mean keeps right
                "tool_call_rate": sum(ep.tool_calls > 0 for ep in eps) / len(eps),
                "env_failure_rate": sum(ep.failure is not None for ep in eps) / len(eps)}
    return out


def sampling_params(cfg, model, tokenizer, max_new_tokens) -> SamplingParams:
    """A turn's sampling: the rollout temperature, ended at eos or (with an env) where the chat format hands over:
    <|observation|> (a tool), <|user|>."""
    stop_ids = tuple(sorted({*model.cfg.eos_token_id, tokenizer.eos_token_id, *(env.turn_ends(tokenizer) if cfg.data.env else ())}))
    return SamplingParams(cfg.rollout.temperature, max_new_tokens=max_new_tokens, stop_token_ids=stop_ids)


def run_eval(cfg, engine, tokenizer, sets, stop_ids, env_cls) -> dict:
    """Every eval set (data.eval) at train.eval_temperature, and greedily too with train.eval_greedy (one argmax
    answer per problem: eval/<set>/greedy_accuracy): eval/<set>/<metric>. Each rank evaluates
    every world()-th example on its own engine; accuracy and pass@k are means over prompts, so the prompt-weighted
    mean of the ranks' numbers is that of the whole set."""
    t = cfg.train
    temp = cfg.rollout.temperature if t.eval_temperature is None else t.eval_temperature
    runs = [("", temp, t.eval_n if temp > 0 else 1)] + ([("greedy_", 0.0, 1)] if t.eval_greedy and temp > 0 else [])
    out = {}
    for name, examples in sets.items():
        mine = examples[rank()::world()]
        for prefix, temperature, n in runs:
            sampling = SamplingParams(temperature, max_new_tokens=t.eval_max_new_tokens, stop_token_ids=stop_ids)
            m = evaluate(engine, mine, tokenizer, n=n, sampling=sampling, seed=cfg.seed, env_cls=env_cls, chat_template=
                         cfg.rollout.chat_template, limits=env.limits_of(cfg.rollout, t.eval_max_new_tokens)) if mine else {}
            if prefix:
                m = {"accuracy": m["accuracy"]} if m else {}
            parts = [(k, pm) for k, pm in all_gather((len(mine), m)) if k]
            total = sum(k for k, _ in parts)
            out |= {f"eval/{name}/{prefix}{key}": sum(k * pm[key] for k, pm in parts) / total for key in parts[0][1]}
        if out.get(f"eval/{name}/env_failure_rate") and rank() == 0:  # said where the accuracy is (accuracy_line too)
            print(f"[eval] {name}: the env failed {out[f'eval/{name}/env_failure_rate']:.0%} of the trajectories; each "
                  f"scored 0 in eval/{name}/accuracy", flush=True)
    return out


def accuracy_line(metrics: dict) -> str:
    """Each eval set's accuracy for the console, e.g. "synthetic/accuracy 61.0%". An env that failed trajectories
    says so beside it: a failed trajectory scores 0, so without the note an env that is down reads as a model that
    learned nothing."""
    out = []
    for k, v in metrics.items():
        if k.startswith("eval/") and k.endswith("accuracy"):
            failed = metrics.get(k.rsplit("/", 1)[0] + "/env_failure_rate", 0.0)
            out.append(f"{k.removeprefix('eval/')} {v:.1%}" + (f" (the env failed {failed:.0%} of its trajectories, each "
                                                                f"scored 0)" if failed else ""))
    return ", ".join(out) or "n/a"


def sft_rows(cfg, tokenizer, examples, env_cls):
    """[(prompt + reference response + eos, its scored span)]: what the supervised warm-up learns from. With data.env
    a reference is the model's turns of a trace, played through the env as an RL episode is (env.traces): (its
    tokens, the spans of the model's turns), so the warm-up learns only the model's; None for a failed trace."""
    if not cfg.data.env:
        prompts = [render_prompt(tokenizer, ex["prompt"], cfg.rollout.chat_template) for ex in examples]
        answers = [tokenizer.encode(ex["solution"], add_special_tokens=False) + [tokenizer.eos_token_id] for ex in examples]
        return [(p + a, [(len(p), len(a))]) for p, a in zip(prompts, answers)]
    turns = [ex["solution"] if isinstance(ex["solution"], list) else [ex["solution"]] for ex in examples]
    stop = env.handoff_token(tokenizer) if any(len(t) > 1 for t in turns) else None
    eps = env.traces(env_cls, examples, turns, tokenizer, env.limits_of(cfg.rollout, cfg.rollout.max_new_tokens), stop,
                     tokenizer.eos_token_id, cfg.rollout.chat_template)
    for ep in (ep for ep in eps if ep.failure is not None):  # a flaky env: skipped now, tried again when drawn again
        print(f"[train] the supervised trace of example {ep.example!r:.60} failed, skipped: {ep.failure}", flush=True)
    # Every rank plays the same global batch and keeps its own share of the rows: a trace that failed on one rank
    # only must be dropped on all, or the ranks would split different batches (every rank calls this, so all meet).
    failed = set().union(*all_gather({k for k, ep in enumerate(eps) if ep.failure is not None}))
    return [None if k in failed else (ep.prompt + ep.response, [(len(ep.prompt) + a, n) for a, n in ep.spans])
            for k, ep in enumerate(eps)]


SPEC_STATS = ("spec_drafts", "spec_accepted", "spec_tokens", "spec_rows", "spec_draft_s", "spec_verify_s", "spec_calls",
              "plain_calls")


def speculation_metrics(engine, seen: dict) -> dict:
    """A batch's speculative decoding (rollout.speculative_tokens; machinery/speculative.py), from the engine's
    counters since the last batch (`seen`: the counters then, updated here; an eval between them counts too): the
    share of the engine's calls that speculated (the others ran plain: it speculates only where that pays), and over
    those that did, the share of drafted tokens accepted, the tokens emitted per row of a verify forward (1 + the
    accepted drafts) and the seconds the drafter and the verify forwards took; each mode's last measured decode
    tokens per second. {} without speculation."""
    stats = getattr(engine, "stats", {})
    if not stats.get("spec_calls"):
        return {}
    d = {k: stats.get(k, 0) - seen.get(k, 0) for k in SPEC_STATS}
    seen |= {k: stats.get(k, 0) for k in SPEC_STATS}
    out = {"rollout/spec_on": d["spec_calls"] / max(1, d["spec_calls"] + d["plain_calls"])}
    if d["spec_rows"]:  # (no call speculated since the last batch: no acceptance to report)
        out |= {"rollout/spec_accept_rate": d["spec_accepted"] / max(1, d["spec_drafts"]),
                "rollout/spec_tokens_per_verify": d["spec_tokens"] / d["spec_rows"],
                "perf/spec_draft_s": d["spec_draft_s"], "perf/spec_verify_s": d["spec_verify_s"]}
    return out | {f"perf/{m}_tokens_per_s": stats[f"{m}_tokens_per_s"] for m in ("spec", "plain")
                  if f"{m}_tokens_per_s" in stats}


def informative_groups(groups) -> int:
    """How many of the groups (lists of Samples; None: failed) have rewards that differ (grpo.informative)."""
    return sum(g is not None and grpo.informative([s.reward for s in g]) for g in groups)
