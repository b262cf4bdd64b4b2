"""
The routed experts of a Mixture-of-Experts MLP, computed grouped by expert (model.py's MoE block calls this).

    experts_forward(x [N, H], idx [N, k], w [N, k], gate_up [E, 2I, H], down [E, H, I]) -> [N, H]
    grouped_mm(a [M, K], b [E, K, N], offs [E])                                          -> [M, N]

Each token goes to k of E experts. Looping over tokens would launch N*k tiny matmuls; looping over experts
with a mask per expert would read every token E times. Instead the N*k (token, expert) slots are sorted by
expert (a stable sort: slots of one expert keep the tokens' order), so that each expert's tokens sit in one
contiguous run of rows, and one grouped matmul multiplies run e by expert e's weights, for all experts at
once: torch._grouped_mm where it runs, a loop over experts (never over tokens) elsewhere.

Determinism: every step is a gather by a permutation or a reduction in a fixed order, so forward and
backward give the same bits run after run, on CPU and CUDA. Sending a token's row to its k slots is a
broadcast then a permutation (backward: a sum over k, then a permutation), not x[token] with repeated
indices, whose backward would add k rows into one with atomics; the results come back by the inverse
permutation and are summed over k. No scatter-add anywhere.
"""
import torch
import torch.nn.functional as F

USE_GROUPED_MM = True  # torch._grouped_mm where it runs; False: always the loop over experts (tests compare both)


def _grouped_mm_runs(a, b) -> bool:
    """Whether torch._grouped_mm takes these operands: it exists, the dtype is one it has a kernel for on this
    device (CUDA: bf16 on Hopper or newer; CPU: fp32, bf16, fp16), and every stride of a, b and the output is a
    multiple of 16 bytes (the kernels read rows with 16-byte vector loads)."""
    if not (USE_GROUPED_MM and hasattr(torch, "_grouped_mm")) or a.dtype != b.dtype:
        return False
    if a.is_cuda:
        if a.dtype != torch.bfloat16 or torch.cuda.get_device_capability(a.device) < (9, 0):
            return False
    elif a.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    size = a.element_size()
    strides = [a.stride(0), b.stride(1), b.stride(2), b.shape[2]]  # the output is [M, N], contiguous
    return all(s % (16 // size) == 0 or s == 1 for s in strides) and min(b.stride(1), b.stride(2)) == 1


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: torch._grouped_mm's backward rejects the
    zero-stride gradient that, e.g., a .sum() sends back."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_mm(a, b, offs):
    """a [M, K] (rows sorted by group), b [E, K, N], offs [E] int32: the cumulative row counts (group e is rows
    offs[e-1]:offs[e]) -> [M, N], row block e times b[e]. Differentiable in a and b. The loop over groups reads
    offs on the host (a device sync on CUDA)."""
    if _grouped_mm_runs(a, b):
        return _ContiguousGrad.apply(torch._grouped_mm(a, b, offs))
    ends = offs.tolist()
    outs, start = [], 0
    for e, end in enumerate(ends):
        if end > start:  # an expert no token chose costs nothing (and gets a zero gradient)
            outs.append(a[start:end] @ b[e])
        start = end
    if not outs:
        return a.new_zeros(a.shape[0], b.shape[2])
    return torch.cat(outs)


def sort_by_expert(idx, E: int):
    """idx [N, k] expert ids -> order [N*k] (the (token, expert) slots grouped by expert, a stable sort: tokens in
    order within one), inverse [N*k] (its inverse permutation) and offs [E] int32 (where each expert's rows end:
    the count of slots with an id <= e). No host read anywhere (not bincount: on CUDA it reads the largest id back
    to the host, a sync that would also break the engine's CUDA-graph capture)."""
    flat = idx.reshape(-1).long()  # [N*k]: slot n*k + j is token n's j-th expert
    order = torch.argsort(flat, stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    offs = torch.searchsorted(flat.index_select(0, order), torch.arange(E, device=flat.device), right=True)
    return order, inverse, offs.to(torch.int32)


def experts_forward(x, idx, w, gate_up, down):
    """The routed experts' weighted sum: out[n] = sum_j w[n, j] * expert_{idx[n, j]}(x[n]), each expert a SwiGLU
    down @ (silu(gate @ x) * (up @ x)) with gate_up = [gate; up] stacked along dim 1.

    x [N, H] (the compute dtype), idx [N, k] expert ids (any integer dtype, each < E), w [N, k] routing weights
    (fp32 from the router), gate_up [E, 2I, H], down [E, H, I] (cast to x's dtype here, as autocast casts a
    linear's weight) -> [N, H] in x's dtype. The product w * expert(x) is rounded to x's dtype, the sum over k
    accumulates in fp32 (torch's reductions do) and is rounded once."""
    N, H = x.shape
    k = idx.shape[1]
    order, inverse, offs = sort_by_expert(idx, gate_up.shape[0])
    xs = x[:, None].expand(N, k, H).reshape(N * k, H).index_select(0, order)  # [N*k, H], sorted by expert
    gate, up = grouped_mm(xs, gate_up.to(x.dtype).transpose(1, 2), offs).chunk(2, dim=-1)  # [N*k, I] each
    ys = grouped_mm(F.silu(gate) * up, down.to(x.dtype).transpose(1, 2), offs)  # [N*k, H], sorted
    ys = ys.index_select(0, inverse).view(N, k, H)  # back in slot order: token n's k results together
    return (ys * w.to(ys.dtype)[..., None]).sum(1)
