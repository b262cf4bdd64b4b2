"""Tests for plot.py. Reading metrics.jsonl is checked against values written out by hand; the command
line's one-line errors run it as a subprocess; drawing only where matplotlib is installed (not in CI)."""
import json
import math
import os
import subprocess
import sys

import pytest

from machinery import plot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # python -m machinery.plot runs from the root


def test_parse_metrics_by_hand():
    lines = [
        '{"stage": "sft", "step": 1, "global_step": 1, "train/loss": 4.5, "train/indexer_kl": 0.25}\n',
        '{"stage": "sft", "step": 2, "global_step": 2, "train/loss": 3.0, "note": "text", "flag": true}\n',
        "\n",
        '{"stage": "rl", "step": 0, "global_step": 2, "eval/accuracy": 0.125}\n',  # the eval-only step-0 row
        '{"stage": "rl", "step": 1, "global_step": 3, "rollout/reward": 0.5, "train/loss": NaN}\n',
        '{"stage": "rl", "step": 2, "global_step": 4, "rollout/reward": 0.75}\n',
        # resumed from step 1: step 2 again, the later values win
        '{"stage": "rl", "step": 2, "global_step": 4, "rollout/reward": 0.25}\n',
        '{"stage": "rl", "step": 2, "eval/accuracy": 0.5}\n',  # an eval-only row adds to its step
        '{"stage": "rl", "step": 3, "global_step": 5, "rollout/reward": Infinity}\n',
        "[1, 2, 3]\n",  # JSON, but not a row
        '{"step": 4, "rollout/reward": 1.0}\n',  # no stage
        '{"stage": "rl", "step": "4", "rollout/reward": 1.0}\n',  # a step that is not a number
        '{"stage": "rl", "step": 4, "global_step": 6, "rollout/rew',  # cut short by a kill
    ]
    series = plot.parse_metrics(lines)
    nan = series["rl"]["train/loss"][1][0]
    assert math.isnan(nan)
    inf_as_nan = series["rl"]["rollout/reward"][1][2]
    assert math.isnan(inf_as_nan)
    assert series == {
        "sft": {
            "global_step": ([1, 2], [1.0, 2.0]),
            "train/loss": ([1, 2], [4.5, 3.0]),
            "train/indexer_kl": ([1], [0.25]),
        },
        "rl": {
            "global_step": ([0, 1, 2, 3], [2.0, 3.0, 4.0, 5.0]),
            "eval/accuracy": ([0, 2], [0.125, 0.5]),
            "rollout/reward": ([1, 2, 3], [0.5, 0.25, inf_as_nan]),  # NaN != NaN: the same object compares equal
            "train/loss": ([1], [nan]),
        },
    }


def test_parse_metrics_sorts_steps_and_skips_nothing_usable():
    # A resumed run can log an earlier step after a later one; the series still comes out in step order.
    lines = ['{"stage": "rl", "step": 3, "x": 3}', '{"stage": "rl", "step": 1, "x": 1}',
             '{"stage": "rl", "step": 2, "x": 2}']
    assert plot.parse_metrics(lines) == {"rl": {"x": ([1, 2, 3], [1.0, 2.0, 3.0])}}
    assert plot.parse_metrics(["", "not json", '{"stage": "rl"}', '{"stage": "rl", "step": 1']) == {}


def test_eval_keys_old_and_per_set_forms():
    keys = ["eval/accuracy", "eval/pass@8", "eval/math500/greedy_accuracy", "eval/gsm8k/accuracy",
            "eval/math500/accuracy", "eval/gsm8k/pass@8", "eval/greedy_accuracy", "rollout/reward",
            "eval/accuracy_extra", "train/eval/accuracy"]
    assert plot.eval_keys(keys) == [
        ("eval/accuracy", "", "sampled"),
        ("eval/greedy_accuracy", "", "greedy"),
        ("eval/gsm8k/accuracy", "gsm8k", "sampled"),
        ("eval/math500/accuracy", "math500", "sampled"),
        ("eval/math500/greedy_accuracy", "math500", "greedy"),
    ]


def test_moving_average_by_hand():
    assert plot.moving_average([1.0, 2.0, 3.0, 4.0, 5.0], 3) == [1.0, 1.5, 2.0, 3.0, 4.0]
    assert plot.moving_average([1.0, 2.0], 1) == [1.0, 2.0]
    out = plot.moving_average([math.nan, 2.0, math.nan, 4.0], 2)  # NaNs are left out of each window
    assert math.isnan(out[0]) and out[1:] == [2.0, 2.0, 4.0]
    assert [plot.smoothing_window(n) for n in (5, 20, 200, 5000)] == [1, 2, 20, 50]


def test_panels_are_the_ones_with_data():
    rl_only = {"rl": {"rollout/reward": ([1], [0.5]), "train/kl": ([1], [0.1])}}
    assert plot.panels(rl_only) == ["Reward", "Mismatch and KL"]
    warm_only = {"dsa_warmup": {"train/indexer_kl": ([1], [0.1])}, "sft": {"train/lr": ([1], [0.1])}}
    assert plot.panels(warm_only) == ["Warm-up stages"]
    assert plot.panels({"sft": {"train/lr": ([1], [1e-3])}}) == []


