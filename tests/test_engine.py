"""engine.py: the sampler against exact distributions, the torch engine against a naive full-forward
reference (dense and DSA, fp32 and bf16, CUDA-graph buckets), retraction, weight updates mid-batch, host
reads, one call at a time, sessions (parked KV, extension, eviction). The scheduler's rules alone:
test_scheduler.py; the decode graphs' guard and buffers: test_graphs.py; the SGLang adapter: test_sglang.py."""
import math
import threading
import time
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from machinery import engine as engine_mod
from machinery import graphs as graphs_mod
from machinery import parallel
from machinery.engine import SamplingParams, TorchEngine, sample_tokens
from model import GLM, GLMConfig


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
    monkeypatch.setattr(graphs_mod, "GRAPH_MIN_KEYS", 8)
    shapes, run = [], graphs_mod.DecodeGraphs.run
    monkeypatch.setattr(graphs_mod.DecodeGraphs, "run", lambda g, tok, pos, keys, valid, Bg:
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
    if engine.graphs.verify is not None:  # (a speculative engine's verify graphs)
        engine.graphs.verify.capture = capture
    return engine


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dsa", [None, {"topk": 3, "heads": 2, "head_dim": 8, "rope_dim": 4, "pattern": "FS"}])
def test_cuda_graph_replays_give_the_eager_tokens(dsa, monkeypatch):
    """On a GPU, bf16: captured and replayed decode steps give exactly the tokens and logprobs of the same
    padded buckets run eagerly (fixed seed, sampled), every bucket passes the capture guard, and a weight
    update mid-call reaches the graphs (they read the weights in place)."""
    monkeypatch.setattr(graphs_mod, "GRAPH_MIN_KEYS", 8)
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


# ----------------------------------------------------------------------------- MoE: the routes each token took

from machinery.scheduler import extend_routes  # noqa: E402
from families.mla_moe import Routing, no_route  # noqa: E402

NO = no_route(torch.uint8)  # the routes' "not routed" id (8 experts: uint8)


def tiny_moe(seed=0):
    """tests/test_train.py's tiny glm_moe_dsa-shaped model (MLA, a dense first layer, then two MoE layers: top-2 of
    8 experts and a shared one; DSA top-4) on this file's 40-token vocabulary; weights sharper than the init, so
    routes and top-k keys are far from ties (fp32 routes then match exactly between code paths)."""
    torch.manual_seed(seed)
    cfg = GLMConfig(model_type="glm_moe_dsa", vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=3,
                    num_heads=4, num_kv_heads=4, eos_token_id=[1], pad_token_id=0,
                    mla=dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
                    moe=dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                             n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                             mlp_layer_types=["dense", "sparse", "sparse"]),
                    dsa={"topk": 4, "heads": 2, "head_dim": 8, "rope_dim": 4, "pattern": "FS"})
    model = GLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def full_routes(model, ids):
    """The experts a full forward of ids (no cache, every layer at every position) chooses: uint8 [len(ids), n_moe, k]."""
    r = Routing(record=True)
    with torch.no_grad():
        model(torch.tensor([ids]), routing=r)
    return torch.stack(r.chosen)[:, 0].permute(1, 0, 2)


def prefill_mask(n_ctx, total, n_moe):
    """Which (position, MoE layer) a whole-context prefill of n_ctx tokens followed by decode steps routes, of `total`
    positions fed: the prefill's last block runs at its context's last token only, every other layer everywhere."""
    ran = torch.ones(total, n_moe, dtype=torch.bool)
    ran[:n_ctx - 1, -1] = False
    return ran


def assert_routes(got, want, ran):
    """got [positions, n_moe, k] routes where `ran` [positions, n_moe] (each chosen set equal to want's there, any
    order), NO_ROUTE in every slot elsewhere."""
    assert torch.equal((got != NO).all(-1), ran) and torch.equal((got != NO).any(-1), ran), (got != NO).all(-1)
    assert torch.equal(got.sort(-1).values[ran], want.sort(-1).values[ran])


