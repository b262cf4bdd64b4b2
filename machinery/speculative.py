"""
Speculative decoding in the torch engine: a drafter proposes k tokens per row, the target model verifies them
in one forward, and every token emitted is exactly the one the plain engine samples there, with its logprob.
TorchEngine (engine.py) calls Speculative.step in place of its one-token decode step when it was built with
one (make_engine: rollout.speculative_tokens), in the calls that speculate (all, or where it pays: the last
paragraph); the rest of a request's life (admission, prefill, sessions, retraction, release) is the engine's,
unchanged. One step, for the running rows (engine._Rows, batch order):

  draft   the drafter proposes d_1..d_k for positions pos+1..pos+k (pos: where the row's last sampled token
          `last` goes). It draws each with the engine's own noise for that position: sample_keys(seed,
          base + ngen + j) for d_{j+1}, the key the plain engine samples token ngen + j with (draft_keys), so
          a drafter that knows the target's distribution proposes exactly the target's token
  verify  one paged forward feeds every row's last, d_1..d_k at positions pos..pos+k, one pool row per token
          (as engine._extend does: each token's keys are its own prefix, written before any row reads, so DSA
          chooses its top-k among them and MoE writes each token's routes beside its KV). Each position's
          logits are sampled with the plain engine's key for it (sample_tokens, so the fused GPU sampler where
          the plain engine uses it): y_0..y_k, y_j the token the plain engine would sample after d_j
  accept  drafts are accepted while they equal the target's: a = accepted(d, y) (d_{j+1} == y_j for every
          j < a). The row emits y_0..y_a (the accepted drafts, then the target's own token at the first
          mismatch, or the bonus token y_k after k accepted), cut after a stop token and at max_new exactly
          where the plain engine stops. Tokens and logprobs are the target's: only the number of forwards
          changes (on a CPU bit for bit up to the matmul's roundings across batch shapes, as any batching)
  clear   the slots of the positions fed but not kept (a rejected draft, or past a stop) are cleared in
          every store of the pool (keys, values or MLA latents, DSA indexer keys: zeros; MoE routes: "not
          routed"), so a row's pool slots hold what a plain run's hold; the row moves on by the tokens kept

A row feeds at most left - 1 drafts (its last sampled token is never fed), and rows already done feed their
last token only, as in a plain step (they ride along until the read); the unused verify rows are padding that
reads and writes the pool's scratch slot alone, so the forward keeps one shape [B * (k + 1)]. The Scheduler
(ahead=k) gives each row the blocks of its next k + 1 positions before the step; the engine learns how far
each row moved at its one read per iteration (_read's pos). With the engine's CUDA graphs on (rollout.cuda_graphs),
the verify forward is a replay of a padded bucket (graphs.DecodeGraphs.verify: Bg >= B rows of k + 1 tokens, Lg keys,
at most the call's longest as no row feeds a position past it; the padding rows again on the scratch slot alone),
counted in graph_steps; and so does the MTP drafter's draft step (MTPDrafter.draft: each of its k chained steps a replay
of a padded bucket of graphs.DecodeGraphs.draft, the hidden states in and out in static buffers, its padding rows on the
scratch slot alone), counted in spec_graph_drafts. The drafter's other forwards (its prefill, its extend) run eagerly.

The drafter (Drafter, below) is any object with draft(engine, rows, hidden, fresh, k) -> tokens [B, k] and
extend(engine, rows, verify), and optionally prefill (its KV at a prefill's positions) and mtp_layers (the model's
MTP layers the engine's pool must hold). `hidden` [B, hidden] is the trunk's hidden state (before the final norm:
GLM.forward's return_hidden="trunk") at each row's last kept position, whose token the target sampled as `last`
(a row just prefilled: its context's last position, kept by Speculative.admitted); `fresh` [B] marks rows
prefilled since their last verify. extend is the "draft extend": after each verify, the positions kept (Verify)
for the drafter's own KV. Draft, verify and extend of a step run under the engine's lock: one weight version.
engine.stats gains spec_verifies, spec_rows (row-verifies of running rows), spec_drafts (drafts they could use),
spec_accepted, spec_tokens (emitted), and spec_draft_s / spec_verify_s, the seconds of each (on a GPU each is
timed to a device sync: two syncs per step).

The drafter a run uses (make_engine: Speculative.of) is MTPDrafter, the model's first MTP layer (families/mtp.py),
its KV in the engine's pool as layer L (= cfg.num_layers). The MTP layer at position t reads (the trunk's hidden
at t, token t + 1), so its KV can cover every position whose next token is known; it is kept covering exactly the
positions of the trunk's KV, so that a row's blocks (parked by a session's turn, too) hold both:

  prefill  the engine's prefill (engine._pack, engine._extend) keeps the trunk's hidden at every position fed and
           hands them over (Speculative.prefill), with the token after each: the MTP layer's KV at the same
           positions, in the same forward shape (one packed row, or decode rows), under the same lock. A context's
           last position has no next token yet (its first token is sampled from these logits): a placeholder
  draft    d_1: the MTP layer at pos - 1 reads (hidden, last), rewriting the placeholder (or an extend's value)
           with the real one; d_{j+1} (j >= 1): at pos - 1 + j it reads (the layer's own output at the position
           before, d_j), writing a provisional key there. Each is sampled with sample_draft (the target's noise).
           Positions a row cannot use (past n, its usable drafts) run as padding on the scratch slot: they write
           nothing of the row's
  extend   after the verify, the MTP layer at every kept position t of a running row reads (the verify's trunk
           hidden at t, the token emitted at t + 1), overwriting the drafts' provisional keys there; the other
           provisional keys lie at fed positions past the kept ones, which the step's clear resets in every layer
           of the pool, the MTP layer's included

Speculation pays only where a draft step costs less than the forwards its accepted drafts save (on a CPU with the tiny
model the MTP layer costs about the trunk's whole decode step: 0.94x at k = 2), so a run's Speculative (Speculative.of:
adaptive) turns itself off where it does not pay. It decides per call (engine._open: one rollout batch's generation, or
one eval set, a session with all its turns; Speculative.open): the call is wholly speculative (MTP prefill, drafts,
verifies) or wholly plain (the plain engine's path exactly: no MTP prefill, its prefill's last block at the ends only,
one-token decode steps, no lookahead blocks). Its figures, one per mode, are the last call's in that mode: decode
tokens emitted per second of decode time (speculative: spec_tokens over spec_draft_s + spec_verify_s; plain: the
engine's _decode steps, timed in a plain call of an engine that may speculate, plain_tokens over plain_decode_s,
each step to a device sync). The first call speculates, the next runs plain; from then on each call takes the mode
with the higher figure, except every PROBE_EVERY-th, which takes the other to keep its figure fresh (acceptance
rises as the MTP layer trains). A whole call in one mode keeps the MTP KV invariant: parked KV lives for one session
(its Scheduler), so every turn of a trajectory runs in its call's mode, and a speculative call has written the MTP KV
of every position it holds (a plain call writes none; a later speculative one prefills all it reads). engine.stats
gains spec_calls, plain_calls, plain_tokens, plain_decode_s, and spec_tokens_per_s / plain_tokens_per_s (the figures,
once measured). Speculative(drafter, k) speculates in every call (tests, benchmarks); adaptive=True for the policy.
"""
import time
from dataclasses import dataclass

