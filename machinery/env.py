"""
Environments: multi-turn episodes, between the engine (engine.py samples one turn) and the rollouts
(rollout.py groups and grades trajectories). A trajectory is the prompt, then model turns and the
environment's messages alternating, as one list of token ids:

    [prompt: env.reset()] [model: calc(37*48) <|observation|>] [env: 1776 <|assistant|>] [model: \\boxed{1776} eos]
     context only          trained, exactly as sampled           context only             trained

The contract an env class keeps (data.env: "module:Class") is told in rollout.py ("beyond one RL step"), beside
the Generator that plays it. Without data.env none of this loop runs: rollout.play_single_turn samples one turn per
trajectory through `generate` below and grades it with `guarded`'s deadline (a test plays rollout.SingleTurn, the
reward hook as a one-turn env, here too, and compares).

Tokens across turns (GLM-5's "TITO": the trainer never re-tokenizes). The model's tokens are kept as
sampled, with their logprobs; a turn ends at a stop id of the chat format (GLM: <|observation|> hands
control to a tool, <|user|>) or at eos. The env's messages are rendered incrementally: a fixed short base
conversation is rendered with and without them, and only the ids they add are appended. The history is
never rendered again (GLM-Z1's template strips earlier <think> blocks, so a re-render is not append-only):
earlier thinking stays in the context exactly as sampled. If the added ids start with the stop token the
model just sampled (GLM renders an observation as <|observation|>\\n...), it is not repeated.

Limits: rollout.max_new_tokens per turn, rollout.max_total_tokens after the prompt (model and env tokens
together), rollout.max_turns; a trajectory cut by one ends with finish "length" and follows
rollout.truncated like a cut single-turn response. Env messages are cut to rollout.max_env_chars
characters before rendering. A turn with neither a tool call nor an answer (info "void") ends the
trajectory with finish "void", and it is masked out of the loss (SimpleTIR: training on such trajectories
is what makes multi-turn runs blow up); its reward still counts in its group's baseline.

Failures are data. Every call into the env (or the reward hook) runs on a pool of daemon threads (many
trajectories' tools at once) with a deadline (rollout.env_timeout_s). One that raises, times out or
returns something malformed fails its trajectory: the trajectory is dropped (rollout.py decides what
becomes of its group), never a traceback that ends the run. (The env itself runs in the trainer's
process: an env that runs model-written code must send it to a sandbox of its own.)

The file in reading order: the hook (load_env), rendering env messages (render_messages), one
trajectory (Limits, Episode, the guarded calls, start, model and env turns, close), the episode loop
(run_episodes), supervised traces (traces), the demo's env (Calculator) and the rollout dump's record.
"""
import ast
import atexit
import contextlib
import json
import math
import numbers
import operator
import os
import queue
import re
import threading
import time
import traceback
from dataclasses import dataclass, field, replace

from data import chat_ids, load_object, math_reward, render_prompt
from machinery.engine import Completion, SamplingParams, request_seeds
from machinery.scheduler import extend_routes

# The chat format's tokens that end a model turn besides eos (GLM-4's generation_config lists both among
# its eos ids): the model hands control to a tool, or to the user.
TURN_ENDS = ("<|observation|>", "<|user|>")
# The fixed conversation env messages are rendered after: only the ids they add go into the trajectory.
BASE = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]
TURN_SEED = 1_000_000_007  # turn t of a batch samples with seed + t * TURN_SEED (turn 0: the batch's own seed)


class TooManyFailures(RuntimeError):
    """More of a batch's trajectories failed in the env than rollout.max_failure_fraction allows (rollout.py raises it;
    checkpoint.run_main prints it as one line)."""


# ----------------------------------------------------------------------------- the hook


