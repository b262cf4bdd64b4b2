"""lora.py: at the start of RL the LoRA model is exactly its base (fp32, bf16 weights, bf16 autocast); gradients
reach the adapters only, kept in fp32 under autocast; disabled() is the base; the fp32 merge is the adapted
layer; the peft layout loads with peft onto transformers' Glm4ForCausalLM and gives our logits. The MoE families:
adapters on MLA's projections, dense and shared MLPs only (not the router or the routed experts), the LoRA forward
equals the merged model's, save/load and the merged export (experts per expert), peft onto Glm4MoeLiteForCausalLM.
With an MTP layer: an rl_step trains the policy's adapters by GRPO alone and the MTP layer's by the MTP loss alone
(a float64 reference), each clipped apart; a publish gives the engine's drafter the trained MTP layer; its adapters
are saved under the layer's published name, round trip, merge into the exported MTP layer, and peft leaves them aside."""
import copy
import json
import os

import pytest
import torch

import train
from families import mtp
from grpo import KLGuard
from machinery import config, lora, parallel
from machinery.lora import LoRAConfig
from families.mla_moe import Routing
from model import GLM, GLMConfig
from rollout import RolloutBatch, Sample

DSA = {"topk": 4, "heads": 2, "head_dim": 8, "rope_dim": 4, "pattern": "FS"}


def tiny(dsa=None, seed=0):
    torch.manual_seed(seed)
    return GLM(GLMConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=8, attention_bias=True, dsa=dsa))


