"""
The decode step as a function of the paged KV pool (decode_forward), and that step replayed as CUDA graphs
of padded buckets (DecodeGraphs). TorchEngine (engine.py) builds each row's key slots with key_slots and
calls decode_forward for its eager decode steps and for the rows of a turn that extends parked KV; with
graphs on, a decode step goes through DecodeGraphs.run instead (on a CPU, in tests, the same padded buckets
run eagerly). A speculative engine's verify forward (speculative.py: k + 1 tokens a row) runs as DecodeGraphs.verify, a
second set of the same buckets on the same memory pool, and its MTP drafter's draft step (draft_forward, one chained step)
as DecodeGraphs.draft, a third. The engine's model runs each RMSNorm as one Triton kernel on a GPU (fuse_norms).
"""
import warnings
from dataclasses import dataclass, field

import torch

import dsa
from families import mtp
from kernels import elementwise
from model import BLOCK_SIZE, GLM, PagedKVCache, RMSNorm


class FusedRMSNorm(RMSNorm):
    """model.RMSNorm whose forward is kernels/elementwise.rms_norm where that runs (CUDA, dsa.USE_TRITON) and no
    gradient is wanted: one kernel, not eight. The same parameters and state dict."""

    def forward(self, x):
        if dsa._triton(x) and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            return elementwise.rms_norm(x, self.weight, self.eps)
        return super().forward(x)


def fuse_norms(model):
    """Every model.RMSNorm of model becomes a FusedRMSNorm, in place (the same modules, parameters and hooks): what
    TorchEngine does to the model it owns."""
    for m in model.modules():
        if type(m) is RMSNorm:
            m.__class__ = FusedRMSNorm
    return model


def decode_forward(model, pool: PagedKVCache, tokens, pos, keys, valid, hidden=False):
    """One decode forward over the paged pool: tokens, pos [B, 1]; keys, valid [B, Lk] (each row's slots in
    position order, its new token's last: Attention.paged_decode) -> logits [B, V] (hidden: the final
    hidden states [B, hidden], before lm_head)."""
    pool.keys, pool.key_valid, pool.slots = keys, valid, keys[:, -1]
    try:
        return model(tokens, position_ids=pos, cache=pool, return_hidden=hidden)[:, -1]
    finally:  # the next forward (a prefill) must not see them
        pool.keys = None


def draft_forward(model, pool: PagedKVCache, hidden, tokens, pos, keys, valid):
    """One MTP draft step over the paged pool (speculative.py's MTPDrafter.draft): the model's first MTP layer (its KV:
    the pool's layer L) at one position per row, reading hidden [B, hidden] (the trunk's at pos, or the layer's own
    output at the position before) and tokens [B, 1] (the token after pos [B, 1]), with keys, valid [B, Lk] as
    decode_forward's -> logits [B, V] (its head's, from which the next draft is sampled) and the layer's output
    [B, hidden] (before shared_head.norm: the next chained step's hidden)."""
    layer = model.mtp[str(model.cfg.num_layers)]
    out = mtp_decode(model, pool, hidden, tokens, pos, keys, valid)
    return mtp.embed_and_head(model, layer)[1](layer.shared_head.norm(out)), out


def mtp_decode(model, pool: PagedKVCache, hidden, tokens, pos, keys, valid):
    """The model's first MTP layer over the paged pool at one position per row (draft_forward's, and the draft
    extend's in speculative.mtp_rows): hidden [B, hidden], tokens, pos [B, 1], keys, valid [B, Lk] -> its output
    [B, hidden], before shared_head.norm."""
    layer = model.mtp[str(model.cfg.num_layers)]
    pool.keys, pool.key_valid, pool.slots = keys, valid, keys[:, -1]
    try:
        return layer.body(mtp.embed_and_head(model, layer)[0], hidden[:, None], tokens, pos, cache=pool)[:, -1]
    finally:  # the next forward (a prefill) must not see them
        pool.keys = None


