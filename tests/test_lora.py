"""lora.py: at the start of RL the LoRA model is exactly its base (fp32, bf16 weights, bf16 autocast); gradients
reach the adapters only, kept in fp32 under autocast; disabled() is the base; the fp32 merge is the adapted
layer; the peft layout loads with peft onto transformers' Glm4ForCausalLM and gives our logits."""
import json

import pytest
import torch

from machinery import lora
from machinery.lora import LoRAConfig
from model import GLM, GLMConfig

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
