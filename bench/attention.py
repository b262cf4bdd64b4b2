"""
Dense vs DSA attention: time and FLOPs of one attention layer's core (after the projections) over
sequence lengths, side by side in one run. Writes a table into docs/benchmarks.md.

    python bench/attention.py                       # CPU: 9B layer shape, 1k..16k, dsa.py's PyTorch DSA
    python bench/attention.py --quick               # a few seconds: small shapes (a smoke test)
    python bench/attention.py --device cuda         # GPU, bf16: the Triton kernels (dsa_triton.py), 8k..128k,
                                                    # forward and forward+backward; --write to update the docs
    python bench/attention.py --device cuda --kernels torch     # GPU, dsa.py's PyTorch DSA (forward)
    TRITON_INTERPRET=1 python bench/attention.py --kernels triton --quick   # the Triton path on CPU, tiny

Dense = PyTorch's fused causal SDPA (flash on a GPU). DSA = lightning indexer scores + top-k selection +
sparse attention over the selected keys: dsa.py (plain PyTorch) or dsa_triton.py (Triton kernels for the
scores and the sparse attention, torch.topk in between, with dsa.py's tie-free keys).
FLOPs count multiply-adds x2 over the causal triangle: dense 4*H*D*T^2/2, indexer 2*H_I*d_I*T^2/2,
sparse 4*H*D*T*min(k, t+1); a backward counts 2.5x its forward (5 matmuls instead of 2), and the
indexer has none (top-k is not differentiable; the indexer trains only through its own KL loss).
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
    ap.add_argument("--kernels", choices=("auto", "torch", "triton"), default="auto",
                    help="DSA implementation: dsa.py (torch) or dsa_triton.py (triton); auto: triton on cuda")
    ap.add_argument("--lengths", default=None, help="comma-separated T (default 1k..16k; triton: 8k..128k)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--index-heads", type=int, default=None, help="default 8 (torch) / DSAConfig's 32 (triton)")
    ap.add_argument("--index-dim", type=int, default=None, help="default 64 (torch) / DSAConfig's 128 (triton)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="small shapes, seconds (smoke test)")
    ap.add_argument("--out", default="docs/benchmarks.md", help="markdown file to update ('' to skip)")
    ap.add_argument("--write", action="store_true", help="triton mode: write its table into --out")
    args = ap.parse_args()
    if args.kernels == "auto":
        args.kernels = "triton" if args.device.startswith("cuda") else "torch"
    if args.kernels == "triton":
        return triton_main(args)
    args.lengths = args.lengths or "1024,2048,4096,8192,16384"
    args.index_heads = args.index_heads or 8
    args.index_dim = args.index_dim or 64
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


def triton_select_topk(iq, iw, ik, topk, chunk):
    """dsa.select_topk for a causal mask with dsa_triton's scores: the same chunking over queries (larger
    chunks: no [B, c, H_I, Tk] intermediate), keys after the chunk's last query skipped, the same
    tie-free torch.topk. Returns idx, valid [B, T, K] and the seconds spent in the scores kernel."""
    from kernels import dsa_triton
    B, T = iq.shape[:2]
    K = min(topk, T)
    idx = torch.zeros(B, T, K, dtype=torch.long, device=iq.device)
    valid = torch.zeros(B, T, K, dtype=torch.bool, device=iq.device)
    slots = torch.arange(T, device=iq.device)
    for q0 in range(0, T, chunk):
        q1 = min(T, q0 + chunk)
        s = dsa_triton.index_scores(iq[:, q0:q1], iw[:, q0:q1], ik[:, :q1], q_slot=slots[q0:q1])
        chosen = dsa._tie_broken(s).topk(min(K, q1), dim=-1).indices
        idx[:, q0:q1, :chosen.shape[-1]] = chosen
        valid[:, q0:q1, :chosen.shape[-1]] = s.gather(-1, chosen) > float("-inf")
    return idx, valid


def triton_main(args):
    """Dense causal SDPA vs DSA on dsa_triton's kernels: forward, and forward + backward (q, k, v)."""
    from kernels import dsa_triton
    if args.quick:  # tiny: also runs on CPU under TRITON_INTERPRET=1 (the interpreter is slow)
        args.lengths, args.heads, args.kv_heads, args.head_dim, args.topk = "64,128", 4, 2, 16, 32
        args.index_heads, args.index_dim, args.repeat = 2, 16, 1
    args.lengths = args.lengths or "8192,16384,32768,65536,131072"
    args.index_heads = args.index_heads or dsa.DSAConfig().heads
    args.index_dim = args.index_dim or dsa.DSAConfig().head_dim
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if not dsa_triton.available(torch.empty(0, device=device)):
        sys.exit(f"dsa_triton cannot run on {device} (needs triton and CUDA, or TRITON_INTERPRET=1 on cpu)")
    H, Hkv, D, Hi, d, topk = args.heads, args.kv_heads, args.head_dim, args.index_heads, args.index_dim, args.topk
    scale = D ** -0.5
    torch.manual_seed(0)

    rows = []
    for n, T in enumerate(map(int, args.lengths.split(","))):
        def rnd(*shape):
            return torch.randn(*shape, device=device, dtype=dtype)
        q, k, v, dout = rnd(1, T, H, D), rnd(1, T, Hkv, D), rnd(1, T, Hkv, D), rnd(1, T, H, D)
        iq, ik = rnd(1, T, Hi, d), rnd(1, T, d)
        iw = torch.randn(1, T, Hi, device=device) * Hi ** -0.5  # fp32, as Indexer.forward returns it
        chunk = max(1, (1 << 28) // T)  # queries per top-k chunk: 1 GiB of fp32 scores, 2 GiB of int64 keys
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        sel = {}

        def dense():
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True, scale=scale, enable_gqa=True)

        def dense_train():
            qg.grad = kg.grad = vg.grad = None
            F.scaled_dot_product_attention(qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2),
                                           is_causal=True, scale=scale, enable_gqa=True).backward(dout.transpose(1, 2))

        def scores():
            for q0 in range(0, T, chunk):
                dsa_triton.index_scores(iq[:, q0:q0 + chunk], iw[:, q0:q0 + chunk], ik[:, :q0 + chunk],
                                        q_slot=torch.arange(q0, min(T, q0 + chunk), device=device))

        def index():
            sel["idx"], sel["valid"] = triton_select_topk(iq, iw, ik, topk, chunk)

        def sparse():
            return dsa_triton.sparse_attention_fwd(q, k, v, sel["idx"], sel["valid"], scale)

        def dsa_fwd():
            index()
            return sparse()

        def dsa_train():
            qg.grad = kg.grad = vg.grad = None
            index()
            dsa_triton.sparse_attention(qg, kg, vg, sel["idx"], sel["valid"], scale).backward(dout)

        with torch.no_grad():
            t_dense, t_scores, t_index, t_sparse, t_dsa = (timed(f, device, args.repeat)
                                                             for f in (dense, scores, index, sparse, dsa_fwd))
        t_dense_train, t_dsa_train = (timed(f, device, args.repeat) for f in (dense_train, dsa_train))
        if n == 0:  # the same selection and output as dsa.py's reference path, at the first length
            check_against_reference(iq, iw, ik, q, k, v, sel, topk, scale)
        visible = sum(min(topk, t + 1) for t in range(T))
        f_dense = 4 * H * D * T * (T + 1) / 2
        f_index = 2 * Hi * d * T * (T + 1) / 2
        f_sparse = 4 * H * D * visible
        rows.append(dict(T=T, dense=t_dense, dsa=t_dsa, scores=t_scores, sparse=t_sparse,
                         index=t_index, dense_train=t_dense_train, dsa_train=t_dsa_train,
                         f_dense=f_dense, f_dsa=f_index + f_sparse,
                         f_dense_train=3.5 * f_dense, f_dsa_train=f_index + 3.5 * f_sparse))
        r = rows[-1]
        print(f"T={T:6d}  fwd: dense {t_dense * 1e3:8.1f} ms  DSA {t_dsa * 1e3:8.1f} ms (indexer {t_index * 1e3:.1f}, "
              f"of which scores {t_scores * 1e3:.1f}; sparse {t_sparse * 1e3:.1f})  {t_dense / t_dsa:5.2f}x   "
              f"fwd+bwd: dense {t_dense_train * 1e3:8.1f} ms  DSA {t_dsa_train * 1e3:8.1f} ms  "
              f"{t_dense_train / t_dsa_train:5.2f}x", flush=True)
        del q, k, v, dout, iq, ik, iw, qg, kg, vg, sel
        if device.type == "cuda":
            torch.cuda.empty_cache()

    table = triton_table(args, device, dtype, rows)
    print(table)
    if args.write and args.out:
        write_section(args.out, f"attention-{device.type}-triton", table)
    return rows


