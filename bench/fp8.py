"""
FP8 generator weights (fp8.py: e4m3 in 128 x 128 blocks, activations in 1 x 128 groups): what they cost in
accuracy, what quantizing a publish costs in time, what they save in bytes, and on CUDA the fp8 GEMM's agreement
with its CPU reference and its speed against a bf16 matmul.

    python bench/fp8.py --device cpu                   # (1) and (2) at GLM-Z1-9B's shapes: about a minute, 2 cores
    python bench/fp8.py --device cpu --small           # small shapes: seconds (bench/gpu.sh --dry runs this)
    python bench/fp8.py --device cuda                  # (1) and (2) on the GPU, and (3)
    python bench/fp8.py --json out.json --md out.md    # also write the results (bench/gpu.sh does)

(1) Quantization error per layer kind, at GLM-Z1-9B-0414's shapes (config.PUBLISHED): q [4096, 4096], k and v
    [256, 4096], o [4096, 4096], gate_up [27392, 4096], down [4096, 13696] (--small: 1/8 of each side, the
    ragged 13696 -> 1712 kept ragged). Weights: normal with std 0.02 (the init), in bf16, as the learner
    publishes them. Random weights have no outliers; a real checkpoint's blocks (an outlier takes its block's
    resolution down) must be checked too (--checkpoint DIR reads the first layer of a real one instead).
    Per kind: the weight's relative Frobenius error |W - deq W| / |W| and its max abs error (against max |W|);
    then the matmul's relative Frobenius error against float64 x W^T on --rows random normal activations
    (bf16): weight-only (x unquantized), w8a8 (fp8.reference_linear: what the generator computes) and, for
    scale, a plain bf16 matmul.
(2) The time of fp8.quantize on --device for one decoder layer's six tensors (the median of --reps), and
    extrapolated to the 40 layers of a publish; the bytes of the generator's weights, bf16 against fp8 +
    scales (fp8.weight_bytes): what the generator holds, and what crosses to it per publish when the
    learner quantizes before sending (fp8.quantized_weights on the learner's side).
(3) CUDA only: per kind, the fp8 paths fp8_linear found working on the device (scaled_mm: torch's cuBLASLt
    block-scaled GEMM; triton: fp8.py's kernel) and fp8_linear itself against fp8.reference_linear on the CPU,
    same bf16 input (max |error| / max |ref| and mean |error| / mean |ref|); then one matmul's time (CUDA events
    around --calls calls, the median of 7) against bf16 F.linear, at decode rows M = 1 .. 256 and prefill
    M = 2048 and 8192 (eager calls: in the engine a decode step replays a CUDA graph, which removes most of
    the launch cost that small M shows here).
CPU timings are only meaningful on an otherwise idle machine: the script prints the threads it used.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # first, before bench/ itself: bench/engine.py must not shadow engine.py
from machinery import config  # noqa: E402
from machinery import fp8  # noqa: E402
from bench import write_results  # noqa: E402
from model import GLM, GLMConfig  # noqa: E402

CFG = GLMConfig.from_hf(config.PUBLISHED["GLM-Z1-9B-0414"])
H, I, HD, KVD = CFG.hidden_size, CFG.intermediate_size, CFG.num_heads * CFG.head_dim, CFG.num_kv_heads * CFG.head_dim
KINDS = {"q": (HD, H), "k": (KVD, H), "v": (KVD, H), "o": (H, HD), "gate_up": (2 * I, H), "down": (H, I)}
HF_NAMES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
            "gate_up": "mlp.gate_up_proj", "down": "mlp.down_proj"}
DECODE = [1, 2, 4, 8, 16, 32, 64, 128, 256]
PREFILL = [2048, 8192]


def shapes(small):
    return {k: (n // 8, k_ // 8) for k, (n, k_) in KINDS.items()} if small else dict(KINDS)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weights(kind, N, K, device, seed, checkpoint=None):
    """The layer kind's weight [N, K] in bf16 on device: random normal (std 0.02), or layer 0's from an HF
    checkpoint directory (GLM-4's names: ours with "model." in front)."""
    if checkpoint is None:
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(N, K, generator=g) * 0.02).to(torch.bfloat16).to(device)
    from safetensors import safe_open
    from model import _safetensors_files
    name = f"model.layers.0.{HF_NAMES[kind]}.weight"
    for file, names in _safetensors_files(checkpoint).items():
        if name in names:
            with safe_open(file, framework="pt") as f:
                return f.get_tensor(name).to(torch.bfloat16).to(device)
    raise KeyError(f"{checkpoint}: no tensor {name}")


