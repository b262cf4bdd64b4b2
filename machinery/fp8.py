"""
Block-wise FP8 weights for the generator: the decoder's linear layers held in 8 bits while the learner trains
in bf16/fp32 (issue "FP8 rollouts with bf16 training"). The format is DeepSeek-V3's, the one of checkpoints
with `quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size: [128, 128]}` (SGLang and slime
read and write it):

    weight            float8_e4m3fn [N, K]              q = e4m3(clamp(w / scale_inv, -448, 448))
    weight_scale_inv  fp32 [ceil(N/128), ceil(K/128)]   per 128 x 128 block: max(amax(|w|), 1e-4) / 448

so that w ~= q * scale_inv, block by block. e4m3 has 4 exponent and 3 mantissa bits and no infinities: +-448
at most, 8 steps per power of two, so rounding costs up to 2^-4 of a value (half a step; about 3% RMS) down
to 2^-6 (q's subnormals below that: values under amax/28672 of their block lose relative precision). The
block's largest value maps to +-448. Blocks are ceil-divided: a ragged edge (512 x 96, 300 x 96) is a smaller
block, padded with zeros only while its amax is taken. The amax is clamped to AMAX_MIN = 1e-4 (as DeepGEMM's
and SGLang's block casts do): an all-zero block then gets a finite scale and exact zero codes, where 0 / 0
would give NaN; a block whose amax is below 1e-4 is quantized against 1e-4 (fewer of the 448 levels used).
Values are clamped to +-448 before the cast, so a quotient rounded just above 448 saturates (a CUDA cast of
an out-of-range value may give NaN; e4m3fn has no infinity).

What is quantized (`is_quantized`): `layers.<i>.self_attn.{q,k,v,o}_proj.weight` and
`layers.<i>.mlp.{gate_up,down}_proj.weight`; in the MoE families (model.py's MLA + MoE) also MLA's
`q_a_proj`, `q_b_proj`, `kv_a_proj_with_mqa` and `o_proj`, the SwiGLU `mlp.{gate,up,down}_proj` of the dense
layers and `mlp.shared_experts.{gate,up,down}_proj`, and the routed experts' stacked `mlp.experts.gate_up_proj`
[E, 2I, H] and `mlp.experts.down_proj` [E, H, I]: each expert's matrix block-wise on its own, codes [E, N, K] and
`..._scale_inv` [E, ceil(N/128), ceil(K/128)] (`FP8Experts`). Not quantized: the embeddings, norms, lm_head,
biases, the whole DSA indexer (`...self_attn.indexer.*`): an fp8 indexer would change which keys the generator
picks (dsa.py's precision notes); the MoE router (`mlp.gate`, fp32 for the same reason: model.FP32_PARAMS); and
MLA's `kv_b_proj`, which the absorbed decode (mla_moe.LatentAttention.paged_decode) reads as a matrix, its key half
folded into the query and its value half applied after attention, not through a linear of activations (it is
under 1% of GLM-4.7-Flash's weights). They stay as the rest of the generator (bf16, model.FP32_PARAMS in fp32).

The matmul, y = x W^T + b (`fp8_linear`): activations are quantized at run time per token and group of 128
along K (`quantize_activations`: fp32 scale = max(amax, 1e-4) / 448 per 1 x 128 group), multiplied with the
weight's codes, and each 128-wide K block's partial sum is scaled by (activation scale x weight scale) and
added into an fp32 accumulator; the output is in x's dtype, bias added in fp32 before that rounding:

    y[m, n] = b[n] + sum_kb  xs[m, kb] * ws[n // 128, kb] * sum_{k in block kb}  xq[m, k] * wq[n, k]

(Hopper's fp8 tensor cores accumulate a block's products with ~14 bits of precision; scaling and adding each
block's partial sum into fp32, as DeepSeek-V3 does every 128 elements, keeps that error to one block's.)
Three implementations, one result:
  - `reference_linear` (CPU, and the fallback anywhere): both operands dequantized to fp32 (codes x scales),
    one fp32 matmul. The scales are constant within a block, so this is the block-scaled sum above
    exactly in real arithmetic; in fp32 only the rounding differs. It is the other paths' reference.
  - `scaled_mm_linear` (CUDA): torch.nn.functional.scaled_mm with ScalingType.BlockWise1x128 (activations)
    and BlockWise128x128 (weights): cuBLASLt >= 12.9 on sm_90 (Hopper) only. Activations are quantized
    first, by the Triton kernels' quantization (`triton_quantize`; PyTorch's `quantize_activations` where
    Triton does not run). Used where K and N are multiples of 128, unless the tile table (TUNED_TILES) names
    the shape: there a GPU sweep measured the Triton kernel faster.
  - `triton_linear` (CUDA otherwise; on CPU tensors under TRITON_INTERPRET=1, which is how the tests run
    it): Triton kernels that quantize the activations (the same arithmetic as quantize_activations, correctly
    rounded divisions; on chip in the GEMM, or in a launch before it) and run the block-scaled GEMM above, in
    one of three variants per shape ("Triton" below).
`fp8_linear` dispatches: on a CUDA device the first call checks scaled_mm and the Triton kernel on a small
problem against the CPU reference (once per device; it syncs, so it must not be the first call inside a CUDA
graph capture: the engine's eager prefills and warm-ups come first) and uses what runs and agrees; on a CPU,
reference_linear (the Triton kernel when TRITON_INTERPRET=1). None of them is differentiable: generator only.

In the model (`quantize_model_`): every quantized nn.Linear becomes an `FP8Linear` whose `weight` (fp8) and
`weight_scale_inv` (fp32) are nn.Parameters with requires_grad=False (so `model.named_parameters()`, which
the engine copies published weights into by name, lists them: "<layer>.weight" and "<layer>.weight_scale_inv",
DeepSeek's names), and every mla_moe.Experts an `FP8Experts` ("<experts>.gate_up_proj" and
"<experts>.gate_up_proj_scale_inv", the same for down_proj), which computes kernels/moe.experts_forward with
fp8 matmuls: where the Triton kernel runs, one grouped launch per projection for every expert
(`triton_grouped_linear`: its row tiles worked out on the device, so decode graphs capture it), else one
fp8_linear per expert and projection. Quantize after any cast: `model.to(dtype)` / `GLM.cast_` treat fp8
as a float dtype and would convert the codes without their scales (fp8_linear then refuses the weight). `quantized_weights` turns
the publisher's (name, tensor) stream into the same stream with each quantized weight replaced by its codes
and scales, one tensor at a time; `weight_bytes` is what a generator's weights take with fp8 (memory.py).

Published FP8 checkpoints (`Published`, this file's last section): config.json's `quantization_config` {quant_method:
fp8, fmt: e4m3, activation_scheme: dynamic, weight_block_size: [128, 128]} (DeepSeek-V3's, zai-org/GLM-5-FP8's) says
each quantized linear is in the files as `X.weight` e4m3 [N, K] and `X.weight_scale_inv` fp32 [ceil(N/128),
ceil(K/128)]: the format above. Its scale is our scale_inv, the multiplier (w = q * scale_inv block by block, despite
the name), on the same grid: 128 x 128 blocks from (0, 0) of the file's tensor, a ragged edge a smaller block (GLM-5's
kv_a_proj_with_mqa: 576 = 4 x 128 + 64 rows). model.load_pretrained reads such a weight dequantized (`dequantize`:
q * scale_inv in fp32, the exact product rounded once, then cast to the model's dtype): a learner's fp32 masters are
the published values exactly, and it saves them so (no fp8, no quantization_config). A published block is one of
ours when the tensor we quantize is the file's tensor, or stacks file tensors each starting on a 128-row boundary of
ours and spanning whole blocks (or ending at its last row): every linear of _QUANTIZED, and the routed experts'
gate_up_proj when moe_intermediate_size is a multiple of 128 (GLM-4.7-Flash's 1536, GLM-5's 2048; else the gate's
last block and the up's first are one block of ours). There an fp8 generator (`quantize_model_(model,
published=the directory)`) keeps the published codes and scales as they are: it computes with the very weights its
learner starts from, whatever rule made them (our rule, run on a block whose amax is not its 448 code or whose
scale is a power of two, as some checkpoints' are, would cut another). A tensor published in fp8 that we hold
otherwise is dequantized, and stays so (kv_b_proj, the indexer's wq_b and wk, the MTP layers: our rule leaves them
bf16) or is quantized again by our rule (experts whose blocks straddle gate and up). In GLM-5-FP8, as its public
loaders read it (SGLang-JAX's, ATOM's, TensorRT-LLM's), every linear of the decoder and MTP layers is fp8: MLA's five
projections, the dense MLPs, the shared and routed experts, the indexer's wq_b and wk; the embeddings, lm_head,
norms, routers (mlp.gate), the MTP's eh_proj and the indexer's weights_proj and k_norm are not (its
modules_to_not_convert lists "model.embed_tokens", "lm_head" and per layer "self_attn.indexers_proj").
"""
from __future__ import annotations  # kernel annotations stay strings: this file imports without triton

