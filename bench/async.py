"""
Asynchronous vs synchronous RL, and the embedded engine's generation speed. Writes two tables into
docs/benchmarks.md.

    python bench/async.py                 # both parts (a few minutes on 2 CPU cores)
    python bench/async.py --part engine   # only the generation throughput

1. `rl`: the tiny default run (configs/tiny_cpu.yaml) with `rollout.max_staleness` 0 (synchronous: the
   generator waits for every update) and 1 (one step off-policy: the next batch is generated while the
   learner trains), same seed and steps, run one after the other: wall-clock per RL step, and the
   fraction of time the generator and the learner each sat idle waiting for the other.
2. `engine`: tokens/s of TorchEngine.generate against transformers' `generate` on the same dense
   model (ours saved, loaded into Glm4ForCausalLM), the same left-padded batch and the same number of
   new tokens (no early stop), sampling at temperature 1.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.attention import machine, write_section  # noqa: E402
from model import GLM, GLMConfig  # noqa: E402
from rollout import SamplingParams, TorchEngine  # noqa: E402


def rl_part(steps, config):
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        # The warm-up stages once; both RL runs start from the same checkpoint.
        warm = os.path.join(tmp, "warm")
        subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config", config, f"run_dir={warm}",
                        "train.rl_steps=0"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        start = sorted(os.listdir(os.path.join(warm, "checkpoints")))[-1]
        for staleness in (0, 1):
            run_dir = os.path.join(tmp, f"staleness{staleness}")
            cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", config, f"run_dir={run_dir}",
                   f"model.path={os.path.join(warm, 'checkpoints', start)}", "model.init=null",
                   "train.dsa_warmup_steps=0", "train.sft_steps=0", f"rollout.max_staleness={staleness}",
                   f"train.rl_steps={steps}", "train.eval_every=0"]
            subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            with open(os.path.join(run_dir, "metrics.jsonl")) as f:
                lines = [json.loads(line) for line in f]
            rl = [m for m in lines if m.get("stage") == "rl" and "perf/step_s" in m][1:]  # step 1 waits for batch 0
            step_s = statistics.median(m["perf/step_s"] for m in rl)
            learner_idle = sum(m["perf/learner_wait_s"] for m in rl) / sum(m["perf/step_s"] for m in rl)
            rows.append((staleness, len(rl), step_s, rl[-1]["perf/generator_idle"], learner_idle))
            print(f"max_staleness {staleness}: {step_s:.2f} s/step, generator idle {rows[-1][3]:.0%}, "
                  f"learner idle {rows[-1][4]:.0%}", flush=True)
    speedup = rows[0][2] / rows[1][2]
    return "\n".join([
        f"### Async vs sync RL, tiny default ({machine(torch.device('cpu'))})",
        "",
        f"Command: `python bench/async.py --part rl --steps {steps}` ({config} after its warm-up stages, "
        f"{steps} RL steps each, "
        f"median step time excluding the first; the learner's idle time is its wait for a batch, the "
        f"generator's its wait on the staleness gate). One step off-policy (`max_staleness: 1`) runs "
        f"{speedup:.2f}x as many RL steps per second as synchronous (`max_staleness: 0`).",
        "",
        "| max_staleness | RL steps | s / step | generator idle | learner idle |",
        "|---:|---:|---:|---:|---:|",
    ] + [f"| {s} | {n} | {t:.2f} | {g:.0%} | {l:.0%} |" for s, n, t, g, l in rows])


def engine_part(batch, new_tokens, repeat):
    from transformers import Glm4ForCausalLM

    torch.manual_seed(0)
    cfg = GLMConfig(vocab_size=512, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=8,
                    num_kv_heads=2, head_dim=32, max_position_embeddings=1024)
    ours = GLM(cfg).eval()
    with tempfile.TemporaryDirectory() as d:
        ours.save_pretrained(d)
        hf = Glm4ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(8, 33, (batch,), generator=g).tolist()
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    P = max(lens)
    ids = torch.zeros(batch, P, dtype=torch.long)
    mask = torch.zeros(batch, P, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):], mask[i, P - len(p):] = torch.tensor(p), 1
    engine = TorchEngine(ours, max_batch=batch)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)

    def run_ours():
        out = engine.generate(prompts, sampling, seed=0)
        assert all(len(c.token_ids) == new_tokens for c in out)

    def run_hf():
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                              top_k=0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
                              eos_token_id=None, output_scores=True, return_dict_in_generate=True)
        assert out.sequences.shape[1] == P + new_tokens

    times = {}
    for name, fn in (("ours", run_ours), ("hf", run_hf)):
        fn()  # warm-up
        ts = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        times[name] = statistics.median(ts)
        print(f"{name}: {batch * new_tokens / times[name]:.0f} tokens/s", flush=True)
    tok = batch * new_tokens
    return "\n".join([
        f"### Generation throughput, TorchEngine vs transformers generate ({machine(torch.device('cpu'))})",
        "",
        f"Command: `python bench/async.py --part engine`. Dense GLM, 4 layers, hidden 256, 8 heads (2 KV), "
        f"vocab 512, float32; {batch} left-padded prompts of 8-32 tokens, {new_tokens} new tokens each "
        f"(no early stop), temperature 1, per-token scores returned by both; median of {repeat}. "
        f"TorchEngine is {times['hf'] / times['ours']:.2f}x transformers' speed.",
        "",
        "| engine | s / batch | new tokens / s |",
        "|---|---:|---:|",
        f"| TorchEngine (rollout.py) | {times['ours']:.2f} | {tok / times['ours']:.0f} |",
        f"| transformers `generate` | {times['hf']:.2f} | {tok / times['hf']:.0f} |",
    ])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["all", "rl", "engine"], default="all")
    ap.add_argument("--config", default="configs/tiny_cpu.yaml")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="docs/benchmarks.md")
    args = ap.parse_args()
    if args.part in ("all", "rl"):
        table = rl_part(args.steps, args.config)
        print(table)
        if args.out:
            write_section(os.path.join(ROOT, args.out), "async-rl", table)
    if args.part in ("all", "engine"):
        table = engine_part(args.batch, args.new_tokens, args.repeat)
        print(table)
        if args.out:
            write_section(os.path.join(ROOT, args.out), "engine-throughput", table)


if __name__ == "__main__":
    main()
