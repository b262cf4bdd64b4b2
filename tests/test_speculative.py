"""speculative.py: speculative decoding in the torch engine. The reference is the plain engine (and a
full forward of the tokens): with any drafter (an oracle that proposes the plain run's next tokens with probability
p, one always wrong, a tiny model), tokens, logprobs, finish reasons, MoE routes and the pool's contents at every
slot a row owns equal a plain run's; the acceptance rule against a naive loop, and a planted bug caught end to end;
sessions, retraction, weight updates; the statistics of the oracle. The MTP drafter (a run's): the plain run's tokens
on a dense and an MLA + MoE model (DSA both), its KV against families/mtp.draft over each whole trajectory, and a
trained MTP layer's drafts accepted far more often than an untrained one's. The adaptive policy (a run's): its choices
against its statement, on injected figures and on an injected clock end to end (the faster mode, a probe every
PROBE_EVERY calls, the figures against hand counts), plain calls on the plain path, and the MTP KV invariant in a
speculative call after plain ones. With graphs: the verify and the MTP draft step in padded buckets (eager on a CPU,
replays on a GPU), the plain run's tokens and pool, the drafts and pool of speculation without graphs."""
import copy
import random
from dataclasses import replace

import pytest
import torch

from families import mtp
from machinery import graphs as graphs_mod
from machinery import speculative as spec_mod
from machinery.engine import SamplingParams, TorchEngine
from machinery.speculative import PROBE_EVERY, Drafter, MTPDrafter, Speculative, accepted, sample_draft
from model import BLOCK_SIZE, GLM, KVCache
from test_engine import DSA3, graph_engine, run_session, tiny_model, tiny_moe

PROMPTS = [[5, 6, 7], [3, 4], [10, 11, 12, 13], [9, 8], [1, 2, 3, 4, 5, 6], [7]]
SAMPLINGS = [SamplingParams(temperature=1.0, max_new_tokens=14),
             SamplingParams(temperature=0.8, top_p=0.7, max_new_tokens=11, stop_token_ids=(3, 17)),
             SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(5,))]


class Oracle(Drafter):
    """Proposes the plain run's token at each position with probability p, else another (always wrong at p = 0)."""

    def __init__(self, plain: dict, p: float, vocab=40, seed=0):
        self.plain, self.p, self.vocab, self.rng = plain, p, vocab, random.Random(seed)
        self.versions = []

    def draft(self, engine, rows, hidden, fresh, k):
        self.versions.append(engine.version)
        start = (rows.base + rows.ngen).tolist()  # token j of this step is the request's token start + j
        out = []
        for r, s in zip(engine.sched.running, start):
            want = self.plain[r.index]
            truth = [want[s + j] if s + j < len(want) else 0 for j in range(k)]
            out.append([t if self.rng.random() < self.p else (t + 1) % self.vocab for t in truth])
        return torch.tensor(out, dtype=torch.long).view(len(start), k)


class ModelDrafter(Drafter):
    """A tiny model as the drafter: a full forward of each row's context (no cache), k times, each draw with the
    target's noise at that position (sample_draft)."""

    def __init__(self, model):
        self.model = model.eval()

    def draft(self, engine, rows, hidden, fresh, k):
        ngen = rows.ngen.tolist()
        ctx = [r.prompt + r.tokens + engine.out_tok[r.buf, :n].tolist() for r, n in zip(engine.sched.running, ngen)]
        out = []
        for j in range(k):
            with torch.no_grad():
                logits = torch.cat([self.model(torch.tensor([c]))[:, -1] for c in ctx])
            tok = sample_draft(engine, logits, rows, j)
            ctx = [c + [t] for c, t in zip(ctx, tok.tolist())]
            out.append(tok)
        return torch.stack(out, 1)


def plain_run(model, sampling, prompts=PROMPTS, seed=3, **kw):
    return TorchEngine(model, max_batch=8, **kw).generate(prompts, sampling, seed=seed)


def assert_same(got, want):
    """Tokens and finish reasons equal; logprobs equal up to the fp32 matmul's roundings across batch shapes
    (the plain engine's own promise across batchings: test_engine.test_sampling_is_reproducible_with_a_seed)."""
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
    for a, b in zip(got, want):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_the_acceptance_rule_against_a_naive_loop():
    g = torch.Generator().manual_seed(0)
    for k in (1, 2, 3, 5):
        target = torch.randint(0, 3, (200, k + 1), generator=g)
        drafts = torch.randint(0, 3, (200, k), generator=g)
        want = []
        for d, y in zip(drafts.tolist(), target.tolist()):
            a = 0
            while a < k and d[a] == y[a]:
                a += 1
            want.append(a)
        assert accepted(drafts, target).tolist() == want


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("p", [0.0, 0.5, 0.7, 1.0])
def test_tokens_and_logprobs_are_the_plain_engines(k, p):
    """Every sampling (tempered, top_p with stops, greedy with a stop) at another max_batch each: the plain run's
    tokens, logprobs and finish reasons, with k drafts accepted with probability p."""
    model = tiny_model()
    for sampling, max_batch in zip(SAMPLINGS, (1, 3, 8)):
        want = plain_run(model, sampling)
        drafter = Oracle({i: c.token_ids for i, c in enumerate(want)}, p, seed=k)
        engine = TorchEngine(model, max_batch=max_batch, speculative=Speculative(drafter, k))
        assert_same(engine.generate(PROMPTS, sampling, seed=3), want)
        assert len(engine.pool.free) == engine.pool.num_blocks and engine.stats["spec_verifies"] > 0


