"""families/mla_moe.py, the MLA + MoE families, glm4_moe_lite (GLM-4.7-Flash) and glm_moe_dsa (GLM-5), against
transformers' Glm4MoeLiteForCausalLM and GlmMoeDsaForCausalLM on tiny random configs; routing replay; expert-sharded
loading; the latent in the caches; the family's place in model.FAMILIES.

DSA with top-k below the sequence length compares selections across implementations: ours breaks score ties by
the earlier key, torch.topk in transformers by no stated rule, so these configs use 8 indexer heads, under which
an exact tie (every head's ReLU at 0, or equal sums) is rare, and the seeds below have none at a top-k boundary
(the fp32 logits agreeing to 1e-5 shows it)."""
import itertools
import json
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F
from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

import model
from families import mla_moe
from kernels import moe as kernels_moe
from families.mla_moe import Routing
from model import GLM, GLMConfig, KVCache


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


MOE_BASE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=16,
                q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=10, pad_token_id=0, eos_token_id=[1],
                mlp_layer_types=["dense", "sparse", "sparse"], max_position_embeddings=256)
# (model_type, overrides): grouped routing, no query latent, biases, two shared experts, a dense middle layer,
# v_head_dim below and equal to the q/k head width; DSA sparse (top-6 of up to 21 keys) and with top-k above T
MOE_CONFIGS = [
    ("glm4_moe_lite", dict(n_group=2, topk_group=1)),
    ("glm4_moe_lite", dict(q_lora_rank=None, attention_bias=True, n_shared_experts=2, qk_nope_head_dim=8, v_head_dim=16,
                           mlp_layer_types=["sparse", "dense", "sparse"], norm_topk_prob=False)),
    ("glm_moe_dsa", dict(index_topk=6, index_head_dim=16, index_n_heads=8, indexer_types=["full", "shared", "full"])),
    ("glm_moe_dsa", dict(index_topk=64, index_head_dim=16, index_n_heads=8, indexer_types=["full", "full", "shared"],
                         n_group=4, topk_group=2, routed_scaling_factor=1.5)),
]


def moe_hf_model(kind, over, seed=0):
    torch.manual_seed(seed)
    if kind == "glm4_moe_lite":
        m = Glm4MoeLiteForCausalLM(Glm4MoeLiteConfig(**{**MOE_BASE, **over}))
    else:
        m = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**{**MOE_BASE, **over}))
    m = m.float().eval()
    m.config._attn_implementation = "eager"
    with torch.no_grad():  # every tensor perturbed, the routers' score-correction biases too
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for name, b in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.1)
    return m


@pytest.fixture(scope="module", params=range(len(MOE_CONFIGS)), ids=[f"{k}-{i}" for i, (k, _) in enumerate(MOE_CONFIGS)])
def moe_pair(request, tmp_path_factory):
    hf = moe_hf_model(*MOE_CONFIGS[request.param], seed=request.param)
    path = str(tmp_path_factory.mktemp("hf_moe"))
    hf.save_pretrained(path)  # transformers writes each expert's matrices apart, as the published checkpoints
    return hf, GLM.from_pretrained(path).eval(), path


