"""
The per-GPU memory plan that `python train.py --dry-run` prints (plumbing, like config.py): what one
learner GPU and one generator GPU hold at their peak, worked out from the model's shapes alone, before
any weights load or any GPU is touched. Each item follows what the code allocates: the learner of
train.py (FSDP2 or DDP, fp32 master weights, bf16 compute, AdamW, chunked logits, checkpointing) and
the engine of engine.py (its model.PagedKVCache, prefills, decode steps and CUDA graphs). A buffer the
GPU path allocates and this plan omits is a bug.
"""
from dataclasses import dataclass, field

import torch

import dsa
from kernels import dsa_triton
from machinery import lora
from machinery.engine import PREFILL_TOKENS
from machinery.fp8 import weight_bytes as fp8_weight_bytes
from families.mla_moe import route_dtype
from model import BLOCK_SIZE, FP32_PARAMS, GLM, GROUP_RATIO, GLMConfig

# Transients that never coexist (one chunk's logits, one recomputed block, a reduce-scatter buffer) enter
# as the largest of them. Sizes in bytes, tables in GiB (2^30): an "80 GB" H100 shows 79.6 GiB in
# nvidia-smi, so gpu_bytes=80e9 (74.5 GiB) is on the safe side.

GiB = 2**30
# CUDA context (~0.5 GiB), NCCL buffers and the caching allocator's fragmentation (freed blocks of the
# wrong size): a "fits" that does not leave this much free would not survive a real run.
OVERHEAD = 3 * GiB
# cuBLAS's workspace for one stream on Hopper: the CUDA graphs' capture stream keeps one in the graphs' pool
CUBLAS_WORKSPACE = 32 * 2**20


