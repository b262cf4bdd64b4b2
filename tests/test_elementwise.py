"""kernels/elementwise.py. rms_norm against model.RMSNorm's formula in float64 (Triton's interpreter on CPU tensors;
on a GPU against model.RMSNorm itself), and machinery/graphs.py's FusedRMSNorm taking it only where it runs and no
gradient is wanted (fuse_norms itself: tests/test_graphs.py). rope against model.apply_rope's PyTorch path: the same
bits in fp32 in the interpreter and in bf16 on a GPU, and apply_rope's dispatch to it.

Tolerances in the interpreter, whose fp32 -> bf16 conversion does not round to nearest (the GPU's does): rms_norm
in bf16 2^-6 of a value (two roundings, each within a step of bf16's 8 significant bits), in fp32 1e-6; rope in bf16
2^-6 of the largest value of the row, in fp32 the same bits."""
import pytest
import torch

import dsa
import model
from kernels import elementwise
from machinery import graphs
from model import RMSNorm
from conftest import compile_for_h100


def reference(x, weight, eps):
    x, w = x.double(), weight.to(x.dtype).double()
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def norm(n, dtype, seed=0):
    torch.manual_seed(seed)
    m = RMSNorm(n, 1e-6)
    with torch.no_grad():
        m.weight.normal_(1.0, 0.5)
    return m.to(dtype)


@pytest.fixture
def interpreter(monkeypatch):
    try:
        import triton.language as tl
    except ImportError:
        pytest.skip("no triton")
    if type(tl.max).__name__ != "InterpretedFunction":  # conftest imports triton in interpreter mode
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set: run this file in its own process")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 2 ** -6)])
@pytest.mark.parametrize("shape", [(3, 5, 64), (7, 48), (2, 0, 32), (1, 1, 100)])
def test_rms_norm_is_the_formula(interpreter, dtype, tol, shape):
    """rms_norm(x, w, eps) = w * x / sqrt(mean(x^2) + eps) per row, for 3-D, 2-D, empty and non-power-of-2 rows; a
    plausible bug (eps left out on rows of small values, the mean over a padded block) is farther off."""
    m = norm(shape[-1], dtype)
    x = (torch.randn(shape) * 3).to(dtype)
    x[..., :1, :] *= 1e-3  # rows whose mean square is near eps: leaving eps out moves them
    out = elementwise.rms_norm(x, m.weight, m.eps)
    assert out.shape == x.shape and out.dtype == dtype
    ref = reference(x, m.weight, m.eps)
    bound = tol * ref.abs() + 1e-30
    assert ((out.double() - ref).abs() <= bound).all()
    if x.numel():
        no_eps = m.weight.double() * x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True))
        padded = m.weight.double() * x.double() * torch.rsqrt(x.double().pow(2).sum(-1, keepdim=True) /
                                                             (1 << (shape[-1] - 1).bit_length()) + m.eps)
        for bug in (no_eps, padded) if shape[-1] & (shape[-1] - 1) else (no_eps,):
            assert ((bug - ref).abs() > bound).any()


def test_rms_norm_reads_strided_rows(interpreter):
    """A row stride other than N (MLA's latent, split off a wider projection): the same values as a contiguous copy."""
    m = norm(48, torch.float32)
    wide = torch.randn(4, 6, 64)
    x = wide[..., :48]
    assert not x.is_contiguous()
    assert torch.equal(elementwise.rms_norm(x, m.weight, m.eps), elementwise.rms_norm(x.contiguous(), m.weight, m.eps))


