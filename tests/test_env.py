"""env.py: incremental rendering on a template written for these tests that renders as GLM-Z1-9B-0414's does
(observation role, earlier <think> stripped, [gMASK]<sop>, tools in the system turn), with a small
tokenizer holding GLM's special tokens; exact token accounting through the episode loop on the torch
engine; limits, void turns, failures (raise, timeout, malformed, a reward past what the learner's float32 loss can
take), close() on every episode; an env that hangs (one env_timeout_s, then a tenth; a bounded number of threads
lost, then the run's stop); the demo's calculator."""
import random
import re
import string
import threading
import time

import numpy as np
import pytest
import torch

import grpo
from machinery import env
from data import make_tiny_tokenizer
from machinery.engine import SamplingParams, TorchEngine
from machinery.env import Episode, Limits, render_messages, run_episodes
from model import GLM, GLMConfig

# Written from GLM-Z1-9B-0414's published chat format (../docs: a user turn "<|user|>\n...", an observation
# "<|observation|>\n...", an assistant turn keeps only the text after its last </think>, the generation
# prompt "<|assistant|>\n<think>"), not copied from its file.
GLM_LIKE_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- if tools -%}<|system|>\n# tools{% for t in tools %}\n{{ t['function']['name'] }}{% endfor %}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}<|assistant|>\n{{ m['content'].split('</think>')[-1].strip() }}"
    "{%- else -%}<|{{ m['role'] }}|>\n{{ m['content'] }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>\n<think>{%- endif -%}")
GLM_SPECIAL = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
               "<think>", "</think>"]