def load_env(spec, env_args=None):
    """The env class named by data.env ("module:Class"), checked against the contract (one line if not), and
    set up: its setup(**env_args) runs now, once per process, before any model loads (a sandbox's workers
    start small), and its teardown() at exit."""
    cls = load_object(spec, "data.env")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        raise ValueError(f"data.env: {spec!r} must be a class with reset() and step(text) methods"
                         + (f" (it has no {' or '.join(missing)})" if missing and isinstance(cls, type) else ""))
    if callable(getattr(cls, "setup", None)):
        try:
            cls.setup(**(env_args or {}))
        except TypeError as e:
            raise ValueError(f"data.env_args: {e}") from None
        except RuntimeError as e:  # the env cannot start here (a sandbox refusing a machine it cannot isolate on)
            raise ValueError(f"data.env: {spec}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        if callable(getattr(cls, "teardown", None)):
            atexit.register(cls.teardown)
    elif env_args:
        raise ValueError(f"data.env_args: {spec} has no setup() to take them")
    return cls


# ----------------------------------------------------------------------------- rendering env messages


def turn_ends(tokenizer):
    """Ids of the chat format's turn-ending tokens (TURN_ENDS) that this tokenizer has as single tokens."""
    vocab = tokenizer.get_vocab()
    return tuple(vocab[t] for t in TURN_ENDS if t in vocab)


def handoff_token(tokenizer):
    """The token a model turn ends with to hand control to a tool (<|observation|>), for supervised traces."""
    vocab = tokenizer.get_vocab()
    if TURN_ENDS[0] not in vocab:
        raise ValueError(f"data.env: the tokenizer has no {TURN_ENDS[0]} token to end a tool-calling turn with")
    return vocab[TURN_ENDS[0]]


def render_messages(tokenizer, messages, tools=None, last=None):
    """The ids that env messages add to a conversation, then the generation prompt for the next model
    turn: the render of BASE + messages minus the render of BASE. `last`: the token the model's turn
    ended with; the added ids do not repeat it (GLM's observation starts with <|observation|>)."""
    kw = {"tools": tools} if tools else {}
    base = chat_ids(tokenizer.apply_chat_template(BASE, tokenize=True, **kw))
    full = chat_ids(tokenizer.apply_chat_template(BASE + list(messages), tokenize=True, add_generation_prompt=True, **kw))
    if full[:len(base)] != base:
        raise ValueError(f"the chat template of {getattr(tokenizer, 'name_or_path', '') or 'the tokenizer'} does not "
                         "extend its own prefix (a conversation rendered with more messages does not start with its "
                         "render without them), so env messages cannot be appended to a trajectory")
    delta = full[len(base):]
    return delta[1:] if delta and last is not None and delta[0] == last else delta


# ----------------------------------------------------------------------------- one trajectory


@dataclass
class Limits:
    max_new_tokens: int  # per model turn
    max_total_tokens: int  # after the prompt: model and env tokens together
    max_turns: int  # model turns
    max_env_chars: int = 4096  # each env message's content is cut to this many characters
    timeout_s: float = 60.0  # each call into the env (or the reward hook)
    max_prompt_tokens: int | None = None  # a longer opening fails its episode (it would be cut mid-question)
    admit_after: int | None = 0  # engine iterations until an env answer is admitted (None: when it arrives)


def limits_of(rollout, per_turn) -> Limits:
    """The episodes' limits from the config's rollout section; per_turn: max_new_tokens (eval: eval_max_new_tokens)."""
    return Limits(per_turn, rollout.max_total_tokens or per_turn, rollout.max_turns, rollout.max_env_chars,
                  rollout.env_timeout_s, rollout.max_prompt_tokens, rollout.env_admit_after)


@dataclass
class Episode:
    """One trajectory: its tokens, which of them the model sampled, and what the env said."""
    example: dict
    index: int  # the example's index among the run's examples (warnings and the dump name it)
    prompt: list[int] = field(default_factory=list)
    response: list[int] = field(default_factory=list)  # every token after the prompt, model and env, in order
    spans: list[tuple[int, int]] = field(default_factory=list)  # (start, length) of each model turn in response
    logprobs: list[float] = field(default_factory=list)  # the generator's logprob of each model token, in order
    routes: object = None  # MoE: the experts each position took in the generator, [positions, n_moe, k] (engine.Completion)
    reward: float = 0.0
    finish: str | None = None  # "stop" (env done), "length" (a limit), "void", "failed", "cancelled"
    failure: str | None = None  # why the env failed: the trajectory is dropped
    error: BaseException | None = None  # ... and the exception, for its traceback
    versions: list | None = None  # [oldest, newest] weight version of its model tokens
    turns: int = 0
    tool_calls: int = 0
    tool_io: list = field(default_factory=list)
    env_s: float = 0.0  # seconds spent in env calls
    env: object = None
    close_failure: str | None = None  # why its env's close() failed (the trajectory stands: close runs after it)

    @property
    def model_tokens(self):
        return len(self.logprobs)


class _Task:
    """One call on POOL: fn(*args), `what` it is ("MyEnv.step": its kind, for _Pool's outage) and its deadline."""
    def __init__(self, fn, args, what, timeout):
        self.fn, self.args, self.what, self.timeout, self.started, self.result = fn, args, what, timeout, None, None
        self.submitted, self.done, self.lock = time.perf_counter(), threading.Event(), threading.Lock()
        self.abandoned = False  # written off: its thread leaves the pool when the call returns

    def run(self, pool):
        with self.lock:  # a task given up on while it waited for a thread never starts, nor one past its deadline
            if self.done.is_set():
                return
            if pool.is_down(self.what) and time.perf_counter() >= self.submitted + self.timeout / 10:
                self.result = (False, pool.down_error(self), 0.0)  # (a probe that came too late: no thread spent)
            else:
                self.started = time.perf_counter()
        if self.started is not None:
            try:
                self.result = (True, self.fn(*self.args), time.perf_counter() - self.started)
            except BaseException as e:  # noqa: BLE001 (the env's own bug is data here)
                self.result = (False, e, time.perf_counter() - self.started)
        self.done.set()
        ANSWERED.set()

    def give_up(self, error):
        """End a task that has not started (no thread runs it): False if a thread started it meanwhile."""
        with self.lock:
            if self.started is not None or self.done.is_set():
                return self.done.is_set()
            self.result = (False, error, 0.0)
            self.done.set()
            return True


class EnvDown(TooManyFailures):
    """More calls written off and still running than a run may lose (_Pool's max_lost): the env is down, the run
    stops (one line: rollout.py and checkpoint.run_main take it as the TooManyFailures it is)."""


class _Pool:
    """Daemon threads that run env calls, so that many trajectories' tools run at once and a cheap call (a
    reward) costs no thread start. A call that misses its deadline keeps its thread (a thread cannot be
    killed): that thread is written off, leaves the pool if the call ever returns, and a new one replaces it
    at once. A kind of call (what: "MyEnv.step"; __init__, reset and close are kinds of their own) is down (a
    backend that died) once one of its calls timed out with none of its kind answering over its whole
    deadline: waiting out each later call's deadline would cost env_timeout_s per call (per engine iteration,
    in _play), so until a call of that kind answers again, each gets a tenth of it from its submission, and
    one still queued then never starts (a probe: an env that is back answers, and ends the outage; the calls
    written off still run, and may too). One slow call among answering ones never trips it, and a batch's
    __init__ and reset calls that answer do not end an outage of its step.
    At most max_lost written-off calls may hold their threads at once (the threads a run can lose, beside the
    pool's own `size`): the next write-off stops the run (EnvDown), so an env that never returns leaves at most
    size + max_lost threads, however many calls it is sent."""

    def __init__(self, size, max_lost):
        self.size, self.max_lost, self.tasks, self.lock = size, max_lost, queue.SimpleQueue(), threading.Lock()
        self.live, self.lost = 0, 0  # threads taking calls; threads written off whose call still runs
        self.timed_out, self.down = {}, set()  # kind -> its calls timed out since one answered; the kinds down
        self.answered = {}  # kind -> when its latest call answered (returned or raised, in time or not)

    @property
    def timeouts(self):
        """Calls timed out since a call of their kind answered (0: every kind answers)."""
        return sum(self.timed_out.values())

    def submit(self, fn, args, what, timeout):
        if self.spent():
            raise self.spent_error(what, timeout)
        task = _Task(fn, args, what, timeout)
        self.tasks.put(task)
        self._fill()
        return task

    def _fill(self):
        with self.lock:
            while self.live < self.size and self.lost <= self.max_lost:
                self.live += 1
                threading.Thread(target=self._work, daemon=True, name="env-call").start()

    def is_down(self, what):
        return what in self.down

    def spent(self):
        return self.lost > self.max_lost

    def down_error(self, task):
        n = self.timed_out.get(task.what, 0)
        return TimeoutError(f"no answer in {task.timeout / 10:g} s while {task.what} is down ({n} of its calls timed out, "
                            "none answering)")

    def spent_error(self, what, timeout):
        return EnvDown(f"the env is down: {self.lost} calls that missed their deadline (rollout.env_timeout_s={timeout:g}) "
                       f"still hold a thread each, over the {self.max_lost} a run may lose (the latest: {what})")

    def write_off(self, task):
        """Give up on a started call past its deadline: False if it answered meanwhile (nothing to write off)."""
        with self.lock:
            if task.done.is_set():
                return False
            task.abandoned = True
            self.lost, self.live = self.lost + 1, self.live - 1  # its thread is stuck: another takes its place now
            self.timed_out[task.what] = self.timed_out.get(task.what, 0) + 1
            if self.answered.get(task.what, -math.inf) < task.started:  # none of its kind answered while it ran
                self.down.add(task.what)
        self._fill()  # (not past max_lost: then the caller raises EnvDown, and no thread takes its place)
        return True

    def _work(self):
        while True:
            task = self.tasks.get()
            task.run(self)
            with self.lock:
                if task.started is not None:  # it answered (not one given up on before it started)
                    self.answered[task.what] = time.perf_counter()
                    self.timed_out.pop(task.what, None)
                    self.down.discard(task.what)
                if task.abandoned:
                    self.lost -= 1
                    return


# 64 threads run calls at once; 4 x 64 more may be lost to calls that never return before the run stops (EnvDown)
POOL = _Pool(64, max_lost=256)
ANSWERED = threading.Event()  # set whenever a call on POOL returns: the episode loop waits on it when idle


def guarded(calls, timeout):
    """Run calls, [(episode, what, fn, args)], all at once on POOL's threads (a tool's latency overlaps the
    others'), each with a deadline from its start (sooner while its kind is down: _Pool). Returns [(True, result)
    or (False, None)], a call that raised, or missed its deadline, marking its episode failed."""
    tasks = [POOL.submit(fn, args, what, timeout) for _, what, fn, args in calls]
    return [outcome(ep, what, task) for (ep, what, _, _), task in zip(calls, tasks)]


def outcome(ep, what, task, wait=True):
    """A call's outcome, once it has one: (True, result), or (False, None) if it raised or missed its deadline
    (its episode is marked failed); None if it is still running and wait is False."""
    result = _result(task, wait)
    if result is None:
        return None
    ok, value, secs = result
    ep.env_s += secs
    return (True, value) if ok else _fail(ep, what, value)


def _result(task, wait=True):
    """(True, value, seconds) or (False, exception, seconds) once the call ended, raised or missed its deadline:
    task.timeout from its start, or while its kind is down a tenth of it from its submission (_Pool); None if it
    is still running (or queued) and wait is False. EnvDown once more calls are written off than a run may lose."""
    while not task.done.is_set():
        if POOL.spent():  # (no thread may be left to run a queued call)
            raise POOL.spent_error(task.what, task.timeout)
        now, down = time.perf_counter(), POOL.is_down(task.what)
        deadline = task.submitted + task.timeout / 10 if down else (task.started or math.inf) + task.timeout
        if now >= deadline:
            error = POOL.down_error(task) if down else \
                TimeoutError(f"no answer in {task.timeout:g} s (rollout.env_timeout_s)")
            if task.give_up(error) or not POOL.write_off(task):  # still queued: it never starts; or it just answered
                break
            if POOL.spent():
                raise POOL.spent_error(task.what, task.timeout)
            return False, error, now - task.started
        if not wait:
            return None
        task.done.wait(min(0.05, deadline - now))
    return task.result


def _why(what, e):
    return f"{what} raised {type(e).__name__}: {' '.join(str(e).split())[:300]}"


def _fail(ep, what, e):
    ep.failure = ep.failure or _why(what, e)
    ep.error = ep.error or e
    ep.finish = ep.finish or "failed"
    return False, None


def _cap(messages, chars):
    """Env messages with each content cut to `chars` characters (a tool's output can be megabytes)."""
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                          for m in messages):
        raise TypeError(f"step() must return a list of {{'role': ..., 'content': str}} messages, got {messages!r:.200}")
    return [m | {"content": m["content"][:chars]} if len(m["content"]) > chars else m for m in messages]


