"""Tests for parallel.py: the non-finite guard's count of skipped steps and the micro-batch evening in one process;
under torchrun with 2 CPU ranks (gloo), FSDP2's sharded loading and an MoE model's learner step against one
process. (Whole multi-process runs are in tests/test_train.py.)"""
import os
import subprocess
import sys

import pytest
import torch

from torch.distributed.fsdp import MixedPrecisionPolicy

from machinery import parallel
from families.mla_moe import Routing
from model import FP32_PARAMS, GLM, GLMConfig


def test_skips_in_a_row_stop_with_one_line(capsys):
    """Each skipped step says why in one console line, as does an RL step with nothing to train on; `limit` skips in
    a row stop the run with one line."""
    skips = parallel.Skips(limit=3)
    for step in range(1, 3):
        skips.update("rl", step, {"train/skipped": 1.0, "train/loss": float("nan"), "train/grad_norm": 1.0})
    skips.update("rl", 3, {"train/skipped": 0.0})  # a good step resets the run
    assert (skips.total, skips.run) == (2, 0)
    for step in range(4, 6):
        skips.update("rl", step, {"train/skipped": 1.0, "train/loss": 1.0, "train/grad_norm": float("inf")})
    with pytest.raises(FloatingPointError) as e:
        skips.update("rl", 6, {"train/skipped": 1.0, "train/loss": 1.0, "train/grad_norm": float("inf")})
    assert str(e.value).startswith("rl step 6: grad_norm inf for 3 steps in a row") and "\n" not in str(e.value)
    skips.update("rl", 7, {"staleness/dropped": 4})  # rl_step returned early: every sample stale
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("[train] rl step 1 skipped, no weight changed: loss nan not finite (1 in a row; "
                        "optim.max_skipped_steps: 3 in a row stop the run)")
    assert len(lines) == 5 and "rl step 5 skipped, no weight changed: grad_norm inf not finite (2 in a row" in lines[3]
    assert lines[4] == "[train] rl step 7 trained nothing: no sample of its batch was left (stale, failed or masked)"


def test_micro_batches_in_one_process_are_the_groups():
    assert parallel.micro_batches(None, [[0, 1], [2]]) == [(0, [0, 1]), (1, [2])]
    assert parallel.combine_ranks({"train/tokens": 5, "train/loss": 1.5}) == {"train/tokens": 5, "train/loss": 1.5}


def test_a_micro_batchs_probe_is_a_spread_of_its_samples_with_their_tokens_and_routes():
    """MicroBatch.probe(n): every ceil(B/n)-th sample (packing put the longest first), with its rows, routes and the
    positions of its scored tokens, in the flat tensors and among the micro-batch's own, as packing them alone gives."""
    lengths = [9, 4, 7, 3, 8, 5, 6]  # sample i: i + 2 prompt tokens, then lengths[i] scored ones
    rows = [(list(range(i + 2 + n)), [(i + 2, n)]) for i, n in enumerate(lengths)]
    routes = [torch.full((i + 1 + n, 2, 2), i, dtype=torch.uint8) for i, n in enumerate(lengths)]
    ((_, mb),) = parallel.packed_micro_batches(None, rows, 10**6, "cpu", routes)
    probe, mine = mb.probe(3)  # 7 samples: every 3rd, so 3 of them
    assert probe.samples == mb.samples[::3] and probe.rows == [rows[i] for i in probe.samples]
    assert [int(r[0, 0, 0]) for r in probe.routes] == probe.samples
    first = [sum(lengths[:i]) for i in range(len(lengths))]  # where sample i's tokens start in the flat tensors
    assert probe.tokens.tolist() == [first[i] + j for i in probe.samples for j in range(lengths[i])]
    assert torch.equal(mb.tokens[mine], probe.tokens)
    assert probe.mask.sum(1).tolist() == [lengths[i] for i in probe.samples]
    assert mb.probe(100)[0].samples == mb.samples and torch.equal(mb.probe(100)[1], torch.arange(sum(lengths)))


