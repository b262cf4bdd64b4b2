"""
The co-located handoff (train.colocate, colocate.py), measured: how long each handoff takes, what the first
generation after one costs (a new KV pool, CUDA graphs captured again) beside the same generation with no handoff
before it, and each phase's peak memory beside memory.memory_plan's co-located phases.

    python bench/colocate.py                           # cuda: GLM-Z1-9B-0414's shapes cut to --layers, LoRA and full
    python bench/colocate.py --device cpu --small      # the same steps on a tiny model (seconds; memory needs CUDA)
    python bench/colocate.py --json out.json --md out.md

Each mode (--modes lora,full) puts a learner (full: fp32 masters; lora: a bf16 base and fp32 adapters, lora.py) and
a TorchEngine (bf16 weights, CUDA graphs; lora: decoding on the learner's base itself, engine.share) on one device,
then runs --steps rounds of the co-located step, as train.train_rl does:
  generate      engine.generate: --gen-batch rows of a --prompt-token prompt + --new-tokens
  to_learner    Handoff.to_learner: the KV pool, its graphs and the engine's unshared weights released; the
                learner's masters and AdamW state back from pinned host memory
  train         train.rl_step on a synthetic batch (--samples sequences of --prompt + --response tokens)
  publish       engine.update_weights(parallel.full_weights(...)): the released weights filled again
  to_generator  Handoff.to_generator: gradients freed, the learner's state offloaded (train.offload: true)
and after the last round one more generate with no handoff before it: the steady state. The first generate of a
round, minus that, is what a handoff costs the engine (the pool allocated again, each bucket's graph captured again).
Memory: torch.cuda.max_memory_allocated per phase, beside the plan's phase without its CUDA-context item (which the
allocator does not see).
"""
import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # first, before bench/ itself: bench/engine.py must not shadow engine.py
from machinery import config  # noqa: E402
from machinery import lora  # noqa: E402
from bench import write_results  # noqa: E402
from bench.gpu_memory import architecture  # noqa: E402
from machinery.memory import OVERHEAD, GiB, memory_plan  # noqa: E402
from model import GLMConfig  # noqa: E402

PHASES = ("generate", "to_learner", "train", "publish", "to_generator")


def plan_phases(args, arch, mode):
    """memory_plan's co-located phases for this workload: {phase: bytes without the CUDA-context item}."""
    plan = memory_plan(arch, learner_gpus=1, parallel="ddp" if mode == "lora" else "fsdp", micro_batch_tokens=args.tokens,
                       gradient_checkpointing=True, trainable_indexer=False, reference=False, generator_batch=args.gen_batch,
                       generator_max_len=args.prompt + args.new_tokens, max_new_tokens=args.new_tokens, engine="torch",
                       cuda_graphs=True, group_size=1, logit_chunk=config.LOGIT_CHUNK, logit_keep=config.LOGIT_KEEP_BYTES,
                       lora_cfg=lora.LoRAConfig(rank=args.rank) if mode == "lora" else None, colocate=True, offload=True)
    return {name.split(":")[0]: sum(b for i, b in items if not (b == OVERHEAD and "context" in i))
            for name, items, _ in plan.phases()}


