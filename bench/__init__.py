"""Scripts that measure what docs/benchmarks.md reports (each says how to run it), and what they share."""
import json


def write_results(args, result, md):
    """--json FILE: the raw result; --md FILE: the markdown table printed (for docs/benchmarks.md)."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md + "\n")


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