import torch

from families import mtp
from families.mla_moe import no_route
from machinery.graphs import decode_forward, draft_forward, key_slots, mtp_decode
from machinery.sampler import sample_keys, sample_tokens

PROBE_EVERY = 8  # an adaptive Speculative runs every PROBE_EVERY-th call in the slower mode: that mode's figure, fresh
# each mode's figure: (decode tokens emitted, its seconds...) in engine.stats, counted over one call of that mode
MEASURED = {"spec": ("spec_tokens", "spec_draft_s", "spec_verify_s"), "plain": ("plain_tokens", "plain_decode_s")}


def accepted(drafts, target):
    """The acceptance rule: how many leading drafts equal the target's token at their position. drafts [B, k] (d_{j+1}
    proposes token j of the step), target [B, k + 1] (y_j, sampled after feeding d_j) -> [B] in 0..k."""
    return (drafts == target[:, :-1]).long().cumprod(1).sum(1)


def draft_keys(rows, j: int):
    """The noise keys [B] with which the plain engine samples each row's token j of this step (and a drafter draws
    d_{j+1}): its request's seed at step base + ngen + j."""
    return sample_keys(rows.seeds, rows.base + rows.ngen + j)


def sample_draft(engine, logits, rows, j: int):
    """A drafter's d_{j+1} from its logits [B, V]: the Gumbel-max draw with the target's noise there -> tokens [B]."""
    return sample_tokens(logits, engine.sampling, draft_keys(rows, j))[0]


