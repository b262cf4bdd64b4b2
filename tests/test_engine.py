"""engine.py: the sampler against exact distributions, the torch engine against a naive full-forward
reference (dense and DSA, fp32 and bf16, CUDA-graph buckets), retraction, weight updates mid-batch, host
reads, one call at a time; the SGLang adapter against a fake sglang module."""
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import pickle
import sys
import threading
import time
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from machinery import engine as engine_mod
from machinery import parallel
from machinery.engine import Completion, SamplingParams, SGLangEngine, TorchEngine, sample_tokens
from machinery.memory import memory_plan
from model import GLM, GLMConfig, hf_name


def tiny_model(dsa=None, seed=0):
    torch.manual_seed(seed)
    cfg = GLMConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=8, dsa=dsa)
    m = GLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return m


def keys(n, step=0):
    return engine_mod.sample_keys(torch.arange(n) * 7919 % 2**32, torch.full((n,), step))


def test_sample_tokens_logprobs_and_top_p():
    logits = torch.randn(5, 40) * 3
    tok, lp = sample_tokens(logits, SamplingParams(temperature=0.7), keys(5))
    ref = (logits.double() / 0.7).log_softmax(-1).gather(-1, tok[:, None])[:, 0]
    assert torch.allclose(lp.double(), ref, atol=1e-5)
    # top_p so small that only the most likely token survives
    tok, _ = sample_tokens(logits, SamplingParams(temperature=1.0, top_p=1e-6), keys(5))
    assert torch.equal(tok, logits.argmax(-1))
    tok, lp = sample_tokens(logits, SamplingParams(temperature=0), keys(5))
    assert torch.equal(tok, logits.argmax(-1))


def key_with_a_full_hash(V):
    """A noise key for which one token id's hash has its top 24 bits all set, and that token: the draw
    whose uniform, taken from 24 bits, would round to 1.0 (noise +inf)."""
    vh = engine_mod._vocab_hash(V, torch.device("cpu"))
    for key in range(5000):
        hit = ((engine_mod._mix32(torch.tensor(key) ^ vh) >> 8) == 2**24 - 1).nonzero()
        if len(hit):
            return key, int(hit[0, 0])


def test_sampling_noise_is_finite_for_every_token():
    """At GLM's vocabulary about one row-step in 110 has such a token; its noise must stay finite, so a
    token with logit -60 is not drawn (it was, whenever its hash came up: a random token in every ~110)."""
    V = 151552
    key, tok = key_with_a_full_hash(V)
    logits = torch.zeros(1, V)
    logits[0, tok] = -60.0
    drawn, lp = sample_tokens(logits, SamplingParams(temperature=1.0), torch.tensor([key]))
    assert int(drawn) != tok and lp.item() == pytest.approx(-math.log(V - 1 + math.exp(-60)), abs=1e-4)


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_hashed_gumbel_sampling_draws_from_the_tempered_distribution(top_p):
    """Token frequencies over 40000 keys (rows x steps) match softmax(logits / T), renormalised over the
    top-p set when truncated (float64 reference), within 5 standard errors; and a key always draws the same."""
    logits = torch.randn(1, 12) * 2
    p = (logits[0].double() / 1.5).softmax(-1)
    if top_p < 1:
        sp, order = p.sort(descending=True)
        p = torch.zeros_like(p).scatter(0, order, sp * (sp.cumsum(0) - sp <= top_p))
        p = p / p.sum()
    sampling = SamplingParams(temperature=1.5, top_p=top_p)
    counts = torch.zeros(12, dtype=torch.float64)
    for step in range(4):
        tok, _ = sample_tokens(logits.expand(10000, 12), sampling, keys(10000, step))
        counts += torch.bincount(tok, minlength=12)
    freq, se = counts / 40000, (p * (1 - p) / 40000).sqrt()
    assert ((freq - p).abs() <= 5 * se + 1e-12).all(), (freq, p)
    assert torch.equal(sample_tokens(logits.expand(3, 12), sampling, keys(3, 9))[0],
                       sample_tokens(logits.expand(3, 12), sampling, keys(3, 9))[0])


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dsa", [None, {"topk": 3, "heads": 2, "head_dim": 8, "rope_dim": 4, "pattern": "FS"}])
def test_greedy_generation_matches_full_forward_reference(dsa, dtype, graphs, monkeypatch):
    """Batched, left-padded, cached decoding (with DSA: sparse decode beyond top-k) gives the tokens and
    logprobs a naive loop of full forwards without a cache gives, row by row; also in bf16 weights, as
    the generator runs on a GPU (the same bf16 model on both sides). graphs: every step runs padded to
    a CUDA-graph bucket (eagerly on a CPU): 3 rows as 4, key lists as 8, 16 or 22 slots (the longest)."""
    monkeypatch.setattr(engine_mod, "GRAPH_MIN_KEYS", 8)
    shapes, run = [], engine_mod.DecodeGraphs.run
    monkeypatch.setattr(engine_mod.DecodeGraphs, "run", lambda g, tok, pos, keys, valid, Bg:
                        shapes.append((len(tok), Bg, keys.shape[1])) or run(g, tok, pos, keys, valid, Bg))
    model = tiny_model(dsa).eval().to(dtype)
    engine = TorchEngine(model, max_batch=4 if graphs else 2, graphs=graphs)  # finished rows are refilled
    prompts = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12], [1] * 17, [7]]
    lengths = [8, 3, 6, 5, 20]  # the last one crosses a KV block boundary
    outs = engine.generate(prompts, [SamplingParams(temperature=0, max_new_tokens=n) for n in lengths])
    ref_model, tol = tiny_model(dsa).double(), (1e-6 if dtype == torch.float32 else 6e-2)
    if dtype != torch.float32:  # the float64 reference holds the bf16-rounded weights
        ref_model.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    for p, n, out in zip(prompts, lengths, outs):
        assert out.finish_reason == "length" and out.versions == (0, 0) and len(out.token_ids) == n
        # The reference: float64 full forwards, fed the engine's tokens (a naive loop, when they agree)
        with torch.no_grad():
            logp = ref_model(torch.tensor([p + out.token_ids]))[0, len(p) - 1:-1].log_softmax(-1)  # [n, V]
        chosen = logp.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        # greedy: the engine's token is the reference's argmax, up to ties within the dtype's rounding
        assert (logp.max(-1).values - chosen <= tol).all(), (logp.max(-1).values - chosen)
        assert out.logprobs == pytest.approx(chosen.tolist(), abs=1e-5 if dtype == torch.float32 else 6e-2)
    assert engine.stats["prefills"] >= 2  # requests were admitted as rows freed up
    assert len(engine.pool.free) == engine.pool.num_blocks  # every block is back
    assert engine.stats["graph_steps"] == len(shapes) == (engine.stats["iterations"] - 1 if graphs else 0)
    if graphs:  # padding rows and left-padded keys were both exercised
        assert (3, 4, 16) in shapes and {w for _, _, w in shapes} == {8, 16, 22}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dsa", [None, {"topk": 3, "heads": 2, "head_dim": 8, "rope_dim": 4, "pattern": "FS"}])
