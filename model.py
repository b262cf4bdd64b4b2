"""
The GLM-4 dense decoder (GLM-4-9B-0414, GLM-Z1-9B-0414), numerically the same model as transformers'
`Glm4ForCausalLM`, plus DeepSeek Sparse Attention when asked for. (This first chapter imports the second,
dsa.py, for its attention: read them as a pair.)

    x -> embed -> L x [ x += post_attn_norm(attn(input_norm(x)));  x += post_mlp_norm(mlp(pre_mlp_norm(x))) ]
      -> norm -> lm_head

What makes it GLM rather than Llama: "sandwich" norms (an extra RMSNorm after attention and after the
MLP), a bias on the Q/K/V projections, RoPE on only the first `partial_rotary_factor` of each head's
dimensions with *interleaved* pairs (x0,x1), (x2,x3)..., and an untied LM head. Attention is GQA.

The file reads top-down: the config, the rotary embedding, the decoder's layers, `GLM` and its forward; then
what the forward's callers hand it, the engine's cache, and Hugging Face checkpoints; last, what the default
run never takes (checkpoints' rarer cases, the KVCache of tests and tools). One forward serves every caller:
  - the learner: packed rows (several sequences per row, positions restarting at 0 for each one, no
    attention across them) so no compute is spent on padding;
  - the generation engine (engine.py): packed prefills, then one new token per row, over its PagedKVCache;
  - tests and tools: a KVCache (batched rows with left or right padding, one or many new tokens per
    call), or plain [B, T] input.
Each of them is described by an `AttnMask`, built once per forward and shared by all layers.

Checkpoints are Hugging Face directories (config.json + *.safetensors, sharded or not), read and
written with transformers' parameter names, so a saved model loads in `Glm4ForCausalLM` and back.

GLM-4.7-Flash and GLM-5 (Multi-head Latent Attention + Mixture of Experts, transformers' glm4_moe_lite and
glm_moe_dsa) are a chapter of their own, families/mla_moe.py, which this file never imports. The dense code
asks a model_type's `Family` (FAMILIES: its config's defaults, its layers, what its caches and checkpoints
hold) wherever a family may differ; GLM-4's own is this file's code, and families/mla_moe.py adds its two on
import (machinery/ imports it for every run).
"""
import json
import math
import os
import shutil
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

import dsa
from dsa import DSAConfig
from kernels import elementwise

# Parameter (and buffer) names, as suffixes, kept in fp32 in every copy of the model (cast_, FSDP's bf16
# gathers, the generator): DSA's small indexer tensors, and the MoE routers' weight and score-correction bias
# (families/mla_moe.py's Router, named here so that every importer sees them, the family imported or not),
# which pick experts by comparing scores a bf16 rounding would flip.
FP32_PARAMS = dsa.FP32_PARAMS + ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


# ----------------------------------------------------------------------------- config

@dataclass
class GLMConfig:
    vocab_size: int = 151552
    hidden_size: int = 4096
    intermediate_size: int = 13696
    num_layers: int = 40
    num_heads: int = 32
    # The next four default by family (None here): GLM-4's below; the MLA families' in MLAConfig's docs
    num_kv_heads: int | None = None  # 2
    head_dim: int | None = None  # 128
    rope_theta: float = 10000.0
    partial_rotary_factor: float | None = None  # 0.5: RoPE on the first half of each head, interleaved pairs
    rms_norm_eps: float = 1e-5
    attention_bias: bool | None = None  # True: bias on q/k/v only, never on o
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    pad_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    dsa: DSAConfig | None = None
    # "glm4" (this file's dense decoder), or a family that families/mla_moe.py registers (FAMILIES):
    # "glm4_moe_lite" (GLM-4.7-Flash) and "glm_moe_dsa" (GLM-5, DSA built in); those need mla and moe, that
    # file's MLAConfig and MoEConfig (a dict here becomes one)
    model_type: str = "glm4"
    mla: "MLAConfig | None" = None  # noqa: F821 (families/mla_moe.py's)
    moe: "MoEConfig | None" = None  # noqa: F821
    # Multi-token-prediction layers after the decoder (config.json's num_nextn_predict_layers; families/mtp.py):
    # layer num_layers + j drafts token t+2+j. mtp_own_embeddings: they keep their own embedding and head (a checkpoint
    # whose copies differ from the main model's; load_pretrained decides), else they use the main model's
    mtp_layers: int = 0
    mtp_own_embeddings: bool = False

    def __post_init__(self):
        if isinstance(self.dsa, dict):
            self.dsa = DSAConfig.from_dict(self.dsa)
        if isinstance(self.eos_token_id, int):
            self.eos_token_id = [self.eos_token_id]
        family(self.model_type).post_init(self)  # the family's defaults and checks (GLM-4's: _glm4_post_init)
        if not isinstance(self.mtp_layers, int) or isinstance(self.mtp_layers, bool) or self.mtp_layers < 0:
            raise ValueError(f"mtp_layers (num_nextn_predict_layers) must be an integer >= 0, got {self.mtp_layers!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.rope_dim % 2:
            raise ValueError(f"head_dim * partial_rotary_factor must be even, got {self.rope_dim}")

    @property
    def rope_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def moe_layers(self) -> list[int]:
        """The layers whose MLP is a mixture of experts, in order (none in GLM-4)."""
        return [i for i, kind in enumerate(self.moe.mlp_layer_types) if kind == "sparse"] if self.moe else []

    @property
    def kv_width(self) -> int:
        """Values per token per layer that a KV cache holds (Family.kv_shapes): keys and values of every KV head
        (GLM-4), or MLA's latent, the normalised kv_lora_rank and the shared rotated key (DSA's indexer keys apart)."""
        k, v = family(self.model_type).kv_shapes(self)
        return math.prod(k) + (math.prod(v) if v else 0)

    @classmethod
    def from_hf(cls, d: dict) -> "GLMConfig":
        """From a transformers config.json, which its model_type's family reads (GLM-4's: _glm4_from_hf)."""
        rope = dict(d.get("rope_parameters") or {})
        legacy = d.get("rope_scaling") or {}  # the older form (transformers 4): {type or rope_type: yarn, factor: ...}
        kind = rope.get("rope_type", legacy.get("rope_type", legacy.get("type", "default")) if isinstance(legacy, dict)
                        else legacy)
        if kind != "default":  # a scaled RoPE read as the plain one would silently change every position's angle
            key = "rope_parameters.rope_type" if "rope_type" in rope else "rope_scaling"
            raise ValueError(f"config.json: {key} {kind!r} is not supported (only the default RoPE)")
        return family(d.get("model_type", "glm4")).from_hf(cls, d, rope)

    def to_hf(self) -> dict:
        """transformers 5 form, which the family writes (GLM-4's: _glm4_to_hf)."""
        return family(self.model_type).to_hf(self)


def _glm4_post_init(cfg: GLMConfig):
    """GLMConfig.__post_init__ for GLM-4: its defaults."""
    if cfg.mla is not None or cfg.moe is not None:
        raise ValueError("mla / moe need model_type glm4_moe_lite or glm_moe_dsa (glm4 is the dense GLM-4 decoder)")
    defaults = {"num_kv_heads": 2, "head_dim": 128, "partial_rotary_factor": 0.5, "attention_bias": True}
    for key, value in defaults.items():
        if getattr(cfg, key) is None:
            setattr(cfg, key, value)


def _glm4_from_hf(cls, d: dict, rope: dict) -> GLMConfig:
    """GLM-4's config.json: the flat form of the published GLM-Z1-9B-0414 checkpoint (`rope_theta`,
    `partial_rotary_factor` at top level) or transformers 5's `rope_parameters`."""
    return cls(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"], num_heads=d["num_attention_heads"],
        num_kv_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
        head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
        rope_theta=rope.get("rope_theta", d.get("rope_theta", 10000.0)),
        partial_rotary_factor=rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.5)),
        rms_norm_eps=d.get("rms_norm_eps", 1e-5), attention_bias=d.get("attention_bias", True),
        tie_word_embeddings=d.get("tie_word_embeddings", False),
        max_position_embeddings=d.get("max_position_embeddings", 32768),
        pad_token_id=d.get("pad_token_id"), eos_token_id=d.get("eos_token_id") or [],
        bos_token_id=d.get("bos_token_id"), dsa=d.get("dsa"), mtp_layers=d.get("num_nextn_predict_layers", 0),
    )


