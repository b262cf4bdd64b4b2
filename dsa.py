"""
DeepSeek Sparse Attention (DSA) for the GLM decoder in model.py.

Dense causal attention costs O(T^2) per layer. DSA puts a small "lightning indexer" in front of it:
for every query t the indexer scores all past tokens s cheaply,

    I(t, s) = sum_j  w[t, j] * ReLU(q[t, j] . k[s]) / sqrt(d_I)          j over H_I indexer heads

and the real attention then looks only at the top-k tokens by that score. The indexer is still
O(T^2) but with a handful of small heads and no softmax; the expensive part (H heads of dimension D
with values) becomes O(T * k). Pieces, in the order the model uses them:

  - `DSAConfig`: topk, indexer heads/dim/rope dims, and the IndexCache layer pattern ("FSSS").
  - `Indexer`: the projections (query per head, one LayerNorm'd key per token, per-head weights).
  - `index_scores`, `select_topk`: fp32 scores and deterministic `torch.topk` under the attention mask.
  - `sparse_attention`: softmax attention over the gathered top-k keys; all heads share the set.
    Keys are gathered by `index_gather`, whose backward sums in a fixed order: autograd's own (float
    atomics on a multi-threaded CPU) made two runs with the same seed train different weights.
  - `dense_indexer_kl`, `sparse_indexer_kl`: the two losses that train the indexer when a dense
    checkpoint is converted to DSA (dense warm-up, then sparse stage). The indexer sees detached
    inputs, and its target is detached, so it learns only from its KL and the model only from the LM loss.

IndexCache: layers marked `S` in the pattern own no indexer and reuse the indices chosen by the
nearest preceding `F` layer, which removes most of the indexer's cost.

Precision. The learner runs under bf16 autocast and the generator in bf16 weights, and both must pick
the same keys: a score rounded to bf16 (8 bits of mantissa) ties or flips against its neighbours, and
one flipped key changes a token's logits far more than bf16 rounding does. So indexer scores, top-k,
the indexer KL and sparse attention's logits and softmax are computed in fp32 whatever the autocast
state (`fp32_scope`), and the small indexer parameters (`weights_proj`, `k_norm`) stay fp32 in every
copy of the model (`FP32_PARAMS`), as DeepSeek-V3.2's reference keeps them. The indexer's q and k are
rounded to the compute dtype before scoring, on both sides: that is how the generator's cache holds k.

Kernels. On CUDA, scoring (in select_topk) and sparse attention (training, its backward, and decode)
run the Triton kernels of kernels/dsa_triton.py, which compute exactly what the functions here compute
without materialising gathered keys or per-head scores; `USE_TRITON = False` (config `model.dsa_kernels:
false`) keeps this file's plain-PyTorch path, which is also the CPU path and the tests' reference. So a
research edit here (a new score, another selection) reaches a GPU run only with model.dsa_kernels: false,
or once the kernel does the same: tests/test_dsa_triton.py holds the two to each other.

Masks are passed as objects with a `.dense(q0, q1) -> bool [B|1, q1-q0, Tk]` method (model.AttnMask),
so nothing here materialises a [T, T] matrix for more than one chunk of queries at a time.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from kernels import dsa_triton

# Work is split into query chunks so that no intermediate exceeds ~2^24 elements (64 MiB in fp32);
# sparse attention's gathered keys get blocks of 2^22 elements on CPU (cache-sized), GATHER_GPU_FACTOR x that on GPU.
CHUNK_ELEMENTS = 1 << 24
GATHER_ELEMENTS = 1 << 22
GATHER_GPU_FACTOR = 16
# Parameter names (suffixes) kept in fp32 in every copy of the model: the learner's bf16 FSDP gather and
# the generator's bf16 weights leave them alone (model.py, machinery/parallel.py and engine.py).
FP32_PARAMS = ("indexer.weights_proj.weight", "indexer.k_norm.weight", "indexer.k_norm.bias")
USE_TRITON = True  # the Triton kernels (kernels/dsa_triton.py) wherever dsa_triton.available() (CUDA tensors)


def _triton(t):
    return USE_TRITON and dsa_triton.available(t)


def fp32_scope(t):
    """Autocast off on t's device: what runs inside computes in the dtypes it is given (fp32 here)."""
    return torch.autocast(t.device.type, enabled=False)


