"""rollout.py: the generator thread's staleness gate, weights between batches, dynamic sampling and
over-sampling, truncated responses, error surfacing and shutdown; eval's accuracy and pass@k."""
import math
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import rollout
from data import PromptStream, make_tiny_tokenizer
from machinery.engine import SamplingParams, TorchEngine, sample_tokens
from model import GLM, GLMConfig
from machinery.config import RolloutConfig
from machinery import env
from machinery.env import Calculator, Limits
from rollout import Generator, evaluate, single_turn
from test_engine import keys, slow


def make_generator(max_staleness, reward_fn=None, dynamic=False, n=2, engine=None):
    tok = make_tiny_tokenizer()
    examples = [{"prompt": f"{a}+1=", "label": str(a + 1)} for a in range(10)]
    engine = engine or TorchEngine(tiny_model_for(tok))
    return Generator(engine, PromptStream(examples, seed=0), tok, rollout_cfg(max_staleness, n=n, dynamic_sampling=dynamic),
                     SamplingParams(max_new_tokens=4, stop_token_ids=(tok.eos_token_id,)),
                     env_cls=single_turn(reward_fn or (lambda text, example: 0.0)))


def rollout_cfg(max_staleness, **kw):
    """The rollout section these tests run with: one turn of 4 tokens, groups of 2, no over-sampling."""
    return RolloutConfig(**{"prompts_per_step": 2, "n": 2, "max_staleness": max_staleness, "dynamic_sampling": False,
                            "oversample": 0.0, "chat_template": True, "max_prompt_tokens": 32, "max_new_tokens": 4,
                            "truncated": "keep", "dump_fraction": 0.0} | kw)


def tiny_model_for(tok):
    torch.manual_seed(0)
    return GLM(GLMConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=8))


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_weights_land_between_batches(staleness):
    """Without partial rollouts, publish(v) waits until batch v + staleness - 1 is done: batch i is sampled
    wholly by version i - staleness (never a mix), whatever the timing; pending() lists what a checkpoint
    must keep, and a Generator built with those batches hands them out first."""
    gen = make_generator(staleness)
    gen.start()
    try:
        for step in range(4):
            batch = gen.get(timeout=30)
            assert {s.versions for s in batch.samples} == {(max(0, step - staleness),) * 2}, step
            gen.publish([], version=step + 1)  # returns only once the batches sampled by older weights are done
            gen.open(step + 1)
            assert gen.next_batch >= step + 1 + staleness
            kept = gen.pending(step + 1)
            assert [b.index for b in kept] == list(range(step + 1, step + 1 + staleness))
    finally:
        gen.stop()
    resumed = make_generator(staleness)
    resumed = Generator(resumed.engine, resumed.stream, resumed.tokenizer, rollout_cfg(staleness), resumed.sampling,
                        env_cls=resumed.env_cls, first_index=4, ready=kept)
    assert resumed.next_batch == 4 + staleness and [resumed.get(timeout=1).index for _ in kept] == [b.index for b in kept]


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_staleness_gate(staleness):
    gen = make_generator(staleness)
    gen.start()
    try:
        for step in range(4):
            batch = gen.get(timeout=30)
            assert batch.index == step
            assert all(step - s.versions[0] <= staleness for s in batch.samples)
            time.sleep(0.2)  # a slow learner: the generator must not run further ahead than allowed
            assert gen.next_batch <= step + 1 + staleness
            gen.publish([], version=step + 1)
            gen.open(step + 1)
    finally:
        gen.stop()
    assert not gen.thread.is_alive()


def test_dynamic_sampling_drops_uniform_groups_and_refills():
    # prompts "0+1=".."9+1=": labels 3 and 5 get all-zero groups, the others one right answer in two
    seen = {}

    def reward(text, example):
        label = example["label"]
        seen[label] = seen.get(label, 0) + 1
        return float(label not in ("3", "5") and seen[label] % 2 == 0)

    gen = make_generator(1, reward_fn=reward, dynamic=True)
    gen.stream.next(1)  # start the stream so that the first draw holds label "3"
    gen.stream.load_state_dict({**gen.stream.state_dict(), "position": gen.stream._order.index(2)})
    gen.start()
    try:
        batch = gen.get(timeout=30)
    finally:
        gen.stop()
    groups = {}
    for s in batch.samples:
        groups.setdefault(s.group, []).append(s.reward)
    assert len(groups) == 2 and all(sorted(r) == [0.0, 1.0] for r in groups.values())
    uniform_drawn = sum(label in ("3", "5") for label in seen)
    assert batch.metrics["rollout/groups_dropped"] == uniform_drawn >= 1


