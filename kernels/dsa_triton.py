"""
Triton kernels for DeepSeek Sparse Attention (dsa.py is the specification; these compute the same things),
and the engine's fused sampler (engine.sample_tokens is its specification).

    index_scores(q, w, k, q_slot=None)          -> fp32 [B, c, Tk]   the lightning indexer, heads fused
    sparse_attention(q, k, v, idx, valid, scale, return_probs=False)
                                                 -> out [B, Tq, H, D] (, probs [B, Tq, K] fp32)
    sparse_attention_fwd(q, k, v, idx, valid, scale) -> (out, lse [B, Tq, H] fp32), no autograd
    sample(logits, temperature, keys)           -> tokens [B], logprobs [B] fp32   hashed Gumbel-max sampling
    available(t)                                 -> whether these kernels can run on t's device

`index_scores` and `sparse_attention` have dsa.py's signatures and results, so dsa.py calls them in one
line. Importing this module needs neither a GPU nor triton: triton is imported, and the kernels are
compiled, on first use (with TRITON_INTERPRET=1 they run on CPU tensors in Triton's interpreter, which is
how tests/test_dsa_triton.py checks them).

Indexer: one program per (batch, block of queries, block of keys). The block's queries times all H_I
heads form the M side of one matmul against the block's keys; ReLU, the per-head weight and the sum over
heads happen on chip, so [B, c, H_I, Tk] never exists. With `q_slot` (each query's own slot) keys after
a query's slot come out as -inf (the causal part of every DSA mask) and key blocks after the block's last
query are skipped: up to half the work of a causal prefill, when a chunk holds many queries.

Sparse attention forward: one program per (query, KV head). It loads the query's G = H/Hkv heads (the M
side of tl.dot, padded to 16), then streams the selected keys and values in blocks of BLOCK_K rows,
gathered straight from k/v by index, with an online softmax in fp32 (logits, running max and sum). It
writes the output and the log-sum-exp [B, Tq, H]. Invalid slots are masked loads (no memory traffic);
a query with no valid slot gives 0 (and LSE -inf), not NaN. When there are too few (query, KV head)
pairs to fill the GPU (decoding: Tq = 1), the slots are also split across programs, and a small kernel
merges the partial softmaxes in a fixed order. `return_probs` runs a second pass that recomputes the
logits of each slot for all heads against the LSE: the head-averaged probabilities, summed over heads
in a fixed order.

Sparse attention backward (deterministic, no atomics):
  pass A, one program per (query, KV head[, slot split]): recompute P = exp(logits - LSE),
    dP = dO V^T, dS = P (dP - Delta) with Delta = rowsum(dO * O); accumulate dQ = dS K scale, and
    write each selected slot's contribution to its key, dK_slot = dS^T Q scale and dV_slot = P^T dO
    (the G heads already summed: one row of D per slot), into an fp32 buffer;
  pass B, one program per block of keys: an inverted index (a stable sort of the (batch, key) of every
    valid slot, as CSR offsets) lists, for every key, the slots that chose it in (query, slot) order,
    and the program sums those rows in that order into fp32 dK/dV.
  The buffer holds BWD_BUFFER_BYTES at most (1 GiB: 256 queries at GLM-9B's shape, K = 2048): queries go
  through passes A and B in chunks, each chunk's sums added to the fp32 accumulators in chunk order.
  Every sum has a fixed order (dQ's partial sums over slot splits, when there are any, are added by one
  torch.sum), so two runs give bit-identical gradients; a different BWD_BUFFER_BYTES or GPU model (the
  split heuristic reads the SM count) may change the last bits. Why this and not a per-key walk over
  the queries (one program per key reading every query that chose it): per slot and KV head that walk
  reads the query's q and dO for all G heads, 4*G*D bytes (64*D at G = 16), and dQ then needs a pass of
  its own; passes A+B read k and v once (4*D bytes in bf16) and write and read back one fp32 row each
  for dK and dV (16*D), about 3x less traffic, at the price of the buffer and a sort per chunk.

Sampler: a row's vocabulary in slices of at least SAMPLE_SLICE ids (as many as bring B x slices to
SAMPLE_PROGRAMS: one program streaming a whole row of ~150k logits took 200-236 us a call on an H200 at 16-256
rows, the fifth GPU run's profiles), each slice streamed twice in blocks of SAMPLE_BLOCK by its own program:
first the slice's log-sum-exp of logits / T (online max and sum, and whether all are finite); then, with the
row's log-sum-exp combined from its slices in a fixed order, logp, the Gumbel noise hashed from the row's key
and each token id (engine._mix32, in int64 as there), and the slice's running argmax of logp + noise; a last
launch takes the row's best slice. First index among equals throughout.
Numerics: fp32 inputs use full-precision fp32 matmuls (input_precision="ieee"); bf16/fp16 inputs use
tensor-core matmuls with fp32 accumulation, the softmax probabilities (and dS) rounded to the input
dtype before their matmul with V (K, Q, dO), as fused attention kernels do.
"""
from __future__ import annotations  # kernel annotations stay strings: this file imports without triton

import contextlib
import functools
import os

import torch

