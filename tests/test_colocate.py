"""colocate.py and the engine calls it uses (TorchEngine.release / share): the handoff really frees and restores
memory, observably on CPU. The KV pool goes, the engine's unshared weights shrink to nothing until a publish refills
them, the learner's masters and AdamW state leave and come back bit for bit, and generation after a handoff is the
generation before it, with a bf16 engine beside an fp32 learner stepping under bf16 autocast. With LoRA the engine
decodes on the learner's base tensors themselves. Whole co-located runs (one process, two with FSDP2, resume after a
kill) are in test_train.py, against the split layout."""
import gc
import threading
import weakref

import pytest
import torch

from machinery import lora
from machinery.colocate import Handoff, offloaded_tensors
from machinery.engine import SamplingParams, TorchEngine
from machinery.lora import LoRAConfig
from model import GLM, GLMConfig

DSA = {"topk": 4, "heads": 2, "head_dim": 8, "rope_dim": 4, "pattern": "FS"}
PROMPTS = [[3, 9, 27, 4], [11, 8, 30, 2, 5, 17], [7, 7, 1]]
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=6)


def tiny(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return GLM(GLMConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=8, dsa=DSA)).cast_(dtype)  # (dsa.FP32_PARAMS stay fp32, as on a GPU)


def step(model, optimizer):
    """One AdamW step under bf16 autocast (fp32 masters): the optimizer then has state to offload."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.tensor([PROMPTS[1]])).float().logsumexp(-1).mean()
    loss.backward()
    optimizer.step()


def publish(engine, model, version):
    engine.update_weights(((n, p.detach().to(engine._params[n].dtype)) for n, p in model.named_parameters()), version)


def out(engine):
    return [(c.token_ids, c.logprobs) for c in engine.generate(PROMPTS, SAMPLING, seed=5)]


def test_the_handoff_frees_and_restores_both_halves_bit_for_bit():
    learner = tiny()
    optimizer = torch.optim.AdamW(learner.parameters(), lr=1e-3)
    step(learner, optimizer)
    engine = TorchEngine(tiny(seed=1, dtype=torch.bfloat16), max_batch=2)  # bf16 weights: the GPU's generator
    publish(engine, learner, 1)
    before = out(engine)
    pool = weakref.ref(engine.pool.k[0])
    hand = Handoff(engine, learner, optimizer, torch.device("cpu"), offload=True)
    saved = [t.clone() for t in offloaded_tensors(learner, optimizer)]
    assert len(saved) == len(list(learner.parameters())) + 3 * len(optimizer.state) > 0  # masters; m, v, step

    hand.to_generator()  # the learner's state leaves; its gradients are freed
    assert all(t.untyped_storage().nbytes() == 0 for t in offloaded_tensors(learner, optimizer))
    assert all(p.grad is None for p in learner.parameters())
    assert hand.stats["colocate/offloaded_gib"] * 2**30 == sum(t.numel() * t.element_size() for t in saved)
    assert out(engine) == before  # the engine generates on its own memory meanwhile

    hand.to_learner()  # the engine lets go of its pool and weights; the learner's state is back, bit for bit
    gc.collect()
    assert engine.pool is None and pool() is None
    assert all(p.untyped_storage().nbytes() == 0 for p in engine._params.values())
    assert all(torch.equal(a, b) for a, b in zip(offloaded_tensors(learner, optimizer), saved))
    step(learner, optimizer)  # the restored optimizer steps on (its state is read, not re-created)
    assert optimizer.state[next(learner.parameters())]["step"].item() == 2

    publish(engine, learner, 2)  # the publish brings the released weights back (new memory), then a new pool
    assert not engine.released and all(p.untyped_storage().nbytes() > 0 for p in engine._params.values())
    reference = TorchEngine(tiny(seed=2, dtype=torch.bfloat16), max_batch=2)  # never released: the same weights
    publish(reference, learner, 2)
    assert out(engine) == out(reference) != before


def test_resident_brings_the_state_back_for_a_checkpoint_then_out_again():
    learner = tiny()
    optimizer = torch.optim.AdamW(learner.parameters(), lr=1e-3)
    step(learner, optimizer)
    hand = Handoff(TorchEngine(tiny(seed=1), max_batch=2), learner, optimizer, torch.device("cpu"), offload=True)
    saved = {k: v.clone() for k, v in learner.state_dict().items()}
    hand.to_generator()
    with hand.resident():
        assert all(torch.equal(v, saved[k]) for k, v in learner.state_dict().items())
        optimizer.state_dict()  # what a checkpoint reads
    assert all(t.untyped_storage().nbytes() == 0 for t in offloaded_tensors(learner, optimizer))
    kept = Handoff(hand.engine, learner, optimizer, torch.device("cpu"), offload=False)  # train.offload: false
    hand.to_learner()
    kept.to_generator()
    assert all(t.untyped_storage().nbytes() > 0 for t in offloaded_tensors(learner, optimizer))


def test_release_waits_for_the_running_call_to_end():
    """An agent's session keeps its call running, with parked KV: release() drains it before the pool goes."""
    engine = TorchEngine(tiny(), max_batch=2)
    with engine.session(SAMPLING, longest=16) as call:
        call.submit(PROMPTS[0], 4, seed=1, key="trajectory")
        while call.busy:
            call.step()
        assert engine.parked  # its KV stays for the next turn
        releasing = threading.Thread(target=engine.release)
        releasing.start()
        releasing.join(timeout=0.5)
        assert releasing.is_alive() and engine.pool is not None  # not while the session runs
    releasing.join(timeout=10)
    assert not releasing.is_alive() and engine.pool is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: the base as a GPU's learner holds it