@pytest.mark.parametrize("outcome", [False, True])
def test_a_distillation_teacher_scores_every_batch_and_alone_keeps_every_group(outcome):
    """With a teacher (machinery/teacher.Teacher's interface: score(samples), outcome) the generator hands over
    batches whose every sample was scored, with the teacher's time in perf/teacher_s; distillation alone
    (outcome false) gives every token its own advantage, so dynamic sampling keeps uniform-reward groups (here every
    group: the reward is always 0), while with the outcome advantage too they are redrawn as without a teacher."""
    class Teacher:
        def __init__(self):
            self.outcome, self.scored = outcome, []

        def score(self, samples):
            for s in samples:
                s.teacher_logprobs = [-1.0] * len(s.gen_logprobs)
            self.scored.append(len(samples))
            return 0.25

    teacher = Teacher()
    gen = make_generator(1, dynamic=True)  # reward 0 for everything: every group uniform
    gen = Generator(gen.engine, gen.stream, gen.tokenizer, rollout_cfg(1, dynamic_sampling=True), gen.sampling,
                    env_cls=gen.env_cls, teacher=teacher)
    gen.start()
    try:
        batch = gen.get(timeout=30)
    finally:
        gen.stop()
    assert len(batch.samples) == 4 and teacher.scored[0] == 4  # the batch's samples, each once, before the learner
    assert all(len(s.teacher_logprobs) == len(s.gen_logprobs) for s in batch.samples)
    assert batch.metrics["perf/teacher_s"] == 0.25
    if outcome:  # every round drew uniform groups only: redrawn until the last round, the surplus dropped
        assert batch.metrics["rollout/rounds"] == rollout.MAX_SAMPLING_ROUNDS and batch.metrics["rollout/groups_dropped"] > 0
    else:
        assert batch.metrics["rollout/rounds"] == 1 and batch.metrics["rollout/groups_dropped"] == 0


def test_oversampling_keeps_the_first_informative_groups_in_prompt_order():
    """Dynamic sampling with oversample 1: one round draws twice the prompts it needs and generates them
    all at once; the batch takes the first informative groups in prompt order (whatever order they
    finish in), and the prompts after the last one it took are cancelled."""
    seen = {}

    def reward(text, example):  # labels 3 and 5: all-zero groups; the others one right answer in two
        label = example["label"]
        seen[label] = seen.get(label, 0) + 1
        return float(label not in ("3", "5") and seen[label] % 2 == 0)

    gen = make_generator(0, reward_fn=reward, dynamic=True)  # (0: batch 1 grades nothing before the stop)
    gen.oversample = 1.0
    gen.stream.next(1)
    gen.stream.load_state_dict({**gen.stream.state_dict(), "position": gen.stream._order.index(2)})
    drawn = [str(gen.stream._order[gen.stream._order.index(2) + j] + 1) for j in range(4)]  # labels, in order
    informative = [i for i, label in enumerate(drawn) if label not in ("3", "5")]
    assert drawn[0] == "3" and len(informative) >= 2  # the first prompt's group is uniform
    gen.start()
    try:
        batch = gen.get(timeout=30)
    finally:
        gen.stop()
    labels = [batch.samples[2 * g].example["label"] for g in range(2)]
    assert labels == [drawn[i] for i in informative[:2]]
    m = batch.metrics
    assert m["rollout/rounds"] == 1 and m["rollout/prompts_cancelled"] == 4 - (informative[1] + 1)
    assert m["rollout/groups_dropped"] == informative[1] - 1  # the uniform groups before the last one taken
    # every prompt up to the last one taken was graded; a cancelled one may have been too, when its turn ended in the
    # same engine iteration (the env calls of an iteration start together), but nothing of it trains
    assert set(drawn[:informative[1] + 1]) <= set(seen) <= set(drawn)


