"""kernels/moe.py: the grouped experts against a naive float64 loop over tokens, forward and backward, through
torch._grouped_mm (where this torch runs it) and through the loop over experts."""
import pytest
import torch
import torch.nn.functional as F

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
