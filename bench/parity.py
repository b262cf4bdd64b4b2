"""
Teacher-forced logprob parity on a device: the learner's and the generator's log-probabilities of the
same tokens against a float64 reference, for dense and DSA models. This is the train/inference gap that
train.py logs every RL step (train/logp_diff_max, train/logp_diff_mean), measured on fixed tokens where
it can be compared with the truth.

    python bench/parity.py                              # cuda when there is one: tiny and 9B-width models
    python bench/parity.py --device cpu --shapes tiny   # CPU, tiny shapes, bf16 as on a GPU: seconds (CI runs this)
    python bench/parity.py --json out.json --md out.md  # also write the results (bench/gpu.sh does)

Models: random GLMs (seeded) with unit-scale weights (std 1/sqrt(fan_in), so that attention is far from
uniform and logits have a spread of about --logit-scale): `tiny` (hidden 64, 3 layers, vocab 256; DSA top-8
of sequences of 16-44 tokens) and `9b` (GLM-Z1-9B-0414's layer width and vocabulary from config.PUBLISHED,
cut to 2 layers; DSA with the recipe's indexer, 32 heads x 128, top-256 of 512-token sequences so that the
sparse path runs), each dense and with DSA (pattern FS).
Tokens: --rows sequences of random prompt and response tokens (fixed seed), packed into one row as the
learner packs them. The reference scores each sequence alone: a plain [1, T] forward of a float64 copy of
the weights on --ref-device (PyTorch paths: dsa.USE_TRITON off), lm_head and log_softmax in float64.

Paths, each scored against the reference on the same tokens (|logp - logp_ref| per response token):
  learner fp32       fp32 weights, no autocast, train.packed_forward: the comparison itself (near 0)
  learner            fp32 master weights under bf16 autocast, train.packed_forward with grad on: what
                     train.rl_step runs on cuda (parallel.autocast; on a CPU the same autocast is forced)
  generator prefill  a bf16 copy (dsa.FP32_PARAMS kept fp32, as engine.update_weights fills it), no
                     autocast, the packed forward the engine's prefill runs, teacher-forced on every token
  engine             engine.TorchEngine on that bf16 copy (CUDA graphs on cuda, as make_engine): random
                     prompts, responses it samples (temperature --temperature, fixed seed, no stop
                     tokens); the logprobs it reports for its own tokens (prefill's last position, then
                     one decode step each) against the reference on those tokens
  learner vs engine  the learner's logprobs of the engine's tokens against the engine's: train/logp_diff
On cuda with DSA the learner, prefill and engine paths run again with dsa.USE_TRITON off (the PyTorch DSA
path), so the compiled Triton kernels are compared with the PyTorch path on the same weights (on a CPU with
TRITON_INTERPRET=1 the same happens in Triton's interpreter: slow, but it checks this script).

Tolerances (TOL below) are on max and mean |delta logp| per path, from CPU measurements with margin: bf16
logits are rounded to 8 bits, so a logit of 10 carries up to 0.04 of error before anything else; a DSA
model can also swap a key at the top-k boundary (its scores come from bf16 activations), which moves a
few tokens further. Exit status 1 when a path is out of tolerance.
"""
import argparse
import copy
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # first, before bench/ itself: bench/engine.py must not shadow engine.py
from machinery import config  # noqa: E402
from bench import write_results  # noqa: E402
import dsa  # noqa: E402
from kernels import dsa_triton  # noqa: E402
from machinery import parallel  # noqa: E402
import train  # noqa: E402
from machinery.engine import SamplingParams, TorchEngine  # noqa: E402
from model import GLM, GLMConfig  # noqa: E402

