"""
Tool latency, hidden: multi-turn episodes whose tool takes t = 0.3 s, played through env.run_episodes on the
torch engine, against the same episodes with an instant tool, side by side in one run. Writes its table into
docs/benchmarks.md.

    python bench/tool_latency.py          # about a minute on 2 CPU cores

The model is a random GLM (DSA) and its turns end at a stop token (a twentieth of the vocabulary: ~20 tokens a
turn); each trajectory has 8 model turns, and the env answers each of the first 7 with a short observation
after sleeping t. d, the decode time of one turn, is measured first (instant tool); then each run plays rounds
of N = 1.5 rows (d + t) / d trajectories (at least rows (d + t) / d, with a margin for the batch's tail):
enough in flight that while some wait on their tool, others fill every decode row. Reported per run:
- tokens/s: model tokens sampled per second of wall clock;
- occupancy: the decode rows in use over the run's wall clock: the mean rows per decode step / rows, times the
  share of the wall clock spent in engine steps (idle waits for a tool count as empty rows);
- prefill tokens per later turn: what each turn after the first ran through the model, which should be the
  env's new tokens and the previous turn's last sampled token only (its parked KV holds the rest);
- the same with rollout.env_admit_after set (answers admitted at fixed iterations: reproducible), and with
  turns in lockstep (an engine without sessions: every live trajectory's turn in one call, the history
  prefilled again, as before sessions), for contrast.
"""
import argparse
import math
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench import write_results  # noqa: E402
from bench.attention import machine, write_section  # noqa: E402
from data import make_tiny_tokenizer  # noqa: E402
from machinery.engine import SamplingParams, TorchEngine  # noqa: E402
from machinery.env import Episode, Limits, run_episodes  # noqa: E402
from model import GLM, GLMConfig  # noqa: E402

TURNS = 8


class SleepyTool:
    """An env whose tool takes `latency` seconds: 3 calls answered with a short observation, then done."""
    latency = 0.0

    def __init__(self, example):
        self.n, self.k = 0, example["k"]

    def reset(self):  # a prompt of its own (identical prompts would share one prefill, blurring the count)
        return [{"role": "user", "content": f"{self.k}*34="}]

    def step(self, text):
        self.n += 1
        if self.n >= TURNS:
            return [], 1.0, True
        time.sleep(self.latency)
        return [{"role": "observation", "content": "408"}], 0.0, False, {"tool_calls": 1}


class Lockstep:
    """The engine without sessions: run_episodes plays turns in lockstep (env._lockstep)."""
    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        if name == "session":
            raise AttributeError(name)
        return getattr(self.engine, name)


