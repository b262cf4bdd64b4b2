"""
The GLM-4 dense decoder (GLM-4-9B-0414, GLM-Z1-9B-0414), numerically the same model as transformers'
`Glm4ForCausalLM`, plus DeepSeek Sparse Attention when asked for. (This first chapter imports the second,
dsa.py, for its attention: read them as a pair.)

    x -> embed -> L x [ x += post_attn_norm(attn(input_norm(x)));  x += post_mlp_norm(mlp(pre_mlp_norm(x))) ]
      -> norm -> lm_head

What makes it GLM rather than Llama: "sandwich" norms (an extra RMSNorm after attention and after the
MLP), a bias on the Q/K/V projections, RoPE on only the first `partial_rotary_factor` of each head's
dimensions with *interleaved* pairs (x0,x1), (x2,x3)..., and an untied LM head. Attention is GQA.

One forward serves every caller:
  - the learner: packed rows (several sequences per row, positions restarting at 0 for each one, no
    attention across them) so no compute is spent on padding;
  - the generation engine (engine.py): packed prefills, then one new token per row, over its PagedKVCache;
  - tests and tools: a KVCache (batched rows with left or right padding, one or many new tokens per
    call), or plain [B, T] input.
Each of them is described by an `AttnMask`, built once per forward and shared by all layers.

Checkpoints are Hugging Face directories (config.json + *.safetensors, sharded or not), read and
written with transformers' parameter names, so a saved model loads in `Glm4ForCausalLM` and back.

GLM-4.7-Flash and GLM-5 (Multi-head Latent Attention + Mixture of Experts, transformers' glm4_moe_lite and
glm_moe_dsa) live in the last section of this file, beside this dense path, which never reads them.
"""
import json
import os
import shutil
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

import dsa
from dsa import DSAConfig, Indexer
from kernels import moe as moe_kernels

# Parameter (and buffer) names, as suffixes, kept in fp32 in every copy of the model (cast_, FSDP's bf16
# gathers, the generator): DSA's small indexer tensors, and the MoE routers' weight and score-correction bias
# (the families at the end of this file), which pick experts by comparing scores a bf16 rounding would flip.
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
    # "glm4" (this file's dense decoder), or one of the MLA + MoE families at the end of this file:
    # "glm4_moe_lite" (GLM-4.7-Flash) and "glm_moe_dsa" (GLM-5, DSA built in); those need mla and moe
    model_type: str = "glm4"
    mla: "MLAConfig | None" = None
    moe: "MoEConfig | None" = None

    def __post_init__(self):
        if isinstance(self.dsa, dict):
            self.dsa = DSAConfig.from_dict(self.dsa)
        if isinstance(self.eos_token_id, int):
            self.eos_token_id = [self.eos_token_id]
        if self.model_type == "glm4":
            if self.mla is not None or self.moe is not None:
                raise ValueError("mla / moe need model_type glm4_moe_lite or glm_moe_dsa (glm4 is the dense GLM-4 decoder)")
            defaults = {"num_kv_heads": 2, "head_dim": 128, "partial_rotary_factor": 0.5, "attention_bias": True}
            for key, value in defaults.items():
                if getattr(self, key) is None:
                    setattr(self, key, value)
        else:
            _latent_post_init(self)
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
        """Values per token per layer that a KV cache holds: keys and values of every KV head (GLM-4), or
        MLA's latent, the normalised kv_lora_rank and the shared rotated key (DSA's indexer keys apart)."""
        if self.mla is not None:
            return self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, d: dict) -> "GLMConfig":
        """From a transformers config.json: the flat form of the published GLM-Z1-9B-0414 checkpoint
        (`rope_theta`, `partial_rotary_factor` at top level) or transformers 5's `rope_parameters`."""
        rope = dict(d.get("rope_parameters") or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"config.json: rope_type {rope['rope_type']!r} is not supported (only 'default')")
        if d.get("model_type", "glm4") != "glm4":
            return _latent_from_hf(cls, d, rope)
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
            bos_token_id=d.get("bos_token_id"), dsa=d.get("dsa"),
        )

    def to_hf(self) -> dict:
        """transformers 5 form; the `dsa` section is ours (Glm4ForCausalLM ignores it)."""
        if self.model_type != "glm4":
            return _latent_to_hf(self)
        d = {
            "architectures": ["Glm4ForCausalLM"], "model_type": "glm4", "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim, "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor},
            "rms_norm_eps": self.rms_norm_eps, "attention_bias": self.attention_bias,
            "tie_word_embeddings": self.tie_word_embeddings, "max_position_embeddings": self.max_position_embeddings,
            "pad_token_id": self.pad_token_id, "eos_token_id": self.eos_token_id, "bos_token_id": self.bos_token_id,
        }
        if self.dsa is not None:
            d["dsa"] = asdict(self.dsa)
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
    if x.dim() == 4:
        cos, sin = cos[:, :, None], sin[:, :, None]
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (x1, x0, x3, x2, ...)
    return x * cos.to(x.dtype) + swapped * sin.to(x.dtype)


