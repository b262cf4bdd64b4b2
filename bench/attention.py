"""
Dense vs DSA attention: forward time and FLOPs of one attention layer's core (after the projections)
over sequence lengths, side by side in one run. Writes a table into docs/benchmarks.md.

    python bench/attention.py                       # CPU: 9B layer shape, 1k..16k
    python bench/attention.py --device cuda         # the same on a GPU (bf16)
    python bench/attention.py --quick               # a few seconds: small shapes (a smoke test)

Dense = PyTorch's fused causal SDPA. DSA = lightning indexer scores + top-k selection + sparse
attention over the selected keys (dsa.py, plain PyTorch: no custom kernel).
FLOPs count multiply-adds x2 over the causal triangle: dense 4*H*D*T^2/2, indexer 2*H_I*d_I*T^2/2,
sparse 4*H*D*T*min(k, t+1).
"""
import argparse
import os
import platform
import re
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dsa  # noqa: E402
from model import AttnMask  # noqa: E402


def timed(fn, device, repeat):
    fn()  # warm-up (allocations, kernel selection)
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def machine(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = re.search(r"model name\s*:\s*(.*)", f.read()).group(1)
    except (OSError, AttributeError):
        pass
    return f"{cpu}, {torch.get_num_threads()} threads"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--index-heads", type=int, default=8)
    ap.add_argument("--index-dim", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="small shapes, seconds (smoke test)")
    ap.add_argument("--out", default="docs/benchmarks.md", help="markdown file to update ('' to skip)")
    args = ap.parse_args()
    if args.quick:
        args.lengths, args.heads, args.head_dim, args.topk, args.repeat = "256,512,1024", 8, 64, 128, 2
        args.out = ""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    H, Hkv, D, Hi, d = args.heads, args.kv_heads, args.head_dim, args.index_heads, args.index_dim
    scale = D ** -0.5
    torch.manual_seed(0)

    rows = []
    for T in map(int, args.lengths.split(",")):
        q = torch.randn(1, T, H, D, device=device, dtype=dtype)
        k, v = torch.randn(1, T, Hkv, D, device=device, dtype=dtype), torch.randn(1, T, Hkv, D, device=device, dtype=dtype)
        iq, iw = torch.randn(1, T, Hi, d, device=device, dtype=dtype), torch.randn(1, T, Hi, device=device, dtype=dtype)
        ik = torch.randn(1, T, d, device=device, dtype=dtype)
        mask = AttnMask(torch.arange(T, device=device), T)

        def dense():
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True, scale=scale, enable_gqa=True)

        def index():
            return dsa.select_topk(iq, iw, ik, mask, args.topk)

        idx, valid = index()

        def sparse():
            return dsa.sparse_attention(q, k, v, idx, valid, scale)

        with torch.no_grad():
            t_dense, t_index, t_sparse = (timed(f, device, args.repeat) for f in (dense, index, sparse))
        visible = sum(min(args.topk, t + 1) for t in range(T))
        f_dense = 4 * H * D * T * (T + 1) / 2
        f_dsa = 2 * Hi * d * T * (T + 1) / 2 + 4 * H * D * visible
        t_dsa = t_index + t_sparse
        rows.append((T, t_dense, t_index, t_sparse, t_dsa, t_dense / t_dsa, f_dense, f_dsa))
        print(f"T={T:6d}  dense {t_dense * 1e3:9.1f} ms  DSA {t_dsa * 1e3:9.1f} ms "
              f"(indexer {t_index * 1e3:.1f} + sparse {t_sparse * 1e3:.1f})  speed-up {t_dense / t_dsa:5.2f}x  "
              f"FLOPs dense/DSA {f_dense / f_dsa:5.2f}x", flush=True)

    wins = [r[0] for r in rows if r[5] > 1]
    crossover = f"DSA is faster from T = {wins[0]}" if wins else "DSA was not faster at any measured length"
    cmd = "python bench/attention.py " + " ".join(sys.argv[1:])
    table = [
        f"### Attention forward, dense vs DSA ({machine(device)})",
        "",
        f"Command: `{cmd.strip()}`. One layer's attention core, batch 1, {str(dtype).removeprefix('torch.')}, "
        f"{H} heads x {D} (GQA {Hkv} KV heads), top-k {args.topk}, indexer {Hi} heads x {d}; median of "
        f"{args.repeat} runs after a warm-up. {crossover}; at T = {rows[-1][0]} DSA takes "
        f"{1 / rows[-1][5]:.2f}x the dense time ({rows[-1][5]:.2f}x speed-up) and "
        f"{rows[-1][7] / rows[-1][6]:.2f}x its FLOPs.",
        "",
        "| T | dense ms | DSA ms | indexer+top-k ms | sparse attn ms | speed-up | dense GFLOP | DSA GFLOP |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ] + [f"| {T} | {td * 1e3:.1f} | {ta * 1e3:.1f} | {ti * 1e3:.1f} | {ts * 1e3:.1f} | {sp:.2f}x | "
         f"{fd / 1e9:.1f} | {fa / 1e9:.1f} |" for T, td, ti, ts, ta, sp, fd, fa in rows]
    print("\n".join(table))
    if args.out:
        write_section(args.out, f"attention-{device.type}", "\n".join(table))


def write_section(path, key, text):
    """Replace (or append) the block between <!-- key --> markers, keeping the rest of the file."""
    begin, end = f"<!-- {key} -->", f"<!-- /{key} -->"
    old = open(path).read() if os.path.exists(path) else "# Benchmarks\n\nEvery table is written by a script in bench/.\n"
    block = f"{begin}\n{text}\n{end}"
    new = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, old, flags=re.S) if begin in old \
        else old.rstrip("\n") + "\n\n" + block + "\n"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(new)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