import contextlib
import functools
import json
import os
import re
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open

from kernels import dsa_triton
from kernels import moe as moe_kernels
from dsa import fp32_scope
from families.mla_moe import Experts
from model import GLM, QUANTIZED, _safetensors_files, family, hf_name

BLOCK = 128  # weight blocks are BLOCK x BLOCK, activation groups 1 x BLOCK
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
AMAX_MIN = 1e-4  # a block's amax is clamped to this: an all-zero block quantizes to zeros, not 0/0 = NaN
FP8 = torch.float8_e4m3fn

# The decoder's linear weights, by our parameter name (an HF name's "model." prefix is accepted too): GLM-4's
# attention and MLP; MLA's projections but kv_b_proj (the module docstring says why); the MoE families' SwiGLU (dense
# layers, shared experts); and the routed experts' stacked [E, N, K] tensors (no ".weight": parameters of
# mla_moe.Experts). Never the indexer's, the router's (mlp.gate.weight) or a bias.
_LINEARS = (r"self_attn\.([qkvo]_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa)|mlp\.(gate_up|down|gate|up)_proj"
            r"|mlp\.shared_experts\.(gate|up|down)_proj")
_QUANTIZED = re.compile(rf"(model\.)?layers\.\d+\.(({_LINEARS})\.weight|mlp\.experts\.(gate_up|down)_proj)")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def is_quantized(name: str) -> bool:
    """Whether a parameter (our name, e.g. "layers.3.mlp.down_proj.weight", "layers.3.mlp.experts.down_proj") is
    held in fp8 by the generator. The indexer's projections ("layers.0.self_attn.indexer.wq.weight"), the MoE
    router, MLA's kv_b_proj, biases, norms, embeddings and lm_head are not."""
    return _QUANTIZED.fullmatch(name) is not None


# ----------------------------------------------------------------------------------------------- the format

def _exactly(number, like):
    """number as a 0-d tensor on like's device: the divisor of a scale. A CUDA tensor divided by a Python number
    (a CPU scalar) is multiplied by the number's fp32 reciprocal instead (PyTorch's division kernel), one bit off
    the correctly rounded quotient for some amax; a scale one ulp off rounds the values that sit at a rounding
    boundary between two e4m3 codes the other way, so a GPU quantized differently from the CPU and from the
    Triton kernel (whose division is correctly rounded). Divided by a device tensor, every path quantizes alike.
    (torch.full: a fill on the device, no host copy, so a CUDA graph capture may include it.)"""
    return torch.full((), number, dtype=torch.float32, device=like.device)


def quantize(w):
    """w [N, K] (any float dtype, any device, meta too) -> (q float8_e4m3fn [N, K], scale_inv fp32 [Nb, Kb]),
    Nb = ceil(N / 128), Kb = ceil(K / 128), with w ~= q * scale_inv per 128 x 128 block.
    Temporary memory: one fp32 copy of w (padded to whole blocks) besides the fp8 result.
    w [E, N, K] (stacked experts): each w[e] on its own -> (q [E, N, K], scale_inv [E, Nb, Kb]), one expert at a
    time (an fp32 copy of one expert's matrix, not of all E)."""
    if w.dim() == 3:
        E, N, K = w.shape
        q = torch.empty(E, N, K, dtype=FP8, device=w.device)
        s = torch.empty(E, _cdiv(N, BLOCK), _cdiv(K, BLOCK), dtype=torch.float32, device=w.device)
        for e in range(E):
            q[e], s[e] = quantize(w[e])
        return q, s
    N, K = w.shape
    Nb, Kb = _cdiv(N, BLOCK), _cdiv(K, BLOCK)
    wf = w.detach().to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # divided in place below
    if (N, K) != (Nb * BLOCK, Kb * BLOCK):
        wf = F.pad(wf, (0, Kb * BLOCK - K, 0, Nb * BLOCK - N))  # zeros: they do not change a block's amax
    blocks = wf.view(Nb, BLOCK, Kb, BLOCK)  # block (i, j) is blocks[i, :, j, :]
    amax = torch.maximum(blocks.amax(dim=(1, 3)), -blocks.amin(dim=(1, 3)))  # [Nb, Kb], no |w| temporary
    scale_inv = amax.clamp_min(AMAX_MIN) / _exactly(E4M3_MAX, amax)  # [Nb, Kb] fp32
    q = blocks.div_(scale_inv[:, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8)  # saturate, then round
    return q.view(Nb * BLOCK, Kb * BLOCK)[:N, :K].contiguous(), scale_inv


def dequantize(q, scale_inv, dtype=torch.float32):
    """(q fp8 [..., N, K], scale_inv fp32 [..., Nb, Kb]) -> q * scale_inv per block, [..., N, K] in dtype (the
    product in fp32). Leading dims: stacked experts."""
    *lead, N, K = q.shape
    Nb, Kb = scale_inv.shape[-2:]
    qf = F.pad(q.float(), (0, Kb * BLOCK - K, 0, Nb * BLOCK - N)).view(*lead, Nb, BLOCK, Kb, BLOCK)
    out = qf * scale_inv[..., :, None, :, None].float()
    return out.view(*lead, Nb * BLOCK, Kb * BLOCK)[..., :N, :K].to(dtype)


def quantize_activations(x):
    """x [..., K] -> (xq float8_e4m3fn [..., K], scale fp32 [..., ceil(K / 128)]): each row's groups of 128
    along K quantized on their own (x ~= xq * scale, per group), the same arithmetic as `quantize`."""
    *lead, K = x.shape
    Kb = _cdiv(K, BLOCK)
    xf = x.detach().to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # (x may be a strided view)
    if K != Kb * BLOCK:
        xf = F.pad(xf, (0, Kb * BLOCK - K))
    groups = xf.view(*lead, Kb, BLOCK)
    scale = torch.maximum(groups.amax(-1), -groups.amin(-1)).clamp_min(AMAX_MIN) / _exactly(E4M3_MAX, xf)  # [..., Kb]
    xq = groups.div_(scale[..., None]).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8)
    return xq.view(*lead, Kb * BLOCK)[..., :K].contiguous(), scale