def test_with_lora_the_engine_decodes_on_the_learners_base_itself(dtype):
    """lora.share_base: the engine's base weights are the learner's tensors (no copy), release() keeps them, and an
    adapters-only publish refills the released adapters (fp32); the tokens are those of an engine with its own full
    copy."""
    cfg = LoRAConfig(rank=4)
    learner = lora.add(tiny(dtype=dtype), cfg)
    for _, p in lora.adapter_named(learner):
        p.data.normal_(0, 0.1)  # trained adapters
    engine = TorchEngine(lora.add(tiny(seed=1, dtype=dtype), cfg), max_batch=2)
    assert lora.share_base(engine, learner)
    base = {n: p for n, p in learner.named_parameters() if not n.endswith((".lora_A", ".lora_B"))}
    assert all(engine._params[n].data_ptr() == p.data_ptr() for n, p in base.items())
    engine.update_weights(lora.adapter_named(learner), 1)
    copy = TorchEngine(lora.add(tiny(seed=2, dtype=dtype), cfg), max_batch=2)
    publish(copy, learner, 1)
    want = out(copy)
    assert out(engine) == want
    engine.release()
    assert set(engine.released) == {n for n, _ in lora.adapter_named(learner)}  # the base stays: it is the learner's
    engine.update_weights(lora.adapter_named(learner), 2)
    assert out(engine) == want


def test_a_colocated_engine_is_made_without_weights_and_filled_by_the_first_publish(tmp_path):
    """engine.make_engine(empty=True): the model of the directory, no weights read or kept (every storage empty), so a
    co-located GPU holds the learner's weights alone at load; the engine refuses to generate until a publish fills
    every weight, then generates what an engine loaded from the directory does."""
    learner = tiny()
    learner.save_pretrained(str(tmp_path / "m"))
    empty = GLM.from_pretrained(str(tmp_path / "m"), weights=False)
    assert all(p.untyped_storage().nbytes() == 0 for p in empty.parameters())
    engine = TorchEngine(empty, max_batch=2)
    assert set(engine.released) == set(engine._params)
    with pytest.raises(RuntimeError, match="released and not all published back"):
        out(engine)
    publish(engine, learner, 1)
    assert out(engine) == out(TorchEngine(GLM.from_pretrained(str(tmp_path / "m")), max_batch=2))


# ----------------------------------------------------------------------------- an MoE model
# A tiny GLM-5-shaped model (glm_moe_dsa: MLA, DSA, layers [dense, sparse, sparse], 4 routed experts top-2 and a
# shared expert). What the handoff moves is the same (parameters and AdamW state, the experts' [E, ...] tensors and
# the routers' fp32 weights among them); what is new is a state no publish carries: the routers' score-correction
# biases are buffers, frozen, which every generator loads from the checkpoint (from_pretrained, weights=False too).
# Every engine below is built from the learner's own seed, as a real one loads the learner's checkpoint.

MOE = dict(model_type="glm_moe_dsa", vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
           num_kv_heads=4, dsa=DSA, mla=dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                             v_head_dim=8),
           moe=dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                    routed_scaling_factor=2.5, mlp_layer_types=["dense", "sparse", "sparse"]))


def tiny_moe(dtype=torch.float32):
    torch.manual_seed(0)
    model = GLM(GLMConfig(**MOE))
    with torch.no_grad():  # the routers' biases away from zero: a generator without them would route otherwise
        for name, b in model.named_buffers():  # (on bf16's grid: GLM.cast_ rounds model.FP32_PARAMS through dtype)
            b.add_(torch.randn_like(b) * 0.5).copy_(b.bfloat16())
    return model.cast_(dtype)


