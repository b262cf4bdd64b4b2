"""
MoE models (MLA attention + routed experts: GLM-4.7-Flash's glm4_moe_lite, GLM-5's glm_moe_dsa) against
transformers' own classes, side by side in one process on the same weights: the RL learner step, and the engine's
generation. Writes the "moe-cpu" section of docs/benchmarks.md with --write ("moe-cuda-flash" for --shape flash).

    python bench/moe.py                                  # CPU: learner and engine, tiny and wide shapes (minutes)
    python bench/moe.py --part learner --shape wide      # one part, one shape
    python bench/moe.py --quick                          # seconds: tiny batches and workloads, the tiny shape
    python bench/moe.py --device cuda --shape flash      # GLM-4.7-Flash cut to 4 layers on a GPU (bench/gpu.sh part 8)
    python bench/moe.py --device cuda --shape flash --part learner --no-cast-cache   # the learner casting the experts
                                                         # in every forward and recompute, as before kernels/moe.CastCache
    python bench/moe.py --device cuda --shape flash --profile prof   # ... and where the time goes: op tables in prof/
    python bench/moe.py --quick --shape tiny,flash       # both paths on a CPU, flash's widths shrunk: a smoke test
                                                         # (bench/gpu.sh --dry's part 8, tests/test_bench.py)

Models, random weights (HF's initialisation):
- `tiny`: configs/tiny_moe_cpu.yaml's model (glm_moe_dsa: hidden 96, 3 layers, one dense then two MoE layers of 8
  experts, top-2, one shared expert; MLA q 48 / kv 32; DSA FS, top-8), the tiny task's 102-token vocabulary,
  max_position_embeddings raised to 1024 for the engine's longest requests.
- `wide`: glm_moe_dsa, hidden 256, 4 layers (dense, then 3 MoE of 16 experts of width 128, top-4, one shared),
  8 heads, MLA q 128 / kv 64 (nope 32, rope 16, v 32), DSA FSSS top-64 (8 heads x 32), vocab 4096.
- `flash`: GLM-4.7-Flash's published config (machinery/config.PUBLISHED; glm4_moe_lite, 64 experts top-4, MLA
  q 768 / kv 512, vocab 154880, no DSA) cut to --layers decoder layers, the first dense (as its config has it).
For tiny and wide, transformers' GlmMoeDsaForCausalLM is made and saved, and ours loaded from that directory with
GLM.from_pretrained. For flash (GBs), ours is made on the device and transformers' Glm4MoeLiteForCausalLM takes its
state dict in memory. Either way the log prints the relative error between the two models' fp32 logits on a row
no longer than DSA's top-k (a check that they hold the same weights).

1. `learner`: train.rl_step (packed micro-batches, the GRPO loss, AdamW: train.adamw; the indexer frozen as in RL)
   on an RL-shaped batch, twice: `rl_step, routes replayed` (each sample carries routes recorded by one forward of
   the same model, as the generator records them, and model.routing_replay: rollout, the default, replays them;
   rl_step then also runs its routing/* diagnostic, one no-grad forward of the first micro-batch routed afresh)
   and `rl_step, fresh routes` (samples without routes: the router decides; the diagnostic's extra no-grad forward runs too, and
   reports only routing/unrecorded). Against it,
   transformers' model on the same sequences right-padded into one batch (--hf-rows sequences at a time,
   gradients accumulated), the response tokens' log-probabilities, the same policy-gradient sum, backward, gradient
   clipping and the same AdamW (bench/learner.py's hf part). Generator log-probabilities are the model's own (one
   forward), so no token is clipped by the loss. On CUDA both sides run fp32 weights under bf16 autocast, as
   train.py's learner does (transformers' grouped experts are not autocast: they run in the weights' fp32); ours
   multiplies the routed experts by bf16 copies made once per optimizer step (kernels/moe.CastCache; each row
   counts them: 2 per MoE layer and step), or with --no-cast-cache casts them in every forward and recompute.
   Tokens/s counts prompt + response tokens; median of --repeat timed steps after a warm-up, the three
   interleaved on a CPU (drift hits them alike), one after the other on CUDA (two fp32 learners do not fit beside
   each other at flash's shape), with each side's peak memory.
2. `engine`: TorchEngine.generate (CUDA graphs on CUDA) against transformers' generate on the same model and
   prompts: on tiny and wide, bench/engine.py's workloads (`uniform`: --batch prompts, 64 new tokens each; `rl`:
   256 requests of heavy-tailed lengths; transformers runs batches of --batch in order, each to its longest
   member) and its count (requested new tokens per second), per-token logprobs from both. On flash: --gen-batch
   rows of --prompt-token prompts, --new-tokens each, prefill (a 1-token generate, median of --repeat) and decode
   tokens/s (the rest of one --new-tokens generate), ours with CUDA graphs and eagerly, transformers without its
   scores (a [rows, 154880] float tensor per step), then ours with fp8 weights (machinery/fp8.quantize_model_ of
   the same generator: the routed experts in FP8Experts' grouped kernel), graphs and eager.
"""
import argparse
import copy
import dataclasses
import gc
import itertools
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench import op_count, profile_to, write_results  # noqa: E402
from bench.attention import machine, write_section  # noqa: E402
from bench.engine import engine_runner, timed, workloads  # noqa: E402
from bench.learner import SHAPES as LEARNER_SHAPES  # noqa: E402
from machinery import config, fp8  # noqa: E402
from machinery.engine import SamplingParams, TorchEngine  # noqa: E402
from machinery.parallel import autocast  # noqa: E402
from families.mla_moe import LATENT_TYPES, Experts, Routing  # noqa: E402
from kernels import moe as moe_kernels  # noqa: E402
from model import GLM, GLMConfig, hf_name  # noqa: E402
from rollout import RolloutBatch, Sample  # noqa: E402
import train  # noqa: E402

