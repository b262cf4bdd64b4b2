"""
On-policy distillation against GRPO on the default task. Runs (one after the other, never two at once: each uses
every core) and tabulates:

    python bench/distill.py --runs runs/distill --write     # ~9 runs of the default config, ~6 minutes each on 2 cores

The teacher is the default run after its RL stage (`python train.py seed=0`, configs/tiny_cpu.yaml); each student is
the same config run again from scratch (its own warm-ups, then 250 RL steps) with seed s and

    distill   distill.teacher=<the teacher's last checkpoint>                       distillation alone
    both      distill.teacher=<...> distill.outcome=true                            distillation + GRPO's advantage
    grpo      (nothing)                                                             GRPO alone (seed 0: the teacher run)

Read from each run's metrics.jsonl: held-out sampled accuracy (eval/synthetic/accuracy, 94 problems x 8 samples at
T = 2.0) at RL steps 0, 100 and 250, greedy accuracy at the end, and the first eval (every 25 RL steps) at or above
90% of the teacher's final sampled accuracy: its RL step, and the seconds the RL stage took to get there
(time/elapsed_s at that eval minus at RL step 0: the warm-ups are the same for every mode). --write puts the table
in docs/benchmarks.md (the README links to it).
"""
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench import demo_args, finished, run_once  # noqa: E402
from bench import metrics_rows as rows  # noqa: E402
from bench.attention import machine, write_section  # noqa: E402

MODES = {"distill": "distillation alone", "both": "distillation + GRPO", "grpo": "GRPO alone"}
ACC, GREEDY = "eval/synthetic/accuracy", "eval/synthetic/greedy_accuracy"


def teacher_checkpoint(runs):
    root = os.path.join(runs, "teacher_s0", "checkpoints")
    return os.path.join(root, sorted(os.listdir(root))[-1])


def runs_dir(runs, seed, mode):
    return os.path.join(runs, "teacher_s0" if (seed, mode) == (0, "grpo") else f"s{seed}_{mode}")


def curve(run_dir):
    rl = [r for r in rows(run_dir) if r["stage"] == "rl"]
    evals = {r["step"]: r for r in rl if ACC in r}
    return evals, rl[0]["time/elapsed_s"]


def table(runs, seeds):
    teacher = curve(runs_dir(runs, 0, "grpo"))[0]
    final = teacher[max(teacher)][ACC]
    target = 0.9 * final
    lines = [f"Teacher: the default run, seed 0, after RL: {final:.1%} held-out sampled accuracy (greedy "
             f"{teacher[max(teacher)][GREEDY]:.1%}); 90% of it: **{target:.1%}**. Students: the same config from scratch.",
             "",
             "| seed | student | held-out sampled, RL step 0 -> 100 -> 250 | greedy at 250 | reaches 90% of the teacher at RL step | RL seconds to get there | RL stage, s | distill_kl, first -> last 10 steps |",
             "| ---: | --- | --- | ---: | ---: | ---: | ---: | --- |"]
    summary = {m: [] for m in MODES}
    for seed in seeds:
        for mode, name in MODES.items():
            d = runs_dir(runs, seed, mode)
            if not finished(d):
                continue
            evals, t0 = curve(d)
            last = max(evals)
            hit = next((s for s in sorted(evals) if evals[s][ACC] >= target), None)  # the first eval at the target
            secs = evals[hit]["time/elapsed_s"] - t0 if hit is not None else None
            stage = evals[last]["time/elapsed_s"] - t0
            kl = [r["train/distill_kl"] for r in rows(d) if "train/distill_kl" in r]
            kl_text = f"{statistics.mean(kl[:10]):.3f} -> {statistics.mean(kl[-10:]):.3f}" if kl else "-"
            lines.append(f"| {seed} | {name} | {evals[0][ACC]:.1%} -> {evals[100][ACC]:.1%} -> **{evals[last][ACC]:.1%}** | "
                         f"{evals[last][GREEDY]:.1%} | {hit if hit is not None else 'not reached'} | "
                         f"{'-' if secs is None else f'{secs:.0f}'} | {stage:.0f} | {kl_text} |")
            summary[mode].append((evals[last][ACC], evals[last][GREEDY], hit, secs, stage))
    for mode, name in MODES.items():
        if not (got := summary[mode]):
            continue
        hits = [g[2] for g in got if g[2] is not None]
        secs = [g[3] for g in got if g[3] is not None]
        mean = lambda i: statistics.mean(g[i] for g in got)  # noqa: E731
        lines.append(f"| mean ({len(got)}) | {name} | **{mean(0):.1%}** at 250 | {mean(1):.1%} | {len(hits)} of {len(got)} "
                     f"reach it{f', at step {statistics.mean(hits):.0f} on average' if hits else ''} | "
                     f"{f'{statistics.mean(secs):.0f}' if secs else '-'} | {mean(4):.0f} | |")
    return "\n".join(lines)


def main():
    args = demo_args(__doc__, os.path.join(ROOT, "runs", "distill"))
    if not args.table_only:
        run_once(runs_dir(args.runs, 0, "grpo"), "seed=0")  # the teacher
        teacher = teacher_checkpoint(args.runs)
        for seed in args.seeds:
            for mode in MODES:
                extra = {"distill": [f"distill.teacher={teacher}"], "grpo": [],
                         "both": [f"distill.teacher={teacher}", "distill.outcome=true"]}[mode]
                run_once(runs_dir(args.runs, seed, mode), f"seed={seed}", *extra)
    text = table(args.runs, args.seeds)
    print(text)
    if args.write:
        write_section(os.path.join(ROOT, "docs", "benchmarks.md"), "distill", "\n".join([
            f"### On-policy distillation vs GRPO, the default task ({machine(torch.device('cpu'))})", "",
            f"Command: `python bench/distill.py --runs runs/distill --write` (the runs one after the other; "
            f"this file's docstring says what each is).", "", text]))


if __name__ == "__main__":
    main()