@dataclass
class Verify:
    """What a verify forward left, per running row (batch order of that step), for the drafter's extend."""
    tokens: torch.Tensor  # [B, k + 1] fed: the row's last sampled token, then its drafts
    pos: torch.Tensor  # [B, k + 1] their positions
    slots: torch.Tensor  # [B, k + 1] their pool slots (the scratch slot where not fed)
    hidden: torch.Tensor  # [B, k + 1, hidden] the trunk's hidden state at each (before the final norm)
    target: torch.Tensor  # [B, k + 1] the target's token after each
    kept: torch.Tensor  # [B] positions kept from pos[:, 0] (hidden[:, j] and target[:, j] for j < kept are final)
    run: torch.Tensor  # [B] rows that were running (the others fed their last token only: nothing of theirs is kept)
    keys: torch.Tensor  # [B (k + 1), Lk] the verify rows' key slots (left-padded; padding rows: the scratch slot)
    valid: torch.Tensor  # [B (k + 1), Lk]


class Drafter:
    """The drafter interface (the docstring's last two paragraphs)."""

    mtp_layers = 0  # the model's MTP layers the engine's pool holds for it (layers L ..)

    def prefill(self, engine, hidden, next_ids, pos, keys=None, valid=None):
        """A prefill's positions (Speculative.prefill; nothing to do for a drafter without KV)."""

    def draft(self, engine, rows, hidden, fresh, k: int) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement draft()")

    def extend(self, engine, rows, verify: Verify):
        """The kept positions of a verify (nothing to do for a drafter without state)."""


