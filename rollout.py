"""
RL rollouts: the generator thread that turns prompts into graded, grouped batches while the learner
trains, and eval on the same engine (engine.py, the chapter before, does the sampling).

    prompts --> [Generator thread] --render--> engine.generate (n per prompt) --grade--> RolloutBatch
                       ^                                                                      |
                       |  publish(weights, version)                 queue (bounded)           v
                       +-------------------------------------------------------------- learner

Staleness, told once (other files say "at most max_staleness versions old" and point here). The learner's
weight version v counts its optimizer steps, and it trains batch i at step i. The gate lets the generator
start batch i only once the engine holds version >= i - max_staleness, and versions only grow, so every
token of batch i was sampled by weights at most max_staleness versions older than the ones that train on
it. max_staleness 0 is synchronous RL; 1 (the recipe) generates batch i+1 while the learner trains on
batch i, one step off-policy. A sample that spans several versions (partial_rollout) is judged on its
oldest. The learner checks the same bound again per sample (grpo.fresh_mask in train.rl_step): a guard,
which never fires while this gate holds; it is there so that a broken gate (an engine or generator of
your own) shows up as staleness/dropped instead of as silent off-policy training.

When do new weights reach the engine? By default between batches only: publish(v) waits until batch
v + max_staleness - 1 is done, so batch i is sampled wholly by version i - max_staleness, two runs with
one seed are identical and a resumed run continues exactly. With `partial_rollout` (as in slime and
AReaL) they land at the next decode step of the batch in flight: generation continues under the new
weights, keeping the KV cache computed under the old ones (or prefilling it again: rollout.update_mode),
and each sample records the (oldest, newest) versions it spans; which token saw which version then
depends on timing.

A response cut by the length limit (finish_reason "length") follows rollout.truncated: `keep` its
graded reward, score it `zero`, or `mask` it (DAPO's overlong filtering): a masked sample is dropped
from the loss (no gradient, in no denominator), but its reward still counts in its group's mean and std,
so its siblings' advantages are those of the group as it was sampled.
"""
import contextlib
import math
import queue
import threading
import time
from dataclasses import dataclass, field

import grpo
from data import eval_metrics, math_reward, render_prompt
from engine import SamplingParams

# Dynamic sampling draws new prompts to replace groups whose samples all got the same reward. A run
# whose model solves nothing (or everything) would redraw forever: after this many rounds the batch
# is topped up with such groups (zero advantage, so they add nothing to the gradient).
MAX_SAMPLING_ROUNDS = 4
TRUNCATED = ("keep", "zero", "mask")  # what rollout.truncated may say


# ----------------------------------------------------------------------------- the generator thread

@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    gen_logprobs: list[float]  # the generator's logprob of each response token
    reward: float
    group: int  # index of the prompt's group within its batch
    versions: tuple[int, int]  # (oldest, newest) weight version; staleness is judged on the oldest
    finish_reason: str
    example: dict  # the dataset entry (prompt, label, ...)
    masked: bool = False  # dropped from the loss (rollout.truncated: mask); its reward still counts in its group


@dataclass
class RolloutBatch:
    samples: list[Sample]  # prompts_per_step groups of n, each group contiguous
    index: int  # batch number: the learner trains batch i at step i
    stream_state: dict  # PromptStream state after this batch's prompts were drawn (for resume)
    metrics: dict = field(default_factory=dict)