# Shapes. Each: the model (GLMConfig fields), its DSA variant's indexer, and the token layout.
SHAPES = {
    "tiny": dict(model=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                            num_kv_heads=2, head_dim=16, max_position_embeddings=256),
                 dsa=dict(topk=8, heads=2, head_dim=16, rope_dim=8, pattern="FS"),
                 rows=6, prompt=(8, 20), response=(8, 24), new_tokens=16),
    "9b": dict(model=dict(GLMConfig.from_hf(dict(config.PUBLISHED["GLM-Z1-9B-0414"], num_hidden_layers=2)).__dict__),
               dsa=dict(topk=256, heads=32, head_dim=128, rope_dim=64, pattern="FS"),
               rows=4, prompt=(384, 384), response=(128, 128), new_tokens=64),
}
# (max, mean) |delta logp| allowed, by what a path is compared with and whether the model is DSA. Measured on
# a CPU (tiny shapes, seeds 0-3, bf16 without AVX512-BF16): dense bf16 vs the reference max 0.20, mean 0.038;
# DSA bf16 vs the reference max 6.5, mean 0.22 (top-8 of ~30 keys: a key swapped at the boundary moves a
# token's logprob by units); learner vs engine, dense max 0.08, mean 0.015, DSA max 1.1, mean 0.07.
TOL = {("fp32", False): (1e-3, 1e-4), ("fp32", True): (1e-3, 1e-4),  # float rounding only
       ("bf16", False): (0.5, 0.1), ("bf16", True): (10.0, 0.5),  # a bf16 path against the float64 reference
       ("pair", False): (0.5, 0.1), ("pair", True): (2.0, 0.15)}  # two bf16 paths against each other
BIG = 0.5  # tokens whose |delta logp| exceeds this are counted (on DSA: mostly top-k boundary swaps)


def randomize_(model, seed, logit_scale):
    """Unit-scale random weights in place: Linear std 1/sqrt(fan_in) (each projection keeps its input's
    scale), embeddings std 1, biases and norm weights around their identity with std 0.1, lm_head std
    logit_scale/sqrt(hidden) (logits of std ~logit_scale after the final RMSNorm). A freshly initialised
    GLM (std 0.02) has nearly uniform attention and logits, where any two paths agree trivially."""
    g = torch.Generator(device=model.lm_head.weight.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32)
            if name == "lm_head.weight":
                p.copy_(noise * logit_scale / p.shape[1] ** 0.5)
            elif name == "embed_tokens.weight":
                p.copy_(noise)
            elif p.dim() == 2:  # a Linear [out, in]
                p.copy_(noise / p.shape[1] ** 0.5)
            elif name.endswith("bias"):
                p.copy_(noise * 0.1)
            else:  # RMSNorm / LayerNorm weights
                p.copy_(1 + noise * 0.1)
    return model