def start(eps, env_cls, tokenizer, limits: Limits, chat_template=True):
    """Make each episode's env (env_cls(example)) and render its prompt (reset()). Failures mark episodes."""
    name = env_cls.__name__
    if getattr(env_cls, "trusted", False):  # rollout.SingleTurn: no user code before step()
        for ep in eps:
            ep.env = env_cls(ep.example)
        openings = [(True, ep.env.reset()) for ep in eps]
    else:
        made = guarded([(ep, f"{name}.__init__", env_cls, (ep.example,)) for ep in eps], limits.timeout_s)
        for ep, (ok, env) in zip(eps, made):
            ep.env = env if ok else None
        eps = [ep for ep in eps if ep.env is not None]
        openings = guarded([(ep, f"{name}.reset", ep.env.reset, ()) for ep in eps], limits.timeout_s)
    for ep, (ok, opening) in zip(eps, openings):
        if not ok:
            continue
        try:
            ep.prompt = render_prompt(tokenizer, opening, chat_template, tools=getattr(ep.env, "tools", None))
        except (TypeError, ValueError, KeyError) as e:
            _fail(ep, f"{name}.reset (rendering its messages)", e)
            continue
        if limits.max_prompt_tokens is not None and len(ep.prompt) > limits.max_prompt_tokens:
            _fail(ep, f"{name}.reset", ValueError(f"its prompt has {len(ep.prompt)} tokens, over "
                                                  f"rollout.max_prompt_tokens={limits.max_prompt_tokens}"))