@dataclass
class MemoryPlan:
    params: int  # total parameter count
    learner: list[tuple[str, int]]  # (item, bytes) on one learner GPU at its peak: a training step
    generator: list[tuple[str, int]]  # (item, bytes) on one generator GPU at its peak: decoding
    settings: dict = field(default_factory=dict)  # memory_plan's arguments, and the KV cache bytes per token
    learner_load: list[tuple[str, int]] = field(default_factory=list)  # (item, bytes) while the weights load
    generator_load: list[tuple[str, int]] = field(default_factory=list)

    def learner_bytes(self) -> int:
        return sum(b for _, b in self.learner)

    def generator_bytes(self) -> int:
        return sum(b for _, b in self.generator)

    def _gpus(self, gpu_bytes):
        """(title, items, bytes needed, bytes allowed, load-time bytes) per GPU kind; SGLang's weights live in its
        static pool. Sharing one GPU (settings["shared"]), the learner gets what the generator leaves."""
        s = self.settings
        pool = gpu_bytes * s["sglang_mem_fraction"] if s["engine"] == "sglang" else gpu_bytes
        gen = (f"generator GPU ({s['engine']} engine)", self.generator, self.generator_bytes(), pool,
               sum(b for _, b in self.generator_load))
        learner = (f"learner GPU ({s['parallel']} over {s['learner_gpus']})", self.learner, self.learner_bytes(), gpu_bytes,
                   sum(b for _, b in self.learner_load))
        if s.get("shared"):  # one CUDA context between them; SGLang's static share is taken first
            room = gpu_bytes - (pool if s["engine"] == "sglang" else self.generator_bytes() - OVERHEAD)
            learner = (f"learner, on the same GPU ({s['parallel']} over {s['learner_gpus']})", *learner[1:3], room,
                       learner[4])
        return [learner, gen]

    def text(self, gpu_bytes) -> str:
        s = self.settings
        out = [f"memory plan: {self.params / 1e9:.2f}B parameters, GPU {gpu_bytes / 1e9:.1f} GB = {gpu_bytes / GiB:.1f} GiB"]
        for (title, items, need, allowed, load), loading in zip(self._gpus(gpu_bytes), (self.learner_load, self.generator_load)):
            out += [f"{title:<72} GiB"] + [f"  {item:<70} {b / GiB:6.2f}" for item, b in items]
            verdict = "fits" if need <= allowed and load <= allowed else "does NOT fit"
            out.append(f"  {'total at the step-time peak':<70} {need / GiB:6.2f}  {verdict} in {allowed / GiB:.1f} GiB")
            if loading:
                what = "weights" + (" + KL reference" if any("reference" in i for i, _ in loading) else "")
                out.append(f"  {f'total at the load-time peak ({what}, one tensor in flight)':<70} {load / GiB:6.2f}")
        if s.get("colocate"):
            out.append("co-located (train.colocate): one GPU, the two halves in turn; its peak is the largest phase's")
            for phase, items, total in self.phases():
                out.append(f"  {phase:<96} {total / GiB:6.2f}")
                out += [f"      {item:<92} {b / GiB:6.2f}" for item, b in items]
            peak = max(total for _, _, total in self.phases())
            out.append(f"  {'peak':<96} {peak / GiB:6.2f}  {'fits' if peak <= gpu_bytes else 'does NOT fit'} in "
                       f"{gpu_bytes / GiB:.1f} GiB" + (f"; pinned host memory per process {s['pinned_host'] / GiB:.2f} GiB"
                                                       if s["pinned_host"] else ""))
        if s.get("shared"):
            both = self.learner_bytes() + self.generator_bytes() - OVERHEAD
            out.append(f"one GPU for both: {both / GiB:.2f} GiB of {gpu_bytes / GiB:.1f} (generator, learner, one CUDA context)"
                       if s["engine"] == "torch" else
                       f"one GPU for both: SGLang's {s['sglang_mem_fraction']:.0%} share + the learner's "
                       f"{self.learner_bytes() / GiB:.2f} GiB of {gpu_bytes / GiB:.1f}")
        if s["fp8_saved"]:  # a decode step reads every weight and, with the pool full, every KV slot once
            pool, bf16 = s["kv_cache_tokens"] * s["kv_token"], self.generator[0][1] + s["fp8_saved"]
            out.append(f"  fp8 weights save {s['fp8_saved'] / GiB:.2f} GiB of the generator's bf16 ones: room for "
                       f"{s['fp8_saved'] // s['kv_token']} more KV token slots ({s['fp8_saved'] // s['kv_token'] // s['generator_max_len']} "
                       f"more rows at the longest sequence, {s['generator_max_len']} tokens); a decode step over a full pool reads "
                       f"{pool / GiB:.1f} GiB of KV beside the weights, so fp8 weights make it at most "
                       f"{s['fp8_saved'] / (bf16 + pool):.0%} faster (an fp8 KV cache is the larger lever)")
        if s["engine"] == "sglang":
            kv = gpu_bytes * s["sglang_mem_fraction"] - self.generator_bytes()
            out.append(f"  SGLang's KV pool: the rest of its share, {kv / GiB:.1f} GiB = {max(0, int(kv)) // s['kv_token']} "
                       f"tokens (batch x max_len = {s['generator_batch'] * s['generator_max_len']}; fewer rows run at once "
                       f"if short); CUDA graphs and activations use the other {1 - s['sglang_mem_fraction']:.0%}, not modelled")
        return "\n".join(out)

    def phases(self) -> list[tuple[str, list, int]]:
        """Co-located: (phase, items, bytes) of each phase of a step (memory_plan's colocate)."""
        return [(phase, items, sum(b for _, b in items)) for phase, items in self.settings.get("phases", [])]

    def problems(self, gpu_bytes) -> list[str]:
        s, out = self.settings, []
        if s.get("colocate"):
            phase, _, need = max(self.phases(), key=lambda p: p[2])
            name = phase.split(":")[0]
            fix = ["model.lora (a frozen bf16 base shared with the engine, adapters alone train)"] if not s["lora"] else []
            if name == "generate":  # the engine's pool and rows, beside what stays of the learner
                fix += (["train.offload: true"] if not s["offload"] else []) + ["a smaller rollout.kv_cache_tokens or "
                                                                                 "rollout.max_batch"]
            elif name == "train":  # the learner's step alone: the engine's pool is released, its state is back
                fix += ([] if s["gradient_checkpointing"] else ["model.gradient_checkpointing: true"]) + [
                    "a smaller optim.max_tokens_per_micro_batch"]
            else:  # load, checkpoint: weights and the learner's state
                fix += (["train.parallel: fsdp (shards the learner's state)"] if s["parallel"] == "ddp" else []) + [
                    "more GPUs (train.pairs)"]
            return [f"co-located, the {name} phase needs {need / GiB:.1f} GiB of {gpu_bytes / GiB:.1f}: "
                    + "; ".join(fix)] if need > gpu_bytes else []
        (lt, _, lneed, lgpu, lload), (gt, _, gneed, gpool, gload) = self._gpus(gpu_bytes)
        lneed, gneed = max(lneed, lload), max(gneed, gload)
        if s.get("shared") and lneed > lgpu:  # one line: what to lower, with the sizes that say which side to lower
            kv = next(b for item, b in self.generator if item.startswith("paged KV pool")) if s["engine"] == "torch" else 0
            sides = (f"the generator ({gneed / GiB:.1f} GiB, its KV pool {kv / GiB:.1f}) and the learner "
                     f"({lneed / GiB:.1f} GiB) share one GPU and need {(lneed + gpu_bytes - lgpu) / GiB:.1f} GiB together, "
                     f"of {gpu_bytes / GiB:.1f}: ")
            if lneed > gpu_bytes:
                out.append(sides + f"the learner alone does not fit (fp32 weights, grads and AdamW of {self.params / 1e9:.2f}B "
                                   "parameters): more GPUs (a generator and a learner GPU per pair, train.pairs) or a smaller model")
            else:
                gen = ("rollout.kv_cache_tokens or rollout.max_batch" if s["engine"] == "torch" else "rollout.sglang_mem_fraction")
                out.append(sides + f"lower {gen} (generator), or optim.max_tokens_per_micro_batch" +
                           ("" if s["gradient_checkpointing"] else " or set model.gradient_checkpointing: true") + " (learner)")
            return out
        if lneed > lgpu:
            fix = ["train.parallel: fsdp (shards weights, grads and AdamW state)"] if s["parallel"] == "ddp" else []
            fix += [] if s["gradient_checkpointing"] else ["model.gradient_checkpointing: true"]
            fix += ["more GPU pairs (train.pairs, or more nodes)", "a smaller optim.max_tokens_per_micro_batch"]
            fix += ["grpo.kl_coef: 0 and grpo.kl_guard: false (no reference model)"] if s["reference"] else []
            out.append(f"{lt} needs {lneed / GiB:.1f} GiB of {lgpu / GiB:.1f}: " + "; ".join(fix))
        if s["engine"] == "torch" and gneed > gpool:
            out.append(f"{gt} needs {gneed / GiB:.1f} GiB of {gpool / GiB:.1f}: a smaller rollout.kv_cache_tokens (null: "
                       "max_batch x (prompt + new tokens)) or rollout.max_batch")
        if s["engine"] == "sglang" and gneed + s["kv_token"] * s["generator_max_len"] > gpool:
            out.append(f"{gt}: SGLang's share ({gpool / GiB:.1f} GiB) cannot hold the weights and one sequence's KV "
                       "cache: a larger rollout.sglang_mem_fraction")
        if s["engine"] == "sglang" and gpu_bytes - gpool < OVERHEAD:
            out.append(f"{gt}: SGLang leaves under {OVERHEAD / GiB:.0f} GiB for CUDA graphs and activations: "
                       "a smaller rollout.sglang_mem_fraction")
        return out


