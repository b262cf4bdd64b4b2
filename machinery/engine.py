"""
The generation engine: token ids in, sampled completions with their logprobs out. Its callers drive a session
(submit / step / end): rollout.py's single turn submits one call's prompts at once (env.generate), agents' episodes
(machinery/env.py) a trajectory's next turn as it comes, joining the running call; the Generator publishes with
update_weights(named_tensors, version) and cancels with abort / resume; release hands the memory to the learner
between calls (colocate.py), and share makes LoRA's frozen base the learner's own tensors (lora.share_base).
Here: TorchEngine and make_engine; SGLang's is sglang.py; the sampler is sampler.py's, SamplingParams and
Completion scheduler.py's, all importable from here.

A request's life in TorchEngine, in order. machinery/scheduler.py keeps the books on the host (rows, KV
blocks of the model.PagedKVCache pool, parked KV); this file runs the model, the rows' state on the device:

  submitted  generate / stream / submit queue a scheduler.Request (Scheduler.waiting)
  admitted   when a row is free and the pool has blocks for its context, within the prefill budget
             (Scheduler.admit, whose docstring has every rule): it takes its blocks and a row
  prefill    _prefill: the admitted fresh contexts packed into one forward (_pack; a prompt's n samples
             run their shared context once). Admission and prefill repeat while requests fit, so a wave of
             them prefills in forwards of at most prefill_tokens back to back; then each one's first token is
             sampled, all at once, and its row joins _Rows; one device read after them all
  decode     _decode, each iteration: one token for every running row at once (eager, or a CUDA graph of
             a padded bucket: graphs.py; or, in a call that speculates, k drafts verified in one forward:
             speculative.py), after a new block for each row whose next token starts one (Scheduler.grow)
  finished   a stop token or its length, seen by the iteration's one device read (_read)
  released   _release / Scheduler.release: its blocks and buffer row go back at once; its tokens copy to
             the host without waiting and join it one iteration later (_land / Scheduler.land): yielded
  or parked  a session's turn with a key (park=True) keeps its KV blocks when it ends (Scheduler.release
             keeps them, Scheduler.land parks them under its key), until its next turn or end(key)
  extended   that next turn, if its context extends the parked tokens, takes the blocks over and runs only
             its new tokens (_extend), then decodes as any row
  evicted    when the pool runs short, parked KV goes first, oldest first (that trajectory's next turn
             prefills its whole context); admit then makes the request wait, while grow retracts the
             newest running rows: blocks freed, back to the front of the queue with their tokens, to
             continue when prefilled again

The engine knows nothing of rewards, groups or staleness: it samples, and records which weight versions
produced each completion's tokens (the learner's staleness guard, train.rl_step, judges from that).
"""
import collections
import contextlib
import itertools
import threading
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from machinery import fp8, lora
from machinery.graphs import DecodeGraphs, decode_forward, fuse_norms, key_slots
from machinery.sampler import _M32, request_seeds, sample_keys, sample_tokens
from machinery.sampler import _mix32, _vocab_hash  # noqa: F401 (importable from here: the sampler's tests)
from machinery.scheduler import Completion, Request, SamplingParams, Scheduler, extend_routes, slots_of
from machinery.scheduler import ADMIT_FRACTION, PREFILL_TOKENS  # noqa: F401 (importable from here: memory.py's)
from machinery.sglang import SGLANG_MISSING, SGLangEngine  # noqa: F401 (make_engine's other engine)
from machinery.speculative import Speculative, synced
from model import BLOCK_SIZE, GLM, Packed, PagedKVCache, to_device


# ----------------------------------------------------------------------------- the torch engine

@dataclass
class _Rows:
    """The running rows' state on the device, entry b for the scheduler's running[b] (batch order): a decode
    step needs no host value, an iteration reads back status and ngen only (_read). Host copy of pos: Scheduler.pos."""
    last: torch.Tensor  # [B] the token to feed next (the one sampled last)
    pos: torch.Tensor  # [B] its position = tokens in the row's KV
    ngen: torch.Tensor  # [B] tokens sampled since admission: the row's next column in the token buffers
    left: torch.Tensor  # [B] tokens it may sample since admission (max_new less the tokens it had before)
    seeds: torch.Tensor  # [B] its request's noise seed
    base: torch.Tensor  # [B] tokens it had before admission: its noise step is base + ngen
    buf: torch.Tensor  # [B] its row of the token buffers out_tok / out_lp (the request's buf)
    status: torch.Tensor  # [B] 0 running, 1 done (a stop token or its length), 2 non-finite logits
    table: torch.Tensor  # [B, max_blocks] its KV block ids in position order (the request's blocks), 0-padded

    @staticmethod
    def empty(max_blocks: int, device):
        return _Rows(*(torch.zeros(0, dtype=torch.long, device=device) for _ in range(8)),
                     table=torch.zeros(0, max_blocks, dtype=torch.long, device=device))

    def keep(self, idx):  # the rows idx ([B'] on the device), in that order
        return _Rows(*(getattr(self, f.name)[idx] for f in fields(self)))

    def cat(self, new):  # these rows, then new's
        return _Rows(*(torch.cat((getattr(self, f.name), getattr(new, f.name))) for f in fields(self)))