def _glm4_to_hf(cfg: GLMConfig) -> dict:
    """GLM-4's config.json; the `dsa` section is ours (Glm4ForCausalLM ignores it)."""
    d = {
        "architectures": ["Glm4ForCausalLM"], "model_type": "glm4", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                            "partial_rotary_factor": cfg.partial_rotary_factor},
        "rms_norm_eps": cfg.rms_norm_eps, "attention_bias": cfg.attention_bias,
        "tie_word_embeddings": cfg.tie_word_embeddings, "max_position_embeddings": cfg.max_position_embeddings,
        "pad_token_id": cfg.pad_token_id, "eos_token_id": cfg.eos_token_id, "bos_token_id": cfg.bos_token_id,
        **({"num_nextn_predict_layers": cfg.mtp_layers} if cfg.mtp_layers else {}),
    }
    if cfg.dsa is not None:
        d["dsa"] = asdict(cfg.dsa)
    return d


# ----------------------------------------------------------------------------- rotary embedding

def rope_cos_sin(position_ids, dim, theta, width):
    """position_ids [B, T] -> cos, sin [B, T, width] in fp32, laid out for apply_rope: the rotated pair
    (x_2i, x_2i+1) of the first `dim` dims turns by angle_i, so cos holds (cos_i, cos_i) there and sin
    (-sin_i, +sin_i); the last width - dim dims pass unchanged (cos 1, sin 0)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=position_ids.device, dtype=torch.float32) / dim)
    angles = position_ids[..., None].float() * inv_freq  # [B, T, dim/2]
    cos = angles.cos().repeat_interleave(2, -1)
    sin = angles.sin()
    sin = torch.stack((-sin, sin), -1).flatten(-2)  # built on the device: no host copy (a sync on CUDA)
    rest = width - dim
    return F.pad(cos, (0, rest), value=1.0), F.pad(sin, (0, rest), value=0.0)


def apply_rope(x, cos, sin):
    """Rotate interleaved pairs (x0,x1), (x2,x3), ... : x0' = x0 cos - x1 sin, x1' = x1 cos + x0 sin, as
    x * cos + swap(x) * sin with rope_cos_sin's tables (the same products and sums, so the same rounding,
    in fewer passes than slicing the pairs apart). x [B, T, H, D] (or [B, T, D]); cos, sin [B, T, D]."""
    if dsa._triton(x) and not x.requires_grad:  # a GPU, no gradient (the generator, no_grad forwards): one kernel,
        return elementwise.rope(x, cos, sin)  # the same bits (kernels/elementwise.py)
    if x.dim() == 4:
        cos, sin = cos[:, :, None], sin[:, :, None]
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (x1, x0, x3, x2, ...)
    return x * cos.to(x.dtype) + swapped * sin.to(x.dtype)


# ----------------------------------------------------------------------------- the decoder

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(x.dtype) * h.to(x.dtype)  # stays in x's dtype (fp32 weights under autocast)


class Attention(nn.Module):
    def __init__(self, cfg: GLMConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, H * D, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, Hkv * D, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, Hkv * D, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(H * D, cfg.hidden_size, bias=False)
        self.kind = cfg.dsa.layer_kinds(cfg.num_layers)[layer] if cfg.dsa else None  # "F", "S" or None
        self.indexer = dsa.Indexer(cfg.hidden_size, cfg.dsa) if self.kind == "F" else None
        self.scale = D ** -0.5

    def forward(self, x, rope, mask: "AttnMask", cache, selected, indexer_loss, keep=None):
        """Returns (output, selected, kl): `selected` is this layer's (idx, valid) top-k choice, handed on
        to the following `S` layers (IndexCache; for packed rows a list, one per group); kl is the
        indexer loss of an `F` layer when asked for. keep [K]: the positions (along T) whose output is
        wanted; the output projection runs on those only (output [B, K, hidden])."""
        B, T, _ = x.shape
        D = self.cfg.head_dim
        q = apply_rope(self.q_proj(x).view(B, T, -1, D), *rope["main"])
        k = apply_rope(self.k_proj(x).view(B, T, -1, D), *rope["main"])
        v = self.v_proj(x).view(B, T, -1, D)
        if isinstance(cache, PagedKVCache) and cache.keys is not None:
            out, selected = self.paged_decode(x, q, k, v, rope, cache, selected)
            return self.project(out, keep), selected, None
        if cache is not None:
            k, v = cache.write(cache.k, self.layer, k), cache.write(cache.v, self.layer, v)
        index = None
        if self.indexer is not None:
            iq, ik, iw = self.index(x, rope, indexer_loss)
            if cache is not None:
                ik = cache.write(cache.index_k, self.layer, ik)
            index = (iq, iw, ik)
        out, selected, kl = self.attend_rows(q, k, v, index, mask, selected, indexer_loss)
        return self.project(out, keep), selected, kl

    def attend_rows(self, q, k, v, index, mask: "AttnMask", selected, indexer_loss):
        """attend() over the forward's rows [B, T]: at once, or for packed rows per group of similar-length
        sequences (model.Packed). Returns (out [B, T, H, D], selected, kl)."""
        if mask.packed is None:
            return self.attend(q, k, v, index, mask, selected, indexer_loss)
        B, T = q.shape[:2]
        p, outs, chosen, kl = mask.packed, [], [], None
        for i, (src, m) in enumerate(p.groups):
            group = [p.take(t, i) for t in (q, k, v)]
            out, sel, kl_i = self.attend(*group, index and tuple(p.take(t, i) for t in index), m,
                                         selected and selected[i], indexer_loss)
            outs.append(out)
            chosen.append(sel)
            if kl_i is not None:  # a mean over the group's tokens: weighted into the mean over all
                kl = kl_i * p.share[i] + (0.0 if kl is None else kl)
        return p.put_back(outs, (B, T)), chosen, kl

    def project(self, out, keep):
        """out [B, T, H, D] -> o_proj of the kept positions [B, K | T, hidden]."""
        out = out.flatten(2)
        return self.o_proj(out if keep is None else out[:, keep])

    def attend(self, q, k, v, index, mask: "AttnMask", selected, indexer_loss):
        """Attention of q [B, Tq, H, D] over k, v [B, Tk, Hkv, D] under mask: DSA's top-k (chosen here
        from the indexer's (iq, iw, ik) on an F layer, handed in on an S layer) or dense.
        Returns (out [B, Tq, H, D], selected, kl)."""
        scale = self.scale
        if index is not None:
            sparse = indexer_loss != "dense" and self.cfg.dsa.topk < mask.k_len
            selected = dsa.select_topk(*index, mask, self.cfg.dsa.topk) if sparse else None
        kl = None
        if self.kind is not None and selected is not None:
            idx, valid = selected
            if index is not None and indexer_loss == "sparse":
                out, p = dsa.sparse_attention(q, k, v, idx, valid, scale, return_probs=True)
                kl = dsa.sparse_indexer_kl(*index, idx, valid, p, mask.q_valid().float())
            else:
                out = dsa.sparse_attention(q, k, v, idx, valid, scale)
        else:
            # With top-k >= visible keys, DSA selects every key: dense attention is then exactly DSA.
            out = dense_attention(q, k, v, mask, scale)
            if index is not None and indexer_loss is not None:
                kl = dsa.dense_indexer_kl(*index, q, k, mask, scale)
        return out, selected, kl

    def index(self, x, rope, indexer_loss=None):
        """The indexer's q [B, T, H_I, d_I], k [B, T, d_I] (both after RoPE) and w [B, T, H_I]. It sees a
        detached input: it must never push gradients into the model. Outside indexer training nothing
        flows through it at all (top-k is not differentiable)."""
        with torch.set_grad_enabled(torch.is_grad_enabled() and indexer_loss is not None):
            iq, ik, iw = self.indexer(x.detach())
            return apply_rope(iq, *rope["index"]), apply_rope(ik, *rope["index"]), iw

    def paged_decode(self, x, q, k, v, rope, cache: "PagedKVCache", selected):
        """One new token per row (q [B, 1, H, D], k/v [B, 1, Hkv, D]) against the engine's block pool. The
        row's keys are its pool slots in position order (cache.keys [B, Lk], its new token last). DSA scores
        the row's indexer keys in that order (so ties go to the earlier key, as in the learner) and maps
        its top-k back to slots, which the `S` layers after it reuse. Returns (out [B, 1, H, D], selected:
        (slots [B, K], valid [B, K]) or None for all of the row's keys)."""
        keys, valid = cache.keys, cache.key_valid  # [B, Lk]
        B, Lk = keys.shape
        cache.write(cache.k, self.layer, k)
        cache.write(cache.v, self.layer, v)
        if self.indexer is not None:
            iq, ik, iw = self.index(x, rope)
            cache.write(cache.index_k, self.layer, ik)
            selected = None  # top-k >= keys: DSA selects every key, as in the learner
            if self.cfg.dsa.topk < Lk:
                last = AttnMask(torch.full((1,), Lk - 1, device=keys.device), Lk, valid)  # the query is the last key
                row_ik = cache.index_k[self.layer].index_select(0, keys.flatten()).view(B, Lk, -1)
                idx, ok = dsa.select_topk(iq, iw, row_ik, last, self.cfg.dsa.topk)  # [B, 1, K]
                selected = keys.gather(1, idx[:, 0]), ok[:, 0]
        idx, ok = selected if self.kind is not None and selected is not None else (keys, valid)
        pk, pv, scale = cache.k[self.layer], cache.v[self.layer], self.cfg.head_dim ** -0.5
        if dsa._triton(q):  # the kernel reads the pool in place: the B rows are B queries of one sequence
            return dsa.sparse_attention(q.transpose(0, 1), pk[None], pv[None], idx[None], ok[None], scale).transpose(0, 1), selected
        # Elsewhere: gather each row's keys and values (whole slots: index_select, several times faster on a
        # CPU than advanced indexing) [B, Hkv, K, D], and one fused attention call with each row as a batch
        # entry and its own key mask. The G = H / Hkv query heads that share a KV head ride as G queries of
        # that head (q [B, Hkv, G, D]: head h reads KV head h // G, as enable_gqa would), so each key is
        # loaded once per KV head rather than once per query head (1.6x faster on a CPU at B = 64)
        K, Hkv, D = idx.shape[1], pk.shape[1], pk.shape[2]
        k = pk.index_select(0, idx.flatten()).view(B, K, Hkv, D).transpose(1, 2)
        v = pv.index_select(0, idx.flatten()).view(B, K, Hkv, D).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.reshape(B, Hkv, -1, D), k, v, attn_mask=ok[:, None, None], scale=scale)
        return out.reshape(B, 1, -1, D), selected