def _dequantize_activations(xq, scale):
    """(xq [..., K], scale [..., Kb]) -> xq * scale per group, fp32 [..., K]."""
    *lead, K = xq.shape
    Kb = scale.shape[-1]
    groups = F.pad(xq.float(), (0, Kb * BLOCK - K)).view(*lead, Kb, BLOCK)
    return (groups * scale[..., None]).view(*lead, Kb * BLOCK)[..., :K]


# ----------------------------------------------------------------------------------------------- the matmul

def fp8_linear(x, weight, weight_scale_inv, bias=None):
    """x [..., K] (bf16 on the engine, or fp32) times the fp8 weight [N, K] with its block scales [Nb, Kb],
    plus bias [N] -> [..., N] in x.dtype. The dispatching matmul: see the module docstring."""
    if weight.dtype != FP8:
        raise TypeError(f"fp8_linear: weight is {weight.dtype}, expected {FP8} (a cast of the model after "
                        "quantize_model_ converts its fp8 weights: quantize last)")
    N, K = weight.shape
    paths = _working_paths(x.device)
    tuned = tuned_tiles("dense", x.numel() // max(K, 1), N, K, x.device)  # measured faster than scaled_mm, or None
    if "scaled_mm" in paths and K % BLOCK == 0 and N % BLOCK == 0 and (tuned is None or "triton" not in paths):
        return scaled_mm_linear(x, weight, weight_scale_inv, bias)
    if "triton" in paths:
        return triton_linear(x, weight, weight_scale_inv, bias, tiles=tuned)
    return reference_linear(x, weight, weight_scale_inv, bias)


def reference_linear(x, weight, weight_scale_inv, bias=None):
    """The specification: activations quantized per 1 x 128 group, both operands dequantized to fp32, one
    fp32 matmul (mathematically the block-scaled sum), bias in fp32, the result in x.dtype. Memory: an fp32
    copy of the whole weight (fine on a CPU; as the CUDA fallback, slow and large)."""
    xd = _dequantize_activations(*quantize_activations(x))  # [..., K] fp32
    with fp32_scope(x):  # no autocast: fp32 in, fp32 out
        y = F.linear(xd, dequantize(weight, weight_scale_inv), None if bias is None else bias.float())
    return y.to(x.dtype)


def scaled_mm_linear(x, weight, weight_scale_inv, bias=None):
    """torch.nn.functional.scaled_mm with 1 x 128 activation and 128 x 128 weight scales (cuBLASLt, sm_90):
    K and N multiples of 16 (fp8_linear sends only multiples of 128). Layouts as PyTorch's block path
    checks them: activation scales outer-dim-major [M, Kb] (strides 1, M: M is padded to a multiple of 4
    for cuBLAS's 16-byte alignment), weight scales [round_up(Kb, 4), Nb] with strides (1, round_up(Kb, 4)). The
    activations are quantized by triton_quantize where Triton runs (else quantize_activations: a padded copy, an fp32
    copy and some ten launches: in the fifth GPU run's profile of Flash's fp8 generate, its amax, amin, div_ and
    clamp_ alone took 86 us a call against the matmul's 44)."""
    *lead, K = x.shape
    N = weight.shape[0]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    M4 = M + -M % 4
    if dsa_triton.available(x):  # one launch: the same codes and scales, written in the layout cuBLAS reads
        xq, xs = triton_quantize(x2, M4, torch.empty(_cdiv(K, BLOCK), M4, device=x.device).t())  # [M4, K], [M4, Kb]
    else:
        xq, xs = quantize_activations(F.pad(x2, (0, 0, 0, M4 - M)))  # [M4, K] fp8, [M4, Kb]
        xs = xs.t().contiguous().t()  # [M4, Kb], strides (1, M4)
    ws = F.pad(weight_scale_inv, (0, -weight_scale_inv.shape[1] % 4)).t()  # [Kb4, Nb], strides (1, Kb4)
    fused_bias = bias is not None and x.dtype != torch.float32  # cuBLAS adds a bias only to 16-bit outputs
    y = F.scaled_mm(xq, weight.t(), xs, F.ScalingType.BlockWise1x128, ws, F.ScalingType.BlockWise128x128,
                    bias=bias.to(x.dtype) if fused_bias else None, output_dtype=x.dtype)[:M]
    if bias is not None and not fused_bias:
        y = y + bias.float()
    return y.view(*lead, N)


def _has_scaled_mm() -> bool:
    st = getattr(F, "ScalingType", None)
    return hasattr(F, "scaled_mm") and hasattr(st, "BlockWise1x128") and hasattr(st, "BlockWise128x128")


# ----------------------------------------------------------------------------------------------- Triton
# The GEMM: one program per (BM rows of x, BN output columns). Each step takes one 128-wide K block: the activations'
# codes of its [BM, 128] tile and each row's group scale, the weight's fp8 tile [BN, 128] and each column's block
# scale, and adds tl.dot(codes, w^T) (fp32) * x scale * w scale into an fp32 accumulator. The weight's 128 x 128 blocks
# need no alignment with BN: each column reads its own block's scale. Ragged M, N and K are masked loads (zeros). The
# bias is added in fp32, then one rounding to Y's dtype. Three variants of one computation (MODES; the tile table picks
# one per shape with its tiles):
#   - "fused": the program quantizes x's [BM, 128] tile on chip from x in its own dtype. One launch, but each of the
#     N / BN column tiles quantizes the same rows again (a divide per element each time).
#   - "pre": `_quant_kernel` quantizes x once ([M, K] codes, [M, Kb] scales), then the GEMM reads codes: half x's
#     bytes, no divides in its loop. Two launches (DeepSeek-V3's and SGLang's block-fp8 layout).
#   - "swap": "pre" with the product transposed, acc^T [BN, BM] += tl.dot(w, codes^T): at decode, BM is 16 rows, too
#     few for Hopper's wgmma (64-row operand A); with the weight as A, its BN (64 or 128) columns fill it.
# Quantizing (`_quantize_rows`, both paths): scale = max(amax, AMAX_MIN) / QMAX per row of the tile, q =
# e4m3(clamp(x / scale)), divisions correctly rounded, as quantize_activations in PyTorch: the variants' codes are
# the same bits, and so are their products up to the order of tl.dot's sums.

triton = tl = None  # imported on first use (dsa_triton's rule: importing this file needs no triton)
_quantize_rows = None  # _quantize_rows_fn jitted, by _compiled
MODES = ("fused", "pre", "swap")


def _quantize_rows_fn(x, AMAX_MIN: tl.constexpr, QMAX: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """x fp32 [R, BK] -> (codes float8e4nv [R, BK], scales fp32 [R]): each row one activation group."""
    xs = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), AMAX_MIN), QMAX)  # [R]
    v = tl.clamp(tl.math.div_rn(x, xs[:, None]), -QMAX, QMAX)
    if ROUND_FIRST:  # the interpreter: its fp32 -> e4m3 cast misrounds (124.3 -> 64), so round on the e4m3 grid
        e = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # exponent (subnormals: -6)
        step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e-3): e4m3's spacing at v
        magic = step * 12582912.0  # 1.5 * 2^23 * step: v + magic rounds v to a multiple of step, ties to even
        v = (v + magic) - magic  # now exact in e4m3: the cast below only converts
    return v.to(tl.float8e4nv, fp_downcast_rounding="rtne"), xs


