"""families/mtp.py: checkpoints in the published layouts (GLM-4.7-Flash's and GLM-5's, MTP layer included) load, run and
save back as published; the MTP layer's cached decode equals its full forward; the MTP loss against a float64 reference."""
import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

import families.mla_moe  # noqa: F401 (registers the MLA + MoE families; the package the MTP module)
from families import mtp
from model import FP32_PARAMS, GLM, GLMConfig, KVCache, PagedKVCache, attention_inputs, our_name

# GLM-4.7-Flash's published config.json (zai-org/GLM-4.7-Flash), only the sizes shrunk: hidden 2048 -> 32, vocab
# 154880 -> 96, 47 layers -> 3, 64 experts -> 8, the MLA ranks and head widths, and the token ids to fit the vocabulary
FLASH = {
    "architectures": ["Glm4MoeLiteForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "pad_token_id": 90, "eos_token_id": [90, 91, 92], "hidden_act": "silu", "hidden_size": 32,
    "intermediate_size": 48, "max_position_embeddings": 202752, "model_type": "glm4_moe_lite",
    "moe_intermediate_size": 16, "topk_method": "noaux_tc", "norm_topk_prob": True, "num_attention_heads": 4,
    "n_group": 1, "topk_group": 1, "n_routed_experts": 8, "n_shared_experts": 1, "routed_scaling_factor": 1.8,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "num_hidden_layers": 3, "num_key_value_heads": 4,
    "num_nextn_predict_layers": 1, "partial_rotary_factor": 1.0, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 1000000, "tie_word_embeddings": False, "dtype": "bfloat16", "transformers_version": "5.0.0rc0",
    "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 20,
    "vocab_size": 96,
}
# GLM-5 (glm_moe_dsa): its config.json is not public here; transformers' GlmMoeDsaConfig defaults for the keys,
# shrunk as above (78 layers -> 4, first_k_dense_replace 3 -> 1, index_topk 2048 -> 4, index_head_dim 128 -> 16,
# index_n_heads 32 -> 4), indexer_types full / shared, and the MTP layer (num_nextn_predict_layers 1)
GLM5 = {
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "attention_bias": False,
    "hidden_act": "silu", "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
    "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1, "num_hidden_layers": 4, "num_nextn_predict_layers": 1, "q_lora_rank": 24,
    "kv_lora_rank": 16, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 20, "index_topk": 4,
    "index_head_dim": 16, "index_n_heads": 4, "indexer_types": ["full", "shared", "full", "shared"],
    "rope_theta": 1000000, "rms_norm_eps": 1e-05, "max_position_embeddings": 202752, "tie_word_embeddings": False,
    "vocab_size": 96, "pad_token_id": 90, "eos_token_id": [90, 91], "dtype": "bfloat16",
}


def published_tensors(c: dict) -> dict:
    """{name: (shape, dtype)}: the published tensor table (GLM-4.7-Flash's model information) at config c's sizes. Layer
    num_hidden_layers is the MTP layer: a full block (MoE, GLM-5's with the indexer) plus enorm, hnorm, eh_proj and
    copies of the embedding and head."""
    h, V, L = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    H, r, q = c["num_attention_heads"], c["kv_lora_rank"], c["q_lora_rank"]
    nope, rope, v, E, I = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["n_routed_experts"], c["moe_intermediate_size"]
    bf, f32 = torch.bfloat16, torch.float32
    t = {"model.embed_tokens.weight": ((V, h), bf), "lm_head.weight": ((V, h), bf), "model.norm.weight": ((h,), bf)}
    for i in range(L + 1):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": ((h,), bf), p + "post_attention_layernorm.weight": ((h,), bf),
                  p + "self_attn.q_a_proj.weight": ((q, h), bf), p + "self_attn.q_a_layernorm.weight": ((q,), bf),
                  p + "self_attn.q_b_proj.weight": ((H * (nope + rope), q), bf),
                  p + "self_attn.kv_a_proj_with_mqa.weight": ((r + rope, h), bf),
                  p + "self_attn.kv_a_layernorm.weight": ((r,), bf),
                  p + "self_attn.kv_b_proj.weight": ((H * (nope + v), r), bf), p + "self_attn.o_proj.weight": ((h, H * v), bf)})
        if i < c["first_k_dense_replace"]:
            for n, shape in (("gate_proj", (c["intermediate_size"], h)), ("up_proj", (c["intermediate_size"], h)),
                             ("down_proj", (h, c["intermediate_size"]))):
                t[p + f"mlp.{n}.weight"] = (shape, bf)
        else:
            t[p + "mlp.gate.weight"] = ((E, h), bf)
            t[p + "mlp.gate.e_score_correction_bias"] = ((E,), f32)
            for e in [f"experts.{e}" for e in range(E)] + ["shared_experts"]:
                t.update({p + f"mlp.{e}.gate_proj.weight": ((I, h), bf), p + f"mlp.{e}.up_proj.weight": ((I, h), bf),
                          p + f"mlp.{e}.down_proj.weight": ((h, I), bf)})
        if c["model_type"] == "glm_moe_dsa" and (i == L or c["indexer_types"][i] == "full"):  # (GLM-5's indexer)
            d, n = c["index_head_dim"], c["index_n_heads"]
            t.update({p + "self_attn.indexer.wq_b.weight": ((n * d, q), bf), p + "self_attn.indexer.wk.weight": ((d, h), bf),
                      p + "self_attn.indexer.k_norm.weight": ((d,), f32), p + "self_attn.indexer.k_norm.bias": ((d,), f32),
                      p + "self_attn.indexer.weights_proj.weight": ((n, h), f32)})
    p = f"model.layers.{L}."
    t.update({p + "eh_proj.weight": ((h, 2 * h), bf), p + "enorm.weight": ((h,), bf), p + "hnorm.weight": ((h,), bf),
              p + "embed_tokens.weight": ((V, h), bf), p + "shared_head.norm.weight": ((h,), bf),
              p + "shared_head.head.weight": ((V, h), bf)})
    return t


