"""
The sandboxed PythonMath tool's cost per call: seconds per call of machinery.tools.PythonMath.step on a tool call
whose code imports numpy and sympy inside the sandbox and computes with them, over N calls one after another,
with PythonMath.setup's default limits (a fresh interpreter per call: the imports are paid every call). Prints
the start-up time and the median, min and max per call. For the checkout it lives in.

    python bench/sandbox.py                 # N = 20, about 20 s on 2 CPU cores
    python bench/sandbox.py --n 50 --code "print(1)" --isolation weak
"""
import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # first: this checkout's machinery, not an installed one
from machinery.tools import PythonMath  # noqa: E402

CODE = ("import numpy as np, sympy as sp\nx = sp.symbols('x')\n"
        "print(np.linalg.solve(np.array([[3., 2.], [1., 4.]]), np.array([7., 9.])).tolist(), "
        "sp.solve(x**2 - 7*x + 10, x))")


def main():
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("--n", type=int, default=20, help="calls timed (after one untimed warm-up call)")
    parser.add_argument("--code", default=CODE, help="the tool call's code")
    parser.add_argument("--isolation", default="strict", choices=("strict", "weak"))
    args = parser.parse_args()
    if args.n < 1:
        parser.error(f"--n must be at least 1, got {args.n}")
    started = time.perf_counter()
    PythonMath.setup(isolation=args.isolation)
    setup_s = time.perf_counter() - started
    env = PythonMath({"prompt": "bench", "label": "0"})
    turn = "python\n" + json.dumps({"code": args.code})
    first = env.step(turn)[0][0]["content"]  # warm-up (the page cache); its output is shown once
    seconds = []
    for _ in range(args.n):
        t = time.perf_counter()
        out = env.step(turn)[0][0]["content"]
        seconds.append(time.perf_counter() - t)
        if out != first:
            raise SystemExit(f"bench/sandbox.py: a call's output changed: {first!r} then {out!r}")
    PythonMath.teardown()
    print(f"checkout {ROOT}; setup {setup_s:.2f} s; the tool's output: {first.strip()!r}")
    print(f"seconds per call over {args.n} calls: median {statistics.median(seconds):.3f}, min {min(seconds):.3f}, "
          f"max {max(seconds):.3f}")


if __name__ == "__main__":
    main()
