"""memory.py: the per-GPU memory plan against parameter counts and item sizes written out by hand from
the architecture, the 9B recipe on an H100, FSDP's sharding and the plan's verdicts."""
from dataclasses import replace

import torch

from dsa import DSAConfig
from machinery.memory import memory_plan
from model import GLM, GLMConfig, PagedKVCache

TINY = GLMConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_layers=3, num_heads=4, num_kv_heads=2,
                 head_dim=16, dsa=DSAConfig(topk=8, heads=2, head_dim=8, rope_dim=4, pattern="FS"))
NINE_B = GLMConfig(vocab_size=151552, hidden_size=4096, intermediate_size=13696, num_layers=40, num_heads=32,
                   num_kv_heads=2, head_dim=128)  # GLM-Z1-9B-0414
RECIPE = dict(learner_gpus=4, parallel="fsdp", micro_batch_tokens=16384, gradient_checkpointing=True,
              trainable_indexer=False, reference=False, generator_batch=128, generator_max_len=1024 + 16384,
              max_new_tokens=16384, engine="torch")
H100 = 80e9  # "80 GB" in bytes = 74.5 GiB (nvidia-smi shows 79.6 GiB: this is the cautious side)


def tiny_plan(**kw):
    args = dict(learner_gpus=2, parallel="fsdp", micro_batch_tokens=64, gradient_checkpointing=True,
                trainable_indexer=False, reference=False, generator_batch=3, generator_max_len=40, max_new_tokens=30,
                engine="torch")
    return memory_plan(TINY, **(args | kw))


def hand_counts(c: GLMConfig):
    """(total, indexer) parameters written out from the architecture, independently of model.py."""
    h, I, HD, KD = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layer = (h * HD + HD) + 2 * (h * KD + KD) + HD * h + h * 2 * I + I * h + 4 * h  # q, k, v (bias), o, mlp, 4 norms
    d = c.dsa
    indexer = h * d.heads * d.head_dim + h * d.head_dim + 2 * d.head_dim + h * d.heads if d else 0  # wq, wk, k_norm, w
    n_F = d.layer_kinds(c.num_layers).count("F") if d else 0
    return 2 * c.vocab_size * h + h + c.num_layers * layer + n_F * indexer, n_F * indexer


def test_memory_plan_counts_parameters_exactly():
    for cfg in (TINY, replace(TINY, dsa=None), replace(TINY, dsa=None, tie_word_embeddings=True)):
        plan = memory_plan(cfg, **(RECIPE | {"generator_batch": 2, "generator_max_len": 8, "max_new_tokens": 4}))
        assert plan.params == sum(p.numel() for p in GLM(cfg).parameters())
    assert tiny_plan().params == hand_counts(TINY)[0]


