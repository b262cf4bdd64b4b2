"""
Generation throughput of engine.TorchEngine (continuous batching over a paged KV pool) against
transformers' `generate` and against the static-batch engine it replaced (kept below as StaticEngine,
a benchmark baseline only), on the same model and batch size, side by side in one run.

    python bench/engine.py                      # prints the table (a few minutes on 2 CPU cores)
    python bench/engine.py --write              # and rewrites its section of docs/benchmarks.md
    python bench/engine.py --dtype bfloat16     # every engine in bf16 weights (the generator's GPU dtype)
    python bench/engine.py --compile            # adds our engine with its decode forward under torch.compile

Model: dense GLM, 4 layers, hidden 256, 8 heads (2 KV), vocab 512, random weights in --dtype (float32; every
engine the same); sampling at temperature 1 with per-token logprobs from every engine. Every engine decodes
at most --batch rows at once.

- `uniform`: --batch prompts of 8-32 tokens, 64 new tokens each (no early stop).
- `rl`: 32 prompts x 8 samples = 256 requests whose response lengths are heavy tailed, as RL's are: 85 %
  draw 8-32 tokens, 15 % 33-256, and one is 256 (the limit). A random model does not stop by itself, so
  each request carries its drawn length as its own max_new_tokens: a row finishes there, as it would at
  its stop token. transformers' `generate` has no per-row limit; like any row at EOS it keeps computing
  finished rows, so it runs batches of --batch requests in submission order, each to its longest member's
  length.

What is counted: new tokens that the requests asked for (the sum of their lengths) per second of wall
clock, the same numerator for every engine; the median of --repeat rounds after a warm-up, each round
running every engine once (interleaved, so that drift on the machine hits them alike).

`--compile` adds a row, `compiled`: the same TorchEngine with its decode forward (engine.decode_forward, the
model over the paged pool) under torch.compile (dynamic shapes, one graph; sampling stays eager). The engine
has no such option: this row measures what compiling would buy on a CPU (on a GPU, CUDA graphs remove the
per-op overhead instead). Its compile time is in the warm-up round, untimed, and printed apart.
"""
import argparse
import atexit
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.attention import machine, write_section  # noqa: E402
from model import GLM, GLMConfig, KVCache  # noqa: E402
from machinery import engine  # noqa: E402
from machinery.engine import Completion, SamplingParams, TorchEngine  # noqa: E402
from bench import op_count  # noqa: E402


class StaticEngine:
    """The static-batch engine as engine.TorchEngine was before continuous batching (a baseline for this
    benchmark, not used anywhere else): batches of max_batch requests, longest prompt first, left-padded
    into a KVCache of prompt + max_new_tokens slots; each batch runs until its longest row is done, and
    rows that finish are copied out of the cache. One change for the `rl` workload: each request may
    carry its own max_new_tokens (a list of SamplingParams), reached as if it were a stop token."""

    def __init__(self, model, max_batch):
        self.model, self.max_batch, self.device = model.eval(), max_batch, next(model.parameters()).device

    def generate(self, prompts, sampling, seed=None):
        per_row = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        out = [None] * len(prompts)
        for b in range(0, len(order), self.max_batch):
            rows = order[b:b + self.max_batch]
            for i, c in zip(rows, self._batch([prompts[i] for i in rows], [per_row[i] for i in rows], gen)):
                out[i] = c
        return out

    @staticmethod
    def sample(logits, temperature, gen):
        """The sampler it had: torch.multinomial on one torch.Generator for the whole batch."""
        logp = (logits.float() / temperature).log_softmax(-1)
        tokens = torch.multinomial(logp.exp(), 1, generator=gen)[:, 0]
        return tokens, logp.gather(-1, tokens[:, None])[:, 0]

    @torch.no_grad()
    def _batch(self, prompts, per_row, gen):
        sampling, limits = per_row[0], [s.max_new_tokens for s in per_row]
        B, P, longest = len(prompts), max(len(p) for p in prompts), max(limits)
        ids = torch.zeros(B, P, dtype=torch.long)
        mask = torch.zeros(B, P, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, P - len(p):], mask[i, P - len(p):] = torch.tensor(p), 1
        pos = (mask.cumsum(1) - 1).clamp_min(0)
        cache = KVCache(self.model.cfg, B, P + longest, self.device, next(self.model.parameters()).dtype)
        logits = self.model(ids, position_ids=pos, attention_mask=mask, cache=cache, keep=slice(-1, None))[:, -1]
        tokens, logps, finish = [[] for _ in range(B)], [[] for _ in range(B)], [None] * B
        alive, next_pos = torch.arange(B), pos[:, -1] + 1
        stop = torch.tensor(sorted(set(sampling.stop_token_ids)), dtype=torch.long)
        for step in range(longest):
            tok, lp = self.sample(logits, sampling.temperature, gen)
            done = torch.isin(tok, stop) if len(stop) else torch.zeros_like(tok, dtype=torch.bool)
            for j, (r, t, l) in enumerate(zip(alive.tolist(), tok.tolist(), lp.tolist())):
                tokens[r].append(t)
                logps[r].append(l)
                if len(tokens[r]) == limits[r]:
                    done[j] = True
            for r in alive[done].tolist():
                finish[r] = "stop"
            keep = ~done
            if not keep.any():
                break
            if not keep.all():  # KVCache.keep as it was: every layer's cache copied without the finished rows
                rows = keep.nonzero()[:, 0]
                for store in (cache.k, cache.v, cache.index_k):
                    for i, t in enumerate(store):
                        if t is not None:
                            store[i] = t[rows]
                cache.key_mask = cache.key_mask[rows]
                alive, tok, next_pos = alive[keep], tok[keep], next_pos[keep]
            logits = self.model(tok[:, None], position_ids=next_pos[:, None], cache=cache)[:, -1]
            next_pos = next_pos + 1
        return [Completion(tokens[i], logps[i], finish[i] or "length", (0, 0)) for i in range(B)]