@pytest.mark.parametrize("kind", ["oracle", "mtp"])
def test_the_verify_runs_as_padded_graph_buckets(kind, monkeypatch):
    """graphs=True (engine.graphs.verify; on a CPU the padded buckets run eagerly): every verify forward of a
    speculative call runs as a bucket of (rows, keys), k + 1 forward rows a row, and the tokens and logprobs are the
    plain engine's and speculation-without-graphs'. Padding rows and left-padded keys are both exercised: 3 rows as 4
    (16 forward rows for 12), key lists as 8, 16 and 20 slots (the call's longest)."""
    monkeypatch.setattr(graphs_mod, "GRAPH_MIN_KEYS", 8)
    seen, run = [], graphs_mod.DecodeGraphs.run
    monkeypatch.setattr(graphs_mod.DecodeGraphs, "run", lambda g, tok, pos, keys, valid, Bg, hidden=None: (g.per > 1 and
                        seen.append((g.per, len(tok), Bg, keys.shape[1]))) or run(g, tok, pos, keys, valid, Bg, hidden))
    k, sampling = 3, SAMPLINGS[0]
    model = MODELS["dense_dsa"]() if kind == "mtp" else tiny_model(DSA3).eval()
    want = plain_run(model, sampling)
    plain = {i: c.token_ids for i, c in enumerate(want)}
    runs = [TorchEngine(model, max_batch=4, graphs=graphs, speculative=Speculative.of(model, k) if kind == "mtp" else
                        Speculative(Oracle(plain, 0.7), k)) for graphs in (False, True)]
    eager, got = (engine.generate(PROMPTS, sampling, seed=3) for engine in runs)
    assert_same(got, want)
    assert_same(got, eager)
    s = runs[1].stats
    assert s["graph_steps"] == len(seen) == s["spec_verifies"] > 0 and runs[0].stats["graph_steps"] == 0
    assert all(per == k + 1 and R % (k + 1) == 0 and R <= Bg * (k + 1) for per, R, Bg, _ in seen)
    assert (k + 1, 3 * (k + 1), 4, 16) in seen and {w for *_, w in seen} == {8, 16, 20}
    assert len(runs[1].pool.free) == runs[1].pool.num_blocks


@pytest.mark.parametrize("kind", ["dense_dsa", "mla_moe_dsa"])
def test_the_mtp_draft_step_runs_as_padded_graph_buckets(kind, monkeypatch):
    """graphs=True with the MTP drafter (engine.graphs.draft; on a CPU the padded buckets run eagerly): each of a step's
    k chained draft steps runs as a bucket of (rows, keys), the rows' hidden states in and the layer's output out
    through the set's static buffers; every step's drafts are speculation-without-graphs', and the tokens and logprobs
    the plain engine's. Padding rows and left-padded keys are both exercised: 3 rows as 4, key lists as 8, 16 and 20
    slots (the call's longest)."""
    monkeypatch.setattr(graphs_mod, "GRAPH_MIN_KEYS", 8)
    seen, run, k = [], graphs_mod.DecodeGraphs.run, 3
    monkeypatch.setattr(graphs_mod.DecodeGraphs, "run", lambda g, tok, pos, keys, valid, Bg, hidden=None: (g.mtp and
                        seen.append((len(tok), Bg, keys.shape[1], tuple(hidden.shape)))) or run(g, tok, pos, keys, valid,
                                                                                                 Bg, hidden))
    drafts, draft = {False: [], True: []}, MTPDrafter.draft  # each engine's drafts, step by step

    def drafted(d, engine, rows, *a):  # (those a row can use, j < n: the others read the scratch slot, whatever is there)
        out = draft(d, engine, rows, *a)
        n = torch.where(rows.status == 0, (rows.left - rows.ngen - 1).clamp(0, k), 0)
        drafts[engine.graphs is not None].append(torch.where(torch.arange(k)[None] < n[:, None], out, -1))
        return out
    monkeypatch.setattr(MTPDrafter, "draft", drafted)
    sampling, model = SAMPLINGS[0], MODELS[kind]()
    want = plain_run(model, sampling)
    runs = [TorchEngine(model, max_batch=4, graphs=graphs, speculative=Speculative(MTPDrafter(), k)) for graphs in
            (False, True)]
    eager, got = (engine.generate(PROMPTS, sampling, seed=3) for engine in runs)
    assert_same(got, want)
    assert_same(got, eager)
    s, h = runs[1].stats, model.cfg.hidden_size
    assert s["spec_graph_drafts"] == len(seen) == k * s["spec_verifies"] > 0 and "spec_graph_drafts" not in runs[0].stats
    assert len(drafts[True]) == len(drafts[False]) == s["spec_verifies"] and s["spec_accepted"] > 0
    assert all(torch.equal(a, b) for a, b in zip(drafts[True], drafts[False]))
    assert all(B <= Bg and hidden == (B, h) for B, Bg, _, hidden in seen)
    assert (3, 4, 16, (3, h)) in seen and {w for _, _, w, _ in seen} == {8, 16, 20}
    assert len(runs[1].pool.free) == runs[1].pool.num_blocks and not runs[1].graphs.draft.failed