def dense_attention(q, k, v, mask: "AttnMask", scale):
    """q [B, Tq, H, D], k/v [B, Tk, Hkv, D] -> [B, Tq, H, D], via PyTorch's fused SDPA kernels.
    Causal without a mask (plain input, and every group of a packed row): the flash kernel, GQA native.
    With a mask (left padding, a cache) flash is ruled out; the memory-efficient kernel takes a boolean
    mask but not enable_gqa, so the KV heads are expanded to H first (2 x [B, Tk, H, D], small). Otherwise
    CUDA falls back to the math kernel, which materialises fp32 [B, H, Tq, Tk] scores."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H|Hkv, T, D]
    if mask.is_causal:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        G = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # [B, H, Tk, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense()[:, None], scale=scale)
    return out.transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, cfg: GLMConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # fused [gate; up]
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: GLMConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # (the pre-MLP norm)
        self.mlp = MLP(cfg)
        self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope, mask, cache, selected, indexer_loss, keep=None):
        """keep [K] (the last block only): positions whose output is wanted. Attention still runs for
        every position (their keys and values are the later tokens' context); the output projection and
        the MLP run on the kept ones only. Returns x [B, K | T, hidden]."""
        h, selected, kl = self.self_attn(self.input_layernorm(x), rope, mask, cache, selected, indexer_loss, keep)
        x = (x if keep is None else x[:, keep]) + self.post_self_attn_layernorm(h)
        return x + self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(x))), selected, kl


def init_weights(m: nn.Module):
    """Small normal init (std 0.02) as transformers does; norms start at identity."""
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
        if getattr(m, "bias", None) is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, RMSNorm):
        nn.init.ones_(m.weight)
    elif isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)


# ----------------------------------------------------------------------------- layer families: the one seam

@dataclass(frozen=True)
class Family:
    """What the dense code in this file asks of a model_type wherever families differ, each a function: GLM-4's
    (FAMILIES["glm4"], below) is this file's own code, most of it the identity or nothing; families/mla_moe.py
    registers GLM-4.7-Flash's and GLM-5's (MLA + MoE) on import, as transformers' AutoConfig.register does."""
    # the config
    post_init: Callable  # (cfg): its defaults and checks, in GLMConfig.__post_init__
    from_hf: Callable  # (GLMConfig, config.json's dict, its rope_parameters) -> GLMConfig
    to_hf: Callable  # (cfg) -> config.json's dict
    with_dsa: Callable  # (cfg, from_pretrained's dsa: a dict or DSAConfig, or False for none) -> cfg
    # the layers
    block: Callable  # (cfg, layer) -> that decoder layer, called as Block is, then with block_args
    block_args: Callable  # (cfg, GLM.forward's routing, B, T) -> the arguments every block takes after Block's
    init_weights: Callable  # (module): GLM.__init__'s initialisation, module by module
    kv_shapes: Callable  # (cfg) -> a cache's keys and values per token and layer: (shape, shape or None)
    routes: Callable  # (cfg, slots, device) -> PagedKVCache.routes: per layer, what each slot's token routed
    # the checkpoints
    file_names: Callable  # ({HF name: tensor}, cfg) -> {the files' names: the tensor, or a part it copies itself}
    to_files: Callable  # ({HF name: CPU tensor}, cfg) -> {the files' names: CPU tensor}, as save_pretrained writes
    load_buffers: Callable  # (model, path, device): its buffers from the files, for from_pretrained(weights=False)


def family(model_type: str) -> Family:
    """FAMILIES[model_type], or one line saying which import registers it."""
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is no registered family ({', '.join(FAMILIES)}): for "
                         "glm4_moe_lite or glm_moe_dsa (GLM-4.7-Flash, GLM-5), import families.mla_moe first")
    return FAMILIES[model_type]