def check_against_reference(iq, iw, ik, q, k, v, sel, topk, scale):
    """Print how the Triton path compares with dsa.py's (select_topk on its fp32 scores, sparse_attention
    on the same indices): the share of identical selections and the output's max error."""
    from kernels import dsa_triton
    T = q.shape[1]
    with torch.no_grad():
        idx, valid = dsa.select_topk(iq, iw, ik, AttnMask(torch.arange(T, device=q.device), T), topk)
        as_set = lambda i, ok: i.masked_fill(~ok, -1).sort(-1).values  # noqa: E731
        same = (as_set(sel["idx"], sel["valid"]) == as_set(idx, valid)).all(-1)
        c = max(1, min(T, (1 << 27) // max(1, q.shape[2] * q.shape[3] * topk)))  # reference rows at a time
        ref = dsa.sparse_attention(q[:, :c], k, v, idx[:, :c], valid[:, :c], scale).float()
        ours = dsa_triton.sparse_attention(q[:, :c], k, v, idx[:, :c], valid[:, :c], scale).float()
    print(f"  check vs dsa.py at T={T}: identical top-k sets for {same.float().mean().item():.4%} of queries; "
          f"sparse attention max |err| / max |ref| = {((ours - ref).abs().max() / ref.abs().max()).item():.2e} "
          f"(first {c} queries)", flush=True)


def triton_table(args, device, dtype, rows):
    cmd = "python bench/attention.py " + " ".join(sys.argv[1:])
    last = rows[-1]
    lines = [
        f"### Attention, dense vs DSA on Triton kernels ({machine(device)})",
        "",
        f"Command: `{cmd.strip()}`. One layer's attention core, batch 1, {str(dtype).removeprefix('torch.')}, "
        f"{args.heads} heads x {args.head_dim} (GQA {args.kv_heads} KV heads), top-k {args.topk}, indexer "
        f"{args.index_heads} heads x {args.index_dim}; median of {args.repeat} runs after a warm-up. Dense: causal "
        f"SDPA. DSA: dsa_triton.index_scores (keys after each query skipped) + tie-free torch.topk + "
        f"dsa_triton.sparse_attention; fwd+bwd adds the backward of q, k, v (the indexer has none). "
        f"Indexer share = (scores + top-k) / DSA time. TFLOPS from the causal FLOP counts in the script's "
        f"docstring. At T = {last['T']}: DSA forward {last['dense'] / last['dsa']:.2f}x, forward+backward "
        f"{last['dense_train'] / last['dsa_train']:.2f}x the dense speed, with {last['f_dsa'] / last['f_dense']:.2f}x "
        f"its forward FLOPs.",
        "",
        "| T | dense fwd ms | DSA fwd ms | indexer ms (scores + top-k) | of which scores ms | sparse fwd ms "
        "| fwd speed-up | indexer share fwd "
        "| dense fwd+bwd ms | DSA fwd+bwd ms | fwd+bwd speed-up | indexer share fwd+bwd | dense TFLOPS fwd / fwd+bwd "
        "| DSA TFLOPS fwd / fwd+bwd |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['T']} | {r['dense'] * 1e3:.1f} | {r['dsa'] * 1e3:.1f} | {r['index'] * 1e3:.1f} | "
            f"{r['scores'] * 1e3:.1f} | {r['sparse'] * 1e3:.1f} | {r['dense'] / r['dsa']:.2f}x | "
            f"{r['index'] / r['dsa']:.0%} | {r['dense_train'] * 1e3:.1f} | {r['dsa_train'] * 1e3:.1f} | "
            f"{r['dense_train'] / r['dsa_train']:.2f}x | {r['index'] / r['dsa_train']:.0%} | "
            f"{r['f_dense'] / r['dense'] / 1e12:.3g} / {r['f_dense_train'] / r['dense_train'] / 1e12:.3g} | "
            f"{r['f_dsa'] / r['dsa'] / 1e12:.3g} / {r['f_dsa_train'] / r['dsa_train'] / 1e12:.3g} |")
    return "\n".join(lines)


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
