"""
The learner's speed on RL-shaped batches. Writes the "learner" section of docs/benchmarks.md (--write).

    python bench/learner.py                      # both parts, CPU (a few minutes on 2 cores)
    python bench/learner.py --part hf            # only rl_step vs transformers
    python bench/learner.py --before /tmp/old    # the task part on another checkout too, side by side

1. `task`: the RL step a new user meets first. A tiny Glm4ForCausalLM checkpoint with its tokenizer
   (transformers' own class, saved to a temporary directory) is trained by `train.py` on JSONL addition
   prompts, 16 prompts x 8 samples of about 11 tokens (a 5-token prompt, responses cut at 6 tokens):
   median wall-clock seconds per RL step (the first excluded), the learner's share of it, and the
   fraction of the run the generator sat idle waiting for the learner.
2. `hf`: learner tokens/s of `train.rl_step` (packed micro-batches, GRPO loss, AdamW step) against
   transformers' `Glm4ForCausalLM` on the same sequences padded into one batch, as most trainers feed
   them (forward, response-token log-probabilities, the same policy-gradient sum, backward and the same
   AdamW step), side by side in one process on the same weights. Two shapes: (a) many short responses
   like the tiny task, (b) a few long ones. Tokens are real tokens (prompt + response), padding excluded.

--before DIR runs the task part on another checkout's train.py as well, alternating with this one:
`git worktree add --detach /tmp/old <commit>` and `--before /tmp/old` show a change's before and after.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.attention import machine, write_section  # noqa: E402

# The task part's models: the default run's shape (configs/tiny_cpu.yaml) as a dense Glm4ForCausalLM, and a
# wider one, where matmuls take a larger share of the step.
TASK_MODELS = {
    "tiny_cpu's shape (hidden 96, 3 layers, 4 heads / 2 KV)": dict(
        hidden_size=96, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=24),
    "hidden 128, 4 layers, 4 heads / 2 KV": dict(
        hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32),
}
# The hf part's model: wider, with a vocabulary large enough for the lm_head to weigh as it does in real models.
HF_MODEL = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                head_dim=32, vocab_size=4096, max_position_embeddings=8192)
SHAPES = {  # name: (sequences, prompt tokens (lo, hi), response tokens (lo, hi)), lengths uniform in the ranges
    "a": ("many short: 128 sequences, prompt 4-8, response 2-12", 128, (4, 8), (2, 12)),
    "b": ("few long: 4 sequences, prompt 256, response 500-3000", 4, (256, 256), (500, 3000)),
}


def glm4_config(**kw):
    from transformers import Glm4Config
    return Glm4Config(**kw, pad_token_id=0, eos_token_id=1, bos_token_id=None, tie_word_embeddings=False,
                      partial_rotary_factor=0.5, attention_bias=True)


def task_part(repo, steps, shape):
    """train.py of `repo` on a tiny HF checkpoint of the given shape: returns (s/step, learner s/step,
    generator idle, tokens/step)."""
    import data
    from transformers import Glm4ForCausalLM
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        tok = data.make_tiny_tokenizer(ckpt)
        torch.manual_seed(0)
        Glm4ForCausalLM(glm4_config(vocab_size=len(tok), max_position_embeddings=512, **shape)).save_pretrained(ckpt)
        for split in ("train", "test"):
            with open(os.path.join(tmp, f"{split}.jsonl"), "w") as f:
                for ex in data.synthetic_task(800 if split == "train" else 16, seed=0, split=split):
                    f.write(json.dumps({"prompt": ex["prompt"], "label": ex["label"]}) + "\n")
        recipe = {"run_dir": f"{tmp}/run", "model": {"path": ckpt},
                  "data": {"train": f"{tmp}/train.jsonl", "eval": f"{tmp}/test.jsonl"},
                  "rollout": {"chat_template": False, "prompts_per_step": 16, "n": 8, "max_new_tokens": 6,
                              "max_prompt_tokens": 32, "max_batch": 128},
                  "optim": {"lr": 1e-5}, "train": {"rl_steps": steps, "eval_every": 0, "eval_n": 1,
                                                   "eval_max_new_tokens": 6, "parallel": "ddp"}}
        with open(os.path.join(tmp, "task.yaml"), "w") as f:
            json.dump(recipe, f)  # JSON is YAML
        cmd = [sys.executable, os.path.join(repo, "train.py"), "--config", os.path.join(tmp, "task.yaml")]
        run = subprocess.run(cmd, cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if run.returncode:
            sys.exit(f"train.py failed: {run.stderr.strip().splitlines()[-1]}")
        with open(os.path.join(tmp, "run", "metrics.jsonl")) as f:
            rl = [m for m in map(json.loads, f) if m.get("stage") == "rl" and "perf/step_s" in m][1:]
    step = statistics.median(m["perf/step_s"] for m in rl)
    learner = statistics.median(m["perf/step_s"] - m["perf/learner_wait_s"] for m in rl)
    tokens = statistics.median(m["train/tokens"] for m in rl)
    return step, learner, rl[-1]["perf/generator_idle"], tokens


def make_samples(shape, vocab, seed=0):
    from rollout import Sample
    _, count, (p0, p1), (r0, r1) = SHAPES[shape]
    rng = random.Random(seed)
    out = []
    for i in range(count):
        p, r = rng.randint(p0, p1), rng.randint(r0, r1)
        out.append(Sample(prompt_ids=[rng.randrange(2, vocab) for _ in range(p)],
                          response_ids=[rng.randrange(2, vocab) for _ in range(r)], gen_logprobs=[-8.0] * r,
                          reward=float(rng.random() < 0.5), group=i // 8, versions=(0, 0), finish_reason="length",
                          example={}))
    return out


def hf_step(model, optimizer, samples, adv):
    """What a padded trainer does per step: right-padded [B, Lmax] batch, forward, log-probabilities of
    the response tokens, sum_i adv_i * mean_t logp_it as the loss, backward, AdamW step."""
    L = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    ids = torch.zeros(len(samples), L, dtype=torch.long)
    att = torch.zeros(len(samples), L, dtype=torch.long)
    resp = torch.zeros(len(samples), L, dtype=torch.bool)  # targets that are response tokens
    for i, s in enumerate(samples):
        seq = s.prompt_ids + s.response_ids
        ids[i, :len(seq)], att[i, :len(seq)] = torch.tensor(seq), 1
        resp[i, len(s.prompt_ids):len(seq)] = True
    optimizer.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
    logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    m = resp[:, 1:]
    loss = -((logp * m).sum(1) / m.sum(1) * adv).sum() / len(samples)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def hf_part(repeat):
    """[(shape, tokens, ours tokens/s, transformers tokens/s)] on one model, ours loaded from its weights."""
    from machinery import config
    import train
    from model import GLM
    from rollout import RolloutBatch
    from transformers import Glm4ForCausalLM
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        hf = Glm4ForCausalLM(glm4_config(**HF_MODEL)).train()
        hf.save_pretrained(tmp)
        ours = GLM.from_pretrained(tmp)
    cfg = config.Config()
    cfg.optim.lr = 1e-6
    for shape in SHAPES:
        samples = make_samples(shape, HF_MODEL["vocab_size"])
        batch = RolloutBatch(samples=samples, index=0, stream_state={})
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        adv = torch.tensor([s.reward - 0.5 for s in samples])
        opt_ours, opt_hf = (torch.optim.AdamW(m.parameters(), lr=1e-6, betas=(0.9, 0.98), weight_decay=0.1, fused=True)
                            for m in (ours, hf))  # the same optimizer on both sides (train.adamw's)
        times = {"ours": [], "hf": []}
        for i in range(1 + repeat):  # the first round allocates AdamW state: untimed
            for name in ("ours", "hf"):  # interleaved, so drift on the machine hits both alike
                t0 = time.perf_counter()
                if name == "ours":
                    train.rl_step(cfg, ours, None, opt_ours, None, batch, 0)
                else:
                    hf_step(hf, opt_hf, samples, adv)
                if i:
                    times[name].append(time.perf_counter() - t0)
        o, h = (tokens / statistics.median(times[k]) for k in ("ours", "hf"))
        rows.append((shape, tokens, o, h))
        print(f"shape {shape}: {tokens} tokens, rl_step {o:.0f} tokens/s, transformers {h:.0f} tokens/s ({o / h:.2f}x)",
              flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("all", "task", "hf"), default="all")
    ap.add_argument("--before", help="another checkout whose train.py runs the task part too (before a change)")
    ap.add_argument("--steps", type=int, default=16, help="RL steps of the task part")
    ap.add_argument("--repeat", type=int, default=3, help="timed steps per shape in the hf part (median)")
    ap.add_argument("--write", action="store_true", help="write the tables into docs/benchmarks.md")
    args = ap.parse_args()
    text = [f"### Learner: RL step and tokens/s vs transformers ({machine(torch.device('cpu'))})", ""]
    if args.part in ("all", "task"):
        repos = ([("before", os.path.abspath(args.before))] if args.before else []) + [("this checkout", ROOT)]
        rows = []
        for model_name, shape in TASK_MODELS.items():
            for name, repo in repos:  # before and after back to back, per model
                step, learner, idle, tokens = task_part(repo, args.steps, shape)
                rows.append((model_name, name, step, learner, idle, tokens))
                print(f"task, {model_name}, {name}: {step:.3f} s/step, learner {learner:.3f} s/step, generator idle "
                      f"{idle:.0%}, {tokens:.0f} tokens/step", flush=True)
        text += [f"Command: `python bench/learner.py --part task --steps {args.steps}"
                 f"{' --before <checkout>' if args.before else ''}`. train.py on a tiny Glm4ForCausalLM checkpoint "
                 "(character tokenizer) and JSONL addition prompts, 16 prompts x 8 samples of ~11 tokens, float32, one "
                 "step off-policy (learner and generator one thread each); medians over the RL steps but the first.", "",
                 "| model | code | RL step s | learner s / step | generator idle | tokens / step |",
                 "|---|---|---:|---:|---:|---:|"]
        text += [f"| {m} | {n} | {s:.3f} | {l:.3f} | {i:.0%} | {t:.0f} |" for m, n, s, l, i, t in rows]
        if args.before:
            text += ["", "RL step speed-up over `before`: " + ", ".join(
                f"{rows[i][0]} {rows[i][2] / rows[i + 1][2]:.2f}x" for i in range(0, len(rows), 2)) + "."]
        text += [""]
    if args.part in ("all", "hf"):
        rows = hf_part(args.repeat)
        text += [f"Command: `python bench/learner.py --part hf --repeat {args.repeat}`. One GLM-4-shaped model (hidden "
                 "256, 4 layers, 8 heads / 2 KV, vocab 4096), float32, the same weights on both sides; ours is "
                 "`train.rl_step` (packed micro-batches, GRPO loss, AdamW), transformers' is `Glm4ForCausalLM` on the "
                 "same sequences right-padded into one batch (log-probabilities, a policy-gradient loss, backward, "
                 "the same AdamW); median of the timed steps after one warm-up, run interleaved.", "",
                 "| shape | tokens | rl_step tokens/s | transformers tokens/s | ratio |", "|---|---:|---:|---:|---:|"]
        text += [f"| {SHAPES[s][0]} | {n} | {o:.0f} | {h:.0f} | {o / h:.2f}x |" for s, n, o, h in rows]
    if args.write:
        write_section(os.path.join(ROOT, "docs", "benchmarks.md"), "learner", "\n".join(text).rstrip())


if __name__ == "__main__":
    main()
