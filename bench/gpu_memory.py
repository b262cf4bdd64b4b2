"""
GPU memory, measured phase by phase, beside memory.memory_plan's numbers for the same shapes and settings.
The plan is what `python train.py --dry-run` prints and what train.py checks before it loads anything; this
script is how to tell whether it is right.

    python bench/gpu_memory.py                           # on cuda: measure, and print the plan beside it
    python bench/gpu_memory.py --dry                     # the plan side only (any machine; automatic without CUDA)
    python bench/gpu_memory.py --layers 2 --dsa --json out.json --md out.md

Model: GLM-Z1-9B-0414's shapes (config.PUBLISHED: hidden 4096, vocab 151552, 32 heads / 2 KV) cut to --layers
decoder layers, so that one GPU holds the generator and the learner together (train.py's one-GPU layout,
train.generator_device = train.learner_device = cuda:0). --dsa adds the recipe's example indexer (top-2048,
32 heads x 128, FSSS). Random weights, written once as a bf16 checkpoint to a temporary directory (outside
--json's folder; deleted at the end) so that both sides load the way train.py loads them.

Phases, in order, each between torch.cuda.reset_peak_memory_stats and torch.cuda.max_memory_allocated (the
caching allocator's live tensors; the CUDA context and the allocator's free blocks are not in it, which the
plan's "CUDA context, fragmentation" item stands for, so that item is left out of the plan side here):
  generator load     GLM.from_pretrained(ckpt, device) in bf16 and a TorchEngine (as engine.make_engine)
  generator prefill  the first call, --gen-batch rows of 2 new tokens: the KV pool allocated, the prompts
                     prefilled (--group samples share a prompt: one prefill serves them) in forwards of at most
                     --prefill-tokens (the 9B recipe's config.prefill_budget: 32 distinct prompts of 1,024 tokens fill
                     one forward of 17 and one of 15), and one decode step, which captures a CUDA graph
  generator decode   the same rows, --new-tokens each (CUDA graphs captured on first use, as rollout.cuda_graphs)
  learner load       GLM.from_pretrained(ckpt, dtype=float32, device), as train.py loads the learner
  learner step 1/2   train.rl_step on a synthetic batch (--samples sequences of --prompt + --response tokens,
                     micro-batches of --tokens, gradient checkpointing, fused AdamW as train.adamw): the first
                     step allocates the AdamW state; the second is the steady state
  publish            engine.update_weights(parallel.full_weights(learner)), as after every RL step
The learner's numbers are net of what the generator keeps resident (its weights, KV pool and graphs).
After the generator's phases, each call's CUDA graphs are listed bucket by bucket (graphs.DecodeGraphs.memory:
the allocator's counters before and after each bucket's eager warm-up and capture, and its reserved growth) with
their static buffers: where the decode phase's memory above the plan (the first GPU run: 1.10x) goes.
On one process parallel_learner returns the bare model (no FSDP/DDP wrapper), so the plan is asked for
train.parallel (fsdp) over 1 GPU, as `--dry-run` with one pair asks it.
"""
import argparse
import inspect
import os
import shutil
import sys
import tempfile
import time
import weakref

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # first, before bench/ itself: bench/engine.py must not shadow engine.py
from machinery import config  # noqa: E402
from bench import write_results  # noqa: E402
from machinery.memory import OVERHEAD, GiB, memory_plan  # noqa: E402
from model import GLMConfig  # noqa: E402

DSA = dict(topk=2048, heads=32, head_dim=128, rope_dim=64, pattern="FSSS")  # configs/glm9b_math.yaml's example


def architecture(layers, use_dsa):
    """GLM-Z1-9B-0414's GLMConfig cut to `layers` decoder layers (DSA: the recipe's example indexer)."""
    return GLMConfig.from_hf(dict(config.PUBLISHED["GLM-Z1-9B-0414"], num_hidden_layers=layers,
                                  dsa=DSA if use_dsa else None))