@pytest.mark.parametrize("kind", ["dense_dsa", "mla_moe_dsa"])
def test_the_pool_with_draft_graphs_equals_an_eager_speculative_runs(kind):
    """The MTP drafter with graphs (its draft steps and the verify in padded buckets, their padding rows on the scratch
    slot alone), rows ending on stop tokens mid-way: the pool at every slot of every parked trajectory's blocks, the MTP
    layer's KV included (the drafts' provisional keys overwritten or cleared), equals speculation-without-graphs', and
    the completions (MoE: their routes too) are the plain engine's."""
    model, sampling = MODELS[kind](), SamplingParams(temperature=1.0, max_new_tokens=13)
    free = parked_pools(TorchEngine(model, max_batch=8), PROMPTS, sampling)[0]
    sampling.stop_token_ids = (free[0].token_ids[4], free[1].token_ids[6])  # (drafts past them are fed, then cleared)
    want = parked_pools(TorchEngine(model, max_batch=8), PROMPTS, sampling)[0]
    eager, eager_pool = parked_pools(TorchEngine(model, max_batch=8, speculative=Speculative(MTPDrafter(), 3)), PROMPTS,
                                     sampling)
    engine = TorchEngine(model, max_batch=8, graphs=True, speculative=Speculative(MTPDrafter(), 3))
    got, got_pool = parked_pools(engine, PROMPTS, sampling)
    assert_same(got, want)
    assert_same(eager, want)
    assert engine.stats["spec_graph_drafts"] > 0 and sum(c.finish_reason == "stop" for c in want) >= 2
    for key in eager_pool:  # (store L: the MTP layer's keys, written)
        assert len(got_pool[key]) == len(eager_pool[key]) and got_pool[key][model.cfg.num_layers].any()
        for a, b in zip(got_pool[key], eager_pool[key], strict=True):
            assert torch.allclose(a.float(), b.float(), atol=1e-5), key
    if kind == "mla_moe_dsa":
        assert all(torch.equal(a.routes, b.routes) for a, b in zip(got, want))


def test_a_planted_bug_in_the_acceptance_rule_is_caught(monkeypatch):
    """Accepting one draft past the first mismatch, or accepting on draft != target: the end-to-end comparison
    fails (so the test above would catch either)."""
    model, sampling = tiny_model(), SAMPLINGS[0]
    want = plain_run(model, sampling)
    plain = {i: c.token_ids for i, c in enumerate(want)}
    rule = spec_mod.accepted
    for bug in (lambda d, y: (rule(d, y) + 1).clamp_max(d.shape[1]), lambda d, y: (d != y[:, :-1]).long().cumprod(1).sum(1)):
        monkeypatch.setattr(spec_mod, "accepted", bug)
        got = TorchEngine(model, max_batch=3, speculative=Speculative(Oracle(plain, 0.7), 2)).generate(PROMPTS, sampling, seed=3)
        assert [c.token_ids for c in got] != [c.token_ids for c in want]


