"""dsa.py: the indexer formula, top-k selection, sparse attention, the indexer losses and IndexCache,
checked against naive float64 loops and against the dense model. Sequences are longer than top-k
wherever it matters: a bug in sparse attention hides when every key is selected."""
import math

import pytest
import torch

import dsa
from model import GLM, AttnMask, GLMConfig, KVCache, Packed, apply_rope, rope_cos_sin


def tiny(topk=4, pattern="F", layers=2, heads=4, kv=2, index_heads=3):
    return GLMConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=layers, num_heads=heads,
                     num_kv_heads=kv, head_dim=8, partial_rotary_factor=0.5, max_position_embeddings=128,
                     dsa=dict(topk=topk, heads=index_heads, head_dim=8, rope_dim=4, pattern=pattern))


def model(cfg, seed=0):
    torch.manual_seed(seed)
    m = GLM(cfg).eval()
    with torch.no_grad():  # larger random weights than the init, so scores are well separated
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return m


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_indexer_scores_match_naive_float64_loop():
    cfg = dsa.DSAConfig(topk=4, heads=3, head_dim=8, rope_dim=4)
    torch.manual_seed(0)
    ix = dsa.Indexer(16, cfg)
    with torch.no_grad():
        for p in ix.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    T, theta = 6, 10000.0
    x = torch.randn(1, T, 16)
    pos = torch.arange(T)[None]
    with torch.no_grad():
        q, k, w = ix(x)
    cos, sin = rope_cos_sin(pos, cfg.rope_dim, theta, cfg.head_dim)
    ours = dsa.index_scores(apply_rope(q, cos, sin), w, apply_rope(k, cos, sin))[0]

    X = x[0].double()
    Wq, Wk, Ww = (m.weight.detach().double() for m in (ix.wq, ix.wk, ix.weights_proj))
    g, b = ix.k_norm.weight.detach().double(), ix.k_norm.bias.detach().double()

    def rot(vec, p):  # interleaved pairs (0,1), (2,3) of the first rope_dim dims
        out = vec.clone()
        for i in range(cfg.rope_dim // 2):
            a = p * theta ** (-2 * i / cfg.rope_dim)
            out[2 * i] = vec[2 * i] * math.cos(a) - vec[2 * i + 1] * math.sin(a)
            out[2 * i + 1] = vec[2 * i + 1] * math.cos(a) + vec[2 * i] * math.sin(a)
        return out

    for t in range(T):
        for s in range(T):
            kk = Wk @ X[s]
            kk = (kk - kk.mean()) / torch.sqrt(kk.var(unbiased=False) + 1e-6) * g + b
            kk = rot(kk, s)
            total = 0.0
            for j in range(cfg.heads):
                qj = rot((Wq @ X[t])[j * 8:(j + 1) * 8], t)
                wj = (Ww @ X[t])[j] / math.sqrt(cfg.heads)
                total += wj * max(0.0, float(qj @ kk))
            assert abs(total / math.sqrt(cfg.head_dim) - ours[t, s].item()) < 1e-5


def test_topk_at_least_seq_len_is_exactly_dense():
    cfg = tiny(topk=32, pattern="FS", layers=3)
    sparse = model(cfg)
    dense = GLM(GLMConfig(**{**cfg.__dict__, "dsa": None})).eval()
    dense.load_state_dict(sparse.state_dict(), strict=False)
    ids = torch.randint(0, 61, (2, 32))
    with torch.no_grad():
        assert torch.equal(sparse(ids), dense(ids))


@pytest.mark.parametrize("chunk", [1 << 24, 200])
def test_selection_counts_and_causality(chunk, monkeypatch):
    monkeypatch.setattr(dsa, "CHUNK_ELEMENTS", chunk)  # 200: query chunks of a few rows, keys cut causally
    T, topk = 24, 5
    B, H, d = 2, 3, 8
    q, w, k = torch.randn(B, T, H, d), torch.randn(B, T, H), torch.randn(B, T, d)
    mask = AttnMask(torch.arange(T), T)
    idx, valid = dsa.select_topk(q, w, k, mask, topk)
    scores = dsa.index_scores(q, w, k)
    for b in range(B):
        for t in range(T):
            chosen = idx[b, t][valid[b, t]].tolist()
            assert len(chosen) == min(topk, t + 1) == len(set(chosen))
            assert max(chosen) <= t  # never a future key
            best = sorted(range(t + 1), key=lambda s: -scores[b, t, s].item())[:len(chosen)]
            assert sorted(scores[b, t, chosen].tolist()) == pytest.approx(sorted(scores[b, t, best].tolist()))


def naive_sparse(q, k, v, idx, valid, scale):
    B, T, H, D = q.shape
    G = H // k.shape[2]
    out = torch.zeros(B, T, H, D, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            keys = idx[b, t][valid[b, t]]
            for h in range(H):
                s = torch.stack([q[b, t, h].double() @ k[b, j, h // G].double() for j in keys]) * scale
                out[b, t, h] = torch.softmax(s, 0) @ v[b, keys, h // G].double()
    return out


@pytest.mark.parametrize("grad", [False, True])
def test_sparse_attention_matches_naive(grad, monkeypatch):
    monkeypatch.setattr(dsa, "GATHER_ELEMENTS", 2000)  # force several query chunks (and checkpointing)
    B, T, H, Hkv, D, topk = 2, 19, 4, 2, 8, 6
    q = torch.randn(B, T, H, D, requires_grad=grad)
    k, v = torch.randn(B, T, Hkv, D), torch.randn(B, T, Hkv, D)
    idx, valid = dsa.select_topk(torch.randn(B, T, 2, 8), torch.randn(B, T, 2), torch.randn(B, T, 8),
                                 AttnMask(torch.arange(T), T), topk)
    out = dsa.sparse_attention(q, k, v, idx, valid, D ** -0.5)
    assert rel_err(out.double(), naive_sparse(q.detach(), k, v, idx, valid, D ** -0.5)) < 1e-6
    if grad:  # gradient through the chunked, recomputed path equals the unchunked one
        out.square().sum().backward()
        g = q.grad.clone()
        q.grad = None
        monkeypatch.setattr(dsa, "GATHER_ELEMENTS", 1 << 24)
        dsa.sparse_attention(q, k, v, idx, valid, D ** -0.5).square().sum().backward()
        assert rel_err(g, q.grad) < 1e-6


def test_sparse_attention_with_every_key_equals_dense():
    B, T, H, Hkv, D = 1, 11, 4, 2, 8
    q, k, v = torch.randn(B, T, H, D), torch.randn(B, T, Hkv, D), torch.randn(B, T, Hkv, D)
    idx = torch.arange(T).expand(B, T, T)
    valid = idx <= torch.arange(T)[:, None]
    out = dsa.sparse_attention(q, k, v, idx, valid, D ** -0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2), v.repeat_interleave(2, 2).transpose(1, 2),
        is_causal=True).transpose(1, 2)
    assert rel_err(out, ref) < 1e-6


def test_sparse_model_differs_from_dense_beyond_topk():
    """Guards the tests above: with T > topk the sparse model must not silently run dense."""
    cfg = tiny(topk=3)
    sparse = model(cfg)
    dense = GLM(GLMConfig(**{**cfg.__dict__, "dsa": None})).eval()
    dense.load_state_dict(sparse.state_dict(), strict=False)
    ids = torch.randint(0, 61, (1, 12))
    with torch.no_grad():
        a, b = sparse(ids), dense(ids)
    assert rel_err(a[:, :3], b[:, :3]) < 1e-5  # the first topk queries see every key
    assert rel_err(a[:, 3:], b[:, 3:]) > 1e-3


@pytest.mark.parametrize("pattern", ["F", "FS"])
def test_cached_decode_equals_full_sparse_forward(pattern):
    m = model(tiny(topk=4, pattern=pattern, layers=2))
    ids = torch.randint(0, 61, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = m(ids)
        cache = KVCache(m.cfg, 2, 20)
        outs = [m(ids[:, :3], cache=cache)] + [m(ids[:, t:t + 1], cache=cache) for t in range(3, 20)]
    assert rel_err(torch.cat(outs, 1), full) < 1e-5


def test_left_padded_cached_decode_equals_unpadded():
    m = model(tiny(topk=3))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 61, (n,), generator=g) for n in (8, 4)]
    cont = torch.randint(0, 61, (2, 6), generator=g)
    ids, mask = torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, 8 - len(p):], mask[i, 8 - len(p):] = p, 1
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        cache = KVCache(m.cfg, 2, 14)
        m(ids, position_ids=pos, attention_mask=mask, cache=cache)
        outs = [m(cont[:, t:t + 1], position_ids=(pos[:, -1] + 1 + t)[:, None], cache=cache) for t in range(6)]
        for i, p in enumerate(prompts):
            alone = m(torch.cat([p, cont[i]])[None])[0, len(p):]
            assert rel_err(torch.cat(outs, 1)[i], alone) < 1e-5


def test_packed_sparse_forward_equals_separate():
    m = model(tiny(topk=3, pattern="FS"))
    seqs = [torch.randint(0, 61, (n,)) for n in (7, 9, 4)]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    with torch.no_grad():
        out = m(torch.cat(seqs)[None], position_ids=pos)[0]
        ref = torch.cat([m(s[None])[0] for s in seqs])
    assert rel_err(out, ref) < 1e-5


def naive_kl(p, logits):
    q = torch.softmax(logits.double(), -1)
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p.double().tolist(), q.tolist()) if pi > 0)


def test_dense_indexer_kl_matches_naive():
    B, T, H, Hkv, D, Hi, d = 1, 7, 4, 2, 8, 3, 8
    q, k = torch.randn(B, T, H, D), torch.randn(B, T, Hkv, D)
    iq, iw, ik = torch.randn(B, T, Hi, d), torch.randn(B, T, Hi), torch.randn(B, T, d)
    mask = AttnMask(torch.arange(T), T)
    ours = dsa.dense_indexer_kl(iq, iw, ik, q, k, mask, D ** -0.5).item()
    scores = dsa.index_scores(iq, iw, ik)[0]
    total = 0.0
    for t in range(T):
        p = torch.zeros(t + 1, dtype=torch.float64)
        for h in range(H):  # main attention summed over heads, then L1-normalised
            p += torch.softmax(torch.stack([q[0, t, h].double() @ k[0, s, h // 2].double()
                                            for s in range(t + 1)]) * D ** -0.5, 0)
        total += naive_kl(p / p.sum(), scores[t, :t + 1])
    assert ours == pytest.approx(total / T, rel=1e-5)


def test_sparse_indexer_kl_matches_naive():
    B, T, Hi, d, topk = 1, 9, 3, 8, 4
    iq, iw, ik = torch.randn(B, T, Hi, d), torch.randn(B, T, Hi), torch.randn(B, T, d)
    idx, valid = dsa.select_topk(iq, iw, ik, AttnMask(torch.arange(T), T), topk)
    p = torch.rand(B, T, topk) * valid
    p = p / p.sum(-1, keepdim=True)
    ours = dsa.sparse_indexer_kl(iq, iw, ik, idx, valid, p, torch.ones(B, T)).item()
    scores = dsa.index_scores(iq, iw, ik)[0]
    total = sum(naive_kl(p[0, t][valid[0, t]], scores[t, idx[0, t][valid[0, t]]]) for t in range(T))
    assert ours == pytest.approx(total / T, rel=1e-5)


@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_indexer_loss_gradients_reach_only_the_indexer(stage):
    m = model(tiny(topk=4, pattern="FS", layers=2)).train()
    ids = torch.randint(0, 61, (2, 16))
    logits, kl = m(ids, indexer_loss=stage)
    assert kl.item() > 0
    kl.backward()
    for name, p in m.named_parameters():
        if ".indexer." in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None or p.grad.abs().sum() == 0, name
    # ... and the LM loss reaches the model but never the indexer
    m.zero_grad(set_to_none=True)
    logits, kl = m(ids, indexer_loss=stage)
    logits.logsumexp(-1).mean().backward()
    assert all(p.grad is None for p in m.indexer_parameters())
    assert m.lm_head.weight.grad.abs().sum() > 0


def test_indexcache_pattern_owns_indexers_only_on_f_layers(monkeypatch):
    m = model(tiny(topk=3, pattern="FSS", layers=6))
    owners = [i for i, layer in enumerate(m.layers) if layer.self_attn.indexer is not None]
    assert owners == [0, 3]
    assert {n.split(".")[1] for n in m.state_dict() if ".indexer." in n} == {"0", "3"}
    calls = []
    real = dsa.select_topk
    monkeypatch.setattr(dsa, "select_topk", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        m(torch.randint(0, 61, (1, 10)))
    assert len(calls) == 2  # S layers reuse the F layer's indices


def test_checkpoint_roundtrip_with_indexer_and_fresh_indexer_on_dense(tmp_path, capsys):
    m = model(tiny(topk=3, pattern="FS"))
    m.save_pretrained(str(tmp_path / "dsa"))
    back = GLM.from_pretrained(str(tmp_path / "dsa"))
    assert back.cfg.dsa == m.cfg.dsa
    ids = torch.randint(0, 61, (1, 12))
    with torch.no_grad():
        assert torch.equal(back(ids), m(ids))
    dense = GLM.from_pretrained(str(tmp_path / "dsa"), dsa=False)  # indexer tensors ignored
    assert dense.cfg.dsa is None and not dense.indexer_parameters()
    dense.save_pretrained(str(tmp_path / "dense"))
    capsys.readouterr()
    fresh = GLM.from_pretrained(str(tmp_path / "dense"), dsa={"topk": 3, "heads": 2, "head_dim": 8, "rope_dim": 4})
    assert "initialised" in capsys.readouterr().out and fresh.indexer_parameters()
    assert torch.equal(fresh.layers[0].self_attn.q_proj.weight, m.layers[0].self_attn.q_proj.weight)


def test_bad_dsa_config_is_a_clear_error():
    with pytest.raises(ValueError, match="pattern"):
        dsa.DSAConfig(pattern="SF")
    with pytest.raises(ValueError, match="unknown dsa key"):
        dsa.DSAConfig.from_dict({"top_k": 4})


def test_ties_are_broken_by_position_whatever_the_row_length():
    scores = torch.tensor([[[0.0, 2.0, -0.0, 0.0, -1.0, 0.0, float("-inf")]]])
    keys = dsa._tie_broken(scores)
    assert keys.argsort(-1, descending=True)[0, 0].tolist() == [1, 0, 2, 3, 5, 4, 6]
    assert torch.equal(keys[..., :4].topk(3).indices, keys.topk(3).indices)


# ----------------------------------------------------------------------------- the GPU's dtypes
# The learner runs under bf16 autocast with fp32 master weights; the generator holds bf16 weights. Tolerances
# are stated against the same model run dense: DSA may add little to the error bf16 itself makes.

def bf16_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def trained_indexer(cfg, steps=60, seed=0):
    """A model whose indexer has learned to imitate its attention (the dense warm-up), so that its scores
    are spread out like a real indexer's, not the near-ties of a fresh one."""
    m = model(cfg, seed)
    opt = torch.optim.Adam(m.indexer_parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    first = None
    for _ in range(steps):
        _, kl = m(torch.randint(0, 61, (4, 24), generator=g), indexer_loss="dense")
        opt.zero_grad()
        kl.backward()
        opt.step()
        first = first if first is not None else kl.item()
    assert kl.item() < 0.5 * first  # it did learn
    return m.eval()


def dense_twin(m):
    twin = GLM(GLMConfig(**{**m.cfg.__dict__, "dsa": None})).eval()
    twin.load_state_dict(m.state_dict(), strict=False)
    return twin


def test_indexer_math_is_fp32_under_autocast():
    m = trained_indexer(tiny(topk=4))
    ix = m.layers[0].self_attn.indexer
    x = torch.randn(1, 10, 32)
    with bf16_autocast():
        q, k, w = ix(x)
        s = dsa.index_scores(q, w, k)
    assert (q.dtype, k.dtype, w.dtype, s.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32, torch.float32)
    ref = dsa.index_scores(q.double(), w.double(), k.double())  # the same bf16 q, k, in float64
    assert rel_err(s.double(), ref) < 1e-6
    with bf16_autocast():
        kl = m(torch.randint(0, 61, (1, 12)), indexer_loss="sparse")[1]
    assert kl.dtype == torch.float32


def test_sparse_attention_under_autocast_keeps_fp32_logits():
    torch.manual_seed(0)
    B, T, H, Hkv, D, K = 1, 9, 4, 2, 8, 4
    q, k, v = (torch.randn(B, T, n, D).bfloat16() for n in (H, Hkv, Hkv))
    idx = torch.randint(0, T, (B, T, K))
    valid = torch.rand(B, T, K) > 0.2
    valid[..., 0] = True
    with bf16_autocast():
        out, p = dsa.sparse_attention(q, k, v, idx, valid, D**-0.5, return_probs=True)
    ref, pref = dsa.sparse_attention(q.double(), k.double(), v.double(), idx, valid, D**-0.5, return_probs=True)
    assert out.dtype == torch.bfloat16 and p.dtype == torch.float32
    assert rel_err(out.double(), ref) < 4e-3  # bf16 rounding of the output only
    assert rel_err(p.double(), pref) < 1e-6  # fp32 probabilities


@pytest.mark.parametrize("pattern", ["F", "FS"])
def test_dsa_forward_and_backward_under_bf16_autocast(pattern):
    """Used to crash: bf16 scores made _tie_broken's int32 view halve the last dimension."""
    m = trained_indexer(tiny(topk=4, pattern=pattern, layers=3))
    ids = torch.randint(0, 61, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref_dsa, ref_dense = m(ids), dense_twin(m)(ids)
    with bf16_autocast():
        out = m(ids)
        out.float().logsumexp(-1).mean().backward()
        with torch.no_grad():
            out_dense = dense_twin(m)(ids)
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in m.parameters())
    assert any(p.grad is not None for p in m.parameters())
    # Against fp32, bf16's rounding of the indexer's q and k flips some near-tied keys (as in any bf16 DSA);
    # what must agree exactly is learner vs generator, tested below. Measured 0.06-0.22 vs dense 0.013-0.02.
    err, err_dense = rel_err(out.float(), ref_dsa), rel_err(out_dense.float(), ref_dense)
    assert err_dense < 0.03 and err < 0.3, (err, err_dense)


def test_indexer_small_parameters_stay_fp32_in_bf16_copies(tmp_path):
    m = trained_indexer(tiny(topk=4, pattern="FS"))
    m.save_pretrained(str(tmp_path / "m"))
    bf = GLM.from_pretrained(str(tmp_path / "m"), dtype=torch.bfloat16)
    for name, p in bf.named_parameters():
        want = torch.float32 if name.endswith(dsa.FP32_PARAMS) else torch.bfloat16
        assert p.dtype == want, name
    assert torch.equal(bf.layers[0].self_attn.indexer.weights_proj.weight, m.layers[0].self_attn.indexer.weights_proj.weight)


def _selections(monkeypatch):
    """Record every (idx, valid, visible key count) of select_topk; returns what select_topk returns."""
    seen, real = [], dsa.select_topk

    def spy(q, w, k, mask, topk):
        seen.append((*real(q, w, k, mask, topk), mask.k_len))
        return seen[-1][:2]
    monkeypatch.setattr(dsa, "select_topk", spy)
    return seen


def test_learner_and_generator_pick_the_same_keys_in_bf16(monkeypatch):
    """The learner (fp32 master weights, packed row, bf16 autocast) and the generator (bf16 weights, KV
    cache, one query per step) must attend to the same keys, or their logprobs part ways: all but a tiny
    fraction of (query, key) pairs agree, and logprob errors stay at the dense model's own bf16 level."""
    m = trained_indexer(tiny(topk=6, pattern="FS", layers=3))
    gen = GLM(m.cfg).eval()
    gen.load_state_dict(m.state_dict())
    gen.cast_(torch.bfloat16)
    dense_gen, dense_m = dense_twin(gen).cast_(torch.bfloat16), dense_twin(m)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 61, (n,), generator=g) for n in (40, 33, 36)]
    P = 5  # prompt tokens; the rest are decoded one at a time

    seen = _selections(monkeypatch)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    with torch.no_grad(), bf16_autocast():
        learner_logits = m(torch.cat(seqs)[None], position_ids=pos)[0].float()
        dense_learner = dense_m(torch.cat(seqs)[None], position_ids=pos)[0].float()
    # The learner selects per group of similar-length sequences (model.Packed), layer by layer: map each
    # (F layer, group) selection [n, L, K] back to its sequences, by where each one starts in the row.
    groups = Packed.of(pos).groups
    learner_sel = {}  # sequence start -> [per F layer: [L, K] key positions within the sequence]
    for f in range(len(seen) // len(groups)):
        for (src, _), (idx, _, _) in zip(groups, seen[f * len(groups):(f + 1) * len(groups)]):
            for r in range(len(src)):
                learner_sel.setdefault(int(src[r, 0]), []).append(idx[r])
    seen.clear()

    differ = total = 0
    logp_err, dense_err = [], []
    start = 0
    for s in seqs:
        T = len(s)
        with torch.no_grad():
            cache, dcache = KVCache(gen.cfg, 1, T, dtype=torch.bfloat16), KVCache(gen.cfg, 1, T, dtype=torch.bfloat16)
            outs = [gen(s[None, :P], cache=cache)] + [gen(s[None, t:t + 1], cache=cache) for t in range(P, T)]
            douts = [dense_gen(s[None, :P], cache=dcache)] + [dense_gen(s[None, t:t + 1], cache=dcache) for t in range(P, T)]
        gen_logits, dgen_logits = torch.cat(outs, 1)[0].float(), torch.cat(douts, 1)[0].float()
        for t in range(max(P, m.cfg.dsa.topk), T):  # decode steps with a choice: one query at slot t
            steps = [(idx, valid) for idx, valid, k_len in seen if k_len == t + 1 and idx.shape[1] == 1]
            assert len(steps) == len(learner_sel[start])  # one selection per F layer
            for f, (idx, valid) in enumerate(steps):
                mine = set(idx[0, 0][valid[0, 0]].tolist())
                theirs = set(learner_sel[start][f][t].tolist())
                differ += len(mine ^ theirs) // 2
                total += len(mine)
        seen.clear()
        tgt = s[1:]
        lp = lambda x: x[:-1].log_softmax(-1).gather(-1, tgt[:, None])[:, 0]
        logp_err.append((lp(gen_logits) - lp(learner_logits[start:start + T]))[P - 1:].abs())
        dense_err.append((lp(dgen_logits) - lp(dense_learner[start:start + T]))[P - 1:].abs())
        start += T
    assert total > 1000 and differ / total < 0.02, (differ, total)  # measured 0.5-1.4% over 3 seeds
    err, derr = torch.cat(logp_err), torch.cat(dense_err)
    # measured: mean 0.011-0.030 nats vs the dense model's 0.007; max 0.2-0.3 vs 0.035 (a flipped key)
    assert err.mean() < max(5 * derr.mean(), 0.01) and err.max() < 0.5, (err.mean(), derr.mean(), err.max())


def test_indexcache_reload_keeps_trained_indexers(tmp_path, capsys):
    m = trained_indexer(tiny(topk=4, pattern="FS", layers=3))  # F S F: indexers on layers 0 and 2
    m.save_pretrained(str(tmp_path / "fs"))
    capsys.readouterr()
    every = GLM.from_pretrained(str(tmp_path / "fs"), dsa={**m.cfg.dsa.__dict__, "pattern": "F"})  # F F F
    out = capsys.readouterr().out
    assert "layer(s) 1 " in out and "initialised" in out  # only the missing one is new
    for i in (0, 2):
        for a, b in zip(every.layers[i].self_attn.indexer.parameters(), m.layers[i].self_attn.indexer.parameters()):
            assert torch.equal(a, b)
    every.save_pretrained(str(tmp_path / "fff"))
    capsys.readouterr()
    sparse = GLM.from_pretrained(str(tmp_path / "fff"), dsa={**m.cfg.dsa.__dict__, "pattern": "FSSS"})  # F S S
    out = capsys.readouterr().out
    assert "ignored" in out and "layer(s) 1-2" in out and "initialised" not in out
    assert sparse.layers[1].self_attn.indexer is None
    for a, b in zip(sparse.layers[0].self_attn.indexer.parameters(), m.layers[0].self_attn.indexer.parameters()):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- run-to-run determinism
# Two runs with the same seed must train the same model, bit for bit. Autograd's own backward of x[b, idx]
# (index_put_ with accumulate) adds float32 rows with atomics whenever the CPU runs several threads, so the
# gradient of a key that many queries pick was rounded differently in every run: two runs of the tiny default
# config (train.py, seed 0, 2 threads) drifted apart 16 steps into the supervised stage.

@pytest.fixture
def set_threads():
    """torch.set_num_threads for one test; the session's setting comes back afterwards."""
    n = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(n)


def test_gathered_keys_backward_is_bitwise_deterministic(set_threads):
    """The worst case for the order of a sum, on the bug report's 2 threads: every query picks the same first
    keys (as a fresh indexer's near-ties do), and one KV head, so both threads' halves land on the same keys."""
    set_threads(2)
    T, K, d = 4096, 8, 16
    g = torch.Generator().manual_seed(0)
    ik = torch.randn(1, T, d, generator=g, requires_grad=True)
    q = torch.randn(1, T, 2, d, generator=g, requires_grad=True)
    k, v = (torch.randn(1, T, 1, d, generator=g, requires_grad=True) for _ in range(2))
    idx = torch.arange(K).expand(1, T, K)
    valid = torch.ones(1, T, K, dtype=torch.bool)
    grad_ks, grad_out = torch.randn(1, T, K, d, generator=g), torch.randn(1, T, 2, d, generator=g)

    def grads():
        a = torch.autograd.grad(dsa._gather(ik, idx), ik, grad_ks)
        return a + torch.autograd.grad(dsa.sparse_attention(q, k, v, idx, valid, d**-0.5), (q, k, v), grad_out)

    first = grads()
    plain = torch.autograd.grad(ik[0][idx], ik, grad_ks)[0]
    assert rel_err(first[0], plain) < 1e-5  # autograd's own gradient, but for the order of the sums
    for _ in range(4):
        assert all(torch.equal(a, b) for a, b in zip(grads(), first))


def tiny_cpu_dsa():
    """configs/tiny_cpu.yaml's model, with the character tokenizer's vocabulary size."""
    return GLMConfig(vocab_size=40, hidden_size=96, intermediate_size=256, num_layers=3, num_heads=4, num_kv_heads=2,
                     head_dim=24, max_position_embeddings=64,
                     dsa=dict(topk=8, heads=4, head_dim=16, rope_dim=8, pattern="FS"))


@pytest.mark.parametrize("stage", ["sparse", "dense"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_training_step_is_bitwise_deterministic(stage, amp, set_threads):
    """What train.py's warm-up stages do on a CPU: one packed row of short sequences (positions restarting
    at 0), LM loss + indexer KL, backward; repeated, every gradient and the KL must come out the same bits.
    4 threads: with 2, the threads' halves of a packed row share few keys and reach them at different
    times, so the old race showed only now and then (16 steps into a run); with 4 it shows at once."""
    set_threads(4)
    torch.manual_seed(0)
    m = GLM(tiny_cpu_dsa())
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(12, 24, (16,), generator=g).tolist()  # ~280 tokens: enough for index_put_'s threads
    ids = torch.randint(0, 40, (1, sum(lens)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])[None]

    def step():
        m.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            logits, kl = m(ids, position_ids=pos, indexer_loss=stage)
            nll = -logits.float().log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None]).mean()
        (nll + kl).backward()
        return kl.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    kl, grads = step()
    assert len(grads) == len(list(m.parameters()))
    for _ in range(2):
        kl2, grads2 = step()
        assert torch.equal(kl2, kl)
        assert [n for n in grads if not torch.equal(grads[n], grads2[n])] == []


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_mla_shaped_sparse_attention_gradients_are_autograds_bit_for_bit(amp, monkeypatch):
    """One query row per key head (H = Hkv, MLA's layout): dsa._matmul's outer-product backward gives exactly the
    gradients of plain autograd matmuls (fp32, and a bf16-autocast forward with the backward outside autocast, as
    train.py runs it), and the gathered keys equal x[index], from a non-contiguous x too."""
    B, T, H, D, topk = 2, 19, 4, 8, 6
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, generator=g, requires_grad=True) for _ in range(3))
    idx, valid = dsa.select_topk(torch.randn(B, T, 2, 8), torch.randn(B, T, 2), torch.randn(B, T, 8),
                                 AttnMask(torch.arange(T), T), topk)
    grad_out = torch.randn(B, T, H, D, generator=g)

    def grads():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = dsa.sparse_attention(q, k, v, idx, valid, D ** -0.5)
        return (out.detach(),) + torch.autograd.grad(out, (q, k, v), grad_out)

    ours = grads()
    monkeypatch.setattr(dsa, "_matmul", lambda a, b: a @ b)
    plain = grads()
    assert all(torch.equal(a, b) for a, b in zip(ours, plain))
    if not amp:
        assert rel_err(ours[0].double(), naive_sparse(q.detach(), k.detach(), v.detach(), idx, valid, D ** -0.5)) < 1e-6
    kt = k.detach().transpose(1, 2)  # [B, H, T, D], not contiguous
    b, n = torch.arange(B)[:, None, None, None], torch.arange(H)[None, :, None, None]
    assert torch.equal(dsa.index_gather(kt, b, n, idx[:, None]), kt[b, n, idx[:, None]])