class Speculative:
    """k drafts per row and step from `drafter`, verified in one forward (this file's docstring). adaptive: only in
    the calls where that pays (the docstring's last paragraph); else in every call."""

    def __init__(self, drafter, k: int, adaptive: bool = False):
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative decoding drafts k >= 1 tokens per row, got {k!r}")
        self.drafter, self.k, self.adaptive = drafter, k, adaptive
        self.hidden = self.owner = None  # per token-buffer row: the trunk hidden at its last kept position, its request
        self.clock = time.perf_counter  # both modes' steps are timed with it (tests inject their own)
        self.rate = {"spec": None, "plain": None}  # each mode's figure: decode tokens per second, its last call's
        self.settled = 0  # calls decided with both figures known (every PROBE_EVERY-th of them probes)
        self.mode = None  # the open call's mode, and its counters (MEASURED) when it opened

    @staticmethod
    def of(model, k) -> "Speculative | None":
        """rollout.speculative_tokens for make_engine: None when 0 (off)."""
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"rollout.speculative_tokens must be an integer >= 0, got {k!r}")
        if k and getattr(model, "mtp", None) is None:
            raise ValueError(f"rollout.speculative_tokens: {k} drafts need a drafter, and the model has no MTP layers "
                             "(model.mtp_layers / config.json's num_nextn_predict_layers)")
        return Speculative(MTPDrafter(), k, adaptive=True) if k else None

    def choose(self) -> bool:
        """Whether the call opening now speculates: the docstring's policy (always, unless adaptive)."""
        spec, plain = self.rate["spec"], self.rate["plain"]
        if not self.adaptive or spec is None:
            return True
        if plain is None:
            return False
        self.settled += 1
        return (spec >= plain) != (self.settled % PROBE_EVERY == 0)  # the faster, or on a probe the other

    def open(self, stats) -> bool:
        """A call opens (engine._open): its mode, counted in stats (spec_calls / plain_calls), held for the whole call."""
        on = self.choose()
        mode = "spec" if on else "plain"
        stats[f"{mode}_calls"] = stats.get(f"{mode}_calls", 0) + 1
        self.mode = mode, [stats.get(key, 0) for key in MEASURED[mode]]
        return on

    def close(self, stats):
        """The call ends (engine._close): its mode's figure, from the counters it moved (none if it decoded nothing)."""
        if self.mode is None:
            return
        (mode, before), self.mode = self.mode, None
        tokens, *seconds = (stats.get(key, 0) - b for key, b in zip(MEASURED[mode], before))
        if tokens > 0 and sum(seconds) > 0:
            self.rate[mode] = stats[f"{mode}_tokens_per_s"] = tokens / sum(seconds)

    def step(self, engine):
        """One speculative decode step of every running row (the docstring's draft, verify, accept, clear)."""
        rows, k, dev, stats = engine.rows, self.k, engine.device, engine.stats
        B, j = len(engine.sched.running), torch.arange(k + 1, device=dev)
        run = rows.status == 0  # rows already done ride along feeding their last token, as in a plain step
        n = torch.where(run, (rows.left - rows.ngen - 1).clamp(0, k), 0)  # [B] drafts a row can use
        hidden, fresh = self._last(engine, rows)
        with engine.lock:  # draft and verify under one weight version
            t0 = self.clock()
            drafts = self.drafter.draft(engine, rows, hidden, fresh, k).to(dev, torch.long)
            if tuple(drafts.shape) != (B, k):
                raise ValueError(f"{type(self.drafter).__name__}.draft returned {tuple(drafts.shape)} tokens, not {(B, k)}")
            t1 = synced(dev, self.clock)
            fed = torch.cat((rows.last[:, None], drafts), 1)  # [B, k + 1]
            real = j[None] <= n[:, None]  # the verify rows fed; the others pad (scratch slot only)
            pos = torch.where(real, rows.pos[:, None] + j, 0)
            graphs = engine.graphs.verify if engine.graphs is not None else None
            graphs = graphs if graphs is not None and not graphs.failed and graphs.per == k + 1 else None
            Lk = int(engine.sched.pos.max()) + k + 1
            # a graph's bucket: more keys, but no more than the call's longest (no row feeds a position past it)
            Bg, Lk = graphs.bucket(B, Lk) if graphs else (None, Lk)
            keys, valid = key_slots(rows.table.repeat_interleave(k + 1, 0), pos.flatten(), Lk)  # [B (k + 1), Lk], left-padded
            pad = ~real.flatten()[:, None]
            keys, valid = torch.where(pad, engine.pool.scratch, keys), valid & ~pad
            valid[:, -1] |= pad[:, 0]  # a padding row sees its own (scratch) slot: finite, and nobody else's
            if graphs:  # the padded bucket's replay (graphs.DecodeGraphs.verify; eager on a CPU): logits and trunk
                logits = graphs.run(fed.flatten(), pos.flatten(), keys, valid, Bg)
                trunk = graphs.trunk[:B * (k + 1)]  # (static buffers: used up before the next step's replay)
                stats["graph_steps"] += 1
            else:
                trunk = decode_forward(engine.model, engine.pool, fed.flatten()[:, None], pos.flatten()[:, None], keys,
                                       valid, hidden="trunk")  # [B (k + 1), hidden], before the final norm
                logits = engine.model.lm_head(engine.model.norm(trunk))
            engine.step_version = engine.version
        noise = sample_keys(rows.seeds[:, None], rows.base[:, None] + rows.ngen[:, None] + j).flatten()
        y, lp = (t.view(B, k + 1) for t in sample_tokens(logits, engine.sampling, noise))
        # accept while equal (no further than the row may go), then cut after the first stop token
        a = torch.minimum(accepted(drafts, y), n)
        stop = torch.isin(y, engine.stop) if len(engine.stop) else torch.zeros_like(y, dtype=torch.bool)
        first_stop = torch.where(stop.any(1), stop.long().argmax(1), k + 1)
        kept = torch.where(run, torch.minimum(a, first_stop) + 1, 1)  # [B] positions kept = tokens emitted by a running row
        emit = j[None] < torch.where(run, kept, 0)[:, None]  # [B, k + 1]
        col = (rows.ngen[:, None] + j).clamp_max(engine.out_tok.shape[1] - 1)  # (a running row's never clamps)
        buf = rows.buf[:, None].expand(B, k + 1)
        engine.out_tok[buf, col] = torch.where(emit, y, engine.out_tok[buf, col])
        engine.out_lp[buf, col] = torch.where(emit, lp, engine.out_lp[buf, col])
        rows.ngen = rows.ngen + emit.sum(1)
        last = y.gather(1, (kept - 1)[:, None])[:, 0]
        done = (rows.ngen >= rows.left) | (torch.isin(last, engine.stop) if len(engine.stop) else False)
        rows.status = torch.where(run, torch.where((lp.isnan() & emit).any(1), 2, done.long()), rows.status)
        rows.last, rows.pos = last, rows.pos + kept
        clear_slots(engine.pool, keys[:, -1], (real & (j[None] >= kept[:, None])).flatten())
        trunk = trunk.view(B, k + 1, -1)
        with engine.lock:  # (the drafter's KV: the draft's weights)
            self.drafter.extend(engine, rows, Verify(fed, pos, keys[:, -1].view(B, k + 1), trunk, y, kept, run, keys, valid))
        self._keep(engine, rows, trunk.gather(1, (kept - 1)[:, None, None].expand(B, 1, trunk.shape[-1]))[:, 0])
        t2 = synced(dev, self.clock)
        counts = torch.stack((run.sum(), torch.where(run, n, 0).sum(), torch.where(run, a, 0).sum(), emit.sum())).tolist()
        for key, v in zip(("spec_rows", "spec_drafts", "spec_accepted", "spec_tokens", "spec_verifies", "decode_steps",
                           "decode_rows", "spec_draft_s", "spec_verify_s"), counts + [1, 1, B, t1 - t0, t2 - t1]):
            stats[key] = stats.get(key, 0) + v

    def prefill(self, engine, hidden, next_ids, pos, keys=None, valid=None, ends=None):
        """The engine's prefill ran the trunk over positions pos [T] (engine._pack: one packed row, the pool's prefill
        state set, ends [C] each context's last token in it; engine._extend: decode rows, keys and valid [T, Lk]):
        hidden [T, hidden] there (before the final norm), next_ids [T] the token after each (at a context's last
        position a placeholder: its token is sampled from these logits). The drafter's KV at those positions, in the
        same forward shape, under the engine's lock. A packed prefill ran its last block everywhere, where the plain
        engine's runs it at the ends only (keep): its MoE routes elsewhere go back to "not routed", the plain record."""
        if keys is None and engine.pool.routes and engine.model.cfg.moe_layers[-1] == engine.model.cfg.num_layers - 1:
            pool, store = engine.pool, engine.pool.routes[-1]  # (the last MoE layer's: the last block's)
            unkept = torch.ones(len(pool.slots), dtype=torch.bool, device=engine.device).index_fill_(0, ends, False)
            for slots, src in [(pool.slots, torch.arange(len(pool.slots), device=engine.device)), *pool.copies]:
                store.index_copy_(0, slots, torch.where(unkept[src, None], no_route(store.dtype), store.index_select(0, slots)))
        self.drafter.prefill(engine, hidden, next_ids, pos, keys, valid)

    def admitted(self, engine, new, hidden):
        """After a prefill: hidden [len(new), hidden], the trunk at each new request's last context position, whose
        logits sampled its first token: its drafter input at its first step (fresh: no verify yet)."""
        self._state(engine)
        self.hidden[torch.tensor([r.buf for r in new]).to(engine.device, non_blocking=True)] = hidden.to(self.hidden.dtype)
        for r in new:
            self.owner[r.buf] = None

    def _state(self, engine):
        if self.hidden is None or len(self.owner) != engine.max_batch or self.hidden.device != engine.device:
            self.hidden = torch.zeros(engine.max_batch, engine.model.cfg.hidden_size, device=engine.device, dtype=engine.dtype)
            self.owner = [None] * engine.max_batch

    def _last(self, engine, rows):
        """The drafter's inputs: hidden [B, hidden] by token-buffer row (the last verify's, or the prefill's), fresh [B]
        where the row's request was not the one verified there last (prefilled since)."""
        self._state(engine)
        fresh = [self.owner[r.buf] is not r for r in engine.sched.running]
        return self.hidden[rows.buf], torch.tensor(fresh, dtype=torch.bool).to(engine.device, non_blocking=True)

    def _keep(self, engine, rows, hidden):
        self.hidden[rows.buf] = hidden.to(self.hidden.dtype)
        for r in engine.sched.running:
            self.owner[r.buf] = r


