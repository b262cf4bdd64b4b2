"""kernels/moe.py: the grouped experts against a naive float64 loop over tokens, forward and backward, through
torch._grouped_mm (where this torch runs it) and through the loop over experts; one sort and no scatter-add, with
the previous formula's bits; CastCache against the cast it replaces."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import moe


def naive(x, idx, w, gate_up, down):
    """out[n] = sum_j w[n, j] * down_e @ (silu(gate_e @ x[n]) * (up_e @ x[n])), token by token."""
    I = down.shape[2]
    out = []
    for n in range(x.shape[0]):
        acc = 0
        for j in range(idx.shape[1]):
            e = int(idx[n, j])
            g, u = gate_up[e, :I] @ x[n], gate_up[e, I:] @ x[n]
            acc = acc + w[n, j] * (down[e] @ (F.silu(g) * u))
        out.append(acc)
    return torch.stack(out)


def case(N=13, k=3, E=6, H=16, I=8, seed=0, unused=(4,)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g)
    scores = torch.rand(N, E, generator=g)
    scores[:, list(unused)] = -1  # an expert no token picks: its group is empty
    idx = scores.topk(k, -1).indices
    w = torch.rand(N, k, generator=g)
    gate_up = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    down = torch.randn(E, H, I, generator=g) / I**0.5
    return x, idx, w, gate_up, down


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("shape", [dict(), dict(N=1, k=1, E=3, unused=()), dict(N=20, k=2, E=4, H=8, I=4, unused=(0, 3))])
def test_experts_forward_matches_naive_loop(grouped, shape, monkeypatch):
    """fp32 experts_forward vs the float64 loop: outputs and the gradients of x, w and both weights."""
    monkeypatch.setattr(moe, "USE_GROUPED_MM", grouped)
    args = case(**shape)
    if grouped:
        assert moe._grouped_mm_runs(args[0], args[3].transpose(1, 2)) == hasattr(torch, "_grouped_mm")
    ours = [t.clone().requires_grad_(t.is_floating_point()) for t in args]
    ref = [t.double().requires_grad_() if t.is_floating_point() else t for t in args]
    out = moe.experts_forward(*ours)
    expect = naive(*ref)
    assert out.dtype == torch.float32 and out.shape == expect.shape
    torch.testing.assert_close(out.double(), expect, atol=1e-5, rtol=1e-5)
    seed = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    out.backward(seed)
    expect.backward(seed.double())
    for a, b, name in zip(ours, ref, ("x", "idx", "w", "gate_up", "down")):
        if name != "idx":
            torch.testing.assert_close(a.grad.double(), b.grad, atol=1e-5, rtol=1e-5, msg=name)
    unused = shape.get("unused", (4,))
    for e in unused:  # an expert that no token chose gets an exact zero gradient
        assert ours[3].grad[e].abs().max() == 0 and ours[4].grad[e].abs().max() == 0


def test_grouped_and_loop_agree_and_are_deterministic(monkeypatch):
    """Both paths give the same values (bf16 too, within rounding), and each gives the same bits twice."""
    x, idx, w, gate_up, down = case(N=40, k=2, E=8, H=32, I=16, seed=1, unused=(2,))
    results = {}
    for grouped in (True, False):
        monkeypatch.setattr(moe, "USE_GROUPED_MM", grouped)
        runs = []
        for _ in range(2):
            xb = x.bfloat16().requires_grad_()
            gu = gate_up.clone().requires_grad_()
            out = moe.experts_forward(xb, idx, w, gu, down)
            out.float().square().sum().backward()
            runs.append((out.detach(), xb.grad, gu.grad))
        for a, b in zip(*runs):
            assert torch.equal(a, b)
        results[grouped] = runs[0]
    for a, b in zip(results[True], results[False]):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


def test_unaligned_shapes_take_the_loop():
    """A width whose rows are not a multiple of 16 bytes: torch._grouped_mm would refuse, the loop runs."""
    x, idx, w, gate_up, down = case(N=7, k=2, E=3, H=6, I=5, unused=())
    assert not moe._grouped_mm_runs(x, gate_up.transpose(1, 2))
    torch.testing.assert_close(moe.experts_forward(x, idx, w, gate_up, down).double(),
                               naive(x.double(), idx, w.double(), gate_up.double(), down.double()), atol=1e-5, rtol=1e-5)


class Ops(TorchDispatchMode):
    """The aten ops that run inside the block (forward, and backward if it runs inside)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def previous(x, idx, w, gate_up, down):
    """experts_forward as it was: x expanded to the k slots, reshaped and index_select'ed by an argsort, the results
    back by index_select with the inverse permutation (a scatter of arange): the same values, by other ops."""
    N, H = x.shape
    k = idx.shape[1]
    order = torch.argsort(idx.reshape(-1).long(), stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    offs = torch.searchsorted(idx.reshape(-1).long()[order], torch.arange(gate_up.shape[0]), right=True).to(torch.int32)
    xs = x[:, None].expand(N, k, H).reshape(N * k, H).index_select(0, order)
    gate, up = moe.grouped_mm(xs, gate_up.to(x.dtype).transpose(1, 2), offs).chunk(2, dim=-1)
    ys = moe.grouped_mm(F.silu(gate) * up, down.to(x.dtype).transpose(1, 2), offs).index_select(0, inverse)
    return (ys.view(N, k, H) * w.to(ys.dtype)[..., None]).sum(1)


def bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_sort_no_scatter_add_and_the_previous_bits(grouped, dtype, monkeypatch):
    """experts_forward sorts once (its sorted ids give the offsets; no inverse permutation is made) and its
    backward adds nothing by index (no index_add / scatter_add / accumulating index_put: atomics on CUDA), with
    the bits, forward and backward, of the previous formula (x expanded, index_select'ed, the inverse gathered),
    down to the sign of zero gradients (a third of the output gradient's rows are -0.0)."""
    monkeypatch.setattr(moe, "USE_GROUPED_MM", grouped)
    x, idx, w, gate_up, down = case(N=40, k=3, E=8, H=32, I=16, seed=2, unused=(5,))
    seed = torch.randn(40, 32, generator=torch.Generator().manual_seed(3)).to(dtype)
    seed[::3] = -0.0
    results = []
    for f in (previous, moe.experts_forward):
        ins = [x.to(dtype), idx, w, gate_up, down]
        ins = [t.clone().requires_grad_(t.is_floating_point()) for t in ins]
        with Ops() as ops:
            out = f(*ins)
            out.backward(seed)
        results.append([out.detach()] + [t.grad for t in ins if t.is_floating_point()])
    for a, b in zip(*results):
        assert torch.equal(bits(a), bits(b))
    assert ops.names.count("sort") == 1 and "scatter" not in ops.names
    assert not {"index_add", "scatter_add", "index_put"} & set(ops.names)
    order, offs = moe.expert_order(idx, 8)  # and sort_by_expert (fp8.FP8Experts') still gives the inverse
    assert torch.equal(moe.sort_by_expert(idx, 8)[1][order], torch.arange(order.numel()))


def test_cast_cache_gives_the_casts_bits_and_gradient():
    """CastCache.weight: the values of master.to(bf16), and a backward that hands the master the cast's own
    gradient (the same bits); one copy for every call until the master changes."""
    g = torch.Generator().manual_seed(4)
    master = torch.nn.Parameter(torch.randn(3, 8, 5, generator=g))
    seed = torch.randn(3, 8, 5, generator=g).bfloat16()
    master.to(torch.bfloat16).backward(seed)
    expect = master.grad.clone()
    master.grad = None
    cache = moe.CastCache()
    for _ in range(3):  # three "forwards" (a forward and two recomputes): one copy
        out = cache.weight("w", master, torch.bfloat16)
        assert out.dtype == torch.bfloat16 and torch.equal(bits(out), bits(master.detach().to(torch.bfloat16)))
        out.backward(seed)
    assert cache.casts == 1 and torch.equal(master.grad, 3 * expect)
    with torch.no_grad():  # an in-place change that bumps _version: a new copy
        master.mul_(2)
    assert torch.equal(cache.weight("w", master, torch.bfloat16), master.detach().to(torch.bfloat16)) and cache.casts == 2
    assert not copy.deepcopy(cache).copies  # a copied model's cache is its own, empty
    with torch.no_grad():
        master.mul_(2)
    with torch.inference_mode():  # its tensors could never enter a graph: cast, not cached
        assert torch.equal(cache.weight("w", master, torch.bfloat16), master.detach().to(torch.bfloat16))
    master.grad = None
    cache.weight("w", master, torch.bfloat16).sum().backward()
    assert cache.casts == 3 and torch.equal(master.grad, torch.ones_like(master))


@pytest.mark.parametrize("kind", ["fused", "foreach", "for-loop"])
def test_cast_cache_recasts_after_an_optimizer_step_and_keeps_frozen_copies(kind):
    """After an AdamW step the stepped master's copy is made again (fused AdamW steps in place without bumping
    _version: the optimizer hook catches it); a frozen master's copy stays, made once; a second optimizer that
    does not hold the master leaves its copy alone."""
    g = torch.Generator().manual_seed(5)
    master, frozen = torch.nn.Parameter(torch.randn(4, 6, generator=g)), torch.randn(4, 6, generator=g)
    flags = {"fused": dict(fused=True), "foreach": dict(foreach=True), "for-loop": dict(foreach=False)}[kind]
    opt = torch.optim.AdamW([master], lr=0.1, **flags)
    other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    cache = moe.CastCache()
    for step in range(3):
        out = cache.weight("w", master, torch.bfloat16)
        assert torch.equal(out, master.detach().to(torch.bfloat16)), step
        assert torch.equal(cache.weight("frozen", frozen, torch.bfloat16), frozen.to(torch.bfloat16))
        assert cache.casts == step + 2  # the frozen copy once, the master's once per step
        out.float().square().sum().backward()
        other.step()  # (another model's optimizer: not this master's)
        assert cache.weight("w", master, torch.bfloat16) is not None and cache.casts == step + 2
        opt.step()
        opt.zero_grad(set_to_none=True)