def _glm4_with_dsa(cfg, dsa):
    return replace(cfg, dsa=dsa or None)  # re-validates; a dict becomes a DSAConfig


def _no_routing(cfg, routing, B, T):
    if routing is not None:
        raise ValueError("routing: this model has no MoE layers")
    return ()


def _glm4_kv_shapes(cfg):
    return (cfg.num_kv_heads, cfg.head_dim), (cfg.num_kv_heads, cfg.head_dim)


def _no_routes(cfg, slots, device):
    return []


def _unchanged(named, cfg):
    return named


def _no_buffers(model, path, device):
    """GLM-4 has no buffers to load."""


FAMILIES: dict[str, Family] = {"glm4": Family(
    post_init=_glm4_post_init, from_hf=_glm4_from_hf, to_hf=_glm4_to_hf, with_dsa=_glm4_with_dsa, block=Block,
    block_args=_no_routing, init_weights=init_weights, kv_shapes=_glm4_kv_shapes, routes=_no_routes,
    file_names=_unchanged, to_files=_unchanged, load_buffers=_no_buffers)}


class GLM(nn.Module):
    def __init__(self, cfg: GLMConfig):
        super().__init__()
        self.cfg = cfg
        # Built on the meta device (a memory plan, a load that allocates afterwards) there is nothing to initialise, and
        # torch's meta normal_ takes seconds at 150K x 6144: skip it (it draws no random numbers either way)
        meta = torch.empty(0).is_meta
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size) if meta else None)
        fam = family(cfg.model_type)  # GLM-4's: Block and init_weights, above (or families/mla_moe.py's)
        self.layers = nn.ModuleList(fam.block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.mtp = mtp_module().layers(cfg) if cfg.mtp_layers else None  # families/mtp.py's MTP layers, {"L + j": layer}
        self.gradient_checkpointing = False  # recompute each block in backward (learner memory option)
        if not meta:
            self.apply(fam.init_weights)

    def forward(self, input_ids, position_ids=None, attention_mask=None, cache: "KVCache | PagedKVCache | None" = None,
                indexer_loss=None, return_hidden=False, keep=None, routing=None):
        """input_ids [B, T] -> logits [B, T, vocab] (or [B, K, vocab] with keep).

        position_ids [B, T]: without a cache (or in a PagedKVCache prefill), the rows are packed: positions
            restart at 0 where each sequence starts, and no token attends across sequences (model.Packed);
            with a KVCache or a paged decode step, the caller gives each row's real positions.
        attention_mask [B, T]: 1 for real tokens, 0 for padding.
        indexer_loss: None, "dense" (warm-up: dense attention, KL on all keys) or "sparse" (top-k
            attention, KL on the selected keys); then returns (logits, indexer KL averaged over F layers).
        return_hidden: return the final normed hidden states [B, T, hidden] instead of logits (the
            learner applies lm_head in chunks to keep [T, vocab] logits out of memory); "trunk": the last
            block's output before the final norm, which the MTP layers read (families/mtp.py; norm(it) is True's).
        keep: the positions [K] (a LongTensor or a slice along T) whose outputs are wanted, the others
            serving only as context (a prompt, the token after the last scored one): the last block's
            output projection and MLP, the final norm and lm_head run on those alone (a decode step's
            last token: keep=slice(-1, None)).
        routing: the MoE families only (families/mla_moe.py's Routing): record each MoE layer's choice of
            experts, or replay given ones.
        """
        B, T = input_ids.shape
        device = input_ids.device
        paged, cache = (cache, None) if isinstance(cache, PagedKVCache) else (None, cache)  # paged: masks as without a cache
        past = cache.length if cache is not None else 0
        mask, rope = attention_inputs(self.cfg, B, T, device, position_ids, attention_mask, cache or paged)
        if indexer_loss not in (None, "dense", "sparse"):
            raise ValueError(f"indexer_loss must be None, 'dense' or 'sparse', got {indexer_loss!r}")
        if indexer_loss is not None and self.cfg.dsa is None:
            raise ValueError("indexer_loss needs a model with DSA (dsa=... when loading)")

        x = self.embed_tokens(input_ids)  # [B, T, hidden]
        if torch.is_autocast_enabled(device.type):
            # The residual stream in the compute dtype (bf16), as the generator's bf16 weights and FSDP's bf16
            # gathers make it: one numerics for every copy of the model, so the learner's logprobs and DSA
            # selections match the generator's (an fp32 stream here alone flips top-k keys and costs memory).
            x = x.to(torch.get_autocast_dtype(device.type))
        # The tables in the compute dtype once per forward, not in each of the layers' apply_rope calls
        rope = {name: (cos.to(x.dtype), sin.to(x.dtype)) for name, (cos, sin) in rope.items()}
        selected, kls = None, []  # top-k choice flows from each F layer to the S layers after it
        extra = family(self.cfg.model_type).block_args(self.cfg, routing, B, T)  # GLM-4's: none (MoE: the routing)
        for i, block in enumerate(self.layers):
            args = (x, rope, mask, paged or cache, selected, indexer_loss, keep if i == len(self.layers) - 1 else None) + extra
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x, selected, kl = torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False)
            else:
                x, selected, kl = block(*args)
            if kl is not None:
                kls.append(kl)
        if cache is not None:
            cache.length = past + T
        x = x if return_hidden == "trunk" else self.norm(x)
        out = x if return_hidden else self.lm_head(x)
        if indexer_loss is not None:
            return out, torch.stack(kls).mean()
        return out

    def indexer_parameters(self):
        return [p for n, p in self.named_parameters() if ".indexer." in n]

    def cast_(self, dtype):
        """Every weight to dtype but FP32_PARAMS, which stay fp32 (generator copies in bf16)."""
        self.to(dtype)
        for name, p in self.named_parameters():
            if name.endswith(FP32_PARAMS):
                p.data = p.data.float()
        for module_name, module in self.named_modules():  # (the MoE routers' bias is a buffer)
            for name, b in module._buffers.items():
                if b is not None and f"{module_name}.{name}".endswith(FP32_PARAMS):
                    module._buffers[name] = b.float()
        return self

    # Hugging Face checkpoints: load_pretrained and save_pretrained, in the checkpoints section below (after what
    # the forward's callers hand it and the engine's cache)

    @classmethod
    def from_pretrained(cls, path, dsa=None, dtype=None, device=None, shard=None, weights=True, mtp=None) -> "GLM":
        """Load an HF directory: load_pretrained, below."""
        return load_pretrained(cls, path, dsa, dtype, device, shard, weights, mtp)

    def save_pretrained(self, path, max_shard_bytes=5 * 2**30):
        """Write an HF directory: save_pretrained, below."""
        save_pretrained(self, path, max_shard_bytes)