def openings(env_cls, examples, tokenizer, chat_template, timeout):
    """The prompt ids each example's episode starts from (start-up checks every prompt's length), each call with
    the run's deadline (timeout: rollout.env_timeout_s); an env that fails here is one ValueError line naming it
    and the example."""
    eps, limits = [Episode(ex, -1) for ex in examples], Limits(1, 1, 1, timeout_s=timeout)
    start(eps, env_cls, tokenizer, limits, chat_template)
    close(eps, env_cls.__name__, limits)
    bad = next((ep for ep in eps if ep.failure is not None), None)
    if bad is not None:
        raise ValueError(f"data.env: {bad.failure} (example {json.dumps(bad.example)[:80]})")
    return [ep.prompt for ep in eps]


def model_turn(ep: Episode, c: Completion):
    """Append one model turn (an engine Completion): its tokens as sampled, with their logprobs (and, MoE, the
    routes of its context: extend_routes keeps the ones earlier turns recorded)."""
    tokens, versions = c.token_ids, c.versions
    ep.spans.append((len(ep.response), len(tokens)))
    ep.response += tokens
    ep.logprobs += c.logprobs
    ep.routes = extend_routes(ep.routes, c.routes)
    ep.turns += 1
    lo, hi = versions
    ep.versions = [lo, hi] if ep.versions is None else [min(ep.versions[0], lo), max(ep.versions[1], hi)]


def env_turns(turns, tokenizer, limits: Limits, name):
    """The env's answers to the model turns just appended, [(episode, its decoded text, cut: it hit
    max_new_tokens)], all at once. Each episode ends (finish) or gets the env's rendered messages."""
    results = guarded([(ep, f"{name}.step", ep.env.step, (text,)) for ep, text, _ in turns], limits.timeout_s)
    for (ep, _, cut), (ok, out) in zip(turns, results):
        if ok:
            _answer(ep, out, cut, tokenizer, limits, name)


