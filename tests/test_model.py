"""model.py against transformers' Glm4ForCausalLM (the reference), on random tiny configs in float32."""
import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import Glm4Config, Glm4ForCausalLM

import model
from model import GLM, GLMConfig, KVCache

# (heads, kv heads, head_dim, rotary fraction, layers): different GQA groupings and rotary fractions.
CONFIGS = [(4, 2, 16, 0.5, 2), (4, 4, 8, 1.0, 1), (6, 1, 16, 0.25, 3), (8, 2, 12, 0.5, 2)]


def hf_config(heads, kv, head_dim, frac, layers, vocab=97):
    return Glm4Config(vocab_size=vocab, hidden_size=48, intermediate_size=80, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": frac},
                      rms_norm_eps=1e-5, pad_token_id=0, eos_token_id=[1], max_position_embeddings=256)


def random_hf_model(cfg, seed=0):
    torch.manual_seed(seed)
    m = Glm4ForCausalLM(cfg).float().eval()
    m.config._attn_implementation = "eager"
    with torch.no_grad():  # perturb every tensor so norms, biases and the head are all exercised
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return m


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module", params=range(len(CONFIGS)))
def pair(request, tmp_path_factory):
    hf = random_hf_model(hf_config(*CONFIGS[request.param]), seed=request.param)
    path = str(tmp_path_factory.mktemp("hf"))
    hf.save_pretrained(path)
    return hf, GLM.from_pretrained(path).eval(), path


def test_logits_match_transformers(pair):
    hf, ours, _ = pair
    ids = torch.randint(0, 97, (3, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel_err(ours(ids), hf(ids).logits) < 1e-5


def test_padded_batch_matches_transformers(pair):
    hf, ours, _ = pair
    ids = torch.randint(2, 97, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding on row 1
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, position_ids=pos).logits
        out = ours(ids, attention_mask=mask, position_ids=pos, cache=KVCache(ours.cfg, 2, 12))
    assert rel_err(out[mask.bool()], ref[mask.bool()]) < 1e-5


def test_ours_to_transformers_roundtrip(pair, tmp_path):
    hf, ours, _ = pair
    ours.save_pretrained(str(tmp_path / "ours"))
    back = Glm4ForCausalLM.from_pretrained(str(tmp_path / "ours"), dtype=torch.float32).eval()
    for name, t in hf.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        assert rel_err(back(ids).logits, hf(ids).logits) < 1e-6


def test_flat_and_rope_parameters_config_forms(tmp_path):
    """The published GLM-Z1-9B-0414 config.json keeps rope_theta / partial_rotary_factor at top level."""
    modern = json.loads(hf_config(4, 2, 16, 0.5, 1).to_json_string())
    flat = {k: v for k, v in modern.items() if k != "rope_parameters"}
    flat.update(rope_theta=10000.0, partial_rotary_factor=0.5)
    assert GLMConfig.from_hf(flat) == GLMConfig.from_hf(modern)
    nine_b = GLMConfig.from_hf({"vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 13696,
                                "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 2,
                                "head_dim": 128, "rope_theta": 10000, "partial_rotary_factor": 0.5,
                                "rms_norm_eps": 1e-5, "attention_bias": True})
    assert (nine_b.rope_dim, nine_b.num_kv_heads, nine_b.tie_word_embeddings) == (64, 2, False)
    with torch.device("meta"):
        n = sum(p.numel() for p in GLM(nine_b).parameters())
    assert 9.0e9 < n < 9.5e9  # GLM-4-9B-0414 has 9.4B parameters


def test_a_scaled_rope_in_either_form_is_refused_in_one_line():
    """transformers 4's rope_scaling ({type: yarn, ...}) and 5's rope_parameters.rope_type: a scaled RoPE read as the
    default one would change every position's angle in silence; a default or null rope_scaling loads."""
    modern = json.loads(hf_config(4, 2, 16, 0.5, 1).to_json_string())
    flat = {k: v for k, v in modern.items() if k != "rope_parameters"} | {"rope_theta": 10000.0}
    for legacy in ({"type": "yarn", "factor": 4.0}, {"rope_type": "linear", "factor": 2.0}):
        with pytest.raises(ValueError, match=r"^config.json: rope_scaling '(yarn|linear)' is not supported") as e:
            GLMConfig.from_hf(flat | {"rope_scaling": legacy})
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="rope_parameters.rope_type 'yarn'"):
        GLMConfig.from_hf(modern | {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}})
    for fine in (None, {"type": "default"}):
        assert GLMConfig.from_hf(flat | {"rope_scaling": fine}) == GLMConfig.from_hf(modern)


