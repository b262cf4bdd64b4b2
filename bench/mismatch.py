"""
The train/inference mismatch of an fp8 generator (rollout.quantization: fp8) against today's generators,
teacher-forced, with no optimizer step: one learner (fp32 weights), and for each generator a TorchEngine
holding the learner's weights as publishing hands them over (fp32 / bf16 / fp8 e4m3 blocks with bf16
activations). Each engine samples the same prompts at temperature 1 with the same seed; the learner then
scores exactly those tokens (train.packed_forward, as rl_step does), and we report what rl_step logs:
train/mismatch_k3 (k3 estimate of KL(pi_gen || pi_learner)), train/logp_diff_mean and _max, plus the share
of tokens whose weight w = pi_learner / pi_gen falls outside IcePop's [1/2, 2] (dropped by the default
grpo.icepop_beta: 2) and above TIS's C = 2 (what verl's token-level TIS would truncate).

    python bench/mismatch.py --shape 9b --layers 2      # GLM-Z1-9B's width and vocabulary, 2 layers (~1.65B)
    python bench/mismatch.py --checkpoint runs/tiny_cpu/checkpoints/step_001270 --temperature 2 --rows 64
                                                         # the trained tiny model, on its task's prompts
    python bench/mismatch.py --shape tiny                # seconds

Random weights (--shape) are a weak test: their next-token distributions are nearly uniform, and they
have none of a trained checkpoint's outlier channels, which are what block-wise fp8 rounds hardest.
"""
import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # first, before bench/ itself: bench/engine.py must not shadow engine.py
from machinery import config  # noqa: E402
import data  # noqa: E402
from machinery import fp8  # noqa: E402
import grpo  # noqa: E402
from machinery import parallel  # noqa: E402
import train  # noqa: E402
from bench import write_results  # noqa: E402
from machinery.engine import SamplingParams, TorchEngine  # noqa: E402
from model import GLM, GLMConfig  # noqa: E402

GENERATORS = [("fp32", torch.float32, None), ("bf16", torch.bfloat16, None), ("fp8", torch.bfloat16, "fp8")]


def learner_model(args):
    if args.checkpoint:
        return GLM.from_pretrained(args.checkpoint, dtype=torch.float32)
    if args.shape == "tiny":
        cfg = GLMConfig(vocab_size=512, hidden_size=256, intermediate_size=640, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=64)
    else:  # GLM-Z1-9B-0414's shapes, fewer layers
        cfg = GLMConfig.from_hf(config.PUBLISHED["GLM-Z1-9B-0414"] | {"num_hidden_layers": args.layers})
    torch.manual_seed(args.seed)
    model = GLM(cfg)
    with torch.no_grad():  # the 0.02 init gives near-flat logits: scale the head to logits of std ~logit_std
        model.lm_head.weight.mul_(args.logit_std / (0.02 * cfg.hidden_size ** 0.5))
    return model


def measure(learner, dtype, quantization, prompts, args):
    """Sample with a generator holding the learner's published weights, then score its tokens with the learner."""
    with torch.device("meta"):
        gen = GLM(learner.cfg).cast_(dtype)
    gen = gen.to_empty(device="cpu")
    if quantization == "fp8":
        fp8.quantize_model_(gen)
    engine = TorchEngine(gen, max_batch=len(prompts))
    engine.update_weights(parallel.full_weights(learner, dtype, quantization), 0)
    sampling = SamplingParams(temperature=args.temperature, max_new_tokens=args.new)
    outs = engine.generate(prompts, sampling, seed=args.seed)
    rows = [(p + o.token_ids, [(len(p), len(o.token_ids))]) for p, o in zip(prompts, outs)]
    with torch.no_grad():
        logp = train.packed_forward(learner, rows, args.temperature)[0]  # [N]: the learner's, fp32
    gen_logp = torch.tensor([x for o in outs for x in o.logprobs])  # [N]: the generator's
    w = torch.exp(logp - gen_logp)  # pi_learner / pi_gen per token
    return {"tokens": len(gen_logp), "mismatch_k3": float(grpo.kl_penalty(gen_logp, logp, "k3").mean()),
            "logp_diff_mean": float((logp - gen_logp).abs().mean()), "logp_diff_max": float((logp - gen_logp).abs().max()),
            "outside_icepop": float(((w < 0.5) | (w > 2.0)).float().mean()), "above_tis_c2": float((w > 2.0).float().mean()),
            "weight_bytes": sum(t.numel() * t.element_size() for t in gen.parameters())}


def markdown(result):
    lines = [f"{result['model']}, {result['rows']} rows x {result['new']} sampled tokens at T = {result['temperature']}, "
             "teacher-forced by the fp32 learner", "",
             "| generator weights | tokens | mismatch_k3 | logp_diff_mean | logp_diff_max | outside IcePop [1/2, 2] | "
             "above TIS C = 2 | generator weights |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, m in result["generators"].items():
        lines.append(f"| {name} | {m['tokens']} | {m['mismatch_k3']:.2e} | {m['logp_diff_mean']:.2e} | "
                     f"{m['logp_diff_max']:.3f} | {m['outside_icepop']:.2%} | {m['above_tis_c2']:.2%} | "
                     f"{m['weight_bytes'] / 2**20:,.2f} MiB |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=("tiny", "9b"), default="9b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--checkpoint", default=None, help="an HF directory to use instead of random weights")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--logit-std", type=float, default=4.0, help="a random model's logits are scaled to this std")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    ap.add_argument("--md")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    learner = learner_model(args)
    n = sum(p.numel() for p in learner.parameters())
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(2, learner.cfg.vocab_size, (args.prompt,), generator=g).tolist() for _ in range(args.rows)]
    if args.checkpoint and os.path.isfile(os.path.join(args.checkpoint, "tokenizer_config.json")):
        from transformers import AutoTokenizer  # a trained tiny model: the synthetic task's own prompts
        tok = AutoTokenizer.from_pretrained(args.checkpoint)
        prompts = [data.render_prompt(tok, ex["prompt"]) for ex in data.synthetic_task(args.rows, args.seed, "test")]
    result = {"model": (args.checkpoint or f"random {args.shape}-shaped GLM, {learner.cfg.num_layers} layers") +
              f" ({n / 1e6:,.1f}M parameters)", "rows": args.rows, "new": args.new, "temperature": args.temperature,
              "generators": {}}
    for name, dtype, quantization in GENERATORS:
        print(f"[mismatch] {name} generator ...", flush=True)
        result["generators"][name] = measure(learner, dtype, quantization, prompts, args)
        print(f"[mismatch] {name}: {result['generators'][name]}", flush=True)
    md = markdown(result)
    print(md)
    write_results(args, result, md)


if __name__ == "__main__":
    main()