def test_fp8_publish_then_decode(dsa, dtype):
    """rollout.quantization: fp8. The learner publishes through parallel.full_weights(..., "fp8") into an engine
    whose decoder linears are fp8.FP8Linear: the engine then holds exactly fp8.quantize of the learner's weights
    (cast to the engine's dtype first), and every other tensor (embeddings, norms, lm_head, the whole DSA
    indexer) exactly as published, unquantized. Decoding then gives the tokens and logprobs of a naive loop of
    full forwards of that fp8 model: the cache, the batching and the fp8 matmuls agree."""
    from machinery import fp8
    learner = tiny_model(dsa)
    gen = fp8.quantize_model_(tiny_model(dsa, seed=1).eval().cast_(dtype))  # weights the publish replaces
    engine = TorchEngine(gen, max_batch=2)
    engine.update_weights(parallel.full_weights(learner, dtype, "fp8"), 1)
    params = dict(gen.named_parameters())
    assert {n for n in params if n.endswith("_scale_inv")} == {n + "_scale_inv" for n, _ in learner.named_parameters()
                                                               if fp8.is_quantized(n)}
    for name, p in learner.named_parameters():
        if fp8.is_quantized(name):
            q, s = fp8.quantize(p.detach().to(dtype))
            assert params[name].dtype == torch.float8_e4m3fn and torch.equal(params[name].view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(params[name + "_scale_inv"], s), name
        else:
            assert not name.startswith("layers.") or ".indexer." in name or "norm" in name or name.endswith(".bias"), name
            assert torch.equal(params[name], p.detach().to(params[name].dtype)), name  # the indexer untouched
    prompts, lengths = [[5, 6, 7, 8, 9], [3, 4], [1] * 17], [8, 3, 20]
    outs = engine.generate(prompts, [SamplingParams(temperature=0, max_new_tokens=n) for n in lengths])
    for p, n, out in zip(prompts, lengths, outs):
        assert len(out.token_ids) == n and out.versions == (1, 1)
        with torch.no_grad():
            logp = gen(torch.tensor([p + out.token_ids]))[0, len(p) - 1:-1].float().log_softmax(-1)  # [n, V]
        chosen = logp.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        tol = 1e-5 if dtype == torch.float32 else 6e-2
        assert (logp.max(-1).values - chosen <= tol).all()
        assert out.logprobs == pytest.approx(chosen.tolist(), abs=tol)


@pytest.mark.parametrize("graphs", [False, True])
def test_blocks_run_out_rows_are_retracted_and_continue_exactly(graphs):
    """A pool too small for every row at once: the newest rows are retracted (blocks freed) and prefilled
    again later from prompt + tokens so far; tokens and logprobs equal those of an unconstrained engine,
    greedy and sampled (the noise depends on the request and step only), also with padded graph buckets
    (the padding rows use the scratch slot, never a block a row could be given)."""
    model = tiny_model({"topk": 3, "heads": 2, "head_dim": 8, "rope_dim": 4, "pattern": "FS"})
    prompts = [[5, 6, 7], [3, 4], [10, 11, 12, 13], [9, 8]] * 2
    for sampling in (SamplingParams(temperature=0, max_new_tokens=40), SamplingParams(temperature=1.0, max_new_tokens=40)):
        free = TorchEngine(model, max_batch=8).generate(prompts, sampling, seed=3)
        tight = TorchEngine(model, max_batch=8, kv_tokens=8 * engine_mod.BLOCK_SIZE, graphs=graphs)
        outs = tight.generate(prompts, sampling, seed=3)
        assert tight.stats["retracted"] > 0 and len(tight.pool.free) == tight.pool.num_blocks
        assert [c.token_ids for c in outs] == [c.token_ids for c in free]
        for a, b in zip(outs, free):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        tight.generate([[1] * 200], SamplingParams(max_new_tokens=1))


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
    """Same seed, same tokens, whatever the batch composition (max_batch 1 or 6); another seed differs.
    With 6 rows the three requests of each prompt share one prefill (3 tokens run, not 9), and each row
    then decodes from its own copy of the keys."""
    sp = SamplingParams(temperature=1.0, max_new_tokens=6)
    shared, alone = TorchEngine(tiny_model()), TorchEngine(tiny_model(), max_batch=1)
    a = shared.generate([[1, 2], [3]] * 3, sp, seed=11)
    b = alone.generate([[1, 2], [3]] * 3, sp, seed=11)
    c = TorchEngine(tiny_model()).generate([[1, 2], [3]] * 3, sp, seed=12)
    assert [x.token_ids for x in a] == [x.token_ids for x in b] != [x.token_ids for x in c]
    # fp32 logprobs of one request differ by a few roundings between batch shapes (the matmul kernels differ)
    assert [lp for x in a for lp in x.logprobs] == pytest.approx([lp for x in b for lp in x.logprobs], abs=1e-5)
    assert shared.stats["prefill_tokens"] == 3 and alone.stats["prefill_tokens"] == 9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_prefill_writes_every_requests_keys(dtype):
    """Three requests with one prompt: the prompt runs once, and each request's own block gets the same
    keys and values (and DSA indexer keys), in the generator's dtypes too."""
    model = tiny_model({"topk": 2, "heads": 2, "head_dim": 8, "rope_dim": 4, "pattern": "FS"}).to(dtype)
    engine = TorchEngine(model, max_batch=3, kv_tokens=8 * engine_mod.BLOCK_SIZE)  # blocks to spare: one prefill
    engine.generate([[5, 6, 7]] * 3, SamplingParams(temperature=0, max_new_tokens=1))
    assert engine.stats["prefill_tokens"] == 3
    B = engine_mod.BLOCK_SIZE  # the three requests took blocks 0, 1 and 2; one token sampled, no decode step
    for store in (engine.pool.k, engine.pool.v, [t for t in engine.pool.index_k if t is not None]):
        for t in store:
            assert t.dtype == dtype and t[:3].abs().sum() > 0
            assert torch.equal(t[B:B + 3], t[:3]) and torch.equal(t[2 * B:2 * B + 3], t[:3])


class HostReads(TorchDispatchMode):
    """Records each op that makes the host wait for a GPU: reading a value (item, int, bool: aten's
    _local_scalar_dense) and ops whose output size depends on the data (nonzero, boolean indexing,
    masked_select, unique, repeat_interleave without output_size). tolist, cpu and numpy, which do not
    dispatch on a CPU tensor, are patched to record too, and so are host-to-device copies that would wait
    on CUDA: torch.tensor / as_tensor straight onto a device, and Tensor.to(device) without non_blocking
    (model.to_device pins and does not wait)."""
    SYNCS = ("_local_scalar_dense", "nonzero", "masked_select", "unique")

    def __init__(self, monkeypatch):
        super().__init__()
        self.seen, self.paused = [], 0
        for name in ("tolist", "cpu", "numpy"):
            method = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _m=method, _n=name, **k: self.note(_n) or _m(t, *a, **k))
        for name in ("tensor", "as_tensor"):
            make = getattr(torch, name)
            monkeypatch.setattr(torch, name, lambda *a, _m=make, _n=name, **k: (k.get("device") is not None
                                                                                 and self.note(_n + "(device=)")) or _m(*a, **k))
        to = torch.Tensor.to

        def to_device(t, *a, **k):
            if (k.get("device") is not None or any(isinstance(x, (str, torch.device)) for x in a)) and not k.get("non_blocking"):
                self.note("to(device)")
            return to(t, *a, **k)
        monkeypatch.setattr(torch.Tensor, "to", to_device)

    def note(self, name):
        if not self.paused:
            self.seen.append(name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        data_sized = (name.startswith("repeat_interleave") and (kwargs or {}).get("output_size") is None
                      or name.startswith("index.") and any(i is not None and i.dtype == torch.bool for i in args[1]))
        if name.split(".")[0] in self.SYNCS or data_sized:
            self.note(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("graphs", [False, True])
def test_one_host_read_per_iteration(monkeypatch, graphs):
    """Host work per step: an iteration (admission, prefill, decode step, sampling, finished rows) reads
    the device once, in _read; the finished rows' tokens travel with it (_land reads the copies that
    arrived). Nothing else in a step waits on the device: not the block bookkeeping, the prefill's
    packing (grouped from host positions: Packed.of(..., device=)), the copies of host lists to the device
    (model.to_device), RoPE's tables, DSA's top-k, the sampler (top-p too) or the stop check. Prompts of different lengths finish at different steps, so rows leave and
    waiting requests join mid-call. graphs: the padding of CUDA-graph buckets adds no read either."""
    model = tiny_model({"topk": 2, "heads": 2, "head_dim": 8, "rope_dim": 4, "pattern": "FS"})
    engine = TorchEngine(model, max_batch=4, graphs=graphs)
    reads = HostReads(monkeypatch)
    reads.paused = 1  # watched: inside a step, outside the sanctioned read and host-side packing

    def around(method, delta, tag=None):  # delta -1: watch inside the call, +1: do not
        def wrapped(*a, **k):
            reads.paused += delta
            try:
                return method(*a, **k)
            finally:
                reads.paused -= delta
                if tag:
                    reads.seen.append(tag)
        return wrapped

    def packed_of(positions, device=None, _of=engine_mod.Packed.of):  # grouping host positions is host work
        return (around(_of, +1) if device is not None else _of)(positions, device=device)
    monkeypatch.setattr(TorchEngine, "_step", around(TorchEngine._step, -1))
    monkeypatch.setattr(TorchEngine, "_read", around(TorchEngine._read, +1, tag="_read"))
    monkeypatch.setattr(TorchEngine, "_land", around(TorchEngine._land, +1))
    monkeypatch.setattr(engine_mod.Packed, "of", packed_of)
    prompts = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10], [11], [12, 13]] * 2
    sampling = [SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=n, stop_token_ids=(3,))
                for n in (2, 9, 5, 17, 3, 6) * 2]
    with reads:
        out = engine.generate(prompts, sampling, seed=0)
    assert [c.finish_reason for c in out].count("length") > 0 and engine.stats["prefills"] > 1
    assert engine.stats["retracted"] == 0 and (engine.stats["graph_steps"] > 0) == graphs
    assert reads.seen == ["_read"] * engine.stats["iterations"]