def test_fused_norm_takes_the_kernel_only_without_gradients(interpreter, monkeypatch):
    """FusedRMSNorm: the kernel where it runs (here the interpreter) and no gradient is wanted; model.RMSNorm's path
    for an input that needs one (the gradient flows as model.RMSNorm's), and with dsa.USE_TRITON off."""
    calls = []
    monkeypatch.setattr(graphs.elementwise, "rms_norm", lambda *a: calls.append(1) or RMSNorm.forward(m, a[0]))
    m = graphs.fuse_norms(torch.nn.Sequential(norm(16, torch.float32)))[0]
    assert type(m) is graphs.FusedRMSNorm
    x = torch.randn(3, 16)
    with torch.no_grad():
        m(x)
    assert calls == [1]
    xg = x.clone().requires_grad_()
    m(xg).sum().backward()
    ref = x.clone().requires_grad_()
    RMSNorm.forward(m, ref).sum().backward()
    assert calls == [1] and torch.equal(xg.grad, ref.grad)
    monkeypatch.setattr(dsa, "USE_TRITON", False)
    with torch.no_grad():
        m(x)
    assert calls == [1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_rms_norm_is_model_rmsnorm_in_bf16():
    """On a GPU, bf16 at GLM's widths (GLM-4.7-Flash's hidden 2048 and latents 768 / 512, GLM-Z1-9B's 4096), decode's
    and a prefill's rows: within one bf16 rounding step of model.RMSNorm's values, and equal in most."""
    for n in (512, 768, 2048, 4096):
        m = norm(n, torch.bfloat16).cuda()
        for rows in (1, 256, 17408):
            x = (torch.randn(rows, n, device="cuda") * 2).to(torch.bfloat16)
            ours, theirs = elementwise.rms_norm(x, m.weight, m.eps).float(), RMSNorm.forward(m, x).float()
            assert ((ours - theirs).abs() <= 2 ** -7 * theirs.abs() + 1e-30).all(), (n, rows)
            assert (ours != theirs).float().mean() < 0.02, (n, rows)


COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction
from kernels import elementwise
elementwise._compiled(False)  # sets the kernels' global tl
def compile(fn, block, n, dtype, warps, fusion=True):
    ptr = {"X": f"*{dtype}", "W": f"*{dtype}", "C": f"*{dtype}", "S": f"*{dtype}", "Y": f"*{dtype}", "eps": "fp32"}
    sig = {a: "constexpr" if a == block else ptr.get(a, "i32") for a in JITFunction(fn).arg_names}
    k = triton.compile(ASTSource(fn=JITFunction(fn), signature=sig, constexprs={block: 1 << (n - 1).bit_length()}),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, enable_fp_fusion=fusion))
    assert k.asm["cubin"]
    return k.asm["ptx"]
for n, dtype, warps in ((512, "bf16", 4), (2048, "bf16", 4), (6144, "bf16", 8), (100, "fp32", 4)):
    ptx = compile(elementwise._rms_norm_kernel, "BN", n, dtype, warps)
    assert dtype != "bf16" or "cvt.rn.bf16" in ptx  # fp32 -> bf16 rounds to nearest on the GPU
    print("rms_norm", n, dtype, "ok")
for n, dtype in ((64, "bf16"), (128, "bf16"), (128, "fp32")):
    ptx = compile(elementwise._rope_kernel, "BD", n, dtype, 1, fusion=False)
    # two products, each rounded to x's dtype (bf16: mul.rn.bf16, or fp32 products and cvt.rn), then their sum: no
    # fused multiply-add (PyTorch's bits; bf16 + bf16 rounded once to bf16 is fp32's sum rounded to bf16)
    assert "fma" not in ptx and (dtype != "bf16" or "mul.rn.bf16" in ptx or "cvt.rn.bf16" in ptx)
    print("rope", n, dtype, "ok")