def test_sharded_checkpoint_loads(pair, tmp_path):
    hf, ours, _ = pair
    ours.save_pretrained(str(tmp_path / "sharded"), max_shard_bytes=20_000)
    assert os.path.exists(tmp_path / "sharded" / "model.safetensors.index.json")
    again = GLM.from_pretrained(str(tmp_path / "sharded"))
    for (n, a), b in zip(ours.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), n


def test_loading_holds_each_weight_once_in_its_final_dtype(pair):
    """from_pretrained allocates every tensor once, in the dtype it keeps, and copies the file's tensors in one
    at a time: a bf16 generator never holds an fp32 model (before, the meta model was fp32, so to_empty allocated
    4 bytes a weight before the cast, and every loaded tensor sat beside its freshly allocated copy). Every
    tensor an op makes is watched through a weak reference; the fp32 bytes alive at once must stay within the
    largest tensor (the one being read from the fp32 file) plus the weights that stay fp32 (dsa.FP32_PARAMS)."""
    import weakref
    from torch.utils._python_dispatch import TorchDispatchMode

    class Live(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.alive, self.peak = {}, 0  # storage pointer -> (weak ref, bytes) of fp32 tensors

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type == "cpu":
                    self.alive[t.untyped_storage().data_ptr()] = (weakref.ref(t), t.untyped_storage().nbytes())
            self.alive = {k: v for k, v in self.alive.items() if v[0]() is not None}
            self.peak = max(self.peak, sum(b for _, b in self.alive.values()))
            return out
    _, ours, path = pair
    with Live() as seen:
        bf16 = GLM.from_pretrained(path, dtype=torch.bfloat16)
    largest = max(p.numel() * 4 for p in ours.parameters())
    kept_fp32 = sum(p.numel() * 4 for p in bf16.parameters() if p.dtype == torch.float32)
    assert 0 < seen.peak <= largest + kept_fp32 < sum(p.numel() * 4 for p in ours.parameters()) / 2
    for (n, a), b in zip(ours.state_dict().items(), bf16.state_dict().values()):
        assert torch.equal(a.to(torch.bfloat16), b), n


def test_bad_checkpoints_name_the_tensor(pair, tmp_path):
    _, ours, path = pair
    state = load_file(os.path.join(path, "model.safetensors"))
    bad = tmp_path / "bad"
    bad.mkdir()
    with open(os.path.join(path, "config.json")) as f:
        (bad / "config.json").write_text(f.read())
    name = "model.layers.0.self_attn.k_proj.weight"
    wrong = dict(state, **{name: torch.zeros(3, 3)})
    save_file(wrong, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight has shape \(3, 3\)"):
        GLM.from_pretrained(str(bad))
    missing = {k: v for k, v in state.items() if k != "model.norm.weight"}
    save_file(missing, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor model\.norm\.weight"):
        GLM.from_pretrained(str(bad))
    with pytest.raises(FileNotFoundError, match="config.json"):
        GLM.from_pretrained(str(tmp_path / "nowhere"))


def test_cached_decode_equals_full_forward(pair):
    _, ours, _ = pair
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, 97, (3, 16), generator=g)
    with torch.no_grad():
        full = ours(ids)
        cache = KVCache(ours.cfg, 3, 16)
        steps = [ours(ids[:, :6], cache=cache)]  # prefill, then one token at a time
        for t in range(6, 16):
            steps.append(ours(ids[:, t:t + 1], cache=cache))
    assert rel_err(torch.cat(steps, 1), full) < 1e-5


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_cached_decode_equals_unpadded(pair, side):
    """Rows of different lengths in one cached batch give the same logits as each row alone."""
    _, ours, _ = pair
    g = torch.Generator().manual_seed(4)
    lens, T, new = [9, 5, 7], 9, 4
    prompts = [torch.randint(2, 97, (n,), generator=g) for n in lens]
    cont = torch.randint(2, 97, (3, new), generator=g)
    ids, mask = torch.zeros(3, T, dtype=torch.long), torch.zeros(3, T, dtype=torch.long)
    for i, p in enumerate(prompts):
        sl = slice(T - len(p), T) if side == "left" else slice(0, len(p))
        ids[i, sl], mask[i, sl] = p, 1
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        cache = KVCache(ours.cfg, 3, T + new)
        ours(ids, position_ids=pos, attention_mask=mask, cache=cache)
        nxt = pos.max(1).values + 1
        outs = []
        for t in range(new):
            outs.append(ours(cont[:, t:t + 1], position_ids=(nxt + t)[:, None], cache=cache))
        batched = torch.cat(outs, 1)
        for i, p in enumerate(prompts):
            alone = ours(torch.cat([p, cont[i]])[None])[0, len(p):]
            assert rel_err(batched[i], alone) < 1e-5


@pytest.mark.parametrize("autocast", [False, True])
def test_packed_forward_equals_separate(pair, autocast, monkeypatch):
    """Sequences packed into one row (positions restarting at 0) give each sequence's own logits and
    gradients, in fp32 and under bf16 autocast (fp32 master weights, as the learner runs on a GPU); the
    attention calls score about sum_i L_i^2 pairs, not (sum_i L_i)^2: sequences of similar length share
    one right-padded causal call, which needs no mask."""
    _, ours, _ = pair
    g = torch.Generator().manual_seed(5)
    lengths = (5, 8, 3, 7, 6, 1, 8)
    seqs = [torch.randint(0, 97, (n,), generator=g) for n in lengths]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    calls, sdpa = [], F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, *a, **kw: calls.append((q.shape, kw)) or sdpa(q, *a, **kw))
    weight = torch.randn(97, generator=g)

    def run(fn):
        ours.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = fn().float()
        (out @ weight).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in ours.named_parameters()}
    out, grads = run(lambda: ours(torch.cat(seqs)[None], position_ids=pos)[0])
    packed_calls, calls[:] = list(calls), []
    ref, ref_grads = run(lambda: torch.cat([ours(s[None])[0] for s in seqs]))
    tol = 2e-2 if autocast else 1e-5  # bf16: the groups' padded batches round like the separate calls, not exactly
    assert rel_err(out, ref) < tol
    for n in grads:
        # bf16: up to 5.6% on a bias gradient (a sum over every token) on a CPU without AVX-512, which rounds
        # bf16 matmuls differently; a wrong mask or position is off by far more
        assert rel_err(grads[n], ref_grads[n]) < (8e-2 if autocast else 1e-4), n
    assert all(kw.get("is_causal") and "attn_mask" not in kw for _, kw in packed_calls)  # no mask: flash on GPU
    scored = sum(shape[0] * shape[2] ** 2 for shape, _ in packed_calls) / ours.cfg.num_layers  # [n, H, L, D]
    assert scored <= sum(n * n for n in lengths) / model.GROUP_RATIO**2 < sum(lengths) ** 2 / 3