def _quant_kernel(X, XQ, XS, M, MQ, K, sxm, sxk, sqm, sqk, ssm, ssk, BM: tl.constexpr, BK: tl.constexpr,
                  AMAX_MIN: tl.constexpr, QMAX: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """One program per (BM rows, one K group): x [M, K] -> codes XQ [MQ, K] and scales XS [MQ, Kb]; rows M..MQ
    (scaled_mm's padding) quantize zeros. "pre"'s first launch, and scaled_mm_linear's quantization."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_k = tl.program_id(1) * BK + tl.arange(0, BK)
    kmask = (offs_k < K)[None, :]
    x = tl.load(X + offs_m[:, None] * sxm + offs_k[None, :] * sxk, mask=(offs_m < M)[:, None] & kmask,
                other=0.0).to(tl.float32)
    xq, xs = _quantize_rows(x, AMAX_MIN, QMAX, ROUND_FIRST)
    tl.store(XQ + offs_m[:, None] * sqm + offs_k[None, :] * sqk, xq, mask=(offs_m < MQ)[:, None] & kmask)
    tl.store(XS + offs_m * ssm + tl.program_id(1) * ssk, xs, mask=offs_m < MQ)


def _gemm_kernel(X, XS, W, WS, BIAS, Y, TILES, M, N, K, sxm, sxk, ssm, ssk, swe, swn, swk, swse, swsn, swsk, sym, syn,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr,
                 AMAX_MIN: tl.constexpr, QMAX: tl.constexpr, ROUND_FIRST: tl.constexpr, GROUPED: tl.constexpr,
                 PRE: tl.constexpr, SWAP: tl.constexpr):
    if GROUPED:  # this program's row tile, from the table [3, T]: its expert, first row, and the expert's row end
        t = tl.program_id(0)
        e = tl.load(TILES + t).to(tl.int64)
        m0 = tl.load(TILES + tl.num_programs(0) + t)
        m1 = tl.load(TILES + 2 * tl.num_programs(0) + t)  # <= m0 for a tile past the last expert's: nothing to do
        W += e * swe
        WS += e * swse
        k_end = tl.where(m0 < m1, K, 0)  # an empty tile runs no step (and stores nothing: no row is in it)
    else:
        m0 = tl.program_id(0) * BM
        m1 = M
        k_end = K
    offs_m = m0 + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mmask = offs_m < m1
    nmask = offs_n < N
    if SWAP:
        acc = tl.zeros([BN, BM], tl.float32)
    else:
        acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, k_end, BK):
        offs_k = k0 + tl.arange(0, BK)
        kmask = offs_k < K
        x = tl.load(X + offs_m[:, None] * sxm + offs_k[None, :] * sxk, mask=mmask[:, None] & kmask[None, :],
                    other=0.0)  # [BM, BK]: codes (PRE), else x in its dtype
        if PRE:
            xq = x
            xs = tl.load(XS + offs_m * ssm + (k0 // BK) * ssk, mask=mmask, other=0.0)  # [BM]
        else:
            xq, xs = _quantize_rows(x.to(tl.float32), AMAX_MIN, QMAX, ROUND_FIRST)
        w = tl.load(W + offs_n[:, None] * swn + offs_k[None, :] * swk, mask=nmask[:, None] & kmask[None, :],
                    other=0.0)  # [BN, BK] fp8
        ws = tl.load(WS + (offs_n // BK) * swsn + (k0 // BK) * swsk, mask=nmask, other=0.0)  # [BN]
        if SWAP:
            acc += tl.dot(w, tl.trans(xq)) * ws[:, None] * xs[None, :]  # [BN, BM]
        else:
            acc += tl.dot(xq, tl.trans(w)) * xs[:, None] * ws[None, :]  # [BM, BN]
    if SWAP:
        acc = tl.trans(acc)
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m[:, None] * sym + offs_n[None, :] * syn, acc.to(Y.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


@functools.lru_cache(maxsize=None)
def _compiled(interpret: bool):
    # triton.jit decides between compiled and interpreted kernels when it decorates: one per mode (as dsa_triton)
    global triton, tl, _quantize_rows
    import triton as triton_
    import triton.language as tl_
    triton, tl = triton_, tl_  # the kernels' global `tl`, resolved when they compile
    _quantize_rows = triton.jit(_quantize_rows_fn)  # their helper, jitted in the same mode (one mode per process)
    return triton.jit(_gemm_kernel), triton.jit(_quant_kernel)


def _tiles(M: int) -> tuple[int, int, int, int, str]:
    """(BM, BN, num_warps, num_stages, mode) for M rows, the rule a key TUNED_TILES does not name falls back to (not
    tuned): tl.dot needs BM >= 16; a decode step (M small) takes narrower column tiles, so that more programs share the
    weight's bytes; "fused" quantization (the first kernel's, which the table's oldest entries were measured against)."""
    BM = min(128, max(16, 1 << (M - 1).bit_length()))
    return BM, 64 if M <= 64 else 128, 4 if BM <= 64 else 8, 3, "fused"


# The launch shapes (BM, BN, num_warps, num_stages, mode) that bench/fp8_tiles.py times on a GPU, and tests/test_fp8.py
# runs in the interpreter against the float64 reference: one list for both, so that the sweep can only pick a tested
# shape. BK is always BLOCK (a step is one quantization group). _tiles' four choices are among them (the sweep's
# baseline). BM >= 16 (tl.dot); BN from 32 (decode: more programs over a narrow weight, e.g. GLM-Z1-9B's k_proj,
# N = 256) to 256 (prefill: fewer re-reads of x); 8 warps for the wide tiles, whose fp32 accumulator [BM, BN] lives in
# registers. "swap" takes BN of 64 and up (wgmma's operand A: 64 rows a warpgroup).
TILE_CANDIDATES = (
    *((*t, "fused") for t in ((16, 32, 4, 3), (16, 64, 4, 3), (16, 64, 4, 4), (16, 128, 4, 3),
                              (32, 64, 4, 3), (32, 128, 4, 3), (32, 128, 4, 4),
                              (64, 64, 4, 3), (64, 128, 4, 3), (64, 128, 8, 3), (64, 256, 8, 3),
                              (128, 64, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3))),
    *((*t, "pre") for t in ((16, 32, 4, 3), (16, 64, 4, 3), (16, 128, 4, 3), (32, 128, 4, 3),
                            (64, 128, 4, 3), (64, 256, 8, 3), (128, 128, 8, 3), (128, 256, 8, 3))),
    *((*t, "swap") for t in ((16, 64, 4, 3), (16, 128, 4, 3), (16, 128, 4, 4), (32, 128, 4, 3),
                             (64, 128, 4, 3), (16, 256, 8, 3))),
)

# The tile table: the fastest of TILE_CANDIDATES per key, as bench/fp8_tiles.py measured them on a GPU (static data:
# no autotuning at run time, so a run's bits never depend on a timing race). {architecture: {(kind, rows, N, K): (BM,
# BN, num_warps, num_stages, mode)}}: architecture "sm_90" for a GPU of compute capability 9.0 (its tiles are measured
# there and may not fit another's registers), "cpu" for the interpreter (tests only); kind "dense" (triton_linear: N, K
# of the weight) or "grouped" (triton_grouped_linear: N, K of one expert's matrix); rows the row bucket, the power of
# two at or above the rows (grouped: above an expert's average share of them, ceil(M / E)). A key not named here takes
# _tiles' rule. `python bench/fp8_tiles.py --write` rewrites the lines between the two markers (by hand: keep that
# form). The sm_90 entries below were measured before "pre" and "swap" existed: among "fused" shapes only.
TUNED_TILES: dict[str, dict[tuple[str, int, int, int], tuple[int, int, int, int, str]]] = {
    # tiles: begin
    "sm_90": {  # NVIDIA H200, torch 2.11.0+cu130, triton 3.6.0: bench/fp8_tiles.py
        ("dense", 64, 576, 2048): (16, 32, 4, 3, "fused"),
        ("dense", 64, 768, 2048): (16, 32, 4, 3, "fused"),
        ("dense", 64, 1536, 2048): (16, 32, 4, 3, "fused"),
        ("dense", 64, 2048, 1536): (16, 64, 4, 3, "fused"),
        ("dense", 64, 5120, 768): (16, 64, 4, 3, "fused"),
        ("dense", 64, 10240, 2048): (16, 128, 4, 3, "fused"),
        ("dense", 256, 576, 2048): (16, 64, 4, 3, "fused"),
        ("dense", 256, 768, 2048): (16, 64, 4, 3, "fused"),
        ("dense", 256, 1536, 2048): (16, 64, 4, 3, "fused"),
        ("dense", 256, 2048, 1536): (16, 128, 4, 3, "fused"),
        ("dense", 256, 5120, 768): (64, 256, 8, 3, "fused"),
        ("dense", 2048, 576, 2048): (64, 256, 8, 3, "fused"),
        ("dense", 2048, 768, 2048): (64, 256, 8, 3, "fused"),
        ("dense", 2048, 2048, 1536): (64, 256, 8, 3, "fused"),
        ("grouped", 4, 2048, 1536): (16, 128, 4, 3, "fused"),
        ("grouped", 4, 3072, 2048): (16, 128, 4, 3, "fused"),
        ("grouped", 16, 2048, 1536): (16, 128, 4, 3, "fused"),
        ("grouped", 16, 3072, 2048): (16, 128, 4, 3, "fused"),
        ("grouped", 128, 2048, 1536): (16, 128, 4, 3, "fused"),
        ("grouped", 128, 3072, 2048): (16, 128, 4, 3, "fused"),
    },
    # tiles: end
}


def _row_bucket(rows: int) -> int:
    """The power of two at or above rows (1 -> 1, 5 -> 8, 64 -> 64, 65 -> 128): the tile table's row key."""
    return 1 << max(rows - 1, 0).bit_length()


@functools.lru_cache(maxsize=None)
@functools.lru_cache(maxsize=None)  # (a launch asks: the decode loop's hot path)
def _arch(device: torch.device) -> str:
    """The tile table's architecture key of a device: "sm_90" (compute capability 9.0), or the device type ("cpu")."""
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def tuned_tiles(kind: str, rows: int, N: int, K: int, device) -> tuple[int, int, int, int, str] | None:
    """TUNED_TILES' entry for (kind, the bucket of rows, N, K) on device's architecture, or None. kind "dense" (rows:
    x's) or "grouped" (rows: an expert's average share)."""
    return TUNED_TILES.get(_arch(torch.device(device)), {}).get((kind, _row_bucket(rows), N, K))


def tiles_for(kind: str, rows: int, N: int, K: int, device) -> tuple[int, int, int, int, str]:
    """(BM, BN, num_warps, num_stages, mode) of a launch: tuned_tiles', else _tiles(rows)."""
    return tuned_tiles(kind, rows, N, K, device) or _tiles(rows)


def triton_linear(x, weight, weight_scale_inv, bias=None, tiles=None):
    """The Triton kernels above: x [..., K] (any float dtype), weight fp8 [N, K], scales [Nb, Kb] -> [..., N]
    in x.dtype. CUDA tensors, or CPU tensors under TRITON_INTERPRET=1. tiles: (BM, BN, num_warps, num_stages, mode), by
    default tiles_for's (the tile table's, else _tiles'); bench/fp8_tiles.py passes each candidate."""
    *lead, K = x.shape
    N = weight.shape[0]
    x2 = x.reshape(-1, K)
    tiles = tiles or tiles_for("dense", x2.shape[0], N, K, x.device)
    return _gemm(x2, weight, weight_scale_inv, bias, None, tiles, _cdiv(x2.shape[0], tiles[0])).view(*lead, N)


def _gemm(x, weight, weight_scale_inv, bias, table, tiles, row_tiles):
    """Launch the GEMM on x [M, K] (strided rows are fine) -> y [M, N] in x.dtype, over row_tiles x ceil(N / BN)
    programs: one matrix (weight [N, K], table None) or stacked experts (weight [E, N, K], table: _tile_table's).
    "pre" and "swap" quantize x first (_quant_kernel, rows in tiles of 16), then read its codes."""
    if not dsa_triton.available(x):
        raise RuntimeError("fp8's Triton kernels need triton and a CUDA tensor (or TRITON_INTERPRET=1 on CPU)")
    interpret = dsa_triton._interpret()
    gemm, quant = _compiled(interpret)
    (M, K), N = x.shape, weight.shape[-2]
    BM, BN, warps, stages, mode = tiles
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    rounding = dict(AMAX_MIN=AMAX_MIN, QMAX=E4M3_MAX, ROUND_FIRST=interpret)
    sw, sws = weight.stride(), weight_scale_inv.stride()
    if table is None:  # one matrix: no expert stride
        sw, sws = (0, *sw), (0, *sws)
    xs = y  # (an unread pointer for "fused")
    if mode != "fused":
        x, xs = triton_quantize(x)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # launch on x's GPU
        gemm[(row_tiles, _cdiv(N, BN))](
            x, xs, weight, weight_scale_inv, bias if bias is not None else y, y, table if table is not None else y,
            M, N, K, *x.stride(), *xs.stride(), *sw, *sws, *y.stride(), BM=BM, BN=BN, BK=BLOCK,
            HAS_BIAS=bias is not None, GROUPED=table is not None, PRE=mode != "fused", SWAP=mode == "swap",
            num_warps=warps, num_stages=stages, **rounding)
    return y


def triton_quantize(x, rows=None, scales=None):
    """quantize_activations' codes and scales by _quant_kernel (one launch, no fp32 copy of x): x [M, K] (strided rows
    are fine) -> (codes fp8 [rows, K], scales fp32 [rows, Kb]); rows (default M) past M quantize zeros (scaled_mm's
    padding). scales: a [rows, Kb] fp32 tensor to write into, any strides (scaled_mm's are column-major)."""
    (M, K), rows = x.shape, rows or x.shape[0]
    xq = torch.empty(rows, K, dtype=FP8, device=x.device)
    xs = torch.empty(rows, _cdiv(K, BLOCK), dtype=torch.float32, device=x.device) if scales is None else scales
    if xq.numel():
        interpret = dsa_triton._interpret()
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            _compiled(interpret)[1][(_cdiv(rows, 16), _cdiv(K, BLOCK))](
                x, xq, xs, M, rows, K, *x.stride(), *xq.stride(), *xs.stride(), BM=16, BK=BLOCK, AMAX_MIN=AMAX_MIN,
                QMAX=E4M3_MAX, ROUND_FIRST=interpret)
    return xq, xs


def _tile_table(ends, BM: int, T: int):
    """The grouped kernel's row tiles, computed on the device (no host read, so a CUDA graph can capture it):
    ends [E] (int, cumulative: expert e owns rows ends[e-1]:ends[e]) -> int32 [3, T]: per tile its expert, first
    row, and that expert's row end. Expert e takes ceil(n_e / BM) tiles, so T = ceil(M / BM) + E always suffices;
    tiles past the last expert's get row end 0 (the kernel skips them)."""
    E = ends.shape[0]
    ends = ends.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])  # [E]
    tiles = (ends - starts + BM - 1) // BM  # [E]
    last = tiles.cumsum(0)  # [E]: one past each expert's last tile
    t = torch.arange(T, device=ends.device)
    e = torch.searchsorted(last, t, right=True)  # [T]: E past the end
    ec = e.clamp(max=E - 1)
    m0 = starts[ec] + (t - (last[ec] - tiles[ec])) * BM
    m1 = torch.where(e < E, ends[ec], 0)
    return torch.stack([ec, m0, m1]).to(torch.int32)