TINY_VOCAB = 102  # data.make_tiny_tokenizer's vocabulary (the tiny task's)
WIDE = dict(model_type="glm_moe_dsa", vocab_size=4096, hidden_size=256, intermediate_size=704, num_layers=4,
            num_heads=8, max_position_embeddings=8192,
            mla=dict(q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32),
            moe=dict(n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=128, n_shared_experts=1,
                     routed_scaling_factor=2.5, mlp_layer_types=["dense", "sparse", "sparse", "sparse"]),
            dsa=dict(topk=64, heads=8, head_dim=32, rope_dim=16, pattern="FSSS"))
# --quick --shape flash: GLM-4.7-Flash's config with every width shrunk, for the flash path on a CPU (seconds)
FLASH_QUICK = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                   num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
                   qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, pad_token_id=0, eos_token_id=[1])
# Learner batches: (what, sequences, prompt tokens (lo, hi), response tokens (lo, hi)), lengths uniform in the ranges
BATCHES = {
    "demo": ("the demo's batch: 256 sequences (32 prompts x 8), prompt 6-10, response 4-16", 256, (6, 10), (4, 16)),
    "a": LEARNER_SHAPES["a"],
    "b": LEARNER_SHAPES["b"],
    "quick": ("quick: 16 sequences, prompt 4-8, response 2-8", 16, (4, 8), (2, 8)),
}
LEARNER_RUNS = {"tiny": ["demo"], "wide": ["a", "b"]}  # CPU: which batches each shape trains on
SIDES = ("replay", "fresh", "hf")
SIDE_NAMES = {"replay": "rl_step, routes replayed", "fresh": "rl_step, fresh routes", "hf": "transformers"}
GiB = 2**30


def log(msg):
    print(msg, flush=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Peak:
    """Peak bytes allocated on CUDA inside the block, and what was allocated when it began (None on a CPU)."""

    def __init__(self, device):
        self.device, self.peak, self.before = device, None, None

    def __enter__(self):
        if self.device.type == "cuda":
            sync(self.device)
            self.before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            sync(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)


def gib(b):
    return "" if b is None else f"{b / GiB:.2f}"


def fmt(err):
    return f"{err:.2e}" if isinstance(err, float) else str(err)


# ----------------------------------------------------------------------------- models

def arch_of(shape, layers, quick):
    """Our GLMConfig of a shape (see the docstring)."""
    if shape == "tiny":
        with open(os.path.join(ROOT, "configs", "tiny_moe_cpu.yaml")) as f:
            m = yaml.safe_load(f)["model"]
        return GLMConfig(**{**m["init"], "vocab_size": TINY_VOCAB, "max_position_embeddings": 1024, "pad_token_id": 0,
                            "eos_token_id": [1]}, dsa=m["dsa"])
    if shape == "wide":
        return GLMConfig(**WIDE, pad_token_id=0, eos_token_id=[1])
    hf = dict(config.PUBLISHED["GLM-4.7-Flash"], num_hidden_layers=layers, **(FLASH_QUICK if quick else {}))
    # (its first layer dense, as first_k_dense_replace 1 says; no MTP layer: transformers' model has none to compare)
    return GLMConfig.from_hf(hf | {"num_nextn_predict_layers": 0})


def hf_class(arch):
    import transformers
    return getattr(transformers, LATENT_TYPES[arch.model_type])


def hf_config(arch):
    return hf_class(arch).config_class(**arch.to_hf())


def freeze_indexer(m):
    for name, p in m.named_parameters():
        p.requires_grad_(".indexer." not in name)  # frozen in RL (train.train_rl); transformers' gets no gradient
    return m


def pair_from_hf(arch, path, device):
    """transformers' model made with its own initialisation and saved to path; ours loaded from there. Both fp32."""
    torch.manual_seed(0)
    hf = hf_class(arch)(hf_config(arch))
    hf.save_pretrained(path)
    ours = GLM.from_pretrained(path, dtype=torch.float32, device=device)
    return ours, hf.float().to(device)


def pair_in_memory(arch, device):
    """Ours made on the device (model.init_weights), transformers' copy of its state dict (flash: no GBs to disk)."""
    torch.manual_seed(0)
    with torch.device(device):
        ours = GLM(arch)
        hf = hf_class(arch)(hf_config(arch)).float()
    missing, unexpected = hf.load_state_dict({hf_name(n): t for n, t in ours.state_dict().items()}, strict=False)
    if unexpected or [n for n in missing if not n.endswith("inv_freq")]:
        raise SystemExit(f"transformers' model does not take our state dict: missing {missing}, "
                         f"unexpected {unexpected}")
    return ours, hf


def agreement(ours, hf, arch, device):
    """agreement_(...), or its error as a string (transformers may lack a kernel for fp32 on this device)."""
    try:
        return agreement_(ours, hf, arch, device)
    except Exception as e:  # noqa: BLE001
        log(f"logits check FAILED: {type(e).__name__}: {e}".splitlines()[0][:300])
        return f"{type(e).__name__}: {e}".splitlines()[0][:200]


def agreement_(ours, hf, arch, device):
    """Relative error of the two models' fp32 logits on one random row (no autocast): the same weights? The row is
    no longer than DSA's top-k, so that the check compares the weights, not how each breaks top-k score ties (on
    random weights many indexer scores tie at ReLU's zero)."""
    T = min(24, arch.dsa.topk) if arch.dsa else 24
    ids = torch.randint(2, arch.vocab_size, (1, T), generator=torch.Generator().manual_seed(3)).to(device)
    with torch.no_grad():
        a, b = ours(ids).float(), hf(input_ids=ids, use_cache=False).logits.float()
    return ((a - b).norm() / b.norm()).item()


# ----------------------------------------------------------------------------- 1. learner

def make_samples(batch, vocab, seed=0):
    """A batch's Samples (groups of 8, 0/1 rewards); gen_logprobs and routes are filled by record()."""
    import random
    _, count, (p0, p1), (r0, r1) = batch
    rng = random.Random(seed)
    out = []
    for i in range(count):
        p, r = rng.randint(p0, p1), rng.randint(r0, r1)
        out.append(Sample(prompt_ids=[rng.randrange(2, vocab) for _ in range(p)],
                          response_ids=[rng.randrange(2, vocab) for _ in range(r)], gen_logprobs=[0.0] * r,
                          reward=float(rng.random() < 0.5), group=i // 8, versions=(0, 0), finish_reason="length",
                          example={}))
    return out


def record(model, samples, device):
    """What the generator would hand over with each sample: its own logprobs of the response tokens, and the
    experts every fed position took (Sample.routes [positions, n_moe, k]: all but the last token, never fed)."""
    with torch.no_grad(), autocast(device):
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids], device=device)
            r = Routing(record=True)
            logits = model(ids, routing=r)[0, :-1].float()
            logp = logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
            s.gen_logprobs = logp[len(s.prompt_ids) - 1:].tolist()
            s.routes = torch.stack(r.chosen)[:, 0, :-1].permute(1, 0, 2).contiguous().cpu()