def _scalar(x):
    """A numpy or torch scalar's Python value; anything else (an array of several values too) as it is."""
    if not isinstance(x, (bool, int, float)) and callable(getattr(x, "item", None)):
        try:
            return x.item()
        except (ValueError, RuntimeError):  # several values: the checks fail it
            return x
    return x


# The largest |reward| a trajectory may have. The learner's arithmetic is float32 (max 3.4e38) and the loss squares
# what a reward scales: with grpo.std_normalize false (Dr.GRPO: an advantage is the reward minus its group's mean)
# the gradient norm (clip_grad_norm: a plain sum of squares over every weight) is inf at a 1e20 reward and the step
# is skipped; at 1e38 a group's sum is inf (grpo.group_advantages: NaN advantages, the step skipped); 1e39 is inf in
# float32 itself. Within 1e6 an advantage is at most 2e6, its square 4e12: a group's sum, mean and std stay finite,
# the gradient keeps 1e25 of float32's range for the rest (activations, ratios, the weight count), and every integer
# reward is exact in float32 (below 2^24). A grader past it is a bug (a count, an unscaled score): scale it down.
REWARD_LIMIT = 1e6


def reward_value(x):
    """The reward as a float: a real number (numpy and torch scalars too), finite and within REWARD_LIMIT. A NaN
    would make its whole group's advantages NaN and the step be skipped, and so would a reward float32 cannot
    carry through the loss (REWARD_LIMIT); a string is not a score."""
    x = _scalar(x)
    if not isinstance(x, numbers.Real) or not math.isfinite(x):
        raise ValueError(f"the reward must be a finite number, got {x!r:.100}")
    if not -REWARD_LIMIT <= x <= REWARD_LIMIT:
        raise ValueError(f"the reward must be within +-{REWARD_LIMIT:g} (machinery/env.py REWARD_LIMIT: the learner's "
                         f"float32 loss cannot take more), got {x!r:.100}")
    return float(x)


def _flag(x):
    """done as a bool: a bool, 0 or 1, or a numpy or torch scalar of one."""
    x = _scalar(x)
    if not (isinstance(x, bool) or isinstance(x, numbers.Integral) and x in (0, 1)):
        raise TypeError(f"step()'s done must be a bool, got {x!r:.100}")
    return bool(x)


def _answer(ep: Episode, out, cut, tokenizer, limits: Limits, name):
    try:  # a return that breaks the contract fails its trajectory, whatever it breaks with
        if not (isinstance(out, tuple) and len(out) in (3, 4)):
            raise TypeError(f"step() must return (messages, reward, done) or (..., info), got {out!r:.200}")
        messages, reward, done, info = out if len(out) == 4 else (*out, {})
        info = {} if info is None else info
        if not isinstance(info, dict):
            raise TypeError(f"step()'s info must be a dict, got {info!r:.200}")
        reward, done = reward_value(reward), _flag(done)
        tool_calls, tool_io = int(info.get("tool_calls", 0)), list(info.get("tool_io", ()))
        messages = _cap(messages, limits.max_env_chars)
    except Exception as e:  # noqa: BLE001 (the env's bug is data here)
        _fail(ep, f"{name}.step", e)
        return
    ep.reward, ep.tool_calls, ep.tool_io = reward, ep.tool_calls + tool_calls, ep.tool_io + tool_io
    if info.get("void"):
        ep.finish = "void"
    elif cut:
        ep.finish = "length"
    elif done:
        ep.finish = "stop"
    elif ep.turns >= limits.max_turns:
        ep.finish = "length"
    else:
        try:
            delta = render_messages(tokenizer, messages, getattr(ep.env, "tools", None), ep.response[-1])
        except Exception as e:  # noqa: BLE001 (the env's messages may not render: its failure)
            _fail(ep, f"{name}.step (rendering its messages)", e)
            return
        if len(ep.response) + len(delta) >= limits.max_total_tokens:
            ep.finish = "length"  # no room left for another model turn
        else:
            ep.response += delta


def close(eps, name, limits: Limits):
    """env.close(), once, for every episode that made an env (finished, cut, failed or cancelled). It runs after the
    trajectories ended, so a close that raises or times out changes none of them (their rewards stand): it is
    recorded on its own (Episode.close_failure, rollout/env_close_failures) with one warning line per call here.
    Returns how many failed (EnvDown, the run's stop, if the env is down for good: _Pool)."""
    todo = [ep for ep in eps if ep.env is not None and callable(getattr(ep.env, "close", None))]
    envs = [ep.env for ep in todo]
    for ep in eps:
        ep.env = None
    tasks = [POOL.submit(env.close, (), f"{name}.close", limits.timeout_s) for env in envs]
    failed = 0
    for ep, task in zip(todo, tasks):
        ok, value, secs = _result(task)
        ep.env_s += secs
        if not ok:
            ep.close_failure = _why(f"{name}.close", value)
            failed += 1
    if failed:
        first = next(ep for ep in todo if ep.close_failure)
        print(f"[env] {failed} of {len(todo)} {name}.close calls failed (their trajectories stand); the first, "
              f"example {first.index}: {first.close_failure}", flush=True)
    return failed


