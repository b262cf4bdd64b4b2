"""
The MLA + MoE families, GLM-4.7-Flash and GLM-5: a chapter of its own for GLM-5's readers, read after model.py
(the dense GLM-4 decoder, whose Attention, RMSNorm, caches and checkpoint code this file reuses) and dsa.py. They
are transformers' `glm4_moe_lite` (Glm4MoeLiteForCausalLM, GLM-4.7-Flash) and `glm_moe_dsa` (GlmMoeDsaForCausalLM,
GLM-5), numerically the same models. This file registers both in model.FAMILIES when imported (its last lines,
one model.Family: where the dense code asks a model_type for its config, layers and checkpoint names, these
answer); model.py never imports it, machinery/__init__.py does. Their block is

    x += attn(input_norm(x));  x += mlp(post_attention_norm(x))          (no sandwich norms)

with Multi-head Latent Attention (MLA, DeepSeek-V2) and, after the first dense layers, an MoE MLP:
  - MLA: queries through a low-rank bottleneck (q_a_proj -> RMSNorm -> q_b_proj), keys and values from one
    shared latent per token: c = RMSNorm(kv_a_proj(x)[:kv_lora_rank]) and a rotated key part k_rope =
    RoPE(kv_a_proj(x)[kv_lora_rank:]) shared by every head. kv_b_proj expands c into each head's no-rope
    key part and its value. A cache holds only [c, k_rope] (kv_lora_rank + qk_rope_head_dim values per token
    per layer): 576 for GLM-4.7-Flash, where expanded keys and values would take 20 heads x 512.
    Head h scores q_h = [q_nope_h, RoPE(q_rope_h)] against k_h = [k_nope_h, k_rope] with scale
    (qk_nope_head_dim + qk_rope_head_dim)^-0.5; RoPE is interleaved, over all of qk_rope_head_dim.
  - MoE: a sigmoid router in fp32 picks num_experts_per_tok of n_routed_experts experts per token (by score
    + e_score_correction_bias, within the best topk_group of n_group groups), weighs them by their un-biased
    scores (normalised if norm_topk_prob, times routed_scaling_factor), and adds the shared experts' SwiGLU.
    kernels/moe.py computes the routed experts grouped by expert.
  - GLM-5's DSA indexer reads the query latent: its query is wq_b(q_a_layernorm(q_a_proj(x))), its key
    LayerNorm(wk(x)), its head weights weights_proj(x); `indexer_types` full / shared is DSA's IndexCache
    pattern F / S. Selection, sparse attention and the indexer losses are dsa.py's, as for GLM-4 + DSA.

Routing replay (RL): the generator records which experts each token took (MoE.routed writes them beside the
token's KV slot, in PagedKVCache.routes; the engine reads them out with each finished row as Completion.routes),
the learner's forward replays them (a Routing with apply=True, built by parallel.MicroBatch.routing), so that a tiny numeric difference between the two cannot send a
token to other experts, which would make the importance ratio of that token meaningless.
"""
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open

import dsa
from dsa import DSAConfig, Indexer
from kernels import moe as moe_kernels
from model import (FAMILIES, GLM, Attention, AttnMask, Family, GLMConfig, PagedKVCache, RMSNorm, _safetensors_files,
                   apply_rope, hf_name, init_weights)

# ----------------------------------------------------------------------------- config