def hf_step(model, optimizer, samples, adv, rows, device):
    """A padded trainer's step: --hf-rows sequences at a time right-padded into [B, Lmax], forward (bf16 autocast on
    CUDA), log-probabilities of the response tokens, sum_i adv_i * mean_t logp_it / N as the loss, backward
    (gradients accumulated over the chunks), clip to norm 1, AdamW step."""
    optimizer.zero_grad(set_to_none=True)
    for c in range(0, len(samples), rows):
        chunk = samples[c:c + rows]
        L = max(len(s.prompt_ids) + len(s.response_ids) for s in chunk)
        ids = torch.zeros(len(chunk), L, dtype=torch.long)
        att = torch.zeros(len(chunk), L, dtype=torch.long)
        resp = torch.zeros(len(chunk), L, dtype=torch.bool)  # targets that are response tokens
        for i, s in enumerate(chunk):
            seq = s.prompt_ids + s.response_ids
            ids[i, :len(seq)], att[i, :len(seq)] = torch.tensor(seq), 1
            resp[i, len(s.prompt_ids):len(seq)] = True
        ids, att, resp = ids.to(device), att.to(device), resp.to(device)
        with autocast(device):
            logits = model(input_ids=ids, attention_mask=att, use_cache=False).logits[:, :-1]
        logp = logits.float().log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        m = resp[:, 1:]
        loss = -((logp * m).sum(1) / m.sum(1) * adv[c:c + rows].to(device)).sum() / len(samples)
        loss.backward()
        del logits, logp, loss
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def expert_casts(m) -> int:
    """The copies the model's routed experts have made in their kernels/moe.CastCache so far."""
    return sum(e.casts.casts for e in m.modules() if isinstance(e, Experts))


def drop_expert_copies(m):
    """Free the copies a step left in the experts' CastCache (its optimizer step drops them; a failed step does not)."""
    for e in m.modules():
        if isinstance(e, Experts):
            e.casts.copies.clear()