def plan_for(args, arch):
    """memory.memory_plan for the measured workload: one learner GPU (train.parallel), the engine with
    --gen-batch rows of --prompt + --new-tokens, every row at full length (kv_cache_tokens None), CUDA graphs,
    and (where memory_plan knows the argument) the generator and the learner on one GPU."""
    kwargs = dict(learner_gpus=1, parallel=args.parallel, micro_batch_tokens=args.tokens, gradient_checkpointing=True,
                  trainable_indexer=False, reference=False, generator_batch=args.gen_batch,
                  generator_max_len=args.prompt + args.new_tokens, max_new_tokens=args.new_tokens, engine="torch",
                  kv_cache_tokens=None, cuda_graphs=True, group_size=args.group, prefill_tokens=args.prefill_tokens,
                  logit_chunk=config.LOGIT_CHUNK,
                  logit_keep=config.LOGIT_KEEP_BYTES, dsa_kernels=not args.no_kernels, shared=True)
    known = inspect.signature(memory_plan).parameters
    return memory_plan(arch, **{k: v for k, v in kwargs.items() if k in known})


def plan_rows(plan):
    """The plan side of each measured phase: (phase, plan bytes, the plan items it adds up). The context item
    (OVERHEAD) is left out: max_memory_allocated does not see the CUDA context or free cached blocks."""
    def total(items):
        return sum(b for i, b in items if b != OVERHEAD or "context" not in i)

    def names(items):
        return [i for i, b in items if b != OVERHEAD or "context" not in i]
    gen, learner = plan.generator, plan.learner
    gen_load = getattr(plan, "generator_load", None) or [i for i in gen if i[0].startswith("bf16 weights")]
    learner_load = getattr(plan, "learner_load", None) or [i for i in learner if i[0].startswith("fp32")
                                                           and "weights" in i[0]]
    return [("generator load", total(gen_load), names(gen_load)),
            ("generator prefill", total(gen), names(gen)),  # (its rows also decode once: graphs are captured)
            ("generator decode", total(gen), names(gen)),
            ("learner load", total(learner_load), names(learner_load)),
            ("learner step 1", total(learner), names(learner)),
            ("learner step 2", total(learner), names(learner)),
            ("publish", None, [])]


def settings_line(args, arch, n_params):
    return (f"GLM-Z1-9B-0414's shapes cut to {arch.num_layers} layers{' (DSA ' + arch.dsa.pattern + ')' if arch.dsa else ''}: "
            f"{n_params / 1e9:.2f}B parameters. Generator: {args.gen_batch} rows ({args.group} per prompt) of "
            f"{args.prompt}-token prompts + {args.new_tokens} new tokens, bf16, CUDA graphs. Learner: fp32 weights, "
            f"bf16 autocast, gradient checkpointing, {args.samples} sequences of {args.prompt} + {args.response} "
            f"tokens in micro-batches of {args.tokens}, fused AdamW. Plan: memory.memory_plan, train.parallel "
            f"{args.parallel} over 1 GPU, kernels {'off' if args.no_kernels else 'on'}.")


def markdown(result):
    lines = [result["settings"], "", "| phase | measured peak GiB | resident after GiB | plan GiB | measured / plan |",
             "|---|---:|---:|---:|---:|"]
    for r in result["phases"]:
        meas = "needs CUDA" if r["peak"] is None else f"{r['peak'] / GiB:.2f}"
        res = "" if r["resident"] is None else f"{r['resident'] / GiB:.2f}"
        plan = "" if r["plan"] is None else f"{r['plan'] / GiB:.2f}"
        ratio = f"{r['peak'] / r['plan']:.2f}x" if r["peak"] is not None and r["plan"] else ""
        lines.append(f"| {r['phase']} | {meas} | {res} | {plan} | {ratio} |")
    lines += ["", "| plan item (one GPU) | plan GiB | counted GiB |", "|---|---:|---:|"]
    for side, items in (("learner", result["plan"]["learner"]), ("generator", result["plan"]["generator"])):
        for item, b in items:
            counted = result["counted"].get(f"{side}: {item}")
            lines.append(f"| {side}: {item} | {b / GiB:.2f} | {'' if counted is None else f'{counted / GiB:.2f}'} |")
    if result.get("graphs"):
        lines += ["", graphs_markdown(result["graphs"])]
    if result.get("note"):
        lines += ["", result["note"]]
    return "\n".join(lines)


