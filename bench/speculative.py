"""
Speculative decoding's costs on the torch engine (machinery/speculative.py), on the default run's tiny DSA model
(configs/tiny_cpu.yaml's model.init and model.dsa, random weights, its tokenizer's 40-odd ids replaced by a
vocabulary of 64) with an oracle drafter that proposes the plain run's next token with probability p (its own
cost: a host lookup, about nothing; an MTP layer's would be about one decoder layer's forward per draft).

    python bench/speculative.py              # p = 0.7, k = 2 and 3; --p, --k, --rows, --new to change
    python bench/speculative.py --drafter mtp   # the model's MTP layer (machinery/speculative.MTPDrafter), trained
                                                # for --mtp-steps Adam steps with families/mtp.mtp_loss on the plain run
    python bench/speculative.py --adaptive 16   # also a run's adaptive engine (speculating only where it pays) over
                                                # 16 calls, each beside a plain engine's call of the same batch

Printed per k: seconds of a draft step and of a verify step (engine.stats' spec_draft_s / spec_verify_s per verify),
of a plain decode step (the same run without speculation: its decode seconds per step), tokens per row-verify,
the speedup those predict (tokens per verify x plain step / (draft + verify step)), and the one measured on the
engine's busy time (wall seconds of the plain call over the speculative one's, prefills included). The engines
above speculate in every call (Speculative(drafter, k)); with --adaptive CALLS, per k the adaptive one (a run's:
Speculative.of) plays CALLS calls, each timed beside a plain engine's call of the same batch (interleaved, so a busy
CPU slows both alike): its modes call by call (S speculative, P plain), its last figures (engine.stats'
spec_tokens_per_s and plain_tokens_per_s) and its speedup on the engine's busy time (the plain calls' wall seconds
over its own, prefills included).
"""
import argparse
import os
import random
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from machinery.engine import SamplingParams, TorchEngine  # noqa: E402
from families import mtp  # noqa: E402
from machinery.speculative import Drafter, MTPDrafter, Speculative  # noqa: E402
from model import GLM, GLMConfig  # noqa: E402

DSA = {"topk": 8, "heads": 4, "head_dim": 16, "rope_dim": 8, "pattern": "FS"}


class Oracle(Drafter):
    """The plain run's token at each position with probability p, else another one."""

    def __init__(self, plain, p, vocab, seed=0):
        self.plain, self.p, self.vocab, self.rng = plain, p, vocab, random.Random(seed)

    def draft(self, engine, rows, hidden, fresh, k):
        out = []
        for r, s in zip(engine.sched.running, (rows.base + rows.ngen).tolist()):
            want = self.plain[r.index]
            truth = [want[s + j] if s + j < len(want) else 0 for j in range(k)]
            out.append([t if self.rng.random() < self.p else (t + 1) % self.vocab for t in truth])
        return torch.tensor(out, dtype=torch.long).view(-1, k)


