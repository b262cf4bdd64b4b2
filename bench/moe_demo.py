"""
The tiny MoE demo, routing replay on and off. Runs (one after the other, never two at once: each uses every core)
and tabulates:

    python bench/moe_demo.py --runs runs/moe_demo --write     # 6 runs of configs/tiny_moe_cpu.yaml, ~6 minutes each

Each run is `python train.py --config configs/tiny_moe_cpu.yaml seed=S model.routing_replay=rollout|none`, timed by
/usr/bin/time when it is there (the wall column). Read from each run's metrics.jsonl: held-out sampled accuracy
(94 problems x 8 samples at T = 2.0) at RL steps 0, 100 and 250, greedy accuracy; over the 250 RL steps the mean of
routing/agree (the fraction of (token, MoE layer) pairs whose learner top-k set equals the generator's), of the
learner-generator gap with replay and without (routing/logp_diff_mean_replay, _fresh: on routing_metrics' probe of
up to 32 samples, one of the two from its extra forward) and of each step's worst token's gap (train/logp_diff_max).
--write puts the table in docs/benchmarks.md (the README links to it).
"""
import os
import re
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench import demo_args, finished, run_once  # noqa: E402
from bench import metrics_rows as rows  # noqa: E402
from bench.attention import machine, write_section  # noqa: E402

CONFIG = os.path.join(ROOT, "configs", "tiny_moe_cpu.yaml")
MODES = {"rollout": "replay on", "none": "replay off"}


def table(runs, seeds):
    lines = ["| seed | routing replay | held-out sampled, RL step 0 -> 100 -> 250 | greedy, 0 -> 250 | routing/agree | "
             "gap with replay | gap without | worst token's gap | wall |",
             "| ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    finals = {m: [] for m in MODES}
    for seed in seeds:
        for mode, name in MODES.items():
            d = os.path.join(runs, f"s{seed}_{mode}")
            if not finished(d):
                continue
            rl = [r for r in rows(d) if r["stage"] == "rl"]
            ev = {r["step"]: (r["eval/synthetic/accuracy"], r["eval/synthetic/greedy_accuracy"])
                  for r in rl if "eval/synthetic/accuracy" in r}
            steps, last = [r for r in rl if r["step"] > 0], max(ev)
            mean = lambda key: statistics.mean(r[key] for r in steps)  # noqa: E731
            log = open(d + ".log").read() if os.path.exists(d + ".log") else ""
            wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", log)
            lines.append(f"| {seed} | {name} | {ev[0][0]:.1%} -> {ev[100][0]:.1%} -> **{ev[last][0]:.1%}** | "
                         f"{ev[0][1]:.1%} -> {ev[last][1]:.1%} | {mean('routing/agree'):.3f} | "
                         f"{mean('routing/logp_diff_mean_replay'):.4f} | {mean('routing/logp_diff_mean_fresh'):.4f} | "
                         f"{mean('train/logp_diff_max'):.2f} | {wall.group(1).split('.')[0] if wall else '-'} |")
            finals[mode].append(ev[last])
    for mode, name in MODES.items():
        if finals[mode]:
            lines.append(f"| mean ({len(finals[mode])}) | {name} | **{statistics.mean(f[0] for f in finals[mode]):.1%}** | "
                         f"{statistics.mean(f[1] for f in finals[mode]):.1%} | | | | | |")
    return "\n".join(lines)


def main():
    args = demo_args(__doc__, os.path.join(ROOT, "runs", "moe_demo"))
    if not args.table_only:
        for seed in args.seeds:
            for mode in MODES:
                run_once(os.path.join(args.runs, f"s{seed}_{mode}"), "--config", CONFIG, f"seed={seed}",
                         f"model.routing_replay={mode}")
    text = table(args.runs, args.seeds)
    print(text)
    if args.write:
        write_section(os.path.join(ROOT, "docs", "benchmarks.md"), "moe-demo", "\n".join([
            f"### The tiny MoE demo, routing replay on and off ({machine(torch.device('cpu'))})", "",
            "Command: `python bench/moe_demo.py --runs runs/moe_demo --write` (the runs one after the other; this "
            "file's docstring says what each column is).", "", text]))


if __name__ == "__main__":
    main()