def graphs_markdown(graphs):
    """The CUDA-graph buckets' memory (graphs.DecodeGraphs.memory, as graph_memory returns it), in GiB."""
    def g(b):
        return f"{b / GiB:.3f}"
    lines = ["CUDA-graph buckets (graphs.DecodeGraphs.memory; allocator counters around each capture, GiB): "
             "allocated before the eager warm-up; the warm-up's peak above that (where it raised the process's peak; "
             "else at most the earlier peak's excess, marked <=); allocated left by the warm-up and by the capture; "
             "reserved growth over both.", "",
             "| call | rows x keys | allocated before | warm-up peak above | left by warm-up | left by capture | "
             "reserved growth | kept |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in graphs["buckets"]:
        before = r["allocated_before"]
        rose = r["peak_after_warmup"] > r["peak_before"]
        peak = g(r["peak_after_warmup"] - before) if rose else "<= " + g(r["peak_before"] - before)
        warm = r["allocated_after_warmup"] - before
        cap = ("failed" if "allocated_after_capture" not in r
               else g(r["allocated_after_capture"] - r["allocated_after_warmup"]))
        res = g(r["reserved_after_capture"] - r["reserved_before"]) if "reserved_after_capture" in r else ""
        lines.append(f"| {r['call']} | {r['rows']} x {r['keys']} | {g(before)} | {peak} | {g(warm)} | {cap} | {res} | "
                     f"{r.get('kept', '')} |")
    calls = [f"{c['call']}: none (eager)" if c["buffers"] is None else
             f"{c['call']}: {g(c['buffers'])} GiB, {c['buckets']} bucket(s)"
             + (" (the call before's graphs, kept)" if c["same_as_before"] else "") for c in graphs["calls"]]
    lines += ["", "Each call's DecodeGraphs: static buffers (tokens, positions, key slots, masks, [max_batch, vocab] "
                  "logits) and buckets captured: " + "; ".join(calls) + "."]
    return "\n".join(lines)


def measure(args, arch, plan, log):
    """Run the phases on cuda -> (per-phase (peak, resident) bytes, counted item bytes)."""
    import dsa
    from machinery import parallel
    import train
    from machinery.engine import SamplingParams, TorchEngine
    from model import GLM
    from rollout import RolloutBatch, Sample

    dev = torch.device(args.device)
    if dev.type == "cuda" and dev.index is None:  # set_device needs an index: "cuda" is the current one
        dev = torch.device("cuda", torch.cuda.current_device())
    dsa.USE_TRITON = not args.no_kernels
    torch.cuda.set_device(dev)
    measured, counted = {}, {}

    def sync():
        torch.cuda.synchronize(dev)

    class Phase:  # peak and resident bytes of what runs inside, net of `base` (bytes resident before that side began)
        def __init__(self, name, base):
            self.name, self.base = name, base

        def __enter__(self):
            sync()
            torch.cuda.reset_peak_memory_stats(dev)
            self.t0 = time.perf_counter()

        def __exit__(self, *exc):
            if exc[0] is not None:
                return False
            sync()
            peak = torch.cuda.max_memory_allocated(dev) - self.base
            resident = torch.cuda.memory_allocated(dev) - self.base
            measured[self.name] = (peak, resident)
            log(f"[memory] {self.name:<18} peak {peak / GiB:7.2f} GiB  resident {resident / GiB:7.2f} GiB  "
                f"({time.perf_counter() - self.t0:.1f} s)")

    ckpt = tempfile.mkdtemp(prefix="gpu_memory_ckpt_", dir=args.tmp)
    try:
        t0 = time.perf_counter()
        torch.manual_seed(0)
        with torch.device(dev):  # random weights made on the GPU, saved in bf16 as the published checkpoint is
            m = GLM(arch).cast_(torch.bfloat16)
        m.save_pretrained(ckpt)
        del m
        torch.cuda.empty_cache()
        log(f"[memory] wrote a random {arch.num_layers}-layer checkpoint to {ckpt} ({time.perf_counter() - t0:.1f} s)")
        base = torch.cuda.memory_allocated(dev)

        with Phase("generator load", base):
            gen = GLM.from_pretrained(ckpt, dsa=None, device=dev)  # bf16 on cuda (dsa.FP32_PARAMS fp32)
            engine = TorchEngine(gen, max_batch=args.gen_batch, graphs=True, prefill_tokens=args.prefill_tokens)
        counted["generator: " + plan.generator[0][0]] = sum(p.numel() * p.element_size() for p in gen.parameters())
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, arch.vocab_size, (args.prompt,), generator=g).tolist()
                   for _ in range(args.gen_batch // args.group)]
        prompts = [p for p in prompts for _ in range(args.group)]  # a prompt's samples side by side, as rollouts are
        # (2 tokens: the prefill's, then one decode step, which captures its graph; a 1-token call would take none)
        sampling = SamplingParams(temperature=1.0, max_new_tokens=2, stop_token_ids=())
        with Phase("generator prefill", base):
            engine.generate(prompts, sampling, seed=0)
        # (a later call with longer rows gets a new pool and new graphs, and frees these: nothing here may hold them,
        # or the decode phase would count the prefill call's pool and graphs beside its own)
        calls = [("prefill call", graph_info(engine.graphs))]
        pool = vars(engine.pool)
        pool_bytes = sum(t.numel() * t.element_size() for t in pool.values() if isinstance(t, torch.Tensor))
        pool_bytes += sum(t.numel() * t.element_size() for v in pool.values() if isinstance(v, (list, tuple))
                          for t in v if isinstance(t, torch.Tensor))
        del pool
        for item, _ in plan.generator:
            if item.startswith("paged KV pool"):
                counted["generator: " + item] = pool_bytes
        with Phase("generator decode", base):
            out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens,
                                                          stop_token_ids=()), seed=0)
        assert all(len(c.token_ids) == args.new_tokens for c in out)
        if engine.graphs is not None and engine.graphs.failed:
            log("[memory] warning: CUDA graphs fell back to eager decode")
        calls.append(("decode call", graph_info(engine.graphs)))
        graphs = graph_memory(calls, log)

        base = torch.cuda.memory_allocated(dev)  # the generator's resident memory: the learner's numbers are net of it
        with Phase("learner load", base):
            model = GLM.from_pretrained(ckpt, dsa=None, dtype=torch.float32, device=dev)
        model.gradient_checkpointing = True
        for name, p in model.named_parameters():
            p.requires_grad_(".indexer." not in name)  # frozen in RL, as train_rl does
        cfg = config.load_config(os.path.join(ROOT, "configs", "glm9b_math.yaml"),
                                 [f"optim.max_tokens_per_micro_batch={args.tokens}", f"train.parallel={args.parallel}"])
        optimizer = train.adamw(cfg, model, cfg.optim.lr, cfg.optim.weight_decay)
        samples = [Sample(prompt_ids=torch.randint(0, arch.vocab_size, (args.prompt,), generator=g).tolist(),
                          response_ids=torch.randint(0, arch.vocab_size, (args.response,), generator=g).tolist(),
                          gen_logprobs=[-1.0] * args.response, reward=float(i % 2), group=i // 4, versions=(0, 0),
                          finish_reason="stop", example={}) for i in range(args.samples)]
        batch = RolloutBatch(samples=samples, index=0, stream_state={})
        for step in (1, 2):
            with Phase(f"learner step {step}", base):
                train.rl_step(cfg, model, None, optimizer, None, batch, 0)
        counted["learner: " + plan.learner[0][0]] = sum(p.numel() * p.element_size() for p in model.parameters())
        for item, _ in plan.learner:
            if item.startswith("fp32 grads"):
                counted["learner: " + item] = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                                                  if p.grad is not None)
            if item.startswith("AdamW"):
                counted["learner: " + item] = sum(t.numel() * t.element_size() for s in optimizer.state.values()
                                                  for k, t in s.items() if torch.is_tensor(t) and k != "step")
        with Phase("publish", base):
            engine.update_weights(parallel.full_weights(model), 1)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    return measured, counted, graphs


