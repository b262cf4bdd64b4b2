"""dsa_triton.py under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors): the indexer scores and
sparse attention forward/backward against dsa.py's PyTorch reference evaluated in float64 on the same
(rounded) inputs. Block sizes are shrunk so that tiny shapes still run several blocks, partial blocks,
several backward chunks and split slots.

Tolerances, as max |ours - ref| / max |ref| over the tensor:
  fp32 inputs: 1e-5 (scores, outputs, LSE, probabilities, gradients);
  bf16 inputs: 1e-2 for outputs, 2e-2 for gradients (outputs and gradients are bf16, and P / dS are
  rounded to bf16 before their matmuls, as on the GPU; measured about 5e-3 and 6e-3), 1e-4 for the
  probabilities and LSE (fp32 logits of exact bf16 products).
Every comparison also checks that a plausible bug (wrong scale, a dropped head, the wrong KV head for
a GQA group) is farther from the reference than the tolerance, so each test can fail."""
import dataclasses
import os

# Before triton is imported: triton.language decorates its own library for the interpreter only when this
# is set then. Put back right after, so that test modules run later in the same session do not see it;
# the fixture below sets it again around each test of this file.
_PREVIOUS_INTERPRET = os.environ.get("TRITON_INTERPRET")

import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

if _PREVIOUS_INTERPRET == "0":  # a session that compiles kernels for the GPU (conftest.py): no interpreter here
    pytest.skip("TRITON_INTERPRET=0: this session compiles for the GPU; the interpreter tests need a session of their own",
                allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
import torch  # noqa: E402

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import dsa  # noqa: E402
from kernels import dsa_triton
from conftest import compile_for_h100  # noqa: E402
from model import AttnMask  # noqa: E402

if _PREVIOUS_INTERPRET is None:
    del os.environ["TRITON_INTERPRET"]
else:
    os.environ["TRITON_INTERPRET"] = _PREVIOUS_INTERPRET
# If something imported triton before this file did, its library is compiled-mode only and every kernel
# call below would fail with "Cannot call @triton.jit'd outside of the scope of a kernel".
INTERPRETED = type(tl.max).__name__ == "InterpretedFunction"

FP32_TOL = 1e-5
BF16_TOL = 1e-2
BF16_GRAD_TOL = 2e-2


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    if not INTERPRETED:
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set: run this file in its own process")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # dsa.py is the reference: with TRITON_INTERPRET=1, dsa.index_scores / select_topk / sparse_attention would
    # dispatch to these very kernels (dsa_triton.available() is true on CPU tensors then), and every check below
    # would hold the kernels to themselves. The tests that mean dsa.py to run on the kernels set it back to True.
    monkeypatch.setattr(dsa, "USE_TRITON", False)
    monkeypatch.setattr(dsa_triton, "BLOCK_K", 16)
    monkeypatch.setattr(dsa_triton, "BWD_BLOCK_K", 16)
    monkeypatch.setattr(dsa_triton, "SCORE_BLOCK_S", 16)
    monkeypatch.setattr(dsa_triton, "SCORE_ROWS", 32)
    monkeypatch.setattr(dsa_triton, "REDUCE_KEYS", 4)
    monkeypatch.setattr(dsa_triton, "MIN_SPLIT_SLOTS", 1 << 20)  # no automatic slot splits unless a test asks
    monkeypatch.setattr(dsa_triton, "_num_sms", lambda device: 132)


def err(a, b):
    """max |a - b| / max |b| in float64 over the finite entries of b; inf if a is not finite exactly
    where b is not (LSE is -inf on a query with no valid slot) or differs from b there."""
    a, b = a.double(), b.double()
    fin = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), fin) or not torch.equal(a[~fin], b[~fin]):
        return float("inf")
    return ((a - b)[fin].abs().max() / b[fin].abs().max().clamp_min(1e-30)).item()


def check(ours, ref, tol, wrong=(), what=""):
    """ours matches ref within tol, and every plausible wrong answer does not."""
    e = err(ours, ref)
    assert e < tol, f"{what}: error {e:.2e} >= {tol:.0e}"
    for i, w in enumerate(wrong):
        ew = err(w, ref)
        assert ew > 3 * tol, f"{what}: mutation {i} differs by only {ew:.2e}: the tolerance could not catch it"


# ----------------------------------------------------------------------------------------------- indexer


