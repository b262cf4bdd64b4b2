"""
The fp8 GEMM's tile table (machinery/fp8.py's TUNED_TILES), measured on a GPU: each launch shape of
fp8.TILE_CANDIDATES timed at the decoder's shapes, checked against the reference, the fastest per key printed and,
with --write, written into the table for this GPU's architecture (issue 48, item 2). CUDA only: on a CPU it refuses
in one line (the interpreter's speed says nothing about a GPU's; tests/test_fp8.py checks every candidate there).

    python bench/fp8_tiles.py                          # every key: prints the table (bench/gpu.sh part 10)
    python bench/fp8_tiles.py --write                  # ... and writes it into machinery/fp8.py (review the diff)
    python bench/fp8_tiles.py --shapes flash --rows 64,256 --json out.json --md out.md
    python bench/fp8_tiles.py --from out.json --write  # any machine: a GPU sweep's JSON (gpu.sh's) into the table

Keys, as fp8.tiles_for looks them up: (kind, row bucket, N, K). `dense` (fp8.triton_linear) at GLM-Z1-9B's linears
(bench/fp8.py's KINDS: q/o [4096, 4096], k/v [256, 4096], gate_up [27392, 4096], down [4096, 13696]) and at
GLM-4.7-Flash's (from its published config, a meta model: MLA's q_a, q_b, kv_a_proj_with_mqa and o_proj, the shared
expert's and the dense first layer's SwiGLU), x of --rows rows; `grouped` (fp8.triton_grouped_linear) at Flash's
routed experts (64 experts: gate_up [3072, 2048] and down [2048, 1536] each), --rows tokens each routed to 4 experts
drawn uniformly (rows x 4 sorted slots; the row bucket is that of an expert's average share, rows x 4 / 64). Rows
64 and 256 are decode steps, 2048 a prefill. A candidate taller than the bucket (BM > max(16, bucket)) only masks
rows: not timed. Weights random normal (std 0.02, bf16) quantized by fp8.quantize, activations bf16 normal.

Timing: CUDA graphs, as the engine's decode replays them: one graph of C back-to-back launches, each on its own copy
of the weight (C copies together at least 4x the L2 cache, C <= 64, so each launch reads its weight from memory as a
decode step's layer does), replayed --reps times, each replay timed with CUDA events; a candidate's time is the median
replay / C. For scale, the same for bf16 F.linear on the bf16 weight (dense keys) and for torch's scaled_mm where
fp8_linear would take it (K and N multiples of 128, sm_90).

Check: each candidate's bf16 output against fp8.reference_linear on the same device in fp32 (same activation codes):
max |y - ref| / max |ref| below fp8.PATH_TOL, the bound fp8_linear's first-use check holds its paths to; a candidate
that fails it, or does not compile or launch here, is reported and never chosen. A key's baseline is what fp8 runs for
it without an entry: scaled_mm where fp8_linear takes it (timed here), else _tiles' rule (always among the
candidates). Its choice is the fastest passing candidate when it beats the baseline by more than --margin, else the
baseline (no entry; so fp8_linear takes the Triton kernel over scaled_mm only where an entry says it measured faster).
--from decides again from the recorded times by today's rule (a sweep from before the "pre" and "swap" modes: its
4-field shapes are "fused" ones).
"""
import argparse
import ast
import json
import math
import os
import re
import statistics
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench import write_results  # noqa: E402
from bench.fp8 import KINDS  # noqa: E402
from families.mla_moe import Experts  # noqa: E402
from machinery import config, fp8  # noqa: E402
from model import GLM, GLMConfig  # noqa: E402

FP8_PY = os.path.join(ROOT, "machinery", "fp8.py")
BEGIN, END = "    # tiles: begin\n", "    # tiles: end\n"  # the table's marker lines in fp8.py