@pytest.mark.parametrize("autocast", [False, True])
def test_keep_gives_the_kept_positions_outputs_and_gradients(pair, autocast):
    """keep (the learner's scored positions): the outputs and gradients of the full forward at those
    positions, in fp32 and under bf16 autocast, with the last block's MLP run on the kept rows only."""
    _, ours, _ = pair
    g = torch.Generator().manual_seed(7)
    lengths = (6, 3, 9, 5)
    ids = torch.randint(0, 97, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    keep = torch.tensor([2, 3, 4, 7, 12, 13, 20])
    weight = torch.randn(97, generator=g)
    rows = []
    hook = ours.layers[-1].mlp.down_proj.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[1]))

    def run(**kw):
        ours.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = ours(ids, position_ids=pos, **kw)[0].float()
        out = out if "keep" in kw else out[keep]
        (out @ weight).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in ours.named_parameters()}
    try:
        out, grads = run(keep=keep)
        ref, ref_grads = run()
    finally:
        hook.remove()
    assert rows == [len(keep), ids.shape[1]]
    tol = 2e-2 if autocast else 1e-5  # bf16: the matmuls' row blocking differs with the row count
    assert rel_err(out, ref) < tol
    for n in grads:
        assert rel_err(grads[n], ref_grads[n]) < (5e-2 if autocast else 1e-5), n


def test_to_device_copies_host_data():
    """model.to_device: lists, numpy arrays and CPU tensors arrive with their values (and the dtype asked
    for); on CUDA through pinned memory, without waiting (the engine's per-step copies)."""
    import numpy as np
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        for data in ([3, 1, 2], np.array([3, 1, 2]), torch.tensor([3, 1, 2])):
            t = model.to_device(data, device, torch.long)
            assert t.device.type == device and t.dtype == torch.long and t.tolist() == [3, 1, 2]
        assert model.to_device(np.zeros((2, 0), dtype=np.int64), device).shape == (2, 0)