def test_memory_plan_items_against_hand_formulas():
    P, indexer = hand_counts(TINY)
    Pt = P - indexer  # the indexer is frozen in RL
    fsdp = dict(tiny_plan().learner)
    assert fsdp["fp32 master weights (1/2)"] == 4 * P // 2
    assert fsdp["fp32 grads, trainable (1/2)"] == 4 * Pt // 2
    assert fsdp["AdamW exp_avg + exp_avg_sq fp32 (1/2)"] == 2 * 4 * Pt // 2
    assert fsdp["bf16 root (embed, norm, lm_head), gathered all step"] == 2 * (2 * 97 * 48 + 48)
    fp32_indexer = 2 * (2 * 8 + 48 * 2)  # k_norm [8] x2 and weights_proj [2, 48] on the 2 F layers
    assert dict(tiny_plan(reference=True).learner)["KL reference bf16 (1/2): bf16 is what the forward uses"] == \
        (2 * P + 2 * fp32_indexer) // 2
    ddp = dict(tiny_plan(parallel="ddp", trainable_indexer=True).learner)
    assert ddp["fp32 weights"] == 4 * P and ddp["fp32 grads, trainable"] == 4 * P
    assert ddp["AdamW exp_avg + exp_avg_sq fp32"] == 8 * P
    assert ddp["DDP gradient buckets fp32 (a second copy of the grads)"] == 4 * P
    gen = dict(tiny_plan().generator)
    assert gen["bf16 weights (indexer weights_proj, k_norm fp32)"] == 2 * P + 2 * fp32_indexer
    # KV pool of 3 rows x 40 slots, each row in 3 blocks of 16, and the scratch block: 160 slots, keys + values
    # [160, 2, 16] on 3 layers, indexer keys [160, 8] on the 2 F layers
    bf16 = 2
    kv = bf16 * 2 * 3 * (160 * 2 * 16) + bf16 * 2 * (160 * 8)
    pool = PagedKVCache(TINY, 9, 16, dtype=torch.bfloat16)  # and what PagedKVCache really allocates
    real = sum(t.numel() * t.element_size() for t in pool.k + pool.v + [t for t in pool.index_k if t is not None])
    assert gen["paged KV pool bf16, 160 token slots (rollout and eval, one at a time)"] == kv == real
    assert dict(tiny_plan(kv_cache_tokens=64).generator)["paged KV pool bf16, 80 token slots (rollout and eval, one at a time)"] == kv * 80 // 160
    # rows: block tables [3, 40 // 16 + 1] int64, tokens + logprobs [3, 30], a step's key slots and valid [3, 40]
    assert gen["3 rows: block tables, tokens + logprobs, a step's key slots"] == 3 * 3 * 8 + 3 * 30 * 12 + 3 * 40 * 9
    prefill = lambda **kw: dict(tiny_plan(**kw).generator)["largest transient: prefill of 4096 packed tokens"]
    assert prefill(group_size=8) - prefill() == 4096 * 7 * (8 + 8)  # 7 further copies' int64 (slot, source) pairs
    plan = tiny_plan()
    assert plan.learner_bytes() == sum(fsdp.values()) and plan.generator_bytes() == sum(gen.values())


def test_memory_plan_fsdp_shards_scale_with_gpus():
    shards = [{n.replace(f"(1/{g})", ""): b for n, b in tiny_plan(learner_gpus=g).learner if f"(1/{g})" in n}
              for g in (1, 2, 4, 8)]
    assert len(shards[0]) == 3
    for g, s in zip((1, 2, 4, 8), shards):
        for name, b in s.items():
            assert abs(b * g - shards[0][name]) < g, name  # integer division only


def test_memory_plan_9b_recipe_on_h100():
    plan = memory_plan(NINE_B, **RECIPE)
    assert 9.3e9 < plan.params < 9.5e9
    assert plan.learner_bytes() < H100 - 15 * 2**30  # FSDP over 4, 16K-token micro-batches: ~56 GiB, room to spare
    assert not any(p.startswith("learner") for p in plan.problems(H100))
    # Without a budget the pool holds every row at full length: 128 x 17408 x 40 KiB = 85 GiB of KV alone.
    assert dict(plan.generator)["paged KV pool bf16, 2228240 token slots (rollout and eval, one at a time)"] == (128 * 17408 + 16) * (40 * 2 * 2 * 128 * 2)
    assert any("rollout.kv_cache_tokens" in p for p in plan.problems(H100))
    assert memory_plan(NINE_B, **(RECIPE | {"generator_batch": 32})).problems(H100) == []
    # The recipe's budget: 256 rows share 2^20 slots (40 GiB), rows taking blocks as they grow
    budget = memory_plan(NINE_B, **(RECIPE | {"generator_batch": 256, "kv_cache_tokens": 2**20}))
    assert budget.problems(H100) == [] and 60 * 2**30 < budget.generator_bytes() < 74.5 * 2**30
    assert "fits" in plan.text(H100) and "does NOT fit" in plan.text(H100)
    ddp = memory_plan(NINE_B, **(RECIPE | {"parallel": "ddp", "generator_batch": 32}))
    assert ddp.learner_bytes() > 2 * H100  # full fp32 weights, grads, buckets and AdamW state: ~200 GiB
    (problem,) = ddp.problems(H100)
    assert problem.startswith("learner") and "train.parallel" in problem
    sglang = memory_plan(NINE_B, **(RECIPE | {"engine": "sglang", "sglang_mem_fraction": 0.8}))
    assert sglang.problems(H100) == [] and "KV pool" in sglang.text(H100)


