"""
The learner step and the generator at GLM-Z1-9B-0414's width on a GPU: a 9B-shaped model cut to a few
layers (random weights made on the device, nothing downloaded), learner tokens/s, MFU and peak memory
of train.rl_step, the time to publish the weights to the engine, and TorchEngine's prefill time and
decode tokens/s at several batch sizes (on CUDA eager and as CUDA graphs, side by side) with their
fraction of the HBM roofline. Writes the "scale"
section of docs/benchmarks.md with --write.

    python bench/scale.py --device cuda --layers 4 --write             # one GPU: learner, then generator
    python bench/scale.py --device cuda --layers 4 --dsa               # DSA layers (topk 2048, FSSS)
    torchrun --nproc-per-node 4 bench/scale.py --device cuda --write   # FSDP2 learner over 4 GPUs
    python bench/scale.py --device cuda --layers 4 --no-kernels        # the same on PyTorch paths, to compare
    python bench/scale.py --device cuda --layers 16 --profile prof     # ... and where the time goes: op tables
    python bench/scale.py --tiny --device cpu                          # a CPU smoke test, seconds

The learner is train.py's: fp32 weights, gradient checkpointing, bf16 autocast on cuda, AdamW over all
but the DSA indexer, configs/glm9b_math.yaml (lm_head in LOGIT_CHUNK-row chunks).
Its batch is synthetic: --samples sequences (groups of 4) of --prompt + --response random tokens, 0/1
rewards, generator logprobs of -1. Under torchrun each rank trains its share of the same global batch
and generates its own --gen-batch; every rank's generator sits on its learner's GPU (train.py puts it on
another GPU of the pair), so publishing here is a same-device copy, not a GPU-to-GPU transfer.

MFU: model FLOPs per second over the GPU's dense bf16 peak (--peak-tflops, else from the device name).
Model FLOPs per trained token: 6 x the decoder layers' matmul parameters, 12 x layers x heads x head_dim
x the mean causal context (attention scores and values), and 6 x vocab x hidden for response tokens
(lm_head runs there only); the recomputation of gradient checkpointing is not counted, as is usual.
Decode roofline: a step must read the bf16 weights once and each row's keys and values (its mean context
over the run), so tokens/s <= rows x HBM bandwidth / those bytes (--hbm-tbps, else from the device
name). The 40-layer estimate assumes the cut model's fraction of its roofline holds at full depth: the
per-layer work is the same, and the embedding and lm_head weigh less there.
"""
import argparse
import dataclasses
import gc
import os
import resource
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from machinery import config  # noqa: E402
import dsa  # noqa: E402
from machinery import fp8  # noqa: E402
from machinery import parallel  # noqa: E402
import train  # noqa: E402
from bench import profile_to  # noqa: E402
from bench.attention import machine, write_section  # noqa: E402
from model import GLM, GLMConfig, hf_name  # noqa: E402
from machinery.engine import SamplingParams, TorchEngine  # noqa: E402
from rollout import RolloutBatch, Sample  # noqa: E402

# Defaults per preset; a flag given on the command line wins. --tiny keeps the CPU run under ~1 GB.
FULL = dict(layers=4, samples=32, prompt=256, response=1024, tokens=16384, gen_batch="64,128,256", new_tokens=512,
            steps=3)