# ----------------------------------------------------------------------------- masks and cache

def to_device(data, device, dtype=None):
    """Host data (a list, a numpy array or a CPU tensor) on `device`, without making the host wait. On CUDA a
    copy from ordinary (pageable) host memory first waits for everything queued on the device, one sync per
    call; from pinned memory it is queued like a kernel (the caching host allocator keeps the buffer until the
    copy has run). The engine's per-step bookkeeping goes through here."""
    t = torch.as_tensor(data, dtype=dtype)
    if torch.device(device).type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


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
        groups, back, share, offset, i = [], torch.empty(N, dtype=torch.long), [], 0, 0
        while i < len(order):
            L, j = n_of[order[i]], i + 1
            while j < len(order) and n_of[order[j]] >= GROUP_RATIO * L:
                j += 1
            st, ln = starts[order[i:j]], lengths[order[i:j]]  # [n]
            slot = torch.arange(L)
            src = st[:, None] + torch.minimum(slot, ln[:, None] - 1)  # [n, L]: padding repeats the last token
            real = slot < ln[:, None]  # [n, L]
            back[src[real]] = offset + torch.arange(real.numel()).view(real.shape)[real]
            groups.append((to_device(src, device), AttnMask(torch.arange(L, device=device), L, real=to_device(real, device))))
            share.append(int(ln.sum()) / N)
            offset, i = offset + real.numel(), j
        return cls(groups, to_device(back, device), share)

    @staticmethod
    def take(t, src):
        """t [B, T, ...] (packed rows) -> [n, L, ...] (a group's sequences, right-padded)."""
        return dsa.index_gather(t.flatten(0, 1), src)  # a deterministic backward

    def put_back(self, outs, shape):
        """The groups' outputs [n, L, ...] -> [B, T, ...] in the rows' order."""
        return torch.cat([o.flatten(0, 1) for o in outs]).index_select(0, self.back).view(*shape, *outs[0].shape[2:])