def make_rows(shape, vocab, seed):
    """[(token ids, prompt length)] of random tokens: lengths drawn in the shape's ranges."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(shape["rows"]):
        P = int(torch.randint(shape["prompt"][0], shape["prompt"][1] + 1, (), generator=g))
        R = int(torch.randint(shape["response"][0], shape["response"][1] + 1, (), generator=g))
        rows.append((torch.randint(0, vocab, (P + R,), generator=g).tolist(), P))
    return rows


@torch.no_grad()
def reference_logprobs(model64, rows, temperature):
    """float64 logprobs of every response token, each sequence alone ([1, T], no packing), PyTorch paths
    only, lm_head and log_softmax in float64 -> [N] float64 (sequence after sequence)."""
    device = model64.lm_head.weight.device
    out = []
    use = dsa.USE_TRITON
    dsa.USE_TRITON = False  # the kernels take no float64; the reference is the PyTorch specification
    try:
        for ids, P in rows:
            x = torch.tensor(ids, device=device)[None]  # [1, T]
            h = model64(x, return_hidden=True)[0, P - 1:len(ids) - 1]  # [R, hidden]: positions predicting tokens P..T-1
            logits = (h @ model64.lm_head.weight.T) / temperature  # [R, V] float64
            out.append(torch.log_softmax(logits, -1).gather(-1, x[0, P:, None])[:, 0])
    finally:
        dsa.USE_TRITON = use
    return torch.cat(out).cpu()


def learner_logprobs(model, rows, temperature, amp):
    """train.packed_forward as train.rl_step calls it: grad on, under bf16 autocast when amp (on cuda that is
    parallel.autocast(device); on a CPU it is forced, to run the GPU's dtypes) -> [N] float32."""
    device = model.lm_head.weight.device
    ctx = (parallel.autocast(device) if device.type == "cuda" else torch.autocast("cpu", dtype=torch.bfloat16)) \
        if amp else torch.autocast(device.type, enabled=False)
    with torch.enable_grad(), ctx:
        logp, _, _, _ = train.packed_forward(model, spanned(rows), temperature)
    return logp.detach().float().cpu()


@torch.no_grad()
def prefill_logprobs(gen, rows, temperature):
    """The generator's bf16 weights, no autocast: the packed forward of the engine's prefill, teacher-forced."""
    logp, _, _, _ = train.packed_forward(gen, spanned(rows), temperature)
    return logp.float().cpu()


def spanned(rows):
    """(ids, prompt length) -> (ids, the scored span after the prompt): packed_forward's rows."""
    return [(ids, [(P, len(ids) - P)]) for ids, P in rows]


def generator_copy(model):
    """The generator's model as train.py holds one: parameters in the engine's dtypes (bf16; dsa.FP32_PARAMS
    fp32), whose values engine.update_weights then copies from the learner's fp32 weights."""
    return copy.deepcopy(model).cast_(torch.bfloat16).requires_grad_(False)


def compare(got, want, kind, use_dsa):
    """|got - want| over the tokens [N] -> its max, mean, count above BIG, and pass/fail against TOL[kind, dsa]."""
    d = (got.double() - want.double()).abs()
    tmax, tmean = TOL[kind, use_dsa]
    s = {"tokens": d.numel(), "max": float(d.max()), "mean": float(d.mean()), "big": int((d > BIG).sum()),
         "kind": kind, "tol_max": tmax, "tol_mean": tmean}
    s["pass"] = bool(torch.isfinite(d).all()) and s["max"] <= tmax and s["mean"] <= tmean
    return s


def run_model(label, shape, use_dsa, device, ref_device, temperature, logit_scale, seed, log=print):
    """Every path of one model -> {path: stats}."""
    cfg = GLMConfig(**{**shape["model"], "dsa": shape["dsa"] if use_dsa else None})
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    with torch.device(device):
        model = randomize_(GLM(cfg), seed, logit_scale)  # the learner: fp32 master weights on the device
    rows = make_rows(shape, cfg.vocab_size, seed + 1)
    model64 = copy.deepcopy(model).to(ref_device, torch.float64).requires_grad_(False)  # the reference's weights
    ref = reference_logprobs(model64, rows, temperature)
    log(f"[parity] {label}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
        f"{len(rows)} sequences / {len(ref)} response tokens; reference on {ref_device} ({time.perf_counter() - t0:.1f} s)")

    out = {}
    out["learner fp32"] = compare(learner_logprobs(model, rows, temperature, amp=False), ref, "fp32", use_dsa)
    learner = learner_logprobs(model, rows, temperature, amp=True)
    out["learner"] = compare(learner, ref, "bf16", use_dsa)
    gen = generator_copy(model)
    engine = TorchEngine(gen, max_batch=len(rows), graphs=torch.device(device).type == "cuda")
    engine.update_weights(parallel.full_weights(model), 0)  # fp32 -> the engine's dtypes, as publishing does
    out["generator prefill"] = compare(prefill_logprobs(gen, rows, temperature), ref, "bf16", use_dsa)
    # Where the Triton kernels run (cuda; a CPU under TRITON_INTERPRET=1), the DSA paths again without them
    kernels = use_dsa and dsa.USE_TRITON and dsa_triton.available(torch.empty(0, device=device))
    if kernels:  # the same paths on the PyTorch DSA code, to set the compiled kernels against it
        dsa.USE_TRITON = False
        try:
            plain = learner_logprobs(model, rows, temperature, amp=True)
            out["learner (no kernels)"] = compare(plain, ref, "bf16", use_dsa)
            out["learner: kernels vs no kernels"] = compare(learner, plain, "pair", use_dsa)
            out["generator prefill (no kernels)"] = compare(prefill_logprobs(gen, rows, temperature), ref, "bf16", use_dsa)
        finally:
            dsa.USE_TRITON = True

    # The engine samples its own tokens; the reference and the learner then score exactly those
    prompts = [ids[:P] for ids, P in rows]
    sampling = SamplingParams(temperature=temperature, max_new_tokens=shape["new_tokens"], stop_token_ids=())

    def sample(engine):  # (the sequences it wrote, as learner rows; the logprobs it reported [N])
        done = engine.generate(prompts, sampling, seed=seed)
        return ([(p + c.token_ids, len(p)) for p, c in zip(prompts, done)],
                torch.tensor([lp for c in done for lp in c.logprobs], dtype=torch.float32))
    gen_rows, gen_logp = sample(engine)
    out["engine"] = compare(gen_logp, reference_logprobs(model64, gen_rows, temperature), "bf16", use_dsa)
    out["learner vs engine"] = compare(learner_logprobs(model, gen_rows, temperature, amp=True), gen_logp, "pair", use_dsa)
    if kernels:  # the engine's decode attention and fused sampler on PyTorch paths (graphs captured anew)
        dsa.USE_TRITON = False
        try:
            plain_rows, plain_logp = sample(TorchEngine(gen, max_batch=len(rows), graphs=True))
        finally:
            dsa.USE_TRITON = True
        out["engine (no kernels)"] = compare(plain_logp, reference_logprobs(model64, plain_rows, temperature), "bf16", use_dsa)
    for path, s in out.items():
        log(f"[parity] {label:<14} {path:<32} max {s['max']:.2e}  mean {s['mean']:.2e}  > {BIG}: {s['big']:>4}  "
            f"(tol {s['tol_max']:g} / {s['tol_mean']:g})  {'ok' if s['pass'] else 'FAIL'}")
    del model, model64, gen, engine
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return out


def markdown(results):
    lines = [f"Device: {results['device']} (reference: float64 on {results['ref_device']}); temperature "
             f"{results['temperature']}, logit scale {results['logit_scale']}, seed {results['seed']}.", "",
             "| model | path | against | tokens | max abs dlogp | mean abs dlogp | tokens > " + f"{BIG} | tolerance (max / mean) | |",
             "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for label, paths in results["models"].items():
        for path, s in paths.items():
            against = "each other" if s["kind"] == "pair" else "float64 reference"
            lines.append(f"| {label} | {path} | {against} | {s['tokens']} | {s['max']:.2e} | {s['mean']:.2e} | {s['big']} | "
                         f"{s['tol_max']:g} / {s['tol_mean']:g} | {'pass' if s['pass'] else '**FAIL**'} |")
    lines += ["", f"All paths within tolerance: {'yes' if results['pass'] else '**no**'}."]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--ref-device", default="cpu", help="where the float64 reference runs (cuda is faster at 9B width)")
    ap.add_argument("--shapes", help="comma-separated: tiny, 9b (default: tiny,9b on cuda, tiny on cpu)")
    ap.add_argument("--dense-only", action="store_true", help="skip the DSA models")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--logit-scale", type=float, default=3.0, help="std of the random model's logits")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--md", help="write the markdown table here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    shapes = (args.shapes or ("tiny,9b" if device.type == "cuda" else "tiny")).split(",")
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r} (known: {', '.join(SHAPES)})")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no CUDA device")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    on = dsa.USE_TRITON and dsa_triton.available(torch.empty(0, device=device))
    print(f"[parity] device {device} ({name}), torch {torch.__version__}, DSA kernels "
          f"{'on (and compared with the PyTorch path)' if on else 'off (PyTorch DSA)'}", flush=True)
    results = {"device": f"{device} ({name})", "ref_device": args.ref_device, "temperature": args.temperature,
               "logit_scale": args.logit_scale, "seed": args.seed, "models": {}}
    for s in shapes:
        for use_dsa in (False, True) if not args.dense_only else (False,):
            label = f"{s} {'DSA' if use_dsa else 'dense'}"
            results["models"][label] = run_model(label, SHAPES[s], use_dsa, device, torch.device(args.ref_device),
                                                 args.temperature, args.logit_scale, args.seed,
                                                 log=lambda m: print(m, flush=True))
    results["pass"] = all(p["pass"] for paths in results["models"].values() for p in paths.values())
    md = markdown(results)
    print(md, flush=True)
    write_results(args, results, md)
    return 0 if results["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