def workloads(cfg, batch):
    g = torch.Generator().manual_seed(1)

    def prompt():
        return torch.randint(3, cfg.vocab_size, (int(torch.randint(8, 33, (1,), generator=g)),), generator=g).tolist()

    uniform = [(prompt(), 64) for _ in range(batch)]
    rl = []
    for _ in range(32):
        p = prompt()
        for _ in range(8):
            long = torch.rand(1, generator=g).item() < 0.15
            rl.append((p, int(torch.randint(33, 257, (1,), generator=g)) if long else int(torch.randint(8, 33, (1,), generator=g))))
    rl[int(torch.randint(0, len(rl), (1,), generator=g))] = (rl[0][0], 256)
    return {"uniform": uniform, "rl": rl}


def hf_runner(hf, work, batch):
    """transformers' generate, batches of `batch` requests in order, each run to its longest length."""
    def run():
        for b in range(0, len(work), batch):
            chunk = work[b:b + batch]
            P, new = max(len(p) for p, _ in chunk), max(n for _, n in chunk)
            ids = torch.zeros(len(chunk), P, dtype=torch.long)
            mask = torch.zeros(len(chunk), P, dtype=torch.long)
            for i, (p, _) in enumerate(chunk):
                ids[i, P - len(p):], mask[i, P - len(p):] = torch.tensor(p), 1
            with torch.no_grad():
                out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                                  top_k=0, max_new_tokens=new, min_new_tokens=new, pad_token_id=0, eos_token_id=None,
                                  output_scores=True, return_dict_in_generate=True)
            assert out.sequences.shape[1] == P + new
    return run


def engine_runner(eng, work, decode_forward=None):
    """Our engine (or the static one) on the workload; decode_forward replaces machinery/engine.py's for the run."""
    prompts = [p for p, _ in work]
    sampling = [SamplingParams(temperature=1.0, max_new_tokens=n) for _, n in work]

    def run():
        plain = engine.decode_forward
        engine.decode_forward = decode_forward or plain
        try:
            out = eng.generate(prompts, sampling, seed=0)
        finally:
            engine.decode_forward = plain
        assert [len(c.token_ids) for c in out] == [n for _, n in work]
    return run


def first_timed(run, firsts: list):
    """run, whose first call (the compilation, in the untimed warm-up) is timed into firsts."""
    def call():
        t0 = time.perf_counter()
        run()
        if not call.timed:
            firsts.append(time.perf_counter() - t0)
            call.timed = True
    call.timed = False
    return call


def engine_facts(model, work, batch):
    """One `rl` run of our engine: its iterations and prefills, and the ATen ops of a decode step (the
    median over the run's steps; the same at any number of rows)."""
    engine, ops = TorchEngine(model, max_batch=batch), []

    def counted(decode=engine._decode):
        with op_count() as c:
            decode()
        ops.append(c.ops)
    engine._decode = counted
    engine_runner(engine, work)()
    return engine.stats["iterations"], engine.stats["prefills"], statistics.median(ops)