def test_statistics_of_the_oracle():
    """p = 1: every draft accepted, k + 1 tokens per row-verify but at a row's end (then what is left); p = 0: none,
    one token per row-verify. No stop tokens: each row samples max_new, its first from the prefill."""
    model, k, sampling = tiny_model(), 3, SamplingParams(temperature=1.0, max_new_tokens=14)
    want = plain_run(model, sampling)
    plain = {i: c.token_ids for i, c in enumerate(want)}
    for p in (1.0, 0.0):
        engine = TorchEngine(model, max_batch=8, speculative=Speculative(Oracle(plain, p), k))
        engine.generate(PROMPTS, sampling, seed=3)
        s = engine.stats
        verifies = len(PROMPTS) * (-(-13 // (k + 1)) if p == 1 else 13)
        assert s["spec_rows"] == verifies and s["spec_tokens"] == 13 * len(PROMPTS)
        assert s["spec_accepted"] == (s["spec_drafts"] if p == 1 else 0) and s["spec_drafts"] > 0
        assert s["spec_draft_s"] > 0 and s["spec_verify_s"] > 0 and s["spec_verifies"] == s["decode_steps"]


def test_a_tiny_model_drafts():
    """The target itself as the drafter (its draws share the target's noise: nearly all accepted) and another tiny
    model (fewer): the plain run's tokens either way."""
    model, sampling = tiny_model(), SAMPLINGS[0]
    want = plain_run(model, sampling)
    rates = []
    for drafter in (tiny_model(), tiny_model(seed=5)):
        engine = TorchEngine(model, max_batch=4, speculative=Speculative(ModelDrafter(drafter), 2))
        assert_same(engine.generate(PROMPTS, sampling, seed=3), want)
        rates.append(engine.stats["spec_accepted"] / engine.stats["spec_drafts"])
    assert rates[0] > 0.9 and rates[1] < rates[0]


class Recorder(Oracle):
    """An oracle that keeps what each verify left at the kept positions (the draft extend): (request, position,
    trunk hidden)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.kept = []

    def extend(self, engine, rows, verify):
        for b, r in enumerate(engine.sched.running):
            for j in range(int(verify.kept[b])):
                self.kept.append((r.index, int(verify.pos[b, j]), verify.hidden[b, j].clone()))


def test_after_a_rejection_the_continuation_is_a_full_forwards():
    """The logits at every kept position (the trunk's hidden the verify hands the drafter, through the final norm
    and lm_head) equal a full forward's of prompt + completion (no cache, no drafts), with drafts rejected half
    the time (DSA: the rejected slots' indexer keys must not be chosen later)."""
    model, sampling = tiny_model(DSA3).eval(), SAMPLINGS[0]
    want = plain_run(model, sampling)
    rec = Recorder({i: c.token_ids for i, c in enumerate(want)}, 0.5)
    got = TorchEngine(model, max_batch=3, speculative=Speculative(rec, 3)).generate(PROMPTS, sampling, seed=3)
    assert_same(got, want)
    assert len(rec.kept) > 20
    with torch.no_grad():
        full = [model(torch.tensor([p + c.token_ids]))[0] for p, c in zip(PROMPTS, got)]
        for i, pos, h in rec.kept:
            assert torch.allclose(model.lm_head(model.norm(h)), full[i][pos], atol=1e-5), (i, pos)


def owned(engine, blocks, n):
    """The pool at n positions of blocks (position order): per store, [n, ...] (a missing block reads as zeros)."""
    out = []
    for store in [*engine.pool.k, *engine.pool.v, *(s for s in engine.pool.index_k if s is not None), *engine.pool.routes]:
        rows = [store[blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE] if p // BLOCK_SIZE < len(blocks) else None
                for p in range(n)]
        fill = store[-1] if store.dtype == torch.uint8 else torch.zeros_like(store[0])  # (the scratch block's: fresh)
        out.append(torch.stack([fill if r is None else r for r in rows]))
    return out


def parked_pools(engine, prompts, sampling):
    """One session turn per prompt, parked: the completions and, per trajectory, its pool contents over its blocks."""
    with engine.session(sampling, 64) as call:
        for i, p in enumerate(prompts):
            call.submit(p, sampling.max_new_tokens, 100 + i, key=i)
        outs = {}
        while call.busy:
            outs.update(call.step())
        span = max(len(b) for _, b in engine.parked.values()) * BLOCK_SIZE
        pools = {key: owned(engine, blocks, span) for key, (ids, blocks) in engine.parked.items()}
    return [outs[i] for i in range(len(prompts))], pools


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("moe", [False, True])
def test_the_pool_and_routes_equal_a_plain_runs(moe, graphs):
    """The pool at every slot of every parked trajectory's blocks (keys, values or MLA latents, DSA indexer keys,
    MoE routes), as a plain run leaves it: its positions' contents equal, the rest fresh (rejected drafts cleared);
    and the completions' routes (the verify forward's) equal the plain run's. graphs: the verify in padded buckets
    (its padding rows write the scratch slot only)."""
    model = tiny_moe() if moe else tiny_model(DSA3).eval()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=13)
    free = parked_pools(TorchEngine(model, max_batch=8), PROMPTS, sampling)[0]
    # stop tokens that end rows mid-way: drafts past them are fed, then must leave nothing behind
    sampling.stop_token_ids = (free[0].token_ids[4], free[1].token_ids[6])
    want, want_pool = parked_pools(TorchEngine(model, max_batch=8), PROMPTS, sampling)
    assert sum(c.finish_reason == "stop" for c in want) >= 2
    plain = {i: c.token_ids for i, c in enumerate(want)}
    got, got_pool = parked_pools(TorchEngine(model, max_batch=8, graphs=graphs,
                                             speculative=Speculative(Oracle(plain, 0.8), 3)), PROMPTS, sampling)
    assert_same(got, want)
    for key in want_pool:
        for a, b in zip(got_pool[key], want_pool[key]):
            assert torch.allclose(a.float(), b.float(), atol=1e-5), key
    if moe:
        for a, b in zip(got, want):
            assert torch.equal(a.routes.sort(-1).values, b.routes.sort(-1).values)


def test_sessions_extend_parked_kv_with_speculation():
    """Multi-turn trajectories (parked KV, turns that extend it) play as with the plain engine."""
    turns = [[[5, 6, 7, 8, 9], [3, 4, 30], [11]], [[3, 4], [7, 7, 7, 7, 7, 7, 7, 7]], [[10, 11, 12], [1, 2]]]
    want = run_session(TorchEngine(tiny_model(DSA3).eval(), max_batch=2), turns, temperature=1.0, max_new=9)
    truth = {(k, t): c.token_ids for k, traj in enumerate(want) for t, (_, c) in enumerate(traj)}
    turn_of = []  # each submission's (trajectory, turn), for the oracle's truth

    class ByTurn(dict):
        def __getitem__(self, index):
            return truth[turn_of[index]]
    engine = TorchEngine(tiny_model(DSA3).eval(), max_batch=2, speculative=Speculative(Oracle(ByTurn(), 0.7), 2))
    submit = engine.submit

    def record(prompt, max_new, seed, key=None, park=True):
        turn_of.append((key, sum(1 for k, _ in turn_of if k == key)))
        return submit(prompt, max_new, seed, key=key, park=park)
    engine.submit = record
    got = run_session(engine, turns, temperature=1.0, max_new=9)
    assert engine.stats["extends"] >= 1 and engine.stats["spec_accepted"] > 0
    for a, b in zip(got, want):
        assert [ctx for ctx, _ in a] == [ctx for ctx, _ in b]
        assert_same([c for _, c in a], [c for _, c in b])


def test_retraction_when_the_pool_runs_short():
    """A pool of 8 blocks for 8 rows of up to 44 tokens: rows are retracted (the lookahead blocks too), prefilled
    again, and finish with the plain run's tokens; every block comes back."""
    model = tiny_model(DSA3).eval()
    prompts = [[5, 6, 7], [3, 4], [10, 11, 12, 13], [9, 8]] * 2
    sampling = SamplingParams(temperature=1.0, max_new_tokens=40)
    want = plain_run(model, sampling, prompts)
    tight = TorchEngine(model, max_batch=8, kv_tokens=8 * BLOCK_SIZE,
                        speculative=Speculative(Oracle({i: c.token_ids for i, c in enumerate(want)}, 0.7), 3))
    assert_same(tight.generate(prompts, sampling, seed=3), want)
    assert tight.stats["retracted"] > 0 and len(tight.pool.free) == tight.pool.num_blocks


def test_a_weight_update_between_iterations():
    """Weights published mid-call land between two steps, never between a draft and its verify (one version per
    step); the completions record the versions they span. Same weights republished: the plain run's tokens."""
    model, sampling = tiny_model(), SAMPLINGS[0]
    want = plain_run(model, sampling)
    drafter = Oracle({i: c.token_ids for i, c in enumerate(want)}, 0.5)
    engine = TorchEngine(model, max_batch=8, speculative=Speculative(drafter, 2))
    verify = spec_mod.decode_forward
    seen = []

    def verify_then_publish(*a, **kw):  # the verify sees the draft's version; then a publish lands
        seen.append((drafter.versions[-1], engine.version))
        out = verify(*a, **kw)
        if len(seen) == 2:
            engine.update_weights(list(model.state_dict().items()), 1)
        return out
    spec_mod.decode_forward = verify_then_publish
    try:
        got = engine.generate(PROMPTS, sampling, seed=3)
    finally:
        spec_mod.decode_forward = verify
    assert_same(got, want)
    assert all(d == v for d, v in seen) and {c.versions for c in got} == {(0, 1)}


def test_the_config_key():
    assert Speculative.of(tiny_model(), 0) is None
    with pytest.raises(ValueError, match="rollout.speculative_tokens must be an integer >= 0"):
        Speculative.of(tiny_model(), -1)
    with pytest.raises(ValueError, match=r"rollout.speculative_tokens: 2 .* no MTP layers \(model.mtp_layers"):
        Speculative.of(tiny_model(), 2)
    spec = Speculative.of(MODELS["dense_dsa"](), 2)
    assert isinstance(spec.drafter, MTPDrafter) and spec.k == 2 and spec.adaptive  # (a run's: adaptive)
    assert not Speculative(Oracle({}, 1.0), 2).adaptive
    with pytest.raises(ValueError, match="k >= 1"):
        Speculative(Oracle({}, 1.0), 0)


# ----------------------------------------------------------------------------- the MTP drafter (families/mtp.py)

def with_mtp(base, seed=1):
    """base's model with one MTP layer: the decoder's weights base's (so the plain engine runs base's model), the MTP
    layer's random, perturbed as test_engine's models are."""
    torch.manual_seed(seed)
    m = GLM(replace(base.cfg, mtp_layers=1))
    assert all(n.startswith("mtp.") for n in m.load_state_dict(base.state_dict(), strict=False).missing_keys)
    with torch.no_grad():
        for p in m.mtp.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return m.eval()


MODELS = {"dense_dsa": lambda: with_mtp(tiny_model(DSA3).eval()), "mla_moe_dsa": lambda: with_mtp(tiny_moe())}


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_mtp_drafter_gives_the_plain_engines_tokens(kind, k):
    """make_engine's drafter (Speculative.of: the model's MTP layer, its KV in the pool as layer L): every sampling at
    another max_batch each, the plain run's tokens, logprobs, finish reasons (and MoE routes); every block back."""
    model = MODELS[kind]()
    for sampling, max_batch in zip(SAMPLINGS, (1, 3, 8)):
        want = plain_run(model, sampling)
        engine = TorchEngine(model, max_batch=max_batch, speculative=Speculative.of(model, k))
        got = engine.generate(PROMPTS, sampling, seed=3)
        assert_same(got, want)
        if kind == "mla_moe_dsa":
            assert all(torch.equal(a.routes, b.routes) for a, b in zip(got, want))
        assert len(engine.pool.k) == model.cfg.num_layers + 1 and engine.stats["spec_drafts"] > 0
        assert len(engine.pool.free) == engine.pool.num_blocks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("kind", list(MODELS))
def test_cuda_verify_graph_replays_give_the_eager_buckets_tokens(kind, monkeypatch):
    """On a GPU, bf16, the MTP drafter: speculative calls whose verify forwards and draft steps replay captured graphs
    give exactly the tokens and logprobs of the same padded buckets run eagerly (capture=False), and every verify and
    draft bucket passes the capture guard (graphs kept, none failed)."""
    monkeypatch.setattr(graphs_mod, "GRAPH_MIN_KEYS", 8)
    sp, prompts, outs = SamplingParams(temperature=1.0, max_new_tokens=20), PROMPTS * 2, []
    model = MODELS[kind]().to("cuda", torch.bfloat16)
    for capture in (False, True):
        engine = graph_engine(model, capture, max_batch=5, speculative=Speculative(MTPDrafter(), 3))
        outs.append(engine.generate(prompts, sp, seed=9))
    v, d = engine.graphs.verify, engine.graphs.draft
    assert not v.failed and len(v.graphs) >= 3 and engine.stats["graph_steps"] == engine.stats["spec_verifies"]
    assert not d.failed and len(d.graphs) >= 3 and engine.stats["spec_graph_drafts"] == 3 * engine.stats["spec_verifies"]
    assert [c.token_ids for c in outs[0]] == [c.token_ids for c in outs[1]]
    assert [c.logprobs for c in outs[0]] == [c.logprobs for c in outs[1]]


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_bf16_generator_speculates_the_plain_engines_tokens(kind):
    """The GPU's dtype: the generator's weights in bf16 (model.cast_). The tokens and finish reasons are the plain bf16
    engine's; the logprobs agree to bf16's rounding across batch shapes (the verify forward runs B (k + 1) rows)."""
    model = MODELS[kind]().cast_(torch.bfloat16)
    for sampling, max_batch in zip(SAMPLINGS, (1, 3, 8)):
        want = plain_run(model, sampling)
        got = TorchEngine(model, max_batch=max_batch, speculative=Speculative(MTPDrafter(), 2)).generate(PROMPTS, sampling,
                                                                                                       seed=3)
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
        for a, b in zip(got, want):
            assert a.logprobs == pytest.approx(b.logprobs, abs=3e-2)


def mtp_stores(engine, blocks, n):
    """The MTP layer's stores in the pool (keys, values or MLA latent, DSA indexer keys) at positions 0..n-1 of blocks."""
    pool, L = engine.pool, engine.model.cfg.num_layers
    slots = torch.tensor([blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n)])
    return [s[slots] for s in (pool.k[L], *pool.v[L:], pool.index_k[L]) if s is not None]


def mtp_reference(model, ids):
    """The MTP layer's keys over a whole trajectory ids (n tokens), as families/mtp.draft leaves them in a KVCache:
    position t from (the trunk's hidden at t, token t + 1), t < n - 1; the stores in mtp_stores' order."""
    n, L = len(ids), model.cfg.num_layers
    cache = KVCache(model.cfg, 1, n, mtp=True)
    with torch.no_grad():
        trunk = model(torch.tensor([ids[:-1]]), cache=cache, return_hidden="trunk")
        mtp.draft(model, trunk, torch.tensor([ids[1:]]), cache=cache)
    return [s[0, :n - 1] for s in (cache.k[L], *cache.v[L:], cache.index_k[L]) if s is not None]


def play_two_turns(engine, sampling):
    """Two turns per trajectory in one session (the second extends the first's parked KV), every turn parked: the
    completions by (trajectory, turn), the contexts, and (a speculative engine) each parked trajectory's parked ids and
    its MTP stores over its blocks."""
    ctx, outs = {i: list(p) for i, p in enumerate(PROMPTS)}, {}
    with engine.session(sampling, 64) as call:
        owner = {call.submit(ctx[i], 12, 100 + i, key=i): (i, 0) for i in ctx}
        while call.busy:
            for index, c in call.step():
                i, turn = owner.pop(index)
                outs[i, turn] = c
                ctx[i] += c.token_ids
                if turn == 0:
                    ctx[i] += [7, 8, 9][:1 + i % 3]  # the env's answer
                    owner[call.submit(ctx[i], 12, 200 + i, key=i)] = (i, 1)
        pools = {i: (ids, mtp_stores(engine, blocks, len(blocks) * BLOCK_SIZE)) for i, (ids, blocks) in engine.parked.items()
                 if engine.spec}
    return outs, ctx, pools


def stop_mid_way(model):
    """Sampling whose stop tokens end rows mid-way (drafts past them are fed, then must leave nothing behind)."""
    free = plain_run(model, SamplingParams(temperature=1.0, max_new_tokens=12))
    return SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=(free[0].token_ids[4], free[2].token_ids[6]))