def slow(engine, delay=0.02):
    forward = engine.model.forward
    engine.model.forward = lambda *a, **k: (time.sleep(delay), forward(*a, **k))[1]
    return engine


def test_weight_update_lands_between_decode_steps():
    """Weights published mid-batch (the Generator's partial_rollout mode) take effect at the next decode
    step: the batch continues under them, and each sample records the versions it spans."""
    old, new = tiny_model(seed=0), tiny_model(seed=1)
    engine = slow(TorchEngine(old))
    result = {}
    t = threading.Thread(target=lambda: result.update(out=engine.generate([[1, 2, 3]] * 2, SamplingParams(max_new_tokens=30))))
    t.start()
    time.sleep(0.15)
    engine.update_weights(((n, p.detach()) for n, p in new.named_parameters()), version=1)
    t.join()
    assert engine.version == 1
    assert torch.equal(old.lm_head.weight, new.lm_head.weight)  # copied in place
    for c in result["out"]:
        assert c.versions == (0, 1) and c.finish_reason == "length" and len(c.token_ids) == 30


@pytest.mark.parametrize("reprefill", [False, True])
def test_weight_update_keeps_kv_or_reprefills(reprefill):
    """An update to the very same weights mid-generation: keeping the KV or prefilling every running row
    again under the "new" weights must give exactly the greedy tokens of an undisturbed run."""
    model = tiny_model()
    sp = SamplingParams(temperature=0, max_new_tokens=30)
    ref = TorchEngine(tiny_model()).generate([[1, 2, 3], [4, 5]], sp)
    engine = slow(TorchEngine(model, reprefill=reprefill))
    result = {}
    t = threading.Thread(target=lambda: result.update(out=engine.generate([[1, 2, 3], [4, 5]], sp)))
    t.start()
    time.sleep(0.15)
    engine.update_weights(((n, p.detach().clone()) for n, p in model.named_parameters()), version=1)
    t.join()
    assert [c.token_ids for c in result["out"]] == [c.token_ids for c in ref]
    assert all(c.versions == (0, 1) for c in result["out"])
    assert (engine.stats["retracted"] > 0) == reprefill