class MTPDrafter(Drafter):
    """The model's first MTP layer (families/mtp.py) as the drafter, chained k times per step, its KV in the engine's
    pool as layer L (the docstring's prefill, draft, extend). Its drafts only decide how many forwards run: a poor
    (untrained, fresh) MTP layer costs speed, never a token."""

    mtp_layers = 1

    def prefill(self, engine, hidden, next_ids, pos, keys=None, valid=None):
        mtp_rows(engine, hidden, next_ids, pos, keys, valid)

    def draft(self, engine, rows, hidden, fresh, k):
        pool, B = engine.pool, len(engine.sched.running)
        n = torch.where(rows.status == 0, (rows.left - rows.ngen - 1).clamp(0, k), 0)  # [B] drafts a row can use
        Lk = int(engine.sched.pos.max()) + k  # (the last query: pos - 1 + (k - 1))
        graphs = engine.graphs.draft if engine.graphs is not None else None  # (graphs.DecodeGraphs.draft)
        graphs = graphs if graphs is not None and not graphs.failed else None  # failed: eager, unpadded
        Bg, Lk = graphs.bucket(B, Lk) if graphs else (None, Lk)  # a bucket: more keys, no more than the call's longest
        tok, out = rows.last, []
        for j in range(k):
            # d_{j+1} from the position pos - 1 + j; d_1's always runs (its KV is the row's for good), a later one's
            # only where the row can use it (inside its blocks: pos + n - 1 at most), else a padding row
            real = (n > j) | (j == 0)
            q = torch.where(real, rows.pos - 1 + j, 0)
            keys, valid = key_slots(rows.table, q, Lk)
            pad = ~real[:, None]
            keys, valid = torch.where(pad, pool.scratch, keys), valid & ~pad
            valid[:, -1] |= pad[:, 0]  # a padding row sees its own (scratch) slot: finite, and nobody else's
            if graphs:  # the padded bucket's replay (eager on a CPU): logits [B, V], the layer's output in graphs.out
                logits = graphs.run(tok, q, keys, valid, Bg, hidden)
                hidden = graphs.out[:B]  # (a static buffer: the next step copies it into graphs.hidden, then replays)
                engine.stats["spec_graph_drafts"] = engine.stats.get("spec_graph_drafts", 0) + 1
            else:
                logits, hidden = draft_forward(engine.model, pool, hidden, tok[:, None], q[:, None], keys, valid)
            tok = sample_draft(engine, logits, rows, j)
            out.append(tok)
        return torch.stack(out, 1)

    def extend(self, engine, rows, verify):
        B, K = verify.tokens.shape
        keep = verify.run[:, None] & (torch.arange(K, device=engine.device)[None] < verify.kept[:, None])  # [B, k + 1]
        pad = ~keep.flatten()[:, None]
        keys, valid = torch.where(pad, engine.pool.scratch, verify.keys), verify.valid & ~pad
        valid[:, -1] |= pad[:, 0]
        # at a kept position t: the trunk's hidden at t and the token emitted at t + 1 (an accepted draft is the target's)
        mtp_rows(engine, verify.hidden.flatten(0, 1), verify.target.flatten(), torch.where(keep, verify.pos, 0).flatten(),
                 keys, valid)