def assert_mtp_kv_is_a_plain_mtp_forwards(model, ctx, pools):
    for i, (ids, stores) in pools.items():
        n = len(ctx[i])
        assert ids == ctx[i][:-1]  # the parked KV: every position but the last token's
        for got_s, ref in zip(stores, mtp_reference(model, ctx[i]), strict=True):
            assert torch.allclose(got_s[:n - 1].float(), ref.float(), atol=1e-5), i
            assert not got_s[n - 1:].any(), i  # (the rest of its blocks: nothing)


@pytest.mark.parametrize("kind", list(MODELS))
def test_the_mtp_layers_kv_equals_a_plain_mtp_forward_over_each_trajectory(kind):
    """Two turns per trajectory in a session (the second extends the first's parked KV), every turn parked, rows ending
    on stop tokens mid-way: the MTP layer's KV over each trajectory's blocks equals a plain MTP forward of its tokens at
    every position the trunk's KV holds (prefill, extend and the draft extend wrote it), and holds nothing past them
    (the drafts' provisional keys were overwritten or cleared); the completions are the plain engine's."""
    model = MODELS[kind]()
    sampling = stop_mid_way(model)
    want, ctx, _ = play_two_turns(TorchEngine(model, max_batch=4), sampling)
    # (a pool that holds every trajectory: no block is evicted and reused, so a slot past a trajectory's end holds nothing)
    engine = TorchEngine(model, max_batch=4, kv_tokens=len(PROMPTS) * 64, speculative=Speculative.of(model, 3))
    got, got_ctx, pools = play_two_turns(engine, sampling)
    assert got_ctx == ctx and engine.stats["extends"] >= 4 and engine.stats["evicted"] == 0
    assert sum(c.finish_reason == "stop" for c in want.values()) >= 2
    for key in want:
        assert_same([got[key]], [want[key]])
    assert pools and engine.stats["spec_calls"] == 1
    assert_mtp_kv_is_a_plain_mtp_forwards(model, ctx, pools)


