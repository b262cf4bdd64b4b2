"""
The routed experts of a Mixture-of-Experts MLP, computed grouped by expert (model.py's MoE block calls this).

    experts_forward(x [N, H], idx [N, k], w [N, k], gate_up [E, 2I, H], down [E, H, I]) -> [N, H]
    grouped_mm(a [M, K], b [E, K, N], offs [E])                                          -> [M, N]
    CastCache().weight(name, master, dtype): master.to(dtype), the copy made once per optimizer step

Each token goes to k of E experts. Looping over tokens would launch N*k tiny matmuls; looping over experts
with a mask per expert would read every token E times. Instead the N*k (token, expert) slots are sorted by
expert (a stable sort: slots of one expert keep the tokens' order), so that each expert's tokens sit in one
contiguous run of rows, and one grouped matmul multiplies run e by expert e's weights, for all experts at
once: torch._grouped_mm where it runs, a loop over experts (never over tokens) elsewhere. One sort a call:
its sorted ids give the experts' row offsets, its permutation takes the rows there and back.

Determinism: every step is a gather by a permutation, a write of each row once, or a reduction in a fixed
order, so forward and backward give the same bits run after run, on CPU and CUDA. Sending a token's row to its
k slots is a gather whose backward puts the slots' gradients back in slot order and sums each token's k in
order (_Dispatch), not x[token] with repeated indices, whose backward would add k rows into one with atomics;
the results come back by writing sorted row i to slot order[i] (_Unsort; backward: the gather by order) and
are summed over k. No scatter-add anywhere, forward or backward.
"""
import weakref

import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook

USE_GROUPED_MM = True  # torch._grouped_mm where it runs; False: always the loop over experts (tests compare both)
CAST_CACHE = True  # mla_moe.Experts under autocast: bf16 copies once per step (CastCache); False: every forward


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
    sizes = [end - start for start, end in zip([0] + ends[:-1], ends)]
    # split and unbind: their backwards put the pieces' gradients together once (a[start:end] and b[e] would each
    # zero-fill a whole a or b per expert and add them up: E passes over the experts' weights in every backward)
    outs = [part @ w for part, w, n in zip(a.split(sizes), b.unbind(0), sizes)
            if n]  # an expert no token chose costs nothing (and gets a zero gradient)
    if not outs:
        return a.new_zeros(a.shape[0], b.shape[2])
    return torch.cat(outs)


def expert_order(idx, E: int):
    """idx [N, k] expert ids -> order [N*k] (the (token, expert) slots grouped by expert, a stable sort: tokens in
    order within one) and offs [E] int32 (where each expert's rows end: the count of slots with an id <= e), from
    one sort (its sorted ids are what the binary search for offs reads). No host read anywhere (not bincount:
    on CUDA it reads the largest id back to the host, a sync that would also break the engine's CUDA-graph
    capture)."""
    flat = idx.reshape(-1).long()  # [N*k]: slot n*k + j is token n's j-th expert
    ids, order = torch.sort(flat, stable=True)  # [N*k] each
    offs = torch.searchsorted(ids, torch.arange(E, device=flat.device), right=True)
    return order, offs.to(torch.int32)


def sort_by_expert(idx, E: int):
    """expert_order and its inverse permutation [N*k] (sorted row of each slot): order, inverse, offs. For
    callers that gather back by the inverse (fp8.FP8Experts); experts_forward needs none."""
    order, offs = expert_order(idx, E)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return order, inverse, offs