def learner_part(ours, hf, samples, device, args, free_ours=False):
    """{side: (median s / step, peak bytes, bytes held before, expert casts in a step)} for rl_step with routes
    replayed and fresh, and transformers (None where --no-hf). free_ours: drop ours (its optimizer and weights) before
    transformers' side."""
    cfg = config.Config()
    cfg.optim.lr = 1e-6  # (weights barely move: every step times the same model)
    cfg.optim.max_tokens_per_micro_batch = args.tokens
    ours.gradient_checkpointing = args.checkpointing
    if args.checkpointing and hf is not None:
        hf.gradient_checkpointing_enable()
    record(ours, samples, device)
    adv = torch.tensor([s.reward - 0.5 for s in samples])
    batches = {"replay": RolloutBatch(samples=samples, index=0, stream_state={}),
               "fresh": RolloutBatch(samples=[dataclasses.replace(s, routes=None) for s in samples], index=0,
                                     stream_state={})}
    sides = {"replay": None, "fresh": None, "hf": None}
    opts, casts = {}, {}

    def optimizer(side):
        if side not in opts:
            m = hf if side == "hf" else ours
            opts[side] = torch.optim.AdamW([p for p in freeze_indexer(m).parameters() if p.requires_grad], lr=1e-6,
                                           betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay,
                                           fused=True)  # (train.adamw's, with this lr)
        return opts[side]

    def run(side):
        sync(device)
        t0 = time.perf_counter()
        if side == "hf":
            hf_step(hf, optimizer(side), samples, adv, args.hf_rows or len(samples), device)
        else:
            before = expert_casts(ours)
            m = train.rl_step(cfg, ours, None, optimizer(side if side == "hf" else "ours"), None, batches[side], 0)
            assert ("routing/agree" in m) == (side == "replay"), sorted(m)
            casts[side] = expert_casts(ours) - before  # (a step's: its optimizer step dropped the copies)
        sync(device)
        return time.perf_counter() - t0

    names = [s for s in SIDES if s != "hf" or hf is not None]
    times, peaks, errors = {s: [] for s in names}, {s: (None, None) for s in names}, {}

    def attempt(side):
        """run(side), or None after recording its error (one failed side must not lose the others' numbers)."""
        try:
            return run(side)
        except Exception as e:  # noqa: BLE001 - e.g. an out-of-memory, or a kernel transformers lacks here
            errors[side] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            log(f"learner {SIDE_NAMES[side]}: FAILED {errors[side]}")
            opts.pop("hf" if side == "hf" else "ours", None)
            (hf if side == "hf" else ours).zero_grad(set_to_none=True)
            drop_expert_copies(ours)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            return None

    if device.type == "cpu":  # interleaved rounds, the first (AdamW's state allocated) untimed
        for i in range(1 + args.repeat):
            for s in names:
                t = None if s in errors else attempt(s)
                if i and t is not None:
                    times[s].append(t)
    else:  # one side after the other, each with its peak memory
        for s in names:
            if s == "hf" and free_ours:
                opts.pop("ours", None)
                ours.zero_grad(set_to_none=True)
                drop_expert_copies(ours)
                ours.to("meta")  # (the caller keeps no other reference to its tensors)
                gc.collect()
                torch.cuda.empty_cache()
            with Peak(device) as p:
                for i in range(1 + args.repeat):
                    t = attempt(s)
                    if t is None:
                        break
                    if i:
                        times[s].append(t)
            peaks[s] = (p.peak, p.before)
            if args.profile and s in times and s not in errors:  # one more step, untimed, under the profiler
                profile_to(os.path.join(args.profile, f"learner_{s}.txt"), lambda s=s: attempt(s))
            if s == "fresh":  # ours done: its gradients go (its weights and AdamW state stay, unless free_ours)
                ours.zero_grad(set_to_none=True)
    for s in names:
        sides[s] = errors[s] if s in errors else (statistics.median(times[s]), *peaks[s], casts.get(s))
    opts.clear()
    if hf is not None:
        hf.zero_grad(set_to_none=True)
        if args.checkpointing:
            hf.gradient_checkpointing_disable()
    return sides


def learner_rows(label, what, samples, sides):
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    hf = sides.get("hf") if isinstance(sides.get("hf"), tuple) else None
    rows = []
    for side in SIDES:
        if sides.get(side) is None:
            continue
        if isinstance(sides[side], str):
            rows.append(dict(shape=label, batch=what, side=SIDE_NAMES[side], tokens=tokens, error=sides[side]))
            continue
        t, peak, before, casts = sides[side]
        rows.append(dict(shape=label, batch=what, side=SIDE_NAMES[side], tokens=tokens, step_s=t,
                         tokens_per_s=tokens / t, vs_hf=(hf[0] / t) if hf else None, peak=peak, before=before,
                         expert_casts_per_step=casts))
        log(f"learner {label}, {what}, {SIDE_NAMES[side]}: {t:.3f} s/step, {tokens / t:.0f} tokens/s"
            + (f" ({hf[0] / t:.2f}x transformers)" if hf else "") + (f", peak {gib(peak)} GiB" if peak else "")
            + (f", {casts} expert weight copies made in the step" if casts is not None else ""))
    return rows


# ----------------------------------------------------------------------------- 2. engine

def carries_routes(gen) -> bool:
    """Whether the engine's completions on this model carry their routes (one short call)."""
    out = TorchEngine(gen, max_batch=1).generate([[3, 4, 5]], SamplingParams(temperature=1.0, max_new_tokens=2), seed=0)
    return out[0].routes is not None


