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

Controlled acceptance at a real model's shapes (--decode; bench/gpu.sh part 9): random weights accept nothing, so the
drafter is the oracle, on the device (its drafts cost a lookup), and the figure is decode tokens/s with and without
speculation, CUDA graphs on where CUDA is (the plain decode's and the verify's: graphs.DecodeGraphs.verify):

    python bench/speculative.py --decode --device cuda --shape flash    # GLM-4.7-Flash (bench/moe.py's) cut to 4
                                                                        # layers, k = 3, p = 0.7, 256 and 64 rows
    python bench/speculative.py --decode --shape flash --quick          # on a CPU: its widths shrunk, 16 rows of 32
                                                                        # new tokens (seconds; graphs' buckets eager)

Per rows: the plain engine's and the speculative engine's decode tokens/s (B (new - 1) tokens over a call of `new`
tokens less a call of one, the prefill's), their ratio, the tokens per row-verify, and the acceptance rate measured on
the engine: the drafts it accepted over the drafts it tested (each row's accepted ones and its first rejected one,
where it had one), which is p if the engine accepts exactly the drafts that equal the plain run's token (checked: the
engine's accepted count equals the oracle's own count of leading matches). The tokens are checked to be the plain
engine's.
"""
import argparse
import dataclasses
import os
import random
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench import write_results  # noqa: E402
from bench.moe import arch_of  # noqa: E402
from machinery.engine import SamplingParams, TorchEngine  # noqa: E402
from families import mtp  # noqa: E402
from machinery.sampler import _M32, sample_keys  # noqa: E402
from machinery.speculative import Drafter, MTPDrafter, Speculative  # noqa: E402
from model import GLM, GLMConfig, to_device  # noqa: E402

DSA = {"topk": 8, "heads": 4, "head_dim": 16, "rope_dim": 8, "pattern": "FS"}


class Oracle(Drafter):
    """The plain run's token at each position with probability p, else another one (the next id). plain: {request index:
    its tokens}. The coin for (request, token index) is a hash of the request's noise seed, the index and `seed`, so
    the drafts never depend on the batch; all on the device, no host read. It counts, on the device, the drafts a correct
    engine accepts (each row's leading matches, as far as it may go) in `hits` and the drafts it tests (those and
    the first mismatch, where there is one) in `tested`."""

    def __init__(self, plain, p, vocab, seed=0):
        n = max(plain) + 1
        width = max((len(t) for t in plain.values()), default=0) + 1  # (past a row's tokens: 0, as a padding draft)
        self.truth = torch.zeros(n, width, dtype=torch.long)  # [requests, tokens]
        for i, t in plain.items():
            self.truth[i, :len(t)] = torch.tensor(t, dtype=torch.long)
        self.p, self.vocab, self.seed = p, vocab, seed
        self.hits = self.tested = 0

    def draft(self, engine, rows, hidden, fresh, k):
        dev = rows.seeds.device
        self.truth = self.truth.to(dev)
        idx = to_device([r.index for r in engine.sched.running], dev, torch.long)
        step = rows.base[:, None] + rows.ngen[:, None] + torch.arange(k, device=dev)  # [B, k] token j's index
        truth = self.truth[idx[:, None], step.clamp_max(self.truth.shape[1] - 1)]
        coin = (sample_keys(rows.seeds[:, None] ^ self.seed, step + (1 << 20)) & _M32).double() / 2**32  # [B, k] in [0, 1)
        hit = coin < self.p
        n = torch.where(rows.status == 0, (rows.left - rows.ngen - 1).clamp(0, k), 0)  # [B] drafts a row can use
        a = torch.minimum(hit.long().cumprod(1).sum(1), n)
        self.hits = self.hits + a.sum()
        self.tested = self.tested + torch.minimum(a + 1, n).sum()
        return torch.where(hit, truth, (truth + 1) % self.vocab)


def timed_decode(engine):
    """Wrap the engine's plain decode step to accumulate its seconds in stats['decode_s']."""
    decode = engine._decode

    def run():
        t = time.perf_counter()
        decode()
        engine.stats["decode_s"] = engine.stats.get("decode_s", 0.0) + time.perf_counter() - t
    engine._decode = run
    return engine


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_rate(engine, prompts, sampling, new, plain=None, reset=None):
    """A warm-up call (the pool sized, every bucket captured), then calls of 1 and of `new` tokens -> (decode tokens/s,
    the longer call's completions): B (new - 1) tokens over the difference of their seconds. plain: the completions the
    longer call must give (the plain engine's); reset: called after the warm-up (counters over the timed calls)."""
    dev = engine.device
    engine.generate(prompts, dataclasses.replace(sampling, max_new_tokens=new), seed=1)
    if reset:
        reset()
    times, out = {}, None
    for n in (1, new):  # (1 new token: the prefill, and its sampling)
        sync(dev)
        t = time.perf_counter()
        out = engine.generate(prompts, dataclasses.replace(sampling, max_new_tokens=n), seed=1)
        sync(dev)
        times[n] = time.perf_counter() - t
    assert all(len(c.token_ids) == new for c in out)  # no stop tokens: every row runs to the limit
    if plain is not None:
        assert [c.token_ids for c in out] == [c.token_ids for c in plain], "speculation changed the tokens"
    return len(prompts) * (new - 1) / max(times[new] - times[1], 1e-9), out