# ----------------------------------------------------------------------------- what the forward's callers hand it

def attention_inputs(cfg: GLMConfig, B: int, T: int, device, position_ids, attention_mask, cache):
    """A forward's attention mask and RoPE tables (fp32) for T new tokens of B rows: plain rows, packed rows
    (position_ids without a cache, or a paged prefill: a paged decode step reads its rows' keys through the pool
    instead, Attention.paged_decode), or a KVCache at its `length`, whose key mask it marks. -> (AttnMask, rope)."""
    paged = isinstance(cache, PagedKVCache)
    kv = None if paged else cache
    past = kv.length if kv is not None else 0
    if kv is not None and past + T > kv.max_len:
        raise ValueError(f"KV cache holds {kv.max_len} slots; {past} used + {T} new tokens do not fit")
    valid = attention_mask.bool() if attention_mask is not None else None
    packed = position_ids is not None and kv is None and (not paged or cache.keys is None)
    if packed and valid is not None:
        raise ValueError("packed rows (position_ids without a cache) have no padding: drop attention_mask")
    if position_ids is None:
        position_ids = (past + torch.arange(T, device=device)).expand(B, T)
    if kv is not None:
        kv.key_mask[:, past:past + T] = True if valid is None else valid
        mask = AttnMask(torch.arange(past, past + T, device=device), past + T, kv.key_mask[:, :past + T])
    else:
        groups = getattr(cache, "packed", None) or (Packed.of(position_ids) if packed else None)
        mask = AttnMask(torch.arange(T, device=device), T, valid, packed=groups)
    rope = {"main": rope_cos_sin(position_ids, cfg.rope_dim, cfg.rope_theta, cfg.head_dim)}
    if cfg.dsa is not None:
        rope["index"] = rope_cos_sin(position_ids, cfg.dsa.rope_dim, cfg.rope_theta, cfg.dsa.head_dim)
    return mask, rope


@dataclass
class AttnMask:
    """Which keys each query may see, without building a [T, T] matrix until a chunk asks for one.
    Keys live in slots 0..k_len-1 (cache slots when generating); query i sits in slot q_slot[i], and the
    queries are the last Tq slots (q_slot = k_len - Tq, ..., k_len - 1), so bounds need no device read."""
    q_slot: torch.Tensor  # [Tq]
    k_len: int
    k_valid: torch.Tensor | None = None  # [B, k_len], False on padding slots
    # [B, Tq], False on right padding: a causal mask already hides padding that comes after every real
    # token, so only the queries need telling apart (the indexer KL must not count them)
    real: torch.Tensor | None = None
    packed: "Packed | None" = None  # a packed row: attention runs per group of its sequences

    @property
    def is_causal(self) -> bool:
        return self.packed is None and self.k_valid is None and len(self.q_slot) == self.k_len

    def dense(self, q0=0, q1=None) -> torch.Tensor:
        """bool [B or 1, q1-q0, k_len]. A query always sees its own slot, so padding rows stay finite."""
        qs = self.q_slot[q0:q1, None]
        ks = torch.arange(self.k_len, device=qs.device)
        m = (ks <= qs)[None]
        if self.k_valid is not None:
            m = m & self.k_valid[:, None, :]
        return m | (ks == qs)[None]

    def q_valid(self) -> torch.Tensor:
        """bool [B or 1, Tq]: queries that are real tokens."""
        if self.real is not None:
            return self.real
        if self.k_valid is None:
            return torch.ones(1, len(self.q_slot), dtype=torch.bool, device=self.q_slot.device)
        return self.k_valid[:, self.q_slot]


# A sequence joins a group while it is at least this fraction of the group's longest: padding then costs
# at most 1 / 0.75^2 = 1.8x a group's attention (far less in practice), and a row of mixed lengths makes
# only a few groups (a few kernel calls per layer).
GROUP_RATIO = 0.75


@dataclass
class Packed:
    """The sequences of packed rows, regrouped for attention. The learner packs sequences end to end
    into rows without padding, so that projections and MLPs do no wasted work; attention, though, must
    stay inside each sequence, and one causal call over the row with a document mask would score
    (sum_i L_i)^2 pairs where sum_i L_i^2 are needed (128x more for 128 sequences of 11 tokens), and no
    flash kernel takes such a mask. So attention takes each group of similar-length sequences as a
    right-padded batch [n, L]: a plain causal call (flash on GPU, no mask), exact for the real tokens,
    whose causal window never reaches the padding after them. DSA's top-k and its sparse/dense choice
    then see each sequence's own keys too."""
    groups: list[tuple[torch.Tensor, AttnMask]]  # (src [n, L]: each slot's token in the flattened rows, causal mask)
    back: torch.Tensor  # [B*T]: where each token of the rows sits in the groups' outputs, concatenated
    share: list[float]  # each group's fraction of the tokens (to average the indexer KL over all of them)
    # Each group's first token in the flattened rows where its sequences lie there end to end, all of length L (a
    # long sequence alone, a prefill of equal prompts), else None: take is then a view, no gather; and whether back
    # is the identity (groups in the rows' order, nothing padded: put_back needs no gather either)
    runs: list[int | None]
    in_order: bool

    @classmethod
    def of(cls, position_ids, device=None):
        """position_ids [B, T], restarting at 0 where a sequence starts (every row starts one). One read
        of the sequence boundaries to the host, per forward; none when they are on the host already (the
        engine's prefill), with the groups made on `device`."""
        B, T = position_ids.shape
        device, N = device or position_ids.device, B * T
        starts = (position_ids.flatten() == 0).nonzero()[:, 0].cpu()
        starts = torch.unique(torch.cat([starts, torch.arange(0, N, T)]))  # a row's first token starts one
        lengths = torch.diff(starts, append=torch.tensor([N]))
        n_of = lengths.tolist()  # the lengths as Python ints: the grouping below is host bookkeeping
        order = sorted(range(len(starts)), key=lambda i: -n_of[i])  # longest first, ties by position
        groups, back, share, runs, offset, i = [], torch.empty(N, dtype=torch.long), [], [], 0, 0
        while i < len(order):
            L, j = n_of[order[i]], i + 1
            while j < len(order) and n_of[order[j]] >= GROUP_RATIO * L:
                j += 1
            st, ln = starts[order[i:j]], lengths[order[i:j]]  # [n]
            whole = bool((ln == L).all() and (st == st[0] + L * torch.arange(j - i)).all())
            runs.append(int(st[0]) if whole else None)
            slot = torch.arange(L)
            src = st[:, None] + torch.minimum(slot, ln[:, None] - 1)  # [n, L]: padding repeats the last token
            real = slot < ln[:, None]  # [n, L]
            back[src[real]] = offset + torch.arange(real.numel()).view(real.shape)[real]
            groups.append((to_device(src, device), AttnMask(torch.arange(L, device=device), L, real=to_device(real, device))))
            share.append(int(ln.sum()) / N)
            offset, i = offset + real.numel(), j
        in_order = offset == N and bool(torch.equal(back, torch.arange(N)))  # (offset: the groups' slots, padding too)
        return cls(groups, to_device(back, device), share, runs, in_order)

    def take(self, t, i):
        """t [B, T, ...] (packed rows) -> [n, L, ...]: group i's sequences, right-padded."""
        src, run = self.groups[i][0], self.runs[i]
        if run is not None:
            return t.flatten(0, 1)[run:run + src.numel()].unflatten(0, src.shape)
        return dsa.index_gather(t.flatten(0, 1), src)  # a deterministic backward

    def put_back(self, outs, shape):
        """The groups' outputs [n, L, ...] -> [B, T, ...] in the rows' order."""
        flat = torch.cat([o.flatten(0, 1) for o in outs]) if len(outs) > 1 else outs[0].flatten(0, 1)
        return (flat if self.in_order else flat.index_select(0, self.back)).view(*shape, *outs[0].shape[2:])