def quick_workloads(arch):
    g = torch.Generator().manual_seed(1)

    def prompt():
        return torch.randint(3, arch.vocab_size, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist()
    return {"uniform": [(prompt(), 4) for _ in range(4)],
            "rl": [(prompt(), int(torch.randint(2, 9, (1,), generator=g))) for _ in range(8)]}


def hf_runner(hf, work, batch, device, scores=True):
    """transformers' generate, batches of `batch` requests in order (left-padded), each run to its longest length."""
    def run():
        for b in range(0, len(work), batch):
            chunk = work[b:b + batch]
            P, new = max(len(p) for p, _ in chunk), max(n for _, n in chunk)
            ids = torch.zeros(len(chunk), P, dtype=torch.long)
            mask = torch.zeros(len(chunk), P, dtype=torch.long)
            for i, (p, _) in enumerate(chunk):
                ids[i, P - len(p):], mask[i, P - len(p):] = torch.tensor(p), 1
            with torch.no_grad():
                out = hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True,
                                  temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new, min_new_tokens=new,
                                  pad_token_id=0, eos_token_id=None, output_scores=scores, return_dict_in_generate=True)
            sync(device)
            assert out.sequences.shape[1] == P + new
    return run


def engine_part(arch, path, device, args):
    """On tiny / wide: bench/engine.py's workloads, TorchEngine vs transformers' generate -> rows."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ours = GLM.from_pretrained(path, dtype=dtype, device=device)
    hf = hf_class(arch).from_pretrained(path, dtype=dtype).to(device).eval()
    args.routes.append(carries_routes(ours))
    work = quick_workloads(arch) if args.quick else workloads(arch, args.batch)
    rows = []
    for name, w in work.items():
        tokens = sum(n for _, n in w)
        eng = TorchEngine(ours, max_batch=args.batch, graphs=device.type == "cuda")
        secs = timed({"ours": engine_runner(eng, w), "hf": hf_runner(hf, w, args.batch, device)}, args.repeat)
        for side, t in secs.items():
            rows.append(dict(workload=name, side="TorchEngine" if side == "ours" else "transformers `generate`",
                             seconds=t, tokens=tokens, tokens_per_s=tokens / t, vs_hf=secs["hf"] / t))
            log(f"engine {name}, {side}: {t:.2f} s, {tokens / t:.0f} new tokens/s ({secs['hf'] / t:.2f}x transformers)")
    return rows


def decoder_share(model, arch, rows, context) -> float:
    """The decoder layers' share of the bytes a decode step reads at `rows` rows of mean `context` tokens, from the
    model's own tensors (bf16, or fp8 codes and scales): every decoder weight once, the routed experts' only as far as
    rows x k choices touch them (1 - (1 - k/E)^rows of them, expected), against those plus lm_head's weight, the
    embedding's rows, and each row's cached latents over every layer. Issue 48 asks fp8 against bf16 decode at a depth
    where this is >= 80%: at GLM-4.7-Flash's widths and 256 rows of ~320 tokens, 4 layers give 79.7%, 6 give 84.4%."""
    k, E = arch.moe.num_experts_per_tok, arch.moe.n_routed_experts
    touched = 1 - (1 - k / E) ** rows
    decoder = other = 0.0
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        size = t.numel() * t.element_size()
        if name.startswith("layers."):
            decoder += size * (touched if ".mlp.experts." in name else 1)
        elif name.startswith("lm_head"):
            other += size
        elif name.startswith("embed_tokens"):
            other += size * rows / arch.vocab_size
    other += rows * context * arch.num_layers * arch.kv_width * 2  # bf16 latents
    return decoder / (decoder + other)