def test_a_micro_batch_replays_the_samples_with_routes_and_routes_the_others_afresh():
    """MicroBatch.routing on a micro-batch where some samples carry no generator routes: the replay row [n_moe, 1, L,
    k] holds each recorded sample's routes (then NO_ROUTE for its last, never fed token) and NO_ROUTE at every token of
    the others (the router's own choice, token by token), written out here; with no routes at all an MoE model's
    micro-batch (route_shape from the model) still gets a Routing, all NO_ROUTE, and a dense model's none."""
    lengths = [5, 3, 4]  # sample i: 2 prompt tokens, then lengths[i] scored ones
    rows = [([7] * (2 + n), [(2, n)]) for n in lengths]
    routes = [torch.full((1 + lengths[0], 2, 3), 10, dtype=torch.uint8), None,
              torch.arange(2 * 3 * (1 + lengths[2]), dtype=torch.uint8).view(1 + lengths[2], 2, 3)]
    ((_, mb),) = parallel.packed_micro_batches(None, rows, 10**6, "cpu", routes)  # (no model: route_shape from routes)
    assert mb.samples == [0, 2, 1] and mb.unrecorded() == 1
    routing = mb.routing(True)
    none = lambda n: torch.full((n, 2, 3), 255, dtype=torch.uint8)  # noqa: E731 - uint8's NO_ROUTE
    want = torch.cat([routes[0], none(1), routes[2], none(1), none(2 + lengths[1])])  # packed order: 0, 2, 1
    assert routing.apply and torch.equal(routing.replay, want.permute(1, 0, 2)[:, None])
    assert not mb.routing(False).apply
    model = GLM(GLMConfig(**MOE))  # 2 MoE layers, top-2 of 5 experts
    ((_, mb),) = parallel.packed_micro_batches(model, rows, 10**6, "cpu", [None] * 3)
    assert mb.unrecorded() == 3 and mb.route_shape == (2, 2, torch.uint8)
    assert torch.equal(mb.routing(True).replay, torch.full((2, 1, sum(lengths) + 6, 2), 255, dtype=torch.uint8))
    ((_, mb),) = parallel.packed_micro_batches(None, rows, 10**6, "cpu", [None] * 3)  # a dense model's samples
    assert mb.routing(True) is None and mb.probe(2)[0].routing(True) is None


# ----------------------------------------------------------------------------- loading sharded
# torchrun with gloo on the CPU: each of 2 FSDP ranks loads only its rows of every tensor
# (parallel.load_learner); gathered, the model must equal one process's from_pretrained, bit for bit.
# This file is the worker: `torchrun ... tests/test_parallel.py DIR`. One torchrun serves every test below (a
# module fixture): the dense loading cases, then the MoE step.

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
DSA = {"topk": 4, "heads": 2, "head_dim": 8, "rope_dim": 4, "pattern": "FS"}
# A tiny GLM-5-shaped model (glm_moe_dsa: MLA, DSA, a dense layer then two MoE layers) whose 5 experts and
# 5-row routers 2 ranks split unevenly (3 + 2)
MOE = dict(model_type="glm_moe_dsa", vocab_size=37, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
           num_kv_heads=4, eos_token_id=[1], pad_token_id=0, dsa=DSA,
           mla=dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
           moe=dict(n_routed_experts=5, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                    routed_scaling_factor=2.5, mlp_layer_types=["dense", "sparse", "sparse"]))


def save_tiny(path, dsa, tied):
    """A 3-layer model whose tensors have row counts that 2 ranks split unevenly (vocab 37, kv 2x8)."""
    torch.manual_seed(0)
    cfg = GLMConfig(vocab_size=37, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                    head_dim=8, eos_token_id=[1], pad_token_id=0, dsa=dsa, tie_word_embeddings=tied)
    distinct(GLM(cfg)).save_pretrained(path)