def rel_fro(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


@torch.no_grad()
def errors(kinds, device, rows, checkpoint, log):
    """(1): per kind, the weight's and the matmul's errors (relative Frobenius, float64 references)."""
    out = []
    for i, (kind, (N, K)) in enumerate(kinds.items()):
        w = weights(kind, N, K, device, seed=i, checkpoint=checkpoint)
        N, K = w.shape  # (a checkpoint's own)
        q, s = fp8.quantize(w)
        deq = fp8.dequantize(q, s)
        w64 = w.double()
        d = deq.double() - w64
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(100 + i)).to(torch.bfloat16).to(device)
        ref = x.double() @ w64.T  # [rows, N]
        r = dict(kind=kind, shape=[N, K], w_rel_fro=(d.norm() / w64.norm()).item(), w_max_abs=d.abs().max().item(),
                 w_amax=w64.abs().max().item(), weight_only=rel_fro(x.float() @ deq.T, ref),
                 w8a8=rel_fro(fp8.reference_linear(x.float(), q, s), ref), bf16=rel_fro(x @ w.T, ref))
        out.append(r)
        log(f"[fp8] {kind:<8} [{N}, {K}]  weight rel fro {r['w_rel_fro']:.4f}, max abs {r['w_max_abs']:.2e} "
            f"(max |w| {r['w_amax']:.3f}); matmul rel fro: weight-only {r['weight_only']:.4f}, w8a8 {r['w8a8']:.4f}, "
            f"bf16 {r['bf16']:.4f}")
        del w, q, s, deq, w64, d, ref
    return out


@torch.no_grad()
def quantize_time(kinds, device, reps, small, log):
    """(2): fp8.quantize's time per kind and per decoder layer; the bytes of a publish, bf16 vs fp8."""
    per = {}
    for i, (kind, (N, K)) in enumerate(kinds.items()):
        w = weights(kind, N, K, device, seed=i)
        ts = []
        for _ in range(reps):
            sync(device)
            t0 = time.perf_counter()
            fp8.quantize(w)
            sync(device)
            ts.append(time.perf_counter() - t0)
        per[kind] = statistics.median(ts)
        del w
    layer = sum(per.values())
    with torch.device("meta"):
        params = sum(p.numel() for p in GLM(CFG).parameters())
    linear = CFG.num_layers * sum(n * k for n, k in KINDS.values())
    res = dict(per_kind_s=per, layer_s=layer, layers=CFG.num_layers,
               publish_s=None if small else layer * CFG.num_layers,
               bf16_bytes=2 * params, fp8_bytes=fp8.weight_bytes(CFG), linear_params=linear, params=params)
    log(f"[fp8] quantize on {device}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in per.items()) +
        f"; one layer {layer:.3f} s" + ("" if small else f", {CFG.num_layers} layers {layer * CFG.num_layers:.1f} s"))
    log(f"[fp8] GLM-Z1-9B weights: bf16 {res['bf16_bytes'] / 1e9:.2f} GB, fp8 + scales {res['fp8_bytes'] / 1e9:.2f} GB "
        f"({res['fp8_bytes'] / res['bf16_bytes']:.3f}x; decoder linears {linear / params:.1%} of the parameters)")
    return res