TINY = dict(layers=2, samples=8, prompt=32, response=64, tokens=256, gen_batch="4,8", new_tokens=16, steps=2)
# Dense bf16 peak TFLOP/s and HBM TB/s by device name (NVIDIA's data sheets; SXM parts); others: give the flags.
GPUS = {"H200": (989, 4.8), "H100 NVL": (835, 3.9), "H100 PCIe": (756, 2.0), "H100": (989, 3.35), "A100": (312, 2.0)}
TINY_SHAPE = dict(vocab_size=1024, hidden_size=256, intermediate_size=704, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=32, pad_token_id=0, eos_token_id=[1])
DSA = dict(topk=2048, heads=32, head_dim=128, rope_dim=64, pattern="FSSS")  # configs/glm9b_math.yaml's example
TINY_DSA = dict(topk=16, heads=4, head_dim=32, rope_dim=16, pattern="FS")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_and_bandwidth(device, args):
    """(dense bf16 peak TFLOP/s, HBM TB/s) of the device: the flags, else GPUS by name; None where unknown."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    known = next((v for k, v in GPUS.items() if k in name), (None, None))
    return args.peak_tflops or known[0], args.hbm_tbps or known[1]


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
    ap.add_argument("--gen-batch", help="prompts decoded together (rollout.max_batch), comma-separated sizes")
    ap.add_argument("--peak-tflops", type=float, help="dense bf16 peak of the device, for MFU")
    ap.add_argument("--hbm-tbps", type=float, help="memory bandwidth of the device, for the decode roofline")
    ap.add_argument("--new-tokens", type=int, help="tokens generated per prompt (no stop tokens)")
    ap.add_argument("--steps", type=int, help="timed learner steps (after one warm-up step)")
    ap.add_argument("--no-kernels", action="store_true",
                    help="PyTorch paths instead of dsa_triton's kernels (DSA and the engine's sampler), to compare")
    ap.add_argument("--fp8", action="store_true", help="the generator's decoder linears in block-wise fp8 (rollout.quantization)")
    ap.add_argument("--profile", metavar="DIR", help="also one untimed learner step, and per batch size a prefill and a "
                    "16-token generate (CUDA graphs where there are), under torch.profiler: op tables in DIR")
    ap.add_argument("--hf", action="store_true", help="also transformers' prefill (a 1-token generate) of the same prompts "
                    "on the generator's weights (Glm4ForCausalLM; dense only), beside ours")
    ap.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md (section scale)")
    args = ap.parse_args()
    if args.hf and args.dsa:
        sys.exit("error: --hf compares the dense model (transformers' Glm4ForCausalLM has no DSA)")
    dsa.USE_TRITON = not args.no_kernels
    for k, v in (TINY if args.tiny else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    batches = [int(b) for b in str(args.gen_batch).split(",")]
    if args.write and args.tiny:
        sys.exit("error: --tiny is a smoke test; its numbers do not go into docs/benchmarks.md")
    world_env = int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if args.device == "cuda" and world_env > 1
                          else args.device)
    parallel.init_processes(device)  # torchrun: NCCL on GPUs, gloo on CPU; nothing in one process
    peak, hbm = peak_and_bandwidth(device, args)
    rank, world = parallel.rank(), parallel.world()
    if args.samples % (4 * world):
        sys.exit(f"error: --samples {args.samples} must be whole groups of 4 on each of {world} ranks")

    arch = GLMConfig.from_hf(dict(config.PUBLISHED["GLM-Z1-9B-0414"], num_hidden_layers=args.layers,
                                  dsa=(TINY_DSA if args.tiny else DSA) if args.dsa else None,
                                  **(TINY_SHAPE if args.tiny else {})))
    cfg = config.load_config(os.path.join(ROOT, "configs", "glm9b_math.yaml"), [
        f"optim.max_tokens_per_micro_batch={args.tokens}", f"train.parallel={args.parallel}",
        f"rollout.max_batch={max(batches)}"])

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
    L, layers_mm = args.prompt + args.response, sum(p.numel() for n, p in model.named_parameters()
                                                     if n.startswith("layers.") and p.dim() == 2 and ".indexer." not in n)
    ctx = sum(min(t + 1, arch.dsa.topk) if arch.dsa else t + 1 for t in range(L))  # keys each query scores, summed
    step_flops = args.samples * (6 * layers_mm * L + 12 * arch.num_layers * arch.num_heads * arch.head_dim * ctx
                                 + 6 * arch.vocab_size * arch.hidden_size * args.response)
    step = max(parallel.all_gather(statistics.median(step_s[1:])))  # ranks step together: the slowest decides
    learner_mem = peak_gib(device)
    if args.profile:  # (every rank steps: collectives; rank 0 writes)
        os.makedirs(args.profile, exist_ok=True)
        profile_to(os.path.join(args.profile, f"learner_rank{rank}.txt"),
                   lambda: train.rl_step(cfg, learner, None, optimizer, None, batch, 0))
    mfu = f"{step_flops / step / (peak * 1e12 * world):.1%}" if peak else "n/a"

    # ---- generator: a second copy in the engine's dtype (engine.make_engine: bf16 on cuda, fp32 on CPU)
    gen_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device("meta"):
        gen_model = GLM(arch).cast_(gen_dtype)  # as engine.make_engine: dsa.FP32_PARAMS stay fp32
        if args.fp8:
            fp8.quantize_model_(gen_model)  # as make_engine with rollout.quantization: fp8
    engine = TorchEngine(gen_model.to_empty(device=device), max_batch=max(batches), graphs=device.type == "cuda",
                         prefill_tokens=config.prefill_budget(cfg))  # (what the recipe's memory plan counts: make_engine's)
    quantization = "fp8" if args.fp8 else None
    engine.update_weights(parallel.full_weights(learner, gen_dtype, quantization), 0)  # fills the empty copy (and warms up)
    publish_s = []
    for version in range(1, 4):
        parallel.barrier()
        t0 = time.perf_counter()
        engine.update_weights(parallel.full_weights(learner, gen_dtype, quantization), version)  # synchronizes on cuda itself
        publish_s.append(time.perf_counter() - t0)
    del learner, model, optimizer, m  # from here on the GPU holds the generator alone: its memory is its own
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    weight_bytes = sum(p.numel() * p.element_size() for p in gen_model.parameters())
    layer_bytes = sum(p.numel() * p.element_size() for n, p in gen_model.named_parameters() if n.startswith("layers."))
    if not arch.tie_word_embeddings:  # a step reads B rows of the embedding table, not the table
        weight_bytes -= gen_model.embed_tokens.weight.numel() * gen_model.embed_tokens.weight.element_size()
    context = args.prompt + args.new_tokens / 2  # a row's mean context over the run
    bf16 = torch.finfo(gen_dtype).bits // 8
    kv_read = arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * bf16 * (
        min(context, arch.dsa.topk) if arch.dsa else context)  # per row per step (DSA: its top-k keys)
    if arch.dsa:  # and the indexer keys of every position, on F layers
        kv_read += arch.dsa.layer_kinds(arch.num_layers).count("F") * arch.dsa.head_dim * bf16 * context
    gen, hf_prefill = [], {}
    for B in batches:  # on CUDA each batch size runs eagerly, then as CUDA graphs (engine.DecodeGraphs)
        for graphs in (False, True) if device.type == "cuda" else (False,):
            engine.max_batch, engine.use_graphs, engine.graphs = B, graphs, None
            prompts = [torch.randint(0, arch.vocab_size, (args.prompt,), generator=g).tolist() for _ in range(B)]
            sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, stop_token_ids=())
            engine.generate(prompts, sampling, seed=rank)  # warm-up: the pool sized, every bucket captured
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times = {}
            for n in (1, args.new_tokens):  # 1 new token = the prefill (plus one sampling step)
                sync(device)
                t0 = time.perf_counter()
                out = engine.generate(prompts, dataclasses.replace(sampling, max_new_tokens=n), seed=rank)
                sync(device)
                times[n] = time.perf_counter() - t0
                assert all(len(c.token_ids) == n for c in out)  # no stop tokens: every row runs to the limit
            assert not graphs or (engine.graphs.graphs and not engine.graphs.failed), "CUDA graphs fell back to eager"
            if args.profile and rank == 0 and graphs == (device.type == "cuda"):
                for n in (1, 16):
                    profile_to(os.path.join(args.profile, f"generate{n}_{B}{'_graphs' if graphs else ''}.txt"),
                               lambda n=n: engine.generate(prompts, dataclasses.replace(sampling, max_new_tokens=n),
                                                           seed=rank))
            decode = B * (args.new_tokens - 1) / (times[args.new_tokens] - times[1])
            roof = roof40 = None
            if hbm:
                roof = B * hbm * 1e12 / (weight_bytes + B * kv_read)
                full = 40 / arch.num_layers  # the published depth: layers' weights and KV scale, the rest stays
                roof40 = B * hbm * 1e12 / (weight_bytes + (full - 1) * layer_bytes + B * kv_read * full)
            gen.append((B, graphs, times, decode, roof, roof40, peak_gib(device)))
            if args.hf and not graphs and rank == 0:
                hf_prefill[B] = hf_prefill_s(gen_model, arch, prompts, device)

    if rank != 0:
        return
    where = f"{world} x {machine(device)}" if world > 1 else machine(device)
    launcher = f"torchrun --nproc-per-node {world} " if world > 1 else "python "
    command = launcher + "bench/scale.py " + " ".join(sys.argv[1:])
    par = f", learner {args.parallel.upper()} over {world} ranks" if world > 1 else ""
    shape = ("Tiny shape (hidden 256, vocab 1024)" if args.tiny else "GLM-Z1-9B-0414's shape") + \
        f", {args.layers} layers{', DSA ' + arch.dsa.pattern if args.dsa else ''}" + \
        (", PyTorch paths (no Triton kernels)" if args.no_kernels else "")
    lines = [
        f"### Learner and generator at scale ({where})",
        "",
        f"Command: `{command}` (torch {torch.__version__}). {shape}: {n_params / 1e6:,.0f}M parameters "
        f"(embeddings and lm_head alone are {2 * arch.vocab_size * arch.hidden_size / 1e6:,.0f}M, so tokens/s "
        f"does not scale down from 40 layers by layer count){par}. Learner: configs/glm9b_math.yaml, "
        f"{args.samples} sequences of {args.prompt} + {args.response} tokens per step, micro-batches of up "
        f"to {args.tokens} tokens, median of {args.steps} steps after a warm-up; tokens/s counts prompt and "
        f"response tokens of the global batch. Publish: full_weights into a {str(gen_dtype)[6:]} TorchEngine "
        f"copy on the same device, median of 3. Generator: {args.gen_batch} rows of {args.prompt}-token prompts, "
        f"{args.new_tokens} new tokens each at temperature 1 (no stop), on one {device.type} (rank 0); prefill = "
        f"a 1-token generate; its peak memory (weights, KV cache, activations) is measured after the learner is "
        f"freed. Memory is rank 0's, per device. MFU and the roofline (bf16 peak {peak or 'n/a'} TFLOP/s, HBM "
        f"{hbm or 'n/a'} TB/s) as the script's docstring says.",
        "",
        "| part | time | tokens / s | MFU or roofline | peak memory |",
        "|---|---:|---:|---|---|",
        f"| learner rl_step | {step:.2f} s / step | {tokens / step:.0f} | MFU {mfu} | {learner_mem} |",
        f"| publish weights | {statistics.median(publish_s) * 1e3:.1f} ms | | | |",
    ]
    for B, graphs, times, decode, roof, roof40, mem in gen:
        share = f"{decode / roof:.0%} of {roof:.0f}; at 40 layers ~{decode / roof * roof40:.0f}" if roof else "n/a"
        vs = (f" ({hf_prefill[B][0] / times[1]:.2f}x transformers' {hf_prefill[B][0]:.3f} s; logits apart by "
              f"{hf_prefill[B][1]:.1e})" if B in hf_prefill else "")
        lines += [f"| generator prefill, {B} rows | {times[1]:.3f} s{vs} | {B * args.prompt / times[1]:.0f} | | |"] * (not graphs)
        lines += [f"| generator decode, {B} rows, {'CUDA graphs' if graphs else 'eager'} | "
                  f"{times[args.new_tokens] - times[1]:.2f} s | {decode:.0f} | {share} | {mem} |"]
    table = "\n".join(lines)
    print(table, flush=True)
    if args.write:
        write_section(os.path.join(ROOT, "docs", "benchmarks.md"), "scale", table)


def hf_prefill_s(gen_model, arch, prompts, device):
    """transformers' Glm4ForCausalLM on the generator's weights (its dtype): a 1-token generate of the prompts in one
    batch (they are of one length: no padding), after a warm-up -> (seconds, the two models' logits' relative
    difference on one prompt). The model is freed before returning."""
    import transformers
    with torch.device("meta"):
        hf = transformers.Glm4ForCausalLM(transformers.Glm4Config(**arch.to_hf()))
    hf.load_state_dict({hf_name(n): t for n, t in gen_model.state_dict().items()}, assign=True)
    with torch.device(device):  # (its buffers, which no state dict holds)
        hf.model.rotary_emb = type(hf.model.rotary_emb)(hf.config)
    hf = hf.to(device).eval()  # (assign: the generator's own tensors, no copy)
    ids = torch.tensor(prompts, device=device)
    with torch.no_grad():  # the same function: the two models' logits on one prompt. bf16 on cuda leaves them a
        a, b = gen_model(ids[:1]).float(), hf(input_ids=ids[:1]).logits.float()  # rounding apart (~1e-2); a wrong
    err = ((a - b).norm() / b.norm()).item()  # weight or layout gives O(1)
    if not err < 0.2:
        raise SystemExit(f"error: transformers' copy of the generator gives other logits (relative error {err:.2e})")

    def run():
        with torch.no_grad():
            hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                        max_new_tokens=1, pad_token_id=0, eos_token_id=None)
        sync(device)
    run()
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0, err


if __name__ == "__main__":
    try:
        main()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
