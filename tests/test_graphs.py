"""graphs.py: key_slots against the slots of a block table, the bucket shapes, the capture guard (torch.cuda's
graph calls faked on a CPU), a speculative engine's verify and MTP draft graphs sharing the decode graphs' pool (the
same fakes), and the graphs' buffers against the memory plan. Graph replays against eager
decoding on a GPU, and engine runs through padded buckets: test_engine.py."""
import contextlib

import pytest
import torch

from machinery import graphs as graphs_mod
from machinery.engine import SamplingParams, TorchEngine
from machinery.memory import memory_plan
from model import BLOCK_SIZE, PagedKVCache, RMSNorm
from test_engine import graph_engine, tiny_model, tiny_moe


def fake_cuda(monkeypatch, Graph):
    """torch.cuda's graph and stream calls, faked on a CPU: graphs of class Graph, streams that do nothing."""
    class Stream:
        def __init__(self, device=None):
            pass

        def wait_stream(self, other):
            pass
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())


def test_graph_capture_falls_back_to_eager_on_a_bad_replay_or_an_error(monkeypatch):
    """The capture guard, with torch.cuda's graph and stream calls faked on a CPU: a replay whose logits
    differ from the eager run's (one that never ran the forward, or one that gives NaN) or a capture that
    raises turns graphs off with one warning and drops them, and generation goes on eagerly with the
    tokens of a plain engine. The first capture is of the largest bucket, with thread-local errors."""
    captured = []

    class Graph:  # "captures" nothing: the logits buffer keeps what capture_end left there
        def capture_begin(self, pool=None, capture_error_mode="global"):
            captured.append(capture_error_mode)
            if mode == "raise":
                raise RuntimeError("operation not permitted when stream is capturing\nmore")

        def capture_end(self):
            graphs.logits.fill_(0.0 if mode == "stale" else float("nan"))

        def pool(self):
            return "pool"

        def replay(self):
            pass
    sp = SamplingParams(temperature=1.0, max_new_tokens=12)
    ref = TorchEngine(tiny_model()).generate([[1, 2, 3], [4, 5]], sp, seed=5)
    fake_cuda(monkeypatch, Graph)
    capture = graphs_mod.DecodeGraphs._capture
    monkeypatch.setattr(graphs_mod.DecodeGraphs, "_capture", lambda g, Bg, Lg: captured.append((Bg, Lg)) or capture(g, Bg, Lg))
    for mode in ("stale", "nan", "raise"):
        captured.clear()
        engine = graph_engine(tiny_model(), capture=True)  # as if on a GPU
        graphs = engine.graphs
        with pytest.warns(RuntimeWarning, match="decoding eagerly from now on") as w:
            out = engine.generate([[1, 2, 3], [4, 5]], sp, seed=5)
        assert len(w) == 1 and graphs.failed and graphs.graphs == {} and graphs.mempool is None
        assert captured == [(graphs.rows[-1], graphs.max_keys), "thread_local"]  # the largest bucket, first
        assert [c.token_ids for c in out] == [c.token_ids for c in ref]
        assert [x for c in out for x in c.logprobs] == pytest.approx([x for c in ref for x in c.logprobs], abs=1e-6)
    assert "RuntimeError: operation not permitted" in str(w[0].message)


def kind(g):
    """A graph set's kind: the decode's, speculation's verify (per = k + 1) or the MTP draft step's."""
    return "draft" if g.mtp else "verify" if g.per > 1 else "decode"