def write_published(path, c: dict, seed=0, differ=False):
    """A checkpoint of config c in the published layout: its tensors random (norms near 1), the MTP layer's
    embedding and head copies of the main model's (differ: not), sharded as published (embeddings in the first
    shard, the decoder layers after, lm_head and the MTP head in the second-to-last, the MTP glue in the last)."""
    g = torch.Generator().manual_seed(seed)
    table, L = published_tensors(c), c["num_hidden_layers"]
    tensors = {}
    for name, (shape, dtype) in table.items():
        x = torch.randn(shape, generator=g) * (0.02 if len(shape) > 1 else 0.1)
        tensors[name] = ((1 + x) if name.endswith("norm.weight") else x).to(dtype)
    for n, main in mtp.COPIES.items():
        tensors[f"model.layers.{L}.{n}"] = tensors[main].clone() + (0.5 if differ else 0)
    glue = [n for n in table if n.startswith(f"model.layers.{L}.") and n.split(f"{L}.", 1)[1].startswith(mtp.GLUE)]
    heads = ["lm_head.weight", f"model.layers.{L}.shared_head.head.weight"]
    first = ["model.embed_tokens.weight", f"model.layers.{L}.embed_tokens.weight"]
    middle = [n for n in table if n not in glue + heads + first]
    shards = [first, middle[:len(middle) // 2], middle[len(middle) // 2:], heads, glue]
    os.makedirs(path, exist_ok=True)
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, fname))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f)
    return tensors


def read_all(path) -> dict:
    out = {}
    for fname in sorted(os.listdir(path)):
        if fname.endswith(".safetensors"):
            with safe_open(os.path.join(path, fname), framework="pt") as f:
                out.update({n: f.get_tensor(n) for n in f.keys()})
    return out


@pytest.mark.parametrize("c", [FLASH, GLM5], ids=["glm4_moe_lite", "glm_moe_dsa"])
def test_published_layout_loads_runs_and_saves_as_published(c, tmp_path):
    tensors = write_published(tmp_path / "pub", c)
    m = GLM.from_pretrained(tmp_path / "pub", dtype=torch.bfloat16)
    assert m.cfg.mtp_layers == 1 and not m.cfg.mtp_own_embeddings
    ids = torch.randint(0, 90, (2, 7))
    with torch.no_grad():
        hidden = m(ids, return_hidden="trunk")
        logits, h = mtp.draft(m, hidden[:, :-1], ids[:, 1:])
    assert logits.shape == (2, 6, 96) and h.shape == (2, 6, 32) and torch.isfinite(logits.float()).all()
    m.save_pretrained(str(tmp_path / "out"), max_shard_bytes=20_000)
    saved = read_all(tmp_path / "out")
    assert set(saved) == set(tensors)  # the published names, the MTP layer's copies of embedding and head included
    for name, t in tensors.items():  # (the routers' weights and DSA's small tensors are kept in fp32: FP32_PARAMS)
        assert saved[name].dtype == (torch.float32 if our_name(name).endswith(FP32_PARAMS) else t.dtype), name
        assert torch.equal(saved[name].to(t.dtype), t), name
    out_cfg = json.load(open(tmp_path / "out" / "config.json"))
    assert out_cfg["num_nextn_predict_layers"] == 1 and out_cfg["num_hidden_layers"] == c["num_hidden_layers"]


