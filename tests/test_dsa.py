"""dsa.py: the indexer formula, top-k selection, sparse attention, the indexer losses and IndexCache,
checked against naive float64 loops and against the dense model. Sequences are longer than top-k
wherever it matters: a bug in sparse attention hides when every key is selected."""
import math

import pytest
import torch

import dsa
from model import GLM, AttnMask, GLMConfig, KVCache, apply_rope, rope_cos_sin


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
    cos, sin = rope_cos_sin(pos, cfg.rope_dim, theta)
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