def test_verify_draft_and_decode_graphs_share_one_pool_the_largest_bucket_first(monkeypatch):
    """A speculative engine's three graph sets (DecodeGraphs, its .verify, k + 1 tokens a row, and its .draft, the MTP
    layer's draft step), with torch.cuda faked on a CPU by graphs whose replay runs the forward they saw captured: a
    speculative call, then a plain one (the adaptive policy's first two). The very first capture is the verify set's
    largest bucket, on a new pool; every later one, of any set, is on that pool; all sets keep their graphs, no warning,
    and each call's tokens are the plain engine's. Then, each on a new engine, a capture that fails turns that set alone
    eager, with one warning: a verify replay with stale logits (the decode set's largest bucket then goes first, when
    the draft step needs a pool), a draft replay with stale logits, and one whose logits are right but whose output
    hidden (the next draft step's input) is not."""
    from test_speculative import MODELS
    from machinery.speculative import Speculative
    captured, last = [], []

    class Graph:  # "captures" the forward it saw run (DecodeGraphs._forward), which its replay runs again
        def capture_begin(self, pool=None, capture_error_mode="global"):
            captured.append((pool, capture_error_mode))

        def capture_end(self):
            g, Bg, Lg = self.seen = last[-1]

        def replay(self):  # stale: the replays of one kind of set leave their logits at zero, or a wrong output hidden
            g, Bg, Lg = self.seen
            if (kind(g), "logits") == stale:
                g.logits.fill_(0.0)
                return
            forward(g, Bg, Lg)
            if (kind(g), "out") == stale:
                g.out.add_(1.0)

        def pool(self):
            return "pool"
    fake_cuda(monkeypatch, Graph)
    forward = graphs_mod.DecodeGraphs._forward
    monkeypatch.setattr(graphs_mod.DecodeGraphs, "_forward", lambda g, Bg, Lg: last.append((g, Bg, Lg)) or forward(g, Bg, Lg))
    capture = graphs_mod.DecodeGraphs._capture
    monkeypatch.setattr(graphs_mod.DecodeGraphs, "_capture", lambda g, Bg, Lg: captured.append((kind(g), Bg, Lg))
                        or capture(g, Bg, Lg))
    model, k, sp, stale = MODELS["dense_dsa"](), 2, SamplingParams(temperature=1.0, max_new_tokens=12), None
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    ref = TorchEngine(model).generate(prompts, sp, seed=5)
    engine = graph_engine(model, capture=True, max_batch=8, speculative=Speculative.of(model, k))
    g, v, d = engine.graphs, engine.graphs.verify, engine.graphs.draft
    assert v.per == k + 1 and v.shared is g.shared is d.shared and g.trunk is None and d.trunk is None and d.capture
    assert v.trunk.shape == (8 * (k + 1), model.cfg.hidden_size) and v.tok.shape == (8 * (k + 1), 1)
    assert d.per == 1 and d.hidden.shape == d.out.shape == (8, model.cfg.hidden_size) and v.hidden is None
    for call in ("spec", "plain"):
        before = engine.stats.get(f"{call}_calls", 0)
        out = engine.generate(prompts, sp, seed=5)
        assert engine.stats[f"{call}_calls"] == before + 1
        assert [c.token_ids for c in out] == [c.token_ids for c in ref]
        assert [x for c in out for x in c.logprobs] == pytest.approx([x for c in ref for x in c.logprobs], abs=1e-5)
    assert captured[0] == ("verify", 8, 64) and captured[1] == (None, "thread_local")  # the largest forward, first
    assert all(c == ("pool", "thread_local") for c in captured[3::2]) and len(captured) > 8
    assert v.graphs and g.graphs and d.graphs and not (v.failed or g.failed or d.failed) and g.mempool == "pool"
    assert {what for what, *_ in captured[::2]} == {"decode", "verify", "draft"}
    assert ("draft", 4, 64) in captured[::2] and engine.stats["spec_graph_drafts"] > 0
    for stale, what in [(("verify", "logits"), "the verify of 8 rows x 3 tokens"), (("draft", "logits"), "the MTP draft "
                        "step of 4 rows"), (("draft", "out"), "the MTP draft step of 4 rows")]:
        captured.clear()
        engine = graph_engine(model, capture=True, max_batch=8, speculative=Speculative.of(model, k))
        with pytest.warns(RuntimeWarning, match=f"capturing {what} x 64 keys failed") as w:
            out = engine.generate(prompts, sp, seed=5)
        sets = {kind(s): s for s in engine.graphs.shared.sets}
        assert len(w) == 1 and [name for name, s in sets.items() if s.failed] == [stale[0]]
        assert sets[stale[0]].graphs == {} and engine.graphs.mempool == "pool"
        assert all(s.graphs for name, s in sets.items() if name not in (stale[0], "decode"))
        # the first captures: the verify's largest bucket, then (that failed) the decode's, before the draft's own
        assert [c[0] for c in captured[:6:2]] == (["verify", "decode", "draft"] if stale[0] == "verify" else
                                                  ["verify", "draft", "verify"])
        assert [c.token_ids for c in out] == [c.token_ids for c in ref]
        assert [x for c in out for x in c.logprobs] == pytest.approx([x for c in ref for x in c.logprobs], abs=1e-5)


