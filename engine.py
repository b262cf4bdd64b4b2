"""
The generation engine: token ids in, sampled completions with their logprobs out. The RL side
(rollout.py, the next chapter) sees three calls: `generate` (or `stream`, which yields completions as
they finish), `update_weights(named_tensors, version)` and `abort`. This chapter is how they run:

  1. the sampler      sample_tokens: logits -> tokens and their logprobs; the noise is a hash of
                      (request seed, step, token id), so a request's draw never depends on its batch
  2. TorchEngine      continuous batching over model.PagedKVCache (a pool of KV blocks), packed prefills
                      and one decode step for all running rows; the map of a row's life is at its top
  3. DecodeGraphs     the decode step replayed as CUDA graphs of padded buckets (GPU)
  4. SGLangEngine     the same calls on SGLang (optional, GPU, dense checkpoints)
  5. make_engine      the config's choice (rollout.engine) on the generator's device

The engine knows nothing of rewards, groups or staleness: it samples, and records which weight version
produced each completion's tokens (the rollout chapter judges staleness from that).
"""
import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import itertools
import json
import os
import random
import shutil
import threading
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

import dsa
import dsa_triton
import fp8
import lora
from model import BLOCK_SIZE, GLM, Packed, PagedKVCache, hf_name, our_name, to_device


# ----------------------------------------------------------------------------- the sampler

@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    # Nucleus sampling, for eval and tools. RL rollouts keep 1.0: the logprobs are of the full tempered
    # distribution, which is what the learner recomputes; a truncated sampler would not match them.
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop_token_ids: tuple = ()


@dataclass
class Completion:
    token_ids: list[int]  # the sampled tokens, stop token included: the learner trains on these exact ids
    logprobs: list[float]  # log softmax(logits / temperature) of each sampled token
    finish_reason: str  # "stop" | "length" | "abort"
    versions: tuple[int, int]  # (oldest, newest) weight version that produced its tokens


_M32 = 0xFFFFFFFF


def _mix32(x):
    """A bijective hash of int64 tensors holding 32-bit values (two multiply-xorshift rounds; every
    product stays below 2^63)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def sample_keys(seeds, steps):
    """One 32-bit noise key per row: its request's seed and how many tokens it has sampled (int64 [B])."""
    return _mix32(seeds ^ _mix32(steps & _M32))


def request_seeds(seed: int | None, n: int) -> list[int]:
    """The noise seeds (32 bits) of a call's n requests: one base from the call's seed (None: fresh, from
    torch's RNG), hashed with each request's index, in one op (not one each)."""
    base = random.Random(seed).getrandbits(32) if seed is not None else int(torch.randint(0, 2**32, ()))
    return (base ^ _mix32(torch.arange(n))).tolist()


@functools.lru_cache(maxsize=8)
def _vocab_hash(vocab_size, device):
    """_mix32 of every token id [V], the same at every step: hashed once per vocabulary and device."""
    return _mix32(torch.arange(vocab_size, device=device))


def sample_tokens(logits, sampling: SamplingParams, keys):
    """logits [B, V], keys [B] (sample_keys) -> tokens [B], logprobs [B]. Gumbel-max: argmax(logp + g)
    with g = -log(-log u) draws exactly from softmax(logp), and u is a hash of (key, token id), so a row's
    draw depends on its own request and step only, never on which rows share its batch (no RNG state).
    The logprob is of the full temperature-scaled distribution (before top-p truncation), which is what
    the learner recomputes. A row whose logits are not finite (weights blown up) gets logprob NaN, for the
    engine to report at its next host sync, instead of a crash in the middle of the batch.
    This is the specification: on CUDA, RL's case (temperature > 0, no top-p) runs dsa_triton.sample, one
    fused kernel that computes the same from two reads of the logits (here, ~20 passes over [B, V])."""
    if sampling.temperature > 0 and sampling.top_p >= 1.0 and dsa._triton(logits):
        return dsa_triton.sample(logits, sampling.temperature, keys)
    logits = logits.float()
    finite = torch.isfinite(logits).all(-1, keepdim=True)  # [B, 1]
    logits = torch.where(finite, logits, 0.0)
    if sampling.temperature == 0:
        logp = logits.log_softmax(-1)
        tokens = logits.argmax(-1)
    else:
        logp = (logits / sampling.temperature).log_softmax(-1)
        scores = logp
        if sampling.top_p < 1.0:  # keep the smallest prefix of tokens reaching top_p, sample among them
            sorted_p, order = logp.exp().sort(-1, descending=True)
            drop = torch.zeros_like(logp, dtype=torch.bool).scatter(-1, order, sorted_p.cumsum(-1) - sorted_p > sampling.top_p)
            scores = logp.masked_fill(drop, float("-inf"))
        # u in (0, 1) from 23 bits: (n + 0.5) / 2^23 is exact in fp32 up to 1 - 2^-24 (with 24 bits the top value
        # rounds to 1.0, and its noise -log(-log 1) = inf would pick that token whatever its probability)
        u = (_mix32(keys[:, None] ^ _vocab_hash(logp.shape[-1], logp.device)[None]) >> 9).float().add_(0.5).mul_(2.0 ** -23)
        tokens = (scores - u.log_().neg_().log_()).argmax(-1)
    logp = logp.gather(-1, tokens[:, None])[:, 0]
    return tokens, torch.where(finite[:, 0], logp, float("nan"))


# ----------------------------------------------------------------------------- the torch engine