# ----------------------------------------------------------------------------- the episode loop


def run_episodes(engine, episodes, env_cls, tokenizer, sampling: SamplingParams, limits: Limits, seed, *,
                 chat_template=True, stopping=lambda: False, each=False):
    """Play the episodes to their end and yield (index, episode) as each one ends (finished, cut, void
    or failed); closing this generator early cancels the rest (their envs are closed, finish
    "cancelled"). sampling: a turn's SamplingParams (its stop ids, the chat format's turn ends included).

    On an engine with sessions (engine.session: TorchEngine, SGLangEngine) every trajectory lives in one
    running call (_play): a turn that ends goes to its env on POOL's threads while the engine decodes the
    others, and the env's answer comes back as the trajectory's next turn, which extends its parked KV.
    limits.admit_after: when an answer is admitted, in engine iterations after its turn ended
    (rollout.env_admit_after): a number makes runs reproducible (the loop waits for a later answer), None admits
    each answer as soon as it is there (timing then decides which rows run together). On an engine without
    sessions, turns run in lockstep (_lockstep; each=True: the env answers each turn as it arrives)."""
    name = env_cls.__name__
    try:
        start(episodes, env_cls, tokenizer, limits, chat_template)
        for i, ep in enumerate(episodes):
            if ep.finish is not None:
                yield i, ep
        live = [i for i, ep in enumerate(episodes) if ep.finish is None]
        if live and hasattr(engine, "session"):
            last = 1 if getattr(env_cls, "one_turn", False) else limits.max_turns  # the turn after which nothing follows
            yield from _play(engine, episodes, live, name, tokenizer, sampling, limits, seed, stopping, last)
        elif live:
            yield from _lockstep(engine, episodes, live, name, tokenizer, sampling, limits, seed, stopping, each)
    finally:
        for ep in episodes:
            if ep.finish is None:
                ep.finish = "cancelled"
        close(episodes, name, limits)


def _seeds(seed, n, turn, redo=0):
    """The noise seeds of turn `turn` of n episodes (redo: an aborted turn generated again)."""
    return request_seeds(seed + turn * TURN_SEED + 7 * redo, n)


def _play(engine, episodes, live, name, tokenizer, sampling, limits, seed, stopping, last_turn):
    """The episode loop on one engine session. Each pass runs one engine iteration, sends the turns that
    ended in it to their envs (all at once, on POOL), then admits the env answers that are due (see
    run_episodes): an episode that ends is yielded and its KV freed, one that goes on is submitted again,
    its context its whole trajectory (the engine runs only the tokens its parked KV lacks). When the engine
    has nothing to run it waits for the next answer (or, with admit_after, skips to its iteration). A turn that
    may be followed by another (before last_turn) parks its KV when it ends; the last one frees it at once."""
    longest, admit_after = max(len(episodes[i].prompt) for i in live) + limits.max_total_tokens, limits.admit_after
    owner, pending, it, seeds = {}, [], 0, {}  # request -> (episode, turn, redo); env calls in launch order

    def submit(i, redo=0):
        ep = episodes[i]
        t = ep.turns
        if (t, redo) not in seeds:
            seeds[t, redo] = _seeds(seed, len(episodes), t, redo)
        max_new = min(limits.max_new_tokens, limits.max_total_tokens - len(ep.response))
        key = i if last_turn > 1 else None  # (single-turn: nothing to extend, nothing to park)
        j = call.submit(ep.prompt + ep.response, max_new, seeds[t, redo][i], key=key, park=t + 1 < last_turn)
        owner[j] = (i, redo)

    with engine.session(sampling, longest, limits.max_new_tokens) as call:
        for i in live:
            submit(i)
        try:
            while (call.busy or pending) and not stopping():
                done = call.step()
                it += 1
                for j, c in done:
                    i, redo = owner.pop(j)
                    if c.finish_reason == "abort":  # SGLang's update without partial rollouts, or a stop: again
                        if not stopping():
                            submit(i, redo + 1)
                        continue
                    ep = episodes[i]
                    model_turn(ep, c)
                    text = tokenizer.decode(c.token_ids, skip_special_tokens=True)
                    task = POOL.submit(ep.env.step, (text,), f"{name}.step", limits.timeout_s)
                    pending.append((it + (admit_after or 0), i, task, c.finish_reason == "length"))
                if admit_after is not None and pending and not call.busy:
                    it = max(it, pending[0][0])  # nothing to decode: on to the next answer's iteration
                ANSWERED.clear()  # (before looking: an answer that comes after the look sets it again)
                taken = set()
                for k, (due, i, task, cut) in enumerate(pending):  # launch order: the same order on every run
                    if admit_after is not None and due > it:
                        break
                    out = outcome(episodes[i], f"{name}.step", task, wait=admit_after is not None)
                    if out is None:
                        continue
                    taken.add(k)
                    if out[0]:
                        _answer(episodes[i], out[1], cut, tokenizer, limits, name)
                    if episodes[i].finish is not None:
                        call.end(i)
                        yield i, episodes[i]
                    else:
                        submit(i)
                pending = [e for k, e in enumerate(pending) if k not in taken]
                if pending and not taken and not call.busy:  # idle until an env answers (or a deadline nears)
                    ANSWERED.wait(0.05)
        finally:  # cancelled: let the env calls in flight end (or time out) before close() runs beside them; the
            for _, i, task, _ in pending:  # queued ones never start
                if not task.give_up(RuntimeError("cancelled")):
                    task.done.wait(max(0.0, task.started + limits.timeout_s - time.perf_counter()))