class KVCache:
    """Preallocated per-layer keys/values [B, S, Hkv, D] (and indexer keys [B, S, d_I] on DSA `F`
    layers). Every row writes its new tokens into the same slots; padding slots are masked out by
    `key_mask`, so left- and right-padded batches both work. (MLA models, at the end of this file: `k` holds
    each token's latent [B, S, cfg.kv_width] and `v` is empty.)"""

    def __init__(self, cfg: GLMConfig, batch: int, max_len: int, device=None, dtype=torch.float32):
        shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim) if cfg.mla is None else (batch, max_len, cfg.kv_width)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers if cfg.mla is None else 0)]
        kinds = cfg.dsa.layer_kinds(cfg.num_layers) if cfg.dsa else "." * cfg.num_layers
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
    rows of a CUDA-graph bucket write and read. (MLA models, at the end of this file: `k` holds each token's
    latent [N, cfg.kv_width], `v` is empty.)"""

    def __init__(self, cfg: GLMConfig, num_blocks: int, block_size: int, device=None, dtype=torch.float32):
        N = (num_blocks + 1) * block_size
        shape = (N, cfg.num_kv_heads, cfg.head_dim) if cfg.mla is None else (N, cfg.kv_width)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers if cfg.mla is None else 0)]
        kinds = cfg.dsa.layer_kinds(cfg.num_layers) if cfg.dsa else "." * cfg.num_layers
        self.index_k = [torch.zeros(N, cfg.dsa.head_dim, device=device, dtype=dtype) if kind == "F" else None
                        for kind in kinds]
        self.num_blocks, self.block_size, self.scratch = num_blocks, block_size, num_blocks * block_size
        self.free = list(range(num_blocks - 1, -1, -1))  # free block ids; pop() hands out the lowest first
        self.slots = self.keys = self.key_valid = self.packed = None  # set by the engine before each forward
        self.copies = []
        # MoE: per MoE layer, the experts [N, k] each slot's token took (written by the forward, MoE.routed): the
        # generator's routes, which the engine reads out with each finished row for the learner to replay
        dt = route_dtype(cfg) if cfg.moe else None
        self.routes = [torch.full((N, cfg.moe.num_experts_per_tok), no_route(dt), dtype=dt, device=device)
                       for _ in cfg.moe_layers] if cfg.moe else []

    def write(self, store, i, new):
        """Store new [B, T, ...] of layer i at `slots` (and its copies); return it unchanged (prefill
        attends within its row)."""
        rows = new.flatten(0, 1).to(store[i].dtype)
        store[i].index_copy_(0, self.slots, rows)
        for slots, src in self.copies:
            store[i].index_copy_(0, slots, rows.index_select(0, src))
        return new


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

    def forward(self, x, rope, mask: AttnMask, cache, selected, indexer_loss, keep=None):
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

    def attend_rows(self, q, k, v, index, mask: AttnMask, selected, indexer_loss):
        """attend() over the forward's rows [B, T]: at once, or for packed rows per group of similar-length
        sequences (model.Packed). Returns (out [B, T, H, D], selected, kl)."""
        if mask.packed is None:
            return self.attend(q, k, v, index, mask, selected, indexer_loss)
        B, T = q.shape[:2]
        p, outs, chosen, kl = mask.packed, [], [], None
        for i, (src, m) in enumerate(p.groups):
            group = [Packed.take(t, src) for t in (q, k, v)]
            out, sel, kl_i = self.attend(*group, index and tuple(Packed.take(t, src) for t in index), m,
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

    def attend(self, q, k, v, index, mask: AttnMask, selected, indexer_loss):
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

    def paged_decode(self, x, q, k, v, rope, cache: PagedKVCache, selected):
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


def dense_attention(q, k, v, mask: AttnMask, scale):
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


class GLM(nn.Module):
    def __init__(self, cfg: GLMConfig):
        super().__init__()
        self.cfg = cfg
        # Built on the meta device (a memory plan, a load that allocates afterwards) there is nothing to initialise, and
        # torch's meta normal_ takes seconds at 150K x 6144: skip it (it draws no random numbers either way)
        meta = torch.empty(0).is_meta
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size) if meta else None)
        block = Block if cfg.mla is None else LatentBlock  # (the MLA + MoE families: the end of this file)
        self.layers = nn.ModuleList(block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.gradient_checkpointing = False  # recompute each block in backward (learner memory option)
        if not meta:
            self.apply(init_weights)

    def forward(self, input_ids, position_ids=None, attention_mask=None, cache: KVCache | PagedKVCache | None = None,
                indexer_loss=None, return_hidden=False, keep=None, routing: "Routing | None" = None):
        """input_ids [B, T] -> logits [B, T, vocab] (or [B, K, vocab] with keep).

        position_ids [B, T]: without a cache (or in a PagedKVCache prefill), the rows are packed: positions
            restart at 0 where each sequence starts, and no token attends across sequences (model.Packed);
            with a KVCache or a paged decode step, the caller gives each row's real positions.
        attention_mask [B, T]: 1 for real tokens, 0 for padding.
        indexer_loss: None, "dense" (warm-up: dense attention, KL on all keys) or "sparse" (top-k
            attention, KL on the selected keys); then returns (logits, indexer KL averaged over F layers).
        return_hidden: return the final normed hidden states [B, T, hidden] instead of logits (the
            learner applies lm_head in chunks to keep [T, vocab] logits out of memory).
        keep: the positions [K] (a LongTensor or a slice along T) whose outputs are wanted, the others
            serving only as context (a prompt, the token after the last scored one): the last block's
            output projection and MLP, the final norm and lm_head run on those alone (a decode step's
            last token: keep=slice(-1, None)).
        routing: the MoE families only (model.Routing): record each MoE layer's choice of experts, or
            replay given ones.
        """
        B, T = input_ids.shape
        device = input_ids.device
        paged, cache = (cache, None) if isinstance(cache, PagedKVCache) else (None, cache)  # paged: masks as without a cache
        past = cache.length if cache is not None else 0
        if cache is not None and past + T > cache.max_len:
            raise ValueError(f"KV cache holds {cache.max_len} slots; {past} used + {T} new tokens do not fit")
        valid = attention_mask.bool() if attention_mask is not None else None
        # Packed rows: position_ids without a cache, or a paged prefill (a paged decode step reads its rows'
        # keys through the pool instead: Attention.paged_decode)
        packed = position_ids is not None and cache is None and (paged is None or paged.keys is None)
        if packed and valid is not None:
            raise ValueError("packed rows (position_ids without a cache) have no padding: drop attention_mask")
        if position_ids is None:
            position_ids = (past + torch.arange(T, device=device)).expand(B, T)
        if cache is not None:
            cache.key_mask[:, past:past + T] = True if valid is None else valid
            mask = AttnMask(torch.arange(past, past + T, device=device), past + T, cache.key_mask[:, :past + T])
        else:
            groups = getattr(paged, "packed", None) or (Packed.of(position_ids) if packed else None)
            mask = AttnMask(torch.arange(T, device=device), T, valid, packed=groups)

        rope = {"main": rope_cos_sin(position_ids, self.cfg.rope_dim, self.cfg.rope_theta, self.cfg.head_dim)}
        if self.cfg.dsa is not None:
            rope["index"] = rope_cos_sin(position_ids, self.cfg.dsa.rope_dim, self.cfg.rope_theta, self.cfg.dsa.head_dim)
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
        extra = () if self.cfg.moe is None and routing is None else (_routing_start(self.cfg, routing, B, T),)
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
        x = self.norm(x)
        out = x if return_hidden else self.lm_head(x)
        if indexer_loss is not None:
            return out, torch.stack(kls).mean()
        return out

    def indexer_parameters(self):
        return [p for n, p in self.named_parameters() if ".indexer." in n]

    # ------------------------------------------------------------------------- checkpoints

    @classmethod
    def from_pretrained(cls, path, dsa=None, dtype=None, device=None, shard=None, weights=True) -> "GLM":
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
        unexpected or misshapen tensor is an error naming it."""
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"{cfg_path}: no config.json (expected a Hugging Face model directory)")
        with open(cfg_path) as f:
            cfg = GLMConfig.from_hf(json.load(f))
        if dsa is False and cfg.model_type == "glm_moe_dsa":  # GLM-5 without its indexers: GLM-4.7-Flash's model
            cfg = replace(cfg, model_type="glm4_moe_lite")
        if dsa is not None:
            cfg = replace(cfg, dsa=dsa or None)  # re-validates; a dict becomes a DSAConfig
        dtype = dtype or (torch.bfloat16 if device is not None and torch.device(device).type == "cuda" else torch.float32)

        with torch.device("meta"):
            model = cls(cfg).cast_(dtype)  # no memory yet: the dtypes are decided before anything is allocated
        if not weights:
            for module in model.modules():
                for name, p in module._parameters.items():
                    if p is not None:
                        t = torch.empty(p.shape, dtype=p.dtype, device=device or "cpu")
                        t.untyped_storage().resize_(0)
                        module._parameters[name] = nn.Parameter(t, requires_grad=p.requires_grad)
            if cfg.tie_word_embeddings:
                model.lm_head.weight = model.embed_tokens.weight
            if cfg.moe is not None:  # the routers' score-correction biases: buffers, which no publish sends
                _load_buffers(model, path, device or "cpu")
            return model
        if shard is not None:
            shard(model)  # FSDP2 on meta: parameters become DTensors, each rank's rows of dim 0
        expected = {hf_name(n): p for n, p in model.state_dict(keep_vars=True).items()}  # global shapes
        if cfg.tie_word_embeddings:
            expected.pop("lm_head.weight")
        if cfg.moe is not None:  # the files hold each expert's matrices, we one [E, ...] tensor: ExpertPart
            expected = _split_experts(expected, cfg)
        files, dropped = _safetensors_files(path), set()
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
        params = {hf_name(n): p for n, p in model.state_dict(keep_vars=True).items()}
        if cfg.moe is not None:
            params = _split_experts(params, cfg)
        with torch.no_grad():
            for file, names in files.items():
                with safe_open(file, framework="pt", device="cpu") as f:
                    for name in names:
                        if name in expected:
                            _copy_rows(params[name], lambda rows, f=f, name=name: f.get_slice(name)[rows])
            for layer in sorted(fresh):  # initialised whole on the CPU with the seed, then each rank keeps its rows,
                with torch.device("meta"):  # so N processes start from the same indexer as one process
                    ix = Indexer(cfg.hidden_size, cfg.dsa) if cfg.mla is None else _latent_indexer(cfg)
                ix.to_empty(device="cpu").apply(init_weights)
                for n, t in ix.state_dict().items():
                    _copy_rows(params[f"model.layers.{layer}.self_attn.indexer.{n}"], lambda rows, t=t: t[rows])
        if fresh:
            print(f"[model] {path}: no indexer weights for layer(s) {_ranges(fresh)} in the checkpoint; initialised "
                  "them fresh (train them with the DSA warm-up before using sparse attention)")
        if dropped:
            print(f"[model] {path}: ignored the checkpoint's indexer weights of layer(s) {_ranges(dropped)} "
                  f"({'dense attention' if cfg.dsa is None else 'S layers in pattern ' + cfg.dsa.pattern})")
        return model

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

    def save_pretrained(self, path, max_shard_bytes=5 * 2**30):
        """Write config.json + safetensors (sharded with an index above max_shard_bytes) into a temp
        directory, then rename it into place: a crash never leaves a half-written checkpoint."""
        path = path.rstrip("/")
        tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        try:
            self._write(tmp, max_shard_bytes)
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

    def _write(self, tmp, max_shard_bytes):
        state = {hf_name(n): t.detach().to("cpu").contiguous() for n, t in self.state_dict().items()}
        if self.cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        if self.cfg.moe is not None:
            state = _experts_to_files(state, self.cfg)
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
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, os.path.join(tmp, fname), metadata={"format": "pt"})
                weight_map.update({n: fname for n in shard})
            total = sum(t.numel() * t.element_size() for t in state.values())
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        config = self.cfg.to_hf()
        config["dtype"] = str(next(self.parameters()).dtype).removeprefix("torch.")
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)