# A row's life, from admission to landing. A request of a call is a row while it decodes; its state lives
# on the device in nine [B]-long tensors (TorchEngine._ROW_STATE), one entry per running row in batch order:
#   last (next token to feed), pos (its position = tokens in the KV), ngen (tokens sampled since admission),
#   left (how many it may still sample), seeds, base (tokens it had before admission: its noise step offset),
#   buf (its row of the token buffers out_tok / out_lp [max_batch, W]), status (0 running, 1 done, 2 NaN),
#   table [B, blocks] (its KV block ids, position order); beside them host_pos (= pos, numpy) and reqs.
#
#   stream()   the call's _Requests wait in `waiting` (prompt, seed, max_new; tokens so far if retracted)
#   _admit     a waiting request takes blocks for its context + 1 from pool.free, a row and a buffer row
#   _prefill   its context runs in one packed forward (keys written to its blocks), its first token is
#              sampled into out_tok[buf, 0], and its entries are appended to the nine tensors
#   _grow      before each decode: a new block for a row whose next position starts one (if the pool is
#              short, _retract sends the newest rows back to `waiting`, tokens kept, blocks freed)
#   _decode    every row samples one token into out_tok[buf, ngen]; ngen, pos, last and status move on
#   _read      the iteration's one host read: status, ngen, buf [3, B]
#   _release   rows whose status is not 0 leave the batch: blocks and buffer row freed at once, their
#              tokens copied to the host without waiting (`landing`); _keep_rows compacts the nine tensors
#   _land      one iteration later, after the next _read has waited for the device: the tokens join the
#              request; finished ones go to `finished` and are yielded, retracted ones back to `waiting`

PREFILL_TOKENS = 4096  # tokens one prefill forward packs at most (a longer context goes alone)
# While rows are decoding, waiting requests are admitted once this fraction of max_batch rows is free (or
# every waiting request fits): a prefill costs a forward whatever its size, so rows that free up one at a
# time are refilled in batches, not by one small prefill each.
ADMIT_FRACTION = 1 / 8


@dataclass
class _Request:
    index: int  # its place in the call's prompt list
    prompt: list[int]
    max_new: int
    seed: int  # 32 bits: its sampling noise is a hash of (seed, step, token id)
    tokens: list[int] = field(default_factory=list)  # sampled before its current admission (a retracted row's)
    logprobs: list[float] = field(default_factory=list)
    versions: list | None = None  # [oldest, newest] weight version
    blocks: list[int] = field(default_factory=list)  # its KV blocks, in position order
    finish: str | None = None
    key: object = None  # a session's trajectory: a turn extends its parked KV
    park: bool = False  # ... and parks its own when it ends (not freed), for the trajectory's next turn
    cached: int = 0  # leading positions of its context whose KV its blocks already hold (a parked prefix)

    def completion(self):
        return Completion(self.tokens, self.logprobs, self.finish, tuple(self.versions))