def run_mode(args, arch, mode, log):
    from machinery import colocate
    from machinery import parallel
    import train
    from machinery.engine import SamplingParams, TorchEngine
    from model import GLM
    from rollout import RolloutBatch, Sample

    dev, cuda = torch.device(args.device), torch.device(args.device).type == "cuda"
    overrides = [f"optim.max_tokens_per_micro_batch={args.tokens}",
                 f"model.lora={{rank: {args.rank}}}" if mode == "lora" else "model.lora=null"]
    cfg = config.load_config(os.path.join(ROOT, "configs", "glm9b_math_1gpu.yaml"), overrides)  # (co-located, one GPU)
    torch.manual_seed(0)
    with torch.device(dev):
        learner = GLM(arch)  # fp32 masters (lora: rl_trainable casts the base to bf16 on a GPU and adds the adapters)
        engine_model = GLM(arch).cast_(torch.bfloat16 if cuda else torch.float32)
    learner.gradient_checkpointing = True
    lora.rl_trainable(learner, cfg)
    if mode == "lora":
        lora.add(engine_model, lora.LoRAConfig(rank=args.rank))
    engine = TorchEngine(engine_model, max_batch=args.gen_batch, graphs=cuda)
    shared = lora.share_base(engine, learner)
    engine.update_weights(parallel.full_weights(learner, engine.dtype, base=not shared), 0)
    optimizer = train.adamw(cfg, learner, lora.rl_lr(cfg), cfg.optim.weight_decay)
    hand = colocate.Handoff(engine, learner, optimizer, dev, offload=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, arch.vocab_size, (args.prompt,), generator=g).tolist() for _ in range(args.gen_batch)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, stop_token_ids=())
    samples = [Sample(prompt_ids=torch.randint(0, arch.vocab_size, (args.prompt,), generator=g).tolist(),
                      response_ids=torch.randint(0, arch.vocab_size, (args.response,), generator=g).tolist(),
                      gen_logprobs=[-1.0] * args.response, reward=float(i % 2), group=i // 4, versions=(0, 0),
                      finish_reason="stop", example={}) for i in range(args.samples)]
    batch = RolloutBatch(samples=samples, index=0, stream_state={})
    hand.to_generator()
    secs, peaks = {p: [] for p in PHASES}, {p: 0 for p in PHASES}

    def phase(name, fn):
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(dev)
            peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated(dev))
        secs[name].append(time.perf_counter() - t0)

    for step in range(args.steps):
        for s in samples:
            s.versions = (step, step)  # sampled by the weights this step trains (max_staleness 0)
        phase("generate", lambda: engine.generate(prompts, sampling, seed=step))
        phase("to_learner", hand.to_learner)
        phase("train", lambda: train.rl_step(cfg, learner, None, optimizer, None, batch, step))
        phase("publish", lambda: engine.update_weights(parallel.full_weights(learner, engine.dtype), step + 1))
        phase("to_generator", hand.to_generator)
        log(f"[colocate] {mode} round {step}: " + ", ".join(f"{p} {secs[p][-1]:.3f} s" for p in PHASES))
    t0 = time.perf_counter()
    engine.generate(prompts, sampling, seed=args.steps)  # no handoff since the last: pool and graphs are there
    steady = time.perf_counter() - t0
    first = statistics.median(secs["generate"][1:] or secs["generate"])  # (round 0 also captures for the first time)
    assert all(t > 0 for t in secs["train"]) and optimizer.state, "the learner did not step"
    out = {"mode": mode, "seconds": {p: statistics.median(v) for p, v in secs.items()}, "steady_generate_s": steady,
           "handoff_generate_cost_s": first - steady, "offloaded_gib": hand.stats["colocate/offloaded_gib"],
           "peaks": peaks if cuda else None, "plan": plan_phases(args, arch, mode)}
    return out


def markdown(result):
    lines = [result["settings"], "", "| mode | to_learner s | train s | publish s | to_generator s | offloaded GiB | "
             "generate after a handoff s | generate, none before s | the handoff's cost to the engine s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["modes"]:
        s = r["seconds"]
        lines.append(f"| {r['mode']} | {s['to_learner']:.3f} | {s['train']:.3f} | {s['publish']:.3f} | {s['to_generator']:.3f} "
                     f"| {r['offloaded_gib']:.3f} | {s['generate']:.3f} | {r['steady_generate_s']:.3f} | "
                     f"{r['handoff_generate_cost_s']:+.3f} |")
    lines += ["", "| mode | phase | measured peak GiB | plan GiB (without the CUDA context) |", "|---|---|---:|---:|"]
    for r in result["modes"]:
        for phase, plan_name in (("generate", "generate"), ("train", "train"), ("publish", None), ("to_learner", None)):
            meas = "needs CUDA" if r["peaks"] is None else f"{r['peaks'][phase] / GiB:.2f}"
            plan = "" if plan_name is None else f"{r['plan'][plan_name] / GiB:.2f}"
            lines.append(f"| {r['mode']} | {phase} | {meas} | {plan} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="a tiny model (any device; the CPU check of this script)")
    ap.add_argument("--modes", default="lora,full")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the 9B depth cut")
    ap.add_argument("--rank", type=int, default=32, help="LoRA rank (lora mode)")
    ap.add_argument("--steps", type=int, default=3, help="co-located rounds per mode")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--response", type=int, default=1536)
    ap.add_argument("--tokens", type=int, default=16384, help="optim.max_tokens_per_micro_batch")
    ap.add_argument("--gen-batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json")
    ap.add_argument("--md")
    args = ap.parse_args(argv)
    if args.small:
        arch = GLMConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=16)
        args.prompt, args.response, args.samples, args.gen_batch, args.new_tokens, args.rank = 16, 16, 8, 8, 8, 4
    else:
        arch = architecture(args.layers, False)
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    result = {"device": name, "settings": (
        f"`python bench/colocate.py {' '.join(argv if argv is not None else sys.argv[1:])}` on {name}, torch {torch.__version__}: "
        f"{'a tiny model' if args.small else f'GLM-Z1-9B-0414 cut to {arch.num_layers} layers'}, {args.gen_batch} rows of "
        f"{args.prompt} + {args.new_tokens} tokens, {args.samples} learner sequences of {args.prompt} + {args.response}, "
        f"medians of {args.steps} rounds (the handoff's cost: rounds after the first)."), "modes": []}
    for mode in args.modes.split(","):
        result["modes"].append(run_mode(args, arch, mode, lambda m: print(m, flush=True)))
        if dev.type == "cuda":
            torch.cuda.empty_cache()  # the mode's model and engine are gone: their cached blocks too
    md = markdown(result)
    print(md, flush=True)
    write_results(args, result, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