# Triton is imported on first use, not here: importing this module (dsa.py does) must neither need triton
# nor fix triton's mode, which it reads from TRITON_INTERPRET when triton.language is first imported.
triton = tl = None
_TRITON_MISSING = False

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# Block sizes (powers of 2). Tests shrink them to cover multi-block paths on tiny shapes.
BLOCK_K = 64  # selected slots per step of the sparse attention forward (and probs) kernels
BWD_BLOCK_K = 64  # selected slots per step of backward pass A
SCORE_BLOCK_S = 128  # keys per indexer program
SCORE_ROWS = 128  # (query, indexer head) rows per indexer program: queries per program = SCORE_ROWS / H_I
REDUCE_KEYS = 16  # keys per program of backward pass B
BWD_BUFFER_BYTES = 1 << 30  # fp32 dK/dV slot buffer of backward pass A (queries go in chunks to fit)
MIN_SPLIT_SLOTS = 128  # fewest slots per program when the slots of a query are split over programs


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _import_triton() -> bool:
    global triton, tl, _TRITON_MISSING
    if triton is None and not _TRITON_MISSING:
        try:
            import triton as triton_
            import triton.language as tl_
        except ImportError:
            _TRITON_MISSING = True
        else:
            triton, tl = triton_, tl_  # the kernels' global `tl`, resolved when they compile
    return triton is not None


def available(t: torch.Tensor) -> bool:
    """True when the kernels can run on t: t is on CUDA and triton imports, or t is on the CPU with
    TRITON_INTERPRET=1 set (Triton's interpreter: slow, for tests) and triton imports."""
    if not (t.is_cuda or (t.device.type == "cpu" and _interpret())):
        return False
    return _import_triton()


