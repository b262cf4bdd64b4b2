"""
The learner step and the generator at GLM-Z1-9B-0414's width on a GPU: a 9B-shaped model cut to a few
layers (random weights made on the device, nothing downloaded), learner tokens/s and peak memory of
train.rl_step, the time to publish the weights to the engine, and TorchEngine's prefill time and
decode tokens/s. Writes the "scale" section of docs/benchmarks.md with --write.

    python bench/scale.py --device cuda --layers 4 --write             # one GPU: learner, then generator
    python bench/scale.py --device cuda --layers 4 --dsa               # DSA layers (topk 2048, FSSS)
    torchrun --nproc-per-node 4 bench/scale.py --device cuda --write   # FSDP2 learner over 4 GPUs
    python bench/scale.py --tiny --device cpu                          # a CPU smoke test, seconds

The learner is train.py's: fp32 weights, gradient checkpointing, bf16 autocast on cuda, AdamW over all
but the DSA indexer, configs/glm9b_math.yaml (lm_head in LOGIT_CHUNK-row chunks).
Its batch is synthetic: --samples sequences (groups of 4) of --prompt + --response random tokens, 0/1
rewards, generator logprobs of -1. Under torchrun each rank trains its share of the same global batch
and generates its own --gen-batch; every rank's generator sits on its learner's GPU (train.py puts it on
another GPU of the pair), so publishing here is a same-device copy, not a GPU-to-GPU transfer.
"""
import argparse
import gc
import os
import resource
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import config  # noqa: E402
import parallel  # noqa: E402
import train  # noqa: E402
from bench.attention import machine, write_section  # noqa: E402
from model import GLM, GLMConfig  # noqa: E402
from rollout import RolloutBatch, Sample, SamplingParams, TorchEngine  # noqa: E402

