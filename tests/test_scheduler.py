"""scheduler.py: the torch engine's row and block bookkeeping on the host alone, no model, no device. Each
test plays a few requests through admit / grow / release / land by hand and checks the books against numbers
worked out here from the documented rules: what admission takes (blocks for context + 1, a spare block per
running row, ADMIT_FRACTION, PREFILL_TOKENS), that release frees exactly a row's blocks, that parked turns keep
theirs and extend them, and the eviction order (oldest parked first, then the newest running rows)."""
import collections

import numpy as np
import pytest

from machinery.scheduler import ADMIT_FRACTION, PREFILL_TOKENS, Request, Scheduler, slots_of
from model import BLOCK_SIZE as BS

STOP = 99  # the calls' stop token


def scheduler(num_blocks, max_batch=4):
    """A Scheduler over a fresh pool's free list (as PagedKVCache makes it: pop() gives the lowest id)."""
    return Scheduler(list(range(num_blocks - 1, -1, -1)), max_batch, stop_ids=(STOP,), stats=collections.Counter())


def req(index, n, key=None, park=False, max_new=8, first=1):
    """A request whose context is n token ids (first, first + 1, ...)."""
    return Request(index, list(range(first, first + n)), max_new, seed=index, key=key, park=park and key is not None)


def books_balance(s, num_blocks, *elsewhere):
    """Every block is in exactly one place: free, a running row's, a parked trajectory's, or held elsewhere (a
    released turn that has not landed yet)."""
    held = list(s.free) + [b for r in s.running for b in r.blocks] + [b for _, bl in s.parked.values() for b in bl]
    held += [b for r in elsewhere for b in r.blocks]
    assert sorted(held) == list(range(num_blocks)), held


def finish(s, rows, reason, tokens):
    """Release rows (batch indices) and land them at once, each having sampled `tokens` (a list per row), as
    the engine does one iteration later. -> the released requests."""
    ngen = np.zeros(len(s.running), dtype=np.int64)
    for b, t in zip(rows, tokens):
        ngen[b] = len(t)
    batch, keep = s.release(rows, reason, ngen, version=0)
    for (r, n), t in zip(batch, tokens):
        assert n == len(t)
        r.tokens += t
    s.land([(r, reason) for r, _ in batch])
    return [r for r, _ in batch]


def test_admission_takes_blocks_for_its_context_and_a_spare_per_row_it_joins():
    """A context of n tokens takes n // BS + 1 blocks (its first decoded token's slot included); a request is
    admitted only if the pool then still holds one block for every row admitted before it, to grow into."""
    s = scheduler(10)
    a, b, c, d = req(0, 20), req(1, 3 * BS - 1), req(2, BS - 1), req(3, 50)
    for r in (a, b, c, d):
        s.submit(r)
    new = s.admit(version=5)
    # a: 2 blocks (10 free); b: 3 + 1 spare <= 8; c: 1 + 2 spares <= 5; d: 4 + 3 spares > 4 free: waits
    assert new == [a, b, c] == s.running and list(s.waiting) == [d]
    assert (a.blocks, b.blocks, c.blocks) == ([0, 1], [2, 3, 4], [5])
    assert [r.buf for r in new] == [0, 1, 2] and s.pos.tolist() == [20, 3 * BS - 1, BS - 1]
    assert all(r.versions == [5, 5] and r.cached == 0 for r in new)
    books_balance(s, 10)
    # nothing else fits while they run: d needs 4 + 3 spare blocks, 4 are free
    assert s.admit(version=5) == [] and list(s.waiting) == [d]


def test_the_first_request_goes_alone_whatever_it_needs():
    """With nothing running, the oldest request is admitted even past the prefill budget (it goes alone)."""
    s = scheduler(1000)
    big, small = req(0, PREFILL_TOKENS + 100), req(1, 5)
    s.submit(big)
    s.submit(small)
    assert s.admit(0) == [big] and list(s.waiting) == [small]  # the budget is spent: small waits


def test_prefill_budget_counts_a_shared_context_once():
    """Requests are admitted while their prefill tokens fit PREFILL_TOKENS; a context already admitted in
    the round (a prompt's n samples) costs nothing, as the prefill runs it once."""
    n = PREFILL_TOKENS // 2 + 1
    s = scheduler(1000)
    x1, x2, y, x3 = req(0, n), req(1, n), req(2, n, first=7), req(3, n)
    for r in (x1, x2, y, x3):
        s.submit(r)
    assert s.admit(0) == [x1, x2] and list(s.waiting) == [y, x3]  # y would need 2n > PREFILL_TOKENS tokens