def test_mtp_copies_that_differ_are_kept_apart(tmp_path, capsys):
    tensors = write_published(tmp_path / "pub", FLASH, differ=True)
    m = GLM.from_pretrained(tmp_path / "pub", dtype=torch.bfloat16)
    assert m.cfg.mtp_own_embeddings and "kept apart" in capsys.readouterr().out
    assert torch.equal(m.mtp["3"].embed_tokens.weight, tensors["model.layers.3.embed_tokens.weight"])
    assert torch.equal(m.embed_tokens.weight, tensors["model.embed_tokens.weight"])
    m.save_pretrained(str(tmp_path / "out"))
    saved = read_all(tmp_path / "out")
    assert all(torch.equal(saved[n], t) for n, t in tensors.items())


def test_an_unexplained_tensor_is_still_an_error_naming_it(tmp_path):
    write_published(tmp_path / "pub", dict(FLASH, num_nextn_predict_layers=0))  # the MTP layer's tensors unexplained
    with pytest.raises(ValueError, match=r"unexpected tensor model\.layers\.3\."):
        GLM.from_pretrained(tmp_path / "pub")


def test_mtp_zero_drops_the_layer_and_a_fresh_one_is_added(tmp_path, capsys):
    write_published(tmp_path / "pub", FLASH)
    m = GLM.from_pretrained(tmp_path / "pub", mtp=0)
    assert m.mtp is None and "ignored the checkpoint's MTP layer(s) 3" in capsys.readouterr().out
    m.save_pretrained(str(tmp_path / "plain"))
    assert not any(n.startswith("model.layers.3.") for n in read_all(tmp_path / "plain"))
    torch.manual_seed(0)
    m2 = GLM.from_pretrained(tmp_path / "plain", mtp=1)  # a checkpoint without one (as GLM-Z1-9B): a fresh MTP layer
    assert "initialised them fresh" in capsys.readouterr().out
    assert m2.cfg.mtp_layers == 1 and m2.mtp["3"].eh_proj.weight.std() > 0
    assert torch.equal(m2.layers[1].mlp.experts.down_proj, m.layers[1].mlp.experts.down_proj)


def dense_cfg(**kw):
    return GLMConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=8, mtp_layers=1, **kw)


def small_model(kind):
    """A dense GLM-4 (+ DSA) or an MLA + MoE (+ DSA) model with one MTP layer, in fp32, perturbed."""
    torch.manual_seed(0)
    if kind == "dense":
        m = GLM(dense_cfg())
    elif kind == "dense_dsa":
        m = GLM(dense_cfg(dsa=dict(topk=3, heads=2, head_dim=8, rope_dim=4, pattern="FS")))
    else:
        cfg = GLMConfig.from_hf(FLASH if kind == "mla_moe" else GLM5)
        m = GLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m.eval()


KINDS = ["dense", "dense_dsa", "mla_moe", "mla_moe_dsa"]


@pytest.mark.parametrize("kind", KINDS)
def test_mtp_cached_decode_equals_full_forward(kind):
    m = small_model(kind)
    T = 9
    ids = torch.randint(0, 60, (2, T + 1))
    with torch.no_grad():
        hidden = m(ids[:, :T], return_hidden="trunk")
        full, full_h = mtp.draft(m, hidden, ids[:, 1:])
        cache = KVCache(m.cfg, 2, T + 1, mtp=True)
        m(ids[:, :3], cache=cache)  # the decoder runs ahead: the MTP layer's slots fill one token behind
        steps = [mtp.draft(m, hidden[:, :2], ids[:, 1:3], cache=cache)[0]]
        for t in range(2, T):
            m(ids[:, t + 1:t + 2], cache=cache)
            steps.append(mtp.draft(m, hidden[:, t:t + 1], ids[:, t + 1:t + 2], cache=cache)[0])
    assert cache.mtp_length == T and cache.length == T + 1
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_mtp_paged_prefill_and_decode_equal_full_forward(kind):
    m = small_model(kind)
    T, size = 7, 4
    ids = torch.randint(0, 60, (1, T + 1))
    with torch.no_grad():
        hidden = m(ids[:, :T], return_hidden="trunk")
        full, _ = mtp.draft(m, hidden, ids[:, 1:])
        pool = PagedKVCache(m.cfg, 4, size, mtp=True)
        assert len(pool.k) == m.cfg.num_layers + 1
        slots = torch.arange(T)  # blocks 0 and 1, in order
        pool.slots = slots[:4]  # a prefill of the first 4 positions (one packed row)
        out = [mtp.draft(m, hidden[:, :4], ids[:, 1:5], position_ids=torch.arange(4)[None], cache=pool)[0]]
        for t in range(4, T):  # decode steps, one token per row
            pool.slots, pool.keys, pool.key_valid = slots[t:t + 1], slots[None, :t + 1], torch.ones(1, t + 1, dtype=torch.bool)
            out.append(mtp.draft(m, hidden[:, t:t + 1], ids[:, t + 1:t + 2], position_ids=torch.tensor([[t]]), cache=pool)[0])
            pool.keys = None
    torch.testing.assert_close(torch.cat(out, 1), full, rtol=1e-4, atol=1e-5)