LATENT_TYPES = {"glm4_moe_lite": "Glm4MoeLiteForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}


@dataclass
class MLAConfig:
    """Multi-head Latent Attention's shapes (transformers' names). In these families GLMConfig's
    head_dim is qk_rope_head_dim (the rotated part, as transformers has it), partial_rotary_factor 1,
    num_kv_heads num_heads, attention_bias False by default (it biases q_a_proj, kv_a_proj_with_mqa, o_proj)."""
    q_lora_rank: int | None = 768  # None: a full-rank q_proj
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256

    def __post_init__(self):
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"mla.{key} must be a positive integer, got {getattr(self, key)!r}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank < 1):
            raise ValueError(f"mla.q_lora_rank must be a positive integer or null, got {self.q_lora_rank!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"mla.qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass
class MoEConfig:
    """The MoE MLP (transformers' names). The router's e_score_correction_bias is a buffer, not a
    parameter: pre-training moves it by a load-balancing rule (raise an expert's bias while it gets too few
    tokens), not by gradients, and RL keeps it frozen, since nothing in an RL loss balances the load and a
    moving bias would re-route tokens under the generator's feet."""
    n_routed_experts: int = 64
    num_experts_per_tok: int = 4  # k
    moe_intermediate_size: int = 1536  # each expert's (and, times n_shared_experts, the shared MLP's) width
    n_shared_experts: int = 1
    n_group: int = 1  # experts form n_group groups; a token chooses within its best topk_group groups
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.8
    # per layer "dense" (an MLP of intermediate_size) or "sparse" (this MoE); empty: the first layer dense,
    # the others sparse (transformers' default for glm4_moe_lite)
    mlp_layer_types: list[str] = field(default_factory=list)

    def __post_init__(self):
        E, G = self.n_routed_experts, self.n_group
        for key in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"moe.{key} must be a positive integer, got {getattr(self, key)!r}")
        if E % G or self.topk_group > G or (G > 1 and E // G < 2):
            raise ValueError(f"moe: {E} experts in n_group {G} groups (at least 2 each), topk_group {self.topk_group}")
        if self.num_experts_per_tok > self.topk_group * E // G:
            raise ValueError(f"moe.num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts of "
                             f"topk_group groups ({self.topk_group * E // G})")
        if set(self.mlp_layer_types) - {"dense", "sparse"}:
            raise ValueError(f"moe.mlp_layer_types holds 'dense' or 'sparse', got {self.mlp_layer_types}")


def _from_dict(cls, d, section):
    if not isinstance(d, dict):
        return d
    unknown = set(d) - set(cls.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown {section} key(s) {sorted(unknown)}; valid: {sorted(cls.__dataclass_fields__)}")
    return cls(**d)


def _latent_post_init(cfg: GLMConfig):
    """GLMConfig.__post_init__ for the MLA + MoE families: nested dicts (a YAML model.init) to dataclasses,
    the family's defaults, and checks."""
    cfg.mla, cfg.moe = _from_dict(MLAConfig, cfg.mla, "mla"), _from_dict(MoEConfig, cfg.moe, "moe")
    if cfg.mla is None or cfg.moe is None:
        raise ValueError(f"model_type {cfg.model_type} needs both mla and moe")
    m = cfg.mla
    if not cfg.moe.mlp_layer_types:
        cfg.moe = replace(cfg.moe, mlp_layer_types=["dense"] + ["sparse"] * (cfg.num_layers - 1))
    if len(cfg.moe.mlp_layer_types) != cfg.num_layers:
        raise ValueError(f"moe.mlp_layer_types has {len(cfg.moe.mlp_layer_types)} entries for {cfg.num_layers} layers")
    fixed = {"head_dim": m.qk_rope_head_dim, "partial_rotary_factor": 1.0, "num_kv_heads": cfg.num_heads}
    for key, value in fixed.items():
        if getattr(cfg, key) not in (None, value):
            raise ValueError(f"{key} is {value} in an MLA model ({cfg.model_type}), got {getattr(cfg, key)}")
        setattr(cfg, key, value)
    if cfg.attention_bias is None:
        cfg.attention_bias = False
    if cfg.model_type == "glm_moe_dsa":
        if cfg.dsa is None or m.q_lora_rank is None:
            raise ValueError("glm_moe_dsa (GLM-5) has DSA and a query latent (dsa and mla.q_lora_rank); "
                             "without DSA it is glm4_moe_lite")
        if cfg.dsa.rope_dim != m.qk_rope_head_dim:
            raise ValueError(f"glm_moe_dsa's indexer rotates qk_rope_head_dim ({m.qk_rope_head_dim}) dims, "
                             f"dsa.rope_dim is {cfg.dsa.rope_dim}")


def _period(s: str) -> str:
    """The shortest p with (p * n)[:len(s)] == s: 'FSSFSSFS' -> 'FSS'."""
    return next(s[:n] for n in range(1, len(s) + 1) if (s[:n] * len(s))[:len(s)] == s)


# transformers' defaults where a family's differ from MoEConfig's (GLM-4.7-Flash's): what a config.json without
# these keys means
MOE_DEFAULTS = {"glm_moe_dsa": {"n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
                                "routed_scaling_factor": 2.5}}


def _latent_from_hf(cls, d: dict, rope: dict) -> GLMConfig:
    kind, L = d.get("model_type"), d["num_hidden_layers"]
    if d.get("rope_interleave", True) is False:
        raise ValueError("config.json: rope_interleave false is not supported (GLM's MLA rotates interleaved pairs)")
    n_dense = 1 if kind == "glm4_moe_lite" else min(d.get("first_k_dense_replace", 3), L)  # transformers' defaults
    dsa_cfg = d.get("dsa")
    if kind == "glm_moe_dsa":
        types = d.get("indexer_types")
        if types is None:  # transformers derives it so from older config.json files
            pattern = d.get("index_topk_pattern")
            if pattern is not None:
                types = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
            else:
                freq, offset = max(d.get("index_topk_freq", 1), 1), d.get("index_skip_topk_offset", 2)
                types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(L)]
        dsa_cfg = DSAConfig(topk=d.get("index_topk", 2048), heads=d.get("index_n_heads", 32),
                            head_dim=d.get("index_head_dim", 128), rope_dim=d.get("qk_rope_head_dim", 64),
                            pattern=_period("".join({"full": "F", "shared": "S"}[t] for t in types)))
    return cls(
        model_type=kind, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"], num_layers=L, num_heads=d["num_attention_heads"],
        rope_theta=rope.get("rope_theta", d.get("rope_theta", 10000.0)), rms_norm_eps=d.get("rms_norm_eps", 1e-5),
        attention_bias=d.get("attention_bias", False), tie_word_embeddings=d.get("tie_word_embeddings", False),
        max_position_embeddings=d.get("max_position_embeddings", 202752), pad_token_id=d.get("pad_token_id"),
        eos_token_id=d.get("eos_token_id") or [], bos_token_id=d.get("bos_token_id"), dsa=dsa_cfg,
        mtp_layers=d.get("num_nextn_predict_layers", 0),  # (families/mtp.py: model.layers.{L}.* in the files)
        mla=MLAConfig(**{k: d[k] for k in MLAConfig.__dataclass_fields__ if k in d}),
        moe=MoEConfig(**MOE_DEFAULTS.get(kind, {}) | {k: d[k] for k in MoEConfig.__dataclass_fields__
                                                      if k in d and k != "mlp_layer_types"},
                      mlp_layer_types=list(d.get("mlp_layer_types") or ["dense"] * n_dense + ["sparse"] * (L - n_dense))),
    )


def _latent_to_hf(cfg: GLMConfig) -> dict:
    m, e = cfg.mla, cfg.moe
    d = {
        "architectures": [LATENT_TYPES[cfg.model_type]], "model_type": cfg.model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads, **asdict(m), **asdict(e), "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}, "rope_interleave": True,
        "rms_norm_eps": cfg.rms_norm_eps, "attention_bias": cfg.attention_bias,
        "tie_word_embeddings": cfg.tie_word_embeddings, "max_position_embeddings": cfg.max_position_embeddings,
        "pad_token_id": cfg.pad_token_id, "eos_token_id": cfg.eos_token_id, "bos_token_id": cfg.bos_token_id,
        "num_nextn_predict_layers": cfg.mtp_layers,
    }
    if cfg.model_type == "glm_moe_dsa":
        kinds = cfg.dsa.layer_kinds(cfg.num_layers)
        d.update(index_topk=cfg.dsa.topk, index_n_heads=cfg.dsa.heads, index_head_dim=cfg.dsa.head_dim,
                 indexer_types=["full" if c == "F" else "shared" for c in kinds])
    elif cfg.dsa is not None:
        d["dsa"] = asdict(cfg.dsa)  # grafted on GLM-4.7-Flash: ours (transformers ignores it)
    return d


def _latent_with_dsa(cfg: GLMConfig, dsa) -> GLMConfig:
    """from_pretrained's dsa=: as GLM-4's; GLM-5 without its indexers (dsa=False) is GLM-4.7-Flash's model."""
    if dsa is False and cfg.model_type == "glm_moe_dsa":
        cfg = replace(cfg, model_type="glm4_moe_lite")
    return replace(cfg, dsa=dsa or None)  # re-validates; a dict becomes a DSAConfig


# ----------------------------------------------------------------------------- routing record / replay

@dataclass
class Routing:
    """Which experts each token took, per MoE layer (cfg.moe_layers, in order; n_moe of them), for
    GLM.forward(routing=...). Ids are route_dtype(cfg) (uint8 below 255 experts), NO_ROUTE = no_route(dtype)."""
    # [n_moe, B, T, k] expert ids to use, rows as the forward's input rows (packed rows too); a token whose
    # ids hold NO_ROUTE is routed freshly (a token the generator never routed there)
    replay: torch.Tensor | None = None
    apply: bool = True  # use the replayed ids (False: route freshly, only count agreement with them)
    record: bool = False  # fill `chosen`
    # per MoE layer [B, T, k]: this forward's choice (the replayed ids where replayed); NO_ROUTE where the layer
    # did not run (the last block's positions outside `keep`). Assigned by layer index, so the recompute of
    # gradient checkpointing writes the same again.
    chosen: list = field(default_factory=list)
    # replay only, per MoE layer: int64 [2] = (replayed tokens whose router's own top-k SET equals the replayed
    # set, replayed tokens), from the router's own choice in the same forward
    agree: list = field(default_factory=list)


def route_dtype(cfg: GLMConfig) -> torch.dtype:
    return torch.uint8 if cfg.moe.n_routed_experts < 255 else torch.int16


def no_route(dtype) -> int:
    """The id that means "not routed" in a routes tensor of this dtype: its largest value."""
    return torch.iinfo(dtype).max


def _routes(cfg: GLMConfig, slots: int, device) -> list:
    """Family.routes, model.PagedKVCache.routes: per MoE layer, the experts [slots, k] each slot's token took,
    NO_ROUTE until the forward writes them (MoE.routed)."""
    dt = route_dtype(cfg)
    return [torch.full((slots, cfg.moe.num_experts_per_tok), no_route(dt), dtype=dt, device=device)
            for _ in cfg.moe_layers]


def _routing_start(cfg: GLMConfig, routing: Routing | None, B: int, T: int) -> tuple:
    """Family.block_args: check routing against the forward's input and give it one slot per MoE layer; every
    block then takes it (or None)."""
    if routing is None:
        return (None,)
    n, k = len(cfg.moe_layers), cfg.moe.num_experts_per_tok
    if routing.replay is not None and tuple(routing.replay.shape) != (n, B, T, k):
        raise ValueError(f"routing.replay has shape {tuple(routing.replay.shape)}, expected {(n, B, T, k)} "
                         "(MoE layers, the input's rows and tokens, experts per token)")
    if routing.record:
        routing.chosen = [None] * n
    if routing.replay is not None:
        routing.agree = [None] * n
    return (routing,)


# ----------------------------------------------------------------------------- MLA attention

class LatentIndexer(Indexer):
    """GLM-5's lightning indexer (dsa.Indexer's role and its wk, k_norm, weights_proj): the query comes from
    the attention's query latent q_resid [B, T, q_lora_rank] through wq_b, not from x."""

    def __init__(self, hidden_size: int, q_lora_rank: int, cfg: DSAConfig):
        nn.Module.__init__(self)
        self.cfg = cfg
        self.wq_b = nn.Linear(q_lora_rank, cfg.heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, cfg.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(cfg.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden_size, cfg.heads, bias=False)

    def forward(self, x, q_resid):
        """x [B, T, hidden], q_resid [B, T, q_lora_rank] -> q [B, T, H_I, d_I], k [B, T, d_I], w [B, T, H_I]
        fp32, as dsa.Indexer.forward."""
        B, T, _ = x.shape
        q = self.wq_b(q_resid).view(B, T, self.cfg.heads, self.cfg.head_dim)
        k = self.wk(x)
        with dsa.fp32_scope(x):
            n = self.k_norm
            k = F.layer_norm(k.float(), n.normalized_shape, n.weight.float(), n.bias.float(), n.eps).to(q.dtype)
            w = F.linear(x.float(), self.weights_proj.weight.float()) * self.cfg.heads**-0.5
        return q, k, w


def _latent_indexer(cfg: GLMConfig) -> nn.Module:
    """An F layer's indexer: GLM-5's (query from the query latent), or GLM-4's when there is no query latent."""
    if cfg.mla.q_lora_rank is None:
        return Indexer(cfg.hidden_size, cfg.dsa)
    return LatentIndexer(cfg.hidden_size, cfg.mla.q_lora_rank, cfg.dsa)


class LatentAttention(Attention):
    """MLA. Reuses Attention's attend_rows / attend / project (masks, packed groups, DSA), with keys and
    values expanded from the latent; the caches hold the latent (MLA's point)."""

    def __init__(self, cfg: GLMConfig, layer: int):
        nn.Module.__init__(self)
        self.cfg, self.layer, m = cfg, layer, cfg.mla
        H, hidden, bias = cfg.num_heads, cfg.hidden_size, cfg.attention_bias
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, H * m.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, 1e-6)  # (transformers' default eps, not rms_norm_eps)
            self.q_b_proj = nn.Linear(m.q_lora_rank, H * m.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, m.kv_lora_rank + m.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, H * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * m.v_head_dim, hidden, bias=bias)
        self.kind = cfg.dsa.layer_kinds(cfg.num_layers)[layer] if cfg.dsa else None
        self.indexer = _latent_indexer(cfg) if self.kind == "F" else None
        self.scale = m.qk_head_dim ** -0.5

    def queries(self, x, rope):
        """x [B, T, hidden] -> q [B, T, H, qk_head_dim] (no-rope part, then the rotated part) and the query
        latent q_resid [B, T, q_lora_rank] (None without one)."""
        B, T, _ = x.shape
        m = self.cfg.mla
        q_resid = None if m.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(x))
        q = (self.q_proj(x) if q_resid is None else self.q_b_proj(q_resid)).view(B, T, -1, m.qk_head_dim)
        q_nope, q_rope = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        return torch.cat([q_nope, apply_rope(q_rope, *rope["main"])], -1), q_resid

    def latent(self, x, rope):
        """x [B, T, hidden] -> [B, T, kv_lora_rank + qk_rope_head_dim]: the normalised c, then the rotated
        shared key part. What the caches hold."""
        c, k_rope = self.kv_a_proj_with_mqa(x).split([self.cfg.mla.kv_lora_rank, self.cfg.mla.qk_rope_head_dim], -1)
        return torch.cat([self.kv_a_layernorm(c), apply_rope(k_rope, *rope["main"])], -1)

    def expand(self, latent):
        """latent [B, S, kv_lora_rank + qk_rope_head_dim] -> keys [B, S, H, qk_head_dim] and values
        [B, S, H, v_head_dim], every head's own."""
        m = self.cfg.mla
        c, k_rope = latent.split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
        B, S, _ = c.shape
        k_nope, v = self.kv_b_proj(c).view(B, S, -1, m.qk_nope_head_dim + m.v_head_dim).split(
            [m.qk_nope_head_dim, m.v_head_dim], -1)
        k = torch.cat([k_nope, k_rope[:, :, None].expand(B, S, k_nope.shape[2], m.qk_rope_head_dim)], -1)
        return k, v

    def forward(self, x, rope, mask: AttnMask, cache, selected, indexer_loss, keep=None):
        """As Attention.forward (same arguments and returns)."""
        q, q_resid = self.queries(x, rope)
        latent = self.latent(x, rope)
        if isinstance(cache, PagedKVCache) and cache.keys is not None:
            out, selected = self.paged_decode(x, q, latent, q_resid, rope, cache, selected)
            return self.project(out, keep), selected, None
        if cache is not None:
            latent = cache.write(cache.k, self.layer, latent)  # a KVCache or a paged prefill: latents only
        index = None
        if self.indexer is not None:
            iq, ik, iw = self.index(x, rope, indexer_loss, q_resid)
            if cache is not None:
                ik = cache.write(cache.index_k, self.layer, ik)
            index = (iq, iw, ik)
        k, v = self.expand(latent)
        out, selected, kl = self.attend_rows(*_same_width(q, k, v), index, mask, selected, indexer_loss)
        return self.project(out[..., :self.cfg.mla.v_head_dim], keep), selected, kl

    def paged_decode(self, x, q, latent, q_resid, rope, cache: PagedKVCache, selected):
        """Attention.paged_decode for MLA (a decode step, and the engine's prefix extension, one row per new
        token): q [B, 1, H, qk_head_dim], latent [B, 1, kv_lora_rank + qk_rope_head_dim] -> (out [B, 1, H,
        v_head_dim], selected). The pool holds latents only, and they are never expanded: kv_b_proj's key half
        W_UK [H, nope, r] is absorbed into the query (q_nope . (W_UK c) = (W_UK^T q_nope) . c), so each head
        scores [W_UK^T q_nope, q_rope] against the row's [c, k_rope] latents, one shared "key head" of
        r + dr dims, and the value half W_UV [H, v, r] applies after the softmax-weighted sum of the c's. Per
        key that reads r + dr values instead of H (nope + dr + v) (576 against 20 x 512 for GLM-4.7-Flash)."""
        keys, valid = cache.keys, cache.key_valid  # [B, Lk]
        B, Lk = keys.shape
        m, H = self.cfg.mla, self.cfg.num_heads
        cache.write(cache.k, self.layer, latent)
        if self.indexer is not None:  # as Attention.paged_decode: top-k among the row's keys in position order
            iq, ik, iw = self.index(x, rope, None, q_resid)
            cache.write(cache.index_k, self.layer, ik)
            selected = None  # top-k >= keys: DSA selects every key, as in the learner
            if self.cfg.dsa.topk < Lk:
                last = AttnMask(torch.full((1,), Lk - 1, device=keys.device), Lk, valid)
                row_ik = cache.index_k[self.layer].index_select(0, keys.flatten()).view(B, Lk, -1)
                idx, ok = dsa.select_topk(iq, iw, row_ik, last, self.cfg.dsa.topk)  # [B, 1, K]
                selected = keys.gather(1, idx[:, 0]), ok[:, 0]
        idx, ok = selected if self.kind is not None and selected is not None else (keys, valid)
        K = idx.shape[1]
        lat = cache.k[self.layer].index_select(0, idx.flatten()).view(B, K, -1)  # [B, K, r + dr]
        b = self.kv_b_proj  # (a LoRA linear: its weight with the adapters merged, lora.LoRALinear.matrix)
        w = (b.matrix() if hasattr(b, "matrix") else b.weight).view(H, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        q_nope, q_rope = q[:, 0].split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)  # [B, H, nope], [B, H, dr]
        q_lat = torch.einsum("bhn,hnr->bhr", q_nope, w[:, :m.qk_nope_head_dim].to(q.dtype))  # [B, H, r]
        qa = torch.cat([q_lat, q_rope.to(q_lat.dtype)], -1)[:, None]  # [B, 1, H, r + dr]: H queries, one key head
        lat = lat.to(qa.dtype)[:, None]  # [B, 1, K, r + dr]
        o = F.scaled_dot_product_attention(qa, lat, lat[..., :m.kv_lora_rank], attn_mask=ok[:, None, None],
                                           scale=self.scale)  # [B, 1, H, r]
        out = torch.einsum("bhr,hvr->bhv", o[:, 0], w[:, m.qk_nope_head_dim:].to(o.dtype))  # [B, H, v]
        return out[:, None], selected

    def index(self, x, rope, indexer_loss=None, q_resid=None):
        """Attention.index, with GLM-5's query from the (detached) query latent."""
        if not isinstance(self.indexer, LatentIndexer):
            return super().index(x, rope, indexer_loss)
        with torch.set_grad_enabled(torch.is_grad_enabled() and indexer_loss is not None):
            iq, ik, iw = self.indexer(x.detach(), q_resid.detach())
            return apply_rope(iq, *rope["index"]), apply_rope(ik, *rope["index"]), iw


def _same_width(q, k, v):
    """Zero-pad q and k, or v, to one head width (the attention kernels want one): zeros add nothing to
    q.k, and padded value dims come out zero (cut off after). GLM-4.7-Flash and GLM-5 need none (256 both)."""
    dq, dv = q.shape[-1], v.shape[-1]
    if dq < dv:
        q, k = F.pad(q, (0, dv - dq)), F.pad(k, (0, dv - dq))
    elif dv < dq:
        v = F.pad(v, (0, dq - dv))
    return q, k, v


def _latent_kv_shapes(cfg: GLMConfig):
    """Family.kv_shapes: a cache holds each token's latent [kv_lora_rank + qk_rope_head_dim], no values."""
    return (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim,), None


# ----------------------------------------------------------------------------- MoE MLP

class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the MoE families' dense-layer MLP and shared experts (transformers' names
    gate_proj / up_proj / down_proj; model.MLP, GLM-4's, fuses gate and up)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """The sigmoid router: weight [E, hidden] and the score-correction bias [E], both fp32 in every copy
    (FP32_PARAMS). The bias only decides which experts are chosen, never their weights."""

    def __init__(self, cfg: GLMConfig):
        super().__init__()
        self.cfg = cfg.moe
        self.weight = nn.Parameter(torch.empty(cfg.moe.n_routed_experts, cfg.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.moe.n_routed_experts, dtype=torch.float32))

    def forward(self, x):
        """x [N, hidden] -> (ids [N, k] int64 this router's choice, scores [N, E] fp32 in (0, 1))."""
        c = self.cfg
        with dsa.fp32_scope(x):  # logits in fp32 under autocast too: a bf16 logit flips near-tied experts
            scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores.detach() + self.e_score_correction_bias.float()  # [N, E]
        if c.n_group > 1:  # keep the topk_group groups whose two best experts score highest
            N, G = choice.shape[0], c.n_group
            best = choice.view(N, G, -1).topk(2, dim=-1).values.sum(-1)  # [N, G]
            groups = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(c.topk_group, dim=-1).indices, True)
            choice = choice.masked_fill(~groups.repeat_interleave(c.n_routed_experts // G, 1), float("-inf"))
        return choice.topk(c.num_experts_per_tok, dim=-1).indices, scores

    def weigh(self, scores, ids):
        """The routing weights [N, k] fp32 of experts ids [N, k]: their scores, normalised to sum 1 if
        norm_topk_prob, times routed_scaling_factor. Differentiable in the router's weight."""
        w = scores.gather(1, ids)
        if self.cfg.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * self.cfg.routed_scaling_factor


class Experts(nn.Module):
    """The routed experts' weights, stacked: gate_up_proj [E, 2I, hidden] (each expert's gate rows, then its
    up rows), down_proj [E, hidden, I]. FSDP2 shards dim 0, the experts. Checkpoints hold them per expert
    (mlp.experts.{e}.gate_proj / up_proj / down_proj.weight): from_pretrained and save_pretrained translate."""

    def __init__(self, cfg: GLMConfig):
        super().__init__()
        E, I, H = cfg.moe.n_routed_experts, cfg.moe.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))
        self.casts = moe_kernels.CastCache()  # their bf16 copies under autocast, one per optimizer step

    def forward(self, x, idx, w):
        """x [N, hidden], idx [N, k] expert ids, w [N, k] their weights -> [N, hidden] (kernels/moe.py; an fp8
        generator swaps this module for fp8.FP8Experts).

        fp32 masters under autocast (the learner on a GPU: one process, or DDP) are multiplied in x's dtype, by
        copies made once per optimizer step (kernels/moe.CastCache), not in every forward and checkpointed
        recompute. Nothing is cached where the weights already are x's dtype (a bf16 model, LoRA's frozen bf16
        base, FSDP2 gathering them in bf16: parallel.gather_policy, a cast once per gather), nor under FSDP2 at
        all (it marks the modules it manages with _is_fsdp_managed_module): its gathered weights are freed after
        each use, and a copy kept of them would hold every layer's experts whole on every rank."""
        gate_up, down = self.gate_up_proj, self.down_proj
        if (moe_kernels.CAST_CACHE and torch.is_autocast_enabled(x.device.type) and gate_up.dtype != x.dtype
                and not getattr(self, "_is_fsdp_managed_module", False)):
            gate_up = self.casts.weight("gate_up_proj", gate_up, x.dtype)
            down = self.casts.weight("down_proj", down, x.dtype)
        return moe_kernels.experts_forward(x, idx, w, gate_up, down)


def same_experts(ids, other):
    """ids [N, k] (the router's top-k: k distinct experts per token), other [N, k] -> [N] bool: whether each token's
    two sets of experts are the same, in any order. Every id of ids among other's k entries says it: k distinct ids
    found in k entries leave no room for another (so no sort: the same answer as comparing the sorted rows)."""
    return (ids[:, :, None] == other[:, None, :]).any(-1).all(-1)  # [N, k, k] compares: k is 2 to 8


class MoE(nn.Module):
    def __init__(self, cfg: GLMConfig, layer: int):
        super().__init__()
        self.index = cfg.moe_layers.index(layer)  # this layer's place among the MoE layers (Routing's lists)
        self.route_dtype = route_dtype(cfg)
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = SwiGLU(cfg.hidden_size, cfg.moe.moe_intermediate_size * cfg.moe.n_shared_experts)

    def forward(self, x, replay=None, apply=True):
        """x [B, T, hidden]; replay [B, T, k] ids to use (NO_ROUTE: the router's own) or None; apply=False: only
        compare them with the router's own. Returns (out [B, T, hidden], ids [B, T, k] int64 used, agree [2] int64
        or None)."""
        B, T, H = x.shape
        flat = x.reshape(B * T, H)
        ids, scores = self.gate(flat)  # [N, k], [N, E]
        agree = None
        if replay is not None:
            r = replay.reshape(B * T, -1)
            replayed = (r != no_route(r.dtype)).all(-1)  # [N]
            same = same_experts(ids, r.long())
            agree = torch.stack([(same & replayed).sum(), replayed.sum()])
            ids = torch.where(replayed[:, None], r.long(), ids) if apply else ids
        out = self.experts(flat, ids, self.gate.weigh(scores, ids))
        return (out + self.shared_experts(flat)).view(B, T, H), ids.view(B, T, ids.shape[-1]), agree

    def routed(self, x, routing: Routing | None, keep, T, cache=None):
        """forward() with the forward's Routing: x [B, T | K, hidden] (K: the last block's kept
        positions `keep` along T) takes its replayed ids, and leaves its choice and agreement there. In the engine's
        forwards (cache: a PagedKVCache with `routes`) the choice is also written beside each token's KV, at its
        slot: routing replay's record of the generator, which a CUDA graph's replay writes as well. An MTP layer's MoE
        (index None, families/mtp.py) records nothing: its drafts are never replayed."""
        if self.index is None:
            return self(x)[0]
        replay = None
        if routing is not None and routing.replay is not None:
            replay = routing.replay[self.index]
            replay = replay if keep is None else replay[:, keep]
        out, ids, agree = self(x, replay, routing is None or routing.apply)
        paged = isinstance(cache, PagedKVCache) and bool(cache.routes)
        if (routing is not None and routing.record) or paged:
            ids = ids.to(self.route_dtype)
            if keep is not None:  # [B, T, k]: NO_ROUTE where the last block did not run
                full = ids.new_full((ids.shape[0], T, ids.shape[2]), no_route(self.route_dtype))
                full[:, keep] = ids
                ids = full
            if paged:
                cache.write(cache.routes, self.index, ids)
        if routing is not None and routing.record:
            routing.chosen[self.index] = ids
        if agree is not None:
            routing.agree[self.index] = agree
        return out


class LatentBlock(nn.Module):
    def __init__(self, cfg: GLMConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LatentAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        sparse = cfg.moe.mlp_layer_types[layer] == "sparse"
        self.mlp = MoE(cfg, layer) if sparse else SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, rope, mask, cache, selected, indexer_loss, keep=None, routing=None):
        """As model.Block.forward, with the forward's Routing (or None)."""
        T = x.shape[1]
        h, selected, kl = self.self_attn(self.input_layernorm(x), rope, mask, cache, selected, indexer_loss, keep)
        x = (x if keep is None else x[:, keep]) + h
        h = self.post_attention_layernorm(x)
        h = self.mlp.routed(h, routing, keep, T, cache) if isinstance(self.mlp, MoE) else self.mlp(h)
        return x + h, selected, kl


# ----------------------------------------------------------------------------- checkpoints: experts per expert

@dataclass
class ExpertPart:
    """One file tensor of a routed expert (model.layers.{i}.mlp.experts.{e}.gate_proj.weight, ...) as a piece
    of our stacked parameter: param[expert, rows] (rows of dim 1: gate_up_proj's gate or up half)."""
    param: torch.Tensor  # [E, ...]: a tensor, or an FSDP2 DTensor sharded along the experts
    expert: int
    rows: slice
    shape: tuple  # the file tensor's

    def copy_(self, read):
        """param[expert, rows] = read(slice(None)), on the rank that holds the expert (FSDP2 splits dim 0 as
        torch.chunk does); the others read nothing."""
        dst = self.param
        if not hasattr(dst, "to_local"):
            dst[self.expert, self.rows].copy_(read(slice(None)))
            return
        local, n = dst.to_local(), dst.shape[0]
        start = min(n, dst.device_mesh.get_local_rank() * -(-n // dst.device_mesh.size()))
        if start <= self.expert < start + local.shape[0]:
            local[self.expert - start, self.rows].copy_(read(slice(None)))


def _split_experts(named: dict, cfg: GLMConfig) -> dict:
    """{HF name: tensor} with each stacked experts tensor replaced by its per-expert file names -> ExpertPart."""
    out, I = {}, cfg.moe.moe_intermediate_size
    for name, t in named.items():
        base, _, what = name.rpartition(".")
        if not base.endswith(".mlp.experts"):
            out[name] = t
            continue
        E, a, b = t.shape
        for e in range(E):
            if what == "gate_up_proj":
                out[f"{base}.{e}.gate_proj.weight"] = ExpertPart(t, e, slice(0, I), (I, b))
                out[f"{base}.{e}.up_proj.weight"] = ExpertPart(t, e, slice(I, 2 * I), (I, b))
            else:
                out[f"{base}.{e}.down_proj.weight"] = ExpertPart(t, e, slice(None), (a, b))
    return out


def _experts_to_files(state: dict, cfg: GLMConfig) -> dict:
    """{HF name: CPU tensor} with stacked experts written per expert, as the published checkpoints hold them
    (each a copy of its own: safetensors refuses tensors that share memory)."""
    return {name: (part.param[part.expert, part.rows].clone() if isinstance(part, ExpertPart) else part)
            for name, part in _split_experts(state, cfg).items()}


def _load_buffers(model: GLM, path, device):
    """The persistent buffers (the routers' score-correction biases), allocated on device and read from the
    checkpoint: for a model whose parameters someone else fills (from_pretrained's weights=False)."""
    files = {n: file for file, names in _safetensors_files(path).items() for n in names}
    for module_name, module in model.named_modules():
        for name, b in list(module._buffers.items()):
            if b is None or name in module._non_persistent_buffers_set:
                continue
            key = hf_name(f"{module_name}.{name}")
            if key not in files:
                raise ValueError(f"{path}: checkpoint is missing tensor {key}")
            with safe_open(files[key], framework="pt", device="cpu") as f:
                module._buffers[name] = f.get_tensor(key).to(device=device, dtype=b.dtype)


def _init_weights(m: nn.Module):
    """Family.init_weights: model.init_weights, and the routers' and experts' own tensors (normal, std 0.02; the
    score-correction bias zero)."""
    init_weights(m)
    if isinstance(m, (Router, Experts)):
        for p in m.parameters(recurse=False):
            nn.init.normal_(p, std=0.02)
        for b in m.buffers(recurse=False):
            nn.init.zeros_(b)


# ----------------------------------------------------------------------------- the family, registered

MLA_MOE = Family(
    post_init=_latent_post_init, from_hf=_latent_from_hf, to_hf=_latent_to_hf, with_dsa=_latent_with_dsa,
    block=LatentBlock, block_args=_routing_start, init_weights=_init_weights, kv_shapes=_latent_kv_shapes,
    routes=_routes, file_names=_split_experts, to_files=_experts_to_files, load_buffers=_load_buffers)
FAMILIES.update(dict.fromkeys(LATENT_TYPES, MLA_MOE))