def mtp_rows(engine, hidden, next_ids, pos, keys=None, valid=None):
    """The model's first MTP layer on the engine's pool (its KV: layer L) -> its output [T, hidden] (before
    shared_head.norm). hidden [T, hidden] (the trunk's, or the layer's own at the position before), next_ids [T] (the
    token after each position), pos [T]; keys, valid [T, Lk]: decode rows (graphs.decode_forward's); None: one packed
    row, the pool's prefill state (slots, copies, groups) set by the engine (engine._pack), its last output only."""
    m, pool = engine.model, engine.pool
    layer = m.mtp[str(m.cfg.num_layers)]
    if keys is None:
        embed = mtp.embed_and_head(m, layer)[0]
        return layer.body(embed, hidden[None], next_ids[None], pos[None], cache=pool, keep=slice(-1, None))[0]
    return mtp_decode(m, pool, hidden, next_ids[:, None], pos[:, None], keys, valid)


def clear_slots(pool, slots, clear):
    """Reset the pool at slots [R] where clear [R] (bool) to a fresh pool's contents, in every store: keys, values (or
    MLA latents), DSA indexer keys (zeros), MoE routes ("not routed"). The others are written back unchanged (no
    host read to pick them: a padding row's scratch slot may repeat, always with its own contents)."""
    stores = [*pool.k, *pool.v, *(ik for ik in pool.index_k if ik is not None)]
    for store, fill in [(s, 0) for s in stores] + [(r, no_route(r.dtype)) for r in pool.routes]:
        old = store.index_select(0, slots)
        store.index_copy_(0, slots, torch.where(clear.view(-1, *[1] * (store.dim() - 1)), fill, old))


def synced(device, clock=time.perf_counter) -> float:
    """The time once the device has finished what was queued (a GPU's work runs behind the host)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return clock()