def test_load_time_peak_is_the_weights_once_plus_one_tensor():
    """GLM.from_pretrained allocates every tensor once, in its final dtype (FSDP: only the rank's rows), then
    copies the file's tensors in one at a time: the largest is the MLP's gate_up [2 x 80, 48]."""
    P, _ = hand_counts(TINY)
    fp32_indexer = 2 * (2 * 8 + 48 * 2)
    big = 2 * 80 * 48
    plan = tiny_plan()
    assert dict(plan.learner_load) == {"fp32 weights (1/2)": 4 * P // 2, "one tensor's rows copied in": 4 * big // 2,
                                       "CUDA context, NCCL, fragmentation": 3 * 2**30}
    assert dict(tiny_plan(parallel="ddp").learner_load)["fp32 weights"] == 4 * P
    ref = dict(tiny_plan(reference=True).learner_load)
    assert ref["reference bf16 (1/2)"] == (2 * P + 2 * fp32_indexer) // 2
    assert ref["saving the reference: one gathered fp32 tensor"] == 4 * big
    assert dict(plan.generator_load)["bf16 weights"] == 2 * P + 2 * fp32_indexer
    text = memory_plan(NINE_B, **RECIPE).text(H100)
    assert text.count("total at the load-time peak") == 2 and text.count("total at the step-time peak") == 2


def test_one_gpu_for_both_must_fit_their_sum():
    """Generator and learner on one GPU: the plan adds them up (one CUDA context between them) and says, in one
    line, which side to lower; each alone fitting is not enough."""
    small = dict(generator_batch=4, generator_max_len=64, max_new_tokens=32, micro_batch_tokens=64)
    plan = tiny_plan(shared=True, **small)
    both = plan.learner_bytes() + plan.generator_bytes() - 3 * 2**30
    assert plan.problems(both) == [] and "one GPU for both" in plan.text(both)
    (line,) = plan.problems(both - 1)  # a byte short: refused, although each side alone fits
    assert max(plan.learner_bytes(), plan.generator_bytes()) <= both - 1
    assert line.startswith("the generator") and "share one GPU" in line and "rollout.kv_cache_tokens" in line
    assert tiny_plan(**small).problems(both - 1) == []  # on two GPUs of that size: fine
    (line,) = memory_plan(NINE_B, **(RECIPE | {"shared": True, "learner_gpus": 1, "generator_batch": 8})).problems(H100)
    assert "the learner alone does not fit" in line and "\n" not in line  # 9B in full on one H100: never


def test_fp8_generator_weights_and_what_they_free():
    """rollout.quantization: fp8: the decoder's linears take 1 byte a weight plus an fp32 scale per 128 x 128 block;
    embeddings, lm_head, norms, biases and the DSA indexer stay as they were (bf16; dsa.FP32_PARAMS fp32)."""
    from machinery import fp8
    bf16, f8 = dict(tiny_plan().generator), dict(tiny_plan(fp8=True).generator)
    P, _ = hand_counts(TINY)
    h, I, HD, KD, L = 48, 80, 4 * 16, 2 * 16, 3
    linears = L * (h * HD + 2 * h * KD + HD * h + h * 2 * I + I * h)  # q, k, v, o, gate_up, down
    blocks = L * (1 + 1 + 1 + 1 + 2 + 1)  # each of them fits one 128-wide block of columns, gate_up [160, 48]: 2 of rows
    fp32_indexer = 2 * (2 * 8 + 48 * 2)
    assert f8["fp8 weights (decoder linears e4m3 + block scales, the rest bf16)"] == fp8.weight_bytes(TINY) == \
        2 * (P - linears) + 2 * fp32_indexer + linears + 4 * blocks
    assert bf16["bf16 weights (indexer weights_proj, k_norm fp32)"] - fp8.weight_bytes(TINY) == linears - 4 * blocks
    text = memory_plan(NINE_B, **(RECIPE | {"generator_batch": 256, "kv_cache_tokens": 2**20, "fp8": True})).text(H100)
    assert "fp8 weights save 7.60 GiB" in text and "at most 13% faster" in text


# ----------------------------------------------------------------------------- MoE: MLA's latent, experts, routes

import pytest  # noqa: E402

TINY_MOE = GLMConfig(model_type="glm_moe_dsa", vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=3,
                     num_heads=4, num_kv_heads=4, eos_token_id=[1], pad_token_id=0,
                     mla=dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
                     moe=dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                              n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                              mlp_layer_types=["dense", "sparse", "sparse"]),
                     dsa={"topk": 4, "heads": 2, "head_dim": 8, "rope_dim": 4, "pattern": "FS"})  # tests/test_train.py's