def test_oversampling_without_streaming_counts_the_surplus_groups_as_dropped():
    """An engine that cannot stream (SGLang's adapter) finishes every over-sampled prompt: the batch keeps
    the first informative groups in prompt order and the surplus is reported, not lost silently."""
    class NoStream:  # a TorchEngine without stream() or sessions
        def __init__(self, engine):
            self.engine = engine

        def __getattr__(self, name):
            if name in ("stream", "session"):
                raise AttributeError(name)
            return getattr(self.engine, name)

    seen = {}

    def reward(text, example):  # every group informative: one right answer in two
        seen[example["label"]] = seen.get(example["label"], 0) + 1
        return float(seen[example["label"]] % 2 == 0)

    tok = make_tiny_tokenizer()
    # max_staleness 0: batch 1 cannot start (and grade prompts of its own) before the test stops the generator
    gen = make_generator(0, reward_fn=reward, dynamic=True, engine=NoStream(TorchEngine(tiny_model_for(tok))))
    gen.oversample = 1.0
    gen.start()
    try:
        batch = gen.get(timeout=30)
    finally:
        gen.stop()
    m = batch.metrics
    assert len(seen) == 4 and len({s.group for s in batch.samples}) == 2  # 4 drawn and graded, 2 kept
    assert m["rollout/groups_dropped"] == 2 and m["rollout/prompts_cancelled"] == 0


def test_uniform_groups_used_to_top_up_are_not_counted_as_dropped():
    gen = make_generator(1, dynamic=True)  # every reward 0: no informative group in MAX_SAMPLING_ROUNDS draws
    gen.start()
    try:
        batch = gen.get(timeout=30)
    finally:
        gen.stop()
    drawn = rollout.MAX_SAMPLING_ROUNDS * 2  # 2 prompts per step, redrawn in each round
    assert len({s.group for s in batch.samples}) == 2 and batch.metrics["rollout/groups_dropped"] == drawn - 2


def test_generator_error_surfaces_at_once(monkeypatch):
    """A bug in the generator thread (here the engine's) reaches the learner at once, with its cause."""
    gen = make_generator(1)
    monkeypatch.setattr(gen.engine, "session", lambda *a, **k: 1 / 0)
    gen.start()
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="generator thread failed") as e:
        gen.get(timeout=30)
    assert isinstance(e.value.__cause__, ZeroDivisionError) and time.perf_counter() - t0 < 10
    gen.stop()


def test_a_reward_that_raises_is_data_until_too_many_fail(tmp_path, capsys):
    """A reward hook that raises fails its trajectory, not the run: a warning line naming the reward, the example
    and the exception, the first traceback of the kind saved in the run directory; a group keeps training while
    more than half of it is left, else it is dropped; beyond rollout.max_failure_fraction the run stops with one
    line (TooManyFailures, which the learner re-raises as it is)."""
    def flaky(text, example):
        if example["label"] in ("2", "3"):  # a+1= with a = 1, 2: every sample of those prompts fails
            raise ZeroDivisionError("grader exploded")
        return 1.0

    gen = make_generator(0, reward_fn=flaky, n=3)
    gen.run_dir, gen.prompts_per_step = str(tmp_path), 5
    gen.start()
    try:
        batch = gen.get(timeout=30)
    finally:
        gen.stop()
    failed = {s.example["label"] for s in batch.samples} & {"2", "3"}
    assert not failed and batch.metrics["rollout/groups_failed"] >= 1
    assert batch.metrics["rollout/env_failures"] == 3 * batch.metrics["rollout/groups_failed"]
    # the dropped groups' places go to fresh prompts, drawn in a further round
    assert len({s.group for s in batch.samples}) == 5 and batch.metrics["rollout/rounds"] >= 2
    out = capsys.readouterr().out
    assert "env failure on example" in out and "flaky.step raised ZeroDivisionError: grader exploded" in out
    saved = (tmp_path / "env_failures" / "flaky_step_raised_ZeroDivisionError.txt").read_text()
    assert "Traceback" in saved and "grader exploded" in saved
    gen = make_generator(0, reward_fn=lambda text, example: 1 / 0, n=2)  # the first round's 4 fail: no further round
    gen.start()
    try:
        with pytest.raises(rollout.TooManyFailures, match=r"4 of 4 trajectories of rollout batch 0 failed in the env "
                                                          r"\(over rollout.max_failure_fraction=0.5\); the first: <lambda>"):
            gen.get(timeout=30)
    finally:
        gen.stop()


