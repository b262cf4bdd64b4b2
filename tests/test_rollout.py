"""rollout.py: the torch engine against a naive full-forward reference, weight updates mid-batch,
and the generator thread's staleness gate, dynamic sampling, error surfacing and shutdown."""
import threading
import time

import pytest
import torch

from data import PromptStream, make_tiny_tokenizer
from model import GLM, GLMConfig
from rollout import Generator, SamplingParams, TorchEngine, evaluate, sample_tokens


def tiny_model(dsa=None, seed=0):
    torch.manual_seed(seed)
    cfg = GLMConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=8, dsa=dsa)
    m = GLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return m


def test_sample_tokens_logprobs_and_top_p():
    logits = torch.randn(5, 40) * 3
    tok, lp = sample_tokens(logits, SamplingParams(temperature=0.7), torch.Generator().manual_seed(0))
    ref = (logits.double() / 0.7).log_softmax(-1).gather(-1, tok[:, None])[:, 0]
    assert torch.allclose(lp.double(), ref, atol=1e-5)
    # top_p so small that only the most likely token survives
    tok, _ = sample_tokens(logits, SamplingParams(temperature=1.0, top_p=1e-6), torch.Generator().manual_seed(0))
    assert torch.equal(tok, logits.argmax(-1))
    tok, lp = sample_tokens(logits, SamplingParams(temperature=0))
    assert torch.equal(tok, logits.argmax(-1))


@pytest.mark.parametrize("dsa", [None, {"topk": 3, "heads": 2, "head_dim": 8, "rope_dim": 4, "pattern": "FS"}])
def test_greedy_generation_matches_full_forward_reference(dsa):
    """Batched, left-padded, cached decoding (with DSA: sparse decode beyond top-k) gives the tokens and
    logprobs a naive loop of full forwards without a cache gives, row by row."""
    model = tiny_model(dsa).eval()
    engine = TorchEngine(model, max_batch=2)  # 3 prompts -> two batches
    prompts = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12]]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=8))
    for p, out in zip(prompts, outs):
        ids, lps = list(p), []
        with torch.no_grad():
            for _ in range(8):
                logp = model(torch.tensor([ids]))[0, -1].log_softmax(-1)
                ids.append(int(logp.argmax()))
                lps.append(float(logp.max()))
        assert out.token_ids == ids[len(p):]
        assert out.logprobs == pytest.approx(lps, abs=1e-4)
        assert out.finish_reason == "length" and out.versions == (0, 0)


def test_stop_tokens_end_rows_independently():
    model = tiny_model()
    engine = TorchEngine(model)
    greedy = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=6))[0].token_ids
    stop = greedy[2]
    out = engine.generate([[1, 2, 3], [7, 8]], SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=(stop,)))
    first = out[0]
    assert first.finish_reason == "stop" and first.token_ids == greedy[:greedy.index(stop) + 1]
    assert len(first.logprobs) == len(first.token_ids)
    assert out[1].token_ids == engine.generate([[7, 8]], SamplingParams(temperature=0, max_new_tokens=6,
                                                                      stop_token_ids=(stop,)))[0].token_ids


def test_sampling_is_reproducible_with_a_seed():
    engine = TorchEngine(tiny_model())
    sp = SamplingParams(temperature=1.0, max_new_tokens=6)
    a = engine.generate([[1, 2], [3]] * 3, sp, seed=11)
    b = engine.generate([[1, 2], [3]] * 3, sp, seed=11)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]


def slow(engine, delay=0.02):
    forward = engine.model.forward
    engine.model.forward = lambda *a, **k: (time.sleep(delay), forward(*a, **k))[1]
    return engine


@pytest.mark.parametrize("partial", [True, False])
def test_weight_update_lands_between_decode_steps(partial):
    old, new = tiny_model(seed=0), tiny_model(seed=1)
    engine = slow(TorchEngine(old, partial_rollout=partial))
    result = {}
    t = threading.Thread(target=lambda: result.update(out=engine.generate([[1, 2, 3]] * 2, SamplingParams(max_new_tokens=30))))
    t.start()
    time.sleep(0.15)
    engine.update_weights(((n, p.detach()) for n, p in new.named_parameters()), version=1)
    t.join()
    assert engine.version == 1
    assert torch.equal(old.lm_head.weight, new.lm_head.weight)  # copied in place
    for c in result["out"]:
        if partial:  # continued under the new weights; the sample spans both versions
            assert c.versions == (0, 1) and c.finish_reason == "length" and len(c.token_ids) == 30
        else:  # aborted at the update, to be regenerated
            assert c.finish_reason == "abort" and 0 < len(c.token_ids) < 30


def make_generator(max_staleness, reward_fn=None, dynamic=False, n=2, engine=None):
    tok = make_tiny_tokenizer()
    examples = [{"prompt": f"{a}+1=", "label": str(a + 1)} for a in range(10)]
    engine = engine or TorchEngine(tiny_model_for(tok))
    return Generator(engine, PromptStream(examples, seed=0), tok, prompts_per_step=2, n=n,
                     sampling=SamplingParams(max_new_tokens=4, stop_token_ids=(tok.eos_token_id,)),
                     max_staleness=max_staleness, dynamic_sampling=dynamic, chat_template=True,
                     max_prompt_tokens=32, reward_fn=reward_fn or (lambda text, label: 0.0))


def tiny_model_for(tok):
    torch.manual_seed(0)
    return GLM(GLMConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=8))


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
            assert gen.index <= step + 1 + staleness
            gen.publish([], version=step + 1)
    finally:
        gen.stop()
    assert not gen.thread.is_alive()


def test_dynamic_sampling_drops_uniform_groups_and_refills():
    # prompts "0+1=".."9+1=": labels 3 and 5 get all-zero groups, the others one right answer in two
    seen = {}

    def reward(text, label):
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


def test_generator_error_surfaces_at_once():
    def boom(text, label):
        raise ZeroDivisionError("grader exploded")

    gen = make_generator(1, reward_fn=boom)
    gen.start()
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="generator thread failed") as e:
        gen.get(timeout=30)
    assert isinstance(e.value.__cause__, ZeroDivisionError) and time.perf_counter() - t0 < 10
    gen.stop()


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


def test_evaluate_reports_accuracy_and_pass_at_k():
    tok = make_tiny_tokenizer()
    engine = TorchEngine(tiny_model_for(tok))
    examples = [{"prompt": "1+1=", "label": "2"}, {"prompt": "2+2=", "label": "4"}]
    calls = iter([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    m = evaluate(engine, examples, tok, n=4, sampling=SamplingParams(max_new_tokens=3), chat_template=True,
                 max_prompt_tokens=32, reward_fn=lambda text, label: next(calls))
    assert m["accuracy"] == pytest.approx(1 / 8) and m["pass@4"] == pytest.approx(0.5)
    assert m["pass@1"] == pytest.approx(1 / 8)