def test_retraction_and_a_weight_update_with_the_mtp_drafter():
    """A pool too small for every row (rows retracted, prefilled again, their MTP KV too), and a publish of the learner's
    named parameters mid-call, MTP layer included (update_weights copies mtp.*): the plain run's tokens."""
    model = MODELS["dense_dsa"]()
    prompts = [[5, 6, 7], [3, 4], [10, 11, 12, 13], [9, 8]] * 2
    sampling = SamplingParams(temperature=1.0, max_new_tokens=40)
    want = plain_run(model, sampling, prompts)
    engine = TorchEngine(copy.deepcopy(model), max_batch=8, kv_tokens=8 * BLOCK_SIZE, speculative=Speculative.of(model, 3))
    with torch.no_grad():  # the engine's MTP layer differs until the publish brings the learner's
        for p in engine.model.mtp.parameters():
            p.zero_()
    step, n = engine.spec.step, [0]

    def step_then_publish(eng):
        step(eng)
        n[0] += 1
        if n[0] == 3:
            eng.update_weights(list(model.named_parameters()), 1)
    engine.spec.step = step_then_publish
    assert_same(engine.generate(prompts, sampling, seed=3), want)
    assert engine.stats["retracted"] > 0 and len(engine.pool.free) == engine.pool.num_blocks
    assert all(torch.equal(p, model.get_parameter(name)) for name, p in engine.model.named_parameters())