def test_moe_a_turn_that_extends_its_parked_kv_carries_the_whole_contexts_routes():
    """Sessions: a trajectory's later turn runs only its new tokens on its parked KV, yet its completion's routes
    cover every position of its context fed so far (prompt, earlier turns, env tokens, its own tokens but the last):
    the positions of the turn before are exactly that turn's completion's routes (read back from the parked slots),
    and the new ones are those a full fp32 forward of the whole context chooses, every MoE layer routed."""
    model = tiny_moe()
    engine = TorchEngine(model, max_batch=2)
    turns = [[[5, 6, 7, 8, 9], [3, 4, 30], [11]], [[3, 4], [7, 7, 7, 7, 7, 7, 7, 7]], [[10, 11, 12], [1, 2]]]
    out = run_session(engine, turns)
    assert engine.stats["extends"] >= 1 and engine.stats["evicted"] == 0 and engine.stats["retracted"] == 0
    n_moe, k = len(model.cfg.moe_layers), model.cfg.moe.num_experts_per_tok
    for traj in out:
        ctx, c = traj[-1]
        want = full_routes(model, ctx + c.token_ids[:-1])
        before = None  # (positions fed, routes) of the turn before
        for t, (ctx, c) in enumerate(traj):
            fed = len(ctx) + len(c.token_ids) - 1
            assert c.routes.shape == (fed, n_moe, k) and c.routes.dtype == torch.uint8
            if before is None:
                assert_routes(c.routes, want[:fed], prefill_mask(len(ctx), fed, n_moe))
            else:
                assert torch.equal(c.routes[:before[0]], before[1])  # the parked positions' own record
                assert_routes(c.routes[before[0]:], want[before[0]:fed], torch.ones(fed - before[0], n_moe, dtype=torch.bool))
            before = (fed, c.routes)