def test_while_rows_decode_admission_waits_for_a_fraction_of_free_rows():
    """With rows running, waiting requests are admitted only once ADMIT_FRACTION of max_batch rows are free,
    or as many as wait."""
    B = 32
    step = max(1, int(B * ADMIT_FRACTION))
    s = scheduler(1000, max_batch=B)
    for i in range(B - step + 1):
        s.submit(req(i, 3))
    assert len(s.admit(0)) == B - step + 1  # step - 1 rows are free now
    for i in range(step):
        s.submit(req(100 + i, 3))
    assert s.admit(0) == []  # step wait, step - 1 rows free
    finish(s, [0], "done", [[1]])
    assert len(s.admit(0)) == step  # step rows free: all of them come in
    s.submit(req(200, 3))
    assert s.admit(0) == []  # no row free
    finish(s, [5], "done", [[1]])
    assert len(s.admit(0)) == 1  # one row free, one waiting: it comes in


def test_release_frees_exactly_the_rows_blocks_and_buffer():
    s = scheduler(12)
    rs = [req(i, n) for i, n in enumerate((20, 40, 15))]
    for r in rs:
        s.submit(r)
    s.admit(0)
    before = {r.index: list(r.blocks) for r in rs}
    free = list(s.free)
    ngen = np.array([2, 3, 4])
    batch, keep = s.release([1], "done", ngen, version=3)
    assert batch == [(rs[1], 3)] and keep == [0, 2]
    assert s.running == [rs[0], rs[2]] and s.pos.tolist() == [20, 15]
    assert s.free == free + before[1][::-1]  # exactly its blocks, the lowest handed out first again
    assert rs[1].blocks == [] and s.free_bufs[-1] == 1 and rs[1].versions == [0, 3]
    assert rs[0].blocks == before[0] and rs[2].blocks == before[2]  # the others keep theirs
    books_balance(s, 12)
    s.land([(rs[1], "done")])
    assert s.finished == [rs[1]] and rs[1].finish == "length"


def test_a_finished_turn_parks_its_blocks_and_its_next_turn_extends_them():
    """A session's turn (a key, park) keeps its blocks at release; at land they are parked under its key,
    holding every position but its last sampled token's. The key's next turn, whose context extends those
    ids, takes them over (cached: the parked positions) and takes blocks only for the rest; end() frees them."""
    s = scheduler(8)
    t = req(0, 20, key="k", park=True)
    s.submit(t)
    s.admit(0)
    blocks, free = list(t.blocks), list(s.free)
    (r,) = finish(s, [0], "done", [[40, 41, 42]])
    assert r is t and s.free == free and s.parked["k"] == (t.prompt + [40, 41], blocks)  # 22 positions
    assert t.blocks == [] and t.finish == "length" and s.stats["parked"] == 1
    books_balance(s, 8)
    nxt = req(1, 0, key="k", park=True)
    nxt.prompt = t.prompt + [40, 41, 42] + list(range(50, 60))  # 33 tokens: 3 blocks, 2 of them parked
    s.submit(nxt)
    assert s.admit(0) == [nxt]
    assert nxt.cached == 22 and nxt.blocks == blocks + [2] and "k" not in s.parked
    books_balance(s, 8)
    (r,) = finish(s, [0], "done", [[STOP]])
    assert r.finish == "stop" and s.parked["k"][1] == blocks + [2]
    s.end("k")
    assert not s.parked and sorted(s.free) == list(range(8))


def test_a_turn_that_does_not_extend_its_parked_ids_drops_them():
    s = scheduler(8)
    t = req(0, 20, key="k", park=True)
    s.submit(t)
    s.admit(0)
    finish(s, [0], "done", [[40, 41]])
    other = req(1, 25, key="k", park=True, first=2)  # the history changed
    s.submit(other)
    assert s.admit(0) == [other] and other.cached == 0 and not s.parked
    books_balance(s, 8)


def test_aborted_or_retracted_turns_never_park():
    s = scheduler(8)
    a, b = req(0, 5, key="a", park=True), req(1, 5, key="b", park=True)
    s.submit(a)
    s.submit(b)
    s.admit(0)
    finish(s, [1], None, [[7]])  # retracted: back to the front of the queue, its tokens kept, blocks freed
    assert list(s.waiting) == [b] and b.tokens == [7] and b.blocks == [] and not s.parked
    finish(s, [0], "abort", [[8]])
    assert s.finished == [a] and a.finish == "abort" and not s.parked
    assert sorted(s.free) == list(range(8))