def moe_hand_counts(c: GLMConfig):
    """(total parameters, those every copy keeps in fp32: the DSA indexer's weights_proj and k_norm, the routers'
    weight) of an MLA + MoE model written out from its architecture, independently of model.py. The routers'
    score-correction bias is a buffer, not a parameter."""
    h, H, m, e = c.hidden_size, c.num_heads, c.mla, c.moe
    qk = H * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * qk if m.q_lora_rank else h * qk  # q_a, its norm, q_b
    kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank + m.kv_lora_rank * H * (m.qk_nope_head_dim + m.v_head_dim)
    attn = q + kv + H * m.v_head_dim * h + 2 * h  # + o_proj, input and post-attention norms
    d = c.dsa  # GLM-5's indexer (F layers): wq_b from the query latent, wk, k_norm (weight and bias), weights_proj
    n_F = d.layer_kinds(c.num_layers).count("F") if d else 0
    indexer = m.q_lora_rank * d.heads * d.head_dim + h * d.head_dim + 2 * d.head_dim + h * d.heads if d else 0
    dense = 3 * h * c.intermediate_size
    moe = e.n_routed_experts * h + 3 * e.n_routed_experts * h * e.moe_intermediate_size \
        + 3 * h * e.moe_intermediate_size * e.n_shared_experts  # router, experts' gate_up + down, shared experts
    n_moe = e.mlp_layer_types.count("sparse")
    total = 2 * c.vocab_size * h + h + c.num_layers * attn + n_F * indexer + (c.num_layers - n_moe) * dense + n_moe * moe
    return total, n_F * (2 * d.head_dim + h * d.heads if d else 0) + n_moe * e.n_routed_experts * h


def moe_plan(cfg, **kw):
    args = dict(learner_gpus=8, parallel="fsdp", micro_batch_tokens=16384, gradient_checkpointing=True,
                trainable_indexer=False, reference=False, generator_batch=128, generator_max_len=1024 + 8192,
                max_new_tokens=8192, engine="torch", kv_cache_tokens=147456)
    return memory_plan(cfg, **(args | kw))


def item(items, prefix):
    (b,) = [b for name, b in items if name.startswith(prefix)]
    return b