def test_moe_an_evicted_trajectorys_turn_prefills_again_and_its_earlier_routes_stay_the_first_records():
    """A pool too small for every parked trajectory (test_parked_kv_is_evicted_first_and_evicted_turns_prefill_again):
    an evicted trajectory's next turn prefills its whole context, whose last MoE layer then runs at the context's
    last token only: that completion's routes hold the first record's experts where it ran them (the same weights)
    and NO_ROUTE in the last layer elsewhere, never a stale route of the slot's previous owner. Merged as an episode
    merges its turns (extend_routes), the trajectory's routes are every position's first record: the model tokens
    that decode fed keep every layer's routes, and all of them are what a full fp32 forward chooses. (The env tokens of a
    turn prefilled again have no last-layer route: their logits are never trained on, and the learner routes them
    afresh; the context's last token, whose logits give the turn's first token, has every layer's.)"""
    turns = [[[5 + k, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [3]] for k in range(4)]
    small = TorchEngine(tiny_moe(), max_batch=4, kv_tokens=80)  # 5 blocks of 16 slots
    packed, pack = [], small._pack
    small._pack = lambda new: packed.extend(tuple(r.prompt + r.tokens) for r in new) or pack(new)
    got = run_session(small, turns, temperature=1.0)
    assert small.stats["evicted"] > 0 and small.stats["retracted"] == 0
    model, n_moe = tiny_moe(), 2
    prefilled_again = 0
    for traj in got:
        ctx, c = traj[-1]
        want = full_routes(model, ctx + c.token_ids[:-1])
        merged, decoded = None, torch.zeros(len(want), dtype=torch.bool)  # positions a decode step (or extension) fed
        for t, (ctx, c) in enumerate(traj):
            fed = len(ctx) + len(c.token_ids) - 1
            assert c.routes.shape[0] == fed
            if t == 0 or tuple(ctx) in packed:  # a whole-context prefill (the first turn, or evicted)
                prefilled_again += t > 0
                assert_routes(c.routes, want[:fed], prefill_mask(len(ctx), fed, n_moe))
                if merged is not None:  # the positions the earlier turns recorded, as they recorded them where it ran
                    ran = prefill_mask(len(ctx), len(merged), n_moe) & (merged != NO).all(-1)
                    assert torch.equal(c.routes[:len(merged)][ran], merged[ran])
            else:  # extended its parked KV: the earlier positions read back as recorded
                assert torch.equal(c.routes[:len(merged)], merged)
            decoded[len(ctx) - 1 if t == 0 or tuple(ctx) in packed else len(merged):fed] = True
            first = merged
            merged = extend_routes(merged, c.routes)
            if first is not None:
                assert torch.equal(merged[:len(first)], first)
        assert merged.shape[0] == len(want)
        # the last layer ran where a decode step (or an extension) fed a position, or at a prefill's last token;
        # elsewhere (the first prompt, and the env tokens of a turn prefilled again) nothing ever ran it
        ran = torch.ones(len(want), n_moe, dtype=torch.bool)
        ran[:, -1] = decoded
        assert_routes(merged, want, ran)
    assert prefilled_again >= 1


def assert_old_then_new(prompts, outs, old, new):
    """Each completion (versions (0, 1)) of a reprefill engine updated from `old` to `new` mid-call: its first tokens
    have the old weights' logprobs, the rest the new weights' (full fp32 forwards; nothing in between: no token of
    new weights over old KV), at least one of each; each position's routes are those of the forward that first ran
    it: the old weights' full forward for every position fed before the update (the re-prefill runs them again but
    must not rewrite them), the new weights' from the first one the re-prefill fed (the last token sampled before
    it) on. -> (completions whose positions before / after that point would have other routes under the other
    weights), so that the routes check above could fail."""
    n_moe, differ = len(old.cfg.moe_layers), [0, 0]
    for p, c in zip(prompts, outs):
        assert c.versions == (0, 1)
        ids = p + c.token_ids
        with torch.no_grad():
            lp = {w: m(torch.tensor([ids]))[0, len(p) - 1:-1].log_softmax(-1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
                  for w, m in (("old", old), ("new", new))}
        got = torch.tensor(c.logprobs)
        is_old, is_new = (got - lp["old"]).abs() < 1e-4, (got - lp["new"]).abs() < 1e-4
        j = int(is_old.long().cumprod(0).sum())  # tokens sampled before the update
        assert 0 < j < len(c.token_ids) and is_new[j:].all(), "".join("o" if a else "n" if b else "?" for a, b in
                                                                     zip(is_old.tolist(), is_new.tolist()))
        b = len(p) - 1 + j  # the first position the new weights ran first: the last token sampled by the old ones
        routes = {w: full_routes(m, ids[:-1]).sort(-1).values for w, m in (("old", old), ("new", new))}
        ran = prefill_mask(len(p), len(ids) - 1, n_moe)
        assert_routes(c.routes, torch.cat((routes["old"][:b], routes["new"][b:])), ran)
        diff = (routes["old"] != routes["new"]).any(-1) & ran
        differ[0] += int(diff[:b].any())
        differ[1] += int(diff[b:].any())
    return differ


def test_moe_reprefill_under_new_weights_keeps_each_tokens_own_routes():
    """Partial rollouts that span a weight update, rollout.update_mode: reprefill: new weights (another seed's) land
    between two iterations mid-call; the running rows are retracted and prefilled again under them. Each token keeps
    the logprob and each position the routes of the weights that first ran it (assert_old_then_new)."""
    old, new = tiny_moe(seed=0), tiny_moe(seed=1)
    engine = TorchEngine(tiny_moe(seed=0), max_batch=4, reprefill=True)
    steps, step = [0], engine._step

    def update_then_step():  # the update lands between two iterations: deterministic, no thread timing
        steps[0] += 1
        if steps[0] == 6:
            engine.update_weights(((n, p.detach()) for n, p in new.named_parameters()), version=1)
        step()
    engine._step = update_then_step
    prompts = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12]]
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12), seed=4)
    assert engine.stats["retracted"] == 3 and all(len(c.token_ids) == 12 for c in outs)
    assert min(assert_old_then_new(prompts, outs, old, new)) > 0