def moe_out(engine):
    """Tokens, logprobs and (once the engine records them) each completion's routes."""
    return [(c.token_ids, c.logprobs, None if c.routes is None else c.routes.tolist())
            for c in engine.generate(PROMPTS, SAMPLING, seed=5)]


def test_an_moe_handoff_frees_and_restores_both_halves_bit_for_bit():
    """As the dense test above, with the MoE model: the experts' [E, ...] tensors, the routers' fp32 weights and their
    AdamW state leave and come back bit for bit; a released engine refilled by a publish generates (tokens,
    logprobs, routes) as an engine never released, with the routers' biases, which no publish carries, intact."""
    learner = tiny_moe()
    optimizer = torch.optim.AdamW(learner.parameters(), lr=1e-2)
    step(learner, optimizer)
    engine = TorchEngine(tiny_moe(torch.bfloat16), max_batch=2)
    assert engine._params["layers.1.mlp.gate.weight"].dtype == torch.float32
    publish(engine, learner, 1)
    before = moe_out(engine)
    hand = Handoff(engine, learner, optimizer, torch.device("cpu"), offload=True)
    saved = [t.clone() for t in offloaded_tensors(learner, optimizer)]
    experts = learner.layers[1].mlp.experts.gate_up_proj
    assert any(t.data_ptr() == experts.data_ptr() for t in offloaded_tensors(learner, optimizer))

    with torch.autocast("cpu", dtype=torch.bfloat16):  # a step that skips its optimizer step keeps its bf16 copies
        learner(torch.tensor([PROMPTS[1]]))
    casts = learner.layers[1].mlp.experts.casts
    assert casts.copies
    hand.to_generator()
    assert all(t.untyped_storage().nbytes() == 0 for t in offloaded_tensors(learner, optimizer))
    assert not casts.copies  # ... which the handoff frees: the generate phase's plan holds none
    assert moe_out(engine) == before

    hand.to_learner()
    assert all(p.untyped_storage().nbytes() == 0 for p in engine._params.values())
    bias = engine.model.layers[1].mlp.gate.e_score_correction_bias  # a buffer: not released, not published
    assert torch.equal(bias, learner.layers[1].mlp.gate.e_score_correction_bias) and bias.abs().sum() > 0
    assert all(torch.equal(a, b) for a, b in zip(offloaded_tensors(learner, optimizer), saved))
    step(learner, optimizer)

    publish(engine, learner, 2)
    reference = TorchEngine(tiny_moe(torch.bfloat16), max_batch=2)
    publish(reference, learner, 2)
    assert moe_out(engine) == moe_out(reference) != before


def test_a_colocated_moe_engine_made_without_weights_loads_the_routers_biases(tmp_path):
    """make_engine(empty=True) with an MoE checkpoint: no parameter read or kept, but the routers' score-correction
    biases (buffers) read from the checkpoint, since no publish brings them; after the first publish it generates
    what an engine loaded from the directory does."""
    learner = tiny_moe()
    learner.save_pretrained(str(tmp_path / "m"))
    empty = GLM.from_pretrained(str(tmp_path / "m"), weights=False)
    assert all(p.untyped_storage().nbytes() == 0 for p in empty.parameters())
    for name, b in learner.named_buffers():
        assert torch.equal(empty.get_buffer(name), b), name
    engine = TorchEngine(empty, max_batch=2)
    publish(engine, learner, 1)
    assert moe_out(engine) == moe_out(TorchEngine(GLM.from_pretrained(str(tmp_path / "m")), max_batch=2))


def test_with_lora_an_moe_engine_decodes_on_the_learners_base_itself():
    """lora.share_base with an MoE model: the engine's base weights (experts and routers included) are the learner's
    tensors; an adapters-only publish after a release gives the tokens of an engine with its own full copy."""
    cfg = LoRAConfig(rank=4)
    learner = lora.add(tiny_moe(), cfg)
    for _, p in lora.adapter_named(learner):
        p.data.normal_(0, 0.1)
    engine = TorchEngine(lora.add(tiny_moe(), cfg), max_batch=2)
    assert lora.share_base(engine, learner)
    assert engine._params["layers.1.mlp.experts.down_proj"].data_ptr() == learner.layers[1].mlp.experts.down_proj.data_ptr()
    engine.update_weights(lora.adapter_named(learner), 1)
    copy = TorchEngine(lora.add(tiny_moe(), cfg), max_batch=2)
    publish(copy, learner, 1)
    want = moe_out(copy)
    assert moe_out(engine) == want
    engine.release()
    assert set(engine.released) == {n for n, _ in lora.adapter_named(learner)}
    engine.update_weights(lora.adapter_named(learner), 2)
    assert moe_out(engine) == want