def to_device(data, device, dtype=None):
    """Host data (a list, a numpy array or a CPU tensor) on `device`, without making the host wait. On CUDA a
    copy from ordinary (pageable) host memory first waits for everything queued on the device, one sync per
    call; from pinned memory it is queued like a kernel (the caching host allocator keeps the buffer until the
    copy has run). The engine's per-step bookkeeping goes through here."""
    t = torch.as_tensor(data, dtype=dtype)
    if torch.device(device).type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


# ----------------------------------------------------------------------------- the engine's cache
# (KVCache, the plain cache of tests and tools, which no run builds, is this file's last section)

BLOCK_SIZE = 16  # token slots per KV block (the engine's PagedKVCache): a sequence wastes under one block


class PagedKVCache:
    """The generation engine's KV memory: engine.py owns it and tells how rows take and return its blocks;
    here is what the forward reads. Per layer one pool of token slots, keys and values [N, Hkv, D] (and
    indexer keys [N, d_I] on DSA `F` layers), handed out in blocks of block_size slots (`free`). Before
    each forward the engine sets:
      - a prefill (input [1, T], a packed row of whole sequences): `slots` [T] receive the keys on the
        way; `packed`, the row's groups (made on the host); `copies`, further (slots [S], src [S]) pairs,
        slot j of a copy taking the keys of row token src[j] (samples that share a context run it once);
      - a decode step (input [B, 1]): `slots` [B] receive the new keys, and `keys` [B, Lk] lists each
        row's slots in position order, left-padded (`key_valid` False there), its new token last, which
        Attention.paged_decode reads (so DSA's ties follow positions, as in the learner, not slots).
    One block more than num_blocks is never handed out: its first slot, `scratch`, is where the padding
    rows of a CUDA-graph bucket write and read. (MLA models, families/mla_moe.py: `k` holds each token's
    latent [N, cfg.kv_width], `v` is empty: the shapes are Family.kv_shapes'.) mtp: the pool also holds the
    MTP layers' keys, as layers num_layers + j (families/mtp.py: speculative decoding's drafts)."""

    def __init__(self, cfg: GLMConfig, num_blocks: int, block_size: int, device=None, dtype=torch.float32, mtp=False):
        N = (num_blocks + 1) * block_size
        fam = family(cfg.model_type)
        k, v = fam.kv_shapes(cfg)
        kinds = cache_kinds(cfg, mtp)  # one per layer the pool holds
        self.k = [torch.zeros(N, *k, device=device, dtype=dtype) for _ in kinds]
        self.v = [torch.zeros(N, *v, device=device, dtype=dtype) for _ in kinds] if v else []
        self.index_k = [torch.zeros(N, cfg.dsa.head_dim, device=device, dtype=dtype) if kind == "F" else None
                        for kind in kinds]
        self.num_blocks, self.block_size, self.scratch = num_blocks, block_size, num_blocks * block_size
        self.free = list(range(num_blocks - 1, -1, -1))  # free block ids; pop() hands out the lowest first
        self.slots = self.keys = self.key_valid = self.packed = None  # set by the engine before each forward
        self.copies = []
        # MoE: per MoE layer, the experts [N, k] each slot's token took (the forward writes them: MoE.routed): the
        # generator's routes, which the engine reads out with each finished row for the learner to replay (GLM-4
        # has none: [])
        self.routes = fam.routes(cfg, N, device)

    def write(self, store, i, new):
        """Store new [B, T, ...] of layer i at `slots` (and its copies); return it unchanged (prefill
        attends within its row)."""
        rows = new.flatten(0, 1).to(store[i].dtype)
        store[i].index_copy_(0, self.slots, rows)
        for slots, src in self.copies:
            store[i].index_copy_(0, slots, rows.index_select(0, src))
        return new


def cache_kinds(cfg: GLMConfig, mtp=False) -> str:
    """The layers a cache holds, one character each: the decoder's DSA kinds (F, S, or "." without DSA), then with
    mtp the MTP layers' (an F: each has its own indexer, families/mtp.py)."""
    n = cfg.mtp_layers if mtp else 0
    return (cfg.dsa.layer_kinds(cfg.num_layers) + "F" * n) if cfg.dsa else "." * (cfg.num_layers + n)


# ----------------------------------------------------------------------------- checkpoints