def test_moe_reprefill_an_update_published_during_an_iteration_waits_for_the_next():
    """The same, with the update published by another thread (as the Generator publishes) while an iteration runs,
    after its reprefill check (TorchEngine._step compares kv_version with version) and before its decode step.
    reprefill promises that no KV of the old weights survives them: the update must wait for the iteration's end
    (the next one retracts and prefills again), not land in between, where the decode step would sample every
    running row's next token, and record its routes, with the new weights over the old weights' KV (seen: one such
    token per row, whose logprob is neither weights' own)."""
    old, new = tiny_moe(seed=0), tiny_moe(seed=1)
    engine = TorchEngine(tiny_moe(seed=0), max_batch=4, reprefill=True)
    grows, grow, publisher = [0], engine._grow, []

    def publish_during_the_iteration():  # _step calls _grow right after its reprefill check, before the forwards
        grows[0] += 1
        if grows[0] == 6:
            t = threading.Thread(target=engine.update_weights,
                                 args=(((n, p.detach()) for n, p in new.named_parameters()), 1))
            t.start()
            publisher.append(t)
            t.join(timeout=0.5)  # landed now, unless the iteration holds the weights (then it lands after it)
        grow()
    engine._grow = publish_during_the_iteration
    prompts = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12]]
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12), seed=4)
    publisher[0].join()
    assert engine.version == 1 and all(len(c.token_ids) == 12 for c in outs)
    assert min(assert_old_then_new(prompts, outs, old, new)) > 0


def test_moe_a_dense_model_has_no_routes():
    """A dense model's engine keeps no routes beside its KV and its completions carry none (generate and sessions)."""
    engine = TorchEngine(tiny_model(DSA3).eval(), max_batch=2)
    outs = engine.generate([[5, 6, 7], [3, 4]], SamplingParams(temperature=1.0, max_new_tokens=5), seed=0)
    assert engine.pool.routes == [] and all(c.routes is None for c in outs)
    out = run_session(engine, [[[5, 6, 7], [8, 9]], [[3, 4], [1]]])
    assert engine.stats["extends"] >= 1 and all(c.routes is None for tr in out for _, c in tr)
    moe = TorchEngine(tiny_moe(), max_batch=2)  # (and an MoE engine's pool holds one [slots, k] uint8 per MoE layer)
    moe.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2), seed=0)
    assert [tuple(r.shape) + (r.dtype,) for r in moe.pool.routes] == [(moe.pool.k[0].shape[0], 2, torch.uint8)] * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_cuda_graphs_capture_the_moe_generator(quantization, monkeypatch):
    """On a GPU: the MoE generator (bf16, or fp8 with its routed experts in FP8Experts' grouped Triton kernel, which
    reads no row count on the host) captures every decode bucket (no eager fallback), and replays give the eager
    run's tokens, logprobs and routes exactly (fixed seed, sampled)."""
    from machinery import fp8
    monkeypatch.setattr(graphs_mod, "GRAPH_MIN_KEYS", 8)
    sp = SamplingParams(temperature=1.0, max_new_tokens=24)
    prompts = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12], [1] * 17, [7]] * 3
    outs = []
    for capture in (False, True):
        gen = tiny_moe().cast_(torch.bfloat16).to("cuda")
        if quantization:
            gen = fp8.quantize_model_(gen)
        engine = graph_engine(gen, capture, max_batch=6)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a failed capture warns, then decodes eagerly: fail here instead
            outs.append(engine.generate(prompts, sp, seed=9))
    assert not engine.graphs.failed and len(engine.graphs.graphs) >= 4
    assert [c.token_ids for c in outs[0]] == [c.token_ids for c in outs[1]]
    assert [c.logprobs for c in outs[0]] == [c.logprobs for c in outs[1]]
    assert all(torch.equal(a.routes, b.routes) for a, b in zip(*outs))