def test_moe_logits_match_transformers(moe_pair):
    hf, ours, _ = moe_pair
    assert ours.cfg.model_type == hf.config.model_type
    ids = torch.randint(0, 97, (3, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel_err(ours(ids), hf(ids).logits) < 1e-5


def recorded(m, ids, **kw):
    r = Routing(record=True)
    with torch.no_grad():
        m(ids, routing=r, **kw)
    return torch.stack(r.chosen)


def test_moe_bf16_autocast_matches_transformers(moe_pair):
    """Under bf16 autocast (fp32 master weights), against transformers in fp32, with the routes of the fp32
    forward replayed: in bf16 a token whose two best experts score within rounding of each other may take the
    other one (transformers in bf16 flips some too), and one flipped token moves these tiny random models' logits
    by up to 10%, so without replay the comparison would measure the flips. DSA with top-k below the sequence
    length has the same discrete choice (keys) and no replay for it: that config is compared in fp32 only (the
    packed test below checks it under autocast against itself)."""
    hf, ours, _ = moe_pair
    ids = torch.randint(0, 97, (3, 21), generator=torch.Generator().manual_seed(1))
    if ours.cfg.dsa is not None and ours.cfg.dsa.topk < ids.shape[1]:
        pytest.skip("DSA top-k selections flip in bf16: compared in fp32 and against ourselves")
    routes = recorded(ours, ids)
    with torch.no_grad():
        ref = hf(ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ours(ids, routing=Routing(replay=routes)).float()
    assert rel_err(out, ref) < 2e-2


@pytest.mark.parametrize("autocast", [False, True])
def test_moe_packed_rows_equal_separate_sequences(moe_pair, autocast):
    """Several sequences packed in one row (positions restarting at 0): in fp32 each sequence's logits are
    transformers' for it alone; under bf16 autocast ours packed equal ours separate (outputs and gradients),
    with the separate runs' routes replayed in the packed row (routes index the forward's rows)."""
    hf, ours, _ = moe_pair
    g = torch.Generator().manual_seed(5)
    lengths = (5, 8, 3, 7, 6, 1, 8)
    seqs = [torch.randint(0, 97, (n,), generator=g) for n in lengths]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    packed = torch.cat(seqs)[None]
    if not autocast:
        with torch.no_grad():
            out = ours(packed, position_ids=pos)[0]
            ref = torch.cat([hf(s[None]).logits[0] for s in seqs])
        assert rel_err(out, ref) < 1e-5
        return
    weight = torch.randn(97, generator=g)

    def run(fn):
        ours.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn().float()
        (out @ weight).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in ours.named_parameters() if p.grad is not None}
    routes = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        routes = torch.cat([recorded(ours, s[None]) for s in seqs], dim=2)  # [n_moe, 1, sum L, k]
    ref, ref_grads = run(lambda: torch.cat([ours(s[None])[0] for s in seqs]))
    out, grads = run(lambda: ours(packed, position_ids=pos, routing=Routing(replay=routes))[0])
    assert rel_err(out, ref) < 2e-2
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        assert rel_err(grads[n], ref_grads[n]) < 8e-2, n


def test_moe_save_loads_in_transformers(moe_pair, tmp_path):
    """Ours -> transformers: every tensor (experts written per expert) and the logits; and back to ours."""
    hf, ours, _ = moe_pair
    ours.save_pretrained(str(tmp_path / "ours"))
    cls = type(hf)
    back = cls.from_pretrained(str(tmp_path / "ours"), dtype=torch.float32).eval()
    back.config._attn_implementation = "eager"
    hf_state, back_state = hf.state_dict(), back.state_dict()
    assert hf_state.keys() == back_state.keys()
    for name, t in hf_state.items():
        assert torch.equal(back_state[name], t), name
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, hf(ids).logits)
    again = GLM.from_pretrained(str(tmp_path / "ours"))
    assert again.cfg == ours.cfg
    for (n, a), b in zip(ours.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), n


def test_replaying_recorded_routes_is_bit_identical(moe_pair):
    _, ours, _ = moe_pair
    ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(3))
    r = Routing(record=True)
    with torch.no_grad():
        ref = ours(ids, routing=r)
        routes = torch.stack(r.chosen)
        n_moe = len(ours.cfg.moe_layers)
        assert routes.shape == (n_moe, 2, 13, 2) and routes.dtype == mla_moe.route_dtype(ours.cfg) == torch.uint8
        again = Routing(replay=routes, record=True)
        out = ours(ids, routing=again)
    assert torch.equal(out, ref)
    assert torch.equal(torch.stack(again.chosen), routes)
    assert [a.tolist() for a in again.agree] == [[26, 26]] * n_moe  # every token replayed, each its own set


def naive_moe(mlp, x, ids):
    """An MoE layer's output token by token, with the experts ids [N, k]: the router's sigmoid scores at
    those ids, normalised and scaled, times each expert's SwiGLU, plus the shared experts."""
    c, I = mlp.gate.cfg, mlp.experts.down_proj.shape[2]
    scores = torch.sigmoid(x.double() @ mlp.gate.weight.double().T)
    out = []
    for n in range(x.shape[0]):
        w = scores[n, ids[n]]
        w = (w / w.sum() if c.norm_topk_prob else w) * c.routed_scaling_factor
        acc = 0
        for j, e in enumerate(ids[n].tolist()):
            gu = mlp.experts.gate_up_proj[e].double() @ x[n].double()
            acc = acc + w[j] * (mlp.experts.down_proj[e].double() @ (F.silu(gu[:I]) * gu[I:]))
        out.append(acc)
    return torch.stack(out) + mlp.shared_experts(x).double()