def triton_grouped_linear(x, weight, weight_scale_inv, ends, tiles=None):
    """Every expert's fp8 linear in one launch: x [M, K] with rows sorted by expert, weight fp8 [E, N, K], scales
    [E, Nb, Kb], ends [E] the cumulative row counts (rows ends[e-1]:ends[e] times expert e's weight) -> [M, N] in
    x.dtype; each row's result is triton_linear's for that row and its expert's matrix. No host read of ends:
    FP8Experts' forward stays capturable in the engine's CUDA graphs. CUDA, or CPU under TRITON_INTERPRET=1.
    tiles: (BM, BN, num_warps, num_stages, mode), by default tiles_for("grouped", ...)'s for an expert's average rows."""
    (M, K), (E, N, _) = x.shape, weight.shape
    tiles = tiles or tiles_for("grouped", _cdiv(M, E), N, K, x.device)  # an expert's average rows
    T = _cdiv(M, tiles[0]) + E
    return _gemm(x, weight, weight_scale_inv, None, _tile_table(ends, tiles[0], T), tiles, T)


# ----------------------------------------------------------------------------------------------- dispatch

_PATHS: dict[torch.device, tuple[str, ...]] = {}  # device -> the fast paths that passed the check there
# A fast path agrees with the CPU reference when max |y - ref| / max |ref| is below this (bf16 outputs: about 2^-9 of
# the largest; a wrong scale is off by far more). _check_paths' bound, and bench/fp8_tiles.py's for each tile shape
PATH_TOL = 2 ** -6


