"""
The generator's RMSNorm in one Triton kernel (model.RMSNorm is the specification).

    rms_norm(x [..., N], weight [N], eps) -> [..., N] in x's dtype, no autograd

model.RMSNorm is seven kernels in PyTorch (x to fp32, square, mean, + eps, rsqrt, multiply, back to x's dtype) and
an eighth for the weight, each a pass over [tokens, N]. A decoder layer has two to four of them (GLM-4's four, MLA's
query and key latents' two more), so at decode's few rows a layer spends some thirty launches on norms, and at a
prefill's thousands of rows as many passes over the activations. Here one program normalises one row: it reads
the row once, and writes it once.

Numerics as model.RMSNorm's: the mean of squares and the scale in fp32, the normalised row rounded to x's dtype, then
the weight (rounded to x's dtype) times it, that product rounded once (a product of two bf16 values is exact in fp32,
so rounding it is PyTorch's bf16 multiply). The sum of squares runs in another order than torch.mean's, so a value
may land one rounding step of x's dtype away (tests/test_rmsnorm.py bounds it against float64).

TorchEngine's model runs it (graphs.fuse_norms: without autograd, its numerics its own; the learner, which recomputes
every logprob, keeps model.RMSNorm). On a CPU, or with model.dsa_kernels off, nothing changes.
"""
from __future__ import annotations  # the kernel's annotations stay strings: this file imports without triton

import functools

import torch

from kernels import dsa_triton

tl = None  # triton.language, set when the kernel first compiles (dsa_triton imports triton on first use)


def _rms_norm_kernel(X, W, Y, N, sx, sy, eps, BN: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BN)
    ok = offs < N
    x = tl.load(X + row * sx + offs, mask=ok, other=0.0).to(tl.float32)
    scale = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
    h = (x * scale).to(Y.dtype.element_ty).to(tl.float32)  # rounded to x's dtype, as model.RMSNorm's h.to(x.dtype)
    w = tl.load(W + offs, mask=ok, other=0.0).to(Y.dtype.element_ty).to(tl.float32)  # the weight in x's dtype
    tl.store(Y + row * sy + offs, (w * h).to(Y.dtype.element_ty), mask=ok)


@functools.lru_cache(maxsize=None)
def _compiled(interpret: bool):
    global tl
    assert interpret == dsa_triton._interpret() and dsa_triton._import_triton()
    tl = dsa_triton.tl  # the kernel's global `tl`, resolved when it compiles
    return dsa_triton.triton.jit(_rms_norm_kernel)


def rms_norm(x, weight, eps):
    """model.RMSNorm.forward in one kernel: x [..., N] (any float dtype; rows may be strided, the last dim
    contiguous), weight [N] -> [..., N] in x's dtype. Needs dsa_triton.available(x); no autograd."""
    if not dsa_triton._import_triton():
        raise RuntimeError("kernels.rmsnorm needs triton; use model.RMSNorm")
    N = x.shape[-1]
    rows = x.reshape(-1, N)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        with dsa_triton._on(x):
            _compiled(dsa_triton._interpret())[(rows.shape[0],)](
                rows, weight, y, N, rows.stride(0), y.stride(0), float(eps), BN=dsa_triton._p2(N),
                num_warps=4 if N <= 4096 else 8)
    return y.view(x.shape)