def test_replaying_other_routes_uses_those_experts(moe_pair):
    """Random routes replayed (NO_ROUTE for some tokens): each MoE layer's output is the naive computation with
    those experts (the router's own choice where NO_ROUTE), `chosen` holds them, and `agree` counts the replayed
    tokens whose own top-k set is the replayed one."""
    _, ours, _ = moe_pair
    cfg = ours.cfg
    B, T, k, E = 2, 11, cfg.moe.num_experts_per_tok, cfg.moe.n_routed_experts
    ids = torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(4))
    own = recorded(ours, ids)
    g = torch.Generator().manual_seed(6)
    routes = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(len(cfg.moe_layers) * B * T)])
    routes = routes.view(len(cfg.moe_layers), B, T, k).to(torch.uint8)
    routes[:, 0, 3] = own[:, 0, 3].flip(-1)  # the router's own set, in another order: agrees
    fresh = torch.zeros(B, T, dtype=torch.bool)
    fresh[1, 2:5] = True
    routes[:, fresh] = mla_moe.no_route(torch.uint8)
    seen = {}
    hooks = [layer.mlp.register_forward_hook(lambda m, i, o, j=j: seen.__setitem__(j, (i[0], o[0])))
             for j, layer in enumerate(l for l in ours.layers if isinstance(l.mlp, mla_moe.MoE))]
    r = Routing(replay=routes, record=True)
    try:
        with torch.no_grad():
            ours(ids, routing=r)
    finally:
        for h in hooks:
            h.remove()
    for j in range(len(cfg.moe_layers)):
        x, out = seen[j]
        mlp = ours.layers[cfg.moe_layers[j]].mlp
        with torch.no_grad():  # the router's own choice in this forward (after layer 0 the inputs differ from own's)
            mine = mlp.gate(x.flatten(0, 1))[0].view(B, T, k).to(torch.uint8)
        assert j or torch.equal(mine, own[0])
        used = torch.where(fresh[..., None], mine, routes[j])
        assert torch.equal(r.chosen[j], used)
        ref = naive_moe(mlp, x.flatten(0, 1), used.flatten(0, 1).long())
        assert rel_err(out.flatten(0, 1).double(), ref) < 1e-6
        same = (routes[j].sort(-1).values == mine.sort(-1).values).all(-1) & ~fresh
        assert r.agree[j].tolist() == [int(same.sum()), int((~fresh).sum())]
    assert r.agree[0][0] >= 1  # token (0, 3) of the first MoE layer


def test_router_gets_gradients_under_replay(moe_pair):
    """Replayed ids fix which experts run; their weights stay the router's own scores, so the router learns."""
    _, ours, _ = moe_pair
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(7))
    routes = recorded(ours, ids)
    ours.zero_grad()
    ours(ids, routing=Routing(replay=routes)).logsumexp(-1).mean().backward()
    for i in ours.cfg.moe_layers:
        g = ours.layers[i].mlp.gate.weight.grad
        assert g is not None and g.abs().sum() > 0
    ours.zero_grad()


def test_routes_with_keep_and_gradient_checkpointing(moe_pair):
    """keep: the last block's MoE runs on the kept positions only, takes their replayed routes, and records
    NO_ROUTE elsewhere; gradient checkpointing's recompute leaves the same record."""
    _, ours, _ = moe_pair
    cfg = ours.cfg
    ids = torch.randint(0, 97, (1, 15), generator=torch.Generator().manual_seed(8))
    keep = torch.tensor([2, 3, 9, 14])
    full = Routing(record=True)
    with torch.no_grad():
        ref = ours(ids, routing=full)[:, keep]
    routes = torch.stack(full.chosen)
    kept = Routing(replay=routes, record=True)
    with torch.no_grad():
        out = ours(ids, keep=keep, routing=kept)
    assert rel_err(out, ref) < 1e-6
    last = cfg.num_layers - 1
    for j, layer in enumerate(cfg.moe_layers):
        if layer == last:
            outside = torch.ones(15, dtype=torch.bool)
            outside[keep] = False
            assert (kept.chosen[j][:, outside] == mla_moe.no_route(torch.uint8)).all()
            assert torch.equal(kept.chosen[j][:, keep], routes[j][:, keep])
            assert kept.agree[j].tolist() == [len(keep), len(keep)]
        else:
            assert torch.equal(kept.chosen[j], routes[j])
    ours.gradient_checkpointing = True
    try:
        r = Routing(record=True)
        ours(ids, routing=r).logsumexp(-1).mean().backward()
    finally:
        ours.gradient_checkpointing = False
        ours.zero_grad()
    assert torch.equal(torch.stack(r.chosen), routes)


def test_moe_fp32_router_in_bf16_copies(moe_pair, tmp_path):
    """bf16 copies (loaded in bf16, or cast) keep the router's weight and score-correction bias in fp32
    (model.FP32_PARAMS, as transformers keeps them); weights=False reads the biases (buffers) from the file."""
    _, ours, path = moe_pair
    for m in (GLM.from_pretrained(path, dtype=torch.bfloat16), GLM.from_pretrained(path).cast_(torch.bfloat16)):
        for name, t in m.state_dict().items():
            assert t.dtype == (torch.float32 if name.endswith(model.FP32_PARAMS) else torch.bfloat16), name
    assert set(model.dsa.FP32_PARAMS) < set(model.FP32_PARAMS)
    shell = GLM.from_pretrained(path, weights=False)
    for (name, b), ref in zip(shell.named_buffers(), ours.buffers()):
        assert torch.equal(b, ref), name