def _dsa_block(cfg: GLMConfig, B, Tq, Tk, grad, kernels):
    """Bytes of DSA's largest transient in one layer. select_topk scores c queries at a time: with the
    Triton kernels fp32 [B, c, Tk] (+ mask, int64 tie-free keys and topk's workspace: ~29 bytes a score),
    else [B, c, H_I, Tk] fp32 and its ReLU. Sparse attention: with the kernels, nothing gathered; its
    backward holds dQ [Tq, H, D] and dK, dV [Tk, Hkv, D] in fp32 and a slot buffer of at most
    dsa_triton.BWD_BUFFER_BYTES. Without them, gathered keys and values [B, Hkv, c, K, D] bf16 (GPU chunk),
    their fp32 copies and the logits and probabilities [B, Hkv, c, G, K] fp32; with grad a chunk is
    recomputed in backward and its gradients join it."""
    K, D, Hkv = min(cfg.dsa.topk, Tk), cfg.head_dim, cfg.num_kv_heads
    if kernels:
        c = min(Tq, max(1, dsa.CHUNK_ELEMENTS // (B * Tk)))
        scores = c * B * Tk * 29
        attn = B * Tq * cfg.num_heads * 4 * 2  # LSE and Delta [B, Tq, H] fp32
        if grad:
            attn += (min(dsa_triton.BWD_BUFFER_BYTES, B * Tq * K * Hkv * D * 4 * 2)
                     + B * Tq * cfg.num_heads * D * 4 + 2 * B * Tk * Hkv * D * 4)
        return max(scores, attn)
    per_q = B * cfg.dsa.heads * Tk
    scores = min(Tq, max(1, dsa.CHUNK_ELEMENTS // per_q)) * per_q * 4 * 2  # a chunk is at most all Tq queries
    per_q = B * K * Hkv * D
    c = min(Tq, max(1, dsa.GATHER_ELEMENTS * dsa.GATHER_GPU_FACTOR // per_q))
    return max(scores, ((2 + 4) * 2 * c * per_q + 2 * 4 * c * B * K * cfg.num_heads) * (2 if grad else 1))


def _widths(cfg: GLMConfig):
    """Per-token widths of a decoder layer: (queries, keys, values, attention output) in elements, MLA's latents
    in bytes, and an MoE layer's bytes: its k routed experts' dispatched copies (x, gate_up, silu, act, output,
    weighted), the shared experts and the router's fp32 scores (0 for a dense model)."""
    H = cfg.num_heads
    HD, KD = H * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    if cfg.mla is not None:  # MLA: queries and keys of nope + rope dims, values of v_head_dim; keys and values are
        m = cfg.mla         # expanded from the latent for the learner's (and a prefill's) attention
        HD = KD = H * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        VD = OD = H * m.v_head_dim  # values, and the attention's output
        latent = 2 * (m.q_lora_rank or 0) * 2 + 2 * (m.kv_lora_rank + m.qk_rope_head_dim) * 2  # q_a, kv_a, their norms
    else:
        VD, OD, latent = KD, HD, 0
    moe_token = 0
    if cfg.moe is not None:
        e, h = cfg.moe, cfg.hidden_size
        Im, k, Is = e.moe_intermediate_size, e.num_experts_per_tok, e.moe_intermediate_size * e.n_shared_experts
        moe_token = 2 * k * (3 * h + 4 * Im) + 2 * 4 * Is + 3 * 4 * e.n_routed_experts + 8 * k * 2
    return HD, KD, VD, OD, latent, moe_token


def _forward_bytes(cfg: GLMConfig, M, dsa_kernels):
    """Bytes of a no-grad forward's largest layer over one packed row of M tokens in bf16 weights (an engine's
    prefill, a distillation teacher's scoring): everything bf16 but RMSNorm's internals; attention runs on groups of
    similar-length sequences (right-padded, no mask)."""
    h, I, H = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads
    HD, KD, VD, OD, latent, moe_token = _widths(cfg)
    pad = 1 / GROUP_RATIO
    out = M * (2 * h + max(2 * (h + 4 * I) if cfg.moe is None or "dense" in cfg.moe.mlp_layer_types else 0,
                           moe_token,  # residual [M, h] + normed input, gate_up [M, 2I], silu, act (or MoE's)
                           2 * (h + 2 * (HD + KD) + 2 * VD + OD) + latent  # or q, k, v before and after RoPE, out
                           + int(pad * (2 * (HD + KD + VD) + 2 * OD + 4 * H)),  # + the groups' q, k, v, out, LSE
                           3 * 4 * h))  # or RMSNorm's fp32 temps
    if cfg.dsa is not None and cfg.dsa.topk < M:
        out += _dsa_block(cfg, 1, M, M, grad=False, kernels=dsa_kernels)
    return out


def _fp8_input_bytes(cfg: GLMConfig, M) -> int:
    """The quantized copy of an fp8 linear's input (machinery/fp8.py) over M tokens, at its largest: the widest input
    ([M, max(h, I)], or the routed experts' sorted slots [M k, max(h, I_moe)]) as e4m3 codes and a fp32 scale per 128
    values (fp8.triton_quantize: scaled_mm's path and the Triton kernel's "pre" and "swap" modes; "fused" quantizes on
    chip. Without Triton, scaled_mm's PyTorch quantization would hold 7 bytes a value: not planned, a CUDA torch
    ships Triton)."""
    values = M * max(cfg.hidden_size, cfg.intermediate_size)
    if cfg.moe is not None:
        values = max(values, M * cfg.moe.num_experts_per_tok * max(cfg.hidden_size, cfg.moe.moe_intermediate_size))
    return int(values * (1 + 4 / 128))


def teacher_items(cfg: GLMConfig, tokens, fp8, logit_chunk, dsa_kernels=True):
    """(weights, scoring) items of an on-policy distillation teacher on the generator's GPU (machinery/teacher.py):
    its bf16 weights (fp8: block-wise e4m3), and what scoring one packed row of `tokens` costs at its peak: the
    largest layer's forward, or the kept positions' hidden states [tokens, h] bf16 and one chunk's logits, bf16
    [c, V] then fp32 / temperature and its log-softmax (fp8: beside it, the quantized copy of a linear's input)."""
    with torch.device("meta"):
        named = dict(GLM(cfg).named_parameters())
    P = sum(p.numel() for p in named.values())
    P32 = sum(p.numel() for n, p in named.items() if n.endswith(FP32_PARAMS))
    weights = fp8_weight_bytes(cfg) if fp8 else 2 * P + 2 * P32
    c = min(logit_chunk, tokens)
    scoring = max(_forward_bytes(cfg, tokens, dsa_kernels), tokens * 2 * cfg.hidden_size + c * cfg.vocab_size * (2 + 4 + 4))
    if fp8:  # an fp8 linear's input quantized too
        scoring += _fp8_input_bytes(cfg, tokens)
    return ([(f"distillation teacher's {'fp8' if fp8 else 'bf16'} weights ({P / 1e9:.1f}B parameters)", weights)],
            [(f"the teacher scoring one packed row of {tokens} tokens", scoring)], P)


def memory_plan(cfg: GLMConfig, *, learner_gpus: int, parallel: str, micro_batch_tokens: int,
                gradient_checkpointing: bool, trainable_indexer: bool, reference: bool,
                generator_batch: int, generator_max_len: int, max_new_tokens: int, engine: str,
                kv_cache_tokens: int | None = None, cuda_graphs: bool = False, prefill_tokens: int = PREFILL_TOKENS, group_size: int = 1,
                sglang_mem_fraction: float | None = None, logit_chunk: int = 1024, logit_keep: int = 64 * 2**20,
                dsa_kernels: bool = True, shared: bool = False, fp8: bool = False, lora_cfg=None,
                colocate: bool = False, offload: bool = True, teacher: GLMConfig | None = None,
                teacher_fp8: bool = False, speculative_tokens: int = 0) -> MemoryPlan:
    """Per-GPU memory of the learner (FSDP2 or DDP over learner_gpus; micro-batches of one packed row of
    micro_batch_tokens) and the generator (engine "torch": generator_batch rows decoding at once, sequences of
    up to generator_max_len tokens (max_new_tokens of them generated) in a pool of kv_cache_tokens slots
    (None: every row at full length), prefills of prefill_tokens whose contexts the group_size samples of a
    prompt share; cuda_graphs: decode steps replayed as CUDA graphs; "sglang": its share of the GPU). logit_chunk:
    response tokens per lm_head call (config.LOGIT_CHUNK); logit_keep: the bytes of fp32 logits a micro-batch
    keeps for backward instead of recomputing them (config.LOGIT_KEEP_BYTES). dsa_kernels: DSA and the sampler run
    dsa_triton's kernels (dsa.USE_TRITON). shared: the generator and the learner share one GPU (their sum must fit).
    fp8: the generator's decoder linears are block-wise e4m3 (rollout.quantization; fp8.weight_bytes).
    lora_cfg: model.lora's lora.LoRAConfig (None: none): RL's learner holds a frozen bf16 base and fp32 adapters with
    their gradients and AdamW state (the warm-up stages, if any, train the whole model: plan them without it), and
    the generator fp32 adapters beside its weights.
    colocate: one GPU per process for both halves in turn (colocate.py); the plan's phases (MemoryPlan.phases) are what
    must fit. offload: the learner's fp32 masters and AdamW state leave the GPU while the engine generates.
    teacher (distill.teacher's architecture; teacher_fp8: its weights e4m3): on the generator's GPU for good, scoring
    packed rows of micro_batch_tokens (teacher_items), possibly while an eval decodes, so counted beside everything.
    speculative_tokens (rollout.speculative_tokens, torch engine): k drafts per row and step from the MTP layer, whose
    KV the pool holds as one more layer (machinery/speculative.py); a step verifies B (k + 1) rows in one forward.
    Beside each step-time peak, the load-time one: the weights as model.GLM.from_pretrained allocates them."""
    assert parallel in ("fsdp", "ddp") and engine in ("torch", "sglang")
    assert engine == "torch" or sglang_mem_fraction, "engine sglang needs sglang_mem_fraction"
    with torch.device("meta"):
        named = dict(GLM(cfg).named_parameters())  # exact counts, no memory; a tied lm_head appears once

    def count(keep):
        return sum(p.numel() for n, p in named.items() if keep(n))

    P = count(lambda n: True)
    Pt = P - (0 if trainable_indexer else count(lambda n: ".indexer." in n))  # RL keeps the indexer frozen
    P32 = count(lambda n: n.endswith(FP32_PARAMS))  # small indexer (and MoE router) tensors every copy keeps in fp32
    root = count(lambda n: not n.startswith("layers."))  # embed_tokens, norm, lm_head
    # bf16 bytes of one decoder layer as FSDP gathers it (an F layer if DSA: its indexer is gathered in fp32, as is an
    # MoE layer's router)
    layer = max(2 * count(lambda n: n.startswith(f"layers.{i}.")) + 2 * count(lambda n: n.startswith(f"layers.{i}.self_attn.indexer."))
                + 2 * count(lambda n: n.startswith(f"layers.{i}.mlp.gate.")) for i in range(cfg.num_layers))
    L, N, T, h, I = cfg.num_layers, learner_gpus, micro_batch_tokens, cfg.hidden_size, cfg.intermediate_size
    V, H = cfg.vocab_size, cfg.num_heads
    n_F = cfg.dsa.layer_kinds(L).count("F") if cfg.dsa else 0
    HD, KD, VD, OD, latent, moe_token = _widths(cfg)
    # The MLP of the widest layer per token: a dense MLP (intermediate_size), or an MoE layer's k routed experts
    # and shared experts
    mlp_width = I
    n_moe = len(cfg.moe_layers)
    route_bytes = n_moe * cfg.moe.num_experts_per_tok * torch.tensor([], dtype=route_dtype(cfg)).element_size() if n_moe else 0
    if cfg.moe is not None:
        e = cfg.moe
        mlp_width = max(I if "dense" in e.mlp_layer_types else 0,
                        (e.num_experts_per_tok * 4 * e.moe_intermediate_size + 4 * e.moe_intermediate_size * e.n_shared_experts) // 4)

    # Learner activations of one packed row of T tokens. The residual stream is bf16 (a = 2 bytes) under
    # FSDP (bf16 weights) and DDP alike (model.GLM.forward casts it to autocast's dtype).
    a = 2
    pad = 1 / GROUP_RATIO  # attention regroups the row's sequences, right-padded: at most this many slots a token
    block = T * (4 * (4 + 2 * a) * h  # 4 RMSNorms: fp32 copy of the input, normalised, output [T, h]
                 + 2 * 2 * (HD + KD) + 2 * VD + latent  # q [T, H*D], k [T, Hkv*D] before and after RoPE; v; MLA's latents
                 + int(pad * (2 * (HD + KD + VD) + 2 * OD + 4 * H))  # per group: q, k, v, output bf16, LSE fp32
                 + 2 * OD  # the attention output back in row order [T, H*D] (no mask anywhere: flash kernel)
                 + max(2 * (2 * I + I + I) if cfg.moe is None or "dense" in cfg.moe.mlp_layer_types else 0, moe_token)
                 + a * h)  # gate_up [T, 2I], silu(gate) [T, I], act = silu(gate) * up [T, I] (or MoE's); residual [T, h]
    block_grads = T * 2 * 4 * mlp_width  # backward's gradients of the MLP tensors [T, 4I] bf16
    sparse = cfg.dsa is not None and cfg.dsa.topk < T
    if sparse:  # DSA inside the block: select_topk without grad, sparse_attention's chunks with
        block_grads += _dsa_block(cfg, 1, T, T, grad=True, kernels=dsa_kernels)
    if gradient_checkpointing:
        saved = ("block inputs kept by checkpointing [T, h] x layers", L * T * h * a)
        one_block = ("one block recomputed + grads", block + block_grads)
    else:
        saved = ("every block's activations (no checkpointing)", L * block)
        one_block = ("one block's gradients", block_grads)
    # lm_head on one chunk: bf16 [c, V], then fp32 logits / temperature, log_softmax, shifted z, softmax
    # and, in backward, their gradients: 5.5 fp32 [c, V] at the peak (measured on CPU).
    logits = (f"logits of a chunk fp32 [{min(logit_chunk, T)}, vocab] x5.5", int(5.5 * min(logit_chunk, T) * V * 4))

    # The routed experts' bf16 copies (kernels/moe.CastCache): with fp32 masters under autocast (one process, or DDP)
    # each MoE layer's are cast by the step's first forward and held, every layer's, until its optimizer step drops
    # them; forwards and checkpointed recomputes reuse them. None under LoRA (the experts are in the frozen bf16 base:
    # nothing to cast; GLM-4.7-Flash's recipe fits because of it: its 46 MoE layers' copies would be 51.8 GiB) nor under
    # FSDP2 across processes (gathered in bf16 per use, never cached). Held into the next phase only after a skipped
    # (non-finite) step, which drops nothing: the co-located phases below leave that case out.
    experts = count(lambda n: ".mlp.experts." in n)
    cast_once = ("routed experts' bf16 copies, made once a step (kernels/moe.py)", 2 * experts)
    adapters = 0
    if lora_cfg is not None:  # LoRA (config refuses FSDP across processes): a frozen bf16 base, replicated; fp32 adapters
        with torch.device("meta"):  # counted on a meta model with lora.py's own adapters
            adapters = sum(p.numel() for _, p in lora.adapter_named(lora.add(GLM(cfg), lora_cfg)))
        learner = [("bf16 frozen base (indexer fp32 islands); the KL reference is it, adapters off", 2 * P + 2 * P32),
                   (f"LoRA adapters rank {lora_cfg.rank} fp32: weights, grads, " + ("DDP buckets, " if N > 1 else "") + "AdamW",
                    (20 if N > 1 else 16) * adapters)]  # (one process: no DDP, no buckets)
        transients = [logits, one_block]
    elif parallel == "fsdp":  # FSDP2: fully_shard per decoder layer + root; bf16 params, fp32 reduce
        learner = [(f"fp32 master weights (1/{N})", 4 * P // N), (f"fp32 grads, trainable (1/{N})", 4 * Pt // N),
                   (f"AdamW exp_avg + exp_avg_sq fp32 (1/{N})", 8 * Pt // N)]
        learner += [(f"KL reference bf16 (1/{N}): bf16 is what the forward uses", (2 * P + 2 * P32) // N)] if reference else []
        learner += [("bf16 root (embed, norm, lm_head), gathered all step", 2 * root),
                    ("bf16 decoder layers gathered: current + prefetched", 2 * layer),
                    ("bf16 root grads (lm_head's from the first chunk on)", 2 * root)]
        one_block = (one_block[0] + " (+ layer's bf16/fp32)", one_block[1] + 3 * layer)
        learner += [cast_once] if N == 1 and experts else []  # one process: no FSDP (parallel_learner), fp32 masters
        transients = [logits, one_block, ("root grads' fp32 reduce-scatter copy", 4 * root),
                      ("publishing: one gathered bf16 tensor", 2 * max(p.numel() for p in named.values()))]
    else:  # DDP: full replicas; autocast caches the bf16 cast of every weight a matmul uses until it exits
        learner = [("fp32 weights", 4 * P), ("fp32 grads, trainable", 4 * Pt),
                   ("DDP gradient buckets fp32 (a second copy of the grads)", 4 * Pt),
                   ("AdamW exp_avg + exp_avg_sq fp32", 8 * Pt)]
        learner += [("KL reference bf16 (what autocast computes with anyway)", 2 * P + 2 * P32)] if reference else []
        learner += [("autocast's bf16 weight copies (held to the forward's end)",
                     2 * (Pt - experts - (0 if cfg.tie_word_embeddings else V * h)))]  # the embedding table is not cast
        learner += [cast_once] if experts else []
        transients = [logits, one_block]
    # a micro-batch with few response tokens keeps its log-probs [N, vocab] fp32 (and the entropy bonus's exp)
    learner += [("small micro-batch's log-softmax kept for backward (2 x logit_keep)", 2 * logit_keep)]
    learner += [saved] + ([("DSA top-k idx int64 + valid [T, topk] per F layer", n_F * T * cfg.dsa.topk * 9)]
                          if sparse else [])
    if cfg.mtp_layers:  # the MTP loss (families/mtp.py's mtp_loss; its weights are in P): each MTP layer's block over
        # the row, kept for backward, with its glue's [T, h] tensors (the embedding, the two norms' inputs and
        # outputs, eh_proj's [T, 2h] input); its logit chunks come after the policy's, as large (recomputed in backward)
        learner += [("MTP layers: block activations + glue [T, 7h] each", cfg.mtp_layers * (block + 7 * T * h * a))]
    if n_moe:  # the micro-batch's replayed routes (the generator's) and each MoE layer's own choice and agreement
        learner += [("MoE routes [n_moe, T, k]: replayed, chosen (int64), agreement", n_moe * T * cfg.moe.num_experts_per_tok * 18)]
    name, peak = max(transients, key=lambda t: t[1])
    learner += [(f"largest transient: {name}", peak), ("CUDA context, NCCL, fragmentation", OVERHEAD)]

    # Generator: our engine holds bf16 weights (dsa.FP32_PARAMS in fp32) and one PagedKVCache of T token slots
    # (keys and values [T, Hkv, D] per layer, indexer keys [T, d_I] on F layers), shared by rollout and eval
    # (calls take turns, engine.py). Per row: a block table, its tokens and logprobs so far, and each decode
    # step's key slots [B, S]. Its transients: a prefill (one packed row of at most prefill_tokens, or one
    # longer context alone) or a decode step (logits and the sampler's hashed noise [B, V], DSA's scores).
    # With CUDA graphs the graphs' memory pool keeps a decode forward at B rows for good.
    B, S = generator_batch, generator_max_len
    weights = fp8_weight_bytes(cfg) if fp8 else 2 * P + 2 * P32  # fp8: the bf16 model is loaded, then quantized
    blocks = -(-kv_cache_tokens // BLOCK_SIZE) if kv_cache_tokens else B * -(-S // BLOCK_SIZE)  # as TorchEngine._open
    T = (blocks + 1) * BLOCK_SIZE  # and the scratch block
    # bf16 KV per token slot: keys and values per layer (MLA: its latent, kv_lora_rank + qk_rope_head_dim values), the
    # indexer's keys on F layers; MoE: the experts each layer chose for the slot's token (routing replay), 1-2 bytes each
    kv_token = 2 * (L * cfg.kv_width + n_F * (cfg.dsa.head_dim if cfg.dsa else 0)) + route_bytes
    k = speculative_tokens if engine == "torch" else 0
    if k:  # the MTP drafter's KV: one more layer (an F layer with DSA: its own indexer keys), no routes
        kv_token += 2 * (cfg.kv_width + (cfg.dsa.head_dim if cfg.dsa else 0))
    if engine == "sglang":
        generator = [(f"{'fp8' if fp8 else 'bf16'} weights, inside SGLang's share of the GPU", weights)]
    else:
        # Prefill: one packed row of M tokens, no grad, everything bf16 but RMSNorm's internals; attention runs
        # on groups of similar-length sequences (right-padded, no mask). The samples sharing a context take
        # its keys from the row: every further copy's (pool slot, row token) int64 pairs, one copy's keys
        # gathered at a time.
        M = max(prefill_tokens, S)
        prefill = _forward_bytes(cfg, M, dsa_kernels) + M * (16 * (group_size - 1) + 2 * KD)  # + the copies' (slot,
        # source) pairs; one copy's keys. Speculative: the trunk's hidden at every token, kept for the MTP layer's
        # forward over the row (one block, after the trunk's activations are gone)
        prefill += (M * h * 2 if k else 0) + (_fp8_input_bytes(cfg, M) if fp8 else 0)  # fp8: a linear's input quantized
        # A decode step: the forward's bf16 logits [B, V] (with DSA the rows' indexer keys gathered [B, S, d_I] and
        # their scores; a turn that extends parked KV runs as such steps of at most B rows); then sampling: fp32 logits, / temperature, log_softmax, exp (greedy eval's path), and,
        # without the kernels (dsa_triton.sample), the noise's int64 hashes
        def decode(R, S):  # (forward, sampling) bytes of a decode step of R rows over S keys
            dsa_decode = 0
            if cfg.dsa is not None and cfg.dsa.topk < S:
                dsa_decode = 2 * R * S * cfg.dsa.head_dim + _dsa_block(cfg, R, 1, S, grad=False, kernels=dsa_kernels)
            # the step's MLP (or MoE: k experts per row), and MLA's absorbed attention over each row's latent keys
            # gathered [R, S, kv_lora_rank + rope] with fp32 scores [R, H, S]
            forward = 2 * R * V + max(2 * R * (h + 2 * I), R * moe_token) + dsa_decode
            if cfg.mla is not None:
                forward += R * S * (2 * cfg.kv_width + 4 * H * 2)
            forward += _fp8_input_bytes(cfg, R) if fp8 else 0
            return forward, 4 * R * V * 4 + (0 if dsa_kernels else 3 * R * V * 8)  # the fused sampler hashes on chip
            # (its per-slice partials, 24 bytes per dsa_triton.SAMPLE_SLICE logits at most, are within the first term)
        forward, sampling = decode(B, S)
        steps = [(f"prefill of {M} packed tokens", prefill)]
        rows = B * (S // BLOCK_SIZE + 1) * 8 + B * max_new_tokens * (8 + 4) + B * S * (8 + 1)
        shares = shared and lora_cfg is not None  # the engine decodes on the learner's base (lora.share_base)
        generator = [(("fp8 weights (decoder linears e4m3 + block scales, the rest bf16)" if fp8 else
                       "bf16 weights (indexer weights_proj, k_norm fp32)") + (": the learner's base, counted there"
                                                                               if shares else ""), 0 if shares else weights),
                     (f"paged KV pool bf16, {T} token slots (rollout and eval, one at a time)" +
                      (" (MLA: the latent)" if cfg.mla else "") + (f" + each slot's routes ({route_bytes} B)" if n_moe else "")
                      + (" + the MTP drafter's layer" if k else ""), T * kv_token),
                     (f"{B} rows: block tables, tokens + logprobs, a step's key slots", rows)]
        if lora_cfg is not None:
            generator.append((f"LoRA adapters fp32, rank {lora_cfg.rank}", 4 * adapters))
        if teacher is not None:  # (fp8: quantized in host memory, then moved: the GPU never holds its bf16 copy)
            t_weights, t_scoring, _ = teacher_items(teacher, micro_batch_tokens, teacher_fp8, logit_chunk, dsa_kernels)
            generator += t_weights + t_scoring
        if cuda_graphs:  # the graphs' pool holds the largest bucket's forward for good (captured first, the others
            # reuse its memory on the one capture stream) and cuBLAS's workspace for that stream (32 MiB on Hopper);
            # static buffers beside it. A capture's eager warm-up still runs beside the pool. (Measured on an H100,
            # bench/gpu_memory.py: the first capture keeps the workspace, the later ones nothing more.)
            # Speculative: the verify's graphs (graphs.DecodeGraphs.verify) share that pool, and their largest bucket is the
            # pool's first capture: a forward of B (k + 1) rows over at most S keys, its trunk's hidden and the final
            # norm's output beside its logits; their own static buffers, the trunk's hidden [B (k + 1), h] among them.
            # The MTP draft step's graphs (.draft: one layer's forward of B rows, smaller) share it too; their static
            # buffers are a decode's, and the hidden states in and out [B, h]
            pool = (f"a verify forward of {B} x {k + 1} rows", decode(B * (k + 1), S)[0] + 4 * B * (k + 1) * h) if k else (
                f"a decode forward of {B} rows", forward)
            generator += [(f"CUDA graphs' pool: {pool[0]} + cuBLAS's workspace", pool[1] + CUBLAS_WORKSPACE),
                          (f"CUDA graphs' inputs [{B}, {S}] and logits [{B}, V]", B * (S * 9 + 16) + 2 * B * V)]
            if k:
                R = B * (k + 1)
                generator.append((f"CUDA graphs' verify inputs [{R}, {S}], logits [{R}, V] and trunk [{R}, h]",
                                  R * (S * 9 + 16) + 2 * R * V + 2 * R * h))
                generator.append((f"CUDA graphs' draft inputs [{B}, {S}], logits [{B}, V] and hidden in and out [{B}, h]",
                                  B * (S * 9 + 16) + 2 * B * V + 4 * B * h))
        steps.append(("a decode step (logits, activations, DSA scores, sampling)", forward + sampling))
        if k:  # speculative.py: the token buffers' k more columns, each row's trunk hidden kept between steps; a step's
            # verify forward of B (k + 1) rows over S + k keys as a decode step's (its logits, then the sampler's fp32
            # copies), their key slots and masks, and the trunk's hidden of every verify row, kept for the draft extend
            # (whose MTP forward of as many rows, one layer, comes after the verify's logits are gone)
            R = B * (k + 1)
            generator.append((f"speculative decoding, {k} drafts: token buffers' {k} more columns, a hidden state per row",
                              B * k * (8 + 4) + B * h * 2))
            steps.append((f"a speculative step: the verify forward of {B} x {k + 1} rows (logits, activations, DSA "
                          "scores, sampling), its key slots, the trunk's hidden kept", sum(decode(R, S + k)) + R * (S + k + 1) * 9
                          + R * h * 2))
        name, peak = max(steps, key=lambda t: t[1])
        generator += [(f"largest transient: {name}", peak), ("CUDA context, fragmentation", OVERHEAD)]
    # Loading (model.GLM.from_pretrained): built on meta, allocated once in its final dtype (FSDP: only this rank's
    # shards), then filled tensor by tensor from the memory-mapped files: one tensor's rows in flight beside it.
    # The KL reference follows at the start of RL: the policy is first saved through rank 0's CPU memory, one
    # gathered fp32 tensor at a time on the GPU, then loaded as bf16 shards.
    big, shards = max(p.numel() for p in named.values()), N if parallel == "fsdp" else 1
    part = f" (1/{N})" if shards > 1 else ""
    # LoRA without warm-up stages: the base loads in bf16 on a GPU (it never trains); else in fp32, cast to bf16 at RL
    w = 2 if lora_cfg is not None and not trainable_indexer else 4
    learner_load = [(f"{'bf16' if w == 2 else 'fp32'} weights{part}", w * P // shards), ("one tensor's rows copied in", w * big // shards)]
    if reference and lora_cfg is None:  # (with LoRA the reference is the base, adapters off: nothing to load)
        learner_load = [(f"fp32 weights{part}", 4 * P // shards), (f"reference bf16{part}", (2 * P + 2 * P32) // shards),
                        ("saving the reference: one gathered fp32 tensor", 4 * big)]
    learner_load.append(("CUDA context, NCCL, fragmentation", OVERHEAD))
    generator_load = [] if engine == "sglang" else [("bf16 weights", 2 * P + 2 * P32), ("one tensor copied in", 2 * big),
                                                    ("CUDA context, fragmentation", OVERHEAD)]
    if teacher is not None:  # the teacher loads at RL's start, beside the engine's weights
        generator_load[-1:-1] = t_weights
    settings = {}
    if colocate:
        resident = 12 * adapters if lora_cfg is not None else 4 * P // shards + 8 * Pt // shards  # masters + AdamW
        buckets = (4 * adapters if N > 1 else 0) if lora_cfg is not None else 4 * Pt if parallel == "ddp" else 0
        stays = [("frozen bf16 base, the engine's weights too (shared)", 2 * P + 2 * P32)] if lora_cfg is not None else []
        stays += [(f"KL reference bf16{part}", (2 * P + 2 * P32) // shards)] if reference and lora_cfg is None else []
        stays += [("DDP gradient buckets (kept)", buckets)] if buckets else []
        state = [(f"learner's fp32 masters + AdamW{part}" + ("" if lora_cfg is None else " (adapters)"), resident)]
        engine_own = generator[1:] if lora_cfg is not None else generator  # LoRA: the weights are the base above
        teacher_stays = t_weights if teacher is not None else []  # a distillation teacher never leaves the GPU
        settings["phases"] = [
            ("load: the learner's weights (the engine has none until the first publish" + (
                ", but fp8's load to be quantized)" if fp8 else ")"),
             learner_load + (generator_load[:-1] if fp8 else []) + ([] if fp8 else teacher_stays)),
            ("generate: the engine, and what stays of the learner" + (" (its state offloaded)" if offload else ""),
             engine_own + stays + ([] if offload else state)),
            ("train: the learner's step (the engine's KV pool and unshared weights released)", learner + teacher_stays),
            ("checkpoint (and the first publish): the learner's state beside the engine's weights, no KV pool",
             ([] if lora_cfg is not None else generator[:1]) + stays + teacher_stays + state
             + [("a checkpoint's one gathered fp32 tensor", 4 * big), ("CUDA context, NCCL, fragmentation", OVERHEAD)])]
        settings["pinned_host"] = sum(b for _, b in state) if offload else 0
    settings |= dict(fp8_saved=2 * P + 2 * P32 - weights, shared=shared, colocate=colocate, lora=lora_cfg is not None,
                     offload=offload, learner_gpus=N, parallel=parallel, gradient_checkpointing=gradient_checkpointing,
                    reference=reference, engine=engine, sglang_mem_fraction=sglang_mem_fraction, dsa=cfg.dsa is not None,
                    generator_batch=B, generator_max_len=S, kv_token=kv_token, kv_cache_tokens=T, cuda_graphs=cuda_graphs)
    return MemoryPlan(P, learner, generator, settings, learner_load, generator_load)