class TorchEngine:
    """Generation on our own model with continuous batching over a paged KV pool.

    A call's requests wait in a queue. Each iteration admits waiting requests while there are free rows
    (at most max_batch decode at once) and free KV blocks, prefills them as one packed row (at most
    PREFILL_TOKENS; a prompt's n samples run their shared context once), then decodes one token for every
    running row together; a finished row leaves at once and waiting requests take the free rows as soon
    as ADMIT_FRACTION of them are free, so no row waits for the longest. KV lives in a
    model.PagedKVCache: blocks of BLOCK_SIZE slots are taken as a row grows and returned when it ends,
    nothing is copied. When blocks run out, the newest rows are retracted: their
    blocks are freed and they go back to the front of the queue with their tokens, to be prefilled again
    (prompt + tokens so far) and continue where they stopped.

    Host work: the running rows' state (next token, position, block table, tokens and logprobs so far,
    done flags) stays on the device; an iteration reads back only the rows' status and counts, once, and
    a finished row's tokens travel in bulk, landing by the next iteration's read. graphs=True: the decode
    forward runs as a CUDA graph of a padded bucket (DecodeGraphs; on a CPU, the same buckets eagerly).

    Sampling is per request (sample_tokens: noise from a hash of the request's seed and step), so a fixed
    seed gives the same tokens whatever the batch composition, retraction or re-prefill. Calls take turns
    (`call_lock`): one call's requests fill the pool at a time, so rollouts and eval share one pool and the
    rows a request runs beside do not depend on thread timing (same-seed runs stay bit-identical).

    Weights: `lock` is held for each forward and each update, so update_weights lands between two decode
    steps. Running rows then keep their KV, computed by the old weights (PRIME-RL, SkyRL), or with
    reprefill=True are retracted and prefilled again under the new ones (AReaL; SGLang's retract); each
    completion records the (oldest, newest) versions it spans. The engine owns its model: it is put in
    eval mode and frozen, so never hand it the learner's."""

    def __init__(self, model: GLM, max_batch: int = 64, kv_tokens: int | None = None, reprefill: bool = False,
                 graphs: bool = False):
        self.model = model.eval().requires_grad_(False)
        self.max_batch, self.kv_tokens, self.reprefill, self.use_graphs = max_batch, kv_tokens, reprefill, graphs
        self.graphs = None  # DecodeGraphs for the current pool, when graphs
        self.version = 0
        self.lock = threading.Lock()  # held for one forward or one weight update
        self.call_lock = threading.Lock()  # held for a whole call: its requests own the pool
        self._abort = threading.Event()
        self._params = dict(model.named_parameters())
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.pool = None  # the PagedKVCache, made by the first call that needs it
        self.shared = set()  # weights that are the learner's tensors (share)
        self.released = {name: p.numel() * p.element_size() for name, p in self._params.items()  # memory out (release,
                         if p.numel() and p.untyped_storage().nbytes() == 0}  # or none yet: from_pretrained(weights=False))
        self.stats = {"iterations": 0, "prefills": 0, "prefill_tokens": 0, "retracted": 0,  # for tests and benchmarks
                      "graph_steps": 0, "parked": 0, "evicted": 0, "extends": 0, "extend_tokens": 0,
                      "decode_steps": 0, "decode_rows": 0}

    # ------------------------------------------------------------------------- calls

    def generate(self, prompts: list[list[int]], sampling, seed: int | None = None) -> list[Completion]:
        """One Completion per prompt, in order. sampling: a SamplingParams, or one per prompt (they may
        differ in max_new_tokens only)."""
        out = [None] * len(prompts)
        for i, c in self.stream(prompts, sampling, seed):
            out[i] = c
        return out

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

        A request with a key parks when its turn ends: its KV blocks stay, its decode row frees up. The
        key's next turn (a context that extends the parked tokens) prefills only the new tokens
        (_extend). Parked KV is evicted, oldest first, before any running row is retracted when the pool
        runs short; an evicted trajectory's next turn prefills its whole context again."""
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
        r = _Request(self.submitted, list(prompt), max_new, seed & _M32, key=key, park=park and key is not None)
        self.submitted += 1
        self.waiting.append(r)
        return r.index

    def step(self) -> list[tuple[int, Completion]]:
        """One iteration (admit, prefill, decode one token per row): the requests that ended in it."""
        return list(self._iteration()) if self.busy else []

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.reqs or self.landing or self.finished)

    def end(self, key):
        """The trajectory is over: its parked KV goes back to the pool."""
        p = self.parked.pop(key, None)
        if p is not None:
            self.pool.free += reversed(p[1])

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
        holds on the same device (train.py). Publishes never carry them, and release() keeps them."""
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
        if self.released:  # a bug, not a run's state: reading a released weight would read freed memory
            raise RuntimeError(f"the engine's weights were released and not all published back: {next(iter(self.released))}")
        self.sampling, self.waiting, self.landing, self.finished = sampling, collections.deque(), [], []
        self.kv_version = self.version  # the weights the running rows' KV was computed with (reprefill)
        self.longest, self.submitted = longest, 0
        self.parked = collections.OrderedDict()  # key -> (ids whose KV its blocks hold, blocks), oldest first
        blocks = -(-longest // BLOCK_SIZE)
        need = self.max_batch * blocks if self.kv_tokens is None else -(-self.kv_tokens // BLOCK_SIZE)
        if self.kv_tokens is not None and blocks > need:
            raise ValueError(f"rollout.kv_cache_tokens ({self.kv_tokens}) cannot hold one sequence of {longest} tokens")
        if self.pool is None or self.pool.num_blocks < need:
            self.pool = self.graphs = None  # free the old pool (and the graphs that read it) first
            self.pool = PagedKVCache(self.model.cfg, need, BLOCK_SIZE, self.device, self.dtype)
        if self.use_graphs and (self.graphs is None or self.graphs.max_keys < longest or self.graphs.rows[-1] != self.max_batch):
            self.graphs = None
            self.graphs = DecodeGraphs(self.model, self.pool, self.max_batch, longest, capture=self.device.type == "cuda")
        self.pool.free = list(range(self.pool.num_blocks - 1, -1, -1))
        dev, B, W = self.device, self.max_batch, max(1, width)
        # Token buffers: row b of the batch writes its j-th token since admission at out_*[buf[b], j].
        self.out_tok = torch.zeros(B, W, dtype=torch.long, device=dev)
        self.out_lp = torch.zeros(B, W, dtype=torch.float32, device=dev)
        self.free_bufs = list(range(B - 1, -1, -1))
        self.stop = torch.tensor(sorted(set(sampling.stop_token_ids)), dtype=torch.long, device=dev)
        self.max_blocks = blocks
        self.reqs = []  # the running rows' requests, in batch order
        long = dict(dtype=torch.long, device=dev)
        # The running rows' state, on the device (the map above this class says what each tensor holds)
        self.last, self.pos, self.ngen, self.left = (torch.zeros(0, **long) for _ in range(4))
        self.seeds, self.base, self.buf = (torch.zeros(0, **long) for _ in range(3))
        self.status = torch.zeros(0, dtype=torch.long, device=dev)
        self.table = torch.zeros(0, blocks, **long)
        self.host_pos = np.zeros(0, dtype=np.int64)  # = pos, in numpy: block bookkeeping never reads the device

    def _close(self):
        self.waiting, self.reqs, self.landing, self.finished = collections.deque(), [], [], []
        self.parked = collections.OrderedDict()
        self.out_tok = self.out_lp = self.table = None

    _ROW_STATE = ("last", "pos", "ngen", "left", "seeds", "base", "buf", "status", "table")

    def _keep_rows(self, keep: list[int]):
        """Compact the running rows to `keep` (batch indices), in that order."""
        self.host_pos = self.host_pos[keep]
        idx = to_device(keep, self.device, torch.long)
        for name in self._ROW_STATE:
            setattr(self, name, getattr(self, name)[idx])
        self.reqs = [self.reqs[i] for i in keep]

    def _release(self, rows: list[int], finish: str | None, host):
        """Take rows out of the batch: their tokens since admission (host: [2, B] status and ngen as read)
        join their requests' lists; finished ones (finish set) are yielded, the others (retracted) go back
        to the front of the queue. Blocks and buffer rows are free at once."""
        idx = to_device(rows, self.device, torch.long)
        bufs = self.buf[idx]
        snap = (self.out_tok[bufs].to("cpu", non_blocking=True), self.out_lp[bufs].to("cpu", non_blocking=True))
        batch = []
        for j, b in enumerate(rows):
            r = self.reqs[b]
            if not r.park or finish != "done":  # a session's finished turn keeps its blocks (parked at _land)
                self.pool.free += reversed(r.blocks)
                r.blocks = []
            self.free_bufs.append(int(host[2][b]))
            batch.append((r, int(host[1][b])))
            r.versions[1] = max(r.versions[1], self.step_version)
        self.landing.append((batch, snap, finish))
        self._keep_rows([b for b in range(len(self.reqs)) if b not in set(rows)])

    def _land(self, wait=False):
        """Released rows' tokens have arrived (after a host sync, or wait=True): they join their requests,
        finished requests go to self.finished, retracted ones back to the front of the queue."""
        if wait and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        keep = []
        for batch, (tok, lp), finish in self.landing:
            for j, (r, n) in enumerate(batch):
                r.tokens += tok[j, :n].tolist()
                r.logprobs += lp[j, :n].tolist()
                if finish is None:  # retracted: back to the queue, oldest first
                    keep.append(r)
                else:
                    r.finish = finish if finish != "done" else ("stop" if r.tokens[-1:] and r.tokens[-1] in
                                                                 self.sampling.stop_token_ids else "length")
                    self.finished.append(r)
                    if r.blocks:  # parked: its KV holds every position but the last sampled token's (never fed)
                        self.end(r.key)
                        self.parked[r.key] = (r.prompt + r.tokens[:-1], r.blocks)
                        self.stats["parked"] += 1
                        r.blocks = []
        self.waiting.extendleft(reversed(keep))
        self.landing = []

    def _read(self):
        """The iteration's one device-to-host transfer: [3, B] status, tokens since admission, buffer row.
        (It waits for the device, so the tokens released by the iteration before have landed too.)"""
        if not self.reqs:
            self._land(wait=True)
            return np.zeros((3, 0), dtype=np.int64)
        return torch.stack((self.status, self.ngen, self.buf)).cpu().numpy()

    # ------------------------------------------------------------------------- one iteration

    def _iteration(self):
        self.stats["iterations"] += 1
        if self._abort.is_set():  # every request of the call returns now, with what it has
            self._release(list(range(len(self.reqs))), "abort", self._read())
            self._land(wait=True)
            for r in self.waiting:
                r.finish, r.versions = "abort", r.versions or [self.version, self.version]
            self.finished += self.waiting
            self.waiting = collections.deque()
        else:
            self._step()
        finished, self.finished = self.finished, []
        for r in finished:
            yield r.index, r.completion()

    def _step(self):
        self.step_version = self.version
        if self.reprefill and self.kv_version != self.version:
            if self.reqs:
                self._retract(len(self.reqs))  # prefilled again below, under the new weights
            self._evict(len(self.parked))  # and no turn extends KV of the old weights
            self.kv_version = self.version
        self._grow()
        new = self._admit()
        if new:
            self._prefill(new)
        if self.reqs:
            self._decode()
        host = self._read()
        if (host[0] == 2).any():
            raise FloatingPointError(f"generator: non-finite logits at weight version {self.step_version} "
                                     "(the published weights overflow: lower the learning rate?)")
        self._land()  # what the last iteration released has arrived: the read above waited for it
        done = np.flatnonzero(host[0]).tolist()
        if done:
            self._release(done, "done", host)

    def _retract(self, n: int):
        """Send the newest n running rows back to the queue (their blocks are freed; tokens kept)."""
        self.stats["retracted"] += n
        self._release(list(range(len(self.reqs) - n, len(self.reqs))), None, self._read())
        self._land(wait=True)  # they are back in the queue now

    def _evict(self, n: int, keep=None):
        """Drop the KV of the n longest-parked trajectories (but `keep`'s): their next turns prefill their
        whole context."""
        for victim in [k for k in self.parked if k != keep][:n]:
            self.end(victim)
            self.stats["evicted"] += 1

    def _grow(self):
        """A block for every running row whose next token starts one; evict parked KV, then retract the
        newest rows, if short."""
        need = np.flatnonzero(self.host_pos % BLOCK_SIZE == 0).tolist()
        while len(need) > len(self.pool.free) and self.parked:
            self._evict(1)
        while len(need) > len(self.pool.free):
            self._retract(1)
            need = [b for b in need if b < len(self.reqs)]
        if need:
            blocks = [self.pool.free.pop() for _ in need]
            for b, blk in zip(need, blocks):
                self.reqs[b].blocks.append(blk)
            rows, cols = to_device(np.stack((need, self.host_pos[need] // BLOCK_SIZE)), self.device)
            self.table[rows, cols] = to_device(blocks, self.device, torch.long)

    def _admit(self):
        """Waiting requests that fit now, oldest first: a free row, blocks for their context and first
        decoded token plus one spare block per running row (to grow into), and the prefill budget (a
        context already admitted in this round costs nothing: _prefill runs it once; a parked trajectory's
        turn costs its new tokens). Parked KV is evicted, oldest first, to make room. While rows are
        decoding, nobody is admitted until ADMIT_FRACTION of the rows (or all that wait) can be."""
        free_rows = self.max_batch - len(self.reqs)
        if self.reqs and free_rows < min(len(self.waiting), max(1, int(self.max_batch * ADMIT_FRACTION))):
            return []
        new, tokens, seen = [], 0, set()
        while self.waiting and len(self.reqs) + len(new) < self.max_batch:
            r = self.waiting[0]
            ctx = r.prompt + r.tokens
            ids, held = self.parked.get(r.key, ((), []))
            if not (len(ids) < len(ctx) and ctx[:len(ids)] == ids):  # its context does not extend the parked KV
                ids, held = (), []
            cost = 0 if not ids and tuple(ctx) in seen else len(ctx) - len(ids)
            blocks = len(ctx) // BLOCK_SIZE + 1 - len(held)
            if new and tokens + cost > PREFILL_TOKENS:
                break
            while blocks + len(self.reqs) + len(new) > len(self.pool.free) and any(k != r.key for k in self.parked):
                self._evict(1, keep=r.key)
            if blocks + len(self.reqs) + len(new) > len(self.pool.free) and (new or self.reqs):
                break
            self.waiting.popleft()
            if r.key in self.parked:  # taken over (extended), or dropped (its context went another way)
                if held:
                    del self.parked[r.key]
                else:
                    self.end(r.key)
            r.cached = len(ids)
            r.blocks = held + [self.pool.free.pop() for _ in range(blocks)]
            r.versions = r.versions or [self.version, self.version]
            new.append(r)
            tokens += cost
            if not ids:
                seen.add(tuple(ctx))
        return new

    def _prefill(self, new):
        """Prefill the admitted requests, sample their first token, add their rows: fresh contexts as one
        packed row (_pack), turns that extend parked KV by their new tokens only (_extend)."""
        self.stats["prefills"] += 1
        fresh, ext = [r for r in new if not r.cached], [r for r in new if r.cached]
        new = fresh + ext
        logits = torch.cat(([self._pack(fresh)] if fresh else []) + ([self._extend(ext)] if ext else []))
        dev, n, ctxs = self.device, len(new), [r.prompt + r.tokens for r in new]
        seeds, base, left, buf = to_device([[r.seed for r in new], [len(r.tokens) for r in new],
                                            [r.max_new - len(r.tokens) for r in new],
                                            [self.free_bufs.pop() for _ in new]], dev, torch.long)
        tok, lp = sample_tokens(logits, self.sampling, sample_keys(seeds, base))
        self.out_tok[buf, 0], self.out_lp[buf, 0] = tok, lp
        table = torch.tensor([r.blocks + [0] * (self.max_blocks - len(r.blocks)) for r in new], dtype=torch.long)
        ones = torch.ones(n, dtype=torch.long, device=dev)
        state = dict(last=tok, pos=to_device([len(c) for c in ctxs], dev, torch.long), ngen=ones, left=left,
                     seeds=seeds, base=base, buf=buf, status=self._status(tok, lp, ones, left), table=to_device(table, dev))
        for name in self._ROW_STATE:
            setattr(self, name, torch.cat((getattr(self, name), state[name])))
        self.host_pos = np.concatenate((self.host_pos, [len(c) for c in ctxs]))
        self.reqs += new

    def _pack(self, new):
        """Fresh contexts as one packed row -> logits [len(new), V] of each one's last token. Each distinct
        context runs once (a prompt's n samples share it); the pool gets its keys once per request."""
        ctxs = [r.prompt + r.tokens for r in new]
        first, uniq, copy, seen = {}, [], [], collections.Counter()
        for c in ctxs:
            u = first.setdefault(tuple(c), len(uniq))
            if u == len(uniq):
                uniq.append(c)
            copy.append((u, seen[u]))  # (its context's place in uniq, how many requests had it before)
            seen[u] += 1
        starts = [0, *itertools.accumulate(len(c) for c in uniq)]  # each distinct context's first token in the row

        def slots_of(r, n):  # the pool slots of a request's first n positions
            return [r.blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n)]

        # Host lists, one tensor each (a tensor per request would cost more than the tiny model's prefill):
        # the row's token ids, positions restarting at 0 per context, the slots of each context's first
        # request [T]; then per further copy, its requests' slots and the row tokens they take keys from
        dev = self.device
        ids = to_device([t for c in uniq for t in c], dev, torch.long)
        pos = torch.tensor([p for c in uniq for p in range(len(c))])
        by_copy = collections.defaultdict(list)
        for r, (u, k) in zip(new, copy):
            by_copy[k].append((r, u))
        self.pool.slots = to_device([s for r, u in by_copy[0] for s in slots_of(r, len(uniq[u]))], dev, torch.long)
        self.pool.copies = [(to_device([s for r, u in by_copy[k] for s in slots_of(r, len(uniq[u]))], dev, torch.long),
                             to_device([starts[u] + p for r, u in by_copy[k] for p in range(len(uniq[u]))], dev, torch.long))
                            for k in range(1, len(by_copy))]
        ends = to_device(starts[1:], dev, torch.long) - 1  # each distinct context's last token
        pick = to_device([u for u, _ in copy], dev, torch.long)  # each request's context
        self.stats["prefill_tokens"] += len(ids)
        self.pool.keys, self.pool.packed = None, Packed.of(pos[None], device=dev)  # grouped on the host: no read back
        try:
            with self.lock:
                hidden = self.model(ids[None], position_ids=to_device(pos, dev)[None], cache=self.pool, return_hidden=True,
                                    keep=ends)
                logits = self.model.lm_head(hidden[0])[pick]
                self.step_version = self.version
        finally:  # the next forward must not see this one's groups or copies
            self.pool.copies, self.pool.packed = [], None
        return logits

    def _extend(self, reqs):
        """Turns that extend their trajectory's parked KV (a tool's answer after the model's call): only the
        new tokens run, as the rows of paged forwards, one row per new token whose keys are its context's
        slots up to itself, as in a decode step (Attention.paged_decode writes every row's keys before any row
        reads). DSA's indexer keys extend the same way, and each row's top-k is chosen among its own prefix in
        position order, as the learner's forward chooses. -> logits [len(reqs), V] of each context's last
        token. At most max_batch rows per forward: none is larger than a decode step (the memory plan's)."""
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
        hidden, step = [], self.max_batch
        for a in range(0, len(tok), step):
            p = torch.arange(L, device=dev)[None] - (L - 1) + pos[a:a + step, None]  # [R, L]: key positions, left-padded
            valid = p >= 0
            p = p.clamp_min(0)
            keys = tables[owner[a:a + step]].gather(1, p // BLOCK_SIZE) * BLOCK_SIZE + p % BLOCK_SIZE
            with self.lock:
                hidden.append(decode_forward(self.model, self.pool, tok[a:a + step, None], pos[a:a + step, None], keys,
                                             valid, hidden=True))
                self.step_version = self.version
        with self.lock:
            return self.model.lm_head(torch.cat(hidden)[to_device(last, dev, torch.long)])

    def _status(self, tok, lp, ngen, left):
        done = (ngen >= left) | (torch.isin(tok, self.stop) if len(self.stop) else False)
        return torch.where(lp.isnan(), 2, done.long())

    def _decode(self):
        """One token for every running row. Rows already done (a first token that was a stop) ride along
        until the read; they sample, but nothing is recorded for them."""
        self.stats["decode_steps"] += 1
        self.stats["decode_rows"] += len(self.reqs)
        Lk = int(self.host_pos.max()) + 1
        graphs = self.graphs if self.graphs and not self.graphs.failed else None  # failed: eager, unpadded
        Bg, Lk = graphs.bucket(len(self.reqs), Lk) if graphs else (None, Lk)  # a graph's shape: more keys
        p = torch.arange(Lk, device=self.device)[None] - (Lk - 1) + self.pos[:, None]  # [B, Lk]: key positions, left-padded
        valid = p >= 0
        p = p.clamp_min(0)
        keys = self.table.gather(1, p // BLOCK_SIZE) * BLOCK_SIZE + p % BLOCK_SIZE
        with self.lock:
            if graphs:
                logits = graphs.run(self.last, self.pos, keys, valid, Bg)
                self.stats["graph_steps"] += 1
            else:
                logits = decode_forward(self.model, self.pool, self.last[:, None], self.pos[:, None], keys, valid)
            self.step_version = self.version
        tok, lp = sample_tokens(logits, self.sampling, sample_keys(self.seeds, self.base + self.ngen))
        live = self.status == 0
        col = self.ngen.clamp_max(self.out_tok.shape[1] - 1)
        self.out_tok[self.buf, col] = torch.where(live, tok, self.out_tok[self.buf, col])
        self.out_lp[self.buf, col] = torch.where(live, lp, self.out_lp[self.buf, col])
        self.ngen = self.ngen + live.long()
        self.status = torch.where(live, self._status(tok, lp, self.ngen, self.left), self.status)
        self.last, self.pos = tok, self.pos + 1
        self.host_pos = self.host_pos + 1


def decode_forward(model, pool: PagedKVCache, tokens, pos, keys, valid, hidden=False):
    """One decode forward over the paged pool: tokens, pos [B, 1]; keys, valid [B, Lk] (each row's slots in
    position order, its new token's last: Attention.paged_decode) -> logits [B, V] (hidden: the final
    hidden states [B, hidden], before lm_head)."""
    pool.keys, pool.key_valid, pool.slots = keys, valid, keys[:, -1]
    try:
        return model(tokens, position_ids=pos, cache=pool, return_hidden=hidden)[:, -1]
    finally:  # the next forward (a prefill) must not see them
        pool.keys = None


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
    graphs. With capture=False (a CPU, in tests) the same padded forward runs eagerly."""

    def __init__(self, model: GLM, pool: PagedKVCache, max_batch: int, max_keys: int, capture: bool):
        self.model, self.pool, self.capture, self.max_keys = model, pool, capture, max_keys
        self.rows = sorted({b for b in (1, 2, 4, 8) if b < max_batch} | set(range(GRAPH_ROW_STEP, max_batch, GRAPH_ROW_STEP))
                           | {max_batch})
        dev, long = pool.k[0].device, dict(dtype=torch.long, device=pool.k[0].device)
        self.tok, self.pos = torch.zeros(max_batch, 1, **long), torch.zeros(max_batch, 1, **long)
        self.keys = torch.zeros(max_batch * max_keys, **long)  # viewed as [Bg, Lg] (contiguous) by each bucket
        self.valid = torch.zeros(max_batch * max_keys, dtype=torch.bool, device=dev)
        self.logits = torch.zeros(max_batch, model.cfg.vocab_size, dtype=pool.k[0].dtype, device=dev)
        self.graphs, self.mempool, self.failed = {}, None, False

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
        self._forward(Bg, Lg)  # warm-up, and the reference this bucket's replay must reproduce
        eager = self.logits[:Bg].clone()
        dev = self.logits.device
        try:
            graph, main = torch.cuda.CUDAGraph(), torch.cuda.current_stream(dev)
            side = torch.cuda.Stream(dev)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                graph.capture_begin(pool=self.mempool, capture_error_mode="thread_local")
                try:
                    self._forward(Bg, Lg)
                finally:
                    graph.capture_end()
            main.wait_stream(side)
            self.mempool = graph.pool()
            graph.replay()
            got = self.logits[:Bg]
            tol = 4 * torch.finfo(eager.dtype).eps * eager.float().nan_to_num(0, 0, 0).abs().max().item()
            same = torch.isclose(got.float(), eager.float(), rtol=0, atol=tol, equal_nan=True).all().item()
            why = f"its replay's logits differ from eager by up to {(got.float() - eager.float()).abs().max().item():.3g}"
        except RuntimeError as e:
            same, why = False, f"{type(e).__name__}: {e}".splitlines()[0]
        if same:
            self.graphs[Bg, Lg] = graph
            return
        # Eager from now on. The graphs' memory goes back; this step runs again eagerly, which also rewrites
        # the keys and values a bad replay may have written
        self.failed, self.graphs, self.mempool = True, {}, None
        self._forward(Bg, Lg)
        warnings.warn(f"rollout.cuda_graphs: capturing the decode of {Bg} rows x {Lg} keys failed ({why}); "
                      "decoding eagerly from now on", RuntimeWarning, stacklevel=2)


# ----------------------------------------------------------------------------- the SGLang engine

SGLANG_MISSING = ("rollout.engine: sglang needs SGLang on a GPU machine: pip install -e '.[sglang]' "
                  "(it is not installed)")


class SGLangEngine:
    """TorchEngine's interface on SGLang's offline `sglang.Engine` (one GPU, tensor parallel 1, bf16),
    for dense GLM-4 checkpoints. Written against SGLang 0.5.9 (python/sglang/srt/entrypoints/engine.py,
    managers/tokenizer_manager.py, io_struct.py, layers/sampler.py); pause modes need >= 0.5.6, and the
    begin/end_weight_update session that newer releases (0.5.23) require is opened when SGLang has it.

    - token_ids: output_ids (ids in and out: skip_tokenizer_init), through the stop token. SGLang also
      stops at the checkpoint's own eos_token_id(s).
    - logprobs: meta_info["output_token_logprobs"], which SGLang's sampler computes as log softmax
      (logits / T) over the full vocabulary, before top-p (greedy: log softmax(logits)), as the learner
      does; SGLANG_RETURN_ORIGINAL_LOGPROB=1 would drop the T, so it is refused.
    - seed: one sampling_seed per request, honoured only with enable_deterministic_inference=True.
    - A weight update pauses generation in mode "retract": running requests go back to SGLang's queue,
      holding no KV, so the flush that ends the update cannot fail on them. With partial_rollout each
      one's prompt + tokens so far are prefilled again under the new weights on resume (TorchEngine
      keeps the old KV); versions are (version at submission, at return). Without, they are aborted.

    Threads: the Engine's sync methods run its asyncio loop until their call is done, so the generator
    and the learner calling them at once would run one loop twice. Instead a thread of ours runs that
    loop forever and every call submits coroutines to it (run_coroutine_threadsafe): the tokenizer
    manager and its zmq sockets are only used from that thread. Never call self.engine's sync methods."""

    def __init__(self, model_path: str, device, *, partial_rollout: bool = True, max_batch: int = 64,
                 mem_fraction_static: float = 0.8, seed: int = 0, dsa: bool | None = None, fp8: bool = False,
                 update_chunk_bytes: int = 2**30, **engine_kwargs):
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"rollout.engine: sglang runs on a CUDA generator device, got {device} "
                             "(use engine: torch)")
        config = os.path.join(model_path, "config.json")
        if dsa is None and os.path.isfile(config):  # our checkpoints have a "dsa" section when they use it
            with open(config) as f:
                dsa = bool(json.load(f).get("dsa"))
        if dsa:
            raise ValueError(f"{model_path}: a DSA model, and SGLang has no DSA kernel for our GLM-4 models; "
                             "engine: torch is the only engine that runs our DSA models")
        if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true", "yes", "on"):
            raise ValueError("unset SGLANG_RETURN_ORIGINAL_LOGPROB: SGLang would return logprobs without the "
                             "temperature, not the log softmax(logits / T) the learner recomputes")
        try:
            import sglang
            from sglang.srt.managers import io_struct
            from sglang.srt.utils import MultiprocessingSerializer
        except ImportError:
            raise ImportError(SGLANG_MISSING) from None
        self.io, self.serializer = io_struct, MultiprocessingSerializer
        self.device, self.dtype = device, torch.bfloat16
        if fp8:  # SGLang's block-wise FP8 runs a checkpoint that says so: an e4m3 copy of this one, in a temp dir
            self._fp8_dir = fp8_checkpoint(model_path)
            model_path = self._fp8_dir.name
        self.partial_rollout, self.chunk_bytes = partial_rollout, update_chunk_bytes
        self.version = 0
        self.engine = sglang.Engine(model_path=model_path, skip_tokenizer_init=True, tp_size=1,
                                    base_gpu_id=device.index or 0, dtype="bfloat16", random_seed=seed,
                                    mem_fraction_static=mem_fraction_static, max_running_requests=max_batch,
                                    **engine_kwargs)
        self.tm, self.loop = self.engine.tokenizer_manager, self.engine.loop
        self._aborted = threading.Event()
        self._inflight = 0  # our requests inside SGLang; read and written on the loop thread only
        self._thread = threading.Thread(target=self.loop.run_forever, name="sglang-loop", daemon=True)
        self._thread.start()

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def generate(self, prompts: list[list[int]], sampling, seed: int | None = None) -> list[Completion]:
        """sampling: a SamplingParams, or one per prompt (a multi-turn call's turns have their own budgets)."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("cannot generate from an empty prompt")
        per = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        rng = random.Random(seed)
        futures = []
        for p, s in zip(prompts, per):  # all at once: SGLang's scheduler batches them (up to max_batch running)
            sp = self._sampling_dict(s, s.max_new_tokens)
            if seed is not None:  # one seed per request: the n copies of a prompt must differ
                sp["sampling_seed"] = rng.getrandbits(31)
            futures.append(asyncio.run_coroutine_threadsafe(self._generate_one(list(p), sp), self.loop))
        return [f.result() for f in futures]

    @contextlib.contextmanager
    def session(self, sampling: SamplingParams, longest: int, width: int | None = None):
        """TorchEngine.session's calls on SGLang, for env.py's episode loop (token ids in and out, so nothing
        is re-tokenized): submit() sends a request at once, step() returns those that have finished (waiting a
        little for one), end() is a no-op (SGLang's radix cache keeps a trajectory's prefix while it has room,
        and its next turn reuses it). Each request's seed is its sampling_seed, honoured only with SGLang's
        deterministic inference: runs on SGLang are not reproducible, whatever rollout.env_admit_after says."""
        yield _SGLangSession(self, sampling)

    def _sampling_dict(self, s: SamplingParams, max_new: int):
        return {"temperature": s.temperature, "top_p": s.top_p, "max_new_tokens": max_new,
                "stop_token_ids": list(s.stop_token_ids)}

    async def _generate_one(self, prompt, sp):
        start = self.version
        if self._aborted.is_set():
            return Completion([], [], "abort", (start, start))
        self._inflight += 1
        try:
            out = await self.engine.async_generate(input_ids=prompt, sampling_params=sp, return_logprob=True)
        finally:
            self._inflight -= 1
        ids, meta = list(out["output_ids"]), out["meta_info"]
        finish = (meta.get("finish_reason") or {}).get("type")  # "stop" | "length" | "abort"
        if finish == "length" and ids and ids[-1] in sp["stop_token_ids"]:
            finish = "stop"  # SGLang checks the length first; TorchEngine calls this a stop
        finish = finish if finish in ("stop", "length") else "abort"  # abort (or unknown): regenerated
        entries = (meta.get("output_token_logprobs") or [])[:len(ids)]  # [(logprob, token id, text)]
        if [e[1] for e in entries] != ids[:len(entries)] or (len(entries) < len(ids) and finish != "abort"):
            raise RuntimeError(f"SGLang returned {len(ids)} token ids and {len(entries)} logprobs that do not line up")
        return Completion(ids[:len(entries)], [float(e[0]) for e in entries], finish, (start, self.version))

    @torch.no_grad()
    def update_weights(self, named_tensors, version: int):
        """Push (our name, tensor) pairs as HF names with update_weights_from_tensor, about chunk_bytes
        at a time, consuming the iterable as it goes: a lazy one (FSDP gathering a layer at a time) never
        has every weight alive at once. Its tensors must stay valid while we hold them (fresh tensors,
        as DTensor.full_tensor() returns). Each chunk is copied to the generator GPU in bf16 and handed
        to SGLang by CUDA IPC; the last one flushes SGLang's KV/radix cache."""
        items = iter(named_tensors)
        first = next(items, None)
        if first is None:  # nothing to push: only the version moves
            self.version = version
            return
        self._run(self.tm.pause_generation(self.io.PauseGenerationReqInput(mode="retract")))
        session = hasattr(self.io, "BeginWeightUpdateReqInput")  # newer SGLang loads weights inside a session
        try:
            if not self.partial_rollout:  # unfinished requests return "abort", to be regenerated
                self._run(self._abort_all())
            if session:
                self._check(self._run(self.tm.begin_weight_update(self.io.BeginWeightUpdateReqInput(), None)))
            chunk, size = [], 0
            for name, t in itertools.chain([first], items):  # fp8 weights and their fp32 scales travel as they are
                t = t.detach().to(self.device, self.dtype if t.dtype in (torch.float32, torch.bfloat16)
                                  and not name.endswith("_scale_inv") else t.dtype)
                if chunk and size + t.nbytes > self.chunk_bytes:
                    self._push(chunk, flush=False)  # not the last: another tensor follows
                    chunk, size = [], 0
                chunk.append((hf_name(name), t))
                size += t.nbytes
            self._push(chunk, flush=True)
            if session:
                self._check(self._run(self.tm.end_weight_update(self.io.EndWeightUpdateReqInput(), None)))
            self.version = version  # before resuming: whatever returns from now on ran on the new weights
        finally:  # resume even after a failure, or paused requests (and the generator thread) would hang
            self._run(self.tm.continue_generation(self.io.ContinueGenerationReqInput()))

    def _push(self, chunk, flush: bool):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the copies must be done before SGLang's process reads them
        req = self.io.UpdateWeightsFromTensorReqInput(serialized_named_tensors=[self.serializer.serialize(chunk)],
                                                      flush_cache=flush)  # one payload per TP rank
        self._check(self._run(self.tm.update_weights_from_tensor(req, None)))
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()  # free the chunk's memory once SGLang has closed its IPC handles

    @staticmethod
    def _check(result):
        success, message = result
        if not success:
            raise RuntimeError(f"SGLang weight update failed: {message}")

    def abort(self):
        """Make in-flight generate calls return now (finish_reason "abort"); clear with resume()."""
        self._aborted.set()
        asyncio.run_coroutine_threadsafe(self._abort_in_flight(), self.loop)

    async def _abort_in_flight(self):
        while self._aborted.is_set() and self._inflight:  # one may reach the scheduler after an abort: repeat
            await self._abort_all()
            await asyncio.sleep(0.05)

    async def _abort_all(self):  # a coroutine: the tokenizer manager is used on the loop thread only
        self.tm.abort_request(abort_all=True)

    def resume(self):
        self._aborted.clear()

    def shutdown(self):
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
        self.engine.shutdown()
        if getattr(self, "_fp8_dir", None) is not None:  # the e4m3 copy of the checkpoint goes with the engine
            self._fp8_dir.cleanup()


class _SGLangSession:
    """One session of an SGLangEngine (SGLangEngine.session): requests in flight as futures on its loop."""

    def __init__(self, engine, sampling):
        self.engine, self.sampling, self.futures, self.submitted = engine, sampling, {}, 0

    def submit(self, prompt, max_new, seed, key=None, park=True):
        if len(prompt) == 0:
            raise ValueError("cannot generate from an empty prompt")
        sp = self.engine._sampling_dict(self.sampling, max_new) | {"sampling_seed": seed & 0x7FFFFFFF}
        self.futures[self.submitted] = asyncio.run_coroutine_threadsafe(self.engine._generate_one(list(prompt), sp),
                                                                        self.engine.loop)
        self.submitted += 1
        return self.submitted - 1

    def step(self, wait_s=0.01):
        """The requests that have finished, in submission order (waiting up to wait_s for the first)."""
        if self.futures:
            concurrent.futures.wait(list(self.futures.values()), timeout=wait_s, return_when=concurrent.futures.FIRST_COMPLETED)
        done = [i for i, f in self.futures.items() if f.done()]
        return [(i, self.futures.pop(i).result()) for i in done]

    @property
    def busy(self):
        return bool(self.futures)

    def end(self, key):
        pass


def fp8_checkpoint(model_path):
    """A copy of an HF checkpoint directory with the decoder's linear weights in block-wise e4m3 and their
    weight_scale_inv (fp8.quantize), and a quantization_config that tells SGLang so (DeepSeek-V3's layout, the
    one SGLang's Fp8LinearMethod loads with block quantization): SGLang then runs fp8 GEMMs, and the learner's
    publishes (fp8.quantized_weights) replace these tensors under the same names. A TemporaryDirectory, removed
    when the engine goes."""
    import tempfile
    from safetensors import safe_open
    from safetensors.torch import save_file
    out = tempfile.TemporaryDirectory(prefix="glm-rl-fp8-")
    with open(os.path.join(model_path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [fp8.BLOCK, fp8.BLOCK]}
    with open(os.path.join(out.name, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in os.listdir(model_path):  # the tokenizer, generation_config.json and the rest, as they are
        if os.path.isfile(os.path.join(model_path, name)) and not name.endswith(".safetensors") and name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy(os.path.join(model_path, name), out.name)
    for fname in sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors")):
        with safe_open(os.path.join(model_path, fname), framework="pt") as f:
            tensors = {}
            for hf in f.keys():  # one file's tensors at a time
                t = f.get_tensor(hf)
                if fp8.is_quantized(our_name(hf)):
                    tensors[hf], tensors[hf + "_scale_inv"] = fp8.quantize(t)
                else:
                    tensors[hf] = t.to(torch.bfloat16) if t.is_floating_point() else t
        save_file(tensors, os.path.join(out.name, fname), metadata={"format": "pt"})
    if os.path.isfile(os.path.join(model_path, "model.safetensors.index.json")):
        with open(os.path.join(model_path, "model.safetensors.index.json")) as f:
            index = json.load(f)
        index["weight_map"] |= {k + "_scale_inv": v for k, v in index["weight_map"].items()
                                if fp8.is_quantized(our_name(k))}
        with open(os.path.join(out.name, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    return out


# ----------------------------------------------------------------------------- the config's choice

def make_engine(rollout, model_dir, device, *, dsa, seed: int, lora_cfg=None, empty=False):
    """The generator's engine (rollout.engine) on this process's generator device, holding a copy of
    model_dir. rollout: the config's rollout section; dsa: model.dsa; lora_cfg: model.lora (adapters on the
    engine's model too, decoded unmerged; the learner's publishes fill them). empty (co-located): no weights of
    its own until the learner's first publish fills them (with fp8 they load: quantizing needs them)."""
    if rollout.engine == "sglang":  # SGLang missing, a CPU device or a DSA model: one line naming the problem
        return SGLangEngine(model_dir, device, partial_rollout=rollout.partial_rollout, max_batch=rollout.max_batch,
                            mem_fraction_static=rollout.sglang_mem_fraction, seed=seed, dsa=True if dsa else None,
                            fp8=rollout.quantization == "fp8")
    model = GLM.from_pretrained(model_dir, dsa=dsa, device=device, weights=not empty or rollout.quantization == "fp8")
    if rollout.quantization == "fp8":  # the decoder's linears to block-wise e4m3, layer by layer (fp8.py)
        fp8.quantize_model_(model)
    if lora_cfg is not None:
        lora.add(model, lora.LoRAConfig(**lora_cfg), seed=seed)
    # when weights land is the Generator's choice; what rows in flight then do, the engine's
    return TorchEngine(model, max_batch=rollout.max_batch, kv_tokens=rollout.kv_cache_tokens,
                       reprefill=rollout.update_mode == "reprefill",
                       graphs=rollout.cuda_graphs and torch.device(device).type == "cuda")