def flash_engine(gen, hf, arch, device, args):
    """Prefill and decode tokens/s at each --gen-batch: ours with CUDA graphs (on CUDA) and eagerly, transformers, and
    ours again with fp8 weights (rollout.quantization: fp8; the routed experts through FP8Experts) unless --no-fp8."""
    g = torch.Generator().manual_seed(2)
    rows = []
    args.routes.append(carries_routes(gen))
    fp8_gen = None if args.no_fp8 else fp8.quantize_model_(copy.deepcopy(gen))
    for B in [int(b) for b in str(args.gen_batch).split(",")]:
        prompts = [torch.randint(2, arch.vocab_size, (args.prompt,), generator=g).tolist() for _ in range(B)]
        sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, stop_token_ids=())
        kinds = (["graphs"] if device.type == "cuda" else []) + ["eager"] + (["hf"] if hf is not None else [])
        kinds += [f"fp8 {k}" for k in kinds if k != "hf"] if fp8_gen is not None else []
        kinds = [k for k in kinds if args.engines is None or k in args.engines]
        for kind in kinds:
            if kind == "hf":
                ids = torch.tensor(prompts, device=device)

                def gen_n(n):
                    with torch.no_grad():
                        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                          temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=n, min_new_tokens=n,
                                          pad_token_id=0, eos_token_id=None)
                    sync(device)
                    assert out.shape[1] == args.prompt + n
            else:
                eng = TorchEngine(fp8_gen if kind.startswith("fp8") else gen, max_batch=B, graphs=kind.endswith("graphs"),
                                  prefill_tokens=args.prefill_tokens)

                def gen_n(n, eng=eng):
                    out = eng.generate(prompts, dataclasses.replace(sampling, max_new_tokens=n), seed=0)
                    assert all(len(c.token_ids) == n for c in out)  # no stop tokens: every row runs to the limit
            try:
                gen_n(args.new_tokens)  # warm-up: the pool sized, kernels chosen, every bucket captured
                with op_count() as ops:  # the host's side of a prefill: ATen ops dispatched (launches, on a GPU)
                    gen_n(1)
                if args.profile and kind in ("graphs", "hf", "fp8 graphs"):  # untimed: a prefill, then 16 tokens
                    name = f"{kind.replace(' ', '_')}_{B}"
                    profile_to(os.path.join(args.profile, f"prefill_{name}.txt"), lambda: gen_n(1))
                    profile_to(os.path.join(args.profile, f"generate16_{name}.txt"), lambda: gen_n(16))
                with Peak(device) as p:
                    times = {}
                    for n in (1, args.new_tokens):  # 1 new token = the prefill (and one sampling step)
                        runs = []
                        for _ in range(args.repeat if n == 1 else 1):  # (a prefill is short: median of --repeat)
                            sync(device)
                            t0 = time.perf_counter()
                            gen_n(n)
                            runs.append(time.perf_counter() - t0)
                        times[n] = statistics.median(runs)
                note = ""
                if kind.endswith("graphs") and (eng.graphs is None or eng.graphs.failed or not eng.graphs.graphs):
                    note = "CUDA graphs fell back to eager"
                decode = B * (args.new_tokens - 1) / max(times[args.new_tokens] - times[1], 1e-9)
                rows.append(dict(rows=B, side=kind, prefill_s=times[1], prefill_tokens_per_s=B * args.prompt / times[1],
                                 prefill_ops=ops.ops, decoder_share=None if kind == "hf" else decoder_share(
                                     eng.model, arch, B, args.prompt + args.new_tokens / 2),
                                 decode_s=times[args.new_tokens] - times[1], decode_tokens_per_s=decode,
                                 peak=p.peak, before=p.before, note=note))
                log(f"engine {B} rows, {kind}: prefill {times[1]:.3f} s ({B * args.prompt / times[1]:.0f} tokens/s, "
                    f"{ops.ops} ATen ops), "
                    f"decode {decode:.0f} tokens/s{', peak ' + gib(p.peak) + ' GiB' if p.peak else ''} {note}")
            except Exception as e:  # noqa: BLE001 - one failed side must not lose the others' numbers
                rows.append(dict(rows=B, side=kind, error=f"{type(e).__name__}: {e}".splitlines()[0][:300]))
                log(f"engine {B} rows, {kind}: FAILED {rows[-1]['error']}")
            eng = gen_n = None  # (the engine's pool and graphs go before the next one's)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- the runs

def side_by_side(shape, device, args, result):
    """tiny / wide: the pair from transformers' checkpoint, the learner batches, then the engine workloads."""
    arch = arch_of(shape, args.layers, args.quick)
    with tempfile.TemporaryDirectory() as path:
        ours, hf = pair_from_hf(arch, path, device)
        err = agreement(ours, hf, arch, device)
        n = sum(p.numel() for p in ours.parameters())
        result["models"][shape] = dict(params=n, logits_rel_err=err, config=arch.to_hf())
        log(f"{shape}: {n / 1e6:.2f}M parameters; fp32 logits ours vs transformers: relative error {fmt(err)}")
        if args.part in ("all", "learner"):
            for b in (["quick"] if args.quick else LEARNER_RUNS[shape]):
                samples = make_samples(BATCHES[b], arch.vocab_size)
                result["learner"] += learner_rows(shape, BATCHES[b][0], samples,
                                                  learner_part(ours, None if args.no_hf else hf, samples, device, args))
        del ours, hf
        if args.part in ("all", "engine"):
            for r in engine_part(arch, path, device, args):
                result["engine"].append(dict(shape=shape, **r))


def flash(device, args, result):
    """GLM-4.7-Flash cut to --layers: ours and transformers' learner, one after the other, then generation."""
    arch = arch_of("flash", args.layers, args.quick)
    ours, hf = pair_in_memory(arch, device)
    if args.no_hf:
        hf = None
    n = sum(p.numel() for p in ours.parameters())
    err = agreement(ours, hf, arch, device) if hf is not None else None
    result["models"]["flash"] = dict(params=n, logits_rel_err=err, config=arch.to_hf())
    log(f"flash, {arch.num_layers} layers: {n / 1e6:,.1f}M parameters"
        + (f"; fp32 logits ours vs transformers: relative error {fmt(err)}" if err is not None else ""))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device("meta"):
        gen = GLM(arch).cast_(dtype)  # the generator's copy, as engine.make_engine (FP32_PARAMS stay fp32)
    gen.to_empty(device=device).load_state_dict(ours.state_dict())
    if args.part in ("all", "learner"):
        batch = BATCHES["quick"] if args.quick else (
            f"{args.samples} sequences, prompt {args.prompt}, response {args.response}", args.samples,
            (args.prompt, args.prompt), (args.response, args.response))
        samples = make_samples(batch, arch.vocab_size)
        sides = learner_part(ours, hf, samples, device, args, free_ours=True)
        result["learner"] += learner_rows("flash", batch[0], samples, sides)
    del ours
    gc.collect()
    if args.part in ("all", "engine"):
        if hf is not None:
            hf = hf.to(dtype).eval()  # transformers' generator copy in the engine's dtype (its router too)
        for r in flash_engine(gen, hf, arch, device, args):
            result["engine"].append(dict(shape="flash", **r))


