"""engine.py: the sampler against exact distributions, the torch engine against a naive full-forward
reference (dense and DSA, fp32 and bf16, CUDA-graph buckets), retraction, weight updates mid-batch, host
reads, one call at a time, sessions (parked KV, extension, eviction). The scheduler's rules alone:
test_scheduler.py; the decode graphs' guard and buffers: test_graphs.py; the SGLang adapter: test_sglang.py."""
import math
import threading
import time

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