def load_pretrained(cls, path, dsa=None, dtype=None, device=None, shard=None, weights=True, mtp=None) -> GLM:
    """Load an HF directory. dsa: None keeps the checkpoint's own setting (dense for a GLM-4
    checkpoint), a dict (or DSAConfig) turns DSA on, False turns it off. dtype (default bf16 on
    CUDA, else fp32) applies to every weight but dsa.FP32_PARAMS, which stay fp32. weights=False: the
    model of the directory without its weights, every tensor's storage empty (each allocated and shrunk,
    one at a time), for someone to fill (a co-located engine: the learner's first publish, colocate.py).

    Memory: the model is built on the meta device, cast there, and only then allocated, so every
    tensor exists once, in its final dtype; the file's tensors are copied in one at a time from the
    memory-mapped safetensors. shard (parallel.py's FSDP2) is applied while the model is still on meta:
    each rank then allocates only its shard of each tensor and reads only those rows of the file, so
    no rank ever holds the full model (a 9B learner loads in 1/N of its fp32 bytes, not 2x).

    IndexCache patterns may differ between the checkpoint and the model: a layer that owns an
    indexer (`F`) takes the checkpoint's indexer for that layer when the file has one, and only the
    layers without one are freshly initialised (we say which); indexer tensors of layers that are
    `S` now (or of any layer, loading dense) are dropped, with one line. Any other missing,
    unexpected or misshapen tensor is an error naming it.

    mtp: the multi-token-prediction layers to have (GLMConfig.mtp_layers; None: the checkpoint's own). Fewer
    than the file holds drops the rest, more initialises the missing ones fresh, each said in one line; the
    files' copies of the embedding and head in them are checked against the main model's (families/mtp.py's
    MTPLoad).

    A block-wise FP8 checkpoint (config.json's quantization_config, as zai-org/GLM-5-FP8) loads too: each fp8
    weight read dequantized into dtype, weight * weight_scale_inv per 128 x 128 block (machinery/fp8.py's Published,
    which checks every scale first); save_pretrained writes the model's own dtype (an fp8 generator keeps the
    published blocks: fp8.quantize_model_(model, published=path))."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{cfg_path}: no config.json (expected a Hugging Face model directory)")
    with open(cfg_path) as f:
        hf = json.load(f)
    cfg = GLMConfig.from_hf(hf)
    fam = family(cfg.model_type)  # GLM-4's (or, say, families/mla_moe.py's: experts stored per expert)
    if dsa is not None:
        cfg = fam.with_dsa(cfg, dsa)
    files, dropped = _safetensors_files(path), set()
    mtp_load = mtp_module().load(cfg, mtp, files, path) if cfg.mtp_layers or mtp else None  # families/mtp.py's MTPLoad
    cfg, files = (mtp_load.cfg, mtp_load.files) if mtp_load else (cfg, files)
    fp8_files = _published_fp8(hf, files, path) if hf.get("quantization_config") is not None else None  # (checked)
    files = fp8_files.files if fp8_files else files  # (the scales' names out: each is its fp8 weight's)
    dtype = dtype or (torch.bfloat16 if device is not None and torch.device(device).type == "cuda" else torch.float32)

    with torch.device("meta"):
        model = cls(cfg).cast_(dtype)  # no memory yet: the dtypes are decided before anything is allocated
    if not weights:
        return _without_weights(model, path, device or "cpu")
    if shard is not None:
        shard(model)  # FSDP2 on meta: parameters become DTensors, each rank's rows of dim 0
    expected = {hf_name(n): p for n, p in model.state_dict(keep_vars=True).items()}  # global shapes
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
    expected = fam.file_names(expected, cfg)  # (MoE: the files hold each expert's matrices, we one [E, ...])
    expected = mtp_load.names(expected) if mtp_load else expected  # (the MTP layers' copies of embedding and head)
    for file, names in files.items():  # check names and shapes from the headers before allocating
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in names:
                if name not in expected:
                    if ".indexer." in name:  # an indexer this model's pattern (or dense) does not use
                        dropped.add(_layer_of(name))
                        continue
                    raise ValueError(f"{file}: unexpected tensor {name} (not part of {describe(cfg)})")
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(expected[name].shape):
                    raise ValueError(f"{file}: tensor {name} has shape {shape}, expected {tuple(expected[name].shape)}")
    in_file = {n for file, names in files.items() for n in names}
    fresh = {}  # layer -> its indexer tensors missing from the checkpoint
    for name in expected:
        if name not in in_file:
            if ".indexer." not in name:
                raise ValueError(f"{path}: checkpoint is missing tensor {name}")
            fresh.setdefault(_layer_of(name), []).append(name)
    for layer, names in fresh.items():  # an indexer is loaded whole or initialised whole
        if len(names) != sum(".indexer." in n and _layer_of(n) == layer for n in expected):
            raise ValueError(f"{path}: checkpoint is missing tensor {names[0]} (it has the rest of layer "
                             f"{layer}'s indexer)")

    model.to_empty(device=device or "cpu")
    if cfg.tie_word_embeddings and shard is None:  # to_empty made two tensors of the tied one
        model.lm_head.weight = model.embed_tokens.weight
    params = fam.file_names({hf_name(n): p for n, p in model.state_dict(keep_vars=True).items()}, cfg)
    params = mtp_load.names(params) if mtp_load else params
    with torch.no_grad():
        for file, names in files.items():
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in names:
                    if name in expected:
                        read = (fp8_files.reader(f, name, params[name]) if fp8_files else
                                lambda rows, f=f, name=name: f.get_slice(name)[rows])  # (fp8: dequantized)
                        _copy_rows(params[name], read)
    if fresh:
        _init_indexers(params, cfg, fresh, path)
    _ = mtp_load and mtp_load.finish(model)  # MTP layers the file lacks: initialised fresh (one line says which)
    if dropped:
        print(f"[model] {path}: ignored the checkpoint's indexer weights of layer(s) {_ranges(dropped)} "
              f"({'dense attention' if cfg.dsa is None else 'S layers in pattern ' + cfg.dsa.pattern})")
    return model


def save_pretrained(model: GLM, path, max_shard_bytes=5 * 2**30):
    """Write config.json + safetensors (sharded with an index above max_shard_bytes) into a temp
    directory, then rename it into place: a crash never leaves a half-written checkpoint."""
    path = path.rstrip("/")
    tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        _write(model, tmp, max_shard_bytes)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(path):
        old = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old)
    else:
        os.rename(tmp, path)


def _write(model: GLM, tmp, max_shard_bytes):
    state = {hf_name(n): t.detach().to("cpu").contiguous() for n, t in model.state_dict().items()}
    if model.cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = family(model.cfg.model_type).to_files(state, model.cfg)  # (MoE: each expert's matrices apart)
    state = mtp_module().to_files(state, model.cfg) if model.cfg.mtp_layers else state  # (copies of embedding, head)
    shards, size = [{}], 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    else:
        _write_shards(tmp, shards)
    config = model.cfg.to_hf()
    config["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def hf_name(name: str) -> str:
    """Our parameter names are transformers' without the `model.` prefix of the decoder; the MTP layers' (GLM.mtp,
    keyed by their layer number) are the files' layers after the decoder's."""
    return name if name.startswith("lm_head.") else "model." + ("layers." + name[4:] if name.startswith("mtp.") else name)


def _safetensors_files(path) -> dict[str, list[str]]:
    """{file: [tensor names]} from model.safetensors.index.json, or every *.safetensors file."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        return _sharded_files(path, index)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    out = {}
    for fname in files:
        with safe_open(os.path.join(path, fname), framework="pt") as f:
            out[os.path.join(path, fname)] = list(f.keys())
    return out


