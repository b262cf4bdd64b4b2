"""
The scheduler of the torch engine: which requests hold a decode row, which KV blocks each one holds, and
where a row goes when it leaves the batch. Host bookkeeping only (Python lists and one numpy array): it
never touches the device, so it reads, and is tested (tests/test_scheduler.py), apart from the forward
(engine.py). TorchEngine makes one Scheduler per call (or session) and asks it, each iteration:

  grow      before the decode step: a block for each row whose next token starts one; short of blocks,
            parked KV is evicted (oldest first), then the newest rows are retracted
  admit     waiting requests take a row, a token-buffer row and the blocks their context needs, while
            the rules of admit() allow; a turn that extends its trajectory's parked KV takes it over
  release   rows that left the batch (finished, retracted or aborted) give back their blocks and their
            buffer row, except a finished turn that parks: its blocks stay with it
  land      once their tokens are on the host: a finished request waits in `finished` (a parking one's KV
            goes to `parked`, under its key), a retracted one goes back to the front of `waiting`
  end       a trajectory is over: its parked KV goes back to the pool

The KV pool is a model.PagedKVCache: num_blocks blocks of BLOCK_SIZE token slots. `free` is its free list
itself (PagedKVCache.free, popped from the end: the lowest block id first); a request's `blocks` are its
block ids in position order, so position p of its context lives in slot
blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE (slots_of).

Here too: the calls' small types, SamplingParams and Completion (both engines', importable from engine.py),
and Request, one request's books.
"""
import collections
from dataclasses import dataclass, field

import numpy as np
import torch

from model import BLOCK_SIZE

# Tokens a prefill forward packs at most, unless the engine is given its own prefill_tokens (config.prefill_budget: what
# the memory plan counts); a longer context goes alone
PREFILL_TOKENS = 4096
# While rows are decoding, waiting requests are admitted once this fraction of max_batch rows is free (or
# every waiting request fits): a prefill costs a forward whatever its size, so rows that free up one at a
# time are refilled in batches, not by one small prefill each.
ADMIT_FRACTION = 1 / 8

# A call's types: what it samples with, and what each of its requests returns. Both engines' calls take and
# give them (engine.py imports them from here, and so does sglang.py, which engine.py imports: here, no cycle).


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
    # MoE models: the experts each context position took, prompt and sampled tokens alike, uint8/int16 [positions,
    # n_moe layers, k] on the host (mla_moe.no_route where a layer did not route it); None for a dense model
    routes: torch.Tensor | None = None


@dataclass
class Request:
    """One request of a call: a prompt (or an agent's turn: its trajectory's whole context) to complete."""
    index: int  # its place in the call: generate's prompt list, or a session's submission order
    prompt: list[int]
    max_new: int  # tokens it may sample in all (across retractions)
    seed: int  # 32 bits: its sampling noise is a hash of (seed, step, token id)
    tokens: list[int] = field(default_factory=list)  # sampled so far, as landed (a retracted row's are kept)
    logprobs: list[float] = field(default_factory=list)
    versions: list | None = None  # [oldest, newest] weight version its tokens came from (set at admission)
    blocks: list[int] = field(default_factory=list)  # its KV blocks, in position order, while it holds any
    buf: int = -1  # its row of the engine's token buffers (out_tok / out_lp) while it runs
    finish: str | None = None  # "stop" | "length" | "abort", once it has finished
    key: object = None  # a session's trajectory: a turn extends the KV its key parked
    park: bool = False  # ... and parks its own when it ends (not freed), for the trajectory's next turn
    cached: int = 0  # leading positions of its context whose KV its blocks already hold (a parked prefix)
    routes: torch.Tensor | None = None  # MoE: [positions, n_moe, k] routes landed so far (extend_routes)