def park(s, key, n, first):
    """A trajectory's turn of n tokens runs alone and parks (its one sampled token never fed)."""
    s.submit(req(len(s.parked) + 100, n, key=key, park=True, first=first))
    s.admit(0)
    finish(s, [len(s.running) - 1], "done", [[1]])


def test_fresh_contexts_join_the_batch_before_extending_turns():
    """One round's rows are ordered as the engine's prefill computes their logits: fresh contexts (one packed
    forward) first, then the turns that extend parked KV, whatever their order in the queue."""
    s = scheduler(8)
    park(s, "k", 20, 1)
    turn = req(0, 0, key="k", park=True)
    turn.prompt = list(range(1, 21)) + [1, 7, 7]
    fresh = req(1, 5, first=50)
    s.submit(turn)
    s.submit(fresh)
    assert s.admit(0) == [fresh, turn] == s.running
    assert [r.buf for r in s.running] == [0, 1] and s.pos.tolist() == [5, 23] and turn.cached == 20


def test_eviction_drops_the_oldest_parked_trajectory_first_and_never_the_admitted_ones_own():
    s = scheduler(6)
    for key, first in (("c", 21), ("a", 1), ("b", 41)):  # three trajectories park 2 blocks each: c, a, b
        park(s, key, 20, first)
    assert list(s.parked) == ["c", "a", "b"] and s.free == []
    turn = req(0, 0, key="c", park=True)
    turn.prompt = list(range(21, 41)) + [1] + list(range(60, 80))  # extends c's 20 parked ids: 41 tokens, 3 blocks
    s.submit(turn)
    assert s.admit(0) == [turn]  # one block short: a goes (the oldest but c, the turn's own)
    assert s.stats["evicted"] == 1 and list(s.parked) == ["b"] and turn.cached == 20 and len(turn.blocks) == 3
    fresh = req(1, 20, first=200)  # 2 blocks, and a spare for the running turn: 3, 1 free
    s.submit(fresh)
    assert s.admit(0) == [fresh] and s.stats["evicted"] == 2 and not s.parked
    books_balance(s, 6)


def test_grow_gives_a_block_at_each_block_boundary_evicting_then_retracting():
    """Before a decode step, a row whose next position starts a block takes one. Short: parked KV goes first
    (oldest first); still short, the engine's retract takes the newest rows out, one at a time."""
    s = scheduler(7, max_batch=3)
    park(s, "p", 5, 1)  # p parks block 0
    r1, r2, r3 = req(1, BS - 2), req(2, 2 * BS - 2), req(3, BS - 2)
    for r in (r1, r2, r3):
        s.submit(r)
    assert s.admit(0) == [r1, r2, r3] and (r1.blocks, r2.blocks, r3.blocks) == ([1], [2, 3], [4]) and s.free == [6, 5]
    retracted = []

    def retract(n):  # the engine's: the newest n rows leave, tokens read back, and land in `waiting`
        assert n == 1
        retracted.append(s.running[-1])
        finish(s, [len(s.running) - 1], None, [[3]])
    s.decoded()
    assert s.grow(retract) == ([], [])  # nobody at a boundary yet
    s.decoded()
    assert s.pos.tolist() == [BS, 2 * BS, BS]  # all three at a boundary, 2 blocks free: p's is evicted
    assert s.grow(retract) == ([0, 1, 2], [0, 5, 6]) and s.stats["evicted"] == 1 and not retracted
    for _ in range(BS):
        s.decoded()
    # all three at a boundary again, nothing free or parked: r3 (the newest) goes back to the queue, which
    # frees its 2 blocks for the other two
    assert s.grow(retract) == ([0, 1], [4, 6]) and retracted == [r3] and list(s.waiting) == [r3]
    assert r1.blocks == [1, 0, 4] and r2.blocks == [2, 3, 5, 6] and r3.tokens == [3] and s.free == []
    books_balance(s, 7)


@pytest.mark.parametrize("reason,last,want", [("done", STOP, "stop"), ("done", 5, "length"), ("abort", STOP, "abort")])
def test_land_tells_a_stop_from_a_length(reason, last, want):
    s = scheduler(4)
    r = req(0, 3)
    s.submit(r)
    s.admit(0)
    finish(s, [0], reason, [[4, last]])
    assert s.finished == [r] and r.finish == want


