"""graphs.py: key_slots against the slots of a block table, the bucket shapes, the capture guard (torch.cuda's
graph calls faked on a CPU) and the graphs' buffers against the memory plan. Graph replays against eager
decoding on a GPU, and engine runs through padded buckets: test_engine.py."""
import contextlib

import pytest
import torch

from machinery import graphs as graphs_mod
from machinery.engine import SamplingParams, TorchEngine
from machinery.memory import memory_plan
from model import BLOCK_SIZE, PagedKVCache
from test_engine import graph_engine, tiny_model


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

    class Stream:
        def __init__(self, device=None):
            pass

        def wait_stream(self, other):
            pass
    sp = SamplingParams(temperature=1.0, max_new_tokens=12)
    ref = TorchEngine(tiny_model()).generate([[1, 2, 3], [4, 5]], sp, seed=5)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
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