"""


def test_kernels_compile_for_h100():
    """Both kernels compile for sm_90 with Triton's compiler and ptxas (no GPU needed; a fresh process: this one's
    triton is in interpreter mode): rms_norm at a latent's, Flash's and a wide row's width, rope at GLM's rotary
    widths. Their bf16 roundings are the hardware's round-to-nearest (cvt.rn), not the interpreter's conversion, and
    rope has no fused multiply-add (as PyTorch's separate products and sum)."""
    compile_for_h100(COMPILE_SCRIPT)


# ----------------------------------------------------------------------------------------------- rope

def rope_inputs(dtype, shape, seed=0):
    """x [B, T, (H,) D] and model.rope_cos_sin's tables for positions of each row (a partial rotation: about the last
    quarter of D passes unchanged), in dtype."""
    g = torch.Generator().manual_seed(seed)
    B, T, D = shape[0], shape[1], shape[-1]
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    pos = torch.arange(T).expand(B, T) + torch.randint(0, 1000, (B, 1), generator=g)
    cos, sin = model.rope_cos_sin(pos, D * 3 // 4 // 2 * 2, 10000.0, D)
    return x, cos.to(dtype), sin.to(dtype)


def pytorch_rope(x, cos, sin, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(dsa, "USE_TRITON", False)
        return model.apply_rope(x, cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 5, 4, 16), (3, 7, 64), (1, 3, 2, 12), (2, 0, 3, 8)])
def test_rope_is_apply_rope(interpreter, monkeypatch, dtype, shape):
    """rope(x, cos, sin) = apply_rope's PyTorch path: the same bits in fp32; in bf16 within a rounding step of the
    row (the interpreter's conversion), while a swap of the wrong pairs or a sign flip is far off. Heads share their
    token's row of cos and sin; a strided x (MLA's rotated slice of q) reads the same."""
    x, cos, sin = rope_inputs(dtype, shape)
    out, ref = elementwise.rope(x, cos, sin), pytorch_rope(x, cos, sin, monkeypatch)
    assert out.shape == x.shape and out.dtype == dtype
    if dtype == torch.float32:
        assert torch.equal(out, ref)
    else:
        bound = 2 ** -6 * x.float().abs().amax(-1, keepdim=True) + 1e-30
        assert ((out.float() - ref.float()).abs() <= bound).all()
    if x.numel():
        c, s = (cos[:, :, None], sin[:, :, None]) if x.dim() == 4 else (cos, sin)
        for bug in (x * c + x.flip(-1) * s, x * c - x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2) * s):
            assert (bug.float() - ref.float()).abs().max() > 0.1
    wide = torch.cat([x, x], -1)[..., :shape[-1]]  # the same values, rows strided
    assert not wide.is_contiguous() or not x.numel()
    assert torch.equal(elementwise.rope(wide, cos, sin), out)
    if x.numel():  # tables of one row of the batch, broadcast over it as apply_rope's products broadcast them
        whole = [t[:1].expand_as(t).contiguous() for t in (cos, sin)]
        assert torch.equal(elementwise.rope(x, cos[:1], sin[:1]), elementwise.rope(x, *whole))


def test_apply_rope_takes_the_kernel_where_no_gradient_is_wanted(interpreter, monkeypatch):
    """model.apply_rope runs the kernel where it can (here the interpreter) and x needs no gradient (the generator's
    frozen weights, any no_grad forward); an x that needs one (the learner) takes the PyTorch path, whose gradient
    flows; with dsa.USE_TRITON off, the PyTorch path."""
    calls = []
    kernel = elementwise.rope
    monkeypatch.setattr(elementwise, "rope", lambda *a: calls.append(1) or kernel(*a))
    x, cos, sin = rope_inputs(torch.float32, (2, 3, 2, 8))
    out = model.apply_rope(x, cos, sin)
    assert calls == [1] and torch.equal(out, pytorch_rope(x, cos, sin, monkeypatch))
    xg = x.clone().requires_grad_()
    model.apply_rope(xg, cos, sin).sum().backward()
    assert calls == [1] and xg.grad is not None
    monkeypatch.setattr(dsa, "USE_TRITON", False)
    model.apply_rope(x, cos, sin)
    assert calls == [1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_rope_is_apply_rope_bit_for_bit(monkeypatch):
    """On a GPU in bf16, the generator's dtype: rope gives apply_rope's PyTorch path's bits, at GLM-Z1-9B's head (128
    dims, 96 rotated here), GLM-4.7-Flash's rotated slice of q (the last 64 of each head's 256, strided) and its shared
    key (64), decode's rows and a prefill's."""
    for shape, width in (((64, 1, 32, 128), 128), ((17, 1024, 2, 128), 128), ((256, 1, 20, 256), 64), ((256, 1, 64), 64)):
        x, cos, sin = (t.cuda() for t in rope_inputs(torch.bfloat16, shape[:-1] + (width,)))
        if shape[-1] != width:  # MLA's q_rope: the last 64 of each head's 256 (q.split)
            x = torch.cat([torch.zeros(*shape[:-1], shape[-1] - width, device="cuda", dtype=x.dtype), x], -1)[..., -width:]
        assert torch.equal(elementwise.rope(x, cos, sin), pytorch_rope(x, cos, sin, monkeypatch)), shape