def test_a_trained_mtp_layer_drafts_what_the_target_samples():
    """An MTP layer trained with families/mtp.mtp_loss on the target's own greedy samples (a few Adam steps on the MTP
    layer alone), published into the engine with update_weights (mtp.* with the rest): the share of drafts accepted
    rises from an untrained layer's near-chance (~1/40) to most; the tokens are the plain run's either way."""
    model = MODELS["dense_dsa"]()
    rng = random.Random(0)
    prompts = [[rng.randrange(40) for _ in range(rng.randint(2, 6))] for _ in range(16)]
    sampling = SamplingParams(temperature=0, max_new_tokens=16)
    want = plain_run(model, sampling, prompts, seed=0)
    seqs = [p + c.token_ids for p, c in zip(prompts, want)]
    ids = torch.tensor([t for s in seqs for t in s])[None]  # one packed row
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    student = copy.deepcopy(model).requires_grad_(False)
    student.mtp.requires_grad_(True)
    opt = torch.optim.Adam(student.mtp.parameters(), lr=1e-2)
    with torch.no_grad():
        trunk = model(ids, position_ids=pos, return_hidden="trunk")
    for _ in range(30):
        loss = mtp.mtp_loss(student, trunk, ids, torch.ones_like(ids), position_ids=pos)
        opt.zero_grad()
        loss.backward()
        opt.step()
    engine = TorchEngine(copy.deepcopy(model), max_batch=8, speculative=Speculative(MTPDrafter(), 2))  # (every call)
    rates = []
    for version in (0, 1):
        if version:
            engine.update_weights([(n, p.detach()) for n, p in student.named_parameters() if n.startswith("mtp.")], 1)
        before = {k: engine.stats.get(k, 0) for k in ("spec_accepted", "spec_drafts")}
        assert_same(engine.generate(prompts, sampling, seed=0), want)
        s = engine.stats
        rates.append((s["spec_accepted"] - before["spec_accepted"]) / (s["spec_drafts"] - before["spec_drafts"]))
    assert rates[0] < 0.1 and rates[1] > 0.4, rates


# ----------------------------------------------------------------------------- adaptive: speculation where it pays