def test_retracted_rows_go_back_to_the_front_of_the_queue_in_order():
    s = scheduler(20, max_batch=3)
    rs = [req(i, 3) for i in range(4)]
    for r in rs:
        s.submit(r)
    s.admit(0)
    assert list(s.waiting) == [rs[3]]
    finish(s, [1, 2], None, [[5], [6]])
    assert list(s.waiting) == [rs[1], rs[2], rs[3]] and s.running == [rs[0]]
    assert s.admit(0) == [rs[1], rs[2]]  # they come back first, their tokens part of their context
    assert s.pos.tolist() == [3, 4, 4]


def test_abort_finishes_every_waiting_request():
    s = scheduler(4, max_batch=1)
    a, b = req(0, 3), req(1, 3)
    s.submit(a)
    s.submit(b)
    s.admit(2)
    s.abort(version=3)
    assert s.finished == [b] and b.finish == "abort" and b.versions == [3, 3] and not s.waiting
    assert a.versions == [2, 2] and s.busy


def test_a_request_waits_for_a_landing_turns_kv_instead_of_taking_blocks_that_are_not_free():
    """A session's finished turn keeps its blocks from release until it lands (one engine iteration later). With no
    row running, the first waiting request used to be admitted whatever its size (the pool holds one longest
    sequence) and popped blocks that were not free: IndexError. It waits one iteration instead; once the turn has
    landed, its parked KV is evicted for the request, which then fits."""
    s = scheduler(4, max_batch=3)
    turn, big = req(0, 2 * BS, key="a", park=True), req(1, 3 * BS, key="b", park=True, first=50)
    s.submit(turn)
    assert s.admit(version=0) == [turn] and len(turn.blocks) == 3  # 2 * BS tokens + its first decoded one
    s.submit(big)  # needs 4 blocks: every block of the pool
    ngen = np.array([1])
    batch, _ = s.release([0], "done", ngen, version=0)  # the turn finished: it keeps its 3 blocks until it lands
    assert s.landing == 3 and len(s.free) == 1 and not s.running
    assert s.admit(version=0) == [] and list(s.waiting) == [big]  # before the fix: IndexError (pop from empty list)
    batch[0][0].tokens += [7]
    s.land([(batch[0][0], "done")])  # now parked: evictable
    assert s.landing == 0 and list(s.parked) == ["a"]
    assert s.admit(version=0) == [big] and len(big.blocks) == 4 and not s.parked
    books_balance(s, 4)


# ----------------------------------------------------------------------------- MoE: routes of a context

def test_extend_routes_keeps_each_positions_first_record():
    """extend_routes(old, new), [positions, n_moe, k] each: a side that is None gives the other (both None: None);
    positions `old` holds keep old's routes whatever `new` says there (the forward that first ran a token wins: a
    re-prefill under newer weights does not rewrite them), and only a longer `new` adds its later positions."""
    import torch
    from machinery.scheduler import extend_routes
    old = torch.arange(3 * 2 * 2, dtype=torch.uint8).view(3, 2, 2)
    new = (100 + torch.arange(5 * 2 * 2, dtype=torch.uint8)).view(5, 2, 2)  # disagrees with old everywhere
    assert extend_routes(None, None) is None
    assert extend_routes(None, new) is new and extend_routes(old, None) is old
    got = extend_routes(old, new)
    assert got.shape == (5, 2, 2) and got.dtype == torch.uint8
    assert torch.equal(got[:3], old) and torch.equal(got[3:], new[3:])
    assert torch.equal(extend_routes(old, new[:3]), old) and torch.equal(extend_routes(old, new[:2]), old)  # no longer
    assert torch.equal(extend_routes(new[:2], old), torch.cat((new[:2], old[2:])))
    # chained, as turns land one after another: every position keeps the earliest record of it
    third = torch.full((7, 2, 2), 255, dtype=torch.uint8)
    chained = extend_routes(extend_routes(extend_routes(None, old), new), third)
    assert torch.equal(chained, torch.cat((old, new[3:], third[5:])))
    wide = torch.zeros(2, 2, 2, dtype=torch.int16)  # int16 routes (255 experts or more) alike
    assert extend_routes(wide, torch.ones(4, 2, 2, dtype=torch.int16)).tolist() == [[[0, 0]] * 2] * 2 + [[[1, 1]] * 2] * 2


def test_slots_of_is_the_position_by_position_formula():
    """slots_of(blocks, n): position p of a context lives in slot blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
    (the module docstring's rule), for every n up to the blocks' capacity, blocks in any order."""
    blocks = [7, 2, 9]
    for n in range(0, 3 * BS + 1):
        assert slots_of(blocks, n).tolist() == [blocks[p // BS] * BS + p % BS for p in range(n)], n
    assert slots_of(blocks, 5).dtype == np.int64