class _Dispatch(torch.autograd.Function):
    """x [N, H] -> [N*k, H], row i = x[order[i] // k]: the token of sorted slot i. Backward: the rows' gradients
    written back in slot order (index_copy_ by a permutation: each row written once) and summed over each token's
    k slots ([N, k, H] -> [N, H], a fixed order). The same bits as autograd's backward of x expanded to [N, k, H],
    reshaped and index_select'ed, whose index_select backward is an index_add_ (atomics on CUDA)."""

    @staticmethod
    def forward(ctx, x, order, k):
        ctx.save_for_backward(order)
        ctx.k = k
        return x.index_select(0, order // k)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        slots = torch.empty_like(grad).index_copy_(0, order, grad)  # [N*k, H]: slot n*k + j is token n's j-th
        return slots.view(-1, ctx.k, grad.shape[1]).sum(1), None, None


class _Unsort(torch.autograd.Function):
    """ys [N*k, H] in sorted order -> [N*k, H] in slot order: sorted row i is slot order[i]'s (index_copy_ by a
    permutation: each row written once; no inverse permutation needed). Backward: the gather by order."""

    @staticmethod
    def forward(ctx, ys, order):
        ctx.save_for_backward(order)
        return torch.empty_like(ys).index_copy_(0, order, ys)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        return grad.index_select(0, order), None


def experts_forward(x, idx, w, gate_up, down):
    """The routed experts' weighted sum: out[n] = sum_j w[n, j] * expert_{idx[n, j]}(x[n]), each expert a SwiGLU
    down @ (silu(gate @ x) * (up @ x)) with gate_up = [gate; up] stacked along dim 1.

    x [N, H] (the compute dtype), idx [N, k] expert ids (any integer dtype, each < E), w [N, k] routing weights
    (fp32 from the router), gate_up [E, 2I, H], down [E, H, I] (cast to x's dtype here, as autocast casts a
    linear's weight; mla_moe.Experts hands in CastCache's copies under autocast) -> [N, H] in x's dtype. The
    product w * expert(x) is rounded to x's dtype, the sum over k accumulates in fp32 (torch's reductions do) and
    is rounded once, to x's dtype: CUDA's autocast runs sum in fp32 and returns fp32 (the CPU's does not), and an
    fp32 result here would turn the residual stream fp32 from the first MoE layer on (every later layer's experts
    then fp32, off torch._grouped_mm's bf16 kernel: the learner at 0.85x transformers on an H200)."""
    N, H = x.shape
    k = idx.shape[1]
    order, offs = expert_order(idx, gate_up.shape[0])
    xs = _Dispatch.apply(x, order, k)  # [N*k, H], sorted by expert
    gate, up = grouped_mm(xs, gate_up.to(x.dtype).transpose(1, 2), offs).chunk(2, dim=-1)  # [N*k, I] each
    ys = grouped_mm(F.silu(gate) * up, down.to(x.dtype).transpose(1, 2), offs)  # [N*k, H], sorted
    ys = _Unsort.apply(ys, order).view(N, k, H)  # back in slot order: token n's k results together
    return (ys * w.to(ys.dtype)[..., None]).sum(1).to(x.dtype)


# ----------------------------------------------------------------------------- the weights, cast once a step

class _CachedCast(torch.autograd.Function):
    """master -> copy (master cast to the compute dtype, made earlier), with the cast's own backward: the
    gradient cast to the master's dtype, what autograd's backward of master.to(dtype) returns (the same bits)."""

    @staticmethod
    def forward(ctx, master, copy):
        ctx.dtype = master.dtype
        return copy.view_as(copy)  # a fresh alias: the cached tensor itself never joins a graph

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


class CastCache:
    """Copies of a module's master weights (fp32) in the compute dtype (bf16), each made once per optimizer step.

    Under autocast the routed experts' weights are cast in every forward (experts_forward's .to), and with
    activation checkpointing in every recompute again: autocast's own cast cache lasts until its context exits,
    and a recompute runs in backward, in a context of its own. Here a weight's copy is made by the step's first
    forward and reused by every forward and recompute of every micro-batch until its master changes:
      - an optimizer step: a hook after every torch.optim step drops the copies of the parameters it held. It is
        what catches the step: fused AdamW (train.adamw's) updates the masters in place without bumping their
        _version. A skipped step (non-finite: parallel.optimizer_step never calls step()) changes nothing, and
        the copies stay right.
      - any other in-place change (load_state_dict's copy_, an edit under no_grad) bumps the master's _version,
        new storage (.data =, an offload that comes back elsewhere) moves its data_ptr: each copy is keyed on
        (the master, _version, data_ptr, dtype), and a key that no longer matches makes a new copy.
    A frozen master, which no optimizer steps, keeps its copy for good: cast once. Memory: the copies of every
    layer are held from the step's first forward to its optimizer step (machinery/memory.py counts them). The
    copy enters each graph through _CachedCast, so the master's gradient is the cast's, bit for bit."""

    def __init__(self):
        self.copies = {}  # name -> (weakref to the master, its key, the copy)
        self.casts = 0  # copies made so far (tests and bench/moe.py count them)

    def weight(self, name, master, dtype):
        """master (a parameter) in dtype, differentiable into master as master.to(dtype) is."""
        if torch.is_inference_mode_enabled():  # a copy made here would be an inference tensor: no graph takes it
            return master.to(dtype)
        key = (master._version, master.data_ptr(), dtype)
        entry = self.copies.get(name)
        if entry is None or entry[0]() is not master or entry[1] != key:
            self.copies.pop(name, None)  # the stale copy goes first: one copy of this weight at a time
            with torch.no_grad():
                entry = self.copies[name] = (weakref.ref(master), key, master.to(dtype))
            self.casts += 1
            _watch(self)
        return _CachedCast.apply(master, entry[2])

    def __deepcopy__(self, memo):
        return CastCache()  # a copied model casts its own masters (these copies are of the original's)

    def drop(self, params: set):
        """Forget the copies whose master is in params (ids of the parameters an optimizer just stepped)."""
        for name, (ref, _, _) in list(self.copies.items()):
            if ref() is None or id(ref()) in params:
                del self.copies[name]


_CACHES = weakref.WeakSet()  # every CastCache that has made a copy
_HOOK = []  # the optimizer hook's handle, once registered (by the first copy: a run that never casts has none)


def _watch(cache: CastCache):
    _CACHES.add(cache)
    if not _HOOK:
        _HOOK.append(register_optimizer_step_post_hook(_stepped))


def _stepped(optimizer, args, kwargs):
    """After any optimizer's step(): the copies of the parameters it stepped are stale."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for cache in list(_CACHES):
        cache.drop(params)