@pytest.mark.parametrize("which", ["tiny", "flash"])
def test_moe_memory_plan_counts_the_latent_the_experts_and_the_routes(which):
    """An MLA + MoE model (a tiny glm_moe_dsa; GLM-4.7-Flash as config.PUBLISHED has it, 47 layers, the published
    29.9B parameters) against hand formulas and what the code allocates: the parameter count (a meta-built GLM, and
    the architecture written out); the KV pool's bytes, each slot holding per layer MLA's bf16 latent (kv_lora_rank +
    qk_rope_head_dim values), DSA's indexer keys on F layers, and each MoE layer's k uint8 routes (PagedKVCache's own
    tensors); the learner's MoE routes item; the generator's weights, bf16 but model.FP32_PARAMS (the indexer's small
    tensors, the routers' weight) in fp32, as model.GLM.cast_ leaves them."""
    from model import FP32_PARAMS
    if which == "tiny":
        cfg = TINY_MOE
    else:
        from machinery import config  # (imports transformers: only here)
        cfg = GLMConfig.from_hf(config.PUBLISHED["GLM-4.7-Flash"])
    plan = moe_plan(cfg)
    with torch.device("meta"):
        model = GLM(cfg)
    P, P32 = moe_hand_counts(replace(cfg, mtp_layers=0))
    if which == "flash":  # its MTP layer: the published count (the files' 31,221,488,576) less the MTP layer's copies of
        # the embedding and head and the 47 routers' score-correction biases (buffers here)
        assert cfg.mtp_layers == 1
        assert plan.params + 2 * cfg.vocab_size * cfg.hidden_size + 47 * 64 == 31_221_488_576
        P += sum(p.numel() for p in model.mtp.parameters())  # (its layer: test_mtp.py's published table)
        P32 += sum(p.numel() for n, p in model.mtp.named_parameters() if n.endswith(FP32_PARAMS))  # its router
    assert plan.params == sum(p.numel() for p in model.parameters()) == P
    assert P32 == sum(p.numel() for n, p in model.named_parameters() if n.endswith(FP32_PARAMS))
    if which == "flash":
        assert cfg.num_layers == 47 and cfg.model_type == "glm4_moe_lite" and 29.9e9 < P - sum(p.numel() for p in model.mtp.parameters()) < 30.0e9
    n_moe, k = len(cfg.moe_layers), cfg.moe.num_experts_per_tok
    assert n_moe == cfg.num_layers - 1  # (both: the first layer dense)
    slots = (147456 // 16 + 1) * 16  # the budget's blocks and the scratch one
    n_F = cfg.dsa.layer_kinds(cfg.num_layers).count("F") if cfg.dsa else 0
    per_slot = 2 * (cfg.num_layers * (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim)
                    + n_F * (cfg.dsa.head_dim if cfg.dsa else 0)) + n_moe * k * 1
    pool = PagedKVCache(cfg, 2, 16, device="meta", dtype=torch.bfloat16)  # what the engine's pool allocates per slot
    real = sum(t.numel() * t.element_size() for t in pool.k + pool.v + [t for t in pool.index_k if t is not None] + pool.routes)
    assert real == 3 * 16 * per_slot and pool.v == [] and all(r.dtype == torch.uint8 for r in pool.routes)
    assert item(plan.generator, "paged KV pool bf16") == slots * per_slot and plan.settings["kv_token"] == per_slot
    assert any(f"each slot's routes ({n_moe * k} B)" in name for name, _ in plan.generator)
    routes = item(plan.learner, "MoE routes [n_moe, T, k]")  # the micro-batch's replayed and chosen routes
    assert routes > 0 and routes % (n_moe * 16384 * k) == 0
    if which == "tiny":  # (one more meta model: the tiny one only)
        assert item(moe_plan(cfg, micro_batch_tokens=2 * 16384).learner, "MoE routes") == 2 * routes
    weights = item(plan.generator, "bf16 weights")
    assert weights == 2 * P + 2 * P32  # 2 bytes a weight, 4 for the fp32 ones
    assert weights == sum(p.numel() * p.element_size() for p in model.cast_(torch.bfloat16).parameters())
    dense = memory_plan(replace(TINY, dsa=None), **RECIPE)  # a dense model: no routes anywhere
    assert not any("routes" in name for name, _ in dense.learner + dense.generator)


# ----------------------------------------------------------------------------- on-policy distillation's teacher

THIRTY_TWO_B = GLMConfig(vocab_size=151552, hidden_size=6144, intermediate_size=23040, num_layers=61, num_heads=48,
                         num_kv_heads=2, head_dim=128, attention_bias=False)  # GLM-Z1-32B-0414


def test_a_distillation_teacher_sits_on_the_generator_gpu_in_every_phase():
    """distill.teacher: its weights (bf16, or fp8 as fp8.weight_bytes counts them) and the scoring of one packed row
    join the generator's items, and nothing else changes; co-located, its weights are in every phase (it never
    leaves the GPU); the load-time peak holds it beside the engine's weights. GLM-Z1-32B-0414's shapes give the
    32,566,081,536 parameters its published 32.57B rounds (counted by hand: 61 layers, no attention bias)."""
    from machinery import fp8
    from machinery.memory import teacher_items
    h, I, HD, KD = 6144, 23040, 48 * 128, 2 * 128
    assert 2 * 151552 * h + h + 61 * (h * HD + 2 * h * KD + HD * h + 3 * h * I + 4 * h) == 32_566_081_536  # 4 norms a layer
    (_, w), = teacher_items(THIRTY_TWO_B, 16384, False, 1024)[0]
    (_, w8), = teacher_items(THIRTY_TWO_B, 16384, True, 1024)[0]
    assert teacher_items(THIRTY_TWO_B, 16384, False, 1024)[2] == 32_566_081_536 and w == 2 * 32_566_081_536
    assert w8 == fp8.weight_bytes(THIRTY_TWO_B) and 32e9 < w8 < 35e9
    teacher = replace(TINY, num_layers=4, hidden_size=64)
    (wname, tw), = teacher_items(teacher, 64, False, 1024)[0]
    (sname, ts), = teacher_items(teacher, 64, False, 1024)[1]
    assert tw == 2 * sum(p.numel() for p in GLM(teacher).parameters()) + 2 * 2 * (2 * 8 + 64 * 2)  # 2 F layers keep fp32
    # scoring: the largest of a layer's no-grad forward and the kept hidden states + one chunk's logits (bf16, fp32 x2)
    assert ts >= 64 * 2 * 64 + 64 * 97 * 10
    plain, with_teacher = tiny_plan(), tiny_plan(teacher=teacher)
    assert with_teacher.generator == plain.generator[:-2] + [(wname, tw), (sname, ts)] + plain.generator[-2:]
    assert with_teacher.learner == plain.learner
    assert dict(with_teacher.generator_load)[wname] == tw
    co = tiny_plan(teacher=teacher, colocate=True, generator_batch=2).phases()
    assert all(dict(items).get(wname) == tw for _, items, _ in co)  # load, generate, train, checkpoint
    recipe = memory_plan(NINE_B, **(RECIPE | {"generator_batch": 256, "kv_cache_tokens": 3 * 2**17, "teacher": THIRTY_TWO_B,
                                              "teacher_fp8": True}))
    assert recipe.problems(H100) == []  # configs/glm9b_distill.yaml's layout
    bf16 = memory_plan(NINE_B, **(RECIPE | {"generator_batch": 256, "kv_cache_tokens": 3 * 2**17, "teacher": THIRTY_TWO_B}))
    assert any(p.startswith("generator") for p in bf16.problems(H100))  # a bf16 32B teacher does not fit beside it


def test_memory_plan_counts_the_mtp_layer_and_its_loss():
    """An MTP layer (families/mtp.py): its weights (a decoder layer with DSA's F indexer, eh_proj [h, 2h], enorm, hnorm,
    shared_head.norm; the embedding and head are the main model's) and its loss's activations."""
    mtp = replace(TINY, mtp_layers=1)
    h = TINY.hidden_size
    total, indexer = hand_counts(TINY)
    one_layer = (hand_counts(replace(TINY, num_layers=1, dsa=None))[0] - 2 * TINY.vocab_size * h - h)
    assert tiny_plan().params == total
    assert memory_plan(mtp, **(RECIPE | {"micro_batch_tokens": 64})).params == total + one_layer + indexer // 2 + 2 * h * h + 3 * h
    items = dict(memory_plan(mtp, **(RECIPE | {"micro_batch_tokens": 64})).learner)
    assert any(name.startswith("MTP layers") for name in items)
    assert not any(name.startswith("MTP layers") for name, _ in tiny_plan().learner)


def test_speculative_decoding_buffers_are_what_the_engine_allocates(monkeypatch):
    """rollout.speculative_tokens k: the pool's MTP layer (one more layer of keys, values and DSA indexer keys), the
    token buffers' k more columns and the hidden state kept per row, against what TorchEngine and Speculative really
    allocate in bf16; the verify forward's logits are [B (k + 1), V], which the plan's speculative step counts as a
    decode step of that many rows over S + k keys, with their key slots and the trunk's hidden kept."""
    from machinery import speculative
    from machinery.engine import SamplingParams, TorchEngine
    B, S, k = 32, 40, 2  # (rows enough that a decode step, not the prefill, is the largest transient)
    cfg = replace(TINY, mtp_layers=1)
    model = GLM(cfg).to(torch.bfloat16)
    engine = TorchEngine(model, max_batch=B, speculative=speculative.Speculative.of(model, k))
    engine._open(SamplingParams(), S, 30)
    engine.spec._state(engine)
    plain = TorchEngine(model, max_batch=B)
    plain._open(SamplingParams(), S, 30)
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts if t is not None)  # noqa: E731
    args = dict(learner_gpus=1, parallel="fsdp", micro_batch_tokens=64, gradient_checkpointing=True, trainable_indexer=False,
                reference=False, generator_batch=B, generator_max_len=S, max_new_tokens=30, engine="torch", prefill_tokens=1)
    gen = dict(memory_plan(cfg, **args, speculative_tokens=k).generator)
    pool = engine.pool
    assert len(pool.k) == cfg.num_layers + 1
    slots = pool.k[0].shape[0]
    assert gen[f"paged KV pool bf16, {slots} token slots (rollout and eval, one at a time) + the MTP drafter's layer"] == \
        nbytes(pool.k + pool.v + pool.index_k)
    assert nbytes(pool.k + pool.v + pool.index_k) > nbytes(plain.pool.k + plain.pool.v + plain.pool.index_k)
    extra = nbytes([engine.out_tok, engine.out_lp]) - nbytes([plain.out_tok, plain.out_lp]) + nbytes([engine.spec.hidden])
    assert gen[f"speculative decoding, {k} drafts: token buffers' {k} more columns, a hidden state per row"] == extra
    # one step: the verify's logits have B (k + 1) rows
    seen = []
    sample = speculative.sample_tokens

    def record(logits, *a):
        seen.append(tuple(logits.shape))
        return sample(logits, *a)
    monkeypatch.setattr(speculative, "sample_tokens", record)
    engine._close()
    engine.generate([[1, 2, 3]] * B, SamplingParams(max_new_tokens=6), seed=0)
    R = B * (k + 1)
    assert (R, cfg.vocab_size) in seen
    step = gen[f"largest transient: a speculative step: the verify forward of {B} x {k + 1} rows (logits, activations, DSA "
               "scores, sampling), its key slots, the trunk's hidden kept"]
    as_decode = dict(memory_plan(cfg, **(args | {"generator_batch": R, "generator_max_len": S + k})).generator)
    assert step == as_decode["largest transient: a decode step (logits, activations, DSA scores, sampling)"] + \
        R * (S + k + 1) * 9 + R * cfg.hidden_size * 2
    assert not any("speculative" in item for item, _ in memory_plan(cfg, **args).generator)