@dataclass
class DSAConfig:
    topk: int = 2048  # keys each query attends to
    heads: int = 32  # indexer heads H_I
    head_dim: int = 128  # indexer dimension d_I
    rope_dim: int = 64  # the first rope_dim dims of indexer q/k get (interleaved) RoPE
    pattern: str = "F"  # per-layer F (own indexer) / S (reuse previous F's indices), repeated

    def __post_init__(self):
        for key in ("topk", "heads", "head_dim"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"dsa.{key} must be a positive integer, got {getattr(self, key)!r}")
        if not (0 <= self.rope_dim <= self.head_dim and self.rope_dim % 2 == 0):
            raise ValueError(f"dsa.rope_dim must be even and <= dsa.head_dim, got {self.rope_dim}")
        if not self.pattern or set(self.pattern) - {"F", "S"} or self.pattern[0] != "F":
            raise ValueError(f"dsa.pattern must be a string of F/S starting with F, got {self.pattern!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "DSAConfig":
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown dsa key(s) {sorted(unknown)}; valid: {sorted(cls.__dataclass_fields__)}")
        return cls(**d)

    def layer_kinds(self, num_layers: int) -> str:
        """The pattern repeated to the model's depth, e.g. "FSSS" -> "FSSSFSSS..."."""
        return (self.pattern * num_layers)[:num_layers]


class Indexer(nn.Module):
    """The lightning indexer's projections. Parameter names follow GLM-5's checkpoints
    (wk, k_norm, weights_proj); the query projection is `wq` since GLM-4 has no query LoRA."""

    def __init__(self, hidden_size: int, cfg: DSAConfig):
        super().__init__()
        self.cfg = cfg
        self.wq = nn.Linear(hidden_size, cfg.heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, cfg.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(cfg.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden_size, cfg.heads, bias=False)

    def forward(self, x):
        """x [B, T, hidden] -> q [B, T, H_I, d_I], k [B, T, d_I] in the compute dtype (bf16 under autocast
        or with bf16 weights), w [B, T, H_I] fp32; q and k before RoPE."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.cfg.heads, self.cfg.head_dim)
        k = self.wk(x)
        with fp32_scope(x):  # LayerNorm and the head weights in fp32, from fp32 parameters
            n = self.k_norm
            k = F.layer_norm(k.float(), n.normalized_shape, n.weight.float(), n.bias.float(), n.eps).to(q.dtype)
            w = F.linear(x.float(), self.weights_proj.weight.float()) * self.cfg.heads**-0.5
        return q, k, w


def index_scores(q, w, k):
    """I(t, s) for a chunk of queries. q [B, c, H_I, d], w [B, c, H_I], k [B, Tk, d] -> [B, c, Tk] fp32,
    computed in fp32 from the inputs as given (under autocast too)."""
    with fp32_scope(q):
        s = torch.einsum("bchd,bsd->bchs", q.float(), k.float()).relu()  # [B, c, H_I, Tk]
        return torch.einsum("bchs,bch->bcs", s, w.float()) * q.shape[-1] ** -0.5


def _tie_broken(scores):
    """fp32 scores [..., Tk] -> int64 keys with the same order and no ties: the float's bits made
    monotonic as a signed int in the high 32 bits, "earlier key wins" in the low 32 bits."""
    assert scores.dtype == torch.float32, f"top-k runs on fp32 scores, got {scores.dtype}"
    bits = (scores + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long()
    slot = torch.arange(scores.shape[-1], device=scores.device)
    return (ordered << 32) | (scores.shape[-1] - 1 - slot)


@torch.no_grad()
def select_topk(q, w, k, mask, topk):
    """Top-k keys per query under the mask. Returns idx [B, Tq, K] (int64) and valid [B, Tq, K]
    (False where a query has fewer than K visible keys: early tokens, padding). K = min(topk, Tk).

    The choice must not depend on how the work was shaped: the generator scores one query against its
    cache, the learner all queries at once, and both must pick the same set. Exact ties are common
    (ReLU makes I(t, s) exactly 0 whenever every head's dot product is negative) and torch.topk's order
    among ties depends on the row's length, so torch.topk runs on tie-free keys (earlier key first)."""
    B, Tq = q.shape[:2]
    Tk = k.shape[1]
    K = min(topk, Tk)
    idx = torch.empty(B, Tq, K, dtype=torch.long, device=q.device)
    valid = torch.empty(B, Tq, K, dtype=torch.bool, device=q.device)
    kernel = _triton(q)
    c = max(1, CHUNK_ELEMENTS // max(1, B * (1 if kernel else q.shape[2]) * Tk))  # the kernel keeps [.., H_I, ..] on chip
    for q0 in range(0, Tq, c):
        q1 = min(Tq, q0 + c)
        kmax = mask.k_len - Tq + q1  # queries hold the last Tq slots: keys after the chunk's last are never visible
        if kernel:
            s = dsa_triton.index_scores(q[:, q0:q1], w[:, q0:q1], k[:, :kmax], q_slot=mask.q_slot[q0:q1])
        else:
            s = index_scores(q[:, q0:q1], w[:, q0:q1], k[:, :kmax])
        s = s.masked_fill_(~mask.dense(q0, q1)[..., :kmax], float("-inf"))
        chosen = _tie_broken(s).topk(min(K, kmax), dim=-1).indices
        idx[:, q0:q1], valid[:, q0:q1] = 0, False
        idx[:, q0:q1, :chosen.shape[-1]] = chosen
        valid[:, q0:q1, :chosen.shape[-1]] = s.gather(-1, chosen) > float("-inf")
    return idx, valid


class _IndexGather(torch.autograd.Function):
    """x[index] (advanced indexing on x's leading dims) with a backward that is the same every run.

    Autograd's own backward of x[index] is index_put_(accumulate=True), which on a CPU running more than
    one thread adds float32 rows with atomics, in whatever order the threads get there. A key that many
    queries select (every query of a sequence picks that sequence's first keys) thus gets its gradient
    summed in a different order each run, and two runs with the same seed drift apart. Here the CPU sums
    with index_add_, which adds each row's contributions in a fixed order. On CUDA index_put_ stays: its
    accumulate sorts the indices first and is deterministic (PyTorch lists only the CPU one as not)."""

    @staticmethod
    def forward(ctx, x, *index):
        ctx.save_for_backward(*index)
        ctx.shape = x.shape
        return _gather_rows(x, index)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        index, shape = ctx.saved_tensors, ctx.shape
        n = len(index)
        if grad.is_cuda:
            return grad.new_zeros(shape).index_put_(index, grad, accumulate=True), *[None] * n
        N, W = math.prod(shape[:n]), math.prod(shape[n:])
        rows = _rows(index, shape)
        # bf16 (or fp16) gradients are summed in fp32, as the Triton kernel's dK, dV are, and rounded once
        acc = torch.zeros(N, W, dtype=torch.promote_types(grad.dtype, torch.float32), device=grad.device)
        acc.index_add_(0, rows, grad.reshape(-1, W).to(acc.dtype))
        return acc.view(shape).to(grad.dtype), *[None] * n


def _rows(index, shape):
    """x as a table of rows [N, W] (N: its first len(index) dims, W: the rest): which row each element of the
    indices' broadcast shape I reads, flattened -> [prod(I)]."""
    rows = 0
    for i, size in zip(index, shape[:len(index)]):
        rows = rows * size + i
    return torch.broadcast_to(rows, torch.broadcast_shapes(*(i.shape for i in index))).reshape(-1)


def _gather_rows(x, index):
    """x[index] as one index_select over x's rows (the same copy; on a CPU several times faster than
    advanced indexing with several index tensors)."""
    n = len(index)
    I = torch.broadcast_shapes(*(i.shape for i in index))
    return x.contiguous().view(-1, *x.shape[n:]).index_select(0, _rows(index, x.shape)).view(*I, *x.shape[n:])


def index_gather(x, *index):
    """x[index] for long index tensors over x's leading dims (broadcast together), e.g. x[b, idx].
    The same values as plain indexing; differentiable in x with a run-to-run deterministic backward."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _IndexGather.apply(x, *index)
    return _gather_rows(x, index)


def _gather(x, idx):
    """x [B, Tk, ...], idx [B, c, K] -> [B, c, K, ...]."""
    b = torch.arange(x.shape[0], device=x.device)[:, None, None]
    return index_gather(x, b, idx)


class _RowMatmul(torch.autograd.Function):
    """a [..., 1, n] @ b [..., n, m]: one row per batch entry (MLA's heads, each with its own key head: no GQA
    group to share a gathered key). Autograd's backward computes b's gradient a^T @ grad as a batched matmul
    whose inner dimension is 1, tens of thousands of tiny products, slow on a CPU; it is the outer product
    a^T * grad, elementwise: one multiplication an entry, so the same bits, several times faster."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        if b.stride(-2) == 1 and b.stride(-1) != 1:  # b a transposed view (keys^T): its gradient laid out as keys
            return grad @ b.transpose(-1, -2), (grad.transpose(-1, -2) * a).transpose(-1, -2)
        return grad @ b.transpose(-1, -2), a.transpose(-1, -2) * grad


def _matmul(a, b):
    """a @ b; through _RowMatmul on a CPU where a holds one row per batch entry and autograd records it."""
    if a.shape[-2] == 1 and a.device.type == "cpu" and torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return _RowMatmul.apply(a, b)
    return a @ b


def _sparse_chunk(q, kh, vh, idx, valid, scale):
    B, c, H, D = q.shape
    Hkv = kh.shape[1]
    b = torch.arange(B, device=q.device)[:, None, None, None]
    n = torch.arange(Hkv, device=q.device)[None, :, None, None]
    # [B, Hkv, c, K, D], ready for batched matmul; index_gather, not kh[b, n, idx], so that backward's
    # sum over the queries that picked a key runs in a fixed order
    ks, vs = index_gather(kh, b, n, idx[:, None]), index_gather(vh, b, n, idx[:, None])
    qg = q.view(B, c, Hkv, H // Hkv, D).transpose(1, 2)  # [B, Hkv, c, G, D]: GQA groups under their KV head
    with fp32_scope(q):  # logits, softmax and the weighted sum in fp32, as a fused kernel keeps them
        att = _matmul(qg.float(), ks.float().transpose(-1, -2)) * scale  # [B, Hkv, c, G, K]
        att = att.masked_fill(~valid[:, None, :, None, :], float("-inf")).softmax(-1)
        out = _matmul(att, vs.float()).to(q.dtype).transpose(1, 2).reshape(B, c, H, D)
    return out, att.detach().mean((1, 3))  # probs summed over heads, L1-normalised: [B, c, K]


def sparse_attention(q, k, v, idx, valid, scale, return_probs=False):
    """Attention over the selected keys only. q [B, Tq, H, D]; k, v [B, Tk, Hkv, D]; idx, valid
    [B, Tq, K] -> out [B, Tq, H, D] (and, if asked, the head-averaged probabilities [B, Tq, K]).

    Each query gathers its own K keys, so this is bound by memory traffic, not FLOPs: queries go in
    chunks small enough for the gathered [c, K, Hkv, D] block to stay in cache on a CPU (bigger on a
    GPU, where launches cost more). Under autograd each chunk is recomputed in backward, so gathered
    keys never pile up for the whole sequence. On CUDA the Triton kernel does all of this on chip."""
    if _triton(q):
        return dsa_triton.sparse_attention(q, k, v, idx, valid, scale, return_probs)
    B, Tq, H, D = q.shape
    K = idx.shape[-1]
    kh, vh = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, Tk, D]
    c = max(1, GATHER_ELEMENTS * (GATHER_GPU_FACTOR if q.is_cuda else 1) // max(1, B * K * k.shape[2] * D))
    outs, probs = [], []
    for q0 in range(0, Tq, c):
        args = (q[:, q0 : q0 + c], kh, vh, idx[:, q0 : q0 + c], valid[:, q0 : q0 + c], scale)
        if torch.is_grad_enabled() and Tq > c:
            out, p = checkpoint(_sparse_chunk, *args, use_reentrant=False)
        else:
            out, p = _sparse_chunk(*args)
        outs.append(out)
        probs.append(p)
    out = torch.cat(outs, 1)
    return (out, torch.cat(probs, 1)) if return_probs else out


def _kl(p, logits):
    """sum_s p log(p / softmax(logits)) per row; p [.., S] sums to 1, masked logits are -inf."""
    logq = logits.log_softmax(-1)
    return torch.where(p > 0, p * (p.clamp_min(1e-30).log() - logq), torch.zeros_like(p)).sum(-1)


def _dense_kl_chunk(iq, iw, ik, q, k, allowed, q_valid, scale):
    with torch.no_grad(), fp32_scope(q):  # target: main attention probabilities (fp32), averaged over heads
        B, c, H, D = q.shape
        qg = q.view(B, c, k.shape[2], H // k.shape[2], D)
        att = torch.einsum("bcngd,bsnd->bcngs", qg.float(), k.float()) * scale
        p = att.masked_fill(~allowed[:, :, None, None, :], float("-inf")).softmax(-1).mean((2, 3))
    s = index_scores(iq, iw, ik).masked_fill(~allowed, float("-inf"))
    with fp32_scope(q):
        return (_kl(p, s) * q_valid).sum()


def dense_indexer_kl(iq, iw, ik, q, k, mask, scale):
    """Dense warm-up loss: mean over queries of KL(p_t || softmax(I_t)) over all visible keys, where
    p_t is the main attention summed over heads and L1-normalised. Indexer tensors (iq [B,T,H_I,d],
    iw [B,T,H_I], ik [B,Tk,d]) carry gradients; q [B,T,H,D] and k [B,Tk,Hkv,D] are only a target."""
    B, Tq = iq.shape[:2]
    Tk = ik.shape[1]
    c = max(1, CHUNK_ELEMENTS // max(1, B * Tk * max(iq.shape[2], q.shape[2])))
    q_valid = mask.q_valid().float()  # [B, Tq]: padding queries do not count
    total = iq.new_zeros((), dtype=torch.float32)
    for q0 in range(0, Tq, c):
        q1 = min(Tq, q0 + c)
        args = (iq[:, q0:q1], iw[:, q0:q1], ik, q[:, q0:q1].detach(), k.detach(), mask.dense(q0, q1),
                q_valid[:, q0:q1], scale)
        total = total + (checkpoint(_dense_kl_chunk, *args, use_reentrant=False) if Tq > c else _dense_kl_chunk(*args))
    return total / q_valid.sum().clamp_min(1)


def sparse_indexer_kl(iq, iw, ik, idx, valid, p, q_valid):
    """Sparse-stage loss: the same KL restricted to each query's selected set. p [B, T, K] is the main
    attention over the selected keys (head-averaged, detached) returned by sparse_attention."""
    ks = _gather(ik, idx)  # [B, T, K, d]
    with fp32_scope(iq):
        s = torch.einsum("bthd,btkd->bthk", iq.float(), ks.float()).relu()
        s = torch.einsum("bthk,bth->btk", s, iw.float()) * iq.shape[-1] ** -0.5
        kl = _kl(p.float(), s.masked_fill(~valid, float("-inf")))  # [B, T]
        return (kl * q_valid).sum() / q_valid.sum().clamp_min(1)