def trained(model, seed=1):
    """Adapters as after some training: B no longer zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in lora.adapter_named(model):
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model


IDS = torch.tensor([[3, 9, 27, 4, 11, 8, 30, 2, 5, 17]])


@pytest.mark.parametrize("dsa", [None, DSA])
def test_at_the_start_the_lora_model_is_its_base(dsa):
    """B = 0: the logits equal the base's bit for bit, in fp32, with bf16 weights (the generator) and under
    bf16 autocast with fp32 weights (the learner); the adapters sit on every decoder linear, not the indexer."""
    base = tiny(dsa)
    model = lora.add(tiny(dsa), LoRAConfig(rank=4))
    names = [n for n, _ in lora.adapter_named(model)]
    assert len(names) == 2 * 6 * 2 and not any("indexer" in n for n in names)
    with torch.no_grad():
        assert torch.equal(model(IDS), base(IDS))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(model(IDS), base(IDS))
        assert torch.equal(model.to(torch.bfloat16)(IDS), base.to(torch.bfloat16)(IDS))


def test_gradients_reach_only_the_adapters_in_fp32_under_autocast():
    model = trained(lora.add(tiny(DSA), LoRAConfig(rank=4)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(IDS).float().logsumexp(-1).mean()
    loss.backward()
    for n, p in model.named_parameters():
        if n.endswith((".lora_A", ".lora_B")):
            assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, n
            assert p.grad.abs().sum() > 0, n
        else:
            assert not p.requires_grad and p.grad is None, n


def test_the_adapted_layer_is_the_float64_formula_and_disabled_is_the_base():
    model = trained(lora.add(tiny(), LoRAConfig(rank=4, alpha=8.0)))
    m = model.layers[0].self_attn.q_proj
    x = torch.randn(3, 32)
    want = x.double() @ m.weight.double().T + m.bias.double() + 2.0 * (x.double() @ m.lora_A.double().T) @ m.lora_B.double().T
    assert torch.allclose(m(x).double(), want, atol=1e-5)
    assert torch.allclose(x.double() @ lora.merged_weight(m).double().T + m.bias.double(), want, atol=1e-5)
    base = tiny()
    with torch.no_grad(), lora.disabled(model):
        assert torch.equal(model(IDS), base(IDS))
    with torch.no_grad():
        assert not torch.equal(model(IDS), base(IDS))


def test_config_errors_are_one_line():
    with pytest.raises(ValueError, match="model.lora.targets"):
        LoRAConfig(targets=("q_proj", "indexer"))
    with pytest.raises(ValueError, match="rank must be >= 1"):
        LoRAConfig(rank=0)


def test_adapters_in_peft_layout_load_onto_transformers_glm4(tmp_path):
    """save_adapters writes what peft loads onto Glm4ForCausalLM (a dense model: transformers has no indexer):
    the same logits as our LoRA model, in fp32."""
    peft = pytest.importorskip("peft")
    from transformers import Glm4ForCausalLM
    model = trained(lora.add(tiny(), LoRAConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "gate_up_proj", "down_proj"))))
    base = tiny()
    base.save_pretrained(str(tmp_path / "base"))
    lora.save_adapters(model, str(tmp_path / "adapter"), base_model=str(tmp_path / "base"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"
    hf = peft.PeftModel.from_pretrained(Glm4ForCausalLM.from_pretrained(str(tmp_path / "base"), torch_dtype=torch.float32),
                                        str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        want = hf(IDS).logits
        got = model(IDS)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engine_decodes_unmerged_and_takes_an_adapters_only_publish(dtype):
    """An engine holding the base with zero adapters receives the learner's adapters alone (a few percent of
    the bytes here; megabytes against gigabytes at 9B) and then decodes x W + scale x A B unmerged: its greedy
    tokens and logprobs are a float64 full forward's of the learner's model (bf16 weights: within bf16's
    rounding: the whole engine model, adapters too, in bf16)."""
    from machinery.engine import SamplingParams, TorchEngine
    cfg = LoRAConfig(rank=4, alpha=8.0)
    learner = trained(lora.add(tiny(DSA), cfg))
    engine = TorchEngine(lora.add(tiny(DSA), cfg).to(dtype))
    sent = [(n, p.detach()) for n, p in lora.adapter_named(learner)]
    engine.update_weights(sent, version=1)
    assert sum(t.numel() for _, t in sent) < 0.25 * sum(p.numel() for p in learner.parameters())
    ref = tiny(DSA).double()
    ref = lora.add(ref, cfg)
    ref.load_state_dict({k: v.double() for k, v in learner.state_dict().items()})
    if dtype != torch.float32:  # the reference holds the weights the engine holds, rounded to bf16
        ref.load_state_dict({k: v.to(dtype).double() for k, v in learner.state_dict().items()})
    (out,) = engine.generate([[3, 9, 27, 4]], SamplingParams(temperature=0, max_new_tokens=12))
    with torch.no_grad():
        logp = ref(torch.tensor([[3, 9, 27, 4] + out.token_ids]))[0, 3:-1].log_softmax(-1)
    chosen = logp.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
    tol = 1e-5 if dtype == torch.float32 else 6e-2
    assert (logp.max(-1).values - chosen <= (1e-6 if dtype == torch.float32 else tol)).all()
    assert out.logprobs == pytest.approx(chosen.tolist(), abs=tol) and out.versions == (1, 1)


def test_a_merged_export_is_the_adapted_model_in_fp32_and_states_its_bf16_rounding(tmp_path, capsys):
    """python -m machinery.lora merge CHECKPOINT OUT: a LoRA checkpoint (adapters + the run's lora_base) becomes one full model
    directory whose logits are the adapted model's (fp32: exact up to float rounding), with no adapter left; in bf16
    the export says how much of the adapters' delta the rounding changes (an fp64 merge of one layer is the reference)."""
    model = trained(lora.add(tiny(DSA), LoRAConfig(rank=4)))
    run = tmp_path / "run"
    tiny(DSA).save_pretrained(str(run / lora.BASE))  # the base: tiny(DSA) again, the same seed
    (run / "checkpoints").mkdir()
    lora.save_adapters(model, str(run / "checkpoints" / "step_000001"))
    out = tmp_path / "merged"
    lora.main(["merge", str(run / "checkpoints" / "step_000001"), str(out)])
    assert "exact (fp32)" in capsys.readouterr().out
    full = GLM.from_pretrained(str(out))
    assert not any(n.endswith((".lora_A", ".lora_B")) for n, _ in full.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(full(IDS), model(IDS), rtol=1e-5, atol=1e-5)
    m = model.layers[0].self_attn.q_proj
    with torch.no_grad():
        ref = m.weight.double() + m.lora_scale * m.lora_B.double() @ m.lora_A.double()
    torch.testing.assert_close(full.layers[0].self_attn.q_proj.weight.double(), ref, rtol=1e-6, atol=1e-6)
    lora.main(["merge", str(run / "checkpoints" / "step_000001"), str(tmp_path / "bf16"), "--dtype", "bfloat16"])
    said = capsys.readouterr().out
    assert "bf16 rounding changes W + delta by" in said
    error = float(said.split("by ")[1].split("%")[0]) / 100
    delta = (ref - m.weight.double()).norm()
    one = float((ref.to(torch.bfloat16).double() - ref).norm() / delta)  # this layer's share, against fp64
    assert 0 < error < 1 and abs(one - error) < 0.5 * error + 1e-3
    from safetensors import safe_open
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), framework="pt") as f:  # written in bf16
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.bfloat16