def _lockstep(engine, episodes, live, name, tokenizer, sampling, limits, seed, stopping, each):
    """The episode loop on an engine without sessions, turn by turn: every live episode's next model turn
    goes into one engine call (the history prefilled again), then the env answers all of them at once, or
    (each=True: dynamic sampling wants to stop as soon as it has enough) each one as it arrives. Turn t's
    call uses seed + t * TURN_SEED (aborted completions are generated again with seed + 7)."""
    turn = 0
    while live and not stopping():
        per = [replace(sampling, max_new_tokens=min(limits.max_new_tokens,
                                                    limits.max_total_tokens - len(episodes[i].response)))
               for i in live]
        calls = generate(engine, [episodes[i].prompt + episodes[i].response for i in live], per,
                          seed + turn * TURN_SEED, stopping)
        with contextlib.closing(calls):  # closed early: the engine's call is cancelled at once
            for part in calls if each else ([c for part in calls for c in part],):
                if stopping():  # the batch is being thrown away: no more env calls for it
                    break
                for j, c in part:
                    model_turn(episodes[live[j]], c)
                env_turns([(episodes[live[j]], tokenizer.decode(c.token_ids, skip_special_tokens=True),
                            c.finish_reason == "length") for j, c in part], tokenizer, limits, name)
                for j, _ in part:
                    if episodes[live[j]].finish is not None:
                        yield live[j], episodes[live[j]]
        live, turn = [i for i in live if episodes[i].finish is None], turn + 1


def generate(engine, prompts, per, seed, stopping):
    """One engine call for every prompt (one turn each; per: their SamplingParams). Yields the completions that
    finished together, as lists of (index, Completion): each engine iteration's (an engine with a session: TorchEngine,
    SGLang), each one (an engine that only streams), or all of them at the end (an engine with generate alone).
    Aborted completions (a stop, or SGLang's update without partial rollouts) are generated again until none is
    left, unless the generator is stopping. Request i samples with request_seeds(seed, len(prompts))[i]; the aborted
    ones again in one more call, with request_seeds(seed + 7, how many are left)."""
    if hasattr(engine, "session"):
        parts = _session_parts(engine, prompts, per, seed)
    elif hasattr(engine, "stream"):
        parts = _one_by_one(engine.stream(prompts, per, seed=seed))
    else:
        parts = iter([list(enumerate(engine.generate(prompts, per, seed=seed)))])
    redo = []
    try:
        for part in parts:
            redo += [i for i, c in part if c.finish_reason == "abort"]
            if done := [(i, c) for i, c in part if c.finish_reason != "abort"]:
                yield done
    finally:
        if hasattr(parts, "close"):
            parts.close()
    while redo and not stopping():
        again = list(zip(redo, engine.generate([prompts[i] for i in redo], [per[i] for i in redo], seed=seed + 7)))
        redo = [i for i, c in again if c.finish_reason == "abort"]
        if done := [(i, c) for i, c in again if c.finish_reason != "abort"]:
            yield done


def _session_parts(engine, prompts, per, seed):
    """The requests of one call submitted to a session at once (as TorchEngine.stream does), and each iteration's
    finished ones yielded together."""
    longest = max(len(p) + s.max_new_tokens for p, s in zip(prompts, per))
    with engine.session(per[0], longest, max(s.max_new_tokens for s in per)) as call:
        for p, s, sd in zip(prompts, per, request_seeds(seed, len(prompts))):
            call.submit(p, s.max_new_tokens, sd, park=False)
        while call.busy:
            if done := call.step():
                yield done


def _one_by_one(stream):
    try:
        for item in stream:
            yield [item]
    finally:
        stream.close()


def report_failures(failures, total, batch, max_fraction, run_dir, rank, seen, max_warnings):
    """A rollout batch's failed trajectories (Episodes with a failure) out of `total`, as data: a warning line each
    (at most max_warnings), the first traceback of each kind in run_dir/env_failures/ (run_dir None: none; kinds in
    `seen`, a set the caller keeps across batches), and TooManyFailures, one line, if more than max_fraction of the
    batch failed."""
    for ep in failures[:max_warnings]:
        print(f"[rollout] env failure on example {ep.index} (batch {batch}): {ep.failure}", flush=True)
    if len(failures) > max_warnings:
        print(f"[rollout] ... and {len(failures) - max_warnings} more env failures in batch {batch}", flush=True)
    for ep in failures:
        kind = re.sub(r"\W+", "_", ep.failure.split(":")[0])
        if run_dir is not None and kind not in seen:
            seen.add(kind)
            folder = os.path.join(run_dir, "env_failures")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"{kind}" + (f"_rank{rank}" if rank else "") + ".txt"), "w") as f:
                f.write(f"example {ep.index}, batch {batch}: {ep.failure}\n\n")
                f.write("".join(traceback.format_exception(ep.error)))
    if total and len(failures) / total > max_fraction:
        raise TooManyFailures(f"{len(failures)} of {total} trajectories of rollout batch {batch} failed in the env "
                              f"(over rollout.max_failure_fraction={max_fraction}); the first: {failures[0].failure}")