def flash_shapes():
    """GLM-4.7-Flash's quantized matrices, from a 2-layer meta model of its published config (the first layer dense,
    the second MoE): ({(N, K): name} of its linears, {(N, K): name} of one expert's matrices, E, top-k)."""
    cfg = GLMConfig.from_hf(dict(config.PUBLISHED["GLM-4.7-Flash"], num_hidden_layers=2, num_nextn_predict_layers=0))
    with torch.device("meta"):
        model = GLM(cfg)
    dense, grouped = {}, {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and fp8.is_quantized(name + ".weight"):
            dense.setdefault(tuple(m.weight.shape), name.split(".", 2)[2])
        elif isinstance(m, Experts) and fp8.is_quantized(name + ".gate_up_proj"):
            for p in ("gate_up_proj", "down_proj"):
                grouped.setdefault(tuple(getattr(m, p).shape[1:]), "experts." + p)
    return dense, grouped, cfg.moe.n_routed_experts, cfg.moe.num_experts_per_tok


def cases(shapes, rows):
    """[(kind, name, N, K, E or None, top-k or None, rows)] for every shape set in `shapes` and row count."""
    out = []
    if "9b" in shapes:
        seen = {}  # (N, K) -> "9B q, o"
        for kind, nk in KINDS.items():
            seen[nk] = f"{seen[nk]}, {kind}" if nk in seen else f"9B {kind}"
        out += [("dense", name, N, K, None, None, r) for (N, K), name in seen.items() for r in rows]
    if "flash" in shapes:
        dense, grouped, E, k = flash_shapes()
        out += [("dense", f"Flash {name}", N, K, None, None, r) for (N, K), name in dense.items() for r in rows]
        out += [("grouped", f"Flash {name}", N, K, E, k, r) for (N, K), name in grouped.items() for r in rows]
    return out


def graph_us(calls, reps):
    """Microseconds per call: the no-argument functions `calls` (one launch each) run once to warm up (compiles,
    allocations), captured back to back in one CUDA graph, the graph replayed reps times, each replay timed with CUDA
    events; the median replay / len(calls)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in calls:
            f()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in calls:
            f()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(1e3 * a.elapsed_time(b) / len(calls))
    del g
    return statistics.median(ts)


def copies_for(nbytes, device):
    """How many copies of a weight of nbytes make each launch of a graph read its weight from memory, not L2."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return max(1, min(64, math.ceil(4 * l2 / nbytes)))


@torch.no_grad()
def sweep_case(case, device, reps):
    """One key: every candidate checked and timed (graph_us); -> a result dict (see the module docstring)."""
    kind, name, N, K, E, topk, rows = case
    g = torch.Generator().manual_seed(N * 7 + K)
    if kind == "dense":
        M, bucket_rows = rows, rows
        w = (torch.randn(N, K, generator=g) * 0.02).to(torch.bfloat16).to(device)
        q, s = fp8.quantize(w)
        x = torch.randn(M, K, generator=g).to(torch.bfloat16).to(device)
        ref = fp8.reference_linear(x.float(), q, s)
        ends = None
    else:
        M = rows * topk
        bucket_rows = -(-M // E)
        w = (torch.randn(E, N, K, generator=g) * 0.02).to(torch.bfloat16).to(device)
        q, s = fp8.quantize(w)
        del w
        idx = torch.rand(rows, E, generator=g).topk(topk, -1).indices  # [rows, k]: k distinct experts per token
        counts = torch.bincount(idx.flatten(), minlength=E)
        ends = counts.cumsum(0).to(device)
        x = torch.randn(M, K, generator=g).to(torch.bfloat16).to(device)  # the sorted slots' rows
        starts = [0] + ends[:-1].tolist()
        ref = torch.cat([fp8.reference_linear(x[a:b].float(), q[e], s[e])
                         for e, (a, b) in enumerate(zip(starts, ends.tolist()))])
    n = copies_for(q.numel(), device)
    qs = [(q, s)] + [(q.clone(), s.clone()) for _ in range(n - 1)]
    bucket = fp8._row_bucket(bucket_rows)
    res = dict(kind=kind, name=name, N=N, K=K, rows=rows, M=M, bucket=bucket, copies=n, candidates={},
               fallback=list(fp8._tiles(bucket_rows)))

    def run(qq, ss, tiles):
        if kind == "dense":
            return fp8.triton_linear(x, qq, ss, tiles=tiles)
        return fp8.triton_grouped_linear(x, qq, ss, ends, tiles=tiles)

    for c in fp8.TILE_CANDIDATES:
        if c[0] > max(16, bucket):
            continue
        key = key_of(c)
        try:
            y = run(q, s, c).float()
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            us = graph_us([lambda qq=qq, ss=ss: run(qq, ss, c) for qq, ss in qs], reps) if err < fp8.PATH_TOL else None
            res["candidates"][key] = dict(err=err, us=us)
        except Exception as e:  # noqa: BLE001 - a shape this GPU cannot compile or launch: reported, not chosen
            res["candidates"][key] = dict(err=None, us=None, error=f"{type(e).__name__}: {str(e)[:120]}")
    if kind == "dense":
        wb = [w] + [w.clone() for _ in range(n - 1)]
        res["bf16_us"] = graph_us([lambda ww=ww: F.linear(x, ww) for ww in wb], reps)
        if "scaled_mm" in fp8._working_paths(device) and N % fp8.BLOCK == 0 and K % fp8.BLOCK == 0:
            res["scaled_mm_us"] = graph_us([lambda qq=qq, ss=ss: fp8.scaled_mm_linear(x, qq, ss) for qq, ss in qs], reps)
        del wb
    del qs, q, s
    torch.cuda.empty_cache()
    return res


def key_of(tiles) -> str:
    """A launch shape's key in the results: "16,64,4,3,swap"."""
    return ",".join(map(str, tiles))


def tiles_of(key: str) -> tuple:
    """key_of's inverse; a 4-field key (a sweep from before fp8.MODES) is a "fused" one."""
    parts = key.split(",")
    if parts[-1].isdigit():
        parts.append("fused")
    return (*map(int, parts[:-1]), parts[-1])


def baseline(res):
    """What fp8 runs for the key without a table entry: "scaled_mm" (fp8_linear's choice where it runs, timed here),
    else _tiles' rule (a launch shape)."""
    return "scaled_mm" if res.get("scaled_mm_us") is not None else tiles_of(key_of(res["fallback"]))


def decide(res, margin):
    """The key's choice into res (choice, baseline_us, choice_us): the fastest passing candidate (a launch shape, or
    "scaled_mm" where it is the baseline) when it beats the baseline by more than margin, else the baseline. From the
    recorded times, so a sweep's JSON is decided by today's rule (--from)."""
    timed = {tiles_of(k): v["us"] for k, v in res["candidates"].items() if v["us"] is not None}
    base = baseline(res)
    if base == "scaled_mm":
        timed[base] = res["scaled_mm_us"]
    pick = base
    if base in timed:
        best = min(timed, key=timed.get)
        pick = best if timed[best] < timed[base] * (1 - margin) else base
    res["choice"] = pick if pick == "scaled_mm" else list(pick)
    res["baseline_us"], res["choice_us"] = timed.get(base), timed.get(pick)
    return pick


def table_text(table, notes):
    """The lines between fp8.py's markers for {arch: {key: tiles}} with a note per arch."""
    lines = []
    for arch in sorted(table):
        lines.append(f"    {arch!r}: {{  # {notes.get(arch, '')}".rstrip().replace("'", '"') + "\n")
        for key in sorted(table[arch]):
            lines.append(f"        {key!r}: {table[arch][key]!r},".replace("'", '"') + "\n")
        lines.append("    },\n")
    return "".join(lines)


def write_table(path, arch, chosen, note):
    """Rewrite the table between path's markers: arch's measured keys {key: (choice, baseline)} set to their choice (an
    entry where it is not the baseline, none where it is), its other keys and every other architecture's entries (and
    notes) kept."""
    with open(path) as f:
        text = f.read()
    head, rest = text.split(BEGIN, 1)
    block, tail = rest.split(END, 1)
    table = ast.literal_eval("{" + block + "}")
    notes = dict(re.findall(r'^    "(\w+)": \{  # (.*)$', block, re.M))
    mine = dict(table.get(arch, {}))
    for key, (tiles, base) in chosen.items():
        if tiles != base:  # (never "scaled_mm": only a baseline is)
            mine[key] = tuple(tiles)
        else:
            mine.pop(key, None)
    table[arch], notes[arch] = mine, note
    table = {a: t for a, t in table.items() if t}
    with open(path, "w") as f:
        f.write(head + BEGIN + table_text(table, notes) + END + tail)
    return table


def markdown(res):
    lines = [f"Device: {res['device']} ({res['arch']}), torch {res['torch']}, triton {res['triton']}. Time of one call "
             f"(us): CUDA graphs of back-to-back calls, each on its own weight copy, median of {res['reps']} replays; "
             f"choice: the fastest candidate within fp8.PATH_TOL when it beats the baseline (what runs without an entry: "
             f"scaled_mm where fp8_linear takes it, else _tiles' rule) by > {res['margin']:.0%}.",
             "", "| kind | weight | N x K | rows | bucket | baseline (us) | choice (us) | speed-up | bf16 F.linear (us) "
             "| scaled_mm (us) | candidates ok |", "|---|---|---|---:|---:|---|---|---:|---:|---:|---:|"]
    shape = lambda t: t if t == "scaled_mm" else tuple(t)  # noqa: E731
    for r in res["keys"]:
        ok = sum(v["us"] is not None for v in r["candidates"].values())
        fb, best = r["baseline_us"], r["choice_us"]
        lines.append(f"| {r['kind']} | {r['name']} | {r['N']} x {r['K']} | {r['rows']} | {r['bucket']} | "
                     f"{shape(baseline(r))} {fb or float('nan'):.1f} | {shape(r['choice'])} {best or float('nan'):.1f}"
                     f" | {fb / best if fb and best else float('nan'):.2f}x | {r.get('bf16_us', float('nan')):.1f} | "
                     f"{r.get('scaled_mm_us', float('nan')):.1f} | {ok} of {len(r['candidates'])} |")
    bad = [f"{r['kind']} {r['name']} rows {r['rows']}: ({k}) " + (v.get("error") or f"error {v['err']:.1e}")
           for r in res["keys"] for k, v in r["candidates"].items() if v["us"] is None]
    if bad:
        lines += ["", "Candidates not chosen (failed the check or to run):", ""] + [f"- {b}" for b in bad]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="9b,flash", help="comma-separated: 9b (GLM-Z1-9B's linears), flash")
    ap.add_argument("--rows", default="64,256,2048", help="comma-separated row counts (tokens)")
    ap.add_argument("--reps", type=int, default=7, help="graph replays per candidate (the median is kept)")
    ap.add_argument("--margin", type=float, default=0.03, help="how much faster than the baseline a choice must be")
    ap.add_argument("--write", action="store_true", help="write the choices into machinery/fp8.py's TUNED_TILES")
    ap.add_argument("--from", dest="source", help="a sweep's --json output: its choices, no sweep (no CUDA needed)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--md", help="write the markdown table here")
    args = ap.parse_args(argv)
    if args.source:
        with open(args.source) as f:
            res = json.load(f)
        for r in res["keys"]:
            decide(r, res["margin"])
        print(markdown(res), flush=True)
        return write(res, args.write)
    if not torch.cuda.is_available():
        print("[fp8_tiles] needs CUDA: it times the fp8 kernel's tile shapes on a GPU (torch sees none)", flush=True)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    import triton
    shapes, rows = args.shapes.split(","), [int(r) for r in args.rows.split(",")]
    arch = fp8._arch(device)
    log = lambda m: print(m, flush=True)  # noqa: E731
    res = dict(device=torch.cuda.get_device_name(device), arch=arch, torch=torch.__version__, triton=triton.__version__,
               reps=args.reps, margin=args.margin, keys=[])
    log(f"[fp8_tiles] {res['device']} ({arch}), torch {res['torch']}, triton {res['triton']}; "
        f"{len(fp8.TILE_CANDIDATES)} candidates; fp8_linear's paths: {', '.join(fp8._working_paths(device))}")
    for case in cases(shapes, rows):
        r = sweep_case(case, device, args.reps)
        tiles = decide(r, args.margin)
        res["keys"].append(r)
        log(f"[fp8_tiles] {r['kind']:<7} {r['name']:<28} [{r['N']}, {r['K']}] rows {r['rows']:>5} (bucket "
            f"{r['bucket']}): baseline {baseline(r)} {r['baseline_us'] or float('nan'):.1f} us, choice "
            f"{tiles} {r['choice_us'] or float('nan'):.1f} us; bf16 {r.get('bf16_us', float('nan')):.1f} us")
    md = markdown(res)
    print(md, flush=True)
    write_results(args, res, md)
    return write(res, args.write)


def write(res, really):
    """--write: a sweep's choices (res, as main builds it or its JSON) into fp8.py's table for its architecture."""
    if really:
        chosen = {(r["kind"], r["bucket"], r["N"], r["K"]): (decide(r, res["margin"]), baseline(r)) for r in res["keys"]}
        note = f"{res['device']}, torch {res['torch']}, triton {res['triton']}: bench/fp8_tiles.py"
        table = write_table(FP8_PY, res["arch"], chosen, note)
        print(f"[fp8_tiles] wrote {len(table.get(res['arch'], {}))} {res['arch']} entries into {FP8_PY}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