def _working_paths(device) -> tuple[str, ...]:
    """The fast paths usable on device: on CUDA those of ("scaled_mm", "triton") that run and agree with the
    CPU reference on a small problem (checked at the first call per device); on a CPU ("triton",) under
    TRITON_INTERPRET=1 (the tests), else none (reference_linear)."""
    device = torch.device(device)
    if device.type != "cuda":
        return ("triton",) if dsa_triton.available(torch.empty(0, device=device)) else ()
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _PATHS:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fp8_linear: the first call on a GPU checks its kernels (a sync): run one eager "
                               "forward before capturing CUDA graphs")
        _PATHS[device] = _check_paths(device)
    return _PATHS[device]


def _check_paths(device) -> tuple[str, ...]:
    """Run each fast path once on a small problem with ragged scale shapes (M = 5 rows, Kb = 3 K blocks: not
    multiples of 4) and blocks of very different scales (a mislaid scale layout shows), against the CPU
    reference in bf16; keep those that run and agree within bf16 rounding."""
    g = torch.Generator().manual_seed(0)
    M, N, K = 5, 256, 384
    Nb, Kb = N // BLOCK, K // BLOCK
    w = torch.randn(Nb, BLOCK, Kb, BLOCK, generator=g) * 2.0 ** torch.randint(-6, 6, (Nb, 1, Kb, 1), generator=g)
    x = torch.randn(M, Kb, BLOCK, generator=g) * 2.0 ** torch.randint(-4, 4, (M, Kb, 1), generator=g)
    x, b = x.view(M, K).to(torch.bfloat16), torch.randn(N, generator=g).to(torch.bfloat16)
    q, s = quantize(w.view(N, K))
    ref = reference_linear(x, q, s, b).float()
    found = []
    for name, fn, usable in (("scaled_mm", scaled_mm_linear, _has_scaled_mm()),
                             ("triton", triton_linear, dsa_triton.available(torch.empty(0, device=device)))):
        if not usable:
            continue
        try:
            y = fn(x.to(device), q.to(device), s.to(device), b.to(device)).float().cpu()
        except Exception as e:  # noqa: BLE001 - an unsupported GPU, cuBLAS or triton: the next path
            print(f"[fp8] {name} does not run on {device} ({type(e).__name__}: {str(e)[:200]})")
            continue
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        if err < PATH_TOL:
            found.append(name)
        else:
            print(f"[fp8] {name} disagrees with the reference on {device} (error {err:.2e}): not used")
    if not found:
        print(f"[fp8] no fast fp8 matmul on {device}: dequantizing to fp32 per call (slow)")
    return tuple(found)


# ----------------------------------------------------------------------------------------------- the model