def test_the_single_turn_path_plays_as_the_episode_loop_plays_the_reward_hook():
    """rollout.play_single_turn (the default path: one engine call, each response graded as it finishes) against the
    reference, machinery/env.py's episode loop playing rollout.SingleTurn: the same episodes in the same order,
    token for token (prompts, responses, logprobs, spans, versions), the same rewards, finishes and failures (a
    reward that raises, one that returns NaN), a response cut at max_new_tokens included."""
    tok = make_tiny_tokenizer()
    engine = TorchEngine(tiny_model_for(tok), max_batch=4)  # two waves: completions arrive over several iterations
    examples = [{"prompt": f"{a}*3=", "label": str(3 * a)} for a in range(5)]

    def grade(text, example):
        if example["label"] == "3":
            raise ZeroDivisionError("grader exploded")
        return math.nan if example["label"] == "6" else float(len(text) % 3)

    hook, limits = single_turn(grade), Limits(5, 5, 1, timeout_s=10.0)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=5, stop_token_ids=(tok.eos_token_id,))
    played = []
    for play in (rollout.play_single_turn, env.run_episodes):
        eps = [env.Episode(ex, i) for i, ex in enumerate(examples) for _ in range(3)]
        order = [i for i, _ in play(engine, eps, hook, tok, sampling, limits, seed=11, chat_template=True)]
        played.append((order, [(ep.prompt, ep.response, ep.logprobs, ep.spans, ep.versions, ep.turns, ep.reward,
                                ep.finish, ep.failure) for ep in eps]))
    assert played[0] == played[1]
    finishes = {f for _, _, _, _, _, _, _, f, _ in played[0][1]}
    failures = [why for *_, why in played[0][1] if why]
    assert {"length", "failed"} <= finishes and len(failures) == 6
    assert any("ZeroDivisionError" in w for w in failures) and any("finite number" in w for w in failures)


def test_a_reward_that_hangs_fails_its_trajectory_at_the_deadline():
    """The reward call runs with a deadline (rollout.env_timeout_s): a reward that never returns fails only its
    trajectory (its group, which loses all 3, is replaced in a further round), and the batch is made from the rest."""
    release = threading.Event()

    def stuck_on_two(text, example):
        if example["label"] == "2":
            release.wait(30)  # hangs (until the test ends)
        return 1.0

    gen = make_generator(0, reward_fn=stuck_on_two, n=3)
    gen.prompts_per_step, gen.limits = 4, replace(gen.limits, timeout_s=0.5)
    gen.start()
    try:
        batch = gen.get(timeout=30)  # (a reward call without a deadline would hang here)
    finally:
        release.set()
        gen.stop()
    assert batch.metrics["rollout/env_failures"] == 3 and batch.metrics["rollout/groups_failed"] == 1
    assert "2" not in {s.example["label"] for s in batch.samples} and len({s.group for s in batch.samples}) == 4


def test_stop_interrupts_generation_in_flight():
    tok = make_tiny_tokenizer()
    engine = slow(TorchEngine(tiny_model_for(tok)), delay=0.05)
    gen = make_generator(1, engine=engine)
    gen.sampling = SamplingParams(max_new_tokens=1000)  # would take ~50 s
    gen.start()
    time.sleep(0.2)
    t0 = time.perf_counter()
    gen.stop()
    assert time.perf_counter() - t0 < 2 and not gen.thread.is_alive()


def test_non_finite_weights_stop_the_generator_with_one_line():
    logits = torch.randn(3, 40)
    logits[1, 5] = float("nan")
    logits[2, 7] = float("inf")
    tok, lp = sample_tokens(logits, SamplingParams(temperature=1.0), keys(3))
    assert torch.isfinite(lp[0]) and lp[1:].isnan().all()  # reported, no multinomial crash
    tok = make_tiny_tokenizer()
    model = tiny_model_for(tok)
    with torch.no_grad():
        model.lm_head.weight[3, 0] = float("inf")  # what a blown-up step would publish
    gen = make_generator(1, engine=TorchEngine(model))
    gen.start()
    with pytest.raises(FloatingPointError, match="non-finite logits at weight version 0"):
        gen.get(timeout=30)
    gen.stop()