def test_packed_groups():
    """model.Packed: every token appears once in its group at its own position, padding only at the
    right end of a sequence; rows of several sequences (B > 1) too."""
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
    p = model.Packed.of(pos)
    flat = pos.flatten()
    seen = []
    for src, m in p.groups:
        real = m.q_valid()
        assert torch.equal(flat[src][real], torch.arange(src.shape[1]).expand_as(src)[real])  # positions in order
        assert (real[:, :-1] >= real[:, 1:]).all()  # padding after the real tokens only
        seen += src[real].tolist()
    assert sorted(seen) == list(range(flat.numel()))
    groups = torch.cat([src.flatten() for src, _ in p.groups])
    assert torch.equal(groups[p.back], torch.arange(flat.numel()))  # put_back undoes the regrouping
    assert sum(p.share) == pytest.approx(1.0)


@pytest.mark.parametrize("lengths, runs, in_order", [((4, 4, 4), [0], True), ((6,), [0], True), ((9, 3, 3), [0, 9], True),
                                                     ((3, 4, 3, 3), [None], False), ((5, 2, 3), [0, 7, 5], False),
                                                     ((5, 4, 2, 2), [None, 9], False)])
def test_packed_take_and_put_back(lengths, runs, in_order):
    """Packed.take is the gather of each group's slots, and put_back its inverse, whether a group is a view of the
    row (its sequences end to end, all of one length: Packed.runs) or a gather; back's gather is skipped only where
    it is the identity (the groups in the row's order, no padding)."""
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    p = model.Packed.of(pos)
    assert p.runs == runs and p.in_order == in_order
    t = torch.randn(1, pos.shape[1], 3, 2)
    outs = []
    for i, (src, _) in enumerate(p.groups):
        outs.append(p.take(t, i))
        assert torch.equal(outs[-1], t.flatten(0, 1)[src])
    assert torch.equal(p.put_back(outs, (1, pos.shape[1])), t)


def test_gradient_checkpointing_same_gradients(pair):
    _, ours, _ = pair
    ids = torch.randint(0, 97, (2, 10))
    grads = []
    for ckpt in (False, True):
        ours.zero_grad()
        ours.gradient_checkpointing = ckpt
        ours(ids).logsumexp(-1).mean().backward()
        grads.append([p.grad.clone() for p in ours.parameters()])
    ours.gradient_checkpointing = False
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6)


def test_tied_embeddings_roundtrip(tmp_path):
    cfg = GLMConfig(vocab_size=31, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                    num_kv_heads=1, head_dim=8, tie_word_embeddings=True)
    m = GLM(cfg)
    m.save_pretrained(str(tmp_path / "tied"))
    back = GLM.from_pretrained(str(tmp_path / "tied"))
    assert back.lm_head.weight is back.embed_tokens.weight
    ids = torch.randint(0, 31, (1, 5))
    assert torch.equal(m(ids), back(ids))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_attention_never_falls_back_to_the_math_kernel():
    """At the 9B head shapes in bf16: causal GQA attention (plain input, every group of a packed row) takes
    the flash kernel, masked attention (left padding, a cache) the memory-efficient one; the math kernel, which materialises [B, H, Tq, Tk]
    fp32 scores, is not allowed to run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from model import AttnMask, dense_attention
    T, H, Hkv, D = 1024, 32, 2, 128
    q = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, T, Hkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    pos = torch.arange(T, device="cuda")
    left = torch.arange(T, device="cuda")[None] >= T // 4  # a left-padded row
    for mask, backends in ((AttnMask(pos, T), [SDPBackend.FLASH_ATTENTION]),
                           (AttnMask(pos, T, left), [SDPBackend.EFFICIENT_ATTENTION])):
        with sdpa_kernel(backends):
            dense_attention(q, k, v, mask, D**-0.5).float().sum().backward()


def test_an_unregistered_model_type_names_the_import_that_registers_it(monkeypatch):
    """model.FAMILIES holds GLM-4's own family until families/mla_moe.py adds its two: without that import, a
    GLM-4.7-Flash or GLM-5 config says in one line what to import."""
    monkeypatch.setattr(model, "FAMILIES", {"glm4": model.FAMILIES["glm4"]})
    with pytest.raises(ValueError, match="import families.mla_moe first"):
        GLMConfig(model_type="glm_moe_dsa")
    with pytest.raises(ValueError, match="import families.mla_moe first"):
        GLMConfig.from_hf({"model_type": "glm4_moe_lite"})