def graph_engine(model, capture, **kw):
    """A TorchEngine whose decode graphs (for calls of up to 64 tokens a sequence) capture or not, on any device."""
    engine = TorchEngine(model, graphs=True, **kw)
    engine._open(SamplingParams(), 64, 63)
    engine.graphs.capture = capture
    return engine


def test_graph_capture_falls_back_to_eager_on_a_bad_replay_or_an_error(monkeypatch):
    """The capture guard, with torch.cuda's graph and stream calls faked on a CPU: a replay whose logits
    differ from the eager run's (one that never ran the forward, or one that gives NaN) or a capture that
    raises turns graphs off with one warning and drops them, and generation goes on eagerly with the
    tokens of a plain engine. The first capture is of the largest bucket, with thread-local errors."""
    captured = []

    class Graph:  # "captures" nothing: the logits buffer keeps what capture_end left there
        def capture_begin(self, pool=None, capture_error_mode="global"):
            captured.append(capture_error_mode)
            if mode == "raise":
                raise RuntimeError("operation not permitted when stream is capturing\nmore")

        def capture_end(self):
            graphs.logits.fill_(0.0 if mode == "stale" else float("nan"))

        def pool(self):
            return "pool"

        def replay(self):
            pass

    class Stream:
        def __init__(self, device=None):
            pass

        def wait_stream(self, other):
            pass
    sp = SamplingParams(temperature=1.0, max_new_tokens=12)
    ref = TorchEngine(tiny_model()).generate([[1, 2, 3], [4, 5]], sp, seed=5)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    capture = engine_mod.DecodeGraphs._capture
    monkeypatch.setattr(engine_mod.DecodeGraphs, "_capture", lambda g, Bg, Lg: captured.append((Bg, Lg)) or capture(g, Bg, Lg))
    for mode in ("stale", "nan", "raise"):
        captured.clear()
        engine = graph_engine(tiny_model(), capture=True)  # as if on a GPU
        graphs = engine.graphs
        with pytest.warns(RuntimeWarning, match="decoding eagerly from now on") as w:
            out = engine.generate([[1, 2, 3], [4, 5]], sp, seed=5)
        assert len(w) == 1 and graphs.failed and graphs.graphs == {} and graphs.mempool is None
        assert captured == [(graphs.rows[-1], graphs.max_keys), "thread_local"]  # the largest bucket, first
        assert [c.token_ids for c in out] == [c.token_ids for c in ref]
        assert [x for c in out for x in c.logprobs] == pytest.approx([x for c in ref for x in c.logprobs], abs=1e-6)
    assert "RuntimeError: operation not permitted" in str(w[0].message)


def test_graph_buffers_are_what_the_memory_plan_counts():
    """--dry-run's CUDA-graph items against what DecodeGraphs allocates: tokens and positions [B], key slots
    and masks [B, S], logits [B, V] in the generator's bf16 (no such items without graphs); and its KV pool
    item against the pool the engine made for B rows of S tokens."""
    model = tiny_model().to(torch.bfloat16)
    B, S = 3, 40
    engine = TorchEngine(model, max_batch=B, graphs=True)
    engine._open(SamplingParams(), S, S - 10)
    g = engine.graphs
    real = sum(t.numel() * t.element_size() for t in (g.tok, g.pos, g.keys, g.valid, g.logits))
    plan = memory_plan(model.cfg, learner_gpus=1, parallel="fsdp", micro_batch_tokens=64, gradient_checkpointing=True,
                       trainable_indexer=False, reference=False, generator_batch=B, generator_max_len=S,
                       max_new_tokens=30, engine="torch", cuda_graphs=True)
    assert dict(plan.generator)[f"CUDA graphs' inputs [{B}, {S}] and logits [{B}, V]"] == real
    pool = engine.pool  # and the KV pool the engine made: B rows of S tokens in whole blocks, and the scratch block
    slots = pool.k[0].shape[0]
    assert dict(plan.generator)[f"paged KV pool bf16, {slots} token slots (rollout and eval, one at a time)"] == sum(
        t.numel() * t.element_size() for t in pool.k + pool.v + [t for t in pool.index_k if t is not None])
    assert not any("CUDA graphs" in item for item, _ in memory_plan(
        model.cfg, **{**dict(learner_gpus=1, parallel="fsdp", micro_batch_tokens=64, gradient_checkpointing=True,
                         trainable_indexer=False, reference=False, generator_batch=B, generator_max_len=S,
                         max_new_tokens=30, engine="torch")}).generator)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dsa", [None, {"topk": 3, "heads": 2, "head_dim": 8, "rope_dim": 4, "pattern": "FS"}])
def test_cuda_graph_replays_give_the_eager_tokens(dsa, monkeypatch):
    """On a GPU, bf16: captured and replayed decode steps give exactly the tokens and logprobs of the same
    padded buckets run eagerly (fixed seed, sampled), every bucket passes the capture guard, and a weight
    update mid-call reaches the graphs (they read the weights in place)."""
    monkeypatch.setattr(engine_mod, "GRAPH_MIN_KEYS", 8)
    sp = SamplingParams(temperature=1.0, max_new_tokens=24)
    prompts = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12], [1] * 17, [7]] * 3
    outs = []
    for capture in (False, True):
        engine = graph_engine(tiny_model(dsa).to("cuda", torch.bfloat16), capture, max_batch=6)
        outs.append(engine.generate(prompts, sp, seed=9))
    assert not engine.graphs.failed and len(engine.graphs.graphs) >= 4
    assert [c.token_ids for c in outs[0]] == [c.token_ids for c in outs[1]]
    assert [c.logprobs for c in outs[0]] == [c.logprobs for c in outs[1]]
    new = tiny_model(dsa, seed=1).to("cuda", torch.bfloat16)
    engine.update_weights(((n, p.detach()) for n, p in new.named_parameters()), version=1)
    after = engine.generate(prompts, sp, seed=9)
    fresh = graph_engine(tiny_model(dsa, seed=1).to("cuda", torch.bfloat16), False, max_batch=6)
    assert [c.token_ids for c in after] == [c.token_ids for c in fresh.generate(prompts, sp, seed=9)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("graphs", [False, True])
def test_cuda_prefill_and_decode_never_wait_for_the_device(graphs, monkeypatch):
    """On a GPU, with CUDA's sync debug mode set to "error" around every prefill and decode step (forward,
    sampling, bookkeeping): nothing there waits for the device; the iteration's one read is outside them.
    A first call captures the graphs (capture synchronizes), the second, watched, replays them."""
    engine = TorchEngine(tiny_model({"topk": 3, "heads": 2, "head_dim": 8, "rope_dim": 4, "pattern": "FS"}).to(
        "cuda", torch.bfloat16), max_batch=4, graphs=graphs)
    prompts = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12], [1] * 17, [7]] * 2
    sp = [SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=n) for n in (8, 3, 6, 5, 20) * 2]
    first = engine.generate(prompts, sp, seed=2)

    def watched(method):
        def run(*a, **k):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return method(*a, **k)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return run
    monkeypatch.setattr(engine, "_prefill", watched(engine._prefill))
    monkeypatch.setattr(engine, "_decode", watched(engine._decode))
    steps = engine.stats["graph_steps"]
    assert [c.token_ids for c in engine.generate(prompts, sp, seed=2)] == [c.token_ids for c in first]
    assert (engine.stats["graph_steps"] > steps) == graphs


