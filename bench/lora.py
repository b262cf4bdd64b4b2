"""
LoRA's publish and merge, measured (lora.py; issue 28's one-GPU work builds on it). Writes its table into
docs/benchmarks.md.

    python bench/lora.py          # about a minute on 2 CPU cores

publish: what a weight update moves to the generator, full model vs adapters only (every decoder linear, rank
   32). Bytes are counted exactly for GLM-Z1-9B-0414's shapes (bf16 weights as publish sends them; adapters in
   fp32); seconds are TorchEngine.update_weights of a 2-layer cut of that model at full width on this CPU, side
   by side (a full publish of the cut, then the adapters of the cut, median of 5), and scaled to 40 layers.
merge: why the generator decodes with the adapters unmerged. After RL, an adapter's delta scale * B A is small
   beside W (an update of lr ~1e-5 per step); merging it into bf16 weights rounds W + delta to bf16's spacing, and
   most of the delta is lost. Reported: the share of the delta's norm that a bf16 merge keeps, for deltas whose
   norm is a given fraction of W's, on one q_proj of the 9B shape (fp32 merge: all of it).
"""
import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from machinery import lora  # noqa: E402
from bench import write_results  # noqa: E402
from bench.attention import machine, write_section  # noqa: E402
from machinery.config import PUBLISHED  # noqa: E402
from machinery.engine import TorchEngine  # noqa: E402
from machinery.lora import LoRAConfig  # noqa: E402
from model import GLM, GLMConfig  # noqa: E402


def publish_part(rank, repeats=5):
    arch = GLMConfig.from_hf(PUBLISHED["GLM-Z1-9B-0414"])
    full_bytes = 2 * sum(p.numel() for p in _meta(arch).parameters())  # bf16 on the wire
    adapted = lora.add(_meta(arch), LoRAConfig(rank=rank))
    adapter_bytes = 4 * sum(p.numel() for _, p in lora.adapter_named(adapted))
    cut = GLMConfig(**{**arch.__dict__, "num_layers": 2, "vocab_size": 4096, "dsa": None})  # full width, 2 layers
    torch.manual_seed(0)
    learner = lora.add(GLM(cut), LoRAConfig(rank=rank))
    engine = TorchEngine(lora.add(GLM(cut), LoRAConfig(rank=rank)))
    decoder = [(n, p.detach().to(torch.bfloat16)) for n, p in learner.named_parameters() if n.startswith("layers.")]
    adapters = [(n, p.detach()) for n, p in lora.adapter_named(learner)]
    times = {"full": [], "adapters": []}
    for _ in range(repeats):  # interleaved: full, then adapters
        for name, tensors in (("full", decoder), ("adapters", adapters)):
            t0 = time.perf_counter()
            engine.update_weights(tensors, version=1)
            times[name].append(time.perf_counter() - t0)
    per_layer = {k: statistics.median(v) / cut.num_layers for k, v in times.items()}
    return {"full_bytes": full_bytes, "adapter_bytes": adapter_bytes, "layers": arch.num_layers,
            "full_s": per_layer["full"] * arch.num_layers, "adapters_s": per_layer["adapters"] * arch.num_layers,
            "cut_full_bytes": sum(t.nbytes for _, t in decoder), "cut_adapter_bytes": sum(t.nbytes for _, t in adapters)}


def _meta(cfg):
    with torch.device("meta"):
        return GLM(cfg)


def merge_part(rank, fractions=(1e-1, 1e-2, 1e-3, 1e-4)):
    arch = GLMConfig.from_hf(PUBLISHED["GLM-Z1-9B-0414"])
    g = torch.Generator().manual_seed(0)
    out_f, in_f = arch.num_heads * arch.head_dim, arch.hidden_size
    w = (torch.randn(out_f, in_f, generator=g) * 0.02).to(torch.bfloat16)  # a bf16 base, as the generator holds it
    rows = []
    for frac in fractions:
        a = torch.randn(rank, in_f, generator=g)
        b = torch.randn(out_f, rank, generator=g)
        delta = b @ a
        delta *= frac * w.float().norm() / delta.norm()
        merged = (w.float() + delta).to(torch.bfloat16).float()  # a bf16 merge
        kept = ((merged - w.float()) * delta).sum() / delta.pow(2).sum()  # the delta's share that survived
        err = (merged - w.float() - delta).norm() / delta.norm()
        rows.append({"fraction": frac, "kept": float(kept), "error": float(err)})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--out", default="docs/benchmarks.md")
    ap.add_argument("--json")
    ap.add_argument("--md")
    args = ap.parse_args()
    pub = publish_part(args.rank)
    merge = merge_part(args.rank)
    gib, mib = 2**30, 2**20
    md = "\n".join([
        f"### LoRA: adapters-only publish, and the bf16 merge ({machine(torch.device('cpu'))})",
        "",
        f"Command: `python bench/lora.py` (lora.py; rank {args.rank}, alpha 32, every decoder linear of GLM-Z1-9B-0414). "
        f"Bytes are exact for the 9B shapes; seconds are `TorchEngine.update_weights` of a 2-layer cut at full width on "
        "this CPU, full then adapters, interleaved, median of 5, scaled to 40 layers (an in-process copy: across GPUs the "
        "bytes set the time). (model.lora publishes exactly these adapters after each step; on a device shared with "
        "the generator the base is never published at all.)",
        "",
        "| publish | bytes | seconds (CPU copy of the 40 decoder layers) |",
        "|---|---:|---:|",
        f"| full model, bf16 | {pub['full_bytes'] / gib:.2f} GiB | {pub['full_s']:.2f} |",
        f"| adapters only, fp32 | {pub['adapter_bytes'] / mib:.0f} MiB | {pub['adapters_s']:.3f} |",
        f"| ratio | {pub['full_bytes'] / pub['adapter_bytes']:.0f}x fewer | {pub['full_s'] / pub['adapters_s']:.0f}x faster |",
        "",
        "Merging the adapters into bf16 weights instead (one 4096 x 4096 q_proj in bf16; a delta = scale B A whose norm "
        "is the given fraction of W's; kept: the delta's share that survives the rounding to bf16, error: "
        "|merged - W - delta| / |delta|):",
        "",
        "| delta norm / W norm | kept by a bf16 merge | error |",
        "|---:|---:|---:|",
    ] + [f"| {r['fraction']:g} | {r['kept']:.0%} | {r['error']:.0%} |" for r in merge] + [
        "",
        "So the generator decodes x W + scale x A B with the adapters unmerged (lora.LoRALinear), and a merged export "
        "is written in fp32 (lora.merged_weight).",
    ])
    print(md)
    write_results(args, {"publish": pub, "merge": merge}, md)
    if args.out:
        write_section(os.path.join(ROOT, args.out), "lora", md)


if __name__ == "__main__":
    main()