def timed(fns, repeat):
    """Median seconds of each function over `repeat` rounds after a warm-up, run interleaved (one call of
    each per round), so that drift on the machine hits every engine alike."""
    for fn in fns.values():
        fn()
    ts = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            ts[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in ts.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--engines", default="ours,static,hf")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="every engine's weights")
    ap.add_argument("--compile", action="store_true", help="add our engine with a torch.compiled decode forward")
    ap.add_argument("--write", action="store_true", help="rewrite the engine section of docs/benchmarks.md")
    args = ap.parse_args()
    from transformers import Glm4ForCausalLM

    torch.manual_seed(0)
    cfg = GLMConfig(vocab_size=512, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=8,
                    num_kv_heads=2, head_dim=32, max_position_embeddings=1024)
    dtype = getattr(torch, args.dtype)
    ours = GLM(cfg).eval().to(dtype)
    with tempfile.TemporaryDirectory() as d:
        ours.save_pretrained(d)
        hf = Glm4ForCausalLM.from_pretrained(d, dtype=dtype).eval()
    names = {"ours": "TorchEngine, continuous batching (engine.py)", "static": "static batches (the engine before)",
             "hf": "transformers `generate`", "compiled": "TorchEngine, decode forward under torch.compile"}
    engines = args.engines.split(",") + (["compiled"] if args.compile else [])
    compiled = None
    if args.compile:  # compiled from scratch: an empty cache of inductor's, so that the compile time printed is a cold one
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache = tempfile.mkdtemp(prefix="bench-engine-inductor-")
        atexit.register(shutil.rmtree, cache, ignore_errors=True)
        compiled = torch.compile(engine.decode_forward, dynamic=True, fullgraph=True)
    results, firsts = {}, []
    for shape, work in workloads(cfg, args.batch).items():
        tokens = sum(n for _, n in work)
        runners = {"ours": lambda: engine_runner(TorchEngine(ours, max_batch=args.batch), work),
                   "static": lambda: engine_runner(StaticEngine(ours, args.batch), work),
                   "hf": lambda: hf_runner(hf, work, args.batch),
                   "compiled": lambda: first_timed(engine_runner(TorchEngine(ours, max_batch=args.batch), work, compiled), firsts)}
        secs = timed({name: runners[name]() for name in engines}, args.repeat)
        for name, t in secs.items():
            results[shape, name] = (t, tokens / t)
            print(f"{shape:8} {name:7} {t:7.2f} s  {tokens / t:8.0f} new tokens/s", flush=True)
    vs_hf = lambda shape, n: f"{results[shape, n][1] / results[shape, 'hf'][1]:.2f}x" if "hf" in engines else "-"
    rows = [f"| {shape} | {names[n]} | {results[shape, n][0]:.2f} | {results[shape, n][1]:.0f} | {vs_hf(shape, n)} |"
            for shape in ("uniform", "rl") for n in engines]  # (--engines without hf: no ratio column to fill)
    flag = ("" if args.dtype == "float32" else f" --dtype {args.dtype}") + (" --compile" if args.compile else "")
    lines = [f"### Generation engine, continuous batching vs static batches vs transformers, {args.dtype} "
             f"({machine(torch.device('cpu'))})",
             "",
             f"Command: `python bench/engine.py --repeat {args.repeat}{flag} --write`. Dense GLM, 4 layers, hidden 256, 8 "
             f"heads (2 KV), vocab 512, {args.dtype} weights in every engine; at most {args.batch} rows decode at once in every engine; temperature "
             f"1, per-token logprobs; median of {args.repeat} rounds after a warm-up, the engines interleaved in each "
             f"round. `uniform`: {args.batch} prompts of 8-32 tokens, 64 new tokens each. `rl`: 256 requests (32 "
             f"prompts x 8), 85 % of responses 8-32 tokens, 15 % 33-256, one of 256; "
             f"{sum(n for _, n in workloads(cfg, args.batch)['rl'])} new tokens in all. Each request stops at its "
             f"length; transformers runs batches of {args.batch} in order to their longest member (it keeps computing "
             f"finished rows). Counted: the requested new tokens / wall-clock seconds.",
             "",
             "| workload | engine | s | new tokens / s | vs transformers |",
             "|---|---|---:|---:|---:|"] + rows
    if "ours" in engines and "static" in engines:
        iterations, prefills, ops = engine_facts(ours, workloads(cfg, args.batch)["rl"], args.batch)
        lines += ["", f"On `rl`, continuous batching is {results['rl', 'ours'][1] / results['rl', 'static'][1]:.2f}x "
                      f"the static engine and {results['rl', 'ours'][1] / results['rl', 'hf'][1]:.2f}x transformers. "
                      f"It runs {iterations} iterations ({prefills} with a prefill); a decode step is {ops:.0f} ATen "
                      f"ops (forward and sampling), whatever its rows."]
    if firsts:
        lines += ["", f"Under torch.compile, our engine is {results['rl', 'compiled'][1] / results['rl', 'hf'][1]:.2f}x "
                      f"transformers on `rl` ({results['rl', 'compiled'][1] / results['rl', 'ours'][1]:.2f}x the eager engine); "
                      f"its first runs, compiling from an empty cache, took {' and '.join(f'{t:.0f}' for t in firsts)} s (`uniform`, `rl`)."]
    table = "\n".join(lines)
    print(table)
    if args.write:
        write_section(os.path.join(ROOT, "docs/benchmarks.md"), "engine-continuous" + ("" if args.dtype == "float32" else "-" + args.dtype), table)


if __name__ == "__main__":
    main()
