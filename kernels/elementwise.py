"""
Two of a layer's small elementwise steps in one Triton kernel each, for forwards without autograd on a GPU (the
generator's decode steps and prefills). model.py is the specification of both.

    rms_norm(x [..., N], weight [N], eps) -> [..., N] in x's dtype    model.RMSNorm.forward
    rope(x [B, T, (H,) D], cos, sin [B, T, D]) -> x's shape and dtype   model.apply_rope, bit for bit

Why: in PyTorch an RMSNorm is eight launches (x to fp32, square, mean, + eps, rsqrt, multiply, back to x's dtype,
the weight) and a rotary embedding four (the pairs swapped, two products, a sum), each a pass over its input. A
decoder layer has two to four norms and two to four rotations (queries and keys; the DSA indexer's too), so at
decode's few rows, where every launch costs a few microseconds whatever its size, a layer spent some forty launches
on them, and at a prefill's thousands of rows as many passes over the activations. Here one program reads a row once
and writes it once.

Numerics:
  - rms_norm: the mean of squares and the scale in fp32, the normalised row rounded to x's dtype, then the weight
    (rounded to x's dtype) times it, the product rounded once: model.RMSNorm's steps (a product of two bf16 values is
    exact in fp32, so rounding it is PyTorch's bf16 multiply). The sum of squares runs in another order than
    torch.mean's, so a value may land one rounding step of x's dtype away: the engine's model takes it
    (graphs.fuse_norms), the learner keeps model.RMSNorm.
  - rope: x * cos and swap(x) * sin each rounded to x's dtype, then their sum computed in fp32 and rounded, as
    PyTorch's three ops do (no fused multiply-add: fp fusion is off), so the same bits as apply_rope on every GPU.
    apply_rope itself calls it wherever x needs no gradient and the kernels can run.
On a CPU, or with model.dsa_kernels off, nothing here runs (tests/test_elementwise.py runs both in Triton's
interpreter, whose fp32 -> bf16 conversion does not round to nearest: bf16 is checked within a rounding step there,
bit for bit on a GPU).
"""
from __future__ import annotations  # the kernels' annotations stay strings: this file imports without triton

import functools

import torch

from kernels import dsa_triton

tl = None  # triton.language, set when the kernels first compile (dsa_triton imports triton on first use)


def _rms_norm_kernel(X, W, Y, N, sx, sy, eps, BN: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BN)
    ok = offs < N
    x = tl.load(X + row * sx + offs, mask=ok, other=0.0).to(tl.float32)
    scale = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
    h = (x * scale).to(Y.dtype.element_ty).to(tl.float32)  # rounded to x's dtype, as model.RMSNorm's h.to(x.dtype)
    w = tl.load(W + offs, mask=ok, other=0.0).to(Y.dtype.element_ty).to(tl.float32)  # the weight in x's dtype
    tl.store(Y + row * sy + offs, (w * h).to(Y.dtype.element_ty), mask=ok)


def _rope_kernel(X, C, S, Y, D, H, sx, sc, ss, sy, BD: tl.constexpr):
    # One row of D values (one head of one token) per program; its token's cos and sin rows are row // H's
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BD)
    ok = offs < D
    dt = Y.dtype.element_ty
    x = tl.load(X + row * sx + offs, mask=ok, other=0.0).to(tl.float32)
    pair = tl.load(X + row * sx + (offs ^ 1), mask=ok, other=0.0).to(tl.float32)  # swap(x): (x1, x0, x3, x2, ...)
    c = tl.load(C + (row // H) * sc + offs, mask=ok, other=0.0).to(dt).to(tl.float32)
    s = tl.load(S + (row // H) * ss + offs, mask=ok, other=0.0).to(dt).to(tl.float32)
    y = (x * c).to(dt).to(tl.float32) + (pair * s).to(dt).to(tl.float32)
    tl.store(Y + row * sy + offs, y.to(dt), mask=ok)


@functools.lru_cache(maxsize=None)
def _compiled(interpret: bool):
    global tl
    assert interpret == dsa_triton._interpret() and dsa_triton._import_triton()
    tl = dsa_triton.tl  # the kernels' global `tl`, resolved when they compile
    return {"rms_norm": dsa_triton.triton.jit(_rms_norm_kernel), "rope": dsa_triton.triton.jit(_rope_kernel)}


def _kernel(name):
    if not dsa_triton._import_triton():
        raise RuntimeError("kernels.elementwise needs triton; use model.py's PyTorch path")
    return _compiled(dsa_triton._interpret())[name]


def _rows(x, n):
    """x [..., n] as rows [R, n] with unit stride along n (a view where one exists)."""
    rows = x.reshape(-1, n)
    return rows if rows.stride(-1) == 1 or rows.shape[0] == 0 else rows.contiguous()


def rms_norm(x, weight, eps):
    """model.RMSNorm.forward in one kernel: x [..., N] (any float dtype, rows in any strides), weight [N] -> [..., N]
    in x's dtype. Needs dsa_triton.available(x); no autograd."""
    N = x.shape[-1]
    rows = _rows(x, N)
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        with dsa_triton._on(x):
            _kernel("rms_norm")[(rows.shape[0],)](rows, weight, y, N, rows.stride(0), y.stride(0), float(eps),
                                                  BN=dsa_triton._p2(N), num_warps=4 if N <= 4096 else 8)
    return y.view(x.shape)


def rope(x, cos, sin):
    """model.apply_rope in one kernel, the same bits: x [B, T, H, D] or [B, T, D] (rows in any strides), cos and sin
    [B, T, D] (model.rope_cos_sin's tables, in any float dtype: taken in x's) -> x's shape, contiguous. Needs
    dsa_triton.available(x); no autograd."""
    D = x.shape[-1]
    H = x.shape[2] if x.dim() == 4 else 1
    cos, sin = (t.expand(*x.shape[:2], D) for t in (cos, sin))  # (broadcast over B or T, as apply_rope's products)
    rows, c, s = _rows(x, D), _rows(cos, D), _rows(sin, D)
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        with dsa_triton._on(x):
            _kernel("rope")[(rows.shape[0],)](rows, c, s, y, D, H, rows.stride(0), c.stride(0), s.stride(0), y.stride(0),
                                              BD=dsa_triton._p2(D, 2), num_warps=1 if D <= 128 else 4,
                                              **({} if dsa_triton._interpret() else {"enable_fp_fusion": False}))
    return y.view(x.shape)