def test_graph_buffers_are_what_the_memory_plan_counts():
    """--dry-run's CUDA-graph items against what DecodeGraphs allocates: tokens and positions [B], key slots
    and masks [B, S], logits [B, V] in the generator's bf16 (no such items without graphs); and its KV pool
    item against the pool the engine made for B rows of S tokens."""
    model = tiny_model().to(torch.bfloat16)
    B, S = 3, 40
    engine = TorchEngine(model, max_batch=B, graphs=True)
    engine._open(SamplingParams(), S, S - 10)
    g = engine.graphs
    real = sum(t.numel() * t.element_size() for t in (g.tok, g.pos, g.keys, g.valid, g.logits))
    plan = memory_plan(model.cfg, learner_gpus=1, parallel="fsdp", micro_batch_tokens=64, gradient_checkpointing=True,
                       trainable_indexer=False, reference=False, generator_batch=B, generator_max_len=S,
                       max_new_tokens=30, engine="torch", cuda_graphs=True)
    assert dict(plan.generator)[f"CUDA graphs' inputs [{B}, {S}] and logits [{B}, V]"] == real
    pool = engine.pool  # and the KV pool the engine made: B rows of S tokens in whole blocks, and the scratch block
    slots = pool.k[0].shape[0]
    assert dict(plan.generator)[f"paged KV pool bf16, {slots} token slots (rollout and eval, one at a time)"] == sum(
        t.numel() * t.element_size() for t in pool.k + pool.v + [t for t in pool.index_k if t is not None])
    assert not any("CUDA graphs" in item for item, _ in memory_plan(
        model.cfg, **{**dict(learner_gpus=1, parallel="fsdp", micro_batch_tokens=64, gradient_checkpointing=True,
                         trainable_indexer=False, reference=False, generator_batch=B, generator_max_len=S,
                         max_new_tokens=30, engine="torch")}).generator)


def test_verify_graph_buffers_are_what_the_memory_plan_counts():
    """A speculative engine's verify graphs (DecodeGraphs.verify): tokens and positions [B (k + 1)], key slots and masks
    [B (k + 1), S], logits [B (k + 1), V] and the trunk's hidden [B (k + 1), h] in bf16, as --dry-run counts them; the
    graphs' pool item is then the verify's forward."""
    from test_speculative import MODELS
    from machinery.speculative import Speculative
    model, B, S, k = MODELS["dense_dsa"]().to(torch.bfloat16), 3, 40, 2
    engine = TorchEngine(model, max_batch=B, graphs=True, speculative=Speculative.of(model, k))
    engine._open(SamplingParams(), S, S - 10)
    v, R = engine.graphs.verify, B * (k + 1)
    real = sum(t.numel() * t.element_size() for t in (v.tok, v.pos, v.keys, v.valid, v.logits, v.trunk))
    plan = dict(memory_plan(model.cfg, learner_gpus=1, parallel="fsdp", micro_batch_tokens=64, gradient_checkpointing=True,
                            trainable_indexer=False, reference=False, generator_batch=B, generator_max_len=S,
                            max_new_tokens=30, engine="torch", cuda_graphs=True, speculative_tokens=k).generator)
    assert plan[f"CUDA graphs' verify inputs [{R}, {S}], logits [{R}, V] and trunk [{R}, h]"] == real
    assert f"CUDA graphs' pool: a verify forward of {B} x {k + 1} rows + cuBLAS's workspace" in plan