# ----------------------------------------------------------------------------- the MoE families
# Tiny GLM-5 (glm_moe_dsa: query latent, DSA) and GLM-4.7-Flash (glm4_moe_lite, here without a query latent: q_proj)
# shapes, layers [dense, sparse, sparse], 4 routed experts top-2 and a shared expert. Adapters go on every linear a
# token always passes (MLA's projections, the dense SwiGLU, the shared experts), never on the router or the routed
# experts (lora.py's docstring says why).

MLA = dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
           routed_scaling_factor=2.5, mlp_layer_types=["dense", "sparse", "sparse"])


def tiny_moe(kind="glm_moe_dsa", seed=0):
    torch.manual_seed(seed)
    mla = MLA if kind == "glm_moe_dsa" else {**MLA, "q_lora_rank": None}
    model = GLM(GLMConfig(model_type=kind, vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=3,
                          num_heads=4, num_kv_heads=4, mla=mla, moe=MOE, pad_token_id=0, eos_token_id=[1],
                          dsa=DSA if kind == "glm_moe_dsa" else None))
    with torch.no_grad():  # every weight and the routers' biases away from their init (the routes depend on them)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.1)
    return model


def adapted_modules(kind):
    """The adapted modules, written out by hand from the architecture."""
    attn = ["q_proj"] if kind == "glm4_moe_lite" else ["q_a_proj", "q_b_proj"]
    attn += ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    swiglu = ["gate_proj", "up_proj", "down_proj"]
    return ({f"layers.{i}.self_attn.{n}" for i in range(3) for n in attn} | {f"layers.0.mlp.{n}" for n in swiglu} |
            {f"layers.{i}.mlp.shared_experts.{n}" for i in (1, 2) for n in swiglu})


@pytest.mark.parametrize("kind", ["glm_moe_dsa", "glm4_moe_lite"])
def test_moe_adapters_land_on_attention_dense_and_shared_mlps_only(kind):
    """Adapters exactly on adapted_modules: not on the indexer, the router or the routed experts, which stay frozen
    (the router fp32); at the start (B = 0) the logits and the chosen experts are the base's, bit for bit."""
    base = tiny_moe(kind)
    model = lora.add(tiny_moe(kind), LoRAConfig(rank=4))
    assert {n for n, m in model.named_modules() if isinstance(m, lora.LoRALinear)} == adapted_modules(kind)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"{m}.lora_{x}" for m in adapted_modules(kind) for x in "AB"}
    assert model.layers[1].mlp.gate.weight.dtype == torch.float32
    with torch.no_grad():
        a, b = Routing(record=True), Routing(record=True)
        assert torch.equal(model(IDS, routing=a), base(IDS, routing=b))
        assert all(torch.equal(x, y) for x, y in zip(a.chosen, b.chosen))