@pytest.mark.parametrize("HI,DI,Tk", [(1, 16, 37), (3, 8, 50), (4, 32, 16), (8, 40, 29)])
def test_index_scores_fp32_match_reference_and_topk_sets(HI, DI, Tk):
    torch.manual_seed(HI * 100 + DI)
    B, c, topk = 2, 11, 6
    q, w, k = torch.randn(B, c, HI, DI), torch.randn(B, c, HI), torch.randn(B, Tk, DI)
    ref64 = dsa.index_scores(q.double(), w.double(), k.double())
    ours = dsa_triton.index_scores(q, w, k)
    assert ours.dtype == torch.float32 and ours.shape == (B, c, Tk)
    w_drop = w.clone()
    w_drop[..., -1] = 0
    check(ours, ref64, FP32_TOL, [dsa.index_scores(q.double(), w_drop.double(), k.double()), ref64 * DI ** -0.5],
          "scores")
    # top-k from our scores == top-k from the fp32 reference (dsa.select_topk's path), under a causal mask
    mask = AttnMask(torch.arange(c) + Tk - c, Tk).dense()
    ref32 = dsa.index_scores(q, w, k)
    sets = [dsa._tie_broken(s.masked_fill(~mask, float("-inf"))).topk(topk, -1).indices.sort(-1).values
            for s in (ours, ref32)]
    s_sorted = ref64.masked_fill(~mask, float("-inf")).sort(-1, descending=True).values
    a, b = s_sorted[..., topk - 1], s_sorted[..., topk]
    exact_tie = (a == b) & ((a == 0) | a.isinf())  # ReLU zeros / masked keys: exact on both sides
    assert (exact_tie | ((a - b).abs() > 1e-4)).all(), "test data has a near tie at the top-k boundary"
    assert torch.equal(sets[0], sets[1])


def test_index_scores_bf16_inputs_and_causal_bound():
    torch.manual_seed(1)
    B, c, HI, DI, Tk = 1, 21, 4, 32, 45
    q, w, k = torch.randn(B, c, HI, DI).bfloat16(), torch.randn(B, c, HI), torch.randn(B, Tk, DI).bfloat16()
    ref = dsa.index_scores(q.double(), w.double(), k.double())  # exact products of the bf16 values
    ours = dsa_triton.index_scores(q, w, k)
    check(ours, ref, FP32_TOL, [dsa.index_scores(q.double(), w.double(), k.double().roll(1, 1))], "bf16 scores")
    # q_slot: keys after each query's slot are -inf, the rest unchanged; whole key blocks get skipped
    slot = torch.arange(c) + 3  # queries sit at slots 3..23 of 45 keys: blocks 32.. are never computed
    causal = dsa_triton.index_scores(q, w, k, q_slot=slot)
    later = torch.arange(Tk)[None, :] > slot[:, None]
    assert torch.equal(causal.isinf(), later[None].expand_as(causal))
    assert torch.equal(causal[~later[None].expand_as(causal)], ours[~later[None].expand_as(causal)])


# ----------------------------------------------------------------------------------------------- helpers


@dataclasses.dataclass
class DocMask(AttnMask):
    """A causal mask over rows of several documents (no key of another document is visible)."""
    doc: torch.Tensor | None = None  # [B, Tk] document id of each slot

    def dense(self, q0=0, q1=None):
        m = super().dense(q0, q1)
        return m if self.doc is None else m & (self.doc[:, self.q_slot[q0:q1], None] == self.doc[:, None, :])


def make_inputs(B=2, T=24, H=4, Hkv=2, D=16, topk=18, dtype=torch.float32, seed=0, doc=None, Tk=None):
    """q/k/v and a realistic (idx, valid) from dsa.select_topk under a causal (optionally packed) mask:
    early queries see fewer than topk keys, so their trailing slots are invalid."""
    g = torch.Generator().manual_seed(seed)
    Tk = Tk or T
    q = torch.randn(B, T, H, D, generator=g).to(dtype)
    k = torch.randn(B, Tk, Hkv, D, generator=g).to(dtype)
    v = torch.randn(B, Tk, Hkv, D, generator=g).to(dtype)
    mask = DocMask(torch.arange(Tk - T, Tk), Tk, doc=doc)
    iq, iw, ik = torch.randn(B, T, 2, 8, generator=g), torch.randn(B, T, 2, generator=g), torch.randn(B, Tk, 8, generator=g)
    idx, valid = dsa.select_topk(iq, iw, ik, mask, topk)
    return q, k, v, idx, valid


