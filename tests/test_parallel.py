"""Tests for parallel.py in one process (the multi-process paths run in tests/test_train.py under
torchrun): the non-finite guard's count of skipped steps, and the micro-batch evening."""
import os
import subprocess
import sys

import pytest
import torch

from machinery import parallel
from model import GLM, GLMConfig


def test_skips_in_a_row_stop_with_one_line():
    skips = parallel.Skips(limit=3)
    for step in range(1, 3):
        skips.update("rl", step, {"train/skipped": 1.0, "train/loss": float("nan"), "train/grad_norm": 1.0})
    skips.update("rl", 3, {"train/skipped": 0.0})  # a good step resets the run
    assert (skips.total, skips.run) == (2, 0)
    for step in range(4, 6):
        skips.update("rl", step, {"train/skipped": 1.0, "train/loss": 1.0, "train/grad_norm": float("inf")})
    with pytest.raises(FloatingPointError) as e:
        skips.update("rl", 6, {"train/skipped": 1.0, "train/loss": 1.0, "train/grad_norm": float("inf")})
    assert str(e.value).startswith("rl step 6: grad_norm inf for 3 steps in a row") and "\n" not in str(e.value)


def test_micro_batches_in_one_process_are_the_groups():
    assert parallel.micro_batches(None, [[0, 1], [2]]) == [(0, [0, 1]), (1, [2])]
    assert parallel.combine_ranks({"train/tokens": 5, "train/loss": 1.5}) == {"train/tokens": 5, "train/loss": 1.5}


# ----------------------------------------------------------------------------- loading sharded
# torchrun with gloo on the CPU: each of 2 FSDP ranks loads only its rows of every tensor
# (parallel.load_learner); gathered, the model must equal one process's from_pretrained, bit for bit.
# This file is the worker: `torchrun ... tests/test_parallel.py DIR`.

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
DSA = {"topk": 4, "heads": 2, "head_dim": 8, "rope_dim": 4, "pattern": "FS"}


def save_tiny(path, dsa, tied):
    """A 3-layer model whose tensors have row counts that 2 ranks split unevenly (vocab 37, kv 2x8)."""
    torch.manual_seed(0)
    cfg = GLMConfig(vocab_size=37, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                    head_dim=8, eos_token_id=[1], pad_token_id=0, dsa=dsa, tie_word_embeddings=tied)
    model = GLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))  # every tensor distinct (norms and biases included)
    model.save_pretrained(path)


def load(ckpt, dsa):
    torch.manual_seed(1)  # what train.py does before loading: a fresh indexer's init draws from it
    return parallel.load_learner(ckpt, dsa, torch.device("cpu"), "fsdp")


CASES = [(DSA, None, False), (None, DSA, False), (None, None, True)]  # (saved, loaded, tied)


def test_two_fsdp_ranks_load_only_their_shards_and_match_one_process(tmp_path):
    """(saved, loaded, tied): a DSA checkpoint as is; a dense one turned DSA (fresh indexers, drawn whole from the
    seed on every rank, each keeping its rows); tied embeddings. One torchrun loads all three."""
    ckpts = [str(tmp_path / f"ckpt{i}") for i in range(len(CASES))]
    for ckpt, (saved, _, tied) in zip(ckpts, CASES):
        save_tiny(ckpt, saved, tied)
    p = subprocess.run([*TORCHRUN, "tests/test_parallel.py", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=os.environ | {"PYTHONPATH": ROOT})
    assert p.returncode == 0, p.stderr[-3000:]
    for i, (ckpt, (_, loaded, _)) in enumerate(zip(ckpts, CASES)):
        two, one = torch.load(str(tmp_path / f"weights{i}.pt")), dict(load(ckpt, loaded).named_parameters())
        assert set(two) == set(one)
        for name in one:
            assert torch.equal(two[name], one[name].detach()), (i, name)


if __name__ == "__main__":  # the worker: tests/test_parallel.py DIR (DIR/ckpt<i> -> DIR/weights<i>.pt)
    parallel.init_processes(torch.device("cpu"))
    for i, (_, loaded, tied) in enumerate(CASES):
        model = load(os.path.join(sys.argv[1], f"ckpt{i}"), loaded)
        # each rank holds only its rows: its local shards add up to about half of the model
        local = sum(p.to_local().numel() for p in model.parameters())
        assert local < 0.6 * sum(p.numel() for p in model.parameters()), local
        assert tied == (model.lm_head.weight is model.embed_tokens.weight)
        full = {k: v.clone() for k, v in parallel.full_weights(model)}
        if parallel.rank() == 0:
            torch.save(full, os.path.join(sys.argv[1], f"weights{i}.pt"))
    torch.distributed.destroy_process_group()