class TorchEngine:
    """Generation on our own model with continuous batching over a paged KV pool (a request's life: this file's
    header; the rules: machinery/scheduler.py). Each iteration admits waiting requests while rows (at most
    max_batch) and KV blocks allow, prefills them together, then decodes one token for every running row; a
    finished row leaves at once and waiting ones take the free rows as soon as ADMIT_FRACTION of them are free,
    so no row waits for the longest. A row's KV never moves: it takes blocks as it grows.

    Host work: the rows' state stays on the device (_Rows), an iteration reads back only their status and counts, once,
    and a finished row's tokens travel in bulk, landing by the next iteration's read. graphs=True: the decode forward runs
    as a CUDA graph of a padded bucket (graphs.DecodeGraphs); speculative (speculative.py): k drafts verified per forward
    (with graphs, that forward and the MTP draft step too: DecodeGraphs.verify and .draft), in the calls it chooses
    (decided in _open: the whole call speculates, or the whole call runs the plain path). prefill_tokens: the most
    tokens one prefill forward packs (None: scheduler.PREFILL_TOKENS; make_engine gives what the memory plan counts).

    Sampling is per request (sample_tokens: noise from a hash of the request's seed and step), so a fixed
    seed gives the same tokens whatever the batch, retraction or re-prefill. Calls take turns (`call_lock`):
    one call's requests fill the pool at a time, so rollouts and eval share one pool, and same-seed runs
    stay bit-identical (the rows a request runs beside never depend on thread timing).

    Weights: `lock` is held for each forward and each update, so update_weights lands between two decode
    steps. Running rows then keep their KV, computed by the old weights (PRIME-RL, SkyRL), or with
    reprefill=True are retracted and prefilled again under the new ones (AReaL; SGLang's retract), and
    parked KV is dropped; each completion records the (oldest, newest) versions it spans. The engine owns
    its model: it is put in eval mode and frozen (and its RMSNorms fused: graphs.fuse_norms), so never hand it the
    learner's."""

    def __init__(self, model: GLM, max_batch: int = 64, kv_tokens: int | None = None, reprefill: bool = False,
                 graphs: bool = False, speculative=None, prefill_tokens: int | None = None):
        self.model = fuse_norms(model.eval().requires_grad_(False))  # its norms one Triton kernel each on a GPU
        self.max_batch, self.kv_tokens, self.reprefill, self.use_graphs = max_batch, kv_tokens, reprefill, graphs
        self.prefill_tokens = prefill_tokens
        # the Speculative (or None); the running call's when it speculates (else None: the plain path), and its drafts fed
        # per row past its next token (Scheduler's ahead)
        self.spec, self.call_spec, self.ahead = speculative, None, 0
        self.graphs, self.version = None, 0  # DecodeGraphs for the current pool (when graphs); the weights' version
        # held for one forward or one weight update (re-entrant: with reprefill, _step holds it over its checks and forwards)
        self.lock = threading.RLock()
        self.call_lock = threading.Lock()  # held for a whole call: its requests own the pool
        self._abort = threading.Event()
        self._params = dict(model.named_parameters())
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.pool = None  # the PagedKVCache, made by the first call that needs it
        self.sched = None  # the running call's Scheduler
        self.shared = set()  # weights that are the learner's tensors (share)
        self.released = {name: p.numel() * p.element_size() for name, p in self._params.items()  # memory out (release,
                         if p.numel() and p.untyped_storage().nbytes() == 0}  # or none yet: from_pretrained(weights=False))
        self.stats = dict.fromkeys(("iterations", "prefills", "prefill_tokens", "retracted", "graph_steps", "parked", "evicted",
                                    "extends", "extend_tokens", "decode_steps", "decode_rows"), 0)  # for tests and benchmarks

    # ------------------------------------------------------------------------- calls

    def generate(self, prompts: list[list[int]], sampling, seed: int | None = None) -> list[Completion]:
        """One Completion per prompt, in order. sampling: a SamplingParams, or one per prompt (they may
        differ in max_new_tokens only)."""
        return [c for _, c in sorted(self.stream(prompts, sampling, seed), key=lambda ic: ic[0])]

    def stream(self, prompts: list[list[int]], sampling, seed: int | None = None):
        """Yield (index, Completion) as requests finish. Closing the iterator early cancels the rest."""
        per = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        if len(per) != len(prompts):
            raise ValueError(f"{len(per)} SamplingParams for {len(prompts)} prompts")
        if len({(s.temperature, s.top_p, tuple(s.stop_token_ids)) for s in per}) > 1:
            raise ValueError("one call's SamplingParams may differ in max_new_tokens only")
        seeds = request_seeds(seed, len(prompts))
        longest = max((len(p) + s.max_new_tokens for p, s in zip(prompts, per)), default=1)
        width = max((s.max_new_tokens for s in per), default=1)
        with self.session(per[0] if per else SamplingParams(), longest, width) as call:
            for p, s, sd in zip(prompts, per, seeds):
                call.submit(p, s.max_new_tokens, sd)
            while call.busy:
                yield from call.step()

    # ------------------------------------------------------------------------- sessions (agents)

    @contextlib.contextmanager
    def session(self, sampling: SamplingParams, longest: int, width: int | None = None):
        """A running call that takes requests while it runs, for agents: the engine keeps decoding while
        some trajectories wait on their tools. Yields the engine, whose submit/step/end/busy are the
        session's; one thread drives it. longest: the most tokens a request's context and completion may
        reach; width: the most tokens one request samples (default sampling.max_new_tokens).

            with engine.session(sampling, longest) as call:
                call.submit(ids, max_new, seed, key=trajectory)  # a turn: the trajectory's whole context
                for index, completion in call.step(): ...       # one iteration: the turns that ended in it
                call.end(trajectory)                            # its episode is over: its parked KV is freed

        A turn with a key parks its KV when it ends (its row frees up); the key's next turn runs only its new
        tokens, unless the pool ran short and evicted it (the header's evicted)."""
        with self.call_lock:
            self._open(sampling, longest, width or sampling.max_new_tokens)
            try:
                yield self
            finally:
                self._close()

    def submit(self, prompt: list[int], max_new: int, seed: int, key=None, park: bool = True) -> int:
        """Queue a request (in a session); returns its index, which step() yields with its Completion. seed:
        32 bits (its noise); key: the trajectory it continues (None: none); park: keep its KV when it ends, for
        the key's next turn (False: the trajectory's last turn, its KV freed at once)."""
        if len(prompt) == 0:
            raise ValueError("cannot generate from an empty prompt")
        if len(prompt) + max_new > self.longest or max_new > self.out_tok.shape[1]:
            raise ValueError(f"a request of {len(prompt)} + {max_new} tokens exceeds the session's {self.longest} "
                             f"(and {self.out_tok.shape[1]} new)")
        self.sched.submit(Request(self.submitted, list(prompt), max_new, seed & _M32, key=key, park=park and key is not None))
        self.submitted += 1
        return self.submitted - 1

    def step(self) -> list[tuple[int, Completion]]:
        """One iteration (admit, prefill, decode one token per row): the requests that ended in it."""
        return list(self._iteration()) if self.busy else []

    @property
    def busy(self) -> bool:
        return bool(self.landing) or (self.sched is not None and self.sched.busy)

    @property
    def parked(self):  # the running session's parked KV: key -> (ids its blocks hold the KV of, blocks), oldest first
        return self.sched.parked if self.sched is not None else collections.OrderedDict()

    def end(self, key):
        """The trajectory is over: its parked KV goes back to the pool."""
        if self.sched is not None:  # (after the session: nothing parked)
            self.sched.end(key)

    # ------------------------------------------------------------------------- weights and memory

    @torch.no_grad()
    def update_weights(self, named_tensors, version: int):
        """Copy new weights in place (names as in model.named_parameters()); takes effect at the next
        forward of the call in flight. A released weight (release) gets its memory back first."""
        with self.lock:
            for name, t in named_tensors:
                if name not in self._params:
                    raise KeyError(f"update_weights: unknown parameter {name}")
                if name in self.released:
                    self._params[name].untyped_storage().resize_(self.released.pop(name))
                if (self._params[name].dtype == fp8.FP8) != (t.dtype == fp8.FP8):  # a cast would drop the block scales
                    raise TypeError(f"update_weights: {name} is {t.dtype} but the engine holds {self._params[name].dtype} "
                                    "(publish through parallel.full_weights(..., quantization) to match rollout.quantization)")
                self._params[name].copy_(t, non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.version = version

    def share(self, named_tensors):
        """Make these weights the given tensors themselves, not copies: LoRA's frozen base, which the learner
        holds on the same device (lora.share_base). Publishes never carry them, and release() keeps them."""
        with self.lock:
            for name, t in named_tensors:
                p = self._params[name]
                if (p.shape, p.dtype, p.device) != (t.shape, t.dtype, t.device):
                    raise ValueError(f"cannot share {name}: the engine holds {p.dtype} {tuple(p.shape)} on {p.device}, "
                                     f"the learner {t.dtype} {tuple(t.shape)} on {t.device}")
                p.data = t.detach()
                self.shared.add(name)
                self.released.pop(name, None)  # (its own memory, released or not, is gone with its old tensor)

    def release(self):
        """Co-located mode (colocate.py): give the memory back while the learner steps. The KV pool and the CUDA
        graphs, which bake in its addresses (the next call makes a new pool and captures new graphs), and every
        weight not shared with the learner: its storage shrinks to nothing, and the next update_weights must
        bring it back (the learner publishes in full after a co-located step). A running call ends first."""
        with self.call_lock, self.lock:
            self.pool = self.graphs = None
            for name, p in self._params.items():
                if name not in self.shared and name not in self.released:
                    self.released[name] = p.untyped_storage().nbytes()
                    p.untyped_storage().resize_(0)

    def abort(self):
        """Make in-flight calls return now (finish_reason "abort"); clear with resume()."""
        self._abort.set()

    def resume(self):
        self._abort.clear()

    # ------------------------------------------------------------------------- a call's state

    def _open(self, sampling, longest, width):
        """A call begins: the pool (made or reused: one per engine, sized for max_batch rows of `longest`
        tokens, or kv_tokens), its graphs, empty token buffers, and a fresh Scheduler over all its blocks."""
        if self.released:  # a bug, not a run's state: reading a released weight would read freed memory
            raise RuntimeError(f"the engine's weights were released and not all published back: {next(iter(self.released))}")
        self.sampling, self.landing = sampling, []
        self.kv_version = self.step_version = self.version  # the weights the running rows' KV was computed with
        # (reprefill), and those of the iteration's forwards (an abort may release before the first one)
        self.longest, self.submitted = longest, 0
        blocks = -(-longest // BLOCK_SIZE)
        need = self.max_batch * blocks if self.kv_tokens is None else -(-self.kv_tokens // BLOCK_SIZE)
        if self.kv_tokens is not None and blocks > need:
            raise ValueError(f"rollout.kv_cache_tokens ({self.kv_tokens}) cannot hold one sequence of {longest} tokens")
        if self.pool is None or self.pool.num_blocks < need:
            self.pool = self.graphs = None  # free the old pool (and the graphs that read it) first
            mtp = self.spec.drafter.mtp_layers if self.spec else 0  # the drafter's layers (speculative.MTPDrafter: L)
            cfg = replace(self.model.cfg, mtp_layers=mtp) if mtp else self.model.cfg
            self.pool = PagedKVCache(cfg, need, BLOCK_SIZE, self.device, self.dtype, mtp=bool(mtp))
        if self.use_graphs and (self.graphs is None or self.graphs.max_keys < longest or self.graphs.rows[-1] != self.max_batch):
            self.graphs = None
            self.graphs = DecodeGraphs(self.model, self.pool, self.max_batch, longest, capture=self.device.type == "cuda",
                                       verify=self.spec.k + 1 if self.spec else 0,  # (speculative.py's verify forward,
                                       draft=bool(self.spec and self.spec.drafter.mtp_layers))  # and the MTP draft step)
        on = self.spec.open(self.stats) if self.spec else False  # the whole call speculates, or none of it does
        self.call_spec, self.ahead = (self.spec, self.spec.k) if on else (None, 0)
        self.pool.free = list(range(self.pool.num_blocks - 1, -1, -1))
        self.sched = Scheduler(self.pool.free, self.max_batch, sampling.stop_token_ids, self.stats, ahead=self.ahead,
                               prefill_tokens=self.prefill_tokens)
        dev, B, W = self.device, self.max_batch, max(1, width) + self.ahead
        # Token buffers [max_batch, W]: a row's j-th token since admission at out_*[its buf, j] (+ k columns: speculative.py)
        self.out_tok = torch.zeros(B, W, dtype=torch.long, device=dev)
        self.out_lp = torch.zeros(B, W, dtype=torch.float32, device=dev)
        self.stop = torch.tensor(sorted(set(sampling.stop_token_ids)), dtype=torch.long, device=dev)
        self.max_blocks = blocks
        self.rows = _Rows.empty(blocks, dev)

    def _close(self):
        if self.spec:  # the call's mode's figure (speculative.Speculative.close)
            self.spec.close(self.stats)
        self.sched, self.landing, self.out_tok, self.out_lp, self.rows, self.call_spec = None, [], None, None, None, None

    # ------------------------------------------------------------------------- one iteration

    def _iteration(self):
        self.stats["iterations"] += 1
        if self._abort.is_set():  # every request of the call returns now, with what it has
            self._release(list(range(len(self.sched.running))), "abort", self._read())
            self._land(wait=True)
            self.sched.abort(self.version)
        else:
            self._step()
        finished, self.sched.finished = self.sched.finished, []
        for r in finished:
            yield r.index, Completion(r.tokens, r.logprobs, r.finish, tuple(r.versions), r.routes)

    def _step(self):
        """Grow, admit and prefill, decode one token for every row, read the device once; then the rows
        released one iteration ago land, and the rows that finished in this one are released."""
        self.step_version = self.version  # the weights of this iteration's forwards (each sets it under the lock)
        # With reprefill, the version check and the forwards that rely on it hold the lock together: an update landing
        # between them would decode new weights over the old weights' KV (a token of neither, and its routes)
        with self.lock if self.reprefill else contextlib.nullcontext():
            if self.reprefill and self.kv_version != self.version:  # new weights: no KV of the old ones survives
                if self.sched.running:
                    self._retract(len(self.sched.running))  # prefilled again below, under the new weights
                self.sched.evict(len(self.sched.parked))  # and no turn extends KV of the old weights
                self.kv_version = self.version
            self._grow()
            new = self._prefill()
            # (a wave whose every row ends with its first token, max_new 1, needs no decode step)
            first_only = len(new) == len(self.sched.running) and all(r.max_new - len(r.tokens) <= 1 for r in new)
            if self.sched.running and not first_only:
                self.call_spec.step(self) if self.call_spec else self._decode()
        host = self._read()
        self.sched.pos = host[2]  # (a speculative step moves each row its own number of positions)
        if (host[0] == 2).any():
            raise FloatingPointError(f"generator: non-finite logits at weight version {self.step_version} "
                                     "(the published weights overflow: lower the learning rate?)")
        self._land()  # what the last iteration released has arrived: the read above waited for it
        done = np.flatnonzero(host[0]).tolist()
        if done:
            self._release(done, "done", host)

    def _grow(self):
        """A block for every running row whose next token starts one (evicting parked KV, then retracting
        the newest rows, if short: Scheduler.grow), written into its row of the block table."""
        need = sorted(set(self.sched.grow(self._retract)[0]))  # (speculative: a row may take several)
        if need:
            table = [r.blocks + [0] * (self.max_blocks - len(r.blocks)) for r in (self.sched.running[b] for b in need)]
            self.rows.table[to_device(need, self.device, torch.long)] = to_device(table, self.device, torch.long)

    def _prefill(self):
        """Admit waiting requests while they fit (Scheduler.admit, in its order), each round prefilled by forwards back
        to back (no device read between them: the host packs the next while the device runs the last): fresh contexts
        as one packed row (_pack), then turns that extend parked KV by their new tokens only (_extend). Then the wave's
        first tokens at once: one lm_head, one sampling; their rows join _Rows. -> the admitted requests."""
        new, outs = [], []
        while reqs := self.sched.admit(self.version):
            self.stats["prefills"] += 1
            fresh, ext = [r for r in reqs if not r.cached], [r for r in reqs if r.cached]
            outs += ([self._pack(fresh)] if fresh else []) + ([self._extend(ext)] if ext else [])
            new += reqs
        if not new:
            return new
        dev, n = self.device, len(new)
        # each part's (h [m, hidden]: lm_head's inputs, pick [its requests]: each one's row of h, or None: one each)
        rows, at = [], 0
        for h, pick, _ in outs:
            rows.append(at + (pick if pick is not None else torch.arange(len(h), device=dev)))
            at += len(h)
        with self.lock:
            logits = self.model.lm_head(torch.cat([h for h, _, _ in outs]))[torch.cat(rows)]
            self.step_version = self.version
        if self.call_spec:  # the trunk's hidden whose logits these are: the drafter's first input (speculative.py)
            self.call_spec.admitted(self, new, torch.cat([last for _, _, last in outs]))
        seeds, base, left, buf = to_device([[r.seed for r in new], [len(r.tokens) for r in new],
                                            [r.max_new - len(r.tokens) for r in new], [r.buf for r in new]], dev, torch.long)
        tok, lp = sample_tokens(logits, self.sampling, sample_keys(seeds, base))
        self.out_tok[buf, 0], self.out_lp[buf, 0] = tok, lp
        table = torch.tensor([r.blocks + [0] * (self.max_blocks - len(r.blocks)) for r in new], dtype=torch.long)
        ones = torch.ones(n, dtype=torch.long, device=dev)
        pos = to_device([len(r.prompt) + len(r.tokens) for r in new], dev, torch.long)
        self.rows = self.rows.cat(_Rows(last=tok, pos=pos, ngen=ones, left=left, seeds=seeds, base=base, buf=buf,
                                        status=self._status(tok, lp, ones, left), table=to_device(table, dev)))
        return new

    def _pack(self, new):
        """Fresh contexts as one packed row -> (h, pick, last): lm_head's input h [m, hidden] and each request's row of
        it, pick [len(new)] (m: the distinct contexts' last tokens; speculative: h per request, pick None), and
        (speculative) the trunk's hidden there [len(new), hidden] (else None). Each distinct context runs once (a
        prompt's n samples share it); the pool gets its keys once per request (speculative: the drafter's too,
        Speculative.prefill)."""
        ctxs = [r.prompt + r.tokens for r in new]
        first, uniq, copy, seen = {}, [], [], collections.Counter()
        for c in ctxs:
            u = first.setdefault(tuple(c), len(uniq))
            if u == len(uniq):
                uniq.append(c)
            copy.append((u, seen[u]))  # (its context's place in uniq, how many requests had it before)
            seen[u] += 1
        starts = [0, *itertools.accumulate(len(c) for c in uniq)]  # each distinct context's first token in the row

        # Host arrays (numpy), one tensor each (a tensor per request would cost more than the tiny model's prefill):
        # the row's token ids, positions restarting at 0 per context, the slots of each context's first
        # request [T]; then per further copy, its requests' slots and the row tokens they take keys from
        dev = self.device
        ids = to_device(np.concatenate([np.asarray(c, dtype=np.int64) for c in uniq]), dev)
        pos = torch.from_numpy(np.concatenate([np.arange(len(c), dtype=np.int64) for c in uniq]))
        by_copy = collections.defaultdict(list)
        for r, (u, k) in zip(new, copy):
            by_copy[k].append((r, u))
        self.pool.slots = to_device(np.concatenate([slots_of(r.blocks, len(uniq[u])) for r, u in by_copy[0]]), dev)
        self.pool.copies = []
        for k in range(1, len(by_copy)):
            slots = np.concatenate([slots_of(r.blocks, len(uniq[u])) for r, u in by_copy[k]])
            src = np.concatenate([starts[u] + np.arange(len(uniq[u]), dtype=np.int64) for r, u in by_copy[k]])
            self.pool.copies.append((to_device(slots, dev), to_device(src, dev)))
        ends = to_device(starts[1:], dev, torch.long) - 1  # each distinct context's last token
        pick = to_device([u for u, _ in copy], dev, torch.long)  # each request's context
        self.stats["prefill_tokens"] += len(ids)
        self.pool.keys, self.pool.packed = None, Packed.of(pos[None], device=dev)  # grouped on the host: no read back
        pos, last = to_device(pos, dev), None
        try:
            with self.lock:
                if self.call_spec:  # the trunk at every position, for the drafter's KV; the norm on the rows sampled
                    trunk = self.model(ids[None], position_ids=pos[None], cache=self.pool, return_hidden="trunk")[0]
                    self.call_spec.prefill(self, trunk, ids.roll(-1), pos, ends=ends)  # (the token after each position)
                    last = trunk[ends][pick]
                    h, pick = self.model.norm(last), None
                else:
                    h = self.model(ids[None], position_ids=pos[None], cache=self.pool, return_hidden=True, keep=ends)[0]
                self.step_version = self.version
        finally:  # the next forward must not see this one's groups or copies
            self.pool.copies, self.pool.packed = [], None
        return h, pick, last

    def _extend(self, reqs):
        """Turns that extend their trajectory's parked KV (a tool's answer after the model's call): only the
        new tokens run, as the rows of paged forwards, one row per new token whose keys are its context's
        slots up to itself, as in a decode step (Attention.paged_decode writes every row's keys before any row
        reads). DSA's indexer keys extend the same way, each row's top-k chosen among its own prefix in position
        order, as the learner's forward chooses. -> (h, None, last) as _pack's: lm_head's input at each context's last
        token [len(reqs), hidden], and (speculative) the trunk's hidden there. At most max_batch rows per forward: none is larger than a decode step (the
        memory plan's)."""
        dev, L = self.device, max(len(r.prompt) + len(r.tokens) for r in reqs)
        tok = [t for r in reqs for t in (r.prompt + r.tokens)[r.cached:]]
        pos = [p for r in reqs for p in range(r.cached, len(r.prompt) + len(r.tokens))]
        owner = [i for i, r in enumerate(reqs) for _ in range(len(r.prompt) + len(r.tokens) - r.cached)]
        last = np.cumsum([len(r.prompt) + len(r.tokens) - r.cached for r in reqs]) - 1  # each request's last row
        tables = to_device([r.blocks + [0] * (self.max_blocks - len(r.blocks)) for r in reqs], dev, torch.long)
        tok, pos, owner = (to_device(x, dev, torch.long) for x in (tok, pos, owner))
        self.stats["extends"] += 1
        self.stats["extend_tokens"] += len(tok)
        self.stats["prefill_tokens"] += len(tok)
        hidden, step, nxt = [], self.max_batch, tok.roll(-1)  # (the token after each, for the drafter's KV)
        for a in range(0, len(tok), step):
            keys, valid = key_slots(tables[owner[a:a + step]], pos[a:a + step], L)  # [R, L], left-padded
            with self.lock:
                hidden.append(decode_forward(self.model, self.pool, tok[a:a + step, None], pos[a:a + step, None], keys,
                                             valid, hidden="trunk" if self.call_spec else True))
                if self.call_spec:
                    self.call_spec.prefill(self, hidden[-1], nxt[a:a + step], pos[a:a + step], keys, valid)
                self.step_version = self.version
        with self.lock:
            last = torch.cat(hidden)[to_device(last, dev, torch.long)]
            return (self.model.norm(last), None, last) if self.call_spec else (last, None, None)

    def _status(self, tok, lp, ngen, left):  # [B]: 2 if the logits were not finite, 1 if done (length or stop), else 0
        done = (ngen >= left) | (torch.isin(tok, self.stop) if len(self.stop) else False)
        return torch.where(lp.isnan(), 2, done.long())

    def _decode(self):
        """One token for every running row. Rows already done (a first token that was a stop) ride along
        until the read; they sample, but nothing is recorded for them. In an engine that may speculate (a plain call),
        each step is timed to a device sync, with the tokens it emitted: the plain mode's figure (speculative.py)."""
        rows, clock = self.rows, self.spec.clock if self.spec else None
        t0 = clock() if clock else None
        self.stats["decode_steps"] += 1
        self.stats["decode_rows"] += len(self.sched.running)
        Lk = int(self.sched.pos.max()) + 1
        graphs = self.graphs if self.graphs and not self.graphs.failed else None  # failed: eager, unpadded
        Bg, Lk = graphs.bucket(len(self.sched.running), Lk) if graphs else (None, Lk)  # a graph's shape: more keys
        keys, valid = key_slots(rows.table, rows.pos, Lk)  # [B, Lk], left-padded
        with self.lock:
            if graphs:
                logits = graphs.run(rows.last, rows.pos, keys, valid, Bg)
                self.stats["graph_steps"] += 1
            else:
                logits = decode_forward(self.model, self.pool, rows.last[:, None], rows.pos[:, None], keys, valid)
            self.step_version = self.version
        tok, lp = sample_tokens(logits, self.sampling, sample_keys(rows.seeds, rows.base + rows.ngen))
        live = rows.status == 0
        col = rows.ngen.clamp_max(self.out_tok.shape[1] - 1)
        self.out_tok[rows.buf, col] = torch.where(live, tok, self.out_tok[rows.buf, col])
        self.out_lp[rows.buf, col] = torch.where(live, lp, self.out_lp[rows.buf, col])
        rows.ngen = rows.ngen + live.long()
        rows.status = torch.where(live, self._status(tok, lp, rows.ngen, rows.left), rows.status)
        rows.last, rows.pos = tok, rows.pos + 1
        if clock:
            self.stats["plain_tokens"] = self.stats.get("plain_tokens", 0) + int(live.sum())
            self.stats["plain_decode_s"] = self.stats.get("plain_decode_s", 0) + synced(self.device, clock) - t0

    def _read(self):
        """The iteration's one device-to-host transfer: status, ngen (tokens since admission) and pos [3, B].
        (It waits for the device, so the tokens released by the iteration before have landed too.)"""
        if not self.sched.running:
            self._land(wait=True)
            return np.zeros((3, 0), dtype=np.int64)
        return torch.stack((self.rows.status, self.rows.ngen, self.rows.pos)).cpu().numpy()

    def _release(self, rows: list[int], finish: str | None, host):
        """Take rows out of the batch (finish: "done", "abort", or None: retracted; host: _read's [3, B]): the
        scheduler frees their blocks (not a parking turn's) and buffer rows at once, and their tokens since
        admission start copying to the host without waiting, to join their requests at the next _land."""
        idx = to_device(rows, self.device, torch.long)
        bufs = self.rows.buf[idx]
        snap = (self.out_tok[bufs].to("cpu", non_blocking=True), self.out_lp[bufs].to("cpu", non_blocking=True),
                self._routes(rows))
        batch, keep = self.sched.release(rows, finish, host[1], self.step_version)
        self.landing.append((batch, snap, finish))
        self.rows = self.rows.keep(to_device(keep, self.device, torch.long))

    def _routes(self, rows: list[int]):
        """MoE: the routes of the rows' positions so far (their KV's: every token fed, not the last sampled one), read
        out of the pool (model.PagedKVCache.routes: each layer's experts per slot, written beside the KV) before their
        blocks go back, copied to the host without waiting -> [[positions, n_moe, k] per row], or None (dense)."""
        if not self.pool.routes:
            return None
        if not rows:  # (an abort while no row runs)
            return ()
        n = [int(self.sched.pos[b]) for b in rows]
        idx = to_device(np.concatenate([slots_of(self.sched.running[b].blocks, m) for b, m in zip(rows, n)]), self.device)
        out = torch.stack([r.index_select(0, idx) for r in self.pool.routes], 1).to("cpu", non_blocking=True)
        return out.split(n)

    def _land(self, wait=False):
        """Released rows' tokens have arrived (after a host sync, or wait=True): they join their requests, and
        Scheduler.land sends each on (finished: to be yielded, a turn's KV parked; retracted: back to the queue)."""
        if wait and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        landed = []
        for batch, (tok, lp, routes), finish in self.landing:
            for j, (r, n) in enumerate(batch):
                r.tokens += tok[j, :n].tolist()
                r.logprobs += lp[j, :n].tolist()
                if routes is not None:  # the positions fed so far: not its last token (a row that stopped at its
                    # prefill's token rode one decode step along, feeding it: that route is not the trajectory's)
                    r.routes = extend_routes(r.routes, routes[j][:len(r.prompt) + len(r.tokens) - 1])
                landed.append((r, finish))
        self.sched.land(landed)
        self.landing = []

    def _retract(self, n: int):
        """Send the newest n running rows back to the queue (their blocks are freed; tokens kept)."""
        self.stats["retracted"] += n
        self._release(list(range(len(self.sched.running) - n, len(self.sched.running))), None, self._read())
        self._land(wait=True)  # they are back in the queue now


# ----------------------------------------------------------------------------- the config's choice

def make_engine(rollout, model_dir, device, *, dsa, seed: int, lora_cfg=None, empty=False, mtp=None, prefill_tokens=None):
    """The generator's engine (rollout.engine) on this process's generator device, holding a copy of
    model_dir. rollout: the config's rollout section; dsa: model.dsa; lora_cfg: model.lora (adapters on the
    engine's model too, decoded unmerged; the learner's publishes fill them). empty (co-located): no weights of
    its own until the learner's first publish fills them (with fp8 they load: quantizing needs them). mtp:
    model.mtp_layers, as the learner loads them (None: the checkpoint's). prefill_tokens: TorchEngine's (config.prefill_budget)."""
    if rollout.engine == "sglang":  # SGLang missing, a CPU device or a DSA model: one line naming the problem
        return SGLangEngine(model_dir, device, partial_rollout=rollout.partial_rollout, max_batch=rollout.max_batch,
                            mem_fraction_static=rollout.sglang_mem_fraction, seed=seed, dsa=True if dsa else None,
                            fp8=rollout.quantization == "fp8")
    model = GLM.from_pretrained(model_dir, dsa=dsa, device=device, weights=not empty or rollout.quantization == "fp8",
                                mtp=mtp)
    if rollout.quantization == "fp8":  # the decoder's linears to block-wise e4m3, layer by layer (fp8.py); a published
        fp8.quantize_model_(model, published=model_dir)  # FP8 checkpoint's own blocks where they are ours
    if lora_cfg is not None:
        lora.add(model, lora.LoRAConfig(**lora_cfg), seed=seed)
    # when weights land is the Generator's choice; what rows in flight then do, the engine's
    return TorchEngine(model, max_batch=rollout.max_batch, kv_tokens=rollout.kv_cache_tokens,
                       reprefill=rollout.update_mode == "reprefill",
                       graphs=rollout.cuda_graphs and torch.device(device).type == "cuda",
                       speculative=Speculative.of(model, rollout.speculative_tokens), prefill_tokens=prefill_tokens)