def controlled(args):
    """--decode: decode tokens/s with and without speculation at controlled acceptance (the docstring's last part)."""
    device = torch.device(args.device)
    arch = arch_of(args.shape, args.layers, args.quick)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = GLM(arch).cast_(dtype)  # the generator's copy, as engine.make_engine (FP32_PARAMS stay fp32)
    g = torch.Generator().manual_seed(2)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new, stop_token_ids=())
    k, rows = args.k[-1], []
    for B in args.rows:
        prompts = [torch.randint(2, arch.vocab_size, (args.prompt,), generator=g).tolist() for _ in range(B)]
        # graphs on both sides (on a CPU the same padded buckets run eagerly: DecodeGraphs' capture=False)
        plain_rate, plain = decode_rate(TorchEngine(model, max_batch=B, graphs=True), prompts, sampling, args.new)
        oracle = Oracle({i: c.token_ids for i, c in enumerate(plain)}, args.p, arch.vocab_size)
        engine = TorchEngine(model, max_batch=B, graphs=True, speculative=Speculative(oracle, k))
        def reset():  # the counters over the timed calls (the one-token call decodes nothing)
            oracle.hits = oracle.tested = 0
            engine.stats.update({key: 0 for key in engine.stats if key.startswith("spec_")})
        spec_rate, _ = decode_rate(engine, prompts, sampling, args.new, plain, reset)
        s, hits, tested = engine.stats, int(oracle.hits), int(oracle.tested)
        assert s["spec_accepted"] == hits, (s["spec_accepted"], hits)  # the engine accepts exactly the leading matches
        v = engine.graphs.verify
        note = "verify graphs fell back to eager" if v.capture and (v.failed or not v.graphs) else ""
        rows.append(dict(rows=B, k=k, p=args.p, plain_tokens_per_s=plain_rate, spec_tokens_per_s=spec_rate,
                         speedup=spec_rate / plain_rate, tokens_per_verify=s["spec_tokens"] / s["spec_rows"],
                         accept_rate=s["spec_accepted"] / tested, captured=v.capture, note=note))
        print(f"{B} rows, k = {k}: plain {plain_rate:.0f}, speculative {spec_rate:.0f} decode tokens/s "
              f"({spec_rate / plain_rate:.2f}x); {rows[-1]['tokens_per_verify']:.2f} tokens per row-verify, "
              f"acceptance {rows[-1]['accept_rate']:.3f} (p = {args.p}) {note}", flush=True)
    what = f"{args.shape}{' (widths shrunk)' if args.quick else ''}, {arch.num_layers} layers, random weights"
    md = "\n".join([f"### Speculative decoding at controlled acceptance ({what}, {device.type}, {dtype})", "",
                     f"Command: `python bench/speculative.py {' '.join(sys.argv[1:])}`. Oracle drafter: the plain run's "
                     f"token with probability p, else another; prompts of {args.prompt} tokens, {args.new} new tokens a row, "
                     "CUDA graphs on (decode and verify)" + ("." if device.type == "cuda" else
                                                             ": on a CPU their padded buckets run eagerly."), "",
                     "| rows | k | p | plain decode tok/s | speculative decode tok/s | speedup | tokens / row-verify | "
                     "acceptance | note |", "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
                    + [f"| {r['rows']} | {r['k']} | {r['p']} | {r['plain_tokens_per_s']:.0f} | "
                       f"{r['spec_tokens_per_s']:.0f} | {r['speedup']:.2f}x | {r['tokens_per_verify']:.2f} | "
                       f"{r['accept_rate']:.3f} | {r['note']} |" for r in rows])
    print(md, flush=True)
    write_results(args, dict(command=" ".join(sys.argv), shape=args.shape, layers=arch.num_layers, rows=rows), md)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--p", type=float, default=0.7)
    ap.add_argument("--k", type=int, nargs="+", default=None, help="drafts per step (default 2 3; --decode: 3)")
    ap.add_argument("--rows", type=int, nargs="+", default=None, help="rows (default 16; --decode: 256 64)")
    ap.add_argument("--new", type=int, default=None, help="new tokens a row (default 48; --decode: 64)")
    ap.add_argument("--drafter", choices=("oracle", "mtp"), default="oracle")
    ap.add_argument("--mtp-steps", type=int, default=60)
    ap.add_argument("--adaptive", type=int, default=0, metavar="CALLS", help="the adaptive engine over CALLS calls (0: not)")
    ap.add_argument("--decode", action="store_true", help="decode tokens/s at controlled acceptance (the docstring's end)")
    ap.add_argument("--device", default="cpu", help="--decode: the device")
    ap.add_argument("--shape", choices=("flash", "tiny", "wide"), default="flash", help="--decode: bench/moe.py's shape")
    ap.add_argument("--layers", type=int, default=4, help="--decode, flash: decoder layers kept")
    ap.add_argument("--prompt", type=int, default=128, help="--decode: prompt tokens a row")
    ap.add_argument("--quick", action="store_true", help="--decode: flash's widths shrunk (bench/moe.py's), 16 rows")
    ap.add_argument("--json", help="--decode: write the raw results here")
    ap.add_argument("--md", help="--decode: write the markdown table here")
    args = ap.parse_args(argv)
    if args.decode:
        args.k, args.new = args.k or [3], args.new or (32 if args.quick else 64)
        args.rows = args.rows or ([16] if args.quick else [256, 64])
        args.prompt = 8 if args.quick else args.prompt
        return controlled(args)
    args.k, args.rows, args.new = args.k or [2, 3], (args.rows or [16])[0], args.new or 48
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