def test_metrics_path(tmp_path):
    assert plot.metrics_path(str(tmp_path)) == os.path.join(str(tmp_path), "metrics.jsonl")
    assert plot.metrics_path("runs/x/metrics.jsonl") == "runs/x/metrics.jsonl"


def synthetic_run(run_dir, rl_steps=12):
    """A small run of every stage: what train.py writes, with a cut last line and a resumed stretch."""
    rows = [{"stage": "dsa_warmup", "step": s, "global_step": s, "train/indexer_kl": 1.0 / s} for s in range(1, 5)]
    rows += [{"stage": "sft", "step": s, "global_step": 4 + s, "train/loss": 5.0 / s, "train/indexer_kl": 0.1 / s}
             for s in range(1, 7)]
    rows.append({"stage": "rl", "step": 0, "global_step": 10, "eval/gsm8k/accuracy": 0.1,
                 "eval/gsm8k/greedy_accuracy": 0.4})
    for s in range(1, rl_steps + 1):
        row = {"stage": "rl", "step": s, "global_step": 10 + s, "time/elapsed_s": 2.0 * s,
               "rollout/reward": 0.1 + 0.05 * s, "train/mismatch_k3": 1e-4 * s, "train/kl": 1e-3 * s,
               "train/skipped": float(s == 5), "train/skipped_steps": float(s >= 5), "perf/step_s": 2.0,
               "perf/learner_wait_s": 0.2, "perf/generator_idle": 0.3}
        if s % 4 == 0:
            row |= {"eval/gsm8k/accuracy": 0.1 + 0.02 * s, "eval/gsm8k/greedy_accuracy": 0.4 + 0.01 * s}
        rows.append(row)
    lines = [json.dumps(r) for r in rows]
    lines += lines[-3:]  # a resume redoing the last steps
    lines.append(json.dumps(rows[-1])[:30])  # cut short by a kill
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.write("\n".join(lines))
    return run_dir


def run_cli(*args, block_matplotlib=False):
    """python -m machinery.plot ARGS in a subprocess. block_matplotlib: as if it were not installed, by a None in
    sys.modules, which makes `import matplotlib` raise ModuleNotFoundError the way a missing package does."""
    if block_matplotlib:
        code = ("import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = ['plot', *sys.argv[1:]]; "
                "runpy.run_module('machinery.plot', run_name='__main__')")
        cmd = [sys.executable, "-c", code, *args]
    else:
        cmd = [sys.executable, "-m", "machinery.plot", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_without_matplotlib_one_line_error(tmp_path):
    run_dir = synthetic_run(str(tmp_path / "run"))
    p = run_cli(run_dir, block_matplotlib=True)
    assert p.returncode == 1
    assert p.stderr == 'error: plotting needs matplotlib: pip install -e ".[plot]"\n'
    assert p.stdout == ""
    assert not os.path.exists(os.path.join(run_dir, "curves.png"))


@pytest.mark.parametrize("case", ["missing", "empty", "no_rows", "nothing_to_plot"])
def test_bad_input_one_line_error(tmp_path, case):
    # Checked before matplotlib is imported, so these need no matplotlib either.
    path = tmp_path / "metrics.jsonl"
    if case == "empty":
        path.write_text("")
    elif case == "no_rows":
        path.write_text('{"stage": "rl", "step": 1, "rollout/rew\n')
    elif case == "nothing_to_plot":
        path.write_text('{"stage": "sft", "step": 1, "train/lr": 0.001}\n')
    p = run_cli(str(tmp_path))  # the directory: its metrics.jsonl
    expected = {
        "missing": f"error: {path}: no such file or directory",
        "empty": f'error: {path}: no usable rows (JSON lines with "stage" and "step")',
        "no_rows": f'error: {path}: no usable rows (JSON lines with "stage" and "step")',
        "nothing_to_plot": f"error: {path}: nothing to plot (no reward, eval, mismatch, timing or warm-up metrics)",
    }[case]
    assert (p.returncode, p.stderr, p.stdout) == (1, expected + "\n", "")


def test_writes_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run_dir = synthetic_run(str(tmp_path / "run"))
    plot.main([run_dir])  # default: curves.png in the run directory
    with open(os.path.join(run_dir, "curves.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "Warm-up stages" in capsys.readouterr().out

    out = str(tmp_path / "new" / "dir" / "c.png")  # -o, into a folder that does not exist yet
    plot.main([os.path.join(run_dir, "metrics.jsonl"), "-o", out])
    assert os.path.getsize(out) > 10_000
    plot.main([run_dir, "-o", str(tmp_path)])  # -o, an existing folder: curves.png in it
    assert os.path.getsize(tmp_path / "curves.png") > 10_000

    # Every panel, and with fewer panels another grid; both draw without error.
    series = plot.read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    assert plot.plot(series, str(tmp_path / "all.png")) == [
        "Reward", "Eval accuracy", "Mismatch and KL", "Skipped steps", "Time per RL step", "Warm-up stages"]
    assert plot.plot({"rl": series["rl"]}, str(tmp_path / "rl.png"))[-1] == "Time per RL step"
    assert plot.plot({"sft": series["sft"]}, str(tmp_path / "sft.png")) == ["Warm-up stages"]