def reference(q, k, v, idx, valid, scale, dout=None, probs=False):
    """dsa.sparse_attention in float64 (rows with no valid slot get a dummy slot: their output is
    replaced by 0 and, with dout 0 there, they add nothing to the gradients, as in the kernels)."""
    empty = ~valid.any(-1)
    valid = valid.clone()
    valid[..., 0] |= empty
    q64, k64, v64 = (x.detach().double().requires_grad_(x.requires_grad) for x in (q, k, v))
    out = dsa.sparse_attention(q64, k64, v64, idx, valid, scale, return_probs=probs)
    out, p = out if probs else (out, None)
    out = out.masked_fill(empty[..., None, None], 0)
    grads = None
    if dout is not None:
        out.backward(dout.double().masked_fill(empty[..., None, None], 0))
        grads = [x.grad for x in (q64, k64, v64)]
    logits = torch.einsum("bthd,btkhd->bthk", q64.detach(),
                          dsa._gather(k64.detach(), idx).repeat_interleave(q.shape[2] // k.shape[2], 3)) * scale
    lse = logits.masked_fill(~valid[:, :, None, :], float("-inf")).logsumexp(-1)
    lse = lse.masked_fill(empty[..., None], float("-inf"))
    return out.detach(), lse, (p.masked_fill(empty[..., None], 0) if probs else None), grads


def wrong_gqa(k):
    """The classic GQA bug: query head h reading KV head h % Hkv instead of h // G (same when Hkv = 1)."""
    Hkv = k.shape[2]
    return k if Hkv == 1 else k[:, :, torch.arange(Hkv).roll(1)]


# ----------------------------------------------------------------------------------------------- forward


# (B = 2 runs forward in test_backward_fp32_matches_autograd, whose gradients check its output; the interpreter is
# slow, and the suite must stay under 10 minutes on 2 cores)
@pytest.mark.parametrize("B,H,Hkv", [(1, 4, 2)])  # (H = Hkv: test_backward_fp32_matches_autograd's first case)
def test_forward_fp32_values_lse_probs(B, H, Hkv):
    q, k, v, idx, valid = make_inputs(B=B, H=H, Hkv=Hkv, seed=H, T=16, topk=12)
    scale = 16 ** -0.5
    assert (~valid).any() and valid.sum(-1).min() < valid.shape[-1]  # early queries: some slots invalid
    ref, lse_ref, p_ref, _ = reference(q, k, v, idx, valid, scale, probs=True)
    out, p = dsa_triton.sparse_attention(q, k, v, idx, valid, scale, return_probs=True)  # one program per slot list
    out2, lse = dsa_triton.sparse_attention_fwd(q, k, v, idx, valid, scale, num_splits=2)  # two, then merged
    wrong_scale = reference(q, k, v, idx, valid, scale * 1.5)[0]
    dropped = ref.clone()
    dropped[:, :, -1] = 0
    assert out.dtype == q.dtype and p.dtype == torch.float32 and lse.shape == q.shape[:3]
    for o in (out, out2):
        check(o, ref, FP32_TOL, [wrong_scale, dropped, reference(q, wrong_gqa(k), v, idx, valid, scale)[0]], "out")
    check(lse, lse_ref, FP32_TOL, [reference(q, k, v, idx, valid, scale * 1.5)[1]], "lse")
    p_drop = p_ref * H / (H - 1) if H > 1 else p_ref * 0
    check(p, p_ref, FP32_TOL, [p_drop, reference(q, k, v, idx, valid, scale * 1.5, probs=True)[2]], "probs")
    assert torch.allclose(p.sum(-1), torch.ones(()), atol=1e-5) and (p[~valid] == 0).all()


def test_forward_bf16():
    q, k, v, idx, valid = make_inputs(B=1, H=4, Hkv=2, dtype=torch.bfloat16, seed=3, T=16, topk=12)
    scale = 16 ** -0.5
    ref, lse_ref, p_ref, _ = reference(q, k, v, idx, valid, scale, probs=True)
    out, p = dsa_triton.sparse_attention(q, k, v, idx, valid, scale, return_probs=True)
    assert out.dtype == torch.bfloat16
    dropped = ref.clone()
    dropped[:, :, 3] = 0
    check(out, ref, BF16_TOL, [reference(q, k, v, idx, valid, scale * 1.5)[0], dropped,
                               reference(q, wrong_gqa(k), v, idx, valid, scale)[0]], "bf16 out")
    # probabilities come from fp32 logits of exact bf16 products: fp32-close, unlike the bf16 output
    check(p, p_ref, FP32_TOL * 10, [reference(q, k, v, idx, valid, scale * 1.01, probs=True)[2]], "bf16 probs")
    # the bf16 kernel against an fp32 forward of the same inputs is as close as bf16 rounding allows
    check(dsa_triton.sparse_attention_fwd(q, k, v, idx, valid, scale)[1], lse_ref, FP32_TOL * 10, [], "bf16 lse")


def test_invalid_slots_and_empty_rows_give_zero_not_nan():
    q, k, v, idx, valid = make_inputs(T=12, Tk=24, seed=5)
    g = torch.Generator().manual_seed(0)
    valid = valid & (torch.rand(valid.shape, generator=g) > 0.3)  # holes anywhere in the slot list
    valid[:, :, 0] |= ~valid.any(-1)
    valid[0, 7] = False  # one query with no valid slot at all
    valid[1, :, :5] = False  # leading slots invalid
    valid[1, :, 5] |= ~valid[1].any(-1)
    idx = torch.where(valid, idx, torch.full_like(idx, 10**6))  # invalid slots may hold any index: never read
    scale = 0.3
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    dout = torch.randn(q.shape, generator=g)
    ref, lse_ref, p_ref, grads = reference(q, k, v, idx.clamp_max(k.shape[1] - 1), valid, scale, dout=dout, probs=True)
    out, p = dsa_triton.sparse_attention(q, k, v, idx, valid, scale, return_probs=True)
    assert torch.equal(out[0, 7], torch.zeros_like(out[0, 7])) and torch.equal(p[0, 7], torch.zeros_like(p[0, 7]))
    lse = dsa_triton.sparse_attention_fwd(q, k, v, idx, valid, scale)[1]
    assert lse[0, 7].eq(float("-inf")).all()
    check(lse, lse_ref, FP32_TOL, [lse_ref.nan_to_num(neginf=0.0)], "lse")
    _, _, p_all, g_all = reference(q, k, v, idx.clamp_max(k.shape[1] - 1), torch.ones_like(valid), scale, dout=dout,
                                   probs=True)  # the bug of ignoring `valid`
    check(out, ref, FP32_TOL, [], "out")
    check(p, p_ref, FP32_TOL, [p_all], "probs")
    out.backward(dout)
    assert torch.equal(q.grad[0, 7], torch.zeros_like(q.grad[0, 7]))
    for x, r, w, name in zip((q, k, v), grads, g_all, "qkv"):
        assert torch.isfinite(x.grad).all()
        check(x.grad, r, FP32_TOL, [w], f"d{name}")


def test_packed_rows_two_documents():
    T = 16
    doc = torch.tensor([[0] * 6 + [1] * 10, [0] * 11 + [1] * 5])
    q, k, v, idx, valid = make_inputs(T=T, topk=7, doc=doc, seed=7)
    # every selected key is in the query's own document
    d_key = torch.gather(doc, 1, idx.flatten(1)).view(idx.shape)
    assert (d_key == doc[:, :, None])[valid].all()
    scale = 0.25
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    dout = torch.randn(q.shape)
    ref, _, _, grads = reference(q, k, v, idx, valid, scale, dout=dout)
    out = dsa_triton.sparse_attention(q, k, v, idx, valid, scale)
    check(out, ref, FP32_TOL, [reference(q, k, v, idx, valid, scale * 2)[0]], "out")
    out.backward(dout)
    for x, r, name in zip((q, k, v), grads, "qkv"):
        check(x.grad, r, FP32_TOL, [reference(q, k, v, idx, valid, scale * 1.5, dout=dout)[3]["qkv".index(name)]],
              f"d{name}")


# ----------------------------------------------------------------------------------------------- backward


# (2, 4, 2, 5): several backward chunks, one spanning the two batch rows (H = 8 there, or a second such case,
# cost 10-25 s more under the interpreter for little more: the G = 4 grouping is (1, 4, 1)'s)
@pytest.mark.parametrize("B,H,Hkv,chunk_rows", [(1, 2, 2, None), (2, 4, 2, 5), (1, 4, 1, None)])
def test_backward_fp32_matches_autograd(monkeypatch, B, H, Hkv, chunk_rows):
    q, k, v, idx, valid = make_inputs(B=B, H=H, Hkv=Hkv, seed=11 + H, T=12 if B > 1 else 24, topk=8 if B > 1 else 18)
    if chunk_rows:  # several backward chunks, one spanning the two batch rows (rows 10..14)
        monkeypatch.setattr(dsa_triton, "BWD_BUFFER_BYTES", chunk_rows * idx.shape[-1] * Hkv * 16 * 8)
    scale = 16 ** -0.5
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    dout = torch.randn(q.shape)
    _, _, _, grads = reference(q, k, v, idx, valid, scale, dout=dout)
    dsa_triton.sparse_attention(q, k, v, idx, valid, scale).backward(dout)
    dout_drop = dout.clone()
    dout_drop[:, :, 0] = 0
    _, _, _, g_drop = reference(q, k, v, idx, valid, scale, dout=dout_drop)  # a head's gradient lost
    _, _, _, g_scale = reference(q, k, v, idx, valid, scale * 1.5, dout=dout)
    for i, (x, name) in enumerate(zip((q, k, v), "qkv")):
        check(x.grad, grads[i], FP32_TOL, [g_drop[i], g_scale[i]], f"d{name}")


def test_backward_bf16():
    q, k, v, idx, valid = make_inputs(B=1, H=8, Hkv=2, dtype=torch.bfloat16, seed=13, T=16, topk=12)
    scale = 16 ** -0.5
    dout = torch.randn(q.shape).bfloat16()
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    _, _, _, grads = reference(q, k, v, idx, valid, scale, dout=dout)
    _, _, _, g_scale = reference(q, k, v, idx, valid, scale * 1.5, dout=dout)
    dsa_triton.sparse_attention(q, k, v, idx, valid, scale).backward(dout)
    for i, (x, name) in enumerate(zip((q, k, v), "qkv")):
        assert x.grad.dtype == torch.bfloat16
        check(x.grad, grads[i], BF16_GRAD_TOL, [g_scale[i]], f"bf16 d{name}")


def test_backward_split_slots_and_partial_requires_grad(monkeypatch):
    monkeypatch.setattr(dsa_triton, "MIN_SPLIT_SLOTS", 8)  # pass A also splits the slots (dQ partial sums)
    q, k, v, idx, valid = make_inputs(B=1, T=8, Tk=24, H=4, Hkv=2, seed=19)
    scale = 16 ** -0.5
    dout = torch.randn(q.shape)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    _, _, _, grads = reference(q, k, v, idx, valid, scale, dout=dout)
    dsa_triton.sparse_attention(q, k, v, idx, valid, scale).backward(dout)
    for i, (x, name) in enumerate(zip((q, k, v), "qkv")):
        check(x.grad, grads[i], FP32_TOL, [grads[i] * 1.01], f"d{name}")
    # only q needs a gradient (pass A without the dK/dV buffer), then only k and v
    q2 = q.detach().requires_grad_()
    dsa_triton.sparse_attention(q2, k.detach(), v.detach(), idx, valid, scale).backward(dout)
    assert torch.equal(q2.grad, q.grad)
    k2, v2 = k.detach().requires_grad_(), v.detach().requires_grad_()
    dsa_triton.sparse_attention(q.detach(), k2, v2, idx, valid, scale).backward(dout)
    assert torch.equal(k2.grad, k.grad) and torch.equal(v2.grad, v.grad)


def test_one_key_chosen_by_every_query_and_determinism(monkeypatch):
    """Key 0 (an attention sink) and key 5 sit in every query's set, one row also lists a key twice:
    many contributions land on the same dK/dV rows. Two backward runs are bit-identical."""
    monkeypatch.setattr(dsa_triton, "BWD_BUFFER_BYTES", 7 * 18 * 2 * 16 * 8)
    q, k, v, idx, valid = make_inputs(T=14, Tk=24, H=4, Hkv=2, seed=17)
    idx = idx.clone()
    idx[:, :, 0], idx[:, :, 1] = 0, 5
    valid = valid.clone()
    valid[:, :, :2] = True
    idx[1, 10, 2], valid[1, 10, 2] = 5, True  # a duplicate slot: counted twice, like the reference does
    scale = 0.2
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    dout = torch.randn(q.shape)
    ref, _, _, grads = reference(q, k, v, idx, valid, scale, dout=dout)
    runs = []
    for _ in range(2):
        q.grad = k.grad = v.grad = None
        out = dsa_triton.sparse_attention(q, k, v, idx, valid, scale)
        out.backward(dout)
        runs.append((out.detach(), q.grad, k.grad, v.grad))
    check(runs[0][0], ref, FP32_TOL, [], "out")
    for i, name in enumerate("qkv"):
        check(runs[0][i + 1], grads[i], FP32_TOL, [grads[i] * 0.99], f"d{name}")
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    # Programs run one after another in the interpreter, so the line above cannot catch a race there;
    # on a GPU it can. What makes it hold is structural: no kernel accumulates through atomics.
    import inspect
    assert "atomic" not in inspect.getsource(dsa_triton).replace("no atomics", "").replace("through atomics", "")


# ----------------------------------------------------------------------------------------------- decode


@pytest.mark.parametrize("splits", [None, 1])
def test_decode_against_partly_filled_cache(monkeypatch, splits):
    """One new query per row against a cache of 64 slots, 45 filled (row 1 left-padded by 6 slots);
    the unfilled slots hold NaN, which would poison the output if any were read."""
    monkeypatch.setattr(dsa_triton, "MIN_SPLIT_SLOTS", 16)  # 40 slots -> 2 programs per (row, KV head)
    B, S, length, H, Hkv, D, topk = 2, 64, 45, 8, 2, 16, 40
    g = torch.Generator().manual_seed(23)
    k_cache = torch.full((B, S, Hkv, D), float("nan"))
    v_cache = torch.full((B, S, Hkv, D), float("nan"))
    k_cache[:, :length] = torch.randn(B, length, Hkv, D, generator=g)
    v_cache[:, :length] = torch.randn(B, length, Hkv, D, generator=g)
    key_mask = torch.ones(B, length, dtype=torch.bool)
    key_mask[1, :6] = False
    mask = AttnMask(torch.tensor([length - 1]), length, k_valid=key_mask)
    ik = torch.randn(B, length, 8, generator=g)
    idx, valid = dsa.select_topk(torch.randn(B, 1, 2, 8, generator=g), torch.randn(B, 1, 2, generator=g), ik, mask, topk)
    assert valid[0].all() and valid[1].sum() == length - 6  # row 1: fewer visible keys than top-k
    q = torch.randn(B, 1, H, D, generator=g)
    scale = 16 ** -0.5
    k, v = k_cache[:, :length], v_cache[:, :length]  # the engine's view: strided, not contiguous
    assert not k.is_contiguous()
    ref, lse_ref, p_ref, _ = reference(q, k, v, idx, valid, scale, probs=True)
    out, lse = dsa_triton.sparse_attention_fwd(q, k, v, idx, valid, scale, num_splits=splits)
    _, p = dsa_triton.sparse_attention(q, k_cache, v_cache, idx, valid, scale, return_probs=True)  # whole cache
    check(out, ref, FP32_TOL, [reference(q, wrong_gqa(k), v, idx, valid, scale)[0]], "decode out")
    check(lse, lse_ref, FP32_TOL, [], "decode lse")
    check(p, p_ref, FP32_TOL, [], "decode probs")


# ----------------------------------------------------------------------------------------------- dispatch


def test_available_and_import_without_triton():
    assert dsa_triton.available(torch.zeros(1))
    code = ("import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
            "import torch\nfrom kernels import dsa_triton\n"
            "assert dsa_triton.triton is None and not dsa_triton.available(torch.zeros(1))\n"
            "try:\n    dsa_triton.index_scores(torch.zeros(1, 1, 1, 16), torch.zeros(1, 1, 1), torch.zeros(1, 2, 16))\n"
            "except RuntimeError as e:\n    assert 'triton' in str(e)\nelse:\n    raise SystemExit('no error')\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stderr


COMPILE_SCRIPT = """
import triton
from kernels import dsa_triton
assert dsa_triton._import_triton()  # sets the kernels' global tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

floats = {"scale", "scale_log2", "inv_h", "temperature"}
unit_strides = {"sqd", "skd", "svd", "sik", "svlk", "swh", "sss", "sxv"}
ptr = dict(IDX="*i64", VALID="*u8", SLOT="*i64", W="*fp32", S="*fp32", LSE="*fp32", DELTA="*fp32", P="*fp32",
           PM="*fp32", PL="*fp32", PACC="*fp32", DQP="*fp32", DKP="*fp32", DVP="*fp32", DK="*fp32", DV="*fp32",
           PERM="*i64", LO="*i64", HI="*i64", Q="*bf16", Kx="*bf16", V="*bf16", O="*bf16", DO="*bf16",
           X="*bf16", KEYS="*i64", TOK="*i64", LP="*fp32", PS="*fp32", PB="*i32", PTOP="*fp32", PAT="*i64")
common = dict(UPCAST=False, PREC="tf32")
attn = dict(GP=16, DP=128, BK=64, **common)
cases = [("scores", dict(BT=4, HP=32, BS=128, BD=128, CAUSAL=True, **common), 8, 2),
         ("fwd", dict(SPLIT=False, **attn), 4, 2), ("fwd", dict(SPLIT=True, **attn), 4, 2),
         ("combine", dict(SP=8, DP=128), 4, 1), ("probs", attn, 4, 2),
         ("bwd_query", dict(STORE_DQ=True, STORE_KV=True, **attn), 8, 2),
         ("bwd_reduce", dict(KB=16, DP=128), 4, 1)]
cases += [("sample", dict(BV=4096, NSPLIT=4, SP=4, PHASE=phase), 8, 1) for phase in (1, 2, 3)]
for name, consts, warps, stages in cases:
    fn = JITFunction(dsa_triton._KERNEL_FNS[name])
    consts = {**consts, **{a: 1 for a in fn.arg_names if a in unit_strides}}
    sig = {a: "constexpr" if a in consts else ptr.get(a, "fp32" if a in floats else "i32") for a in fn.arg_names}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=warps, num_stages=stages))
    assert kernel.asm["cubin"], name
    print(name, "ok")
"""


def test_kernels_compile_for_h100():
    """The interpreter accepts some programs that the GPU compiler rejects (16-bit tl.dot operand
    mismatches, block shapes, loop-carried types), so compile the bf16 kernels at GLM-9B's shape for
    sm_90 with Triton's own compiler and ptxas (no GPU needed; last-dim strides of 1, as a launch
    specialises them), in a fresh process: this one's triton was imported in interpreter mode."""
    compile_for_h100(COMPILE_SCRIPT)


# ----------------------------------------------------------------------------------------------- dispatch

def test_the_model_runs_the_kernels_and_matches_pytorch(monkeypatch):
    """dsa.py dispatches to the kernels where they are available (CUDA; here the interpreter): the DSA
    model's packed forward, its backward and its cached decode then equal the plain-PyTorch path."""
    from model import GLM, GLMConfig, KVCache
    torch.manual_seed(0)
    cfg = GLMConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
                    head_dim=16, dsa=dict(topk=4, heads=2, head_dim=16, rope_dim=4, pattern="FS"))
    m = GLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    ids = torch.randint(0, 40, (1, 14))
    pos = torch.cat([torch.arange(8), torch.arange(6)])[None]  # a packed row of two sequences
    calls = []
    for name in ("index_scores", "sparse_attention"):
        real = getattr(dsa_triton, name)
        monkeypatch.setattr(dsa_triton, name, lambda *a, _real=real, _n=name, **k: calls.append(_n) or _real(*a, **k))

    def run():
        m.zero_grad()
        out = m(ids, position_ids=pos)
        out.square().mean().backward()
        grads = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
        with torch.no_grad():
            cache = KVCache(cfg, 1, 8)
            steps = [m(ids[:, :3], cache=cache)] + [m(ids[:, t:t + 1], cache=cache) for t in range(3, 8)]
        return out.detach(), grads, torch.cat(steps, 1)

    monkeypatch.setattr(dsa, "USE_TRITON", False)
    ref = run()
    assert not calls
    monkeypatch.setattr(dsa, "USE_TRITON", True)
    got = run()
    assert {"index_scores", "sparse_attention"} <= set(calls)
    for a, b, what in zip(got, ref, ("packed forward", "gradients", "cached decode")):
        check(a, b, 1e-4, what=what)
    check(got[2], got[0][:, :8], 1e-4, what="kernel decode vs kernel full forward")


# ----------------------------------------------------------------------------------------------- sampling

@pytest.mark.parametrize("dtype,slice_", [(torch.float32, 8192), (torch.bfloat16, 64)])
def test_sample_is_engine_sample_tokens(monkeypatch, dtype, slice_):
    """The fused sampler against engine.sample_tokens' PyTorch path (the specification) on the same logits:
    the same tokens (same hashed noise, same argmax) and logprobs within 1e-6, over several vocabulary
    blocks and a partial one, a row's vocabulary in one slice (fp32) or in 3 (bf16, as a GPU's logits: two
    blocks, two, one partial), three temperatures, a [B, 1, V] view's strides, and rows with an inf or a NaN
    logit (uniform draw, logprob NaN). A wrong noise key would change most tokens."""
    from machinery import engine
    monkeypatch.setattr(dsa_triton, "SAMPLE_BLOCK", 64)
    monkeypatch.setattr(dsa_triton, "SAMPLE_SLICE", slice_)
    torch.manual_seed(0)
    B, V = 12, 300
    logits = (torch.randn(B, 1, V) * 3).to(dtype)[:, -1]  # strides (V, 1) of a decode step's last position
    logits[5, 17], logits[7, 3] = float("inf"), float("nan")
    keys = engine.sample_keys(torch.arange(B) * 7919 % 2**32, torch.full((B,), 3))
    for t in (1.0, 0.7, 2.0):
        monkeypatch.setattr(dsa, "USE_TRITON", False)
        ref_tok, ref_lp = engine.sample_tokens(logits, engine.SamplingParams(temperature=t), keys)
        monkeypatch.setattr(dsa, "USE_TRITON", True)
        calls = []
        monkeypatch.setattr(dsa_triton, "sample", lambda *a, _real=dsa_triton.sample: calls.append(1) or _real(*a))
        tok, lp = engine.sample_tokens(logits, engine.SamplingParams(temperature=t), keys)
        assert calls and torch.equal(tok, ref_tok)
        assert torch.equal(lp.isnan(), ref_lp.isnan()) and lp.isnan()[[5, 7]].all()
        assert torch.allclose(lp.nan_to_num(), ref_lp.nan_to_num(), atol=1e-6, rtol=0)
        assert (dsa_triton.sample(logits, t, keys + 1)[0] != ref_tok).float().mean() > 0.5
    calls.clear()  # greedy and top-p stay on the PyTorch path
    engine.sample_tokens(logits, engine.SamplingParams(temperature=0), keys)
    engine.sample_tokens(logits, engine.SamplingParams(temperature=1.0, top_p=0.9), keys)
    assert not calls


def sample_against_pytorch(B, V, device, monkeypatch):
    """dsa_triton.sample and engine.sample_tokens' PyTorch path on the same bf16 logits [B, V] on device -> (rows whose
    tokens differ, rows whose best two scores are within 1e-4 in float64 on the CPU: near ties that the two paths' exp
    and log may order either way, max |logprob difference|)."""
    from machinery import engine, sampler
    g = torch.Generator().manual_seed(B)
    logits = (torch.randn(B, V, generator=g) * 4).to(torch.bfloat16)
    keys = engine.sample_keys(torch.arange(B) * 7919 % 2**32, torch.full((B,), 5))
    tok, lp = dsa_triton.sample(logits.to(device), 1.0, keys.to(device))
    monkeypatch.setattr(dsa, "USE_TRITON", False)
    ref_tok, ref_lp = engine.sample_tokens(logits.to(device), engine.SamplingParams(temperature=1.0), keys.to(device))
    monkeypatch.setattr(dsa, "USE_TRITON", True)
    u = ((sampler._mix32(keys[:, None] ^ sampler._vocab_hash(V, "cpu")[None]) >> 9).double() + 0.5) * 2.0 ** -23
    top2 = (logits.double().log_softmax(-1) - u.log().neg().log()).topk(2, -1).values  # [B, 2]
    near = set(torch.nonzero(top2[:, 0] - top2[:, 1] < 1e-4)[:, 0].tolist())
    differ = set(torch.nonzero(tok.cpu() != ref_tok.cpu())[:, 0].tolist())
    return differ, near, (lp.cpu() - ref_lp.cpu()).abs().max().item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_sample_at_glms_vocabulary_is_the_pytorch_paths(monkeypatch):
    """On a GPU at GLM's vocabulary (151,552 ids), bf16 logits, 64 and 256 rows (13 and 4 slices a row): the fused
    sampler draws the PyTorch path's tokens but at near ties, with logprobs within 1e-4."""
    for B in (64, 256):
        differ, near, lp_err = sample_against_pytorch(B, 151552, "cuda", monkeypatch)
        assert differ <= near and lp_err < 1e-4, (B, differ - near, lp_err)


def test_sample_noise_is_finite_at_glms_vocabulary(monkeypatch):
    """The kernel on the key and token of test_engine's finite-noise test (a hash with its top 24 bits set):
    the token with logit -60 is not drawn, and the draw is the PyTorch path's."""
    from machinery import engine
    from test_engine import key_with_a_full_hash
    V = 151552
    key, tok = key_with_a_full_hash(V)
    logits = torch.zeros(1, V)
    logits[0, tok] = -60.0
    drawn, lp = dsa_triton.sample(logits, 1.0, torch.tensor([key]))
    assert int(drawn) != tok
    monkeypatch.setattr(dsa, "USE_TRITON", False)
    ref = engine.sample_tokens(logits, engine.SamplingParams(temperature=1.0), torch.tensor([key]))
    assert torch.equal(drawn, ref[0]) and torch.allclose(lp, ref[1], atol=1e-6)


def test_engine_on_the_kernels_generates_what_pytorch_does(monkeypatch):
    """TorchEngine where the kernels run (CUDA; here the interpreter): paged decode attention on the
    Triton kernel and the fused sampler give the sampled tokens and logprobs of the PyTorch path; so does a
    session's second turn, whose new tokens extend the parked KV through the same kernel."""
    from machinery import engine
    from model import GLM, GLMConfig
    torch.manual_seed(0)
    m = GLM(GLMConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16))
    prompts, sp = [[1, 2, 3], [4, 5], [6]] * 2, engine.SamplingParams(temperature=1.0, max_new_tokens=6)
    monkeypatch.setattr(dsa, "USE_TRITON", False)
    ref = engine.TorchEngine(m, max_batch=4).generate(prompts, sp, seed=1)
    monkeypatch.setattr(dsa, "USE_TRITON", True)
    calls = []
    for name in ("sample", "sparse_attention"):
        real = getattr(dsa_triton, name)
        monkeypatch.setattr(dsa_triton, name, lambda *a, _real=real, _n=name, **k: calls.append(_n) or _real(*a, **k))
    got = engine.TorchEngine(m, max_batch=4).generate(prompts, sp, seed=1)
    assert {"sample", "sparse_attention"} <= set(calls)
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    assert [lp for c in got for lp in c.logprobs] == pytest.approx([lp for c in ref for lp in c.logprobs], abs=1e-5)

    def two_turns():  # a session: the second turn extends the first's parked KV (its rows are queries of the kernel)
        e = engine.TorchEngine(m, max_batch=2)
        with e.session(sp, 40) as call:
            call.submit([1, 2, 3], 6, 5, key=0)
            first = [c for _ in iter(lambda: call.busy, False) for _, c in call.step()][0]
            call.submit([1, 2, 3] + first.token_ids + [7, 8], 6, 6, key=0, park=False)
            second = [c for _ in iter(lambda: call.busy, False) for _, c in call.step()][0]
        assert e.stats["extends"] == 1
        return first.token_ids + second.token_ids, first.logprobs + second.logprobs

    calls.clear()
    tok, lp = two_turns()
    assert "sparse_attention" in calls
    monkeypatch.setattr(dsa, "USE_TRITON", False)
    tok_ref, lp_ref = two_turns()
    assert tok == tok_ref and lp == pytest.approx(lp_ref, abs=1e-5)