def slots_of(blocks: list[int], n: int) -> np.ndarray:
    """The pool slots [n] int64 of a context's first n positions, its blocks in position order (numpy: a prefill of
    4096 tokens asks for 4096 of them, and a list made position by position cost the engine milliseconds a chunk)."""
    held = np.asarray(blocks[:-(-n // BLOCK_SIZE)], dtype=np.int64)
    return (held[:, None] * BLOCK_SIZE + np.arange(BLOCK_SIZE)).reshape(-1)[:n]


def extend_routes(old, new):
    """Routes recorded so far, extended by a later record of the same context ([positions, n_moe, k] each): the
    positions `old` already holds keep their routes. A token's routes are those of the forward that first ran it
    (the weights that sampled it), even when its context runs again later under newer weights (a retracted row's
    prefill, a trajectory's evicted KV): the learner replays what the generator computed with."""
    if old is None or new is None:
        return new if old is None else old
    return torch.cat((old, new[len(old):])) if len(new) > len(old) else old


class Scheduler:
    """One call's rows and blocks. running[b] is the request in row b of the batch: the engine's device
    state (engine._Rows, [B] tensors) has its entries in the same order, and pos [B] (numpy int64) holds
    each row's next position (= tokens in its KV) on the host, so that block bookkeeping never reads the
    device. stats: the engine's counters ("parked", "evicted" are counted here)."""

    def __init__(self, free: list[int], max_batch: int, stop_ids=(), stats=None, ahead: int = 0, prefill_tokens=None):
        self.free = free  # free KV block ids: the pool's own list, shared with it
        self.prefill_tokens = prefill_tokens  # a prefill forward's tokens, at most (None: PREFILL_TOKENS)
        self.max_batch = max_batch  # rows decoding at once, at most
        # Speculative decoding (machinery/speculative.py) feeds a row's next token and `ahead` drafts at once: a row
        # holds blocks for positions up to pos + ahead (never past its last possible one), and may take up to
        # `spare` blocks at a step (k + 1 consecutive positions span at most ceil(k / BLOCK_SIZE) + 1 blocks)
        self.ahead, self.spare = ahead, 1 + -(-ahead // BLOCK_SIZE)
        self.free_bufs = list(range(max_batch - 1, -1, -1))  # free token-buffer rows; pop() hands out the lowest
        self.stop_ids = tuple(stop_ids)
        self.stats = stats if stats is not None else collections.Counter()
        self.waiting = collections.deque()  # requests not running, oldest first
        self.running = []  # the batch's requests, in batch order
        self.pos = np.zeros(0, dtype=np.int64)  # [B] each running row's next position
        self.parked = collections.OrderedDict()  # key -> (ids whose KV its blocks hold, blocks), oldest first
        self.landing = 0  # blocks held by finished turns that park, released but not landed yet (not evictable)
        self.finished = []  # finished requests, until the engine yields them

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running or self.finished)

    def submit(self, r: Request):
        self.waiting.append(r)

    def admit(self, version: int) -> list[Request]:
        """Waiting requests that fit now, oldest first, appended to `running` and returned in the order they
        join the batch: fresh contexts first, then turns that extend parked KV (the engine's prefill computes
        their logits in that order). A request fits with a free row and, in the pool, blocks for its context
        and its first decoded token (less the parked blocks it takes over) plus one spare block for every row
        running or admitted before it (each may need one to grow into at the next step), and within the
        prefill budget (prefill_tokens, or PREFILL_TOKENS)
        (a context already admitted in this round costs nothing: the prefill runs it once; an extending turn
        costs its new tokens). Parked KV of other trajectories is evicted, oldest first, to make room. The
        first request of a round goes whatever its size when no row runs and no finished turn's KV is on its
        way to parking (the pool is sized for one longest sequence; such KV is evictable once it lands, at the
        end of this iteration, so the request waits one). While rows are decoding, nobody is admitted until ADMIT_FRACTION of the rows (or all that
        wait) can be. version: the weights now, a new request's first version."""
        free_rows = self.max_batch - len(self.running)
        if self.running and free_rows < min(len(self.waiting), max(1, int(self.max_batch * ADMIT_FRACTION))):
            return []
        new, tokens, seen = [], 0, set()
        while self.waiting and len(self.running) + len(new) < self.max_batch:
            r = self.waiting[0]
            ctx = r.prompt + r.tokens
            ids, held = self.parked.get(r.key, ((), []))
            if not (len(ids) < len(ctx) and ctx[:len(ids)] == ids):  # its context does not extend the parked KV
                ids, held = (), []
            cost = 0 if not ids and tuple(ctx) in seen else len(ctx) - len(ids)
            # its context's blocks and its first decoded token's, with `ahead` the positions of its first verify's drafts
            top = len(ctx) + min(self.ahead, max(0, len(r.prompt) + r.max_new - 2 - len(ctx)))
            blocks = max(0, top // BLOCK_SIZE + 1 - len(held))  # (a speculative row may have parked more)
            if new and tokens + cost > (self.prefill_tokens or PREFILL_TOKENS):
                break
            while blocks + self.spare * (len(self.running) + len(new)) > len(self.free) and any(k != r.key for k in self.parked):
                self.evict(1, keep=r.key)
            # Too few blocks: wait for rows to finish, or for landing turns' KV to park (it is evictable then,
            # next iteration); only with neither may the first request go alone (the pool holds one longest)
            if blocks + self.spare * (len(self.running) + len(new)) > len(self.free) and (new or self.running or self.landing):
                break
            self.waiting.popleft()
            if r.key in self.parked:  # taken over (extended), or dropped (its context went another way)
                if held:
                    del self.parked[r.key]
                else:
                    self.end(r.key)
            r.cached = len(ids)
            r.blocks = held + [self.free.pop() for _ in range(blocks)]
            r.versions = r.versions or [version, version]
            new.append(r)
            tokens += cost
            if not ids:
                seen.add(tuple(ctx))
        new = [r for r in new if not r.cached] + [r for r in new if r.cached]
        for r in new:
            r.buf = self.free_bufs.pop()
        self.running += new
        self.pos = np.concatenate((self.pos, np.array([len(r.prompt) + len(r.tokens) for r in new], dtype=np.int64)))
        return new

    def grow(self, retract) -> tuple[list[int], list[int]]:
        """Before a decode step: a block for every running row whose next token starts one (pos a multiple
        of BLOCK_SIZE), appended to its request's blocks -> (those rows, their new blocks), for the engine's
        block table. With `ahead` (speculative decoding) a row takes every block its next ahead + 1 positions
        need, so a row may be listed more than once. Short of blocks: parked KV is evicted, oldest first; still
        short, retract(1), the engine's, takes the newest row out (its tokens are on the device: the engine reads
        them back, and release / land put it back at the front of `waiting`), until the rows that remain fit."""
        short = self.short()
        while short.sum() > len(self.free) and self.parked:
            self.evict(1)
        while short.sum() > len(self.free):
            retract(1)
            short = short[:len(self.running)]
        need = [b for b in np.flatnonzero(short).tolist() for _ in range(short[b])]
        blocks = [self.free.pop() for _ in need]
        for b, blk in zip(need, blocks):
            self.running[b].blocks.append(blk)
        return need, blocks

    def short(self):
        """[B] the blocks each running row lacks for its next step: the positions it feeds, pos .. pos + ahead, but
        none past its request's last fed position (prompt + max_new - 2: its last sampled token is never fed)."""
        if not self.ahead:  # one position: a block where it starts one (the row holds the blocks of every earlier one)
            return (self.pos % BLOCK_SIZE == 0).astype(np.int64)
        last = np.array([len(r.prompt) + r.max_new - 2 for r in self.running], dtype=np.int64)
        top = self.pos + np.clip(last - self.pos, 0, self.ahead)
        return np.maximum(top // BLOCK_SIZE + 1 - np.array([len(r.blocks) for r in self.running], dtype=np.int64), 0)

    def decoded(self):
        """A decode step fed every running row one token: each row's next position moves on."""
        self.pos = self.pos + 1

    def release(self, rows: list[int], finish: str | None, ngen, version: int):
        """Take rows (batch indices) out of the batch. finish: "done" (a stop token or its length; land tells
        which), "abort", or None (retracted: to run again). ngen [B] (host): tokens each row sampled since its
        admission; version: the weights of the step that last touched them. Each row gives back its buffer
        row and its blocks, but a session's finished turn that parks keeps its blocks (land parks them).
        -> (batch: [(request, its ngen)] in rows' order, for the engine to join their tokens once they land;
        keep: the batch indices that stay, in order, for the engine to compact its device state)."""
        batch = []
        for b in rows:
            r = self.running[b]
            if not r.park or finish != "done":
                self.free += reversed(r.blocks)
                r.blocks = []
            else:
                self.landing += len(r.blocks)
            self.free_bufs.append(r.buf)
            batch.append((r, int(ngen[b])))
            r.versions[1] = max(r.versions[1], version)
        gone = set(rows)
        keep = [b for b in range(len(self.running)) if b not in gone]
        self.running = [self.running[b] for b in keep]
        self.pos = self.pos[keep]
        return batch, keep

    def land(self, landed: list[tuple[Request, str | None]]):
        """Released requests whose tokens have joined their lists, with their release's finish. A retracted
        one (None) goes back to the front of `waiting` (they keep their order). A finished one waits in
        `finished` with its reason ("stop" when its last token is a stop token, else "length"; or "abort");
        one that kept its blocks parks them under its key: they hold the KV of every position but its last
        sampled token's (never fed), and replace whatever that key had parked."""
        back = []
        for r, finish in landed:
            if finish is None:
                back.append(r)
                continue
            r.finish = finish if finish != "done" else ("stop" if r.tokens[-1:] and r.tokens[-1] in
                                                         self.stop_ids else "length")
            self.finished.append(r)
            if r.blocks:
                self.landing -= len(r.blocks)
                self.end(r.key)
                self.parked[r.key] = (r.prompt + r.tokens[:-1], r.blocks)
                self.stats["parked"] += 1
                r.blocks = []
        self.waiting.extendleft(reversed(back))

    def end(self, key):
        """The trajectory is over: its parked KV goes back to the pool."""
        p = self.parked.pop(key, None)
        if p is not None:
            self.free += reversed(p[1])

    def evict(self, n: int, keep=None):
        """Drop the KV of the n longest-parked trajectories (but `keep`'s): their next turns prefill their
        whole context."""
        for victim in [k for k in self.parked if k != keep][:n]:
            self.end(victim)
            self.stats["evicted"] += 1

    def abort(self, version: int):
        """Every waiting request finishes now, "abort", with the tokens it has."""
        for r in self.waiting:
            r.finish, r.versions = "abort", r.versions or [version, version]
        self.finished += self.waiting
        self.waiting = collections.deque()