def distinct(model):
    """Every tensor distinct (norms, biases and the routers' score-correction biases included)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.1)
    return model


def load(ckpt, dsa):
    torch.manual_seed(1)  # what train.py does before loading: a fresh indexer's init draws from it
    return parallel.load_learner(ckpt, dsa, torch.device("cpu"), "fsdp")


CASES = [(DSA, None, False), (None, DSA, False), (None, None, True)]  # (saved, loaded, tied)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """DIR after one torchrun of 2 ranks over DIR/ckpt<i> (CASES) and DIR/moe: DIR/weights<i>.pt, DIR/moe_step.pt."""
    out = tmp_path_factory.mktemp("ranks")
    for i, (saved, _, tied) in enumerate(CASES):
        save_tiny(str(out / f"ckpt{i}"), saved, tied)
    torch.manual_seed(0)
    distinct(GLM(GLMConfig(**MOE))).save_pretrained(str(out / "moe"))
    p = subprocess.run([*TORCHRUN, "tests/test_parallel.py", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=os.environ | {"PYTHONPATH": ROOT})
    assert p.returncode == 0, p.stderr[-3000:]
    return out


def test_two_fsdp_ranks_load_only_their_shards_and_match_one_process(two_ranks):
    """(saved, loaded, tied): a DSA checkpoint as is; a dense one turned DSA (fresh indexers, drawn whole from the
    seed on every rank, each keeping its rows); tied embeddings. One torchrun loads all three."""
    for i, (_, loaded, _) in enumerate(CASES):
        two = torch.load(str(two_ranks / f"weights{i}.pt"))
        one = dict(load(str(two_ranks / f"ckpt{i}"), loaded).named_parameters())
        assert set(two) == set(one)
        for name in one:
            assert torch.equal(two[name], one[name].detach()), (i, name)


# ----------------------------------------------------------------------------- an MoE model under FSDP2
# One learner step of the tiny MoE model (MOE), rank r of 2 on rows 2r, 2r+1 of a fixed batch of 4, against one
# process on all 4: the same routes, loss, full gradients and stepped weights (float tolerance, max |two - one| over
# max |one| per tensor < 1e-5: the ranks' partial sums add in another order; measured up to 1.7e-6 for the
# gradients, the embeddings' (the largest, summed over every layer's path)). The experts load expert-sharded (each
# rank reads its own experts' files) and shard along dim 0; each router is an FSDP unit of its own, gathered in fp32
# where the rest of its layer is gathered in bf16 (checked with the GPU's policy forced on the CPU).

BATCH = torch.randint(2, 37, (4, 12), generator=torch.Generator().manual_seed(3))


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def moe_step(model):
    """SGD at lr 0.5 on this rank's rows of BATCH (next-token NLL summed over the global batch's 44 targets). Returns
    {"loss", "routes" (per MoE layer [B, T, k] of this rank's rows), "grads", "weights"} with full tensors."""
    for name, p in model.named_parameters():  # what RL trains: everything but the indexer (lora.rl_trainable)
        p.requires_grad_(".indexer." not in name)
    rows = BATCH if parallel.world() == 1 else BATCH[2 * parallel.rank():2 * parallel.rank() + 2]
    routing = Routing(record=True)
    logits = model(rows, routing=routing)
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), rows[:, 1:].flatten(), reduction="sum")
    parallel.learner_backward(model, nll / BATCH[:, 1:].numel(), last=True)
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731 - (a collective under FSDP)
    grads = {n: full(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5).step()
    return {"loss": parallel.global_sum(nll.item())[0] / BATCH[:, 1:].numel(), "grads": grads,
            "routes": [r.clone() for r in routing.chosen],
            "weights": {n: t.clone() for n, t in parallel.full_weights(model)}}


def test_an_moe_model_under_fsdp_steps_as_one_process(two_ranks):
    two = torch.load(str(two_ranks / "moe_step.pt"))
    one = moe_step(load(str(two_ranks / "moe"), None))
    assert [r.shape for r in one["routes"]] == [(4, 12, 2)] * 2
    for j, routes in enumerate(one["routes"]):  # each rank's rows took the experts one process's did
        assert torch.equal(torch.cat([two["routes0"][j], two["routes1"][j]]), routes)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6)
    assert set(two["grads"]) == set(one["grads"]) and "layers.1.mlp.gate.weight" in one["grads"]
    assert "layers.1.mlp.experts.gate_up_proj" in one["grads"] and not any(".indexer." in n for n in one["grads"])
    for name, g in one["grads"].items():
        assert rel_err(two["grads"][name], g) < 1e-5, name
    start = dict(load(str(two_ranks / "moe"), None).named_parameters())
    assert (one["weights"]["layers.2.mlp.gate.weight"] - start["layers.2.mlp.gate.weight"]).abs().max() > 1e-4
    for name, w in one["weights"].items():
        assert rel_err(two["weights"][name], w) < 1e-5, name
    # what the ranks published to a bf16 generator: their own stepped weights, in bf16 but the routers' (fp32)
    published = two["published"]
    assert set(published) == set(one["weights"])
    for name, t in published.items():
        want = two["weights"][name]
        assert torch.equal(t, want if name.endswith(FP32_PARAMS) else want.to(torch.bfloat16)), name
    assert {n for n, t in published.items() if t.dtype == torch.float32} == {
        f"layers.{i}.{n}" for i in (0, 2) for n in ("self_attn.indexer.weights_proj.weight",
                                                     "self_attn.indexer.k_norm.weight", "self_attn.indexer.k_norm.bias")
    } | {f"layers.{i}.mlp.gate.weight" for i in (1, 2)}
    # the GPU's policy (bf16 gathers) forced: inside the forward a router's weight is whole and fp32, the
    # experts beside it whole and bf16
    assert two["gathered"] == {"router": (torch.float32, (5, 32)), "experts": (torch.bfloat16, (5, 32, 32))}