def cuda_ms(fn, calls):
    """Median over 7 samples of the time of one call (CUDA events around `calls` calls), after 3 warm-ups."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / calls)
    return statistics.median(ts)


@torch.no_grad()
def gemm(kinds, device, rows, calls, log):
    """(3): each fp8 path against the CPU reference, then its time against bf16 F.linear."""
    paths = fp8._working_paths(device)
    log(f"[fp8] fp8_linear's paths on {device}: {', '.join(paths) or 'none (reference_linear)'}")
    fns = {"fp8_linear": fp8.fp8_linear, "scaled_mm": fp8.scaled_mm_linear, "triton": fp8.triton_linear}
    fns = {n: f for n, f in fns.items() if n == "fp8_linear" or n in paths}
    acc, speed = [], []
    for i, (kind, (N, K)) in enumerate(kinds.items()):
        w = weights(kind, N, K, device, seed=i)
        q, s = fp8.quantize(w)
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(200 + i)).to(torch.bfloat16)
        ref = fp8.reference_linear(x.float(), q.cpu(), s.cpu()).double()  # fp32 on the CPU: no output rounding
        for name, fn in fns.items():
            if name == "scaled_mm" and (N % fp8.BLOCK or K % fp8.BLOCK):
                continue
            d = (fn(x.to(device), q, s).cpu().double() - ref).abs()
            acc.append(dict(kind=kind, path=name, max=(d.max() / ref.abs().max()).item(),
                            mean=(d.mean() / ref.abs().mean()).item()))
            log(f"[fp8] {kind:<8} {name:<10} vs CPU reference: max {acc[-1]['max']:.2e}, mean {acc[-1]['mean']:.2e}")
        for M in DECODE + PREFILL:
            xm = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            n = calls if M <= 256 else 3
            row = dict(kind=kind, M=M, bf16_us=1e3 * cuda_ms(lambda xm=xm, w=w: F.linear(xm, w), n))
            for name, fn in fns.items():
                if name == "scaled_mm" and (N % fp8.BLOCK or K % fp8.BLOCK):
                    continue
                row[name + "_us"] = 1e3 * cuda_ms(lambda fn=fn, xm=xm, q=q, s=s: fn(xm, q, s), n)
            speed.append(row)
            log(f"[fp8] {kind:<8} M {M:>5}: " + ", ".join(f"{k[:-3]} {v:.1f} us" for k, v in row.items()
                                                          if k.endswith("_us")))
        del w, q, s
        torch.cuda.empty_cache()
    return paths, acc, speed


def markdown(res):
    small = res["small"]
    lines = [f"Device: {res['device']}, torch {res['torch']}, {res['threads']} CPU threads; shapes: "
             f"{'small (1/8 of each side of GLM-Z1-9B' + chr(39) + 's)' if small else 'GLM-Z1-9B-0414'}; weights: "
             f"{res['weights']}.", "",
             "| kind | shape | weight rel. Frobenius error | weight max abs error (max abs w) "
             "| matmul error: weight-only | w8a8 (generator) | bf16 matmul |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in res["errors"]:
        lines.append(f"| {r['kind']} | {r['shape'][0]} x {r['shape'][1]} | {r['w_rel_fro']:.4f} | {r['w_max_abs']:.2e} "
                     f"({r['w_amax']:.3f}) | {r['weight_only']:.4f} | {r['w8a8']:.4f} | {r['bf16']:.4f} |")
    qt = res["quantize"]
    lines += ["", f"Matmul errors: relative Frobenius against float64 x W^T, {res['rows']} random normal rows in bf16.",
              "", "| quantize on " + res["device"] + " | " + " | ".join(qt["per_kind_s"]) + " | one layer | "
              + f"{qt['layers']} layers |", "|---|" + "---:|" * (len(qt["per_kind_s"]) + 2),
              "| seconds | " + " | ".join(f"{v:.4f}" for v in qt["per_kind_s"].values()) + f" | {qt['layer_s']:.3f} | "
              + (f"{qt['publish_s']:.1f}" if qt["publish_s"] is not None else "n/a (small shapes)") + " |", "",
              f"GLM-Z1-9B-0414's generator weights: bf16 {qt['bf16_bytes'] / 1e9:.2f} GB, fp8 + scales "
              f"{qt['fp8_bytes'] / 1e9:.2f} GB ({qt['fp8_bytes'] / qt['bf16_bytes']:.3f}x; the decoder linears are "
              f"{qt['linear_params'] / qt['params']:.1%} of the {qt['params'] / 1e9:.2f}B parameters; embeddings and "
              "lm_head stay bf16). A publish moves as many bytes when the learner quantizes before sending."]
    if res.get("gemm") is None:
        lines += ["", "fp8 GEMM on CUDA: not run (--device cpu)."]
        return "\n".join(lines)
    g = res["gemm"]
    lines += ["", f"fp8_linear's paths on {res['device']}: {', '.join(g['paths']) or 'none'}.", "",
              "| kind | path | max abs error / max abs ref | mean abs error / mean abs ref |", "|---|---|---:|---:|"]
    lines += [f"| {a['kind']} | {a['path']} | {a['max']:.2e} | {a['mean']:.2e} |" for a in g["accuracy"]]
    cols = [c for c in ("fp8_linear_us", "scaled_mm_us", "triton_us") if any(c in r for r in g["speed"])]
    lines += ["", "Time of one matmul (us, eager):", "",
              "| kind | M | bf16 | " + " | ".join(c[:-3] for c in cols) + " | bf16 / fp8_linear |",
              "|---|---:|---:|" + "---:|" * len(cols) + "---:|"]
    for r in g["speed"]:
        lines.append(f"| {r['kind']} | {r['M']} | {r['bf16_us']:.1f} | " + " | ".join(
            f"{r[c]:.1f}" if c in r else "" for c in cols) + f" | {r['bf16_us'] / r['fp8_linear_us']:.2f}x |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="1/8 of each side of the 9B shapes: a quick CPU check")
    ap.add_argument("--rows", type=int, default=64, help="activation rows for the matmul errors")
    ap.add_argument("--reps", type=int, default=3, help="quantize timings per tensor (the median is reported)")
    ap.add_argument("--calls", type=int, default=20, help="calls per CUDA timing sample at decode sizes")
    ap.add_argument("--checkpoint", help="an HF directory: (1) on its layer-0 weights instead of random ones")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--md", help="write the markdown tables here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no CUDA device")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    kinds = shapes(args.small)
    log = lambda m: print(m, flush=True)  # noqa: E731
    log(f"[fp8] device {device} ({name}), torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    res = dict(device=f"{device} ({name})", torch=torch.__version__, threads=torch.get_num_threads(), small=args.small,
               rows=args.rows, weights=f"layer 0 of {args.checkpoint}" if args.checkpoint else "normal, std 0.02, bf16")
    res["errors"] = errors(kinds, device, args.rows, args.checkpoint if not args.small else None, log)
    res["quantize"] = quantize_time(kinds, device, args.reps, args.small, log)
    res["gemm"] = None
    if device.type == "cuda":
        paths, acc, speed = gemm(kinds, device, args.rows, args.calls, log)
        res["gemm"] = dict(paths=list(paths), accuracy=acc, speed=speed)
    md = markdown(res)
    print(md, flush=True)
    write_results(args, res, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