def _copy_rows(dst, read):
    """Fill dst (a tensor, or an FSDP2 DTensor sharded along dim 0) with read(rows), the source's rows
    [start, stop) that this rank holds: FSDP2 splits dim 0 as torch.chunk does, ceil(n / ranks) rows each.
    dst not a tensor: a part of one that Family.file_names made (families/mla_moe.py's ExpertPart, one expert's
    matrix of an [E, ...] tensor), which copies itself in."""
    if not isinstance(dst, torch.Tensor):
        return dst.copy_(read)
    if not hasattr(dst, "to_local"):
        dst.copy_(read(slice(None)))
        return
    local, n = dst.to_local(), dst.shape[0]
    ranks, rank = dst.device_mesh.size(), dst.device_mesh.get_local_rank()
    start = min(n, rank * -(-n // ranks))
    if local.numel():  # (a rank can hold no rows of a short tensor)
        local.copy_(read(slice(start, start + local.shape[0])))


# ----------------------------------------------------------------------------- checkpoints: the rarer cases
# (a co-located engine's empty model, indexers the checkpoint lacks, sharded files, names for messages)

def _without_weights(model: GLM, path, device) -> GLM:
    """load_pretrained(weights=False): the model of the directory on device without its weights, every
    parameter's storage empty (each allocated and shrunk, one at a time), for someone to fill (a co-located
    engine: the learner's first publish, colocate.py); its buffers are read from the files (Family.load_buffers:
    GLM-4 has none, the MoE routers' biases are buffers, which no publish sends)."""
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                t = torch.empty(p.shape, dtype=p.dtype, device=device)
                t.untyped_storage().resize_(0)
                module._parameters[name] = nn.Parameter(t, requires_grad=p.requires_grad)
    if model.cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    family(model.cfg.model_type).load_buffers(model, path, device)
    return model


# config.json's quantization_config.quant_method -> its reader, (quantization_config, {file: [names]}, path) ->
# an object with .files (the names without the scales) and .reader(f, name, dst). machinery/fp8.py registers "fp8"
# (block-wise e4m3, as zai-org/GLM-5-FP8) on import, as families register in FAMILIES: the model never imports the
# machinery above it (docs/design.md's import rule), and every run imports it.
QUANTIZED: dict = {}


def _published_fp8(hf: dict, files: dict, path):
    """load_pretrained of a checkpoint with a quantization_config: its registered reader (QUANTIZED; one line naming
    the key, or the file and tensor, for anything its config does not explain), which dequantizes the fp8 weights."""
    qc = hf["quantization_config"]
    method = qc.get("quant_method") if isinstance(qc, dict) else qc
    if method not in QUANTIZED:
        raise ValueError(f"{os.path.join(path, 'config.json')}: quantization_config.quant_method is {method!r}: only "
                         f"{', '.join(map(repr, QUANTIZED)) or 'block-wise fp8 (machinery.fp8, imported by any run)'} load")
    return QUANTIZED[method](qc, files, path)


def _init_indexers(params: dict, cfg: GLMConfig, fresh: dict, path):
    """load_pretrained's F layers whose indexer the checkpoint lacks ({layer: names}): each initialised whole on
    the CPU with the seed, then each rank keeps its rows, so N processes start from the same indexer as one."""
    with torch.no_grad():
        for layer in sorted(fresh):
            with torch.device("meta"):
                ix = family(cfg.model_type).block(cfg, layer).self_attn.indexer  # the layer's own kind of indexer
            ix.to_empty(device="cpu").apply(init_weights)
            for n, t in ix.state_dict().items():
                _copy_rows(params[f"model.layers.{layer}.self_attn.indexer.{n}"], lambda rows, t=t: t[rows])
    print(f"[model] {path}: no indexer weights for layer(s) {_ranges(fresh)} in the checkpoint; initialised "
          "them fresh (train them with the DSA warm-up before using sparse attention)")


def _sharded_files(path, index) -> dict[str, list[str]]:
    """_safetensors_files of a sharded checkpoint: {file: [tensor names]} from its index (_write_shards')."""
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    files = {}
    for name, fname in weight_map.items():
        files.setdefault(os.path.join(path, fname), []).append(name)
    return files


def _write_shards(tmp, shards: list[dict]):
    """save_pretrained above max_shard_bytes: one file per shard and model.safetensors.index.json."""
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(tmp, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    total = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


# The multi-token-prediction layers' module (families/mtp.py), which sets this on import: GLM builds its MTP layers,
# load_pretrained and save_pretrained handle their tensors through it
MTP = None


def mtp_module():
    """families/mtp.py (MTP), or one line saying which import provides it."""
    if MTP is None:
        raise ValueError("a model with multi-token-prediction layers (mtp_layers, num_nextn_predict_layers) needs "
                         "families/mtp.py: import families first")
    return MTP


def our_name(name: str) -> str:
    return name if name.startswith("lm_head.") else name.removeprefix("model.")


def _layer_of(name: str) -> int:
    """'model.layers.12.self_attn...' -> 12."""
    return int(name.split("layers.")[1].split(".")[0])


def _ranges(layers) -> str:
    """{0, 1, 2, 5} -> '0-2, 5'."""
    out, run = [], []
    for i in sorted(layers):
        if run and i != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(i)
    out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


def describe(cfg: GLMConfig) -> str:
    moe = (f" ({cfg.model_type}: MLA, {len(cfg.moe_layers)} MoE layers of {cfg.moe.n_routed_experts} experts, "
           f"top-{cfg.moe.num_experts_per_tok})") if cfg.moe else ""
    return (f"GLM with {cfg.num_layers} layers, hidden {cfg.hidden_size}{moe}" +
            (f", DSA {cfg.dsa.pattern} top-{cfg.dsa.topk}" if cfg.dsa else ", dense attention"))


# ----------------------------------------------------------------------------- the cache of tests and tools

class KVCache:
    """Preallocated per-layer keys/values [B, S, Hkv, D] (and indexer keys [B, S, d_I] on DSA `F`
    layers). Every row writes its new tokens into the same slots; padding slots are masked out by
    `key_mask`, so left- and right-padded batches both work. (MLA models, families/mla_moe.py: `k` holds
    each token's latent [B, S, cfg.kv_width] and `v` is empty: the shapes are Family.kv_shapes'.) mtp: the MTP
    layers' too, as layers num_layers + j, which fill their slots one token behind the decoder's (families/mtp.py),
    so they count theirs in `mtp_length`."""

    def __init__(self, cfg: GLMConfig, batch: int, max_len: int, device=None, dtype=torch.float32, mtp=False):
        k, v = family(cfg.model_type).kv_shapes(cfg)
        kinds = cache_kinds(cfg, mtp)
        self.k = [torch.zeros(batch, max_len, *k, device=device, dtype=dtype) for _ in kinds]
        self.v = [torch.zeros(batch, max_len, *v, device=device, dtype=dtype) for _ in kinds] if v else []
        self.mtp_length = 0
        self.index_k = [torch.zeros(batch, max_len, cfg.dsa.head_dim, device=device, dtype=dtype)
                        if kind == "F" else None for kind in kinds]
        self.key_mask = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.length = 0  # slots filled so far (same for every row)
        self.max_len = max_len

    def write(self, store, i, new):
        """Write new [B, T, ...] at the current slots of layer i; return all filled slots."""
        end = self.length + new.shape[1]
        store[i][:, self.length:end] = new
        return store[i][:, :end]