def test_trunk_hidden_is_the_last_block_output_before_the_final_norm():
    m = small_model("dense")
    ids = torch.randint(0, 60, (2, 5))
    with torch.no_grad():
        trunk = m(ids, return_hidden="trunk")
        assert torch.equal(m.norm(trunk), m(ids, return_hidden=True))
        assert torch.equal(m.lm_head(m.norm(trunk)), m(ids))


def naive_rms(x, w, eps):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def reference_loss(m, hidden, ids, loss_mask, lengths, temperature=1.0):
    """mtp_loss in float64, one sequence at a time, written out: the glue by hand, the block as the layer's own, the
    cross-entropy as -log softmax of each counted target, averaged over the counted tokens. (model.RMSNorm computes
    in fp32 even for fp64 input: hence the tolerances of ~1e-6.)"""
    layer = m.mtp[str(m.cfg.num_layers)]
    eps, total, n, start = m.cfg.rms_norm_eps, 0.0, 0, 0
    for length in lengths:
        h, tok, lm = hidden[:, start:start + length], ids[:, start:start + length], loss_mask[:, start:start + length]
        e = m.embed_tokens.weight[tok[:, 1:]]  # the token after each position
        x = torch.cat([naive_rms(e, layer.enorm.weight, eps), naive_rms(h[:, :-1], layer.hnorm.weight, eps)], -1)
        x = x @ layer.eh_proj.weight.T
        x = _block(layer, x)  # the decoder block (its own numerics are test_model.py's)
        logits = naive_rms(x, layer.shared_head.norm.weight, eps) @ m.lm_head.weight.T  # [1, length - 1, V]
        for t in range(length - 2):
            if lm[0, t + 2]:
                total = total - torch.log_softmax(logits[0, t] / temperature, -1)[tok[0, t + 2]]
                n += 1
        start += length
    return total / n


def _block(layer, x):
    mask, rope = attention_inputs(layer.block.self_attn.cfg, *x.shape[:2], x.device, None, None, None)
    rope = {name: (cos.to(x.dtype), sin.to(x.dtype)) for name, (cos, sin) in rope.items()}
    return layer.block(x, rope, mask, None, None, None)[0]


@pytest.mark.parametrize("detach, temperature", [(True, 1.0), (False, 1.0), (True, 2.0)])
def test_mtp_loss_and_gradient_match_a_float64_reference(detach, temperature):
    """(temperature: the rollout's, at which RL's tokens were sampled and the engine drafts)"""
    m = small_model("dense").double()
    lengths = [6, 5]  # one packed row of two sequences
    ids = torch.randint(0, 60, (1, sum(lengths)))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    loss_mask = torch.rand(1, sum(lengths)) > 0.3
    loss_mask[0, 2] = True
    trunk = m(ids, position_ids=pos, return_hidden="trunk")
    loss = mtp.mtp_loss(m, trunk, ids, loss_mask, position_ids=pos, detach_trunk=detach, scale=0.2, chunk=3,
                        temperature=temperature)
    params = [m.mtp["2"].eh_proj.weight, m.mtp["2"].shared_head.norm.weight, m.lm_head.weight, m.layers[0].mlp.down_proj.weight]
    grads = torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True)
    ref = 0.2 * reference_loss(m, trunk if not detach else trunk.detach(), ids, loss_mask, lengths, temperature)
    ref_grads = torch.autograd.grad(ref, params, allow_unused=True)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-9)
    for g, r in zip(grads[:2], ref_grads[:2]):
        assert (g - r).norm() <= 1e-5 * r.norm()
    if detach:  # the main model gets nothing
        assert grads[2] is None and grads[3] is None
    else:
        assert all((g - r).norm() <= 1e-5 * r.norm() for g, r in zip(grads[2:], ref_grads[2:]))


def test_dense_mtp_config_roundtrips_and_bad_values_are_one_line(tmp_path):
    cfg = dense_cfg()
    assert cfg.to_hf()["num_nextn_predict_layers"] == 1 and GLMConfig.from_hf(cfg.to_hf()).mtp_layers == 1
    assert "num_nextn_predict_layers" not in GLMConfig().to_hf()  # GLM-4's config.json as before
    with pytest.raises(ValueError, match="mtp_layers"):
        GLMConfig(mtp_layers=-1)