def test_moe_config_roundtrip_and_init_dicts(moe_pair):
    """config.json -> GLMConfig -> config.json -> transformers' config: the same model; GLMConfig(**asdict(cfg))
    (model.init's nested mla / moe dicts) rebuilds it; kv_width and moe_layers."""
    hf, ours, _ = moe_pair
    cfg = ours.cfg
    assert GLMConfig.from_hf(cfg.to_hf()) == cfg
    assert GLMConfig(**asdict(cfg)) == cfg
    cls = type(hf.config)
    again = cls(**{k: v for k, v in cfg.to_hf().items() if k not in ("architectures", "model_type")})
    for key in ("mlp_layer_types", "n_group", "topk_group", "q_lora_rank", "v_head_dim", "routed_scaling_factor",
                "norm_topk_prob", "attention_bias", "n_shared_experts", "indexer_types", "index_topk"):
        assert getattr(again, key, None) == getattr(hf.config, key, None), key
    assert cfg.kv_width == 16 + 8
    assert cfg.moe_layers == [i for i, t in enumerate(hf.config.mlp_layer_types) if t == "sparse"]
    if cfg.model_type == "glm_moe_dsa":
        assert cfg.dsa.layer_kinds(3) == "".join("F" if t == "full" else "S" for t in hf.config.indexer_types)


def test_glm5_loads_without_dsa_as_glm4_moe_lite(moe_pair, tmp_path, capsys):
    """dsa=False on a GLM-5 checkpoint: its indexers dropped (one line), the rest is GLM-4.7-Flash's model,
    equal to the DSA model wherever top-k covers every key, and it saves as glm4_moe_lite."""
    _, ours, path = moe_pair
    if ours.cfg.model_type != "glm_moe_dsa":
        pytest.skip("a GLM-5 checkpoint")
    dense = GLM.from_pretrained(path, dsa=False).eval()
    assert dense.cfg.model_type == "glm4_moe_lite" and dense.cfg.dsa is None and "ignored" in capsys.readouterr().out
    ids = torch.randint(0, 97, (2, 6))  # top-k >= 6 keys: DSA is exactly dense attention
    with torch.no_grad():
        assert torch.equal(dense(ids), ours(ids))
    dense.save_pretrained(str(tmp_path / "lite"))
    assert GLMConfig.from_hf(json.load(open(tmp_path / "lite" / "config.json"))) == dense.cfg