def _p2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (int(n) - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter: pretend to be an H100, so CPU tests take the same code paths


def _precision(dtype) -> str:
    # fp32 inputs: exact fp32 products (no TF32), as the fp32 reference; 16-bit inputs: tensor cores.
    return "ieee" if dtype == torch.float32 or _interpret() else "tf32"


# ----------------------------------------------------------------------------------------------- kernels
# Plain functions, compiled by _kernels() on first use (so TRITON_INTERPRET is read then, not at import).
# UPCAST (interpreter only: its tl.dot does not handle bf16) turns loaded 16-bit tiles into fp32 after
# the same roundings the GPU path does, so the interpreter checks the GPU path's numerics.


def _index_scores_kernel(Q, W, Kx, S, SLOT, c, Tk, NHI, DI,
                         sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd, ssb, sst, sss, scale,
                         BT: tl.constexpr, HP: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr,
                         CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_t = pid_t * BT + tl.arange(0, BT)
    offs_s = pid_s * BS + tl.arange(0, BS)
    tmask = offs_t < c
    smask = offs_s < Tk
    if CAUSAL:
        slot = tl.load(SLOT + offs_t, mask=tmask, other=-1)
        run = pid_s * BS <= tl.max(slot, axis=0)
    else:
        slot = offs_t  # unused
        run = pid_s >= 0
    res = tl.full([BT, BS], float("-inf"), tl.float32)
    if run:
        rows = tl.arange(0, BT * HP)  # (query, head) pairs, head fastest
        rt = pid_t * BT + rows // HP
        rh = rows % HP
        rmask = (rt < c) & (rh < NHI)
        wr = tl.load(W + b * swb + rt * swt + rh * swh, mask=rmask, other=0.0).to(tl.float32)
        acc = tl.zeros([BT * HP, BS], tl.float32)
        for d0 in range(0, DI, BD):
            offs_d = d0 + tl.arange(0, BD)
            dmask = offs_d < DI
            q = tl.load(Q + b * sqb + rt[:, None] * sqt + rh[:, None] * sqh + offs_d[None, :] * sqd,
                        mask=rmask[:, None] & dmask[None, :], other=0.0)
            k = tl.load(Kx + b * skb + offs_s[:, None] * sks + offs_d[None, :] * skd,
                        mask=smask[:, None] & dmask[None, :], other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
                k = k.to(tl.float32)
            acc = tl.dot(q, tl.trans(k), acc, input_precision=PREC)
        acc = tl.maximum(acc, 0.0) * wr[:, None]
        res = tl.sum(tl.reshape(acc, (BT, HP, BS)), axis=1) * scale
        if CAUSAL:
            res = tl.where(offs_s[None, :] <= slot[:, None], res, float("-inf"))
    tl.store(S + b * ssb + offs_t[:, None] * sst + offs_s[None, :] * sss, res,
             mask=tmask[:, None] & smask[None, :])


def _attn_fwd_kernel(Q, Kx, V, IDX, VALID, O, LSE, PM, PL, PACC,
                     sqb, sqt, sqh, sqd, skb, skt, skh, skd, svb, svt, svh, svd,
                     sib, sit, sik, svlb, svlt, svlk,
                     Tq, H, G, D, NK, NROWS, slots_per_split, scale_log2,
                     GP: tl.constexpr, DP: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                     UPCAST: tl.constexpr, PREC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # b * Tq + t
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    b = row // Tq
    t = row % Tq
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, DP)
    gmask = offs_g < G
    dmask = offs_d < D
    heads = kvh * G + offs_g
    q = tl.load(Q + b * sqb + t * sqt + heads[:, None] * sqh + offs_d[None, :] * sqd,
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = Kx + b * skb + kvh * skh
    v_base = V + b * svb + kvh * svh
    i_base = IDX + b * sib + t * sit
    vl_base = VALID + b * svlb + t * svlt
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    start = split * slots_per_split
    end = tl.minimum(start + slots_per_split, NK)
    for s0 in range(start, end, BK):
        offs_k = s0 + tl.arange(0, BK)
        inb = offs_k < end
        ids = tl.load(i_base + offs_k * sik, mask=inb, other=0)
        ok = (tl.load(vl_base + offs_k * svlk, mask=inb, other=0) != 0) & inb
        kv_mask = ok[:, None] & dmask[None, :]
        kt = tl.load(k_base + ids[:, None] * skt + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
        vt = tl.load(v_base + ids[:, None] * svt + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        s = tl.dot(q, tl.trans(kt), input_precision=PREC) * scale_log2  # [GP, BK], log2 units
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid slot yet: keep exp2 finite
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(s - m_use[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        pv = p.to(V.dtype.element_ty).to(vt.dtype)  # rounded as the GPU's 16-bit matmul input
        acc = acc * alpha[:, None] + tl.dot(pv, vt, input_precision=PREC)
        m = m_new
    if SPLIT:
        pidx = (split * NROWS + row) * H + heads
        tl.store(PM + pidx, m, mask=gmask)
        tl.store(PL + pidx, l, mask=gmask)
        tl.store(PACC + pidx[:, None] * D + offs_d[None, :], acc, mask=gmask[:, None] & dmask[None, :])
    else:
        has = l > 0
        l_use = tl.where(has, l, 1.0)
        out = acc / l_use[:, None]
        lse = tl.where(has, (m + tl.log2(l_use)) * 0.6931471805599453, float("-inf"))
        tl.store(O + (row * H + heads)[:, None] * D + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=gmask[:, None] & dmask[None, :])
        tl.store(LSE + row * H + heads, lse, mask=gmask)


def _attn_combine_kernel(PM, PL, PACC, O, LSE, NROWS, H, D, NSPLIT,
                         SP: tl.constexpr, DP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, SP)
    offs_d = tl.arange(0, DP)
    smask = sp < NSPLIT
    dmask = offs_d < D
    pidx = (sp * NROWS + row) * H + h
    m = tl.load(PM + pidx, mask=smask, other=float("-inf"))
    l = tl.load(PL + pidx, mask=smask, other=0.0)
    acc = tl.load(PACC + pidx[:, None] * D + offs_d[None, :], mask=smask[:, None] & dmask[None, :], other=0.0)
    mx = tl.max(m, axis=0)
    mx_use = tl.where(mx == float("-inf"), 0.0, mx)
    wgt = tl.exp2(m - mx_use)
    total = tl.sum(wgt * l, axis=0)
    has = total > 0
    t_use = tl.where(has, total, 1.0)
    out = tl.sum(acc * wgt[:, None], axis=0) / t_use
    lse = tl.where(has, (mx_use + tl.log2(t_use)) * 0.6931471805599453, float("-inf"))
    tl.store(O + (row * H + h) * D + offs_d, out.to(O.dtype.element_ty), mask=dmask)
    tl.store(LSE + row * H + h, lse)


def _attn_probs_kernel(Q, Kx, IDX, VALID, LSE, P,
                       sqb, sqt, sqh, sqd, skb, skt, skh, skd, sib, sit, sik, svlb, svlt, svlk,
                       Tq, H, Hkv, G, D, NK, scale_log2, inv_h,
                       GP: tl.constexpr, DP: tl.constexpr, BK: tl.constexpr,
                       UPCAST: tl.constexpr, PREC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    b = row // Tq
    t = row % Tq
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, DP)
    offs_k = blk * BK + tl.arange(0, BK)
    gmask = offs_g < G
    dmask = offs_d < D
    inb = offs_k < NK
    ids = tl.load(IDX + b * sib + t * sit + offs_k * sik, mask=inb, other=0)
    ok = (tl.load(VALID + b * svlb + t * svlt + offs_k * svlk, mask=inb, other=0) != 0) & inb
    total = tl.zeros([BK], tl.float32)
    for n in range(0, Hkv):  # KV heads in order: a fixed summation order
        heads = n * G + offs_g
        q = tl.load(Q + b * sqb + t * sqt + heads[:, None] * sqh + offs_d[None, :] * sqd,
                    mask=gmask[:, None] & dmask[None, :], other=0.0)
        kt = tl.load(Kx + b * skb + n * skh + ids[:, None] * skt + offs_d[None, :] * skd,
                     mask=ok[:, None] & dmask[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
            kt = kt.to(tl.float32)
        lse = tl.load(LSE + row * H + heads, mask=gmask, other=float("-inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        s = tl.dot(q, tl.trans(kt), input_precision=PREC) * scale_log2
        p = tl.exp2(s - lse2[:, None])
        p = tl.where(gmask[:, None] & ok[None, :], p, 0.0)
        total += tl.sum(p, axis=0)
    tl.store(P + row * NK + offs_k, total * inv_h, mask=inb)


def _attn_bwd_query_kernel(Q, Kx, V, DO, LSE, DELTA, IDX, VALID, DQP, DKP, DVP,
                           sqb, sqt, sqh, sqd, skb, skt, skh, skd, svb, svt, svh, svd,
                           sib, sit, sik, svlb, svlt, svlk,
                           Tq, H, Hkv, G, D, NK, row0, nrows, slots_per_split, scale, scale_log2,
                           GP: tl.constexpr, DP: tl.constexpr, BK: tl.constexpr,
                           STORE_DQ: tl.constexpr, STORE_KV: tl.constexpr,
                           UPCAST: tl.constexpr, PREC: tl.constexpr):
    """Pass A: one (query, KV head, slot split). dQ partial -> DQP[split, row - row0]; each valid slot's
    dK/dV contribution (G heads summed) -> DKP/DVP[row - row0, slot, kv head] (fp32)."""
    lrow = tl.program_id(0).to(tl.int64)  # row within the chunk
    row = row0 + lrow
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    b = row // Tq
    t = row % Tq
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, DP)
    gmask = offs_g < G
    dmask = offs_d < D
    heads = kvh * G + offs_g
    qmask = gmask[:, None] & dmask[None, :]
    q = tl.load(Q + b * sqb + t * sqt + heads[:, None] * sqh + offs_d[None, :] * sqd, mask=qmask, other=0.0)
    do = tl.load(DO + (row * H + heads)[:, None] * D + offs_d[None, :], mask=qmask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(LSE + row * H + heads, mask=gmask, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)  # no valid slot: P = 0
    delta = tl.load(DELTA + row * H + heads, mask=gmask, other=0.0)
    k_base = Kx + b * skb + kvh * skh
    v_base = V + b * svb + kvh * svh
    i_base = IDX + b * sib + t * sit
    vl_base = VALID + b * svlb + t * svlt
    dq = tl.zeros([GP, DP], tl.float32)
    start = split * slots_per_split
    end = tl.minimum(start + slots_per_split, NK)
    for s0 in range(start, end, BK):
        offs_k = s0 + tl.arange(0, BK)
        inb = offs_k < end
        ids = tl.load(i_base + offs_k * sik, mask=inb, other=0)
        ok = (tl.load(vl_base + offs_k * svlk, mask=inb, other=0) != 0) & inb
        kv_mask = ok[:, None] & dmask[None, :]
        kt = tl.load(k_base + ids[:, None] * skt + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
        vt = tl.load(v_base + ids[:, None] * svt + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        s = tl.dot(q, tl.trans(kt), input_precision=PREC) * scale_log2
        p = tl.exp2(s - lse2[:, None])
        p = tl.where(gmask[:, None] & ok[None, :], p, 0.0)  # [GP, BK]
        dp = tl.dot(do, tl.trans(vt), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        ds16 = ds.to(Q.dtype.element_ty).to(q.dtype)  # 16-bit matmul inputs on the GPU path
        if STORE_DQ:
            dq = tl.dot(ds16, kt, dq, input_precision=PREC)
        if STORE_KV:
            dk = tl.dot(tl.trans(ds16), q, input_precision=PREC) * scale  # [BK, DP]
            dv = tl.dot(tl.trans(p.to(DO.dtype.element_ty).to(do.dtype)), do, input_precision=PREC)
            off = ((lrow * NK + offs_k) * Hkv + kvh)[:, None] * D + offs_d[None, :]
            tl.store(DKP + off, dk, mask=kv_mask)
            tl.store(DVP + off, dv, mask=kv_mask)
    if STORE_DQ:
        tl.store(DQP + ((split * nrows + lrow) * H + heads)[:, None] * D + offs_d[None, :], dq * scale,
                 mask=qmask)


def _attn_bwd_reduce_kernel(PERM, LO, HI, DKP, DVP, DK, DV, key0, nkeys, Hkv, D,
                            KB: tl.constexpr, DP: tl.constexpr):
    """Pass B: KB keys x one KV head. Key j's slots are PERM[LO[j]:HI[j]] (flat (row, slot) indices in
    chunk's (row, slot) order), summed in that order and added to the fp32 accumulators DK/DV."""
    keys = tl.program_id(0) * KB + tl.arange(0, KB)
    kvh = tl.program_id(1).to(tl.int64)
    offs_d = tl.arange(0, DP)
    kmask = keys < nkeys
    dmask = offs_d < D
    lo = tl.load(LO + keys, mask=kmask, other=0)
    n = tl.load(HI + keys, mask=kmask, other=0) - lo
    acc_k = tl.zeros([KB, DP], tl.float32)
    acc_v = tl.zeros([KB, DP], tl.float32)
    for j in range(0, tl.max(n, axis=0)):
        more = j < n
        f = tl.load(PERM + lo + j, mask=more, other=0).to(tl.int64)
        off = (f * Hkv + kvh)[:, None] * D + offs_d[None, :]
        mk = more[:, None] & dmask[None, :]
        acc_k += tl.load(DKP + off, mask=mk, other=0.0)
        acc_v += tl.load(DVP + off, mask=mk, other=0.0)
    has = (n > 0)[:, None] & dmask[None, :]
    out = ((key0 + keys).to(tl.int64) * Hkv + kvh)[:, None] * D + offs_d[None, :]
    tl.store(DK + out, tl.load(DK + out, mask=has, other=0.0) + acc_k, mask=has)
    tl.store(DV + out, tl.load(DV + out, mask=has, other=0.0) + acc_v, mask=has)


def _sample_kernel(X, KEYS, PM, PS, PB, PTOP, PAT, TOK, LP, NV, per, sxb, sxv, temperature,
                   NSPLIT: tl.constexpr, SP: tl.constexpr, PHASE: tl.constexpr, BV: tl.constexpr):
    # Three launches over a row's vocabulary cut into NSPLIT slices of `per` ids (one slice per program: a row's
    # ~150k logits are too many for one program to stream, at decode's few rows). Phase 1 (B x NSPLIT): each slice's
    # log-sum-exp of x / T (online max m_i and sum s_i) and its count of non-finite logits. Phase 2 (B x NSPLIT): the
    # row's log-sum-exp from its partials, then the slice's hashed Gumbel noise of every token id and the argmax of
    # logp + g (the first index among equals). Phase 3 (B): the best slice (the first among equals), its token and
    # logprob. A row with a non-finite logit is taken as all zeros, as engine.sample_tokens does.
    row = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    base = X + row * sxb
    lo = sp * per
    hi = tl.minimum(lo + per, NV)
    if PHASE == 1:
        m = tl.full([], float("-inf"), tl.float32)
        s = tl.zeros([], tl.float32)
        bad = tl.zeros([], tl.int32)
        for v0 in range(lo, hi, BV):
            offs = v0 + tl.arange(0, BV)
            ok = offs < hi
            x = tl.load(base + offs * sxv, mask=ok, other=0.0).to(tl.float32)
            fin = (x == x) & (tl.abs(x) != float("inf"))
            bad += tl.sum((ok & ~fin).to(tl.int32), 0)
            y = tl.where(ok & fin, tl.math.div_rn(x, temperature), float("-inf"))  # IEEE division, as PyTorch
            m_new = tl.maximum(m, tl.max(y, 0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(y - m_new), 0)
            m = m_new
        tl.store(PM + row * NSPLIT + sp, m)
        tl.store(PS + row * NSPLIT + sp, s)
        tl.store(PB + row * NSPLIT + sp, bad)
    else:  # the row's log-sum-exp from its NSPLIT partials, in one fixed order (phases 2 and 3 get the same bits)
        parts = tl.arange(0, SP)
        pok = parts < NSPLIT
        pm = tl.load(PM + row * NSPLIT + parts, mask=pok, other=float("-inf"))
        finite = tl.sum(tl.load(PB + row * NSPLIT + parts, mask=pok, other=0), 0) == 0
        m = tl.max(pm, 0)
        s = tl.sum(tl.load(PS + row * NSPLIT + parts, mask=pok, other=0.0) * tl.exp(pm - m), 0)
        m = tl.where(finite, m, 0.0)
        log_s = tl.log(tl.where(finite, s, NV.to(tl.float32)))
        if PHASE == 2:
            key = tl.load(KEYS + row)
            best = tl.full([], float("-inf"), tl.float32)
            tok = tl.zeros([], tl.int64)
            for v0 in range(lo, hi, BV):
                offs = v0 + tl.arange(0, BV)
                ok = offs < hi
                x = tl.where(finite, tl.load(base + offs * sxv, mask=ok, other=0.0).to(tl.float32), 0.0)
                logp = (tl.math.div_rn(x, temperature) - m) - log_s
                h = offs.to(tl.int64)  # engine._mix32 twice, in int64 as there: of the token id, then of it ^ key
                for r in tl.static_range(2):
                    h = (((h >> 16) ^ h) * 0x45D9F3B) & 0xFFFFFFFF
                    h = (((h >> 16) ^ h) * 0x45D9F3B) & 0xFFFFFFFF
                    h = (h >> 16) ^ h
                    if r == 0:
                        h = h ^ key
                u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # (0, 1) from 23 bits, as engine.py: 2^-23
                score = tl.where(ok, logp - tl.log(-tl.log(u)), float("-inf"))
                top = tl.max(score, 0)
                at = v0 + tl.argmax(score, 0).to(tl.int64)
                tok = tl.where(top > best, at, tok)
                best = tl.maximum(best, top)
            tl.store(PTOP + row * NSPLIT + sp, best)
            tl.store(PAT + row * NSPLIT + sp, tok)
        else:
            tops = tl.load(PTOP + row * NSPLIT + parts, mask=pok, other=float("-inf"))
            tok = tl.load(PAT + row * NSPLIT + tl.argmax(tops, 0))  # (tl.argmax: the first among equals)
            x = tl.load(base + tok * sxv).to(tl.float32)
            tl.store(TOK + row, tok)
            tl.store(LP + row, tl.where(finite, (tl.math.div_rn(x, temperature) - m) - log_s, float("nan")))


_KERNEL_FNS = dict(scores=_index_scores_kernel, fwd=_attn_fwd_kernel, combine=_attn_combine_kernel,
                   probs=_attn_probs_kernel, bwd_query=_attn_bwd_query_kernel, bwd_reduce=_attn_bwd_reduce_kernel,
                   sample=_sample_kernel)


@functools.lru_cache(maxsize=None)
def _compiled(interpret: bool):
    # triton.jit decides between compiled and interpreted kernels when it decorates: one set per mode.
    assert interpret == _interpret()
    return {name: triton.jit(fn) for name, fn in _KERNEL_FNS.items()}


def _kernels():
    if not _import_triton():
        raise RuntimeError("dsa_triton needs triton (pip install triton); use dsa.py's PyTorch path")
    return _compiled(_interpret())


def _on(t):
    """Launch on t's GPU: Triton uses the current device, and a process may hold tensors on several
    (train.py's generator and learner)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------- indexer


def index_scores(q, w, k, q_slot=None):
    """I(t, s) = d_I^-0.5 sum_j w[t, j] relu(q[t, j] . k[s]), as dsa.index_scores: q [B, c, H_I, d_I],
    w [B, c, H_I], k [B, Tk, d_I] -> fp32 [B, c, Tk], fp32 accumulation from the inputs as given.
    q_slot (int [c], optional): query t's own key slot; keys s > q_slot[t] then score -inf (every DSA
    mask hides them) and key blocks wholly after the chunk's queries are not computed."""
    B, c, HI, DI = q.shape
    Tk = k.shape[1]
    assert w.shape == (B, c, HI) and k.shape == (B, Tk, DI), (q.shape, w.shape, k.shape)
    kern = _kernels()
    out = torch.empty(B, c, Tk, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    if q.dtype != k.dtype:
        dt = torch.promote_types(q.dtype, k.dtype)
        q, k = q.to(dt), k.to(dt)
    HP = _p2(HI, 1)
    BT = max(1, SCORE_ROWS // HP)
    while BT * HP < 16:  # tl.dot needs M >= 16
        BT *= 2
    BS = max(16, SCORE_BLOCK_S)
    BD = _p2(min(DI, 128))
    slot = q_slot.to(device=q.device, dtype=torch.int64).contiguous() if q_slot is not None else out
    interp = _interpret()
    grid = (_cdiv(c, BT), _cdiv(Tk, BS), B)
    with _on(q):
        kern["scores"][grid](
            q, w, k, out, slot, c, Tk, HI, DI, *q.stride(), *w.stride(), *k.stride(), *out.stride(),
            DI ** -0.5, BT=BT, HP=HP, BS=BS, BD=BD, CAUSAL=q_slot is not None,
            UPCAST=interp and q.dtype != torch.float32, PREC=_precision(q.dtype), **_launch_opts(interp, 8, 2))
    return out


# ----------------------------------------------------------------------------------------------- attention


def _prepare(q, k, v, idx, valid):
    B, Tq, H, D = q.shape
    assert k.dim() == 4 and k.shape[0] == B and k.shape[3] == D and v.shape == k.shape, (q.shape, k.shape, v.shape)
    assert idx.shape == valid.shape and idx.shape[:2] == (B, Tq), (idx.shape, valid.shape)
    assert H % k.shape[2] == 0, f"{H} heads are not a multiple of {k.shape[2]} KV heads"
    if valid.dtype == torch.bool:
        valid = valid.view(torch.uint8)  # same bytes; kernels read 0/1
    return idx, valid


def _launch_opts(interp, warps=4, stages=2):
    return {} if interp else dict(num_warps=warps, num_stages=stages)


def sparse_attention_fwd(q, k, v, idx, valid, scale, num_splits=None):
    """Forward only, no autograd: out [B, Tq, H, D] in q.dtype and lse [B, Tq, H] fp32 (natural log of the
    softmax denominator, -inf where a query has no valid slot; its output is then 0). q, k, v must share a
    dtype. num_splits: programs per (query, KV head), each over a slice of the K slots (default: 1 unless
    B*Tq*Hkv programs are too few for the GPU, as when decoding)."""
    B, Tq, H, D = q.shape
    Hkv, NK = k.shape[2], idx.shape[-1]
    G = H // Hkv
    assert q.dtype == k.dtype == v.dtype, (q.dtype, k.dtype, v.dtype)
    idx, valid = _prepare(q, k, v, idx, valid)
    out = torch.empty(B, Tq, H, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Tq, H, dtype=torch.float32, device=q.device)
    rows = B * Tq
    if rows == 0:
        return out, lse
    if NK == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    if num_splits is None:
        target = 2 * _num_sms(q.device)
        num_splits = 1
        if rows * Hkv < target:
            num_splits = min(_cdiv(target, rows * Hkv), max(1, NK // MIN_SPLIT_SLOTS))
    BK = max(16, BLOCK_K)
    per = _cdiv(_cdiv(NK, max(1, num_splits)), BK) * BK  # whole blocks per split
    num_splits = _cdiv(NK, per)
    interp = _interpret()
    kern = _kernels()
    GP, DP = _p2(G), _p2(D)
    common = dict(GP=GP, DP=DP, BK=BK, UPCAST=interp and q.dtype != torch.float32, PREC=_precision(q.dtype))
    if num_splits > 1:
        pm = torch.empty(num_splits, rows, H, dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
        pacc = torch.empty(num_splits, rows, H, D, dtype=torch.float32, device=q.device)
    else:
        pm = pl = pacc = lse
    with _on(q):
        kern["fwd"][(rows, Hkv, num_splits)](
            q, k, v, idx, valid, out, lse, pm, pl, pacc, *q.stride(), *k.stride(), *v.stride(),
            *idx.stride(), *valid.stride(), Tq, H, G, D, NK, rows, per, scale * LOG2E,
            SPLIT=num_splits > 1, **common, **_launch_opts(interp))
        if num_splits > 1:
            kern["combine"][(rows, H)](pm, pl, pacc, out, lse, rows, H, D, num_splits,
                                       SP=_p2(num_splits, 2), DP=DP, **_launch_opts(interp, 4, 1))
    return out, lse


def sparse_attention_probs(q, k, idx, valid, scale, lse):
    """Head-averaged softmax probabilities over the selected slots, [B, Tq, K] fp32 (0 on invalid slots),
    from the forward's lse; the mean over all H heads, summed in a fixed order."""
    B, Tq, H, D = q.shape
    Hkv, NK = k.shape[2], idx.shape[-1]
    G = H // Hkv
    idx, valid = _prepare(q, k, k, idx, valid)
    probs = torch.zeros(B, Tq, NK, dtype=torch.float32, device=q.device)
    if probs.numel() == 0:
        return probs
    BK = max(16, BLOCK_K)
    interp = _interpret()
    with _on(q):
        _kernels()["probs"][(B * Tq, _cdiv(NK, BK))](
            q, k, idx, valid, lse, probs, *q.stride(), *k.stride(), *idx.stride(), *valid.stride(),
            Tq, H, Hkv, G, D, NK, scale * LOG2E, 1.0 / H, GP=_p2(G), DP=_p2(D), BK=BK,
            UPCAST=interp and q.dtype != torch.float32, PREC=_precision(q.dtype), **_launch_opts(interp))
    return probs


def _inverted_index(idx, valid, r0, r1, Tk):
    """For the chunk of rows [r0, r1) (row = b * Tq + t): the flat (row, slot) index of every valid slot,
    sorted by (batch, key) with ties in (row, slot) order (stable sort), and CSR bounds lo/hi per key of
    the batches the chunk touches. Returns perm, lo, hi, first key (b * Tk + s) covered, number of keys."""
    B, Tq, NK = idx.shape
    sel_idx = idx.reshape(B * Tq, NK)[r0:r1]
    sel_ok = valid.reshape(B * Tq, NK)[r0:r1] != 0
    b = torch.arange(r0, r1, device=idx.device) // Tq
    b0, b1 = r0 // Tq, (r1 - 1) // Tq + 1
    key = (b[:, None] - b0) * Tk + sel_idx  # key index relative to the first batch of the chunk
    nkeys = (b1 - b0) * Tk
    key = torch.where(sel_ok, key, nkeys).reshape(-1)  # invalid slots sort after every key
    kdt = torch.int32 if nkeys < 2**31 - 1 else torch.int64
    sorted_key, order = torch.sort(key.to(kdt), stable=True)
    bounds = torch.searchsorted(sorted_key, torch.arange(nkeys + 1, device=idx.device, dtype=kdt))
    return order, bounds[:-1].contiguous(), bounds[1:].contiguous(), b0 * Tk, nkeys


def _backward(q, k, v, idx, valid, out, lse, dout, scale, need_dq, need_dkv):
    B, Tq, H, D = q.shape
    Tk, Hkv, NK = k.shape[1], k.shape[2], idx.shape[-1]
    G = H // Hkv
    rows = B * Tq
    dev = q.device
    interp = _interpret()
    kern = _kernels()
    dout = dout.to(q.dtype).contiguous()
    delta = (dout.float() * out.float()).sum(-1).contiguous()  # [B, Tq, H] = rowsum(dO * O)
    dq = torch.empty(rows, H, D, dtype=torch.float32, device=dev) if need_dq else None
    dk32 = torch.zeros(B * Tk, Hkv, D, dtype=torch.float32, device=dev) if need_dkv else None
    dv32 = torch.zeros_like(dk32) if need_dkv else None
    BK = max(16, BWD_BLOCK_K)
    GP, DP = _p2(G), _p2(D)
    chunk = rows
    if need_dkv:
        chunk = max(1, min(rows, BWD_BUFFER_BYTES // (NK * Hkv * D * 4 * 2)))
    for r0 in range(0, rows, chunk):
        r1 = min(rows, r0 + chunk)
        n = r1 - r0
        splits = 1
        if n * Hkv < 2 * _num_sms(dev):  # few programs (short or decode-like input): split the slots too
            splits = min(_cdiv(2 * _num_sms(dev), n * Hkv), max(1, NK // MIN_SPLIT_SLOTS))
        per = _cdiv(_cdiv(NK, splits), BK) * BK
        splits = _cdiv(NK, per)
        if not need_dq:
            dqp = lse  # unused
        elif splits == 1:
            dqp = dq[r0:r1]  # written in place
        else:
            dqp = torch.empty(splits, n, H, D, dtype=torch.float32, device=dev)
        if need_dkv:
            dkp = torch.empty(n, NK, Hkv, D, dtype=torch.float32, device=dev)
            dvp = torch.empty_like(dkp)
        else:
            dkp = dvp = lse
        kern["bwd_query"][(n, Hkv, splits)](
            q, k, v, dout, lse, delta, idx, valid, dqp, dkp, dvp,
            *q.stride(), *k.stride(), *v.stride(), *idx.stride(), *valid.stride(),
            Tq, H, Hkv, G, D, NK, r0, n, per, scale, scale * LOG2E,
            GP=GP, DP=DP, BK=BK, STORE_DQ=need_dq, STORE_KV=need_dkv,
            UPCAST=interp and q.dtype != torch.float32, PREC=_precision(q.dtype), **_launch_opts(interp, 8, 2))
        if need_dq and splits > 1:
            dq[r0:r1] = dqp.sum(0)  # fixed-order reduction over the splits
        if need_dkv:
            perm, lo, hi, key0, nkeys = _inverted_index(idx, valid, r0, r1, Tk)
            KB = REDUCE_KEYS
            kern["bwd_reduce"][(_cdiv(nkeys, KB), Hkv)](
                perm, lo, hi, dkp, dvp, dk32, dv32, key0, nkeys, Hkv, D,
                KB=KB, DP=DP, **_launch_opts(interp, 4, 1))
    dq = dq.view(B, Tq, H, D).to(q.dtype) if need_dq else None
    dk = dk32.view(B, Tk, Hkv, D).to(k.dtype) if need_dkv else None
    dv = dv32.view(B, Tk, Hkv, D).to(v.dtype) if need_dkv else None
    return dq, dk, dv


class SparseAttention(torch.autograd.Function):
    """out, lse = SparseAttention.apply(q, k, v, idx, valid, scale); gradients for q, k, v (those that
    require grad), none for idx/valid/scale; lse is not differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, idx, valid, scale):
        out, lse = sparse_attention_fwd(q, k, v, idx, valid, scale)
        ctx.save_for_backward(q, k, v, idx, valid, out, lse)
        ctx.scale = scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, idx, valid, out, lse = ctx.saved_tensors
        need_dq, need_dk, need_dv = ctx.needs_input_grad[:3]
        if dout is None or not (need_dq or need_dk or need_dv):
            return None, None, None, None, None, None
        _, valid = _prepare(q, k, v, idx, valid)
        with _on(q):
            dq, dk, dv = _backward(q, k, v, idx, valid, out, lse, dout, ctx.scale, need_dq, need_dk or need_dv)
        return dq, dk if need_dk else None, dv if need_dv else None, None, None, None


# ----------------------------------------------------------------------------------------------- sampling

SAMPLE_BLOCK = 4096  # vocabulary entries per step of the sampling kernel
SAMPLE_SLICE = 8192  # the fewest vocabulary entries of a slice (one program's share of a row)
SAMPLE_PROGRAMS = 1024  # slices are cut until B x slices reaches this (or a slice is SAMPLE_SLICE ids)


def sample(logits, temperature, keys):
    """engine.sample_tokens for temperature > 0 without top-p, fused: logits [B, V] (any float dtype and
    strides), keys [B] int64 (engine.sample_keys) -> tokens [B] int64, logprobs [B] fp32 (NaN for a row
    with a non-finite logit). Reads the logits twice and writes nothing else but five numbers per slice of a row (the
    kernel's comment), where the PyTorch path makes about 20 passes over [B, V] (int64 hashes among them). The slices
    depend on B and V only (never on the GPU), so a row's bits do not depend on the device model."""
    B, V = logits.shape
    tok = torch.empty(B, dtype=torch.int64, device=logits.device)
    lp = torch.empty(B, dtype=torch.float32, device=logits.device)
    if B:
        BV = min(SAMPLE_BLOCK, _p2(V))
        n = max(1, min(-(-SAMPLE_PROGRAMS // B), V // SAMPLE_SLICE))
        per = -(-(-(-V // n)) // BV) * BV  # whole blocks per slice
        n = -(-V // per)
        dev, f32 = logits.device, torch.float32
        pm, ps, ptop = (torch.empty(B, n, dtype=f32, device=dev) for _ in range(3))
        pb, pat = torch.empty(B, n, dtype=torch.int32, device=dev), torch.empty(B, n, dtype=torch.int64, device=dev)
        args = (logits, keys.to(torch.int64).contiguous(), pm, ps, pb, ptop, pat, tok, lp, V, per, *logits.stride(),
                float(temperature))
        with _on(logits):
            for phase, grid in ((1, (B, n)), (2, (B, n)), (3, (B, 1))):
                _kernels()["sample"][grid](*args, NSPLIT=n, SP=_p2(n, 2), PHASE=phase, BV=BV,
                                           **_launch_opts(_interpret(), 8, 1))
    return tok, lp


def sparse_attention(q, k, v, idx, valid, scale, return_probs=False):
    """dsa.sparse_attention on Triton: q [B, Tq, H, D]; k, v [B, Tk, Hkv, D] (any strides, e.g. the
    filled part of a KV cache); idx [B, Tq, K] int (indices into Tk), valid [B, Tq, K] bool ->
    out [B, Tq, H, D] in q.dtype, and with return_probs the detached head-averaged probabilities
    [B, Tq, K] fp32. Differentiable in q, k, v (deterministic backward); a query with no valid slot
    gets 0."""
    dt = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    qc, kc, vc = q.to(dt), k.to(dt), v.to(dt)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = SparseAttention.apply(qc, kc, vc, idx, valid, scale)
    else:
        out, lse = sparse_attention_fwd(qc, kc, vc, idx, valid, scale)
    out = out.to(q.dtype)
    if not return_probs:
        return out
    with torch.no_grad():
        return out, sparse_attention_probs(qc.detach(), kc.detach(), idx, valid, scale, lse)
