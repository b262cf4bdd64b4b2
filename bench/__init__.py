"""Scripts that measure what docs/benchmarks.md reports (each says how to run it), and what they share."""
import json
import os
import shutil
import subprocess
import sys


def write_results(args, result, md):
    """--json FILE: the raw result; --md FILE: the markdown table printed (for docs/benchmarks.md)."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md + "\n")


def op_count():
    """A context that counts the ATen ops run inside it (.ops): each one a call from Python into a kernel (a launch
    on a GPU, where the host's time per op is what a CPU-bound forward pays). Made on first use: importing this
    package needs no torch."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCount(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    return OpCount()


def profile_to(path, fn, rows=40):
    """Run fn() once under torch.profiler and write its ops, most device time first (CUDA where there is one, else CPU),
    to path: where a step's time goes, for a GPU session that has minutes to find out. Returns fn()'s result."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        out = fn()
        if cuda:
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70)
    with open(path, "w") as f:
        f.write(table + "\n")
    return out


# ----------------------------------------------------------------------------- demos: whole runs, one at a time
# (bench/distill.py, bench/moe_demo.py)


def metrics_rows(run_dir):
    """The run's metrics.jsonl rows ([] before it has any)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def finished(run_dir):
    """Whether the run's last row is its final RL step's (the one with the last eval's greedy accuracy)."""
    rows = metrics_rows(run_dir)
    return bool(rows) and rows[-1]["stage"] == "rl" and "eval/synthetic/greedy_accuracy" in rows[-1]


def run_once(run_dir, *args):
    """`python train.py ARGS run_dir=RUN_DIR`, timed by /usr/bin/time -v where there is one (its output, with the
    run's, in RUN_DIR.log), unless RUN_DIR already holds a finished run; an unfinished one is started over."""
    if finished(run_dir):
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(run_dir)), exist_ok=True)  # --runs may not exist yet
    timer = ["/usr/bin/time", "-v"] if os.path.exists("/usr/bin/time") else []
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [*timer, sys.executable, os.path.join(root, "train.py"), *args, f"run_dir={run_dir}"]
    print("$", " ".join(cmd), flush=True)
    with open(run_dir + ".log", "w") as log:
        subprocess.run(cmd, check=True, cwd=root, stdout=log, stderr=subprocess.STDOUT)


def demo_args(doc, default_runs):
    """The command line of a script that runs demo runs one after the other and tabulates them (bench/distill.py,
    bench/moe_demo.py): --runs, --seeds, --table-only, --write."""
    import argparse
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default=default_runs, help="where the runs go (finished ones are kept: a rerun skips them)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--table-only", action="store_true", help="tabulate the finished runs, run nothing")
    ap.add_argument("--write", action="store_true", help="put the table into docs/benchmarks.md")
    return ap.parse_args()