if __name__ == "__main__":  # the worker: tests/test_parallel.py DIR (DIR/ckpt<i> -> DIR/weights<i>.pt; DIR/moe)
    parallel.init_processes(torch.device("cpu"))
    for i, (_, loaded, tied) in enumerate(CASES):
        model = load(os.path.join(sys.argv[1], f"ckpt{i}"), loaded)
        # each rank holds only its rows: its local shards add up to about half of the model
        local = sum(p.to_local().numel() for p in model.parameters())
        assert local < 0.6 * sum(p.numel() for p in model.parameters()), local
        assert tied == (model.lm_head.weight is model.embed_tokens.weight)
        full = {k: v.clone() for k, v in parallel.full_weights(model)}
        if parallel.rank() == 0:
            torch.save(full, os.path.join(sys.argv[1], f"weights{i}.pt"))

    moe = os.path.join(sys.argv[1], "moe")
    model = load(moe, None)
    experts = model.layers[1].mlp.experts.gate_up_proj
    assert experts.to_local().shape[0] == (3, 2)[parallel.rank()]  # rank r holds experts 3r..: dim 0 sharded
    result = moe_step(model)
    result["published"] = {n: t.clone() for n, t in parallel.full_weights(model, torch.bfloat16)}
    routes = parallel.all_gather(result.pop("routes"))
    result.update(routes0=routes[0], routes1=routes[1])

    parallel.gather_policy = lambda device: MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                 reduce_dtype=torch.float32)  # a GPU's
    model, gathered = load(moe, None), {}
    mlp = model.layers[1].mlp
    seen = lambda key, t: gathered.setdefault(key, (t.dtype, tuple(t.shape))) and None  # noqa: E731 - (None: args kept)
    mlp.gate.register_forward_pre_hook(lambda m, _: seen("router", m.weight))
    mlp.register_forward_pre_hook(lambda m, _: seen("experts", m.experts.gate_up_proj))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # (the learner's autocast, as on a GPU)
        model(BATCH[:2])
    result["gathered"] = gathered
    if parallel.rank() == 0:
        torch.save(result, os.path.join(sys.argv[1], "moe_step.pt"))
    # Both ranks leave together: a rank that tore gloo down while the other was still saving aborted once in CI
    # ("terminate called without an active exception", SIGABRT, on 2 busy cores)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