def key_slots(table, pos, Lk: int):
    """The pool slots a decode row reads: table [R, blocks] (each row's KV block ids, position order), pos
    [R] (the position of the token it feeds now) -> keys, valid [R, Lk]: the slots of positions pos - Lk + 1
    .. pos in order, left-padded where those are below 0 (valid False; the padding reads position 0's slot)."""
    p = torch.arange(Lk, device=pos.device)[None] - (Lk - 1) + pos[:, None]  # [R, Lk] key positions
    valid = p >= 0
    p = p.clamp_min(0)
    return table.gather(1, p // BLOCK_SIZE) * BLOCK_SIZE + p % BLOCK_SIZE, valid


# ----------------------------------------------------------------------------- CUDA graphs for decode

# Bucket sizes: rows 1, 2, 4, 8, then every GRAPH_ROW_STEP up to max_batch; keys GRAPH_MIN_KEYS, doubling up to
# the longest sequence. A step runs as the smallest bucket that holds it.
GRAPH_ROW_STEP = 16
GRAPH_MIN_KEYS = 256


@dataclass
class _Shared:
    """What an engine's graph sets share: one memory pool and one capture stream (steps never overlap), and whether
    they capture (DecodeGraphs.capture: one device)."""
    capture: bool = False
    mempool: tuple | None = None  # the pool's handle (CUDAGraph.pool()), once a capture has made it
    stream: "torch.cuda.Stream | None" = None
    sets: list = field(default_factory=list)  # the DecodeGraphs on it


class DecodeGraphs:
    """The decode forward as CUDA graphs, one per bucket of (rows, keys). Eager decoding pays Python's and
    the launch's overhead for each of a layer's few dozen kernels, every step, while the GPU waits for
    them; a replay launches the whole forward at once.

    A graph has fixed shapes, so a step of B rows whose longest holds Lk keys runs as the smallest bucket
    (Bg >= B rows, Lg >= Lk keys), padded: the engine left-pads every row's key list to Lg (masked, as
    any row's left padding), and the Bg - B padding rows feed token 0 at position 0, reading and writing
    the pool's scratch slot only. The inputs are copied into static buffers (one set, sized for the
    largest bucket, which every bucket views), the graph runs, and the logits land in one [max_batch, V]
    buffer; every bucket shares one memory pool, as steps never overlap.

    per > 1 (speculative.py's verify, k + 1 tokens a row): a bucket of Bg rows runs a forward of Bg * per rows,
    a row's tokens next to each other, each with its own keys (as Speculative.step feeds them; a padding row is
    per padding rows), and the trunk's hidden states (before the final norm) land in self.trunk [max_batch * per,
    hidden] beside the logits computed from them, as the eager verify computes them. A DecodeGraphs made with
    verify=k + 1 makes that set too, as .verify (the same rows, keys and capture), sharing its memory pool and
    capture stream (_Shared): the pool holds the larger of the two forwards, not both.

    mtp=True (speculative.py's MTPDrafter, one chained draft step: draft_forward): a bucket of Bg rows runs the model's
    first MTP layer at one position per row, reading a hidden state per row too, from self.hidden [max_batch, hidden]
    (a padding row's: zeros), and leaves its head's logits in self.logits and the layer's output, which the next
    chained step reads as its hidden, in self.out [max_batch, hidden]. A DecodeGraphs made with draft=True makes that
    set too, as .draft, on the same memory pool and capture stream; its forward is one layer's, the smallest of the three.

    A bucket is captured on the first step that needs it: an eager run of the same padded inputs (Triton
    compiles its kernels, cuBLAS picks its algorithms), the capture, then a replay whose outputs must match
    the eager run's to a few roundings (a guard against a capture gone wrong: on a mismatch, or an error
    while capturing, the set's graphs are dropped (and the pool, where no set has graphs left), the step runs again
    eagerly, rewriting any keys a bad replay wrote, and that set runs eagerly from then on, with a warning). The very
    first capture on a pool is of the largest bucket of its largest set (the verify's where there is one, then the
    decode's, then the draft step's), all padding rows, so that every later one reuses its memory. Captures
    run on a stream of the engine's GPU and their errors are thread-local: the learner's thread beside it
    keeps its own GPU (torch.cuda.graph would also empty every device's allocator cache). Weight updates
    copy in place, so graphs stay valid; a new pool (a call with longer sequences) or max_batch gets new
    graphs. With capture=False (a CPU, in tests; one flag for all the sets on a pool) the same padded forward runs
    eagerly.

    `memory` is a diagnostic for the memory plan (bench/gpu_memory.py prints it): per bucket (Bg, Lg) captured,
    the allocator's figures in bytes around it, read from its counters without a sync or a reset: allocated and
    reserved before the eager warm-up, allocated after it, the process's peak allocated before and after it (the
    warm-up's own peak where that rose), allocated and reserved after the capture, and whether the bucket was kept."""

    def __init__(self, model: GLM, pool: PagedKVCache, max_batch: int, max_keys: int, capture: bool, verify: int = 0,
                 per: int = 1, shared: _Shared | None = None, draft: bool = False, mtp: bool = False):
        self.model, self.pool, self.max_keys, self.per, self.mtp = model, pool, max_keys, per, mtp
        self.rows = sorted({b for b in (1, 2, 4, 8) if b < max_batch} | set(range(GRAPH_ROW_STEP, max_batch, GRAPH_ROW_STEP))
                           | {max_batch})
        R, dev, long = max_batch * per, pool.k[0].device, dict(dtype=torch.long, device=pool.k[0].device)  # forward rows
        self.tok, self.pos = torch.zeros(R, 1, **long), torch.zeros(R, 1, **long)
        self.keys = torch.zeros(R * max_keys, **long)  # viewed as [Bg per, Lg] (contiguous) by each bucket
        self.valid = torch.zeros(R * max_keys, dtype=torch.bool, device=dev)
        self.logits = torch.zeros(R, model.cfg.vocab_size, dtype=pool.k[0].dtype, device=dev)
        self.trunk = torch.zeros(R, model.cfg.hidden_size, dtype=pool.k[0].dtype, device=dev) if per > 1 else None
        # mtp: the draft step's hidden in and out [max_batch, hidden] (out: another buffer, as the next step reads it)
        self.hidden, self.out = ([torch.zeros(R, model.cfg.hidden_size, dtype=pool.k[0].dtype, device=dev)
                                  for _ in range(2)] if mtp else (None, None))
        # One side stream for every capture: cuBLAS keeps a workspace (32 MiB on Hopper) per stream, and the caching
        # allocator reuses a freed block only on the stream that freed it, so a new stream per capture made each
        # bucket keep its own workspace in the pool (measured on an H100: 0.031 GiB and 0.06 GiB reserved a bucket;
        # with one stream the later buckets add nothing)
        self.graphs, self.failed, self.shared = {}, False, shared or _Shared()
        self.shared.sets.append(self)
        self.capture = capture
        self.memory = {}  # (Bg, Lg) -> bytes around its capture (the docstring's last paragraph)
        self.verify = (DecodeGraphs(model, pool, max_batch, max_keys, capture, per=verify, shared=self.shared)
                       if verify else None)
        self.draft = DecodeGraphs(model, pool, max_batch, max_keys, capture, shared=self.shared, mtp=True) if draft else None

    @property
    def capture(self):  # whether the sets on this pool capture (False: their padded forwards run eagerly)
        return self.shared.capture

    @capture.setter
    def capture(self, on: bool):
        self.shared.capture = on

    @property
    def mempool(self):  # the shared memory pool's handle (None: no capture holds one)
        return self.shared.mempool

    def bucket(self, B: int, Lk: int):
        """The (rows, keys) shape a step of B rows and Lk keys runs as."""
        Bg = next(b for b in self.rows if b >= B)
        Lg = GRAPH_MIN_KEYS
        while Lg < Lk:
            Lg *= 2
        return Bg, min(Lg, self.max_keys)

    def run(self, tok, pos, keys, valid, Bg, hidden=None):
        """tok, pos [R]; keys, valid [R, Lg] (a bucket's width), R = B per forward rows of B rows -> logits [R, V] of
        the padded forward (per > 1: the trunk's hidden states [R, hidden] in self.trunk[:R]; mtp: hidden [R, hidden]
        the rows' hidden states in, the layer's output in self.out[:R])."""
        R, Lg = keys.shape
        Rg = Bg * self.per
        while self.capture and not self.failed and self.mempool is None:
            # The first capture on the pool: the largest bucket of the largest set that has not failed, all padding
            # rows: every later capture then fits in the memory it freed, and the graphs' pool stays one largest forward
            # (the memory plan's figure). (A failed set drops out, and the next largest goes first; the draft step,
            # one layer, is smaller than the decode's forward.)
            big = max((s for s in self.shared.sets if not s.failed), key=lambda s: (s.per, not s.mtp))
            if (big, Bg, Lg) == (self, self.rows[-1], self.max_keys):
                break
            big.run(big.tok[:0, 0], big.pos[:0, 0], keys.new_zeros(0, big.max_keys), valid.new_zeros(0, big.max_keys),
                    big.rows[-1], big.hidden[:0] if big.mtp else None)
        self.tok[:R, 0], self.pos[:R, 0] = tok, pos
        self.tok[R:Rg], self.pos[R:Rg] = 0, 0
        if self.mtp:
            self.hidden[:R], self.hidden[R:Rg] = hidden, 0
        k, v = self.keys[:Rg * Lg].view(Rg, Lg), self.valid[:Rg * Lg].view(Rg, Lg)
        k[:R], v[:R] = keys, valid
        k[R:], v[R:] = self.pool.scratch, False
        v[R:, -1] = True  # a padding row sees its own (scratch) slot: finite, and nobody else's
        if not self.capture or self.failed:
            self._forward(Bg, Lg)
        elif (Bg, Lg) in self.graphs:
            self.graphs[Bg, Lg].replay()
        else:
            self._capture(Bg, Lg)
        return self.logits[:R]

    def _outputs(self, Rg):
        return [self.logits[:Rg]] + ([self.trunk[:Rg]] if self.per > 1 else []) + ([self.out[:Rg]] if self.mtp else [])

    def _forward(self, Bg, Lg):
        """The captured work: the model on the static buffers, logits into self.logits (per > 1: the trunk's hidden
        states into self.trunk, and the logits from them, as Speculative.step's eager verify; mtp: the MTP layer's
        output into self.out, as MTPDrafter.draft's eager step)."""
        Rg = Bg * self.per
        args = (self.model, self.pool, self.tok[:Rg], self.pos[:Rg], self.keys[:Rg * Lg].view(Rg, Lg),
                self.valid[:Rg * Lg].view(Rg, Lg))
        if self.mtp:
            self.logits[:Rg], self.out[:Rg] = draft_forward(self.model, self.pool, self.hidden[:Rg], *args[2:])
            return
        if self.per == 1:
            self.logits[:Rg] = decode_forward(*args)
            return
        self.trunk[:Rg] = decode_forward(*args, hidden="trunk")
        self.logits[:Rg] = self.model.lm_head(self.model.norm(self.trunk[:Rg]))

    def _capture(self, Bg, Lg):
        """Warm up, capture on a stream of our own (left whatever happens: a failed capture must not leave
        this thread on it), replay, and check the replay against the warm-up."""
        dev, Rg = self.logits.device, Bg * self.per
        mem = self.memory[Bg, Lg] = _allocated(dev, "before", reserved=True, peak=True)
        self._forward(Bg, Lg)  # warm-up, and the reference this bucket's replay must reproduce
        eager = [t.clone() for t in self._outputs(Rg)]
        mem |= _allocated(dev, "after_warmup", peak=True)  # (with the reference copy, gone after the check)
        try:
            graph, main = torch.cuda.CUDAGraph(), torch.cuda.current_stream(dev)
            side = self.shared.stream = self.shared.stream or torch.cuda.Stream(dev)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                graph.capture_begin(pool=self.mempool, capture_error_mode="thread_local")
                try:
                    self._forward(Bg, Lg)
                finally:
                    graph.capture_end()
            main.wait_stream(side)
            mem |= _allocated(dev, "after_capture", reserved=True)
            self.shared.mempool = graph.pool()
            graph.replay()
            same, why = True, ""
            for got, want in zip(self._outputs(Rg), eager):
                tol = 4 * torch.finfo(want.dtype).eps * want.float().nan_to_num(0, 0, 0).abs().max().item()
                if not torch.isclose(got.float(), want.float(), rtol=0, atol=tol, equal_nan=True).all().item():
                    same, err = False, (got.float() - want.float()).abs().max().item()
                    why = f"its replay's outputs differ from eager by up to {err:.3g}"
        except RuntimeError as e:
            same, why = False, f"{type(e).__name__}: {e}".splitlines()[0]
        mem["kept"] = bool(same)
        if same:
            self.graphs[Bg, Lg] = graph
            return
        # This set runs eagerly from now on. Its graphs' memory goes back (the pool with them, where no other set holds
        # graphs in it); this step runs again eagerly, which also rewrites the keys and values a bad replay may have
        # written
        self.failed, self.graphs = True, {}
        if not any(s.graphs for s in self.shared.sets):
            self.shared.mempool = None
        self._forward(Bg, Lg)
        what = (f"the MTP draft step of {Bg} rows" if self.mtp else f"the decode of {Bg} rows" if self.per == 1
                else f"the verify of {Bg} rows x {self.per} tokens")
        warnings.warn(f"rollout.cuda_graphs: capturing {what} x {Lg} keys failed ({why}); "
                      "decoding eagerly from now on", RuntimeWarning, stacklevel=2)


def _allocated(dev, when: str, reserved=False, peak=False) -> dict:
    """The CUDA caching allocator's counters on dev, named for DecodeGraphs.memory (no sync, no reset); {} off CUDA."""
    if dev.type != "cuda":
        return {}
    out = {f"allocated_{when}": torch.cuda.memory_allocated(dev)}
    if reserved:
        out[f"reserved_{when}"] = torch.cuda.memory_reserved(dev)
    if peak:
        out[f"peak_{when}"] = torch.cuda.max_memory_allocated(dev)
    return out