def glm_like_tokenizer(template=GLM_LIKE_TEMPLATE):
    """A character-level tokenizer with GLM's special tokens, each one token."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    chars = string.digits + string.ascii_letters + string.punctuation + " \n"
    vocab = {t: i for i, t in enumerate(GLM_SPECIAL + list(chars))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="#"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(GLM_SPECIAL)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.chat_template = template
    return tok


def test_env_messages_are_appended_not_re_rendered():
    """A conversation's ids grow by what each new message adds; the observation's leading <|observation|> is
    not repeated after the model sampled it; the thinking of the earlier turn stays exactly as sampled,
    where a re-render of the whole conversation would strip it (GLM-Z1's template is not append-only)."""
    tok = glm_like_tokenizer()
    obs = tok.convert_tokens_to_ids("<|observation|>")
    turn = "reasoning</think>calc(12*34)"
    ids = tok.apply_chat_template([{"role": "user", "content": "12*34="}], add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    ids += tok.encode(turn, add_special_tokens=False) + [obs]  # the model's turn, ended by its stop token
    delta = render_messages(tok, [{"role": "observation", "content": "408"}], last=obs)
    assert tok.decode(delta) == "\n408<|assistant|>\n<think>"  # no second <|observation|>
    assert render_messages(tok, [{"role": "observation", "content": "408"}], last=5)[0] == obs  # ended otherwise
    full = tok.decode(ids + delta)
    assert "reasoning</think>calc(12*34)<|observation|>\n408<|assistant|>\n<think>" in full
    rerender = tok.apply_chat_template([{"role": "user", "content": "12*34="}, {"role": "assistant", "content": turn},
                                        {"role": "observation", "content": "408"}], add_generation_prompt=True,
                                       tokenize=False)
    assert "reasoning" not in rerender  # what re-rendering the history would have trained on instead
    tools = [{"type": "function", "function": {"name": "calc"}}]
    assert render_messages(tok, [{"role": "observation", "content": "1"}], tools, last=obs) == \
        render_messages(tok, [{"role": "observation", "content": "1"}], None, last=obs)  # tools live in the prefix


def test_a_template_that_does_not_extend_its_prefix_is_one_line_naming_it():
    bad = "{%- for m in messages|reverse -%}<|{{ m['role'] }}|>{{ m['content'] }}{%- endfor -%}"
    tok = glm_like_tokenizer(bad)
    tok.name_or_path = "my-reversed-template"
    with pytest.raises(ValueError, match="chat template of my-reversed-template does not extend its own prefix"):
        render_messages(tok, [{"role": "observation", "content": "1"}])


# ----------------------------------------------------------------------------- the episode loop on a real engine


class Scripted:
    """Replies to every model turn with an observation of the turn's length; done after `turns` turns."""
    tools = []
    turns, reward, log = 3, 1.0, []

    def __init__(self, example):
        self.example, self.n, self.turns = example, 0, example.get("turns", self.turns)

    def reset(self):
        return [{"role": "user", "content": self.example["prompt"]}]

    def step(self, text):
        self.n += 1
        done = self.n >= self.turns
        return [] if done else [{"role": "observation", "content": f"got {len(text)}" * 3}], self.reward, done, \
            {"tool_calls": int(not done)}

    def close(self):
        Scripted.log.append(self.example["prompt"])


def tool_tokenizer():
    return make_tiny_tokenizer(tools=True)


def tiny_engine(tok, seed=0):
    torch.manual_seed(seed)
    model = GLM(GLMConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=8, max_position_embeddings=256))
    return TorchEngine(model, max_batch=4)


def stops(tok):
    """A random model rarely samples eos: a quarter of the vocabulary also ends a turn, so turns end early
    and by a stop token, as a trained model's do."""
    return tuple(sorted({tok.eos_token_id, *env.turn_ends(tok), *range(7, len(tok), 4)}))


def play(env_cls, examples, limits, tok=None, engine=None, sampling=None, **kw):
    tok = tok or tool_tokenizer()
    engine = engine or tiny_engine(tok)
    sampling = sampling or SamplingParams(temperature=1.0, stop_token_ids=stops(tok))
    eps = [Episode(ex, i) for i, ex in enumerate(examples)]
    order = [i for i, _ in run_episodes(engine, eps, env_cls, tok, sampling, limits, seed=3, **kw)]
    return eps, order, engine, tok


def test_trajectory_ids_are_the_sampled_ids_plus_the_rendered_env_ids():
    """Exact token accounting: the response is each turn's sampled ids (with their logprobs), then the ids
    render_messages gives for the env's answer, in order; the spans mark exactly the model's tokens; every
    env is closed."""
    Scripted.log = []
    limits = Limits(max_new_tokens=12, max_total_tokens=200, max_turns=5)
    eps, order, engine, tok = play(Scripted, [{"prompt": "a"}, {"prompt": "bb"}, {"prompt": "c"}], limits)
    assert sorted(order) == [0, 1, 2] and sorted(Scripted.log) == ["a", "bb", "c"]
    assert max(ep.turns for ep in eps) == 3  # multi-turn, ended by the env
    for ep in eps:
        assert ep.finish in ("stop", "length") and ep.failure is None and ep.turns <= 3
        rebuilt, at, texts = [], 0, []
        for k, (start, n) in enumerate(ep.spans):
            model_ids = ep.response[start:start + n]
            assert start == len(rebuilt) and len(model_ids) == n
            rebuilt += model_ids
            texts.append(tok.decode(model_ids, skip_special_tokens=True))
            if k < len(ep.spans) - 1:  # the env's answer to this turn, rendered as run_episodes does
                msgs = [{"role": "observation", "content": f"got {len(texts[-1])}" * 3}]
                rebuilt += render_messages(tok, msgs, None, last=model_ids[-1])
        assert rebuilt == ep.response
        assert len(ep.logprobs) == sum(n for _, n in ep.spans) == ep.model_tokens
    # The model tokens are the engine's own: a second engine continuing the same context samples the same
    ep = eps[0]
    start, n = ep.spans[-1]
    again = engine.generate([ep.prompt + ep.response[:start]], SamplingParams(temperature=1.0, max_new_tokens=n,
                            stop_token_ids=stops(tok)), seed=3 + (len(ep.spans) - 1) * env.TURN_SEED)
    assert again[0].token_ids == ep.response[start:start + n]


class Slow(Scripted):
    """A tool that takes its time, unevenly (random: it differs between runs, as a real tool's does)."""
    def step(self, text):
        time.sleep(0.002 + 0.01 * random.random())
        return super().step(text)


def later_turn_tokens(ep):
    """The tokens each later turn must prefill: the env's answer and the last sampled token (never fed)."""
    return sum(start - (prev + n) + 1 for (prev, n), (start, _) in zip(ep.spans, ep.spans[1:]))


@pytest.mark.parametrize("admit_after", [None, 2])
def test_turns_wait_on_their_tool_while_the_engine_decodes_others(admit_after):
    """Eight trajectories, two decode rows, a tool that sleeps: a trajectory waiting on its tool parks its KV and
    frees its row, so the others decode meanwhile; its next turn prefills only the env's new tokens (exactly:
    the tokens the spans say) and extends its parked KV. With admit_after the loop admits an answer a fixed number
    of iterations after its turn, so a second run gives the same tokens although the tool's times differ; with
    None (as soon as it arrives) the episodes are equally well formed."""
    limits = Limits(max_new_tokens=12, max_total_tokens=200, max_turns=3, admit_after=admit_after)  # the last turn extends too
    runs = []
    for _ in range(2):
        tok = tool_tokenizer()
        engine = tiny_engine(tok)
        engine.max_batch = 2
        eps, order, engine, tok = play(Slow, [{"prompt": "ab"[k % 2] * (k + 1)} for k in range(8)], limits, tok, engine)
        assert sorted(order) == list(range(8)) and all(ep.failure is None for ep in eps)
        assert sum(ep.turns for ep in eps) > 8 and engine.stats["evicted"] == 0
        assert engine.stats["extend_tokens"] == sum(later_turn_tokens(ep) for ep in eps)
        assert engine.stats["prefill_tokens"] == engine.stats["extend_tokens"] + sum(len(ep.prompt) for ep in eps)
        assert len(engine.pool.free) == engine.pool.num_blocks
        runs.append([(ep.response, ep.logprobs) for ep in eps])
    if admit_after is not None:
        assert runs[0] == runs[1]


def test_limits_end_trajectories_with_finish_length():
    Scripted.turns = 10
    try:
        eps, _, _, _ = play(Scripted, [{"prompt": "a"}] * 3, Limits(max_new_tokens=12, max_total_tokens=200, max_turns=2))
        assert all(ep.turns <= 2 and ep.finish == "length" for ep in eps)
        eps, _, _, _ = play(Scripted, [{"prompt": "a"}] * 3, Limits(max_new_tokens=12, max_total_tokens=30, max_turns=9))
        assert all(len(ep.response) <= 30 and ep.finish == "length" for ep in eps)
    finally:
        Scripted.turns = 3


def test_env_output_is_capped_before_rendering():
    class Loud(Scripted):
        def step(self, text):
            return [{"role": "observation", "content": "x" * 1000}], 0.0, False

    eps, _, _, tok = play(Loud, [{"prompt": "a"}], Limits(max_new_tokens=12, max_total_tokens=60, max_turns=2,
                                                          max_env_chars=7))
    start, n = eps[0].spans[0]
    env_ids = eps[0].response[start + n:eps[0].spans[1][0]]
    assert tok.decode(env_ids).count("x") == 7


class Flaky(Scripted):
    """Fails in the ways an env can: raises in step, hangs, returns garbage, raises in __init__."""
    def __init__(self, example):
        if example["prompt"] == "init":
            raise RuntimeError("cannot start")
        super().__init__(example)

    def step(self, text):
        how = self.example["prompt"]
        if how == "raise":
            raise KeyError("tool crashed")
        if how == "hang":
            time.sleep(5)
        if how == "garbage":
            return "not a tuple"
        if how == "void":
            return [], 0.5, True, {"void": True}
        return super().step(text)


def test_failures_are_data_and_every_env_is_closed():
    Scripted.log = []
    prompts = ["ok", "raise", "hang", "garbage", "init", "void"]
    eps, order, _, _ = play(Flaky, [{"prompt": p} for p in prompts],
                            Limits(max_new_tokens=12, max_total_tokens=100, max_turns=5, timeout_s=0.5))
    by = dict(zip(prompts, eps))
    assert sorted(order) == list(range(6))
    assert by["ok"].failure is None and by["ok"].finish in ("stop", "length")
    assert "Flaky.step raised KeyError: 'tool crashed'" == by["raise"].failure
    assert "Flaky.step raised TimeoutError" in by["hang"].failure and "0.5 s" in by["hang"].failure
    assert "Flaky.step raised TypeError" in by["garbage"].failure
    assert by["init"].failure == "Flaky.__init__ raised RuntimeError: cannot start"
    assert by["void"].failure is None and by["void"].finish == "void" and by["void"].reward == 0.5
    assert sorted(Scripted.log) == ["garbage", "hang", "ok", "raise", "void"]  # every env made was closed


def test_cancelled_episodes_are_closed():
    """Closing the loop early (dynamic sampling has what it needs, or the generator stops) closes the envs
    of the episodes still running."""
    Scripted.log, Scripted.turns = [], 4
    try:
        tok = tool_tokenizer()
        eps = [Episode({"prompt": str(i), "turns": i + 1}, i) for i in range(4)]  # the first ends after one turn
        runs = run_episodes(tiny_engine(tok), eps, Scripted, tok, SamplingParams(temperature=1.0, stop_token_ids=stops(tok)),
                            Limits(max_new_tokens=12, max_total_tokens=100, max_turns=4), seed=0)
        next(runs)
        runs.close()
        assert sorted(Scripted.log) == ["0", "1", "2", "3"]
        assert sum(ep.finish == "cancelled" for ep in eps) == 3
    finally:
        Scripted.turns = 3


def test_calculator_env_and_expression_evaluator():
    calc = env.Calculator({"prompt": "37*48=", "label": "1776"})
    assert calc.reset() == [{"role": "user", "content": "37*48="}]
    msgs, reward, done, info = calc.step("calc(37*48)")
    assert msgs == [{"role": "observation", "content": "1776"}] and not done and info["tool_calls"] == 1
    assert calc.step("\\boxed{1776}") == ([], 1.0, True)
    assert calc.step("hmm")[3] == {"void": True}
    no_tool = env.Calculator({"prompt": "37*48=", "label": "1776", "tools": False})
    assert no_tool.tools == [] and no_tool.step("calc(37*48)")[0][0]["content"] == "error: no calculator"
    for expr, want in [("2+3*4", "14"), ("(2+3)*4", "20"), ("7/2", "3.5"), ("8/2", "4"), ("-3*-3", "9"),
                       ("1/0", "error: division by zero"), ("2**9", "error: bad expression"), ("(1", "error: bad expression")]:
        assert env.calculate(expr) == want, expr
    assert env.calculate("9" * 12 + "*" + "9" * 12 + "*" + "9" * 12) == "error: bad expression"  # no huge numbers


def test_calculator_traces_render_as_rl_does():
    """A supervised trace goes through the same rendering as an RL episode: the model's turns end with
    <|observation|> while the env goes on, then eos; the env's answer follows it without repeating it."""
    tok = tool_tokenizer()
    ex = {"prompt": "37*48=", "label": "1776"}
    ep, short = env.traces(env.Calculator, [ex, ex], [["calc(37*48)", "\\boxed{1776}"], ["calc(37*48)"]], tok,
                           Limits(16, 40, 3), stop_id=tok.convert_tokens_to_ids("<|observation|>"), eos_id=tok.eos_token_id)
    assert short.failure == "Calculator.step raised ValueError: the env goes on after the trace's 1 turns"
    assert ep.failure is None and ep.finish == "stop" and ep.reward == 1.0
    assert tok.decode(ep.prompt) == "<|system|>calc<|user|>37*48=<|assistant|>"
    assert tok.decode(ep.response) == "calc(37*48)<|observation|>1776<|assistant|>\\boxed{1776}<eos>"
    (s0, n0), (s1, n1) = ep.spans
    assert tok.decode(ep.response[s0:s0 + n0]) == "calc(37*48)<|observation|>"
    assert tok.decode(ep.response[s1:s1 + n1]) == "\\boxed{1776}<eos>"


def test_a_bad_env_spec_is_one_line():
    with pytest.raises(ValueError, match=r"^data.env: 'nosuch_module:Env': no module named 'nosuch_module'"):
        env.load_env("nosuch_module:Env")
    with pytest.raises(ValueError, match=r"^data.env: 'machinery.env:calculate' must be a class with reset\(\) and step\(text\)"):
        env.load_env("machinery.env:calculate")
    with pytest.raises(ValueError, match=r"^data.env: 'machinery.env:Calculatr': module machinery.env \(.*\) has no class 'Calculatr'; "
                                         r"did you mean 'Calculator'\?"):
        env.load_env("machinery.env:Calculatr")
    assert env.load_env("machinery.env:Calculator") is env.Calculator


# ----------------------------------------------------------------------------- env calls that hang, fail or misbehave


def release(event):
    """Let the test's hanging calls return, and wait until they all have (no kind of call is down, no thread lost)."""
    event.set()
    deadline = time.perf_counter() + 5
    while (env.POOL.timeouts or env.POOL.lost) and time.perf_counter() < deadline:
        time.sleep(0.01)


def within(seconds, fn):
    """fn() on a daemon thread: its result, or a test failure (not a hung suite) if it takes longer than seconds."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("v", fn()), daemon=True)
    t0 = time.perf_counter()
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s"
    return out.get("v"), time.perf_counter() - t0


def test_hundreds_of_hanging_calls_end_within_twice_the_timeout():
    """300 calls that never return, on the 64-thread pool: the first 64 time out after env_timeout_s; the queued ones
    must not wait for a later submit that never comes: each call ends within 2 x env_timeout_s of its submission."""
    never = threading.Event()
    try:
        eps = [Episode({}, i) for i in range(300)]
        results, _ = within(10, lambda: env.guarded([(ep, "Hang.step", never.wait, ()) for ep in eps], 0.3))
        assert results == [(False, None)] * 300  # within(10): they all ended (before: the queued ones never started)
        assert all(ep.failure.startswith("Hang.step raised TimeoutError") for ep in eps)
    finally:
        release(never)  # the stuck threads return and leave the pool


class Hang(Scripted):
    never = threading.Event()

    def step(self, text):
        Hang.never.wait()


def test_more_hanging_steps_than_threads_in_the_session_loop():
    """_play with 100 turns (one token each: they all end at once) whose env never answers, more than the pool's 64
    threads: every trajectory fails with a timeout within a few env_timeout_s, none waits forever."""
    tok = tool_tokenizer()
    engine = tiny_engine(tok)
    engine.max_batch = 128
    Hang.never = threading.Event()
    try:
        (eps, order, _, _), _ = within(15, lambda: play(Hang, [{"prompt": "a"}] * 100, Limits(1, 40, 2, timeout_s=0.3),
                                                           tok, engine))
        assert sorted(order) == list(range(100))  # within(15): no hang
        assert all(ep.failure.startswith("Hang.step raised TimeoutError") for ep in eps)
    finally:
        release(Hang.never)


def test_a_batch_whose_step_hangs_costs_one_timeout_then_a_tenth():
    """Steps that never return, one trajectory at a time (max_batch 1: each turn ends in an iteration of its own, and
    the loop waits for its answer): the first env_timeout_s puts Hang.step down, so the three after it get a tenth
    each (before: a whole one each, as 8 had to time out in a row). The next episode loop (the next eval set, batch
    or round) gets only the tenth although its __init__, reset and close calls answer (before: any answer ended the
    outage, and every loop paid a whole env_timeout_s again). A step that answers ends the outage. (Times are the
    env's, Episode.env_s: the engine's own vary with the machine's load.)"""
    tok = tool_tokenizer()
    engine = tiny_engine(tok)
    engine.max_batch = 1
    Hang.never, timeout = threading.Event(), 0.5
    try:
        for loop in range(2):
            eps, _, _, _ = play(Hang, [{"prompt": "a"}] * 4, Limits(1, 40, 2, timeout_s=timeout), tok, engine)
            took = sum(ep.env_s for ep in eps)
            down = [ep.failure == "Hang.step raised TimeoutError: no answer in 0.05 s while Hang.step is down "
                                  f"({k} of its calls timed out, none answering)" for k, ep in enumerate(eps, 4 * loop)]
            if loop == 0:
                assert eps[0].failure == "Hang.step raised TimeoutError: no answer in 0.5 s (rollout.env_timeout_s)"
                assert down[1:] == [True] * 3 and timeout <= took < 2 * timeout  # 1.3 x (before: 4 x env_timeout_s)
            else:
                assert down == [True] * 4 and took < timeout  # 0.4 x (before: 4 x env_timeout_s again)
        assert env.POOL.is_down("Hang.step")
    finally:
        release(Hang.never)
    assert not env.POOL.is_down("Hang.step")  # its written-off calls answered


def test_calls_that_never_return_lose_a_bounded_number_of_threads_then_stop_the_run():
    """300 close() calls that never return: before, each kept its thread for good while a new one took its place (364
    threads); now about the first wave of 64 times out holding threads, the kind is down and the queued rest never
    start. Later waves of hanging calls each lose the threads of the calls that started (on a loaded machine some do
    not start within their tenth of the deadline, and hold none), until more than MAX_LOST (4 x the pool) would be
    held: then close raises EnvDown, a TooManyFailures (the run stops with its one line), and the pool never held more
    than size + max_lost threads. Once the calls return, the pool is whole again."""
    never, pool = threading.Event(), env.POOL

    class Stuck:
        def close(self):
            never.wait()

    def threads():
        return sum(t.name == "env-call" for t in threading.enumerate())

    def hanging(n):
        eps = [Episode({}, i) for i in range(n)]
        for ep in eps:
            ep.env = Stuck()
        return eps

    limits, most = Limits(1, 1, 1, timeout_s=0.2), threads()
    try:
        eps = hanging(300)
        assert within(10, lambda: env.close(eps, "Stuck", limits))[0] == 300
        # (before: 300 lost, 364 threads.) About the first 64: a few more where submitting 300 calls outlasts the first
        # deadline on a loaded machine (a call submitted less than a tenth of the deadline before a free thread takes
        # it still starts), never more than the pool's threads, its own and those written off
        assert 0 < pool.lost <= 2 * pool.size and threads() <= pool.size + pool.lost
        assert sum("while Stuck.close is down" in ep.close_failure for ep in eps) >= 300 - pool.size
        with pytest.raises(env.TooManyFailures) as stop:
            for _ in range(50):  # the waves after: each call a probe, each one that started lost
                before = pool.lost
                assert env.close(hanging(pool.size), "Stuck", limits) == pool.size
                assert before <= pool.lost <= before + pool.size
                most = max(most, threads())
        assert isinstance(stop.value, env.EnvDown) and "\n" not in str(stop.value)
        held = re.fullmatch(r"the env is down: (\d+) calls that missed their deadline \(rollout\.env_timeout_s=0\.2\) still "
                            r"hold a thread each, over the 256 a run may lose \(the latest: Stuck\.close\)", str(stop.value))
        assert held and pool.max_lost < int(held[1]) <= pool.max_lost + pool.size, str(stop.value)
        assert most <= pool.size + pool.max_lost == 320 and threads() <= pool.size + pool.max_lost
        with pytest.raises(env.EnvDown):  # and no call more while the threads stay lost
            env.guarded([(Episode({}, 0), "Stuck.reset", time.sleep, (0,))], 0.2)
    finally:
        release(never)
    assert pool.lost == 0 and env.guarded([(Episode({}, 0), "Stuck.reset", time.sleep, (0,))], 0.2) == [(True, None)]


class Unclosable(Scripted):
    def close(self):
        if self.example["prompt"] == "hang":
            Hang.never.wait()
        raise OSError("sandbox gone")


def test_a_failed_close_changes_no_trajectory(capsys):
    """close() runs after the trajectory ended: one that raises or times out is counted on its own (close_failure,
    one warning line) and leaves the trajectory's reward, finish and failure as they were."""
    Hang.never = threading.Event()
    try:
        eps, order, _, _ = play(Unclosable, [{"prompt": "a"}, {"prompt": "hang"}],
                                Limits(max_new_tokens=12, max_total_tokens=100, max_turns=5, timeout_s=0.3))
    finally:
        release(Hang.never)
    assert all(ep.failure is None and ep.finish in ("stop", "length") and ep.reward == 1.0 for ep in eps)
    assert eps[0].close_failure == "Unclosable.close raised OSError: sandbox gone"
    assert eps[1].close_failure.startswith("Unclosable.close raised TimeoutError")
    lines = [line for line in capsys.readouterr().out.splitlines() if "close" in line]
    assert len(lines) == 1 and "2 of 2 Unclosable.close calls failed" in lines[0]


class Malformed(Scripted):
    def step(self, text):
        return self.example["out"]


@pytest.mark.parametrize("out, why", [
    (([], 1.0, True, "void"), "info must be a dict"),
    (([], 1.0, True, [1]), "info must be a dict"),
    (([], 1.0, np.array([True, False])), "done must be a bool"),
    (([], 1.0, torch.tensor([1, 1])), "done must be a bool"),
    (([], 1.0, "yes"), "done must be a bool"),
    (([], float("nan"), True), "the reward must be a finite number, got nan"),
    (([], float("inf"), True), "the reward must be a finite number, got inf"),
    (([], np.float32("nan"), True), "the reward must be a finite number, got nan"),
    (([], "1.0", True), "the reward must be a finite number, got '1.0'"),
    (([], None, True), "the reward must be a finite number, got None"),
    (([], torch.tensor([1.0, 2.0]), True), "the reward must be a finite number"),
])
def test_a_malformed_return_fails_its_trajectory(out, why):
    """Any return that breaks the contract fails its trajectory, naming the value, instead of killing the loop."""
    eps, order, _, _ = play(Malformed, [{"prompt": "a", "out": out}], Limits(12, 100, 5))
    assert order == [0] and eps[0].finish == "failed"
    assert eps[0].failure.startswith("Malformed.step raised") and why in eps[0].failure


@pytest.mark.parametrize("done, reward", [(np.bool_(True), np.float32(0.5)), (torch.tensor(True), torch.tensor(0.5)),
                                          (np.int64(1), np.float64(0.5)), (1, 0.5)])
def test_numpy_and_tensor_scalars_are_accepted(done, reward):
    """A numpy or torch scalar (bool or 0/1) done, and a real-number scalar reward, are taken at their value."""
    eps, _, _, _ = play(Malformed, [{"prompt": "a", "out": ([], reward, done)}], Limits(12, 100, 5))
    assert eps[0].failure is None and eps[0].finish == "stop" and eps[0].reward == 0.5 and type(eps[0].reward) is float


def learner_step(rewards, std_normalize):
    """One RL step of the learner's own arithmetic on one group's rewards: grpo.group_advantages, grpo.policy_loss on
    a small float32 policy (8 responses of 5 tokens), parallel.optimizer_step. Returns (advantages [8], whether
    the step was skipped)."""
    from machinery.parallel import optimizer_step
    torch.manual_seed(0)
    policy = torch.nn.Linear(8, 16)
    x, ids = torch.randn(len(rewards), 5, 8), torch.randint(0, 16, (len(rewards), 5))
    logp = torch.log_softmax(policy(x), -1).gather(-1, ids[..., None])[..., 0]  # [8, 5]
    adv = grpo.group_advantages(rewards, len(rewards), std_normalize)
    loss, _ = grpo.policy_loss(logp, logp.detach(), adv, torch.ones_like(logp), grpo.GRPOConfig(std_normalize=std_normalize))
    loss.backward()
    out = optimizer_step(torch.optim.AdamW(policy.parameters()), policy, float(loss.detach()), 1.0, lambda: 1e-3)
    return adv, bool(out["train/skipped"])


@pytest.mark.parametrize("big, skipped", [(1e20, {True: False, False: True}), (1e38, {True: True, False: True}),
                                          (1e39, {True: True, False: True}), (-1e39, {True: True, False: True})])
def test_a_reward_float32_cannot_carry_fails_its_trajectory(big, skipped, capsys):
    """A reward that is finite in Python but past what the learner's float32 loss can take: before, it passed the check
    and a group of rollout.n = 8 holding it (half of it, the rest 0) skipped the whole RL step silently: at 1e20 the
    gradient norm of Dr.GRPO (std_normalize false) is inf, at 1e38 the group's sum and at 1e39 the reward itself
    (std_normalize either way: every advantage NaN). Now it fails its trajectory, on the agent path (step's reward)
    and on the single-turn one (the reward hook), and report_failures says so in one line. Within REWARD_LIMIT the
    same step is taken, with the advantages of a float64 reference."""
    n = 8
    for std_normalize, want in skipped.items():  # what a reward past the limit did to the step
        assert learner_step([big] * (n // 2) + [0.0] * (n // 2), std_normalize)[1] == want
    for group in ([env.REWARD_LIMIT] * 4 + [0.0] * 4, [-env.REWARD_LIMIT, env.REWARD_LIMIT] * 4):
        for std_normalize in (True, False):
            adv, was_skipped = learner_step(group, std_normalize)
            ref = torch.tensor(group, dtype=torch.float64) - sum(group) / n
            ref = ref / (torch.tensor(group, dtype=torch.float64).std() + 1e-6) if std_normalize else ref
            assert not was_skipped and torch.allclose(adv.double(), ref, rtol=1e-6)
    assert env.reward_value(env.REWARD_LIMIT) == 1e6 and env.reward_value(np.float32(-1e6)) == -1e6
    with pytest.raises(ValueError, match=r"^the reward must be within \+-1e\+06 .*, got " + re.escape(repr(big))):
        env.reward_value(big)
    eps, order, engine, tok = play(Malformed, [{"prompt": "a", "out": ([], big, True)}, {"prompt": "b", "out": ([], 1.0, True)}],
                                   Limits(12, 100, 5))
    assert eps[0].finish == "failed" and eps[0].failure.startswith("Malformed.step raised ValueError: the reward must be within")
    assert eps[1].failure is None and eps[1].reward == 1.0
    import rollout
    hook = rollout.single_turn(lambda text, example: big if example["prompt"] == "a" else 1.0)
    single = [Episode({"prompt": p}, i) for i, p in enumerate("ab")]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=stops(tok))
    assert sorted(i for i, _ in rollout.play_single_turn(engine, single, hook, tok, sampling, Limits(4, 4, 1), 0)) == [0, 1]
    assert single[0].finish == "failed" and single[0].failure.startswith("<lambda>.step raised ValueError: the reward must be")
    assert single[1].failure is None and single[1].reward == 1.0
    capsys.readouterr()
    env.report_failures([eps[0], single[0]], 4, 0, 0.5, None, 0, set(), 5)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(f"got {big!r}" in line and line.startswith("[rollout] env failure") for line in lines)


def test_an_env_whose_setup_cannot_start_is_one_line():
    """A setup that raises RuntimeError (PythonMath's sandbox refusing a machine it cannot isolate on) ends start-up
    with one line naming the env, not a traceback."""
    class Refuses:
        @classmethod
        def setup(cls):
            raise RuntimeError("the sandbox cannot isolate the model's code here: missing root\n(details)")

        def reset(self):
            return []

        def step(self, text):
            return [], 0.0, True

    import types
    import sys
    sys.modules["refusing_env"] = types.SimpleNamespace(Refuses=Refuses, __file__="refusing_env.py")
    try:
        with pytest.raises(ValueError, match=r"^data.env: refusing_env:Refuses: the sandbox cannot isolate the model's "
                                             r"code here: missing root$"):
            env.load_env("refusing_env:Refuses")
    finally:
        del sys.modules["refusing_env"]


# ----------------------------------------------------------------------------- MoE: an episode's routes

def tiny_moe_engine(tok, seed=0):
    """A tiny glm_moe_dsa-shaped model (tests/test_train.py's tiny_moe: MLA, a dense first layer, then two MoE layers,
    top-2 of 8 experts and a shared one, DSA top-4) on this tokenizer, weights sharper than the init (routes far
    from ties), in an engine of 4 rows."""
    torch.manual_seed(seed)
    cfg = GLMConfig(model_type="glm_moe_dsa", vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=3,
                    num_heads=4, num_kv_heads=4, max_position_embeddings=256,
                    mla=dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
                    moe=dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                             n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                             mlp_layer_types=["dense", "sparse", "sparse"]),
                    dsa={"topk": 4, "heads": 2, "head_dim": 8, "rope_dim": 4, "pattern": "FS"})
    model = GLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return TorchEngine(model.eval(), max_batch=4)


def test_an_moe_episode_carries_the_routes_of_every_position_of_its_trajectory(monkeypatch):
    """Multi-turn episodes on an MoE engine (run_episodes' session loop): Episode.routes holds one row per position
    the trajectory fed, prompt, model and env tokens alike (all but its last sampled token): its first turn's rows
    are exactly that turn's completion's routes, and every row is the experts a full fp32 forward of the whole
    trajectory chooses, every MoE layer routed from the prompt's last token on (the later turns extend their parked
    KV: each env token runs every layer), the prompt's earlier tokens routed in every MoE layer but the last (the
    prefill runs its last block at the prompt's last token only)."""
    from families.mla_moe import Routing, no_route
    turns = []
    model_turn = env.model_turn
    monkeypatch.setattr(env, "model_turn", lambda ep, c: turns.append((ep.index, c)) or model_turn(ep, c))
    tok = tool_tokenizer()
    engine = tiny_moe_engine(tok)
    limits = Limits(max_new_tokens=8, max_total_tokens=120, max_turns=3)
    eps, order, _, _ = play(Scripted, [{"prompt": "a"}, {"prompt": "bb"}, {"prompt": "c"}], limits, tok=tok, engine=engine)
    assert sorted(order) == [0, 1, 2] and max(ep.turns for ep in eps) >= 2 and engine.stats["extends"] >= 1
    n_moe, k, NO = 2, 2, no_route(torch.uint8)
    for ep in eps:
        assert ep.failure is None and ep.turns == sum(i == ep.index for i, _ in turns)
        ids = ep.prompt + ep.response
        assert ep.routes.shape == (len(ids) - 1, n_moe, k) and ep.routes.dtype == torch.uint8
        first = next(c for i, c in turns if i == ep.index)
        assert torch.equal(ep.routes[:len(first.routes)], first.routes)
        assert len(first.routes) == len(ep.prompt) + len(first.token_ids) - 1 < len(ep.routes) or ep.turns == 1
        r = Routing(record=True)
        with torch.no_grad():
            engine.model(torch.tensor([ids[:-1]]), routing=r)
        want = torch.stack(r.chosen)[:, 0].permute(1, 0, 2)
        ran = torch.ones(len(ids) - 1, n_moe, dtype=torch.bool)
        ran[:len(ep.prompt) - 1, -1] = False
        assert torch.equal((ep.routes != NO).all(-1), ran) and torch.equal((ep.routes != NO).any(-1), ran)
        assert torch.equal(ep.routes.sort(-1).values[ran], want.sort(-1).values[ran])
