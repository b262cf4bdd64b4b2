"""
Asynchronous vs synchronous RL. Writes its table into docs/benchmarks.md (the engine's generation speed
is bench/engine.py's).

    python bench/async.py                 # a few minutes on 2 CPU cores

`rl`: the tiny default run (configs/tiny_cpu.yaml) with `rollout.max_staleness` 0 (synchronous: the
   generator waits for every update) and 1 (one step off-policy: the next batch is generated while the
   learner trains), same seed and steps, run one after the other: wall-clock per RL step, and the
   fraction of time the generator and the learner each sat idle waiting for the other.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.attention import machine, write_section  # noqa: E402


def rl_part(steps, config):
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        # The warm-up stages once; both RL runs start from the same checkpoint.
        warm = os.path.join(tmp, "warm")
        subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config", config, f"run_dir={warm}",
                        "train.rl_steps=0"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        start = sorted(os.listdir(os.path.join(warm, "checkpoints")))[-1]
        for staleness in (0, 1):
            run_dir = os.path.join(tmp, f"staleness{staleness}")
            cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", config, f"run_dir={run_dir}",
                   f"model.path={os.path.join(warm, 'checkpoints', start)}", "model.init=null",
                   "train.dsa_warmup_steps=0", "train.sft_steps=0", f"rollout.max_staleness={staleness}",
                   f"train.rl_steps={steps}", "train.eval_every=0"]
            subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            with open(os.path.join(run_dir, "metrics.jsonl")) as f:
                lines = [json.loads(line) for line in f]
            rl = [m for m in lines if m.get("stage") == "rl" and "perf/step_s" in m][1:]  # step 1 waits for batch 0
            step_s = statistics.median(m["perf/step_s"] for m in rl)
            learner_idle = sum(m["perf/learner_wait_s"] for m in rl) / sum(m["perf/step_s"] for m in rl)
            rows.append((staleness, len(rl), step_s, rl[-1]["perf/generator_idle"], learner_idle))
            print(f"max_staleness {staleness}: {step_s:.2f} s/step, generator idle {rows[-1][3]:.0%}, "
                  f"learner idle {rows[-1][4]:.0%}", flush=True)
    speedup = rows[0][2] / rows[1][2]
    return "\n".join([
        f"### Async vs sync RL, tiny default ({machine(torch.device('cpu'))})",
        "",
        f"Command: `python bench/async.py --part rl --steps {steps}` ({config} after its warm-up stages, "
        f"{steps} RL steps each, "
        f"median step time excluding the first; the learner's idle time is its wait for a batch, the "
        f"generator's its wait on the staleness gate). One step off-policy (`max_staleness: 1`) runs "
        f"{speedup:.2f}x as many RL steps per second as synchronous (`max_staleness: 0`).",
        "",
        "| max_staleness | RL steps | s / step | generator idle | learner idle |",
        "|---:|---:|---:|---:|---:|",
    ] + [f"| {s} | {n} | {t:.2f} | {g:.0%} | {l:.0%} |" for s, n, t, g, l in rows])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["rl"], default="rl")
    ap.add_argument("--config", default="configs/tiny_cpu.yaml")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default="docs/benchmarks.md")
    args = ap.parse_args()
    table = rl_part(args.steps, args.config)
    print(table)
    if args.out:
        write_section(os.path.join(ROOT, args.out), "async-rl", table)

if __name__ == "__main__":
    main()