def test_the_routed_experts_cast_once_a_step_are_counted_where_they_are_held():
    """kernels/moe.CastCache's bf16 copies of the routed experts (2 bytes x E x 3 I h per MoE layer, written out from
    the architecture) in the learner's step: under DDP (fp32 masters under autocast) out of autocast's copies, whose
    total stays; with one process under "fsdp" (no FSDP: a plain module); not under FSDP2 across processes (gathered
    in bf16, never cached), nor under LoRA (the experts in the frozen bf16 base), nor for a dense model."""
    from machinery import lora
    e, h = TINY_MOE.moe, TINY_MOE.hidden_size
    copies = 2 * len(TINY_MOE.moe_layers) * e.n_routed_experts * 3 * e.moe_intermediate_size * h
    name = "routed experts' bf16 copies"
    ddp = moe_plan(TINY_MOE, parallel="ddp", learner_gpus=2).learner
    P, P32 = moe_hand_counts(TINY_MOE)
    indexer = sum(p.numel() for n, p in GLM(TINY_MOE).named_parameters() if ".indexer." in n)
    assert item(ddp, name) == copies
    assert item(ddp, "autocast's bf16 weight copies") + copies == 2 * (P - indexer - TINY_MOE.vocab_size * h)
    assert item(moe_plan(TINY_MOE, learner_gpus=1).learner, name) == copies
    for plan in (moe_plan(TINY_MOE, learner_gpus=2), moe_plan(TINY_MOE, parallel="ddp", lora_cfg=lora.LoRAConfig()),
                 tiny_plan(parallel="ddp"), tiny_plan(learner_gpus=1)):
        assert not any(n.startswith(name) for n, _ in plan.learner)


def test_a_colocated_plan_that_does_not_fit_names_the_fixes_of_its_largest_phase():
    """The refusal names what shrinks the phase that does not fit: the train phase (the engine's pool released) by the
    micro-batch, never by the KV pool; the generate phase by the KV pool or its rows."""
    for kw, phase, right, wrong in (({"micro_batch_tokens": 4096}, "train", "optim.max_tokens_per_micro_batch",
                                     "rollout.kv_cache_tokens"),
                                    ({"generator_batch": 64, "generator_max_len": 4096}, "generate",
                                     "rollout.kv_cache_tokens", "optim.max_tokens_per_micro_batch")):
        plan = tiny_plan(colocate=True, learner_gpus=1, **kw)
        name, _, need = max(plan.phases(), key=lambda p: p[2])
        assert name.startswith(phase + ":"), name
        assert plan.problems(need) == []
        (line,) = plan.problems(need - 1)
        assert line.startswith(f"co-located, the {phase} phase needs") and right in line and wrong not in line, line