def test_moe_config_from_init_kwargs_and_errors():
    """A fresh MoE model from model.init-style kwargs (nested dicts), the family's defaults, and clear errors."""
    init = dict(model_type="glm_moe_dsa", vocab_size=31, hidden_size=16, intermediate_size=32, num_layers=3,
                num_heads=2, mla={"q_lora_rank": 8, "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4,
                                  "v_head_dim": 8},
                moe={"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8},
                dsa={"topk": 4, "heads": 2, "head_dim": 8, "rope_dim": 4, "pattern": "FS"})
    cfg = GLMConfig(**init)
    assert (cfg.head_dim, cfg.partial_rotary_factor, cfg.num_kv_heads, cfg.attention_bias) == (4, 1.0, 2, False)
    assert cfg.moe.mlp_layer_types == ["dense", "sparse", "sparse"] and cfg.moe_layers == [1, 2]
    m = GLM(cfg)
    assert m(torch.randint(0, 31, (2, 6))).shape == (2, 6, 31)
    dense = GLMConfig(vocab_size=31, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2)
    assert (dense.head_dim, dense.partial_rotary_factor, dense.num_kv_heads, dense.attention_bias) == (128, 0.5, 2, True)
    assert dense.moe_layers == [] and dense.kv_width == 2 * 2 * 128
    bad = [(dict(init, moe={**init["moe"], "bogus": 1}), "unknown moe key"),
           (dict(init, dsa=None), "without DSA it is glm4_moe_lite"),
           (dict(init, head_dim=8), "head_dim is 4 in an MLA model"),
           (dict(init, model_type="glm4"), "mla / moe need model_type"),
           (dict(init, model_type="glm4_moe_lite", mla=None), "needs both mla and moe"),
           (dict(init, moe={**init["moe"], "mlp_layer_types": ["dense", "sparse"]}), "2 entries for 3 layers"),
           (dict(init, moe={**init["moe"], "num_experts_per_tok": 5}), "exceeds"),
           (dict(init, dsa={**init["dsa"], "rope_dim": 2}), "dsa.rope_dim is 2")]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            GLMConfig(**kwargs)


class FakeShard:
    """What ExpertPart.copy_ sees of an FSDP2 DTensor sharded along dim 0 over `ranks` ranks."""

    def __init__(self, full_shape, rank, ranks):
        n = full_shape[0]
        per = -(-n // ranks)
        self.shape = full_shape
        self.local = torch.zeros(max(0, min(n, (rank + 1) * per) - min(n, rank * per)), *full_shape[1:])
        self.device_mesh = type("Mesh", (), {"size": lambda s: ranks, "get_local_rank": lambda s: rank})()

    def to_local(self):
        return self.local


def test_expert_sharded_loading_reads_only_this_ranks_experts(moe_pair):
    """Under FSDP2 (experts sharded along dim 0, as torch.chunk splits) each rank fills its own experts from
    the per-expert file tensors, and reads no other expert's."""
    _, ours, path = moe_pair
    cfg = ours.cfg
    layer = cfg.moe_layers[0]
    name = f"model.layers.{layer}.mlp.experts.gate_up_proj"
    full = ours.layers[layer].mlp.experts.gate_up_proj.detach()
    files = {n: f for f, names in model._safetensors_files(path).items() for n in names}
    for ranks in (2, 3):
        got = []
        for rank in range(ranks):
            shard = FakeShard(tuple(full.shape), rank, ranks)
            reads = []
            for file_name, part in mla_moe._split_experts({name: shard}, cfg).items():
                def read(rows, file_name=file_name):
                    reads.append(file_name)
                    with model.safe_open(files[file_name], framework="pt") as f:
                        return f.get_slice(file_name)[rows]
                model._copy_rows(part, read)
            held = {int(n.split(".experts.")[1].split(".")[0]) for n in reads}
            per = -(-full.shape[0] // ranks)
            assert held == set(range(rank * per, min(full.shape[0], (rank + 1) * per)))
            got.append(shard.local)
        assert torch.equal(torch.cat(got), full)


# ----------------------------------------------------------------------------- MLA caches: the latent

def test_moe_kv_cache_holds_the_latent_and_decodes_as_the_full_forward(moe_pair):
    """KVCache of an MLA model: one latent of kv_lora_rank + qk_rope_head_dim values per token per layer (and
    indexer keys on F layers); a prefill then one token at a time gives the full forward's logits (with DSA:
    top-6 decode among up to 16 keys)."""
    _, ours, _ = moe_pair
    cfg = ours.cfg
    cache = KVCache(cfg, 3, 16)
    assert [t.shape for t in cache.k] == [(3, 16, cfg.kv_width)] * cfg.num_layers and cache.v == []
    ids = torch.randint(2, 97, (3, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = ours(ids)
        steps = [ours(ids[:, :6], cache=cache)]
        for t in range(6, 16):
            steps.append(ours(ids[:, t:t + 1], cache=cache))
    assert rel_err(torch.cat(steps, 1), full) < 1e-5


def paged_slots(blocks, n):
    """The pool slots of a sequence's first n positions, its blocks in order."""
    return [blocks[p // model.BLOCK_SIZE] * model.BLOCK_SIZE + p % model.BLOCK_SIZE for p in range(n)]


def paged_rows(pool, m, tokens, pos, blocks, routing=None):
    """One paged forward of rows that each feed one token (a decode step, or an extension's new tokens, as
    machinery/graphs.decode_forward runs them): row i's keys are its sequence's slots up to its position,
    left-padded. -> logits [R, V]."""
    Lk = max(pos) + 1
    keys, valid = [], []
    for p, b in zip(pos, blocks):
        s = paged_slots(b, p + 1)
        keys.append([s[0]] * (Lk - len(s)) + s)
        valid.append([False] * (Lk - len(s)) + [True] * len(s))
    pool.keys, pool.key_valid = torch.tensor(keys), torch.tensor(valid)
    pool.slots = pool.keys[:, -1]
    try:
        return m(torch.tensor(tokens)[:, None], position_ids=torch.tensor(pos)[:, None], cache=pool,
                 routing=routing)[:, -1]
    finally:
        pool.keys = None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_paged_prefill_decode_and_extension_equal_the_full_forward(moe_pair, dtype):
    """The engine's paths over a PagedKVCache of latents: contexts prefilled as one packed row (keep = each
    context's last token, one context's latents copied for a second request), decode steps of all rows, and a
    turn that extends a parked context by several tokens as rows of one paged forward; logits equal the full
    forward's of each whole sequence, DSA decode choosing top-6 among up to 30 keys. fp32: within 1e-5, and the
    routes recorded on the way (prefill: every token, the last layer at the kept tokens only; decode and
    extension: each row's token) are the full forward's. bf16 weights: within 2e-2 of the bf16 model's full
    forward, replaying its routes (in bf16 a near-tied expert flips between two shapes of the same sum, and
    moves a tiny random model's logits by more than rounding; the DSA configs get 0.25, as a bf16 top-k near a
    tie may flip too: tests/test_engine.py's tolerance for the dense model's)."""
    _, ref, _ = moe_pair
    m = GLM(ref.cfg).eval()
    m.load_state_dict(ref.state_dict())
    m.cast_(dtype)
    cfg, NR, fp32 = m.cfg, mla_moe.no_route(torch.uint8), dtype == torch.float32
    tol = 1e-5 if fp32 else 2e-2 if cfg.dsa is None else 0.25
    pool = model.PagedKVCache(cfg, 12, model.BLOCK_SIZE, dtype=dtype)
    assert [t.shape[1:] for t in pool.k] == [(cfg.kv_width,)] * cfg.num_layers and pool.v == []
    g = torch.Generator().manual_seed(11)
    ctx = [torch.randint(2, 97, (n,), generator=g).tolist() for n in (5, 18, 9)]
    ctx.append(ctx[0])  # a fourth request shares the first one's context: prefilled once, its latents copied
    steps = torch.randint(2, 97, (6, 4), generator=g).tolist()  # decode: each request one token per step
    new = torch.randint(2, 97, (7,), generator=g).tolist()  # then a later turn of request 1: 7 tokens at once
    seqs = [c + [s[i] for s in steps] + (new if i == 1 else []) for i, c in enumerate(ctx)]
    full, routes = [], []  # the reference: each whole sequence's full forward
    for s in seqs:
        r = Routing(record=True)
        with torch.no_grad():
            full.append(m(torch.tensor([s]), routing=r)[0].float())
        routes.append(torch.stack(r.chosen)[:, 0])  # [n_moe, L, k]

    def routing(parts):  # record (fp32), or replay the full forwards' routes at (request, positions) (bf16)
        return Routing(record=True) if fp32 else Routing(replay=torch.stack([routes[i][:, p] for i, p in parts], 1))
    blocks = [[0, 1], [2, 3], [4, 5], [6, 7]]
    row = [t for c in ctx[:3] for t in c]
    pos = [p for c in ctx[:3] for p in range(len(c))]
    ends = torch.tensor(list(itertools.accumulate(len(c) for c in ctx[:3]))) - 1
    pool.slots = torch.tensor([s for c, b in zip(ctx[:3], blocks) for s in paged_slots(b, len(c))])
    pool.copies = [(torch.tensor(paged_slots(blocks[3], 5)), torch.arange(5))]
    pool.packed = model.Packed.of(torch.tensor([pos]))
    r = Routing(record=True) if fp32 else Routing(  # the packed row: each context's routes in turn
        replay=torch.cat([routes[i][:, None, :len(c)] for i, c in enumerate(ctx[:3])], 2))
    with torch.no_grad():
        first = m(torch.tensor([row]), position_ids=torch.tensor([pos]), cache=pool, keep=ends, routing=r)[0]
    pool.copies, pool.packed = [], None
    outs = [[first[i]] for i in range(3)] + [[first[0]]]
    got_routes = [[torch.stack(r.chosen)[:, 0, a:a + len(c)]] for a, c in zip([0, 5, 23], ctx[:3])] if fp32 else None
    with torch.no_grad():
        for j, tok in enumerate(steps):
            at = [len(c) + j for c in ctx]
            r = routing([(i, torch.tensor([p])) for i, p in enumerate(at)])
            logits = paged_rows(pool, m, tok, at, blocks, routing=r)
            for i in range(4):
                outs[i].append(logits[i])
                if fp32 and i < 3:
                    got_routes[i].append(torch.stack(r.chosen)[:, i])
        start = len(ctx[1]) + len(steps)
        blocks[1] = blocks[1] + [8]  # request 1's blocks grow to hold 30 tokens
        r = routing([(1, torch.tensor([p])) for p in range(start, start + 7)])
        ext = paged_rows(pool, m, new, list(range(start, start + 7)), [blocks[1]] * 7, routing=r)
    for i in range(4):
        n0 = len(ctx[i])
        got = torch.stack([o.float() for o in outs[i]])
        assert rel_err(got, full[i][n0 - 1:n0 + len(steps)]) < tol, i
    assert rel_err(ext.float(), full[1][start:]) < tol
    if fp32:
        for i in range(3):
            n0 = len(ctx[i])
            want, got = routes[i][:, :n0 + len(steps)].clone(), torch.cat(got_routes[i], 1)  # [n_moe, n0 + 6, k]
            if cfg.moe_layers[-1] == cfg.num_layers - 1:  # the last block ran on each context's last token only
                assert (got[-1, :n0 - 1] == NR).all()
                want[-1, :n0 - 1] = NR
            assert torch.equal(got, want), i
        assert torch.equal(torch.stack(r.chosen)[:, :, 0], routes[1][:, start:])


def test_a_glm5_config_json_without_moe_keys_means_glm5s_moe_not_flashs():
    """transformers' glm_moe_dsa defaults (GLM-5: 256 experts, top-8, 2048 wide, scaling 2.5) where config.json omits
    them, as transformers reads it; glm4_moe_lite keeps GLM-4.7-Flash's."""
    want = GlmMoeDsaConfig()
    for d in (json.loads(GlmMoeDsaConfig(num_hidden_layers=4).to_json_string()),):
        d = {k: v for k, v in d.items() if k not in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                      "routed_scaling_factor")}
        moe = model.GLMConfig.from_hf(d).moe
        assert (moe.n_routed_experts, moe.num_experts_per_tok, moe.moe_intermediate_size, moe.routed_scaling_factor) == \
            (want.n_routed_experts, want.num_experts_per_tok, want.moe_intermediate_size, want.routed_scaling_factor)
    flash = json.loads(Glm4MoeLiteConfig(num_hidden_layers=4).to_json_string())
    flash = {k: v for k, v in flash.items() if k not in ("n_routed_experts", "routed_scaling_factor")}
    moe = model.GLMConfig.from_hf(flash).moe
    assert (moe.n_routed_experts, moe.routed_scaling_factor) == (64, 1.8)


# ----------------------------------------------------------------------------- the experts' cast cache, one sort

CAST_CFG = dict(model_type="glm4_moe_lite", vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=3,
                num_heads=4, mla=dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                      v_head_dim=8),
                moe=dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                         mlp_layer_types=["dense", "sparse", "sparse"]))


def experts_of(m):
    return [layer.mlp.experts for layer in m.layers if isinstance(layer.mlp, mla_moe.MoE)]


def cast_model(seed=0):
    torch.manual_seed(seed)
    return GLM(GLMConfig(**CAST_CFG))


def train_step(m, opt, batches, cache: bool, autocast=True):
    """One optimizer step over micro-batches (ids, replayed routes or None) under bf16 autocast, the cast cache on or
    off (off: every forward and recompute casts the experts, the previous path) -> (logits, gradients)."""
    kernels_moe.CAST_CACHE = cache
    try:
        outs = []
        for ids, routes in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = m(ids, routing=Routing(replay=routes))
            logits.float().logsumexp(-1).mean().backward()
            outs.append(logits.detach())
        grads = [p.grad.clone() for p in m.parameters() if p.requires_grad]
        opt.step()
        opt.zero_grad(set_to_none=True)
        return outs, grads
    finally:
        kernels_moe.CAST_CACHE = True


def test_expert_weights_cast_once_per_step_across_forwards_and_recomputes():
    """bf16 autocast over fp32 masters, gradient checkpointing, two micro-batches (one replaying routes), fused AdamW
    (train.adamw's, which steps in place without bumping _version) for two steps: logits and every gradient have
    the bits of the path that casts in every forward, and each expert weight is cast once per step (2 weights x 2
    MoE layers), not once per forward and recompute (8 each). Outside autocast, or with bf16 weights, nothing is
    cast or kept."""
    ours, ref = cast_model(), cast_model()
    for m in (ours, ref):
        m.gradient_checkpointing = True
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (ours, ref)]
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 97, (2, 9), generator=g) for _ in range(2)]
    batches = [(ids[0], recorded(ours, ids[0])), (ids[1], None)]
    for step in range(2):
        out, grads = train_step(ours, opts[0], batches, True)
        out_ref, grads_ref = train_step(ref, opts[1], batches, False)
        for a, b in zip(out + grads, out_ref + grads_ref):
            assert torch.equal(a, b), step
        assert [e.casts.casts for e in experts_of(ours)] == [2 * (step + 1)] * 2 and experts_of(ref)[0].casts.casts == 0
        assert all(not e.casts.copies for e in experts_of(ours))  # dropped by the step: none held until the next forward
    for (n, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), n
    plain = cast_model()
    train_step(plain, torch.optim.AdamW(plain.parameters()), batches, True, autocast=False)  # fp32: no autocast
    bf16 = cast_model().cast_(torch.bfloat16)  # the weights already in the compute dtype (the router's in fp32)
    train_step(bf16, torch.optim.AdamW(bf16.parameters()), batches, True)
    assert all(e.casts.casts == 0 for e in experts_of(plain) + experts_of(bf16))


def test_the_residual_stream_stays_bf16_under_cudas_autocast_policy():
    """CUDA's autocast runs sum (and softmax, exp, ...) in fp32 and returns fp32, where the CPU's returns bf16: the
    experts' sum over k came back fp32 on an H200, the residual stream turned fp32 from the first MoE layer on and
    every later layer's experts ran fp32, off the cast cache and torch._grouped_mm (found by profile: 0.85x
    transformers). With that policy emulated on a CPU (conftest.CudaAutocastFP32Ops), every MoE layer's experts see
    bf16 and take their bf16 copies (2 casts a layer), forward and recompute, and the logits are those of the plain
    CPU autocast."""
    from conftest import CudaAutocastFP32Ops
    m = cast_model()
    m.gradient_checkpointing = True
    seen = []
    hooks = [e.register_forward_pre_hook(lambda mod, a: seen.append(a[0].dtype)) for e in experts_of(m)]
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = m(ids).detach()
    with CudaAutocastFP32Ops():  # the forward, and backward's recompute (checkpointing restores the autocast)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cuda_like = m(ids)
        cuda_like.float().logsumexp(-1).mean().backward()
    for h in hooks:
        h.remove()
    assert seen and all(d == torch.bfloat16 for d in seen), seen
    assert [e.casts.casts for e in experts_of(m)] == [2, 2]
    torch.testing.assert_close(cuda_like.float(), plain.float(), rtol=0, atol=0)


def test_frozen_expert_weights_are_cast_once_for_good():
    """LoRA's way (frozen experts, no optimizer holds them) with fp32 weights under autocast: their copies are made
    by the first step and kept through the later ones; the trained weights' gradients are unchanged by it."""
    ours, ref = cast_model(), cast_model()
    for m in (ours, ref):
        for e in experts_of(m):
            e.requires_grad_(False)
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, fused=True)
            for m in (ours, ref)]
    batches = [(torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2)), None)]
    for step in range(2):
        out, grads = train_step(ours, opts[0], batches, True)
        out_ref, grads_ref = train_step(ref, opts[1], batches, False)
        assert all(torch.equal(a, b) for a, b in zip(out + grads, out_ref + grads_ref))
        assert [e.casts.casts for e in experts_of(ours)] == [2, 2]
        assert all(len(e.casts.copies) == 2 for e in experts_of(ours))