def test_key_slots_are_the_table_slots_of_each_rows_last_positions():
    """key_slots against a plain loop over the block table: row r reads positions pos[r] - Lk + 1 .. pos[r] in
    order, position p in slot table[r][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE; positions below 0 are
    padding (invalid), on the left."""
    table = torch.tensor([[7, 2, 9], [4, 0, 0], [1, 5, 3]])
    pos = torch.tensor([BLOCK_SIZE + 3, 2, 2 * BLOCK_SIZE])
    Lk = BLOCK_SIZE + 6
    keys, valid = graphs_mod.key_slots(table, pos, Lk)
    assert keys.shape == valid.shape == (3, Lk)
    for r in range(3):
        for j in range(Lk):
            p = int(pos[r]) - (Lk - 1) + j
            assert bool(valid[r, j]) == (p >= 0), (r, j)
            if p >= 0:
                assert int(keys[r, j]) == int(table[r, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE, (r, j)


def test_buckets_are_the_smallest_that_hold_a_step():
    """Rows 1, 2, 4, 8, then every GRAPH_ROW_STEP, and max_batch; keys from GRAPH_MIN_KEYS, doubling, capped
    at the longest sequence."""
    model = tiny_model()
    pool = PagedKVCache(model.cfg, 4, BLOCK_SIZE)
    g = graphs_mod.DecodeGraphs(model, pool, max_batch=40, max_keys=600, capture=False)
    assert g.rows == [1, 2, 4, 8, 16, 32, 40]
    K = graphs_mod.GRAPH_MIN_KEYS
    assert g.bucket(1, 1) == (1, K) and g.bucket(3, K) == (4, K) and g.bucket(9, K + 1) == (16, 2 * K)
    assert g.bucket(33, 599) == (40, 600) and g.bucket(40, 600) == (40, 600)  # 4 * K = 1024 > 600 keys: capped


def test_draft_graph_buffers_are_what_the_memory_plan_counts():
    """A speculative engine's MTP draft-step graphs (DecodeGraphs.draft): tokens and positions [B], key slots and masks
    [B, S], logits [B, V] and the MTP layer's hidden in and out [B, h] in bf16, as --dry-run counts them."""
    from test_speculative import MODELS
    from machinery.speculative import Speculative
    model, B, S, k = MODELS["dense_dsa"]().to(torch.bfloat16), 3, 40, 2
    engine = TorchEngine(model, max_batch=B, graphs=True, speculative=Speculative.of(model, k))
    engine._open(SamplingParams(), S, S - 10)
    d = engine.graphs.draft
    real = sum(t.numel() * t.element_size() for t in (d.tok, d.pos, d.keys, d.valid, d.logits, d.hidden, d.out))
    plan = dict(memory_plan(model.cfg, learner_gpus=1, parallel="fsdp", micro_batch_tokens=64, gradient_checkpointing=True,
                            trainable_indexer=False, reference=False, generator_batch=B, generator_max_len=S,
                            max_new_tokens=30, engine="torch", cuda_graphs=True, speculative_tokens=k).generator)
    assert plan[f"CUDA graphs' draft inputs [{B}, {S}], logits [{B}, V] and hidden in and out [{B}, h]"] == real


@pytest.mark.parametrize("make", [tiny_model, tiny_moe])
def test_fuse_swaps_every_norm_and_changes_nothing_on_a_cpu(make):
    """fuse_norms(model): every model.RMSNorm of a GLM-4 or MLA + MoE model (MLA's latent norms included) is a
    FusedRMSNorm, the same modules and parameters, and without the kernel (a CPU) the same logits, bit for bit.
    TorchEngine fuses the model it is given."""
    model = make()
    norms = [m for m in model.modules() if type(m) is RMSNorm]
    params = dict(model.named_parameters())
    ids = torch.randint(2, 40, (2, 9))
    with torch.no_grad():
        before = model(ids)
    graphs_mod.fuse_norms(model)
    assert norms and all(type(m) is graphs_mod.FusedRMSNorm for m in norms)
    assert not any(type(m) is RMSNorm for m in model.modules())
    assert all(p is params[n] for n, p in model.named_parameters())
    with torch.no_grad():
        assert torch.equal(model(ids), before)
    engine = TorchEngine(make())
    assert not any(type(m) is RMSNorm for m in engine.model.modules())
