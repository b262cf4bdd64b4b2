"""Tests for parallel.py in one process (the multi-process paths run in tests/test_train.py under
torchrun): the non-finite guard's count of skipped steps, and the micro-batch evening."""
import pytest

import parallel


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