def test_fsdp2_gathered_experts_are_never_cached():
    """FSDP2 (one CPU process, gloo over an in-process store) gathering the experts as stored, fp32, under bf16
    autocast: they are cast in each forward as before and nothing is cached (a cached copy of gathered weights would
    keep every layer's experts whole on every rank, and FSDP's gathered parameter is not the one its optimizer
    steps, so no step would drop it), with the unsharded model's logits before and after an optimizer step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    ours, ref = cast_model(), cast_model()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for layer in ours.layers:
            fully_shard(layer, mesh=mesh, mp_policy=MixedPrecisionPolicy())
        fully_shard(ours, mesh=mesh)
        assert all(getattr(e, "_is_fsdp_managed_module", False) for e in experts_of(ours))
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for m in (ours, ref)]
        batches = [(torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3)), None)]
        for step in range(2):
            out, out_ref = train_step(ours, opts[0], batches, True)[0], train_step(ref, opts[1], batches, False)[0]
            assert torch.equal(out[0], out_ref[0]), step
        assert all(e.casts.casts == 0 for e in experts_of(ours))
    finally:
        dist.destroy_process_group()


def test_same_experts_is_the_sorted_comparison():
    """same_experts (no sort) against comparing the sorted rows, with the router's k distinct ids on one side and
    anything on the other (other orders, repeats, other experts)."""
    g = torch.Generator().manual_seed(4)
    for k, E in ((1, 3), (2, 4), (4, 8), (8, 9)):
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(500)])
        other = torch.randint(0, E, (500, k), generator=g)
        other[::3] = ids[::3][:, torch.randperm(k, generator=g)]  # the same set, shuffled
        other[1::7, 0] = other[1::7, -1]  # repeats
        want = (ids.sort(-1).values == other.sort(-1).values).all(-1)
        assert torch.equal(mla_moe.same_experts(ids, other), want) and want.any() and not want.all()


def test_an_moe_layer_sorts_once_under_replay():
    """An MoE layer's forward with replayed routes runs one sort, the experts' (the routes' agreement is counted
    without sorting either side), with or without replay."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Sorts(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func.overloadpacket.__name__ in ("sort", "argsort")
            return func(*args, **(kwargs or {}))

    m = cast_model()
    mlp = next(layer.mlp for layer in m.layers if isinstance(layer.mlp, mla_moe.MoE))
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(5))
    routes = torch.randint(0, 8, (2, 9, 2), generator=torch.Generator().manual_seed(6)).to(torch.uint8)
    for replay in (routes, None):
        with Sorts() as sorts:
            mlp(x, replay)
        assert sorts.n == 1