def graph_info(g):
    """What graph_memory reports of a call's DecodeGraphs (None: eager decode), taken right after the call and holding
    only a weak reference to it: the set, its pool and its buffers are the engine's to free."""
    if g is None:
        return None
    return dict(ref=weakref.ref(g), buffers=sum(t.numel() * t.element_size() for t in (g.tok, g.pos, g.keys, g.valid,
                                                                                      g.logits)),
                kept=g.mempool is not None, memory=dict(g.memory))


def graph_memory(calls, log):
    """Each call's DecodeGraphs.memory (bytes around each bucket's capture; graph_info's) as rows, logged as they are
    read, with the static buffers every bucket shares (inputs, key slots, masks, logits) and whether the call kept the
    graphs of the call before (a call with longer rows gets a new pool and new graphs); a bucket is listed once."""
    rows, seen, listed, summary = [], [], set(), []
    for call, g in calls:
        if g is None:
            log(f"[memory] graphs, {call}: none (eager decode)")
            summary.append({"call": call, "buffers": None, "same_as_before": False, "buckets": 0})
            continue
        buffers, live = g["buffers"], g["ref"]()
        same = live is not None and any(live is other["ref"]() for other in seen)
        seen.append(g)
        pool = "kept" if g["kept"] else "none"
        summary.append({"call": call, "buffers": buffers, "same_as_before": same, "buckets": len(g["memory"])})
        log(f"[memory] graphs, {call}: {len(g['memory'])} bucket(s){' (the graphs of the call before)' if same else ''}, "
            f"static buffers {buffers / GiB:.3f} GiB, graph pool {pool}")
        owner = id(live) if live is not None else id(g)  # one set's buckets are listed once
        for (Bg, Lg), m in g["memory"].items():
            if (owner, Bg, Lg) in listed:
                continue
            listed.add((owner, Bg, Lg))
            rows.append({"call": call, "rows": Bg, "keys": Lg, **m})
            figures = [f"{k} {v / GiB:.3f} GiB" if type(v) is int else f"{k} {v}" for k, v in m.items()]
            log(f"[memory]   {Bg:>4} rows x {Lg:>5} keys: " + ", ".join(figures))
    return {"buckets": rows, "calls": summary}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dry", action="store_true", help="the plan side only (automatic when torch sees no CUDA)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the depth cut (the published model has 40)")
    ap.add_argument("--dsa", action="store_true", help="the recipe's example DSA (top-2048, FSSS)")
    ap.add_argument("--parallel", default="fsdp", choices=["fsdp", "ddp"], help="train.parallel the plan is asked for")
    ap.add_argument("--no-kernels", action="store_true", help="PyTorch paths instead of dsa_triton's kernels")
    ap.add_argument("--samples", type=int, default=16, help="learner sequences per step (groups of 4)")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens (learner sequences and generator prompts)")
    ap.add_argument("--response", type=int, default=3072, help="response tokens of each learner sequence")
    ap.add_argument("--tokens", type=int, default=16384, help="optim.max_tokens_per_micro_batch")
    ap.add_argument("--gen-batch", type=int, default=64, help="rows decoding at once (rollout.max_batch)")
    ap.add_argument("--group", type=int, default=2, help="samples per prompt (they share one prefill)")
    ap.add_argument("--prefill-tokens", type=int, default=None, help="tokens a prefill forward packs, in the engine and "
                    "the plan (default: configs/glm9b_math.yaml's config.prefill_budget)")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens generated per row")
    ap.add_argument("--tmp", help="where the temporary checkpoint goes (default: the system's temp directory)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--md", help="write the markdown tables here")
    args = ap.parse_args(argv)
    if args.gen_batch % args.group:
        ap.error("--gen-batch must be a multiple of --group")
    args.prefill_tokens = args.prefill_tokens or config.prefill_budget(
        config.load_config(os.path.join(ROOT, "configs", "glm9b_math.yaml"), []))
    arch = architecture(args.layers, args.dsa)
    plan = plan_for(args, arch)
    dry = args.dry or not torch.cuda.is_available()
    why = "--dry" if args.dry else "torch sees no CUDA device"
    print(f"[memory] plan for {arch.num_layers} layers of GLM-Z1-9B-0414 ({plan.params / 1e9:.2f}B parameters)",
          flush=True)
    print(plan.text(config.H100_BYTES), flush=True)
    result = {"settings": settings_line(args, arch, plan.params), "dry": dry, "params": plan.params,
              "plan": {"learner": plan.learner, "generator": plan.generator,
                       "learner_load": getattr(plan, "learner_load", []),
                       "generator_load": getattr(plan, "generator_load", [])},
              "counted": {}, "device": None}
    measured = {}
    if dry:
        print(f"[memory] the measured side needs CUDA ({why}): plan only", flush=True)
        result["note"] = f"Measured side not run ({why}): it needs a CUDA device."
    else:
        result["device"] = torch.cuda.get_device_name(torch.device(args.device))
        print(f"[memory] measuring on {args.device} ({result['device']}), torch {torch.__version__}", flush=True)
        measured, result["counted"], result["graphs"] = measure(args, arch, plan, lambda m: print(m, flush=True))
        result["note"] = (f"Measured on {result['device']} with torch {torch.__version__}: torch.cuda.max_memory_allocated "
                          "per phase (the learner's net of the generator's resident memory); plan totals without the "
                          f"{OVERHEAD / GiB:.0f} GiB CUDA context / fragmentation item.")
    result["phases"] = [dict(phase=name, plan=b, items=items, peak=measured.get(name, (None, None))[0],
                             resident=measured.get(name, (None, None))[1]) for name, b, items in plan_rows(plan)]
    md = markdown(result)
    print(md, flush=True)
    write_results(args, result, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