def run(engine, tok, n, latency, admit_after=None, lockstep=False, rounds=1):
    """Play `rounds` batches of n trajectories, one after the other; returns the measurements (the engine's
    stats are reset first)."""
    SleepyTool.latency = latency
    engine.stats = {k: 0 for k in engine.stats}
    stepping = [0.0]
    real_step = engine.step

    def timed_step():  # wall clock inside engine steps (the rest is waiting on tools, or the loop's own work;
        # stream(), which lockstep calls, steps through here too)
        t0 = time.perf_counter()
        try:
            return real_step()
        finally:
            stepping[0] += time.perf_counter() - t0
    engine.step = timed_step
    vocab = len(tok)
    stops = tuple(range(5, vocab, 20))  # a twentieth of the ids end a turn (the random model samples ~uniformly)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=200, stop_token_ids=stops)
    limits = Limits(max_new_tokens=200, max_total_tokens=2000, max_turns=TURNS, timeout_s=30, admit_after=admit_after)
    eps, wall = [], 0.0
    for k in range(rounds):
        batch = [Episode({"k": i}, i) for i in range(n)]
        t0 = time.perf_counter()
        for _ in run_episodes(Lockstep(engine) if lockstep else engine, batch, SleepyTool, tok, sampling, limits, seed=k):
            pass
        wall += time.perf_counter() - t0
        eps += batch
    del engine.step
    s = engine.stats
    tokens = sum(ep.model_tokens for ep in eps)
    turns = sum(ep.turns for ep in eps)
    later = sum(ep.turns - 1 for ep in eps)
    new = sum(start - (prev + k) + 1 for ep in eps for (prev, k), (start, _) in zip(ep.spans, ep.spans[1:]))
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "turns": turns,
            "turn_tokens": tokens / turns, "rows_per_step": s["decode_rows"] / max(1, s["decode_steps"]),
            "occupancy": s["decode_rows"] / max(1, s["decode_steps"]) / engine.max_batch * min(1.0, stepping[0] / wall),
            "step_s": stepping[0] / max(1, s["iterations"]), "decode_steps": s["decode_steps"],
            "prefill_per_later_turn": (s["prefill_tokens"] - sum(len(ep.prompt) for ep in eps)) / max(1, later),
            "new_per_later_turn": new / max(1, later), "evicted": s["evicted"],
            "failed": sum(ep.failure is not None for ep in eps)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16, help="decode rows (rollout.max_batch)")
    ap.add_argument("--latency", type=float, default=0.3, help="the tool's seconds per call")
    ap.add_argument("--rounds", type=int, default=2, help="batches of N trajectories per run")
    ap.add_argument("--out", default="docs/benchmarks.md")
    ap.add_argument("--json")
    ap.add_argument("--md")
    args = ap.parse_args()
    torch.manual_seed(0)
    tok = make_tiny_tokenizer(tools=True)
    cfg = GLMConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8, num_kv_heads=2,
                    head_dim=32, max_position_embeddings=2048,
                    dsa={"topk": 64, "heads": 4, "head_dim": 32, "rope_dim": 16, "pattern": "FS"})
    engine = TorchEngine(GLM(cfg).eval(), max_batch=args.rows)
    run(engine, tok, args.rows, 0.0)  # warm-up
    probe = run(engine, tok, 2 * args.rows, 0.0)
    d = probe["step_s"] * probe["turn_tokens"]  # the decode time of one turn, all rows busy
    need = args.rows * (d + args.latency) / d
    n = math.ceil(1.5 * need)
    admit = math.ceil(1.5 * args.latency / probe["step_s"])  # fixed admission: later than the tool, with margin
    print(f"d = {d * 1e3:.0f} ms a turn ({probe['turn_tokens']:.1f} tokens x {probe['step_s'] * 1e3:.1f} ms a step); "
          f"rows (d + t) / d = {need:.0f}: {n} trajectories in flight", flush=True)
    cases = [("instant tool", 0.0, None, False), (f"tool {args.latency:g} s", args.latency, None, False),
             (f"tool {args.latency:g} s, env_admit_after {admit}", args.latency, admit, False),
             (f"tool {args.latency:g} s, turns in lockstep (no sessions)", args.latency, None, True)]
    results = {}
    for name, latency, admit_after, lockstep in cases:
        r = run(engine, tok, n, latency, admit_after, lockstep, args.rounds)
        results[name] = r
        print(f"{name}: {r['tokens_per_s']:.0f} tokens/s, occupancy {r['occupancy']:.0%}, prefill "
              f"{r['prefill_per_later_turn']:.1f} tokens per later turn (new: {r['new_per_later_turn']:.1f}), "
              f"{r['wall_s']:.1f} s", flush=True)
    base = results["instant tool"]
    rows = [f"| {name} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f} | "
            f"{r['occupancy']:.0%} | {r['occupancy'] / base['occupancy']:.2f} | {r['prefill_per_later_turn']:.1f} | "
            f"{r['new_per_later_turn']:.1f} | {r['wall_s']:.1f} |" for name, r in results.items()]
    md = "\n".join([
        f"### Tool latency hidden by the engine's sessions ({machine(torch.device('cpu'))})",
        "",
        f"Command: `python bench/tool_latency.py` (a random 4-layer DSA GLM, hidden 256, {args.rows} decode rows; "
        f"{args.rounds} batches of {n} trajectories of {TURNS} model turns, ~{probe['turn_tokens']:.0f} tokens a turn; one decode "
        f"step {probe['step_s'] * 1e3:.1f} ms, so a turn decodes in d = {d * 1e3:.0f} ms, and a tool of "
        f"t = {args.latency:g} s needs rows (d + t) / d = {need:.0f} trajectories in flight: each batch has {n}). "
        "Occupancy: the decode rows in use over the wall clock. Prefill per later turn: tokens run through the "
        "model for each turn after a trajectory's first; new: the env's answer plus the last sampled token. "
        "Ratios are to the instant tool's run, in the same process, one after the other.",
        "",
        "| tool | tokens/s | vs instant | occupancy | vs instant | prefill / later turn | new / later turn | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ] + rows)
    print(md)
    write_results(args, {"d_s": d, "need": need, "n": n, "admit_after": admit, "results": results}, md)
    if args.out:
        write_section(os.path.join(ROOT, args.out), "tool-latency", md)


if __name__ == "__main__":
    main()