def _copy_rows(dst, read):
    """Fill dst (a tensor, or an FSDP2 DTensor sharded along dim 0) with read(rows), the source's rows
    [start, stop) that this rank holds: FSDP2 splits dim 0 as torch.chunk does, ceil(n / ranks) rows each.
    dst an ExpertPart (one expert's matrix of the MoE families' [E, ...] tensors): that expert, if held here."""
    if isinstance(dst, ExpertPart):
        dst.copy_(read)
        return
    if not hasattr(dst, "to_local"):
        dst.copy_(read(slice(None)))
        return
    local, n = dst.to_local(), dst.shape[0]
    ranks, rank = dst.device_mesh.size(), dst.device_mesh.get_local_rank()
    start = min(n, rank * -(-n // ranks))
    if local.numel():  # (a rank can hold no rows of a short tensor)
        local.copy_(read(slice(start, start + local.shape[0])))


def hf_name(name: str) -> str:
    """Our parameter names are transformers' without the `model.` prefix of the decoder."""
    return name if name.startswith("lm_head.") else "model." + name


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


def _safetensors_files(path) -> dict[str, list[str]]:
    """{file: [tensor names]} from model.safetensors.index.json, or every *.safetensors file."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = {}
        for name, fname in weight_map.items():
            files.setdefault(os.path.join(path, fname), []).append(name)
        return files
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    out = {}
    for fname in files:
        with safe_open(os.path.join(path, fname), framework="pt") as f:
            out[os.path.join(path, fname)] = list(f.keys())
    return out


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
    elif isinstance(m, (Router, Experts)):  # (the MoE families' own tensors, at the end of this file)
        for p in m.parameters(recurse=False):
            nn.init.normal_(p, std=0.02)
        for b in m.buffers(recurse=False):
            nn.init.zeros_(b)


# ============================================================================= MLA + MoE: GLM-4.7-Flash and GLM-5
#
# Everything above is the dense GLM-4 decoder; what follows is only read for the two Mixture-of-Experts families,
# transformers' `glm4_moe_lite` (Glm4MoeLiteForCausalLM, GLM-4.7-Flash) and `glm_moe_dsa` (GlmMoeDsaForCausalLM,
# GLM-5), numerically the same models. Their block is
#
#     x += attn(input_norm(x));  x += mlp(post_attention_norm(x))          (no sandwich norms)
#
# with Multi-head Latent Attention (MLA, DeepSeek-V2) and, after the first dense layers, an MoE MLP:
#   - MLA: queries through a low-rank bottleneck (q_a_proj -> RMSNorm -> q_b_proj), keys and values from one
#     shared latent per token: c = RMSNorm(kv_a_proj(x)[:kv_lora_rank]) and a rotated key part k_rope =
#     RoPE(kv_a_proj(x)[kv_lora_rank:]) shared by every head. kv_b_proj expands c into each head's no-rope
#     key part and its value. A cache holds only [c, k_rope] (kv_lora_rank + qk_rope_head_dim values per token
#     per layer): 576 for GLM-4.7-Flash, where expanded keys and values would take 20 heads x 512.
#     Head h scores q_h = [q_nope_h, RoPE(q_rope_h)] against k_h = [k_nope_h, k_rope] with scale
#     (qk_nope_head_dim + qk_rope_head_dim)^-0.5; RoPE is interleaved, over all of qk_rope_head_dim.
#   - MoE: a sigmoid router in fp32 picks num_experts_per_tok of n_routed_experts experts per token (by score
#     + e_score_correction_bias, within the best topk_group of n_group groups), weighs them by their un-biased
#     scores (normalised if norm_topk_prob, times routed_scaling_factor), and adds the shared experts' SwiGLU.
#     kernels/moe.py computes the routed experts grouped by expert.
#   - GLM-5's DSA indexer reads the query latent: its query is wq_b(q_a_layernorm(q_a_proj(x))), its key
#     LayerNorm(wk(x)), its head weights weights_proj(x); `indexer_types` full / shared is DSA's IndexCache
#     pattern F / S. Selection, sparse attention and the indexer losses are dsa.py's, as for GLM-4 + DSA.
#
# Routing replay (RL): the generator records which experts each token took (`Routing.record`), the learner's
# forward replays them (`Routing.replay`), so that a tiny numeric difference between the two cannot send a
# token to other experts, which would make the importance ratio of that token meaningless.

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
    if cfg.model_type not in LATENT_TYPES:
        raise ValueError(f"model_type must be glm4, {' or '.join(LATENT_TYPES)}; got {cfg.model_type!r}")
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


def _latent_from_hf(cls, d: dict, rope: dict) -> GLMConfig:
    kind, L = d.get("model_type"), d["num_hidden_layers"]
    if kind not in LATENT_TYPES:
        raise ValueError(f"config.json: model_type {kind!r} is not supported (glm4, {', '.join(LATENT_TYPES)})")
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
        mla=MLAConfig(**{k: d[k] for k in MLAConfig.__dataclass_fields__ if k in d}),
        moe=MoEConfig(**{k: d[k] for k in MoEConfig.__dataclass_fields__ if k in d and k != "mlp_layer_types"},
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
    }
    if cfg.model_type == "glm_moe_dsa":
        kinds = cfg.dsa.layer_kinds(cfg.num_layers)
        d.update(index_topk=cfg.dsa.topk, index_n_heads=cfg.dsa.heads, index_head_dim=cfg.dsa.head_dim,
                 indexer_types=["full" if c == "F" else "shared" for c in kinds])
    elif cfg.dsa is not None:
        d["dsa"] = asdict(cfg.dsa)  # grafted on GLM-4.7-Flash: ours (transformers ignores it)
    return d


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


def _routing_start(cfg: GLMConfig, routing: Routing | None, B: int, T: int) -> Routing | None:
    """Check routing against the forward's input and give it one slot per MoE layer."""
    if routing is None:
        return None
    if cfg.moe is None:
        raise ValueError("routing: this model has no MoE layers")
    n, k = len(cfg.moe_layers), cfg.moe.num_experts_per_tok
    if routing.replay is not None and tuple(routing.replay.shape) != (n, B, T, k):
        raise ValueError(f"routing.replay has shape {tuple(routing.replay.shape)}, expected {(n, B, T, k)} "
                         "(MoE layers, the input's rows and tokens, experts per token)")
    if routing.record:
        routing.chosen = [None] * n
    if routing.replay is not None:
        routing.agree = [None] * n
    return routing


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
        key that reads r + dr values instead of H (nope + dr + v) (576 against 20 x 704 for GLM-4.7-Flash)."""
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


# ----------------------------------------------------------------------------- MoE MLP

class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the MoE families' dense-layer MLP and shared experts (transformers' names
    gate_proj / up_proj / down_proj; GLM-4's MLP above fuses gate and up)."""

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

    def forward(self, x, idx, w):
        """x [N, hidden], idx [N, k] expert ids, w [N, k] their weights -> [N, hidden] (kernels/moe.py; an fp8
        generator swaps this module for fp8.FP8Experts)."""
        return moe_kernels.experts_forward(x, idx, w, self.gate_up_proj, self.down_proj)


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
            same = (ids.sort(-1).values == r.long().sort(-1).values).all(-1)
            agree = torch.stack([(same & replayed).sum(), replayed.sum()])
            ids = torch.where(replayed[:, None], r.long(), ids) if apply else ids
        out = self.experts(flat, ids, self.gate.weigh(scores, ids))
        return (out + self.shared_experts(flat)).view(B, T, H), ids.view(B, T, ids.shape[-1]), agree

    def routed(self, x, routing: Routing | None, keep, T, cache=None):
        """forward() with the forward's Routing: x [B, T | K, hidden] (K rows: the last block's kept
        positions `keep` of T) takes its replayed ids, and leaves its choice and agreement there. In the engine's
        forwards (cache: a PagedKVCache with `routes`) the choice is also written beside each token's KV, at its
        slot: routing replay's record of the generator, which a CUDA graph's replay writes as well."""
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
        """As Block.forward, with the forward's Routing (or None)."""
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


def _load_buffers(model: "GLM", path, device):
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
