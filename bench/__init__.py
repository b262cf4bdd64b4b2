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