class Generator:
    """Runs the generation loop in a background thread and hands RolloutBatches to the learner.
    The staleness gate compares batch numbers with engine.version, so before start() the engine must
    hold the learner's weights and version (engine.update_weights(weights, version)); first_index is
    that version on resume, and `ready` the batches a checkpoint kept (sampled before it was taken).
    Do not evaluate on the engine while stop() runs: it aborts in-flight work. The gate and when weights
    land are this file's docstring; with max_staleness 1 the learner loses nothing by publish() waiting
    for batch v: its next step needs exactly that batch."""

    def __init__(self, engine, stream, tokenizer, *, prompts_per_step: int, n: int, sampling: SamplingParams,
                 max_staleness: int, dynamic_sampling: bool, oversample: float, chat_template: bool,
                 max_prompt_tokens: int, reward_fn=math_reward, seed: int = 0, first_index: int = 0, partial_rollout: bool = False,
                 truncated: str = "keep", ready: list = ()):
        self.engine, self.stream, self.tokenizer = engine, stream, tokenizer
        self.prompts_per_step, self.n, self.sampling = prompts_per_step, n, sampling
        self.max_staleness, self.dynamic_sampling, self.oversample = max_staleness, dynamic_sampling, oversample
        self.chat_template, self.max_prompt_tokens = chat_template, max_prompt_tokens
        self.reward_fn, self.seed, self.partial_rollout = reward_fn, seed, partial_rollout
        if truncated not in TRUNCATED:
            raise ValueError(f"rollout.truncated must be one of {TRUNCATED}, got {truncated!r}")
        self.truncated = truncated
        self.queue = queue.Queue(maxsize=max_staleness + 1)
        for batch in ready:
            self.queue.put(batch)
        self.index = first_index + len(ready)  # next batch to produce
        self.gate = threading.Condition()
        self.stopping = threading.Event()
        self.error = None
        self.waited = 0.0  # seconds spent blocked on the staleness gate or a full queue
        self.started = None
        self.thread = threading.Thread(target=self._run, name="generator", daemon=True)

    def start(self):
        self.started = time.perf_counter()
        self.thread.start()

    def stop(self):
        self.stopping.set()
        self.engine.abort()
        with self.gate:
            self.gate.notify_all()
        if self.thread.is_alive():
            self.thread.join()
        self.engine.resume()

    def publish(self, named_tensors, version: int):
        """Called by the learner after each optimizer step: new weights, and the gate opens."""
        with self.gate:
            while not (self.partial_rollout or self.index >= version + self.max_staleness or self.stopping.is_set()
                       or self.error is not None or not self.thread.is_alive()):
                self.gate.wait(0.1)
        self.engine.update_weights(named_tensors, version)
        with self.gate:
            self.gate.notify_all()

    def get(self, timeout: float | None = None) -> RolloutBatch:
        """The next batch; re-raises at once if the generator thread failed (a FloatingPointError as it
        is: a one-line diagnosis, not a bug)."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        while True:
            if isinstance(self.error, FloatingPointError):
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

    def pending(self, version: int) -> list:
        """The finished batches the learner has not taken yet, from batch `version` on (they go into a
        checkpoint: sampled by older weights, they could not be sampled again after a resume)."""
        with self.queue.mutex:
            return [b for b in self.queue.queue if version <= b.index < version + self.max_staleness]

    def idle_fraction(self) -> float:
        return self.waited / max(1e-9, time.perf_counter() - self.started) if self.started else 0.0

    def _run(self):
        try:
            while not self.stopping.is_set():
                t0 = time.perf_counter()
                with self.gate:  # bounded staleness: wait for version >= index - max_staleness
                    while self.engine.version < self.index - self.max_staleness and not self.stopping.is_set():
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
                    self.index += 1
                    self.gate.notify_all()
        except BaseException as e:  # surfaced in the learner by get()
            self.error = e

    def _make_batch(self):
        t0 = time.perf_counter()
        kept, spare, rounds, generated, skipped, cancelled = [], [], 0, [], 0, 0
        while len(kept) < self.prompts_per_step and rounds < MAX_SAMPLING_ROUNDS:
            need = self.prompts_per_step - len(kept)
            draw = math.ceil(need * (1 + self.oversample)) if self.dynamic_sampling else need
            examples, prompts = [], []
            for ex in self.stream.next(draw):
                ids = render_prompt(self.tokenizer, ex["prompt"], self.chat_template)
                if len(ids) > self.max_prompt_tokens:
                    skipped += 1  # an overlong prompt would be cut mid-question: skip it
                    continue
                examples.append(ex)
                prompts.append(ids)
            rounds += 1
            if not prompts:
                if skipped > len(self.stream.examples):
                    raise ValueError(f"every prompt is longer than rollout.max_prompt_tokens={self.max_prompt_tokens}")
                continue
            groups = self._generate_groups(examples, prompts, seed=self.seed * 1_000_003 + self.index * 101 + rounds,
                                           need=need if self.dynamic_sampling else None)
            if groups is None:
                return None
            for g in groups:
                generated += g
                (spare if self.dynamic_sampling and not grpo.informative([s.reward for s in g]) else kept).append(g)
            cancelled += len(prompts) - len(groups)
        surplus = kept[self.prompts_per_step:]  # an engine that cannot stream finishes every over-sampled prompt
        kept = kept[:self.prompts_per_step]
        top_up = spare[:self.prompts_per_step - len(kept)]  # too few informative groups: uniform ones fill in
        dropped, kept = len(spare) - len(top_up) + len(surplus), kept + top_up
        samples = []
        for gi, g in enumerate(kept):
            for s in g:
                s.group = gi
                samples.append(s)
        secs = time.perf_counter() - t0
        n_tok = sum(len(s.response_ids) for s in generated)
        metrics = {
            "rollout/reward": sum(s.reward for s in generated) / max(1, len(generated)),
            "rollout/reward_trained": sum(s.reward for s in samples) / max(1, len(samples)),
            "rollout/response_len": n_tok / max(1, len(generated)),
            "rollout/truncated": sum(s.finish_reason == "length" for s in generated) / max(1, len(generated)),
            "rollout/groups_dropped": dropped, "rollout/rounds": rounds, "rollout/prompts_skipped": skipped,
            "rollout/prompts_cancelled": cancelled,
            "rollout/gen_s": secs, "rollout/gen_tokens_per_s": n_tok / max(secs, 1e-9),
        }
        return RolloutBatch(samples, self.index, self.stream.state_dict(), metrics)

    def _generate_groups(self, examples, prompts, seed, need=None):
        """n completions per prompt, graded: a list of groups in prompt order. need (dynamic sampling with
        an engine that streams): stop once the groups done so far, taken in prompt order, hold `need`
        informative ones, and cancel the prompts after them. Prompt order, not the order groups finish
        in, so that which prompts train never favours short answers. Aborted completions (no partial
        rollout) are generated again."""
        n, flat = self.n, [p for p in prompts for _ in range(self.n)]
        comps = [None] * len(flat)
        done = []  # graded groups, a prefix of the prompts

        def grade_ready():  # grade the groups whose n completions are all in, while they form a prefix
            while len(done) < len(prompts) and all(comps[len(done) * n:(len(done) + 1) * n]):
                p, group = len(done), comps[len(done) * n:(len(done) + 1) * n]
                if any(c.finish_reason == "abort" for c in group):
                    return
                done.append([self._sample(prompts[p], c, examples[p], p) for c in group])

        if need is not None and hasattr(self.engine, "stream"):
            with contextlib.closing(self.engine.stream(flat, self.sampling, seed=seed)) as results:
                for i, c in results:
                    comps[i] = c
                    grade_ready()
                    if sum(grpo.informative([s.reward for s in g]) for g in done) >= need:
                        return done
        else:
            comps = self.engine.generate(flat, self.sampling, seed=seed)
        while not self.stopping.is_set():
            redo = [i for i, c in enumerate(comps) if c.finish_reason == "abort"]
            if not redo:
                break
            for i, c in zip(redo, self.engine.generate([flat[i] for i in redo], self.sampling, seed=seed + 7)):
                comps[i] = c
        if self.stopping.is_set():
            return None
        grade_ready()
        return done

    def _sample(self, prompt, c, example, group):
        """A graded Sample of one completion; a cut one follows rollout.truncated (this file's docstring)."""
        reward = float(self.reward_fn(self.tokenizer.decode(c.token_ids, skip_special_tokens=True), example))
        cut = c.finish_reason == "length"
        if cut and self.truncated == "zero":
            reward = 0.0
        return Sample(prompt, c.token_ids, c.logprobs, reward, group, c.versions, c.finish_reason, example,
                      masked=cut and self.truncated == "mask")


def evaluate(engine, examples, tokenizer, *, n: int, sampling: SamplingParams, chat_template: bool,
             max_prompt_tokens: int, reward_fn=math_reward, seed=0) -> dict:
    """Accuracy and pass@k of the engine's current weights on held-out examples (n samples each)."""
    prompts = [render_prompt(tokenizer, ex["prompt"], chat_template) for ex in examples]
    if max(map(len, prompts)) > max_prompt_tokens:
        raise ValueError(f"an eval prompt has {max(map(len, prompts))} tokens, over rollout.max_prompt_tokens="
                         f"{max_prompt_tokens}")
    comps = engine.generate([p for p in prompts for _ in range(n)], sampling, seed=seed)
    rewards = [[float(reward_fn(tokenizer.decode(c.token_ids, skip_special_tokens=True), ex))
                for c in comps[i * n:(i + 1) * n]] for i, ex in enumerate(examples)]
    return eval_metrics(rewards, ks=tuple(k for k in (1, 2, 4, 8, 16, 32, 64) if k <= n))