def markdown(result):
    lines = [f"### MoE: learner and generation vs transformers ({result['machine']})", "",
             f"Command: `{result['command']}` (torch {torch.__version__}, transformers {result['transformers']}). "
             + result["setting"]]
    for shape, m in result["models"].items():
        err = m["logits_rel_err"]
        check = "" if err is None else f"; ours vs transformers, fp32 logits relative error {err:.1e}" if isinstance(
            err, float) else f"; the fp32 logits check failed ({err})"
        lines += ["", f"`{shape}`: {m['params'] / 1e6:,.1f}M parameters{check}."]
    if result["learner"]:
        lines += ["", "| shape | batch | learner | tokens | s / step | tokens / s | vs transformers | peak GiB | "
                      "held before GiB |",
                  "|---|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in result["learner"]:
            if "error" in r:
                lines.append(f"| {r['shape']} | {r['batch']} | {r['side']} | {r['tokens']} | failed: {r['error']} "
                             "| | | | |")
                continue
            vs = "" if r["vs_hf"] is None else f"{r['vs_hf']:.2f}x"
            lines.append(f"| {r['shape']} | {r['batch']} | {r['side']} | {r['tokens']} | {r['step_s']:.3f} | "
                         f"{r['tokens_per_s']:.0f} | {vs} | {gib(r['peak'])} | {gib(r['before'])} |")
    flash_rows = [r for r in result["engine"] if r["shape"] == "flash"]
    other = [r for r in result["engine"] if r["shape"] != "flash"]
    if other:
        lines += ["", "| shape | workload | engine | s | new tokens / s | vs transformers |",
                  "|---|---|---|---:|---:|---:|"]
        lines += [f"| {r['shape']} | {r['workload']} | {r['side']} | {r['seconds']:.2f} | {r['tokens_per_s']:.0f} | "
                  f"{r['vs_hf']:.2f}x |" for r in other]
    if flash_rows:
        names = {"graphs": "TorchEngine, CUDA graphs", "eager": "TorchEngine, eager", "hf": "transformers `generate`",
                 "fp8 graphs": "TorchEngine fp8, CUDA graphs", "fp8 eager": "TorchEngine fp8, eager"}
        lines += ["", "| rows | engine | prefill s | prefill tokens / s | prefill's ATen ops | decode s | decode tokens / s | "
                      "decoder's share of a step's bytes | peak GiB | held before GiB |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in flash_rows:
            if "error" in r:
                lines.append(f"| {r['rows']} | {names[r['side']]} | failed: {r['error']} | | | | | | | |")
                continue
            share = "" if r.get("decoder_share") is None else f"{100 * r['decoder_share']:.1f}%"
            lines.append(f"| {r['rows']} | {names[r['side']]}{' (' + r['note'] + ')' if r['note'] else ''} | "
                         f"{r['prefill_s']:.3f} | {r['prefill_tokens_per_s']:.0f} | {r['prefill_ops']} | {r['decode_s']:.2f} | "
                         f"{r['decode_tokens_per_s']:.0f} | {share} | {gib(r['peak'])} | {gib(r['before'])} |")
    if result["routes_recorded"] is False:
        lines += ["", "The engine's completions carried no routes: this model.py does not record them beside the KV "
                      "(model.PagedKVCache.routes) yet, so the engine's figures leave that work out."]
    return "\n".join(lines)


def setting(args, device):
    dtype = ("bf16 autocast over fp32 weights (learner), bf16 weights (generation)" if device.type == "cuda"
             else "float32")
    s = (f"Random weights, {dtype}. Learner: median of {args.repeat} steps after a warm-up "
         f"({'interleaved' if device.type == 'cpu' else 'one side after the other'}), micro-batches of up to "
         f"{args.tokens} tokens, gradient checkpointing {'on' if args.checkpointing else 'off'}, transformers fed "
         f"{'the whole batch padded at once' if not args.hf_rows else f'{args.hf_rows} padded sequences at a time'}; "
         "tokens are prompt + response tokens.")
    if set(args.shapes) - {"flash"}:
        work = "quick workloads" if args.quick else "bench/engine.py's `uniform` and `rl` workloads"
        s += (f" Generation on {', '.join(x for x in args.shapes if x != 'flash')}: at most {args.batch} rows at "
              f"once, {work}, median of {args.repeat} rounds after a warm-up, interleaved; requested new tokens / "
              "wall-clock s.")
    if "flash" in args.shapes:
        s += (f" Generation on flash: {args.gen_batch} rows of {args.prompt}-token prompts, {args.new_tokens} new "
              f"tokens at temperature 1 (no stop); prefill = a 1-token generate (median of {args.repeat}; ours packs at "
              f"most {args.prefill_tokens} tokens a forward, what configs/glm47flash_math.yaml's memory plan counts); "
              "decode = the rest of one generate.")
    if device.type == "cuda":
        s += (" Ours multiplies the routed experts by " + ("bf16 copies made once per optimizer step (kernels/moe.CastCache)"
              if moe_kernels.CAST_CACHE else "their bf16 casts made in every forward and recompute (--no-cast-cache)") + ".")
        s += (" Peak memory: torch.cuda.max_memory_allocated in each phase, beside what was already allocated when it "
              "began (the other copies' weights).")
    return s


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", help="comma-separated: tiny, wide, flash (default tiny,wide; --quick: tiny)")
    ap.add_argument("--part", choices=("all", "learner", "engine"), default="all")
    ap.add_argument("--quick", action="store_true", help="tiny batches and workloads: seconds (a smoke test)")
    ap.add_argument("--repeat", type=int, default=None, help="timed steps / rounds (median; default 3, quick 1)")
    ap.add_argument("--batch", type=int, default=64, help="tiny / wide: rows decoding at once in both engines")
    ap.add_argument("--layers", type=int, default=4, help="flash: decoder layers kept (the published model has 47)")
    ap.add_argument("--samples", type=int, default=32, help="flash: learner sequences (groups of 8)")
    ap.add_argument("--prompt", type=int, default=None, help="flash: prompt tokens (learner and generation; default 256, "
                    "--quick 6)")
    ap.add_argument("--response", type=int, default=1024, help="flash: learner response tokens")
    ap.add_argument("--tokens", type=int, default=None, help="optim.max_tokens_per_micro_batch (default 16384)")
    ap.add_argument("--hf-rows", type=int, default=None, help="transformers: sequences per padded micro-batch "
                    "(default: all at once; flash on CUDA 4)")
    ap.add_argument("--gen-batch", default=None, help="flash: generation rows, comma-separated (default 64,256)")
    ap.add_argument("--new-tokens", type=int, default=None, help="flash: new tokens per row (default 128)")
    ap.add_argument("--prefill-tokens", type=int, default=None, help="flash: tokens one prefill forward of ours packs "
                    "(default config.prefill_budget of configs/glm47flash_math.yaml: what its memory plan counts)")
    ap.add_argument("--no-checkpointing", dest="checkpointing", action="store_false", default=None,
                    help="flash: no gradient checkpointing (default on there, off on tiny / wide, as their configs)")
    ap.add_argument("--no-hf", action="store_true", help="ours only (no transformers side)")
    ap.add_argument("--no-fp8", action="store_true", help="flash: no fp8 generator rows")
    ap.add_argument("--engines", type=lambda s: s.split(","), help="flash: only these engine rows, comma-separated, of "
                    "graphs, eager, hf, 'fp8 graphs', 'fp8 eager' (default all)")
    ap.add_argument("--no-cast-cache", action="store_true", help="ours casts the routed experts to bf16 in every "
                    "forward and recompute (kernels/moe.CAST_CACHE off: the path before the cast cache)")
    ap.add_argument("--profile", metavar="DIR", help="also run one untimed learner step per side and (flash) a prefill "
                    "and a 16-token generate per engine under torch.profiler: their op tables, most device time first")
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--md", help="write the markdown table here")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks.md"), help="the file --write updates")
    ap.add_argument("--write", action="store_true", help="write the section into --out (docs/benchmarks.md)")
    args = ap.parse_args(argv)
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    moe_kernels.CAST_CACHE = not args.no_cast_cache
    args.shapes = (args.shape or ("tiny" if args.quick else "tiny,wide")).split(",")
    is_flash = "flash" in args.shapes
    if set(args.shapes) - {"tiny", "wide", "flash"}:
        ap.error(f"--shape: tiny, wide or flash, got {args.shape}")
    if args.quick and args.write and os.path.abspath(args.out) == os.path.join(ROOT, "docs", "benchmarks.md"):
        ap.error("--quick is a smoke test: its numbers do not go into docs/benchmarks.md (give --out)")
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    quick = args.quick
    args.repeat = args.repeat or (1 if quick else 3)
    args.tokens = args.tokens or 16384
    args.checkpointing = (is_flash and not quick) if args.checkpointing is None else args.checkpointing
    if args.hf_rows is None and is_flash and device.type == "cuda":
        args.hf_rows = 4  # [4 x 1280 tokens, 154880] fp32 logits: 3 GiB, and as much again for log_softmax
    if is_flash and quick:  # (the learner trains on BATCHES["quick"])
        args.prompt = args.prompt or 6
        args.gen_batch, args.new_tokens = args.gen_batch or "2,4", args.new_tokens or 4
    args.gen_batch, args.new_tokens, args.prompt = args.gen_batch or "64,256", args.new_tokens or 128, args.prompt or 256
    args.prefill_tokens = args.prefill_tokens or config.prefill_budget(
        config.load_config(os.path.join(ROOT, "configs", "glm47flash_math.yaml"), []))
    if quick:
        args.batch = min(args.batch, 4)
    if args.samples % 8:
        ap.error("--samples: whole groups of 8")

    args.routes = []  # per engine model: whether its completions carried routes
    import transformers
    command = "python bench/moe.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result = dict(machine=machine(device), command=command,
                  transformers=transformers.__version__, setting=setting(args, device), models={}, learner=[],
                  engine=[])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    for shape in args.shapes:
        if shape == "flash":
            flash(device, args, result)
        else:
            side_by_side(shape, device, args, result)
    result["routes_recorded"] = all(args.routes) if args.routes else None
    md = markdown(result)
    print(md, flush=True)
    write_results(args, result, md)
    if args.write:
        key = f"moe-{device.type}" + ("-flash" if args.shapes == ["flash"] else "")
        write_section(args.out, key, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