def test_engine_runs_one_call_at_a_time_in_one_pool():
    """Eval (learner thread) and rollouts (generator thread) share the engine: their calls take turns in
    one KV pool (the memory plan counts one), and a call's rows never depend on another call's timing."""
    engine = slow(TorchEngine(tiny_model(), max_batch=2), delay=0.005)
    live, peak, lock = [0], [0], threading.Lock()
    inner = engine._open

    pools = set()

    def counted(*a):  # a call opens ...
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        inner(*a)
        pools.add(id(engine.pool))
    close = engine._close

    def closed():  # ... and closes
        with lock:
            live[0] -= 1
        close()
    engine._open, engine._close = counted, closed
    threads = [threading.Thread(target=engine.generate, args=([[1, 2, 3]] * 4, SamplingParams(max_new_tokens=6)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak[0] == 1 and len(pools) == 1


# ----------------------------------------------------------------------------- sessions: agents' turns

DSA3 = {"topk": 3, "heads": 2, "head_dim": 8, "rope_dim": 4, "pattern": "FS"}


def run_session(engine, turns, longest=64, max_new=6, temperature=0.0):
    """Play trajectories through one session: turns[k] lists trajectory k's env messages as token ids; each
    trajectory's next turn is submitted when its previous one ends, its context being everything so far plus
    the env's ids. Returns each trajectory's contexts and completions, turn by turn."""
    sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new)
    ctx = [list(t[0]) for t in turns]
    out = [[] for _ in turns]
    with engine.session(sampling, longest) as call:
        owner = {call.submit(ctx[k], max_new, 1000 + k, key=k): k for k in range(len(turns))}
        while call.busy:
            for i, c in call.step():
                k = owner.pop(i)
                out[k].append((list(ctx[k]), c))
                ctx[k] += c.token_ids
                if len(out[k]) < len(turns[k]):
                    ctx[k] += turns[k][len(out[k])]
                    owner[call.submit(ctx[k], max_new, 1000 + k + 17 * len(out[k]), key=k)] = k
                else:
                    call.end(k)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dsa", [None, DSA3])
def test_a_turn_extends_its_parked_prefix_as_a_full_prefill_would(dsa, dtype):
    """A trajectory's next turn prefills only its new tokens on top of its parked KV (dense, and DSA whose
    indexer keys extend too). Its completion is checked against a float64 full forward of the whole
    context fed the engine's tokens (greedy: the engine's token is the argmax up to the dtype's ties), and
    against a fresh engine that prefills the whole context: in fp32 the same tokens, logprobs within 1e-5; in
    bf16 within 6e-2 (top-k and argmax may flip near ties). A row freed while its trajectory waits is
    decoding others: three trajectories run in two rows."""
    model = tiny_model(dsa).eval().to(dtype)
    engine = TorchEngine(model, max_batch=2)
    turns = [[[5, 6, 7, 8, 9], [3, 4, 30], [11]], [[3, 4], [7, 7, 7, 7, 7, 7, 7, 7]], [[10, 11, 12], [1, 2]]]
    out = run_session(engine, turns)
    s = engine.stats
    assert s["parked"] == 7 and s["extends"] >= 1 and s["evicted"] == 0
    # every later turn ran only its new tokens: the last sampled token (never fed) plus the env's ids
    assert s["extend_tokens"] == sum(len(t) + 1 for tr in turns for t in tr[1:])
    assert s["prefill_tokens"] == s["extend_tokens"] + sum(len(tr[0]) for tr in turns)
    assert len(engine.pool.free) == engine.pool.num_blocks  # ended trajectories gave their blocks back
    ref_model = tiny_model(dsa).double()
    ref_model.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    fresh = TorchEngine(tiny_model(dsa).eval().to(dtype), max_batch=4)
    # bf16 against float64: 6e-2 as decoding (test above); with DSA 0.25, as a top-k choice near a tie may flip,
    # which the bf16 full prefill does at the same token (seen here: 0.166 for both)
    tol = 1e-5 if dtype == torch.float32 else 6e-2 if dsa is None else 0.25
    for k, traj in enumerate(out):
        for t, (ctx, c) in enumerate(traj):
            with torch.no_grad():
                logp = ref_model(torch.tensor([ctx + c.token_ids]))[0, len(ctx) - 1:-1].log_softmax(-1)
            chosen = logp.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            assert (logp.max(-1).values - chosen <= (1e-6 if dtype == torch.float32 else tol)).all()
            assert c.logprobs == pytest.approx(chosen.tolist(), abs=tol)
            (full,) = fresh.generate([ctx], SamplingParams(temperature=0, max_new_tokens=6))
            if dtype == torch.float32:
                assert full.token_ids == c.token_ids and full.logprobs == pytest.approx(c.logprobs, abs=1e-5)
            elif full.token_ids == c.token_ids:  # bf16: extending and a full prefill round apart, a little
                assert full.logprobs == pytest.approx(c.logprobs, abs=6e-2)


def test_parked_kv_is_evicted_first_and_evicted_turns_prefill_again():
    """A pool too small for every parked trajectory: parked KV is dropped (oldest first) before any running
    row is retracted, and an evicted trajectory's next turn prefills its whole context, giving exactly the
    tokens an unconstrained engine gives (sampled, fp32: the noise is per request)."""
    turns = [[[5 + k, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [3]] for k in range(4)]
    big = run_session(TorchEngine(tiny_model(DSA3).eval(), max_batch=4), turns, temperature=1.0)
    small = TorchEngine(tiny_model(DSA3).eval(), max_batch=4, kv_tokens=80)  # 5 blocks of 16 slots
    got = run_session(small, turns, temperature=1.0)
    assert small.stats["evicted"] > 0 and small.stats["retracted"] == 0
    assert [[c.token_ids for _, c in tr] for tr in got] == [[c.token_ids for _, c in tr] for tr in big]
    assert [x for tr in got for _, c in tr for x in c.logprobs] == pytest.approx([x for tr in big for _, c in tr for x in c.logprobs],
                                                                                abs=1e-5)
    assert len(small.pool.free) == small.pool.num_blocks


@pytest.mark.parametrize("reprefill", [False, True])
def test_a_weight_update_between_turns_keeps_or_drops_parked_kv(reprefill):
    """Weights published while a trajectory waits on its tool: its next turn records the new version; keep_kv
    extends the parked KV (computed by the old weights, as running rows keep theirs), reprefill drops it and
    prefills the whole context under the new weights. The same weights here, so the tokens equal an
    undisturbed session's either way."""
    def play(engine, update):
        sampling = SamplingParams(temperature=0, max_new_tokens=5)
        with engine.session(sampling, 40) as call:
            call.submit([5, 6, 7], 5, 0, key="a")
            first = [c for _ in iter(lambda: call.busy, False) for _, c in call.step()][0]
            if update:
                engine.update_weights(((n, p.detach().clone()) for n, p in engine.model.named_parameters()), version=1)
            call.submit([5, 6, 7] + first.token_ids + [3, 4], 5, 1, key="a", park=False)
            second = [c for _ in iter(lambda: call.busy, False) for _, c in call.step()][0]
        return first, second

    want = play(TorchEngine(tiny_model(DSA3).eval()), update=False)
    engine = TorchEngine(tiny_model(DSA3).eval(), reprefill=reprefill)
    first, second = play(engine, update=True)
    assert (first.token_ids, second.token_ids) == (want[0].token_ids, want[1].token_ids)
    assert first.versions == (0, 0) and second.versions == (1, 1)
    assert engine.stats["extends"] == (0 if reprefill else 1) and engine.stats["evicted"] == (1 if reprefill else 0)
    assert len(engine.pool.free) == engine.pool.num_blocks  # the last turn (park=False) freed its blocks at once


def test_a_context_that_does_not_extend_its_parked_tokens_prefills_whole():
    """TITO guard: if a trajectory's next context is not its parked tokens plus more (an env that rewrote the
    history), the parked KV is dropped and the whole context runs, never a stale prefix."""
    engine = TorchEngine(tiny_model().eval(), max_batch=2)
    sampling = SamplingParams(temperature=0, max_new_tokens=4)
    with engine.session(sampling, 32) as call:
        call.submit([5, 6, 7], 4, 0, key="a")
        while call.busy:
            call.step()
        assert list(call.parked) == ["a"]
        call.submit([5, 6, 8, 9], 4, 0, key="a")  # the history changed
        outs = []
        while call.busy:
            outs += call.step()
    assert engine.stats["extends"] == 0 and engine.stats["prefill_tokens"] == 3 + 4
    (ref,) = TorchEngine(tiny_model().eval()).generate([[5, 6, 8, 9]], sampling)
    assert outs[0][1].token_ids == ref.token_ids


# ----------------------------------------------------------------------------- SGLangEngine on a fake sglang

def model_dir(tmp_path, dsa=None):
    cfg = {"architectures": ["Glm4ForCausalLM"]} | ({"dsa": dsa} if dsa else {})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_sglang_missing_gives_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang raises ImportError
    with pytest.raises(ImportError, match=r"pip install -e '\.\[sglang\]' \(it is not installed\)"):
        SGLangEngine(model_dir(tmp_path), "cuda:0")


def test_sglang_refuses_cpu_and_dsa(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(ValueError, match="CUDA"):
        SGLangEngine(model_dir(tmp_path), "cpu")
    with pytest.raises(ValueError, match="engine: torch is the only engine that runs our DSA models"):
        SGLangEngine(model_dir(tmp_path, dsa={"topk": 4}), "cuda:0")
    with pytest.raises(ValueError, match="DSA"):
        SGLangEngine(model_dir(tmp_path), "cuda:0", dsa=True)
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    with pytest.raises(ValueError, match="SGLANG_RETURN_ORIGINAL_LOGPROB"):
        SGLangEngine(model_dir(tmp_path), "cuda:0")


def fake_serialize(chunk):  # pickle, which cannot load an fp8 storage back: fp8 tensors travel as their bytes
    return pickle.dumps([(n, t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t, t.dtype == torch.float8_e4m3fn)
                         for n, t in chunk])


def fake_deserialize(b):
    return [(n, t.view(torch.float8_e4m3fn) if is_fp8 else t) for n, t, is_fp8 in pickle.loads(b)]


class FakeTokenizerManager:
    """The TokenizerManager calls the adapter makes, as we read them in SGLang 0.5.9: new requests wait
    while paused, pause "retract" holds the running ones until continue_generation (they keep their
    tokens); update_weights_from_tensor takes one serialized [(name, tensor)] per TP rank and answers
    (success, message); abort_request(abort_all=True) makes every request inside return "abort"."""

    def __init__(self, session):
        self.paused, self.running, self.calls, self.weights = False, [], [], 0
        if session:  # newer SGLang: weight loads inside begin/end_weight_update
            self.begin_weight_update = lambda obj, request: self._log(("begin",))
            self.end_weight_update = lambda obj, request: self._log(("end",))

    async def _log(self, call):
        self.calls.append(call)
        return True, "Success"

    async def pause_generation(self, obj):
        self.calls.append(("pause", obj.mode))
        self.paused = True

    async def continue_generation(self, obj):
        self.calls.append(("continue",))
        self.paused = False

    async def update_weights_from_tensor(self, obj, request):
        (chunk,) = [fake_deserialize(b) for b in obj.serialized_named_tensors]
        # bf16 travels; with fp8, the quantized weights and their fp32 scales as they are
        assert all(t.dtype == (torch.float32 if n.endswith("_scale_inv") else torch.bfloat16) or t.dtype == torch.float8_e4m3fn
                   for n, t in chunk)
        self.weights += obj.flush_cache  # the fake model changes once the whole update has landed
        return await self._log(("update", [n for n, _ in chunk], obj.flush_cache, [t.dtype for _, t in chunk]))

    def abort_request(self, rid="", abort_all=False):
        self.calls.append(("abort",))
        for req in self.running:
            req["abort"] = True


class FakeEngine:
    """sglang.Engine as the adapter uses it: `loop`, `tokenizer_manager`, `async_generate(input_ids=,
    sampling_params=, return_logprob=True)` -> {"output_ids", "meta_info": {"finish_reason": {"type"},
    "output_token_logprobs": [(logprob, id, None)]}} with output_ids through the stop token, and the
    length checked before stop tokens. Its "model" emits last token + 1 + weight updates so far (mod 40),
    one token per `step` seconds, with logprob -0.5 per token."""
    step = 0.0
    last = None  # the latest instance, for the tests to inspect

    def __init__(self, **kwargs):
        self.kwargs, self.loop, self.shut = kwargs, asyncio.new_event_loop(), False
        session = hasattr(sys.modules["sglang.srt.managers.io_struct"], "BeginWeightUpdateReqInput")
        self.tokenizer_manager = FakeTokenizerManager(session)
        self.seen = []  # sampling params of every request
        FakeEngine.last = self

    async def async_generate(self, input_ids, sampling_params, return_logprob=False):
        tm, sp, req = self.tokenizer_manager, sampling_params, {"abort": False}
        self.seen.append(sp)
        while tm.paused:
            await asyncio.sleep(0.001)
        tm.running.append(req)
        ids, finish, last = [], {"type": "length"}, input_ids[-1]
        while not req["abort"]:
            last = (last + 1 + tm.weights) % 40
            ids.append(last)
            if len(ids) == sp["max_new_tokens"]:
                break
            if last in sp["stop_token_ids"]:
                finish = {"type": "stop", "matched": last}
                break
            await asyncio.sleep(self.step)
            while tm.paused and not req["abort"]:  # retracted until continue_generation
                await asyncio.sleep(0.001)
        if req["abort"]:
            finish = {"type": "abort", "message": "Abort"}
        tm.running.remove(req)
        return {"output_ids": ids, "meta_info": {"finish_reason": finish,
                                                 "output_token_logprobs": [(-0.5, t, None) for t in ids]}}

    def shutdown(self):
        self.shut = True


@pytest.fixture
def fake_sglang(monkeypatch):
    """Injects a fake `sglang` (Engine, srt.managers.io_struct, srt.utils.MultiprocessingSerializer). It
    tests our adapter against our reading of SGLang's API, not SGLang itself (which needs a GPU)."""
    io = types.ModuleType("sglang.srt.managers.io_struct")
    io.PauseGenerationReqInput = dataclasses.make_dataclass("PauseGenerationReqInput", [("mode", str, "abort")])
    io.ContinueGenerationReqInput = dataclasses.make_dataclass("ContinueGenerationReqInput", [])
    io.UpdateWeightsFromTensorReqInput = dataclasses.make_dataclass(
        "UpdateWeightsFromTensorReqInput", [("serialized_named_tensors", list), ("flush_cache", bool, True)])
    utils = types.ModuleType("sglang.srt.utils")
    utils.MultiprocessingSerializer = types.SimpleNamespace(serialize=fake_serialize)  # CUDA IPC handles in SGLang
    sgl, srt, managers = (types.ModuleType(n) for n in ("sglang", "sglang.srt", "sglang.srt.managers"))
    sgl.Engine, sgl.srt, srt.managers, srt.utils, managers.io_struct = FakeEngine, srt, managers, utils, io
    for m in (sgl, srt, managers, io, utils):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    monkeypatch.setattr(FakeEngine, "step", 0.0)
    engines = []

    def make(tmp_path, **kw):
        engine = SGLangEngine(model_dir(tmp_path), "cuda:1", **kw)
        engine.device = torch.device("cpu")  # the fake runs on CPU; the CUDA-only steps are skipped there
        engines.append(engine)
        return engine, FakeEngine.last

    yield make
    for e in engines:
        e.shutdown()


def test_sglang_engine_args_and_completions(tmp_path, fake_sglang):
    engine, fake = fake_sglang(tmp_path, max_batch=8)
    assert fake.kwargs | {"model_path": None} == {
        "model_path": None, "skip_tokenizer_init": True, "tp_size": 1, "base_gpu_id": 1, "dtype": "bfloat16",
        "random_seed": 0, "mem_fraction_static": 0.8, "max_running_requests": 8}
    sp = SamplingParams(temperature=0.7, max_new_tokens=4, stop_token_ids=(12,))
    stop, length = engine.generate([[1, 2, 9], [20]], sp)
    assert stop == Completion([10, 11, 12], [-0.5] * 3, "stop", (0, 0))  # the stop token is kept
    assert length == Completion([21, 22, 23, 24], [-0.5] * 4, "length", (0, 0))
    # SGLang says "length" when the stop token is also the last allowed one; TorchEngine says "stop"
    assert engine.generate([[9]], SamplingParams(max_new_tokens=3, stop_token_ids=(12,)))[0].finish_reason == "stop"
    assert fake.seen[0] == {"temperature": 0.7, "top_p": 1.0, "max_new_tokens": 4, "stop_token_ids": [12]}
    engine.generate([[1]] * 3, sp, seed=5)
    engine.generate([[1]] * 3, sp, seed=5)
    seeds = [s["sampling_seed"] for s in fake.seen[-6:]]
    assert seeds[:3] == seeds[3:] and len(set(seeds[:3])) == 3  # reproducible, distinct within a call
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate([[]], sp)
    engine.shutdown()
    assert fake.shut and not engine._thread.is_alive()


def test_sglang_session_drives_episodes_by_token_ids(tmp_path, fake_sglang):
    """env.py's episode loop on SGLang: a session takes requests while others run and returns each as it ends,
    with the completions generate() gives, each request's seed its sampling_seed; and a whole multi-turn episode
    loop runs on it (token ids in and out)."""
    from machinery import env
    engine, fake = fake_sglang(tmp_path, max_batch=8)
    sp = SamplingParams(temperature=0.7, max_new_tokens=4, stop_token_ids=(12,))
    with engine.session(sp, 64) as call:
        a = call.submit([1, 2, 9], 4, 5)
        got = {}
        while call.busy:
            for i, c in call.step():
                got[i] = c
                if i == a:
                    call.submit([20], 3, 2**40 + 6, key="t")  # submitted while the call runs; seeds kept to 31 bits
    assert got == {0: Completion([10, 11, 12], [-0.5] * 3, "stop", (0, 0)), 1: Completion([21, 22, 23], [-0.5] * 3, "length", (0, 0))}
    assert [s["sampling_seed"] for s in fake.seen] == [5, 6]

    from data import make_tiny_tokenizer
    tok = make_tiny_tokenizer(tools=True)
    from test_env import Scripted  # an observation after each turn but the last
    eps = [env.Episode({"prompt": "1+1=", "turns": 2}, 0)]
    sp = SamplingParams(max_new_tokens=8, stop_token_ids=(10,))  # the fake counts up from the context's last id
    ends = list(env.run_episodes(engine, eps, Scripted, tok, sp, env.Limits(8, 60, 3), seed=0))
    assert [i for i, _ in ends] == [0] and eps[0].turns == 2 and eps[0].failure is None and eps[0].reward == 1.0
    assert eps[0].response[:5] == [6, 7, 8, 9, 10]  # the first turn, through its stop token


@pytest.mark.parametrize("partial,session", [(True, False), (False, True)])
def test_sglang_weight_push_is_chunked_and_lazy(tmp_path, fake_sglang, partial, session):
    if session:
        io = sys.modules["sglang.srt.managers.io_struct"]
        io.BeginWeightUpdateReqInput = io.EndWeightUpdateReqInput = io.ContinueGenerationReqInput  # empty requests
    engine, fake = fake_sglang(tmp_path, partial_rollout=partial, update_chunk_bytes=2048)
    tm, params = fake.tokenizer_manager, list(tiny_model().named_parameters())
    pushed_before = []

    def lazy():  # like an FSDP gather: tensors are produced one at a time
        for name, p in params:
            pushed_before.append(sum(c[0] == "update" for c in tm.calls))
            yield name, p.detach()

    engine.update_weights(lazy(), version=3)
    updates = [c for c in tm.calls if c[0] == "update"]
    assert len(updates) > 2 and pushed_before[-1] > 0  # pushed while the generator was still running
    assert [c[2] for c in updates] == [False] * (len(updates) - 1) + [True]  # only the last one flushes
    names = [n for c in updates for n in c[1]]
    assert names == [hf_name(n) for n, _ in params]
    assert {"model.layers.0.self_attn.q_proj.weight", "lm_head.weight"} <= set(names)  # HF names
    steps = [c[0] for c in tm.calls if c[0] != "update"]
    assert steps == ["pause"] + ["abort"] * (not partial) + ["begin", "end"] * session + ["continue"]
    assert tm.calls[0] == ("pause", "retract") and engine.version == 3
    engine.update_weights([], version=4)  # nothing to push: only the version moves
    assert engine.version == 4 and len(tm.calls) == len(updates) + len(steps)


def test_sglang_fp8_runs_an_fp8_checkpoint_and_pushes_fp8_tensors(tmp_path, fake_sglang):
    """rollout.quantization: fp8 with SGLang: it is started on an e4m3 copy of the checkpoint whose config asks
    for block-wise FP8 (SGLang's Fp8LinearMethod), and publishes keep the fp8 weights and fp32 scales as they are."""
    from safetensors import safe_open
    model = tiny_model()
    model.save_pretrained(str(tmp_path / "ckpt"))
    engine, fake = fake_sglang(tmp_path / "ckpt", fp8=True)
    path = fake.kwargs["model_path"]
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
                                                       "dynamic", "weight_block_size": [128, 128]}
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        q, s = f.get_tensor("model.layers.0.mlp.down_proj.weight"), f.get_tensor("model.layers.0.mlp.down_proj.weight_scale_inv")
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16  # lm_head and embeddings stay bf16
    engine.update_weights(parallel.full_weights(model, torch.bfloat16, "fp8"), version=1)
    pushed = dict(kv for c in fake.tokenizer_manager.calls if c[0] == "update" for kv in zip(c[1], c[3]))
    assert pushed["model.layers.0.mlp.down_proj.weight"] == torch.float8_e4m3fn
    assert pushed["model.layers.0.mlp.down_proj.weight_scale_inv"] == torch.float32
    assert pushed["model.embed_tokens.weight"] == torch.bfloat16
    engine.shutdown()
    assert not os.path.exists(path)  # the fp8 copy goes with the engine


@pytest.mark.parametrize("partial", [True, False])
def test_sglang_update_mid_generation(tmp_path, fake_sglang, partial, monkeypatch):
    engine, fake = fake_sglang(tmp_path, partial_rollout=partial)
    monkeypatch.setattr(FakeEngine, "step", 0.01)
    result = {}
    sp = SamplingParams(max_new_tokens=80)
    t = threading.Thread(target=lambda: result.update(out=engine.generate([[1], [2]], sp)))
    t.start()
    time.sleep(0.15)
    engine.update_weights(tiny_model().named_parameters(), version=1)
    t.join()
    for c in result["out"]:
        steps = {(b - a) % 40 for a, b in zip(c.token_ids, c.token_ids[1:])}
        if partial:  # continued under the new weights (the fake model's step changed from 1 to 2)
            assert c.versions == (0, 1) and c.finish_reason == "length" and len(c.token_ids) == 80
            assert steps == {1, 2}
        else:  # aborted at the update, to be regenerated
            assert c.finish_reason == "abort" and 0 < len(c.token_ids) < 80 and steps == {1}
            assert len(c.logprobs) == len(c.token_ids)


def test_sglang_abort_and_resume(tmp_path, fake_sglang, monkeypatch):
    engine, fake = fake_sglang(tmp_path)
    monkeypatch.setattr(FakeEngine, "step", 0.01)
    result = {}
    sp = SamplingParams(max_new_tokens=1000)  # 10 s at the fake's pace
    t = threading.Thread(target=lambda: result.update(out=engine.generate([[1]] * 3, sp)))
    t.start()
    time.sleep(0.1)
    t0 = time.perf_counter()
    engine.abort()
    t.join()
    assert time.perf_counter() - t0 < 2 and all(c.finish_reason == "abort" for c in result["out"])
    assert engine.generate([[1]], SamplingParams(max_new_tokens=5))[0] == Completion([], [], "abort", (0, 0))
    engine.resume()
    assert engine.generate([[1]], SamplingParams(max_new_tokens=5))[0].finish_reason == "length"