@pytest.mark.parametrize("kind", ["glm_moe_dsa", "glm4_moe_lite"])
def test_moe_lora_forward_and_gradients_equal_the_merged_model(kind):
    """Trained adapters: the LoRA model's logits (fp32) are the merged model's (W + scale B A per adapted linear,
    lora.merged), which routes every token to the same experts; the loss's gradient reaches the adapters alone,
    the shared experts' and kv_b_proj's included. matrix() is the merged weight."""
    model = trained(lora.add(tiny_moe(kind), LoRAConfig(rank=4, alpha=8.0)))
    full, error = lora.merged(model)
    assert error == 0 and not any(n.endswith((".lora_A", ".lora_B")) for n, _ in full.named_parameters())
    ids = torch.randint(2, 50, (3, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a, b = Routing(record=True), Routing(record=True)
        got, want = model(ids, routing=a), full(ids, routing=b)
    assert all(torch.equal(x, y) for x, y in zip(a.chosen, b.chosen))
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5  # (fp32 rounding; measured up to 7e-7)
    with torch.no_grad(), lora.disabled(model):
        assert not torch.equal(model(ids), got)
    m = model.layers[1].self_attn.kv_b_proj
    assert torch.equal(m.matrix(), full.layers[1].self_attn.kv_b_proj.weight)
    with lora.disabled(model):
        assert m.matrix() is m.weight
    model(ids).logsumexp(-1).mean().backward()
    for n, p in model.named_parameters():
        assert (p.grad is not None and p.grad.abs().sum() > 0) == n.endswith((".lora_A", ".lora_B")), n


def test_moe_adapters_round_trip_and_merge(tmp_path):
    """save_adapters of a GLM-5-shaped LoRA model: load_model reads them back onto the saved base (the same adapters
    and logits, bit for bit); the merged export writes each expert's matrices apart, as the model's save does, and
    loads as the adapted model (fp32: 1e-5 of the largest logit)."""
    from safetensors import safe_open
    model = trained(lora.add(tiny_moe(), LoRAConfig(rank=4, alpha=8.0)))
    run = tmp_path / "run"
    tiny_moe().save_pretrained(str(run / lora.BASE))
    (run / "checkpoints").mkdir()
    step = str(run / "checkpoints" / "step_000001")
    lora.save_adapters(model, step, base_model=str(run / lora.BASE))
    config = json.loads((run / "checkpoints" / "step_000001" / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted({n.split(".", 2)[2] for n in adapted_modules("glm_moe_dsa")})
    back = lora.load_model(step, GLM.from_pretrained)
    assert [n for n, _ in lora.adapter_named(back)] == [n for n, _ in lora.adapter_named(model)]
    with torch.no_grad():
        want = model(IDS)
        assert torch.equal(back(IDS), want)
    out = tmp_path / "merged"
    lora.main(["merge", step, str(out)])
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {f"model.layers.{i}.mlp.experts.{e}.{n}.weight" for i in (1, 2) for e in range(4)
            for n in ("gate_proj", "up_proj", "down_proj")} <= names
    assert not any("experts.gate_up_proj" in n or "lora" in n for n in names)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
    with torch.no_grad():
        merged = GLM.from_pretrained(str(out))(IDS)
    assert ((merged - want).abs().max() / want.abs().max()).item() < 1e-5


@pytest.mark.parametrize("targets", [("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"), lora.TARGETS],
                         ids=["attention", "all"])
def test_moe_adapters_load_in_peft_onto_transformers(targets, tmp_path):
    """peft loads our glm4_moe_lite adapters onto transformers' Glm4MoeLiteForCausalLM of the saved base: our logits
    (fp32, 1e-5 of the largest). With the MLP adapters too, peft releases with huggingface/peft#3711 (0.21 here)
    move the dense and shared MLPs' adapters onto the routed experts (their transformers 4 names): xfail there."""
    peft = pytest.importorskip("peft")
    from transformers import Glm4MoeLiteForCausalLM
    model = trained(lora.add(tiny_moe("glm4_moe_lite"), LoRAConfig(rank=4, alpha=8.0, targets=targets)))
    tiny_moe("glm4_moe_lite").save_pretrained(str(tmp_path / "base"))
    lora.save_adapters(model, str(tmp_path / "adapter"), base_model=str(tmp_path / "base"))
    base = Glm4MoeLiteForCausalLM.from_pretrained(str(tmp_path / "base"), torch_dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    if hf.peft_config["default"].target_parameters:
        pytest.xfail(f"peft {peft.__version__} re-targets the MLP adapters at mlp.experts (huggingface/peft#3711)")
    with torch.no_grad():
        got, want = hf(IDS).logits, model(IDS)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


def test_an_moe_engine_decodes_unmerged_lora_as_the_full_forward():
    """An engine holding the GLM-5-shaped base with zero adapters takes an adapters-only publish and decodes greedily
    (prefill, then the paged decode: MLA's absorbed path, which reads kv_b_proj as a matrix, so its adapter must come
    in through LoRALinear.matrix()): the tokens and logprobs of a float64 full forward of the learner's model (fp32
    engine: 1e-5)."""
    from machinery.engine import SamplingParams, TorchEngine
    cfg = LoRAConfig(rank=4, alpha=8.0)
    learner = trained(lora.add(tiny_moe(), cfg))
    engine = TorchEngine(lora.add(tiny_moe(), cfg))
    engine.update_weights([(n, p.detach()) for n, p in lora.adapter_named(learner)], version=1)
    ref = lora.add(tiny_moe().double(), cfg)
    ref.load_state_dict({k: v.double() for k, v in learner.state_dict().items()})
    (out,) = engine.generate([[3, 9, 27, 4]], SamplingParams(temperature=0, max_new_tokens=12))
    with torch.no_grad():
        logp = ref(torch.tensor([[3, 9, 27, 4] + out.token_ids]))[0, 3:-1].log_softmax(-1)
    chosen = logp.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert (logp.max(-1).values - chosen <= 1e-6).all()
    assert out.logprobs == pytest.approx(chosen.tolist(), abs=1e-5)


# ----------------------------------------------------------------------------- LoRA with an MTP layer
# A tiny dense model (DSA where said) with one MTP layer (model.mtp_layers 1: layer 2, families/mtp.py) under
# model.lora: its block's linears get adapters as the decoder's do, its glue (eh_proj, the norms) stays frozen. What
# trains in an RL step (the policy's adapters by GRPO, the MTP layer's by the MTP loss, each clipped apart), what a
# publish gives the engine's drafter, and what a checkpoint and the merged export keep of them.

MTP_ADAPTED = {f"mtp.2.{n}" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                      "mlp.gate_up_proj", "mlp.down_proj")}  # written out from GLM-4's block


def tiny_mtp(dsa=None, seed=0):
    """tiny(dsa) with one MTP layer, every weight perturbed (sharper probabilities, an MTP layer that drafts)."""
    torch.manual_seed(seed)
    model = GLM(GLMConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                          head_dim=8, attention_bias=True, dsa=dsa, mtp_layers=1))
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def mtp_batch(model, temperature):
    """A GRPO batch of 3 groups of 2 from random prompts and responses; gen_logprobs the model's own (on-policy)."""
    g = torch.Generator().manual_seed(5)
    samples = []
    for i in range(6):
        prompt = torch.randint(2, 50, (3 + i % 3,), generator=g).tolist()
        response = torch.randint(2, 50, (4 + i % 4,), generator=g).tolist()
        with torch.no_grad():
            logp, _, _, _ = train.packed_forward(model, [(prompt + response, [(len(prompt), len(response))])], temperature)
        samples.append(Sample(prompt, response, logp.tolist(), float(i % 3 == 0), i // 2, (0, 0), "length", {}))
    return RolloutBatch(samples, index=0, stream_state={}, metrics={})


def rl_config(**overrides):
    """The default run's config with model.lora on (rank 4, alpha 8, as these tests' adapters) and overrides."""
    tiny_cpu = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny_cpu.yaml")
    overrides = {"model.lora": "{rank: 4, alpha: 8.0}", "rollout.temperature": 0.7} | overrides
    return config.load_config(tiny_cpu, [f"{k}={v}" for k, v in overrides.items()])


def test_under_lora_the_mtp_layers_adapters_train_by_the_mtp_loss_alone_and_clip_apart():
    """An actual rl_step (train.adamw, as train_rl builds it): the trainable parameters are the adapters alone,
    the MTP block's among them (MTP_ADAPTED), never eh_proj or a norm; the policy's adapters get the gradient of a
    step with model.mtp_loss_scale 0 (GRPO's: the trunk detached), the MTP layer's the gradient of mtp_loss over the
    batch's packed row (a float64 reference) at scale > 0 and none at 0; with a tight optim.grad_clip each part is
    scaled by its own norm (parallel.optimizer_step clips mtp.* apart). No other weight moves."""
    model = trained(lora.add(tiny_mtp(), LoRAConfig(rank=4, alpha=8.0)))
    adapters = {n for n, _ in lora.adapter_named(model)}
    assert {n for n, m in model.named_modules() if isinstance(m, lora.LoRALinear) and n.startswith("mtp.")} == MTP_ADAPTED
    assert {n for n, p in model.named_parameters() if p.requires_grad} == adapters
    batch = mtp_batch(model, 0.7)
    grads, metrics = {}, {}
    for scale, clip in ((0.2, 1e9), (0.0, 1e9), (0.2, 1e-3), (0.0, 1e-3)):
        learner = copy.deepcopy(model)
        cfg = rl_config(**{"model.mtp_loss_scale": scale, "optim.grad_clip": clip})
        optimizer = train.adamw(cfg, learner, lora.rl_lr(cfg), cfg.optim.weight_decay)
        metrics[scale, clip] = train.rl_step(cfg, learner, None, optimizer, KLGuard(), batch, version=0)
        assert metrics[scale, clip]["train/skipped"] == 0.0
        grads[scale, clip] = {n: p.grad for n, p in learner.named_parameters()}
        after = dict(learner.named_parameters())
        for n, p in model.named_parameters():  # only adapters with a gradient move (AdamW skips the others)
            assert torch.equal(after[n], p) == (n not in adapters or (scale == 0 and n.startswith("mtp."))), n
    policy = sorted(n for n in adapters if not n.startswith("mtp."))
    drafter = sorted(n for n in adapters if n.startswith("mtp."))
    for clip in (1e9, 1e-3):
        g0, g = grads[0.0, clip], grads[0.2, clip]
        assert all(g[n] is None and g0[n] is None for n in grads[0.0, clip] if n not in adapters)
        assert all(g0[n] is None for n in drafter) and all(g[n].abs().max() > 0 for n in drafter)
        for n in policy:  # the policy's gradient is GRPO's alone
            assert g0[n].abs().max() > 0, n
            torch.testing.assert_close(g[n], g0[n], rtol=1e-5, atol=1e-8)
    # The MTP adapters' gradient: mtp_loss over the samples packed in one row (one micro-batch), in float64
    ref = copy.deepcopy(model).double()
    rows = [s.row() for s in batch.samples]
    ids = torch.tensor([t for seq, _ in rows for t in seq])[None]
    pos = torch.cat([torch.arange(len(seq)) for seq, _ in rows])[None]
    mask, at = torch.zeros_like(ids, dtype=torch.bool), 0
    for seq, spans in rows:
        for a, n in spans:
            mask[0, at + a:at + a + n] = True
        at += len(seq)
    trunk = ref(ids, position_ids=pos, return_hidden="trunk")
    mtp.mtp_loss(ref, trunk, ids, mask, pos, detach_trunk=True, scale=0.2, temperature=0.7).backward()
    assert all(p.grad is None for n, p in ref.named_parameters() if not n.startswith("mtp."))
    for n in drafter:
        torch.testing.assert_close(grads[0.2, 1e9][n].double(), ref.get_parameter(n).grad, rtol=1e-4, atol=1e-7)
    # Clipped apart: each part's norm reported and each scaled by clip / its own norm (torch's clip_grad_norm_)
    for scale in (0.2, 0.0):
        whole, tight = grads[scale, 1e9], grads[scale, 1e-3]
        for names, key in ((policy, "train/grad_norm"), (drafter if scale else [], "train/mtp_grad_norm")):
            norm = float(torch.cat([whole[n].double().flatten() for n in names]).norm()) if names else 0.0
            assert metrics[scale, 1e-3][key] == pytest.approx(norm, rel=1e-5)
            for n in names:
                torch.testing.assert_close(tight[n], whole[n] * (1e-3 / (norm + 1e-6)), rtol=1e-5, atol=1e-12)


def test_a_publish_gives_the_engines_mtp_drafter_the_trained_adapters(tmp_path):
    """make_engine from the run's base with model.lora and a drafter (rollout.speculative_tokens): the publish of RL
    (parallel.full_weights: adapters only) carries the MTP layer's adapters too, and after it the engine's MTP layer
    is the learner's: each adapted linear's merged weight equal (it was not before), the glue the base's, and its
    drafts (families/mtp.draft) those of a float64 merge of the learner's. The engine then speculates with it."""
    from machinery.engine import SamplingParams, make_engine
    tiny_mtp().save_pretrained(str(tmp_path / "base"))
    learner = trained(lora.add(tiny_mtp(), LoRAConfig(rank=4, alpha=8.0)))
    cfg = rl_config(**{"rollout.speculative_tokens": 2, "rollout.max_batch": 4})
    engine = make_engine(cfg.rollout, str(tmp_path / "base"), "cpu", dsa=None, seed=0, lora_cfg=cfg.model.lora, mtp=1)
    assert engine.spec is not None and engine.model.cfg.mtp_layers == 1
    ours, theirs = dict(learner.named_modules()), dict(engine.model.named_modules())
    assert not any(torch.equal(lora.merged_weight(theirs[n]), lora.merged_weight(ours[n])) for n in MTP_ADAPTED)
    sent = list(parallel.full_weights(learner, engine.dtype))
    assert {n for n, _ in sent} == {n for n, _ in lora.adapter_named(learner)} >= {f"{m}.lora_{x}" for m in MTP_ADAPTED
                                                                                   for x in "AB"}
    engine.update_weights(sent, version=1)
    for n in MTP_ADAPTED:
        assert torch.equal(lora.merged_weight(theirs[n]), lora.merged_weight(ours[n])), n
    state = engine.model.state_dict()
    assert all(torch.equal(state[n], t) for n, t in learner.state_dict().items() if n.startswith("mtp."))
    full, _ = lora.merged(copy.deepcopy(learner).double(), torch.float64)
    ids = torch.tensor([[3, 9, 27, 4, 11, 8, 30]])
    with torch.no_grad():
        hidden = full(ids[:, :-1], return_hidden="trunk")
        want, _ = mtp.draft(full, hidden, ids[:, 1:])
        got, _ = mtp.draft(engine.model, hidden.float(), ids[:, 1:])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    engine.generate([[3, 9, 27, 4], [5, 6]], SamplingParams(temperature=0, max_new_tokens=8))
    assert engine.stats["spec_drafts"] > 0


def test_mtp_adapters_are_saved_under_the_layers_published_name_and_round_trip_and_merge(tmp_path):
    """save_adapters writes the MTP layer's adapters in peft's layout under the name the published checkpoints give
    the layer (model.layers.2.*, as its base weights are saved), none under ours (mtp.2.*); load_model (resume)
    reads them back onto the MTP layer bit for bit (and a file naming them mtp.2.* still loads); the merged export
    writes the MTP layer as W + scale B A (a float64 merge) and drafts as the adapted layer does."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    model = trained(lora.add(tiny_mtp(DSA), LoRAConfig(rank=4, alpha=8.0)))  # (the MTP block's indexer: no adapters)
    run = tmp_path / "run"
    tiny_mtp(DSA).save_pretrained(str(run / lora.BASE))
    (run / "checkpoints").mkdir()
    step = str(run / "checkpoints" / "step_000001")
    lora.save_adapters(model, step, base_model=str(run / lora.BASE))
    saved = load_file(os.path.join(step, lora.ADAPTERS))
    assert {k for k in saved if ".layers.2." in k} == {f"base_model.model.model.layers.2.{m[6:]}.lora_{x}.weight"
                                                        for m in MTP_ADAPTED for x in "AB"}  # (m[6:]: mtp.2. off)
    assert not any("mtp" in k for k in saved) and len(saved) == len(lora.adapter_named(model))
    ids = torch.tensor([[3, 9, 27, 4, 11, 8, 30]])

    def drafts(m):  # the MTP layer's logits on the model's own trunk
        with torch.no_grad():
            return mtp.draft(m, m(ids[:, :-1], return_hidden="trunk"), ids[:, 1:])[0]
    for file in (None, "mtp"):
        if file == "mtp":  # the file as written before the MTP adapters took the layer's published name
            save_file({k.replace(".layers.2.", ".mtp.2."): t for k, t in saved.items()}, os.path.join(step, lora.ADAPTERS))
        back = lora.load_model(step, GLM.from_pretrained)
        assert [n for n, _ in lora.adapter_named(back)] == [n for n, _ in lora.adapter_named(model)]
        assert all(torch.equal(p, q) for (_, p), (_, q) in zip(lora.adapter_named(back), lora.adapter_named(model)))
        assert torch.equal(drafts(back), drafts(model))
    out = tmp_path / "merged"
    lora.main(["merge", step, str(out)])
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        exported = f.get_tensor("model.layers.2.self_attn.q_proj.weight")
    assert not any("lora" in n for n in names) and "model.layers.2.eh_proj.weight" in names
    m = model.mtp["2"].self_attn.q_proj
    with torch.no_grad():
        ref = m.weight.double() + m.lora_scale * m.lora_B.double() @ m.lora_A.double()
    assert not torch.allclose(m.weight.double(), ref, atol=1e-3)
    torch.testing.assert_close(exported.double(), ref, rtol=1e-6, atol=1e-6)
    want = drafts(model)
    assert ((drafts(GLM.from_pretrained(str(out))) - want).abs().max() / want.abs().max()).item() < 1e-5
    # a base loaded without its MTP layer (model.mtp_layers: 0) cannot take them: one line naming the file
    with pytest.raises(ValueError, match=r"step_000001/adapter_model\.safetensors: adapters do not match .* 0 MTP layers"):
        lora.load_model(step, lambda path: GLM.from_pretrained(path, mtp=0))


def test_peft_loads_the_adapters_of_a_model_with_an_mtp_layer_onto_transformers_glm4(tmp_path):
    """transformers' Glm4ForCausalLM has no MTP layer: loading the base it leaves model.layers.2.* aside, and peft
    loading our adapters leaves the MTP layer's aside alike; the logits are our LoRA model's (fp32)."""
    peft = pytest.importorskip("peft")
    from transformers import Glm4ForCausalLM
    model = trained(lora.add(tiny_mtp(), LoRAConfig(rank=4, alpha=8.0)))
    tiny_mtp().save_pretrained(str(tmp_path / "base"))
    lora.save_adapters(model, str(tmp_path / "adapter"), base_model=str(tmp_path / "base"))
    base = Glm4ForCausalLM.from_pretrained(str(tmp_path / "base"), torch_dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        got, want = hf(IDS).logits, model(IDS)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