def timed_decode(engine):
    """Wrap the engine's plain decode step to accumulate its seconds in stats['decode_s']."""
    decode = engine._decode

    def run():
        t = time.perf_counter()
        decode()
        engine.stats["decode_s"] = engine.stats.get("decode_s", 0.0) + time.perf_counter() - t
    engine._decode = run
    return engine


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--p", type=float, default=0.7)
    ap.add_argument("--k", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--drafter", choices=("oracle", "mtp"), default="oracle")
    ap.add_argument("--mtp-steps", type=int, default=60)
    ap.add_argument("--adaptive", type=int, default=0, metavar="CALLS", help="the adaptive engine over CALLS calls (0: not)")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    vocab = 64
    model = GLM(GLMConfig(vocab_size=vocab, hidden_size=96, intermediate_size=256, num_layers=3, num_heads=4,
                          num_kv_heads=2, head_dim=24, max_position_embeddings=128, dsa=DSA,
                          mtp_layers=int(args.drafter == "mtp"))).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(6, 12))] for _ in range(args.rows)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new)
    plain_engine = timed_decode(TorchEngine(model, max_batch=args.rows))
    plain_engine.generate(prompts, sampling, seed=1)  # warm-up
    plain_engine.stats.clear()
    plain_engine.stats.update(dict.fromkeys(("iterations", "prefills", "prefill_tokens", "retracted", "graph_steps",
                                             "parked", "evicted", "extends", "extend_tokens", "decode_steps", "decode_rows"), 0))
    t = time.perf_counter()
    plain = plain_engine.generate(prompts, sampling, seed=1)
    plain_wall = time.perf_counter() - t
    step = plain_engine.stats["decode_s"] / plain_engine.stats["decode_steps"]
    truth = {i: c.token_ids for i, c in enumerate(plain)}
    if args.drafter == "mtp":  # the MTP layer alone learns the plain run's tokens (the trunk frozen, as RL trains it)
        seqs = [p + c.token_ids for p, c in zip(prompts, plain)]
        ids, pos = torch.tensor([t for s in seqs for t in s])[None], torch.cat([torch.arange(len(s)) for s in seqs])[None]
        with torch.no_grad():
            trunk = model(ids, position_ids=pos, return_hidden="trunk")
        opt = torch.optim.Adam(model.mtp.parameters(), lr=1e-2)
        with torch.enable_grad():
            model.mtp.requires_grad_(True)
            for _ in range(args.mtp_steps):
                loss = mtp.mtp_loss(model, trunk, ids, torch.ones_like(ids), position_ids=pos)
                opt.zero_grad()
                loss.backward()
                opt.step()
            model.mtp.requires_grad_(False)
        print(f"MTP layer trained {args.mtp_steps} steps on the plain run: loss {loss.item():.2f}")
    what = f"oracle p = {args.p}" if args.drafter == "oracle" else "MTP drafter"
    print(f"tiny default model (DSA), {args.rows} rows x {args.new} new tokens, {what}; "
          f"plain decode step {step * 1e3:.2f} ms, call {plain_wall:.2f} s")
    print("k | draft step ms | verify step ms | tokens/verify | accept rate | predicted speedup | measured speedup")
    for k in args.k:
        spec = Speculative(Oracle(truth, args.p, vocab) if args.drafter == "oracle" else MTPDrafter(), k)  # every call
        engine = TorchEngine(model, max_batch=args.rows, speculative=spec)
        engine.generate(prompts, sampling, seed=1)  # warm-up
        engine.stats.clear()
        engine.stats.update(dict.fromkeys(plain_engine.stats, 0))
        t = time.perf_counter()
        out = engine.generate(prompts, sampling, seed=1)
        wall = time.perf_counter() - t
        assert [c.token_ids for c in out] == [c.token_ids for c in plain], "speculation changed the tokens"
        s = engine.stats
        draft, verify = s["spec_draft_s"] / s["spec_verifies"], s["spec_verify_s"] / s["spec_verifies"]
        per = s["spec_tokens"] / s["spec_rows"]
        print(f"{k} | {draft * 1e3:.3f} | {verify * 1e3:.2f} | {per:.2f} | {s['spec_accepted'] / s['spec_drafts']:.2f} | "
              f"{per * step / (draft + verify):.2f} | {plain_wall / wall:.2f}")
        if args.adaptive:
            adaptive(model, plain_engine, prompts, sampling, plain, k, args, truth, vocab)


def adaptive(model, plain_engine, prompts, sampling, plain, k, args, truth, vocab):
    """The adaptive engine (a run's) over args.adaptive calls, each beside a plain call: its modes, figures, speedup."""
    drafter = Oracle(truth, args.p, vocab) if args.drafter == "oracle" else MTPDrafter()
    engine = TorchEngine(model, max_batch=args.rows, speculative=Speculative(drafter, k, adaptive=True))
    modes, walls, plain_walls = [], [], []
    for _ in range(args.adaptive):
        t = time.perf_counter()
        plain_engine.generate(prompts, sampling, seed=1)
        plain_walls.append(time.perf_counter() - t)
        before = engine.stats.get("spec_calls", 0)
        t = time.perf_counter()
        out = engine.generate(prompts, sampling, seed=1)
        walls.append(time.perf_counter() - t)
        assert [c.token_ids for c in out] == [c.token_ids for c in plain], "the adaptive engine changed the tokens"
        modes.append("S" if engine.stats["spec_calls"] > before else "P")
    s = engine.stats
    print(f"  adaptive, k = {k}: {''.join(modes)}; figures {s.get('spec_tokens_per_s', 0):.0f} speculative, "
          f"{s.get('plain_tokens_per_s', 0):.0f} plain tokens/s; busy time speedup {sum(plain_walls) / sum(walls):.2f}")


if __name__ == "__main__":
    main()