# Defaults per preset; a flag given on the command line wins. --tiny keeps the CPU run under ~1 GB.
FULL = dict(layers=4, samples=32, prompt=256, response=1024, tokens=16384, gen_batch=64, new_tokens=512, steps=3)
TINY = dict(layers=2, samples=8, prompt=32, response=64, tokens=256, gen_batch=8, new_tokens=16, steps=2)
TINY_SHAPE = dict(vocab_size=1024, hidden_size=256, intermediate_size=704, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=32, pad_token_id=0, eos_token_id=[1])
DSA = dict(topk=2048, heads=32, head_dim=128, rope_dim=64, pattern="FSSS")  # configs/glm9b_math.yaml's example
TINY_DSA = dict(topk=16, heads=4, head_dim=32, rope_dim=16, pattern="FS")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_gib(device):
    """Peak allocated GiB on cuda since the last reset; on CPU the process's max RSS so far."""
    if device.type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB"
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB max RSS (CPU, whole process)"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="hidden 256, vocab 1024, small batches: a CPU smoke test")
    ap.add_argument("--layers", type=int, help="decoder layers (the published model has 40)")
    ap.add_argument("--dsa", action="store_true", help="DSA attention (topk 2048, 32 indexer heads x 128, FSSS)")
    ap.add_argument("--parallel", default="fsdp", choices=["fsdp", "ddp"], help="learner sharding under torchrun")
    ap.add_argument("--samples", type=int, help="sequences per global learner batch (groups of 4)")
    ap.add_argument("--prompt", type=int, help="prompt tokens (learner sequences and generator prompts)")
    ap.add_argument("--response", type=int, help="response tokens of each learner sequence")
    ap.add_argument("--tokens", type=int, help="optim.max_tokens_per_micro_batch")
    ap.add_argument("--gen-batch", type=int, help="prompts decoded together (rollout.max_batch)")
    ap.add_argument("--new-tokens", type=int, help="tokens generated per prompt (no stop tokens)")
    ap.add_argument("--steps", type=int, help="timed learner steps (after one warm-up step)")
    ap.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md (section scale)")
    args = ap.parse_args()
    for k, v in (TINY if args.tiny else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.write and args.tiny:
        sys.exit("error: --tiny is a smoke test; its numbers do not go into docs/benchmarks.md")
    world_env = int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if args.device == "cuda" and world_env > 1
                          else args.device)
    parallel.init_processes(device)  # torchrun: NCCL on GPUs, gloo on CPU; nothing in one process
    rank, world = parallel.rank(), parallel.world()
    if args.samples % (4 * world):
        sys.exit(f"error: --samples {args.samples} must be whole groups of 4 on each of {world} ranks")

    arch = GLMConfig.from_hf(dict(config.PUBLISHED["GLM-Z1-9B-0414"], num_hidden_layers=args.layers,
                                  dsa=(TINY_DSA if args.tiny else DSA) if args.dsa else None,
                                  **(TINY_SHAPE if args.tiny else {})))
    cfg = config.load_config(os.path.join(ROOT, "configs", "glm9b_math.yaml"), [
        f"optim.max_tokens_per_micro_batch={args.tokens}", f"train.parallel={args.parallel}",
        f"rollout.max_batch={args.gen_batch}"])

    # ---- learner: as train.train_rl builds it (every rank makes the same weights from the same seed)
    torch.manual_seed(0)
    with torch.device(device):
        model = GLM(arch)
    model.gradient_checkpointing = cfg.model.gradient_checkpointing
    n_params = sum(p.numel() for p in model.parameters())
    for name, p in model.named_parameters():
        p.requires_grad_(".indexer." not in name)  # frozen in RL, as in train_rl
    learner = parallel.parallel_learner(model, device, cfg.train.parallel)  # FSDP2/DDP under torchrun; the model itself alone
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.optim.lr,
                                  betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay)

    g = torch.Generator().manual_seed(1 + rank)  # each rank its own share of the global batch
    mine = args.samples // world
    samples = [Sample(prompt_ids=torch.randint(0, arch.vocab_size, (args.prompt,), generator=g).tolist(),
                      response_ids=torch.randint(0, arch.vocab_size, (args.response,), generator=g).tolist(),
                      gen_logprobs=[-1.0] * args.response, reward=float(torch.randint(0, 2, (), generator=g)),
                      group=i // 4, versions=(0, 0), finish_reason="length", example={}) for i in range(mine)]
    batch = RolloutBatch(samples=samples, index=0, stream_state={})

    step_s = []
    for step in range(1 + args.steps):  # the first step allocates AdamW state and picks kernels: untimed
        if step == 1 and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        t0 = time.perf_counter()
        m = train.rl_step(cfg, learner, None, optimizer, None, batch, 0)  # version 0: the batch stays fresh
        sync(device)
        step_s.append(time.perf_counter() - t0)
    tokens = sum(parallel.all_gather(m["train/tokens"]))  # the global batch
    step = max(parallel.all_gather(statistics.median(step_s[1:])))  # ranks step together: the slowest decides
    learner_mem = peak_gib(device)

    # ---- generator: a second copy in the engine's dtype (rollout.make_engine: bf16 on cuda, fp32 on CPU)
    gen_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device("meta"):
        gen_model = GLM(arch).to(gen_dtype)
    engine = TorchEngine(gen_model.to_empty(device=device), max_batch=args.gen_batch)
    engine.update_weights(parallel.full_weights(learner, gen_dtype), 0)  # fills the empty copy (and warms up)
    publish_s = []
    for version in range(1, 4):
        parallel.barrier()
        t0 = time.perf_counter()
        engine.update_weights(parallel.full_weights(learner, gen_dtype), version)  # synchronizes on cuda itself
        publish_s.append(time.perf_counter() - t0)
    del learner, model, optimizer, m  # from here on the GPU holds the generator alone: its memory is its own
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    prompts = [torch.randint(0, arch.vocab_size, (args.prompt,), generator=g).tolist() for _ in range(args.gen_batch)]
    engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=2), seed=rank)  # warm-up
    times = {}
    for n in (1, args.new_tokens):  # 1 new token = the prefill (plus one sampling step)
        sync(device)
        t0 = time.perf_counter()
        out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=n, stop_token_ids=()), seed=rank)
        sync(device)
        times[n] = time.perf_counter() - t0
        assert all(len(c.token_ids) == n for c in out)  # no stop tokens: every row runs to the limit
    decode = args.gen_batch * (args.new_tokens - 1) / (times[args.new_tokens] - times[1])
    gen_mem = peak_gib(device)

    if rank != 0:
        return
    where = f"{world} x {machine(device)}" if world > 1 else machine(device)
    launcher = f"torchrun --nproc-per-node {world} " if world > 1 else "python "
    command = launcher + "bench/scale.py " + " ".join(sys.argv[1:])
    par = f", learner {args.parallel.upper()} over {world} ranks" if world > 1 else ""
    shape = ("Tiny shape (hidden 256, vocab 1024)" if args.tiny else "GLM-Z1-9B-0414's shape") + \
        f", {args.layers} layers{', DSA ' + arch.dsa.pattern if args.dsa else ''}"
    lines = [
        f"### Learner and generator at scale ({where})",
        "",
        f"Command: `{command}` (torch {torch.__version__}). {shape}: {n_params / 1e6:,.0f}M parameters "
        f"(embeddings and lm_head alone are {2 * arch.vocab_size * arch.hidden_size / 1e6:,.0f}M, so tokens/s "
        f"does not scale down from 40 layers by layer count){par}. Learner: configs/glm9b_math.yaml, "
        f"{args.samples} sequences of {args.prompt} + {args.response} tokens per step, micro-batches of up "
        f"to {args.tokens} tokens, median of {args.steps} steps after a warm-up; tokens/s counts prompt and "
        f"response tokens of the global batch. Publish: full_weights into a {str(gen_dtype)[6:]} TorchEngine "
        f"copy on the same device, median of 3. Generator: {args.gen_batch} prompts of {args.prompt} tokens, "
        f"{args.new_tokens} new tokens each at temperature 1 (no stop), on one {device.type} (rank 0); prefill = "
        f"a 1-token generate; its peak memory (weights, KV cache, activations) is measured after the learner is "
        f"freed. Memory is rank 0's, per device.",
        "",
        "| part | time | tokens / s | peak memory |",
        "|---|---:|---:|---|",
        f"| learner rl_step | {step:.2f} s / step | {tokens / step:.0f} | {learner_mem} |",
        f"| publish weights | {statistics.median(publish_s) * 1e3:.1f} ms | | |",
        f"| generator prefill | {times[1]:.3f} s | {args.gen_batch * args.prompt / times[1]:.0f} | |",
        f"| generator decode | {times[args.new_tokens] - times[1]:.2f} s | {decode:.0f} | {gen_mem} |",
    ]
    table = "\n".join(lines)
    print(table, flush=True)
    if args.write:
        write_section(os.path.join(ROOT, "docs", "benchmarks.md"), "scale", table)


if __name__ == "__main__":
    try:
        main()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