def test_evaluate_reports_accuracy_and_pass_at_k():
    tok = make_tiny_tokenizer()
    engine = TorchEngine(tiny_model_for(tok))
    examples = [{"prompt": "1+1=", "label": "2"}, {"prompt": "2+2=", "label": "4"}]
    calls = iter([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    m = evaluate(engine, examples, tok, n=4, sampling=SamplingParams(max_new_tokens=3), chat_template=True,
                 limits=Limits(3, 3, 1), env_cls=single_turn(lambda text, example: next(calls)))
    assert m["accuracy"] == pytest.approx(1 / 8) and m["pass@4"] == pytest.approx(0.5)
    assert m["pass@1"] == pytest.approx(1 / 8)


@pytest.mark.parametrize("truncated", ["keep", "zero", "mask"])
def test_truncated_responses_follow_the_setting(truncated):
    """rollout.truncated: a response cut at max_new_tokens keeps its graded reward, scores 0, or is masked out
    of the loss with its reward kept (for its group's baseline); a response that stopped is never touched."""
    gen = make_generator(0, reward_fn=lambda text, example: 1.0, n=4)
    gen.truncated = truncated
    gen.sampling = SamplingParams(temperature=3.0, max_new_tokens=2, stop_token_ids=gen.sampling.stop_token_ids)
    gen.start()
    try:
        batch = gen.get(timeout=30)
    finally:
        gen.stop()
    cut = [s for s in batch.samples if s.finish_reason == "length"]
    stopped = [s for s in batch.samples if s.finish_reason == "stop"]
    assert cut and all(s.reward == 1.0 and not s.masked for s in stopped)
    assert all(s.reward == (0.0 if truncated == "zero" else 1.0) for s in cut)
    assert all(s.masked == (truncated == "mask") for s in cut)


def test_void_turns_end_their_trajectory_masked_with_the_reward_kept():
    """A turn with neither a tool call nor an answer (the env says "void") ends its trajectory, which is masked
    out of the loss like rollout.truncated: mask, while its reward stays for its group's baseline."""
    class Mute:
        def __init__(self, example):
            self.example = example

        def reset(self):
            return [{"role": "user", "content": self.example["prompt"]}]

        def step(self, text):
            return [], 0.5, True, {"void": True}

    gen = make_generator(0, n=2)
    gen.env_cls = Mute
    gen.start()
    try:
        batch = gen.get(timeout=30)
    finally:
        gen.stop()
    assert batch.samples and all(s.masked and s.finish_reason == "void" and s.reward == 0.5 for s in batch.samples)
    assert batch.metrics["rollout/void"] == 1.0 and batch.metrics["rollout/env_failures"] == 0


# ----------------------------------------------------------------------------- envs that hang, fail to close, misreport


class Hang:
    """An env whose backend is down: every step waits forever (until the test sets `never`)."""
    never = threading.Event()

    def __init__(self, example):
        self.example = example

    def reset(self):
        return [{"role": "user", "content": self.example["prompt"]}]

    def step(self, text):
        Hang.never.wait()


def env_generator(env_cls, prompts_per_step=2, n=2, **kw):
    tok = make_tiny_tokenizer()
    examples = [{"prompt": f"{a}+1=", "label": str(a + 1)} for a in range(10)]
    return Generator(TorchEngine(tiny_model_for(tok)), PromptStream(examples, seed=0), tok,
                     rollout_cfg(0, prompts_per_step=prompts_per_step, n=n, **kw),
                     SamplingParams(max_new_tokens=4, stop_token_ids=(tok.eos_token_id,)), env_cls=env_cls)


def test_a_run_whose_env_hangs_on_every_call_stops_with_one_line():
    """256 trajectories whose step never returns, four times the pool's 64 threads: the learner's get() (no timeout)
    raises TooManyFailures naming the env, the call and the count within a few env_timeout_s, never hangs."""
    Hang.never = threading.Event()
    gen = env_generator(Hang, prompts_per_step=128, env_timeout_s=0.3)
    gen.sampling = replace(gen.sampling, max_new_tokens=1)  # one token a turn: the time is the env's, not the engine's
    gen.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(rollout.TooManyFailures, match=r"^256 of 256 trajectories of rollout batch 0 failed in the env "
                                                          r".*; the first: Hang.step raised TimeoutError"):
            gen.get(timeout=20)
        assert time.perf_counter() - t0 < 10  # mostly the engine's own time (old: never returned)
    finally:
        gen.stop()
        Hang.never.set()
        while env.POOL.timeouts and time.perf_counter() < t0 + 15:  # the pool takes the env for down until one returns
            time.sleep(0.01)


def test_a_dead_generator_never_keeps_the_learner_waiting(monkeypatch):
    """The generator thread dies: get() without a timeout raises, and publish() (which waits for batches) returns."""
    gen = make_generator(1)
    monkeypatch.setattr(gen.engine, "session", lambda *a, **k: 1 / 0)
    gen.start()
    gen.thread.join(10)
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="generator thread failed"):
        gen.get()
    gen.publish([], version=1)
    assert time.perf_counter() - t0 < 10  # returned at all (a generous bound: the cores may be busy)
    gen.stop()


class Unclosable(Hang):
    def step(self, text):
        return [], float(self.example["label"] == "2"), True

    def close(self):
        raise OSError("sandbox gone")


def test_a_failed_close_is_counted_apart_and_changes_nothing(capsys):
    """close() raising ends no run and relabels no trajectory: the batch trains as it would, rollout/env_close_failures
    counts the closes (one warning line), eval scores the solved episodes; single-turn rows have no such key."""
    gen = env_generator(Unclosable, n=2)
    gen.start()
    try:
        batch = gen.get(timeout=30)
    finally:
        gen.stop()
    m = batch.metrics
    assert len(batch.samples) == 4 and m["rollout/env_failures"] == 0 and m["rollout/env_close_failures"] == 4
    lines = [line for line in capsys.readouterr().out.splitlines() if "close" in line]
    assert len(lines) == 1 and "4 of 4 Unclosable.close calls failed" in lines[0]
    tok = make_tiny_tokenizer()
    out = evaluate(gen.engine, [{"prompt": "1+1=", "label": "2"}, {"prompt": "2+2=", "label": "4"}], tok, n=2,
                   sampling=SamplingParams(max_new_tokens=3), chat_template=True, limits=Limits(3, 3, 1), env_cls=Unclosable)
    assert out["accuracy"] == 0.5 and out["env_failure_rate"] == 0.0
    gen = make_generator(0)
    gen.start()
    try:
        assert "rollout/env_close_failures" not in gen.get(timeout=30).metrics
    finally:
        gen.stop()


def test_a_non_finite_or_non_numeric_reward_fails_its_trajectory(capsys):
    """A reward hook that returns NaN, inf or a string fails that trajectory with a warning naming the hook, the
    example and the value (a NaN would turn its group's advantages into NaN); eval counts it wrong, never NaN."""
    bad = {"2": float("nan"), "3": "1.0", "4": float("inf")}

    def reward(text, example):
        return bad.get(example["label"], 1.0)

    gen = make_generator(0, reward_fn=reward, n=2)
    gen.prompts_per_step = 10  # every prompt: 0+1= .. 9+1=
    gen.max_failures = 1.0
    gen.start()
    try:
        batch = gen.get(timeout=30)
    finally:
        gen.stop()
    assert all(math.isfinite(s.reward) and s.example["label"] not in bad for s in batch.samples)
    out = capsys.readouterr().out
    assert "reward.step raised ValueError: the reward must be a finite number, got nan" in out
    assert "reward.step raised ValueError: the reward must be a finite number, got '1.0'" in out
    tok = make_tiny_tokenizer()
    m = evaluate(gen.engine, [{"prompt": "1+1=", "label": "2"}, {"prompt": "2+2=", "label": "4"}], tok, n=2,
                 sampling=SamplingParams(max_new_tokens=3), chat_template=True, limits=Limits(3, 3, 1),
                 env_cls=single_turn(reward))
    assert m["accuracy"] == 0.0 and m["pass@2"] == 0.0


def test_sft_traces_that_fail_on_any_rank_are_dropped_on_every_rank(monkeypatch):
    """Every rank plays the same global batch of supervised traces: one that failed on another rank only (a flaky env)
    is dropped here too, so the ranks split the same rows."""
    tok = make_tiny_tokenizer(tools=True)
    ex = {"prompt": "37*48=", "label": "1776", "solution": ["calc(37*48)", "\\boxed{1776}"]}
    short = ex | {"solution": ["calc(37*48)"]}  # the env goes on after the trace: fails on every rank
    cfg = SimpleNamespace(data=SimpleNamespace(env="machinery.env:Calculator"), rollout=rollout_cfg(0, max_new_tokens=64))
    assert [r is None for r in rollout.sft_rows(cfg, tok, [ex, ex, short], Calculator)] == [False, False, True]
    gathered = []
    monkeypatch.setattr(rollout, "all_gather", lambda mine: gathered.append(mine) or [mine, {1}])  # rank 1 lost trace 1
    assert [r is None for r in rollout.sft_rows(cfg, tok, [ex, ex, short], Calculator)] == [False, True, True]
    assert gathered == [{2}]


class Broken(Hang):
    def reset(self):
        raise ConnectionError("backend down")


def test_env_failures_in_eval_are_said_beside_the_accuracy(capsys):
    """An env that fails every episode scores 0 in eval; the console says that the env failed, where the accuracy is
    said (run_eval's line and the final accuracy line), so it never reads as a model that learned nothing."""
    tok = make_tiny_tokenizer()
    cfg = SimpleNamespace(seed=0, train=SimpleNamespace(eval_temperature=None, eval_n=2, eval_greedy=False,
                                                       eval_max_new_tokens=3),
                          rollout=rollout_cfg(0, max_new_tokens=3, env_timeout_s=5.0), data=SimpleNamespace(env="x"))
    sets = {"multiply": [{"prompt": "1+1=", "label": "2"}, {"prompt": "2+2=", "label": "4"}]}
    out = rollout.run_eval(cfg, TorchEngine(tiny_model_for(tok)), tok, sets, (tok.eos_token_id,), Broken)
    assert out["eval/multiply/accuracy"] == 0.0 and out["eval/multiply/env_failure_rate"] == 1.0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[eval]")]
    assert said == ["[eval] multiply: the env failed 100% of the trajectories; each scored 0 in eval/multiply/accuracy"]
    assert rollout.accuracy_line(out) == "multiply/accuracy 0.0% (the env failed 100% of its trajectories, each scored 0)"
    assert rollout.accuracy_line({"eval/synthetic/accuracy": 0.61, "eval/synthetic/env_failure_rate": 0.0}) == \
        "synthetic/accuracy 61.0%"


def test_speculation_metrics_are_the_batchs_share_of_the_engines_counters():
    """rollout/spec_* from the engine's cumulative counters: this batch's differences (seen keeps the last ones), the
    acceptance only where a call speculated, nothing without speculation."""
    stats = {"spec_calls": 1, "plain_calls": 0, "spec_drafts": 20, "spec_accepted": 15, "spec_tokens": 25,
             "spec_rows": 10, "spec_draft_s": 0.5, "spec_verify_s": 1.0, "spec_tokens_per_s": 16.0}
    engine, seen = SimpleNamespace(stats=stats), {}
    assert rollout.speculation_metrics(engine, seen) == {
        "rollout/spec_on": 1.0, "rollout/spec_accept_rate": 0.75, "rollout/spec_tokens_per_verify": 2.5,
        "perf/spec_draft_s": 0.5, "perf/spec_verify_s": 1.0, "perf/spec_tokens_per_s": 16.0}
    stats |= {"plain_calls": 3, "plain_tokens_per_s": 20.0}  # three plain calls since: no acceptance to report
    assert rollout.speculation_metrics(engine, seen) == {"rollout/spec_on": 0.0, "perf/spec_tokens_per_s": 16.0,
                                                         "perf/plain_tokens_per_s": 20.0}
    assert rollout.speculation_metrics(SimpleNamespace(stats={"iterations": 3}), {}) == {}