class FP8Linear(nn.Module):
    """nn.Linear's place in the generator: weight fp8 [out, in] and weight_scale_inv fp32 [ceil(out/128),
    ceil(in/128)] as nn.Parameters without gradients (model.named_parameters() lists them), bias (dtype,
    default bf16) or None. forward(x) = fp8_linear(x, weight, weight_scale_inv, bias)."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=torch.bfloat16):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        blocks = (_cdiv(out_features, BLOCK), _cdiv(in_features, BLOCK))
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=FP8, device=device),
                                   requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.ones(blocks, device=device), requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, blocks=None) -> "FP8Linear":
        """linear's weight quantized (or blocks, its published (codes, scales): published_blocks), its bias (the same
        Parameter, dtype and values) kept. A meta linear gives meta tensors of the right shapes and dtypes (to_empty
        allocates them)."""
        with torch.device("meta"):  # the empty shell; its tensors are replaced just below
            m = cls(linear.in_features, linear.out_features, bias=False)
        q, s = blocks if blocks is not None else quantize(linear.weight)
        m.weight = nn.Parameter(q, requires_grad=False)
        m.weight_scale_inv = nn.Parameter(s, requires_grad=False)
        m.bias = linear.bias
        return m

    def forward(self, x):
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.bias)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                "e4m3 in 128 x 128 blocks")


class FP8Experts(nn.Module):
    """mla_moe.Experts' place in the generator: the routed experts' stacked weights, each expert's matrix quantized
    block-wise on its own: gate_up_proj fp8 [E, 2I, H] with gate_up_proj_scale_inv fp32 [E, ceil(2I/128),
    ceil(H/128)], down_proj fp8 [E, H, I] with down_proj_scale_inv [E, ceil(H/128), ceil(I/128)] (nn.Parameters
    without gradients, as FP8Linear's). forward(x, idx, w) is kernels/moe.experts_forward's computation with each
    expert's two projections as fp8_linear calls."""

    def __init__(self, n_experts, hidden_size, intermediate_size, device=None):
        super().__init__()
        E, H, I = n_experts, hidden_size, intermediate_size
        for name, (N, K) in (("gate_up_proj", (2 * I, H)), ("down_proj", (H, I))):
            setattr(self, name, nn.Parameter(torch.zeros(E, N, K, dtype=FP8, device=device), requires_grad=False))
            blocks = (E, _cdiv(N, BLOCK), _cdiv(K, BLOCK))
            setattr(self, name + "_scale_inv", nn.Parameter(torch.ones(blocks, device=device), requires_grad=False))

    @classmethod
    def from_experts(cls, experts, blocks=None) -> "FP8Experts":
        """mla_moe.Experts' weights quantized (quantize, one expert at a time; or blocks {"gate_up_proj" or
        "down_proj": its published (codes, scales) or None}: published_blocks); meta in, meta out."""
        E, H, I = experts.down_proj.shape
        with torch.device("meta"):  # the empty shell; its tensors are replaced just below
            m = cls(E, H, I)
        for name in ("gate_up_proj", "down_proj"):
            given = (blocks or {}).get(name)
            q, s = given if given is not None else quantize(getattr(experts, name))
            setattr(m, name, nn.Parameter(q, requires_grad=False))
            setattr(m, name + "_scale_inv", nn.Parameter(s, requires_grad=False))
        return m

    def forward(self, x, idx, w):
        """x [N, H] (bf16 on the engine), idx [N, k] expert ids, w [N, k] routing weights -> [N, H] in x's dtype:
        out[n] = sum_j w[n, j] * expert_{idx[n, j]}(x[n]), each expert down(silu(gate(x)) * up(x)) in fp8.

        As kernels/moe.experts_forward: the N*k (token, expert) slots sorted by expert (stable), each expert's
        contiguous run of rows through its two fp8 matmuls, back in slot order by the inverse permutation,
        weighted (the product rounded to x's dtype) and summed over k in fp32, rounded once. Where the Triton
        kernel runs (CUDA; CPU under TRITON_INTERPRET=1), each projection is one grouped launch whose row tiles
        are worked out on the device, so the engine's CUDA graphs capture it; elsewhere a loop over the experts
        that have tokens (never over tokens), their row counts read on the host."""
        N, H = x.shape
        k = idx.shape[1]
        order, inverse, ends = moe_kernels.sort_by_expert(idx, self.gate_up_proj.shape[0])  # [N*k], [N*k], [E]
        xs = x[:, None].expand(N, k, H).reshape(N * k, H).index_select(0, order)  # [N*k, H], sorted by expert
        if "triton" in _working_paths(x.device):  # one launch per projection, no host read (graph-capturable)
            gate, up = triton_grouped_linear(xs, self.gate_up_proj, self.gate_up_proj_scale_inv, ends).chunk(2, -1)
            ys = triton_grouped_linear(F.silu(gate) * up, self.down_proj, self.down_proj_scale_inv, ends)  # [N*k, H]
        else:  # a loop over the experts that have rows, their ends read on the host
            outs, start = [], 0
            for e, end in enumerate(ends.tolist()):
                if end > start:
                    h = fp8_linear(xs[start:end], self.gate_up_proj[e], self.gate_up_proj_scale_inv[e])  # [n_e, 2I]
                    gate, up = h.chunk(2, dim=-1)
                    outs.append(fp8_linear(F.silu(gate) * up, self.down_proj[e], self.down_proj_scale_inv[e]))
                start = end
            ys = torch.cat(outs) if outs else x.new_zeros(0, H)  # [N*k, H], sorted
        ys = ys.index_select(0, inverse).view(N, k, H)
        return (ys * w.to(ys.dtype)[..., None]).sum(1)

    def extra_repr(self):
        E, N, K = self.gate_up_proj.shape
        return f"experts={E}, hidden={K}, intermediate={N // 2}, e4m3 in 128 x 128 blocks per expert"


def quantize_model_(model, published=None):
    """In place: every quantized nn.Linear of a model.GLM (is_quantized of "<its name>.weight") becomes an
    FP8Linear holding quantize(its weight), one at a time (a loaded model's peak: its own weights plus one
    linear's fp32 copy while it is quantized), and every mla_moe.Experts (is_quantized of "<its name>.gate_up_proj")
    an FP8Experts. Works on a meta-device model (then empty fp8 tensors). Everything else (embeddings, norms,
    lm_head, biases, the DSA indexer, the MoE routers, kv_b_proj) is left as it is. Returns model.
    Cast first (GLM.cast_): a cast after this converts the fp8 codes.
    published: the directory the model was loaded from. When it is a published FP8 checkpoint (config.json's
    quantization_config: `Published`), each tensor whose published blocks are the ones our rule cuts keeps the
    published codes and scales (published_blocks; the model's weight must be them dequantized, or an error names
    it), and one line says how many did; a directory without a quantization_config changes nothing."""
    return _quantize_modules_(model, Published.at(published) if published is not None else None)


def _quantize_modules_(model, published=None):
    """quantize_model_'s replacements, without its check that the model would compute with them (weight_bytes only
    counts their bytes). published: a Published or None."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and is_quantized(n + ".weight")]
    experts = [n for n, m in model.named_modules() if isinstance(m, Experts) and is_quantized(n + ".gate_up_proj")]
    kept, rest = [], []  # our tensor names: published blocks kept, quantized by our rule

    def blocks(name, param):
        got = published_blocks(published, model.cfg, name, param)
        (kept if got is not None else rest).append(name)
        return got

    for name in names + experts:  # (names, not modules: each replaced module is freed before the next is quantized)
        parent, _, child = name.rpartition(".")
        module = model.get_submodule(name)
        if isinstance(module, Experts):
            new = FP8Experts.from_experts(module, {p: blocks(f"{name}.{p}", getattr(module, p))
                                                   for p in ("gate_up_proj", "down_proj")})
        else:
            new = FP8Linear.from_linear(module, blocks(name + ".weight", module.weight))
        setattr(model.get_submodule(parent), child, new)
    if published is not None:
        some = ", ".join(rest[:3]) + (", ..." if len(rest) > 3 else "")
        print(f"[fp8] {published.path}: {len(kept)} of {len(kept) + len(rest)} quantized tensors keep the checkpoint's "
              "fp8 blocks" + (f"; our rule quantizes the rest (not fp8 in the files, or blocks not ours: {some})" if rest
                              else ""))
    return model


def quantized_weights(named_tensors):
    """(name, tensor) pairs -> the same pairs, each quantized weight replaced by (name, q fp8) and
    (name + "_scale_inv", scale_inv fp32): the names of an FP8Linear's (or FP8Experts') parameters; stacked
    experts [E, N, K] per expert (quantize). Lazy: one input pair is read (and quantized, on its own device) per
    output, as the publisher gathers FSDP shards tensor by tensor."""
    for name, t in named_tensors:
        if is_quantized(name):
            q, s = quantize(t)
            yield name, q
            yield name + "_scale_inv", s
        else:
            yield name, t


def weight_bytes(cfg) -> int:
    """Bytes of a generator's weights with fp8 (model.GLMConfig): quantized linears and experts 1 byte per weight
    plus 4 per 128 x 128 block (per expert), everything else bf16 but model.FP32_PARAMS (fp32), the MoE routers'
    score-correction biases (buffers) included. Counted from the model built on the meta device and cast as the
    generator is (no memory); each tensor quantize_model_ replaces, by the sizes of quantize's results (tested equal
    to a meta model's quantized tensors: quantizing meta tensors takes seconds at 30B)."""
    with torch.device("meta"):
        model = GLM(cfg).cast_(torch.bfloat16)
    total = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if is_quantized(name):  # [N, K] or stacked experts [E, N, K]: 1 byte a weight, a fp32 scale a block
            *experts, N, K = t.shape
            total += (experts[0] if experts else 1) * (N * K + 4 * _cdiv(N, BLOCK) * _cdiv(K, BLOCK))
        else:
            total += t.numel() * t.element_size()
    return total


# ----------------------------------------------------------------------------------------------- published checkpoints
# A block-wise FP8 checkpoint as DeepSeek-V3 and the GLM family publish it (the module docstring's last paragraph):
# what model.load_pretrained reads dequantized, and what quantize_model_(published=) keeps as it is.

E4M3_FILE = "F8_E4M3"  # safetensors' name of float8_e4m3fn in the file headers