@pytest.mark.parametrize("budget", ["scheduler", "engine"])
def test_a_wave_larger_than_the_prefill_budget_prefills_back_to_back_in_one_iteration(monkeypatch, budget):
    """Requests that do not fit one prefill forward (scheduler.PREFILL_TOKENS, or the engine's prefill_tokens: what
    make_engine gives, config.prefill_budget) prefill in several, one after the other in the same iteration (no
    device read between them, so the host packs the next while the device runs the last), then one lm_head and one
    sampling for all of them, before the iteration's one decode step; each forward stays within the budget, and every
    completion is the one a single forward gives (its tokens; its logprobs up to fp32 rounding: other packings,
    other matmul shapes)."""
    from machinery import engine as engine_mod, scheduler
    model = tiny_model()
    prompts = [[i + 1, i + 2, i + 3, i + 4, i + 5] for i in range(6)]  # 30 tokens, 6 distinct contexts
    sampling = SamplingParams(temperature=1.0, max_new_tokens=4)
    whole = TorchEngine(model, max_batch=8, kv_tokens=256).generate(prompts, sampling, seed=3)
    if budget == "scheduler":
        monkeypatch.setattr(scheduler, "PREFILL_TOKENS", 10)  # two contexts a forward
    # (blocks to spare: the pool does not hold anyone back)
    engine = TorchEngine(model, max_batch=8, kv_tokens=256, prefill_tokens=10 if budget == "engine" else None)
    sizes, pack, samplings, sample = [], TorchEngine._pack, [], engine_mod.sample_tokens
    monkeypatch.setattr(TorchEngine, "_pack", lambda self, new: sizes.append(
        (self.stats["iterations"], sum(len(r.prompt) for r in new))) or pack(self, new))
    monkeypatch.setattr(engine_mod, "sample_tokens", lambda logits, *a: samplings.append(logits.shape[0]) or sample(logits, *a))
    out = engine.generate(prompts, sampling, seed=3)
    assert sizes == [(1, 10)] * 3 and engine.stats["prefills"] == 3  # all in the first iteration
    assert engine.stats["decode_steps"] == 3  # tokens 2-4 of every row at once
    assert samplings == [6] * 4  # the three forwards' first tokens at once, then the decode steps
    assert [c.token_ids for c in out] == [c.token_ids for c in whole]  # (logprobs: another packing's rounding)
    for c, w in zip(out, whole):
        assert c.logprobs == pytest.approx(w.logprobs, abs=1e-5)


@pytest.mark.parametrize("model", [tiny_model, tiny_moe])
def test_an_abort_returns_every_request_running_or_waiting(model):
    """abort() (the Generator's stop) makes a running call return at its next iteration: rows running and requests
    still waiting all finish "abort" with what they have, the pool gets every block back, and resume() lets the
    next call run. Also when no row is running at that moment (every request still waits), on an MoE model too,
    whose release reads the rows' routes."""
    engine = TorchEngine(model(), max_batch=2)
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12]]
    sampling = [SamplingParams(temperature=1.0, max_new_tokens=n, stop_token_ids=()) for n in (2, 6, 6, 6)]
    engine.abort()  # before the first iteration: nothing runs yet
    out = engine.generate(prompts, sampling, seed=0)
    assert [(c.finish_reason, c.token_ids) for c in out] == [("abort", [])] * 4
    engine.resume()
    seen = []
    for i, c in engine.stream(prompts, sampling, seed=0):  # request 0 finishes first: abort then (1 runs, 2-3 wait)
        seen.append((i, c.finish_reason, len(c.token_ids)))
        engine.abort()
    assert seen[0] == (0, "length", 2) and sorted(seen[1:]) == [(1, "abort", 2), (2, "abort", 0), (3, "abort", 0)]
    assert len(engine.pool.free) == engine.pool.num_blocks
    engine.resume()
    assert [c.finish_reason for c in engine.generate(prompts, sampling, seed=0)] == ["length"] * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model", [tiny_model, tiny_moe])
def test_one_new_token_takes_no_decode_step(model, dtype):
    """A wave whose every request samples one token (max_new_tokens 1) ends at its prefill: no decode step runs (a
    prefill's cost, nothing more), and each completion is the first token of a longer generation with its logprob,
    and (MoE) the routes of its prompt's positions; in the generator's bf16 weights too."""
    engine = TorchEngine(model().cast_(dtype), max_batch=4)
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    one = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=1), seed=5)
    assert engine.stats["decode_steps"] == 0
    longer = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=3), seed=5)
    for p, a, b in zip(prompts, one, longer):
        assert a.token_ids == b.token_ids[:1] and a.logprobs == b.logprobs[:1] and a.finish_reason == "length"
        if b.routes is not None:
            assert a.routes.shape[0] == len(p) and torch.equal(torch.as_tensor(a.routes), torch.as_tensor(b.routes)[:len(p)])
