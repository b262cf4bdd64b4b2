"""
The decode step as a function of the paged KV pool (decode_forward), and that step replayed as CUDA graphs
of padded buckets (DecodeGraphs). TorchEngine (engine.py) builds each row's key slots with key_slots and
calls decode_forward for its eager decode steps and for the rows of a turn that extends parked KV; with
graphs on, a decode step goes through DecodeGraphs.run instead (on a CPU, in tests, the same padded buckets
run eagerly).
"""
import warnings

import torch

from model import BLOCK_SIZE, GLM, PagedKVCache


def decode_forward(model, pool: PagedKVCache, tokens, pos, keys, valid, hidden=False):
    """One decode forward over the paged pool: tokens, pos [B, 1]; keys, valid [B, Lk] (each row's slots in
    position order, its new token's last: Attention.paged_decode) -> logits [B, V] (hidden: the final
    hidden states [B, hidden], before lm_head)."""
    pool.keys, pool.key_valid, pool.slots = keys, valid, keys[:, -1]
    try:
        return model(tokens, position_ids=pos, cache=pool, return_hidden=hidden)[:, -1]
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

    A bucket is captured on the first step that needs it: an eager run of the same padded inputs (Triton
    compiles its kernels, cuBLAS picks its algorithms), the capture, then a replay whose logits must match
    the eager run's to a few roundings (a guard against a capture gone wrong: on a mismatch, or an error
    while capturing, the graphs and their memory are dropped, the step runs again eagerly, rewriting any
    keys a bad replay wrote, and the engine decodes eagerly from then on, with a warning). The very first
    capture is of the largest bucket, all padding rows, so that the smaller ones reuse its memory. Captures
    run on a stream of the engine's GPU and their errors are thread-local: the learner's thread beside it
    keeps its own GPU (torch.cuda.graph would also empty every device's allocator cache). Weight updates
    copy in place, so graphs stay valid; a new pool (a call with longer sequences) or max_batch gets new
    graphs. With capture=False (a CPU, in tests) the same padded forward runs eagerly.

    `memory` is a diagnostic for the memory plan (bench/gpu_memory.py prints it): per bucket (Bg, Lg) captured,
    the allocator's figures in bytes around it, read from its counters without a sync or a reset: allocated and
    reserved before the eager warm-up, allocated after it, the process's peak allocated before and after it (the
    warm-up's own peak where that rose), allocated and reserved after the capture, and whether the bucket was kept."""

    def __init__(self, model: GLM, pool: PagedKVCache, max_batch: int, max_keys: int, capture: bool):
        self.model, self.pool, self.capture, self.max_keys = model, pool, capture, max_keys
        self.rows = sorted({b for b in (1, 2, 4, 8) if b < max_batch} | set(range(GRAPH_ROW_STEP, max_batch, GRAPH_ROW_STEP))
                           | {max_batch})
        dev, long = pool.k[0].device, dict(dtype=torch.long, device=pool.k[0].device)
        self.tok, self.pos = torch.zeros(max_batch, 1, **long), torch.zeros(max_batch, 1, **long)
        self.keys = torch.zeros(max_batch * max_keys, **long)  # viewed as [Bg, Lg] (contiguous) by each bucket
        self.valid = torch.zeros(max_batch * max_keys, dtype=torch.bool, device=dev)
        self.logits = torch.zeros(max_batch, model.cfg.vocab_size, dtype=pool.k[0].dtype, device=dev)
        # One side stream for every capture: cuBLAS keeps a workspace (32 MiB on Hopper) per stream, and the caching
        # allocator reuses a freed block only on the stream that freed it, so a new stream per capture made each
        # bucket keep its own workspace in the pool (measured on an H100: 0.031 GiB and 0.06 GiB reserved a bucket;
        # with one stream the later buckets add nothing)
        self.graphs, self.mempool, self.failed, self.stream = {}, None, False, None
        self.memory = {}  # (Bg, Lg) -> bytes around its capture (the docstring's last paragraph)

    def bucket(self, B: int, Lk: int):
        """The (rows, keys) shape a step of B rows and Lk keys runs as."""
        Bg = next(b for b in self.rows if b >= B)
        Lg = GRAPH_MIN_KEYS
        while Lg < Lk:
            Lg *= 2
        return Bg, min(Lg, self.max_keys)

    def run(self, tok, pos, keys, valid, Bg):
        """tok, pos [B]; keys, valid [B, Lg] (a bucket's width) -> logits [B, V] of the padded forward."""
        B, Lg = keys.shape
        if self.capture and not self.failed and not self.graphs and (Bg, Lg) != (self.rows[-1], self.max_keys):
            # The largest bucket first, all padding rows: every later capture then fits in the memory it
            # freed, and the graphs' pool stays one largest forward (the memory plan's figure)
            self.run(tok[:0], pos[:0], keys.new_zeros(0, self.max_keys), valid.new_zeros(0, self.max_keys), self.rows[-1])
        self.tok[:B, 0], self.pos[:B, 0] = tok, pos
        self.tok[B:Bg], self.pos[B:Bg] = 0, 0
        k, v = self.keys[:Bg * Lg].view(Bg, Lg), self.valid[:Bg * Lg].view(Bg, Lg)
        k[:B], v[:B] = keys, valid
        k[B:], v[B:] = self.pool.scratch, False
        v[B:, -1] = True  # a padding row sees its own (scratch) slot: finite, and nobody else's
        if not self.capture or self.failed:
            self._forward(Bg, Lg)
        elif (Bg, Lg) in self.graphs:
            self.graphs[Bg, Lg].replay()
        else:
            self._capture(Bg, Lg)
        return self.logits[:B]

    def _forward(self, Bg, Lg):
        """The captured work: the model on the static buffers, logits into self.logits."""
        self.logits[:Bg] = decode_forward(self.model, self.pool, self.tok[:Bg], self.pos[:Bg],
                                          self.keys[:Bg * Lg].view(Bg, Lg), self.valid[:Bg * Lg].view(Bg, Lg))

    def _capture(self, Bg, Lg):
        """Warm up, capture on a stream of our own (left whatever happens: a failed capture must not leave
        this thread on it), replay, and check the replay against the warm-up."""
        dev = self.logits.device
        mem = self.memory[Bg, Lg] = _allocated(dev, "before", reserved=True, peak=True)
        self._forward(Bg, Lg)  # warm-up, and the reference this bucket's replay must reproduce
        eager = self.logits[:Bg].clone()
        mem |= _allocated(dev, "after_warmup", peak=True)  # (with the reference copy, gone after the check)
        try:
            graph, main = torch.cuda.CUDAGraph(), torch.cuda.current_stream(dev)
            side = self.stream = self.stream or torch.cuda.Stream(dev)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                graph.capture_begin(pool=self.mempool, capture_error_mode="thread_local")
                try:
                    self._forward(Bg, Lg)
                finally:
                    graph.capture_end()
            main.wait_stream(side)
            mem |= _allocated(dev, "after_capture", reserved=True)
            self.mempool = graph.pool()
            graph.replay()
            got = self.logits[:Bg]
            tol = 4 * torch.finfo(eager.dtype).eps * eager.float().nan_to_num(0, 0, 0).abs().max().item()
            same = torch.isclose(got.float(), eager.float(), rtol=0, atol=tol, equal_nan=True).all().item()
            why = f"its replay's logits differ from eager by up to {(got.float() - eager.float()).abs().max().item():.3g}"
        except RuntimeError as e:
            same, why = False, f"{type(e).__name__}: {e}".splitlines()[0]
        mem["kept"] = bool(same)
        if same:
            self.graphs[Bg, Lg] = graph
            return
        # Eager from now on. The graphs' memory goes back; this step runs again eagerly, which also rewrites
        # the keys and values a bad replay may have written
        self.failed, self.graphs, self.mempool = True, {}, None
        self._forward(Bg, Lg)
        warnings.warn(f"rollout.cuda_graphs: capturing the decode of {Bg} rows x {Lg} keys failed ({why}); "
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