@dataclass
class Published:
    """A checkpoint's fp8 weights, every one checked from the file headers alone (`of`): fp8 {"X.weight": (its file,
    the file of "X.weight_scale_inv")}, rows {"X.weight": N}; files: the checkpoint's {file: [tensor names]} without
    the scales (each explained by its weight), as load_pretrained checks the rest against the model."""
    fp8: dict
    rows: dict
    files: dict
    path: str

    @classmethod
    def of(cls, qc, files: dict, path) -> "Published":
        """config.json's quantization_config qc and the checkpoint's {file: [names]} -> Published, or a one-line error
        naming the key, or the file and tensor: another format; a weight_scale_inv whose weight is missing or not fp8,
        of another dtype than fp32 or another shape than one per 128 x 128 block; an fp8 tensor that is not an e4m3
        linear weight with its scales, or that modules_to_not_convert lists (a module named so, or a prefix or a
        suffix of its dotted name, as transformers matches them)."""
        where = f"{os.path.join(path, 'config.json')}: quantization_config"
        if not isinstance(qc, dict) or qc.get("quant_method") != "fp8":
            got = qc.get("quant_method") if isinstance(qc, dict) else qc
            raise ValueError(f"{where}.quant_method is {got!r}: only block-wise 'fp8' checkpoints load (DeepSeek-V3's "
                             "format, as zai-org/GLM-5-FP8)")
        for key, want in (("fmt", "e4m3"), ("activation_scheme", "dynamic"), ("weight_block_size", [BLOCK, BLOCK])):
            if qc.get(key, want) != want:  # (transformers' defaults when a key is absent)
                raise ValueError(f"{where}.{key} is {qc[key]!r}, expected {want!r}")
        skip = qc.get("modules_to_not_convert") or []
        heads = {}  # name -> (file, dtype, shape)
        for file, names in files.items():
            with safe_open(file, framework="pt", device="cpu") as f:
                for n in names:
                    t = f.get_slice(n)
                    heads[n] = (file, t.get_dtype(), tuple(t.get_shape()))
        fp8, rows = {}, {}
        for n, (file, dtype, shape) in heads.items():  # the fp8 tensors first: a scale's check reads its weight's
            if not dtype.startswith("F8"):
                continue
            if dtype != E4M3_FILE or len(shape) != 2 or not n.endswith(".weight"):
                raise ValueError(f"{file}: tensor {n} is {dtype} {list(shape)}: quantization_config explains only e4m3 "
                                 "linear weights [out, in]")
            if n + "_scale_inv" not in heads:
                raise ValueError(f"{file}: fp8 tensor {n} has no {n}_scale_inv (its scales, one per 128 x 128 block)")
            module = n.removesuffix(".weight")
            listed = [k for k in skip if module == k or module.startswith(k + ".") or module.endswith("." + k)]
            if listed:
                raise ValueError(f"{file}: tensor {n} is fp8, but quantization_config.modules_to_not_convert lists "
                                 f"{listed[0]!r}")
            fp8[n], rows[n] = (file, heads[n + "_scale_inv"][0]), shape[0]
        for n, (file, dtype, shape) in heads.items():
            if not n.endswith("_scale_inv"):
                continue
            w = n.removesuffix("_scale_inv")
            if w not in fp8:
                why = f"{w} is {heads[w][1]}, not fp8" if w in heads else f"the checkpoint has no {w}"
                raise ValueError(f"{file}: unexpected tensor {n} ({why}: nothing for its block scales to scale)")
            N, K = heads[w][2]
            want = (_cdiv(N, BLOCK), _cdiv(K, BLOCK))
            if dtype != "F32" or shape != want:
                raise ValueError(f"{file}: tensor {n} is {dtype} {list(shape)}, expected F32 {list(want)} (one scale per "
                                 f"128 x 128 block of {w} {[N, K]})")
        files = {file: [n for n in names if not n.endswith("_scale_inv")] for file, names in files.items()}
        return cls(fp8, rows, files, str(path))

    @classmethod
    def at(cls, path) -> "Published | None":
        """The directory's Published, or None when its config.json has no quantization_config (a bf16 checkpoint, as
        the ones a run saves)."""
        with open(os.path.join(path, "config.json")) as f:
            qc = json.load(f).get("quantization_config")
        return None if qc is None else cls.of(qc, _safetensors_files(path), path)

    def scales(self, name, blocks=slice(None)):
        """The block rows `blocks` of fp8 weight name's scales, fp32 [rows, Kb] (read from their own file)."""
        with safe_open(self.fp8[name][1], framework="pt", device="cpu") as f:
            return f.get_slice(name + "_scale_inv")[blocks]

    def read(self, name):
        """fp8 weight name's published (codes e4m3 [N, K], scales fp32 [Nb, Kb]), on the CPU."""
        with safe_open(self.fp8[name][0], framework="pt", device="cpu") as f:
            return f.get_tensor(name), self.scales(name)

    def reader(self, f, name, dst):
        """load_pretrained's read(rows) of the file tensor name (f: its open file) into dst (a tensor, or a part of
        one: model._copy_rows): rows [start, stop) of the file as they are, or of an fp8 weight dequantized in dst's
        dtype (dequantize), reading only the 128-row blocks they fall in (an FSDP rank reads its own rows)."""
        if name not in self.fp8:
            return lambda rows: f.get_slice(name)[rows]
        dtype, N = getattr(dst, "param", dst).dtype, self.rows[name]  # (families/mla_moe.py's ExpertPart: .param)

        def read(rows):
            start, stop, _ = rows.indices(N)
            b0, b1 = start // BLOCK, _cdiv(stop, BLOCK)
            q = f.get_slice(name)[b0 * BLOCK:min(b1 * BLOCK, N)]  # whole blocks: [<= (b1 - b0) * 128, K]
            return dequantize(q, self.scales(name, slice(b0, b1)), dtype)[start - b0 * BLOCK:stop - b0 * BLOCK]
        return read


def published_blocks(published: Published | None, cfg, name, param):
    """Our quantized tensor `name` (a linear's "....weight" [N, K], or the stacked experts' "...gate_up_proj" /
    "...down_proj" [E, N, K]) as published codes and scales in our layout, (q fp8, scale_inv fp32) on param's device,
    when the checkpoint's blocks are the ones quantize cuts from it: every file tensor it is made of (the family's
    file_names: itself, or each expert's gate_proj, up_proj or down_proj) fp8, each covering whole 128-row blocks of
    ours (starting on a block boundary, ending on one or at its last row). Else None (no published checkpoint, a meta
    model, a part in high precision or across our blocks). The model's values must be those blocks dequantized as
    load_pretrained reads them (dequantize in param's dtype; experts one at a time, as quantize): else the model is not
    the checkpoint's, an error naming the tensor."""
    if published is None or param.is_meta:
        return None
    parts = family(cfg.model_type).file_names({hf_name(name): param}, cfg)  # {file name: param, or an ExpertPart}
    *lead, N, K = param.shape
    spans = []
    for fname, part in parts.items():
        at, rows = ((), slice(None)) if isinstance(part, torch.Tensor) else ((part.expert,), part.rows)
        start, stop, _ = rows.indices(N)
        if fname not in published.fp8 or start % BLOCK or (stop % BLOCK and stop != N):
            return None
        spans.append((fname, at, start, stop))
    q = torch.empty(param.shape, dtype=FP8, device=param.device)
    s = torch.empty(*lead, _cdiv(N, BLOCK), _cdiv(K, BLOCK), device=param.device)
    for fname, at, start, stop in spans:
        fq, fs = published.read(fname)
        if tuple(fq.shape) != (stop - start, K):
            raise ValueError(f"{published.path}: {fname} is {list(fq.shape)}, the model's {name} holds "
                             f"{[stop - start, K]} there (quantize_model_'s published= is not the model's checkpoint)")
        q[(*at, slice(start, stop))] = fq.to(param.device)
        s[(*at, slice(start // BLOCK, _cdiv(stop, BLOCK)))] = fs.to(param.device)
    pairs = zip(q, s, param.detach()) if q.dim() == 3 else [(q, s, param.detach())]  # (experts one at a time)
    if not all(torch.equal(dequantize(a, b, param.dtype), w) for a, b, w in pairs):
        raise ValueError(f"{published.path}: the model's {name} is not the checkpoint's fp8 blocks dequantized "
                         "(quantize_model_'s published= must be the directory the model was loaded from)")
    return q, s


QUANTIZED["fp8"] = Published.of  # model.load_pretrained reads such checkpoints through it