# ----------------------------------------------------------------------------- supervised traces


def traces(env_cls, examples, turns, tokenizer, limits: Limits, stop_id, eos_id, chat_template=True):
    """The tokens of scripted trajectories (a supervised warm-up on tool traces), all played at once: turns[k]
    are example k's model turns, as text; each is encoded and ends with stop_id while more follow, else
    eos_id, and the env's answers are rendered as in RL. Returns the Episodes (a failure set where the env
    failed, or went on past the script)."""
    eps, name = [Episode(ex, k) for k, ex in enumerate(examples)], env_cls.__name__
    start(eps, env_cls, tokenizer, limits, chat_template)
    try:
        live, k = [ep for ep in eps if ep.finish is None], 0
        while live:
            for ep in live:
                if k == len(turns[ep.index]):
                    _fail(ep, f"{name}.step", ValueError(f"the env goes on after the trace's {k} turns"))
            live = [ep for ep in live if ep.finish is None]
            for ep in live:
                text, last = turns[ep.index][k], k == len(turns[ep.index]) - 1
                ids = list(tokenizer.encode(text, add_special_tokens=False))
                model_turn(ep, Completion(ids + [eos_id if last else stop_id], [0.0] * (len(ids) + 1), "stop", (0, 0)))
            env_turns([(ep, turns[ep.index][k], False) for ep in live], tokenizer, limits, name)
            live, k = [ep for ep in live if ep.finish is None], k + 1
    finally:
        close(eps, name, limits)
    return eps


# ----------------------------------------------------------------------------- the demo's env


class Calculator:
    """The tool demo's env (configs/tiny_tool_cpu.yaml): a calculator for multiplication problems the tiny
    model cannot do in its head. A turn that writes calc(<expression>) gets the value back as an
    observation; a turn with a \\boxed{} answer ends the episode, graded against the label; a turn with
    neither is void. example["tools"] false: no calculator (a call gets an error message)."""
    tools = [{"type": "function", "function": {"name": "calc", "description": "evaluate an arithmetic expression",
                                               "parameters": {"type": "object",
                                                              "properties": {"expression": {"type": "string"}}}}}]
    CALL = re.compile(r"calc\(([0-9+\-*/() ]{1,40})\)")

    def __init__(self, example):
        self.example = example
        if not example.get("tools", True):
            self.tools = []

    def reset(self):
        return [{"role": "user", "content": self.example["prompt"]}]

    def step(self, text):
        if "\\boxed" in text:
            return [], math_reward(text, self.example), True
        call = self.CALL.search(text)
        if call is None:
            return [], 0.0, True, {"void": True}
        expr = call.group(1)
        out = calculate(expr) if self.tools else "error: no calculator"
        return [{"role": "observation", "content": out}], 0.0, False, {"tool_calls": 1, "tool_io": [[expr, out]]}


def calculate(expr):
    """An arithmetic expression of integers, + - * / and brackets, evaluated without eval() (Python's parser,
    then only those operations): the value as text, or an error message for the model to read."""
    try:
        value = _value(ast.parse(expr, mode="eval").body) if len(expr) <= 200 else None
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, RecursionError):
        value = None
    if value is None:
        return "error: bad expression"
    return str(int(value)) if value == int(value) else f"{value:.6g}"


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _value(node):
    if isinstance(node, ast.Constant) and type(node.value) is int and node.value < 10**12:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        value = _OPS[type(node.op)](_value(node.left), _value(node.right))
        if abs(value) <= 10**30:  # no astronomically large numbers
            return value
    raise ValueError


def dump_record(ep: Episode, tokenizer):
    """One trajectory as the rollout dump writes it (a JSON-ready dict): the text of each turn, which is the
    model's and which the env's, the tool inputs and outputs, the reward and how it ended."""
    turns, at = [], 0
    for start_, n in ep.spans + [(len(ep.response), 0)]:
        if start_ > at:
            turns.append({"role": "env", "text": tokenizer.decode(ep.response[at:start_]), "tokens": start_ - at})
        if n:
            turns.append({"role": "model", "text": tokenizer.decode(ep.response[start_:start_ + n]), "tokens": n})
        at = start_ + n
    return {"example": ep.index, "prompt": tokenizer.decode(ep.prompt), "turns": turns, "tool_io": ep.tool_io,
            "reward": ep.reward, "finish": ep.finish, "versions": ep.versions, "failure": ep.failure,
            "label": json.loads(json.dumps(ep.example.get("label"), default=str))}