def test_the_policy_against_its_statement():
    """Speculative.open's choices, figures injected: the first call speculates, then one runs plain (no plain figure),
    then the faster mode but every PROBE_EVERY-th call, which runs the other; each call counted in stats. Without
    adaptive (Speculative(drafter, k)): every call speculates, whatever the figures."""
    def calls(spec, n, rate):
        stats, modes = {}, []
        for _ in range(n):
            spec.rate = dict(rate)  # (close would overwrite the figure of the call's mode with the one it measured)
            modes.append(spec.open(stats))
            spec.close(stats)
        assert stats.get("spec_calls", 0) == sum(modes) and stats.get("plain_calls", 0) == n - sum(modes)
        return modes

    adaptive = lambda: Speculative(Oracle({}, 1.0), 2, adaptive=True)  # noqa: E731
    assert calls(adaptive(), 3, {"spec": None, "plain": None}) == [True] * 3  # (a call that measured nothing: again)
    assert calls(adaptive(), 3, {"spec": 5.0, "plain": None}) == [False] * 3
    n = 3 * PROBE_EVERY
    for spec_rate, plain_rate in [(5.0, 7.0), (7.0, 5.0), (6.0, 6.0)]:
        faster = spec_rate >= plain_rate
        want = [faster if i % PROBE_EVERY != PROBE_EVERY - 1 else not faster for i in range(n)]
        assert calls(adaptive(), n, {"spec": spec_rate, "plain": plain_rate}) == want
    assert calls(Speculative(Oracle({}, 1.0), 2), n, {"spec": 1.0, "plain": 9.0}) == [True] * n


class Ticks:
    """A clock that moves one second per reading: a speculative step reads it three times (two seconds), a plain
    step twice (one second)."""

    def __init__(self):
        self.t = 0

    def __call__(self):
        self.t += 1
        return self.t


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_the_engine_takes_the_faster_mode_on_its_own_figures(p):
    """An injected clock (Ticks) and an oracle whose drafts are all rejected (p = 0: one token per row and two seconds
    a step, where a plain step emits one per second: plain is faster) or all accepted (p = 1, k = 3: four per two
    seconds: speculation is). Call by call: the first speculates, the next runs plain, then the faster mode with a
    probe of the other at the PROBE_EVERY-th; each mode's figure is its last call's, against a hand count (6 rows x 13
    decode tokens a call, no stops: 13 plain steps; at p = 0 13 speculative steps, at p = 1 4); the tokens, logprobs
    and finish reasons of every call are the plain engine's."""
    model, k, sampling = tiny_model(), 3, SAMPLINGS[0]
    want = plain_run(model, sampling)
    spec = Speculative(Oracle({i: c.token_ids for i, c in enumerate(want)}, p), k, adaptive=True)
    spec.clock = Ticks()
    engine = TorchEngine(model, max_batch=8, speculative=spec)
    modes = []
    for _ in range(PROBE_EVERY + 3):
        before = engine.stats.get("spec_calls", 0)
        assert_same(engine.generate(PROMPTS, sampling, seed=3), want)
        modes.append(engine.stats["spec_calls"] > before)
    faster = p == 1.0
    assert modes == [True, False] + [faster] * (PROBE_EVERY - 1) + [not faster, faster]
    tokens = 6 * 13
    assert spec.rate == {"spec": tokens / (2 * (4 if p else 13)), "plain": tokens / 13}
    assert engine.stats["spec_tokens_per_s"] == spec.rate["spec"] and engine.stats["plain_tokens_per_s"] == spec.rate["plain"]
    assert engine.stats["plain_tokens"] == tokens * engine.stats["plain_calls"]
    assert engine.stats["spec_tokens"] == tokens * engine.stats["spec_calls"]


@pytest.mark.parametrize("kind", list(MODELS))
def test_plain_calls_then_a_speculative_one_keep_the_mtp_kv_invariant(kind, monkeypatch):
    """A run's adaptive engine (Speculative.of) whose figures say plain: its calls (sessions of two turns, the second
    extending the first's parked KV) run the plain path (no draft, verify, MTP prefill or hidden kept: the MTP layer's
    KV stays empty) with the plain engine's completions; then figures that say speculate: the next call speculates,
    its completions the plain engine's, and its MTP KV over each trajectory equals a plain MTP forward's (the
    invariant test's check), though the blocks it reuses held the plain calls' trunk KV."""
    model = MODELS[kind]()
    sampling = stop_mid_way(model)
    want, ctx, _ = play_two_turns(TorchEngine(model, max_batch=4), sampling)
    spec = Speculative.of(model, 3)
    engine = TorchEngine(model, max_batch=4, kv_tokens=len(PROMPTS) * 64, speculative=spec)
    with monkeypatch.context() as m:  # a plain call touches nothing of speculation's
        for name in ("step", "prefill", "admitted"):
            m.setattr(Speculative, name, lambda *a, **kw: pytest.fail("a plain call ran speculation's path"))
        for _ in range(2):
            spec.rate["spec"] = 1e-9  # (the second call: both figures known, plain's measured)
            got, got_ctx, _ = play_two_turns(engine, sampling)
            assert got_ctx == ctx and all(got[key].token_ids == want[key].token_ids for key in want)
            assert all(got[key].logprobs == want[key].logprobs for key in want)  # (the same path: the same roundings)
    L = model.cfg.num_layers
    assert engine.stats["plain_calls"] == 2 and engine.stats["extends"] >= 4 and "spec_calls" not in engine.stats
    assert not any(s.any() for s in (engine.pool.k[L], *engine.pool.v[L:], engine.pool.index_k[L]) if s is not None)
    spec.rate["spec"] = 1e9
    got, got_ctx, pools = play_two_turns(engine, sampling)
    assert engine.stats["spec_calls"] == 1 and engine.stats["spec_verifies"] > 0 and got_ctx == ctx
    for key in want:
        assert_same([got[key]], [want[key]])
    assert_mtp_kv_is_a_plain_mtp_forwards(model, ctx, pools)
