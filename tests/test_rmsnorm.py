"""kernels/rmsnorm.py: the fused RMSNorm against model.RMSNorm's formula in float64 (Triton's interpreter on CPU
tensors; on a GPU against model.RMSNorm itself), and its place in the engine (machinery/graphs.py): FusedRMSNorm
takes the kernel only where it runs and no gradient is wanted, fuse_norms swaps every norm of a model in place,
TorchEngine fuses its own.

Tolerance in bf16: 2^-6 of a value (the kernel rounds twice, the normalised row and the product, each within one
step of bf16's 8 significant bits; the interpreter's fp32 -> bf16 conversion does not round to nearest, the GPU's
does). In fp32: 1e-6."""
import pytest
import torch

import dsa
from kernels import rmsnorm
from machinery import graphs
from model import RMSNorm
from conftest import compile_for_h100
from test_engine import tiny_model, tiny_moe


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
    out = rmsnorm.rms_norm(x, m.weight, m.eps)
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
    assert torch.equal(rmsnorm.rms_norm(x, m.weight, m.eps), rmsnorm.rms_norm(x.contiguous(), m.weight, m.eps))


def test_fused_norm_takes_the_kernel_only_without_gradients(interpreter, monkeypatch):
    """FusedRMSNorm: the kernel where it runs (here the interpreter) and no gradient is wanted; model.RMSNorm's path
    for an input that needs one (the gradient flows as model.RMSNorm's), and with dsa.USE_TRITON off."""
    calls = []
    monkeypatch.setattr(graphs.rmsnorm, "rms_norm", lambda *a: calls.append(1) or RMSNorm.forward(m, a[0]))
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


@pytest.mark.parametrize("make", [tiny_model, tiny_moe])
def test_fuse_swaps_every_norm_and_changes_nothing_on_a_cpu(make):
    """fuse_norms(model): every model.RMSNorm of a GLM-4 or MLA + MoE model (MLA's latent norms included) is a
    FusedRMSNorm, the same modules and parameters, and without the kernel (a CPU) the same logits, bit for bit.
    TorchEngine fuses the model it is given."""
    from machinery.engine import TorchEngine
    model = make()
    norms = [m for m in model.modules() if type(m) is RMSNorm]
    params = dict(model.named_parameters())
    ids = torch.randint(2, 40, (2, 9))
    with torch.no_grad():
        before = model(ids)
    graphs.fuse_norms(model)
    assert norms and all(type(m) is graphs.FusedRMSNorm for m in norms)
    assert not any(type(m) is RMSNorm for m in model.modules())
    assert all(p is params[n] for n, p in model.named_parameters())
    with torch.no_grad():
        assert torch.equal(model(ids), before)
    engine = TorchEngine(make())
    assert not any(type(m) is RMSNorm for m in engine.model.modules())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_rms_norm_is_model_rmsnorm_in_bf16():
    """On a GPU, bf16 at GLM's widths (GLM-4.7-Flash's hidden 2048 and latents 768 / 512, GLM-Z1-9B's 4096), decode's
    and a prefill's rows: within one bf16 rounding step of model.RMSNorm's values, and equal in most."""
    for n in (512, 768, 2048, 4096):
        m = norm(n, torch.bfloat16).cuda()
        for rows in (1, 256, 17408):
            x = (torch.randn(rows, n, device="cuda") * 2).to(torch.bfloat16)
            ours, theirs = rmsnorm.rms_norm(x, m.weight, m.eps).float(), RMSNorm.forward(m, x).float()
            assert ((ours - theirs).abs() <= 2 ** -7 * theirs.abs() + 1e-30).all(), (n, rows)
            assert (ours != theirs).float().mean() < 0.02, (n, rows)


COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction
from kernels import rmsnorm
from machinery import graphs
rmsnorm._compiled(False)  # sets the kernel's global tl
for n, dtype, warps in ((512, "bf16", 4), (2048, "bf16", 4), (6144, "bf16", 8), (100, "fp32", 4)):
    bn = 1 << (n - 1).bit_length()
    sig = {a: "constexpr" if a == "BN" else {"X": f"*{dtype}", "W": f"*{dtype}", "Y": f"*{dtype}", "eps": "fp32"}.get(a, "i32")
           for a in JITFunction(rmsnorm._rms_norm_kernel).arg_names}
    k = triton.compile(ASTSource(fn=JITFunction(rmsnorm._rms_norm_kernel), signature=sig, constexprs=dict(BN=bn)),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    assert k.asm["cubin"]
    ptx = k.asm["ptx"]
    assert dtype != "bf16" or "cvt.rn.bf16" in ptx  # fp32 -> bf16 rounds to nearest on the GPU
    print(n, dtype, "ok")
"""


def test_kernel_compiles_for_h100():
    """The kernel compiles for sm_90 with Triton's compiler and ptxas (no GPU needed; a fresh process: this one's
    triton is in interpreter mode), at a latent's, Flash's and a wide row's width, and its bf16 roundings are the
    hardware's round-to-nearest (cvt.rn), not the interpreter's conversion."""
    compile_for_h100(COMPILE_SCRIPT)
