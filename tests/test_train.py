"""Tests for train.py: config loading and validation, the learner's packed logprobs against the
generator's, one RL step in-process (staleness filter, on-policy check, micro-batch gradients), short
end-to-end runs of the tiny config in a subprocess (metrics, checkpoints, Ctrl-C, resume after a kill),
and several processes (torchrun, gloo on CPU) against one: RL steps on a fixed global batch with DDP and
FSDP2, the warm-up stages end to end, and checkpoint/resume with 2 processes.

This file is also the worker of the RL-step test: `torchrun ... tests/test_train.py OUT PARALLEL AGG`."""
import copy
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from machinery import checkpoint
from machinery import lora
from machinery import config
import data
import dsa
from machinery import env
import grpo
from machinery import parallel
from machinery import variants
import train
from machinery.engine import SamplingParams, TorchEngine
from machinery.teacher import Teacher
from model import GLM, GLMConfig
from rollout import RolloutBatch, Sample

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
GLM9B = os.path.join(ROOT, "configs", "glm9b_math.yaml")
DICT_KEYS = {"model.init", "model.dsa"}  # free-form mappings, checked by GLMConfig / DSAConfig

# A few seconds per run: a smaller model, every stage a few steps, a checkpoint every 2 steps.
FAST = ["model.init.hidden_size=32", "model.init.intermediate_size=64", "model.init.num_layers=2",
        "model.init.head_dim=8", "train.dsa_warmup_steps=2", "train.sft_steps=4", "train.rl_steps=4",
        "train.warmup_batch_size=16", "rollout.prompts_per_step=4", "rollout.n=4", "train.eval_every=2",
        "train.eval_n=2", "data.eval_size=8", "train.save_every=2", "train.keep_checkpoints=20",
        "optim.warmup_steps=2"]


# ----------------------------------------------------------------------------- learner vs generator


def tiny_model(seed=0, topk=4, vocab=len(data.make_tiny_tokenizer())):
    torch.manual_seed(seed)
    cfg = GLMConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                    num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, eos_token_id=[1], pad_token_id=0,
                    dsa={"topk": topk, "heads": 2, "head_dim": 8, "rope_dim": 4, "pattern": "FS"})
    model = GLM(cfg)
    with torch.no_grad():  # sharper than the 0.02 init, so probabilities and top-k choices differ
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


@pytest.fixture(scope="module")
def rollouts():
    """A learner model, an engine holding an identical copy, and completions sampled from it."""
    tok = data.make_tiny_tokenizer()
    model = tiny_model()
    engine = TorchEngine(copy.deepcopy(model), max_batch=8)
    prompts = [data.render_prompt(tok, ex["prompt"]) for ex in data.synthetic_task(6, seed=1)] + [[4, 9], [4, 9, 9, 9, 9]]
    sampling = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=12, stop_token_ids=(1,))
    comps = engine.generate([p for p in prompts for _ in range(2)], sampling, seed=3)  # groups of 2
    return model, engine, [p for p in prompts for _ in range(2)], comps


def test_packed_logprobs_match_generator(rollouts):
    """The learner's packed forward (several samples per row, positions restarting at 0) gives the
    generator's logprobs: same tokens, same temperature, same DSA top-k, full distribution (top-p aside)."""
    model, _, prompts, comps = rollouts
    assert max(len(p) + len(c.token_ids) for p, c in zip(prompts, comps)) > 4  # top-k 4: attention is sparse
    rows = [(p + c.token_ids, [(len(p), len(c.token_ids))]) for p, c in zip(prompts, comps)]
    with torch.no_grad():
        for mb in data.pack_by_tokens([len(s) for s, _ in rows], 60):
            logp, _, _, _ = train.packed_forward(model, [rows[i] for i in mb], temperature=0.7)
            for i, lp in zip(mb, logp.split([len(comps[i].token_ids) for i in mb])):
                assert len(lp) == len(comps[i].token_ids)
                assert (lp - torch.tensor(comps[i].logprobs)).abs().max() < 1e-4


def make_batch(prompts, comps, versions, n=2):
    samples = [Sample(p, c.token_ids, c.logprobs, float(i % 3 == 0), i // n, v, c.finish_reason, {})
               for i, (p, c, v) in enumerate(zip(prompts, comps, versions))]
    return RolloutBatch(samples, index=0, stream_state={}, metrics={})


def rl_setup(model, **overrides):
    overrides = {"rollout.temperature": 0.7} | overrides
    cfg = config.load_config(TINY, [f"{k}={v}" for k, v in overrides.items()])
    return cfg, torch.optim.AdamW(p for n, p in model.named_parameters() if ".indexer." not in n), grpo.KLGuard()


def test_rl_step_on_policy_and_staleness_filter(rollouts):
    model, _, prompts, comps = rollouts
    learner = copy.deepcopy(model)
    cfg, opt, guard = rl_setup(learner, **{"rollout.max_staleness": 1})
    # Learner at version 5: samples from versions 5 and 4 are fresh, one touched by version 3 is not.
    versions = [(5, 5)] * 8 + [(4, 5)] * 6 + [(3, 5)] + [(4, 4)]
    m = train.rl_step(cfg, learner, None, opt, guard, make_batch(prompts, comps, versions), version=5)
    assert m["staleness/dropped"] == 1 and m["staleness/max"] == 1 and m["train/samples"] == 15
    # Same weights as the generator, so the learner's own forward (pi_prox) is the generator's logprobs.
    assert m["train/logp_diff_max"] < 1e-4
    assert m["train/ratio_mean"] == pytest.approx(1.0, abs=1e-5)


def test_masked_samples_count_in_their_group_baseline_but_not_in_the_loss(rollouts):
    """rollout.truncated: mask. A masked sample's reward stays in its group's mean and std, but it is out of the
    loss: the gradient is that of the clipped loss over the other samples alone, with the advantages of the
    whole groups, every denominator counting only them."""
    model, _, prompts, comps = rollouts
    batch = make_batch(prompts, comps, [(0, 0)] * len(comps))
    masked = {0, 5, 9}  # the first of a rewarded group, the second of another, one of a uniform group
    for i in masked:
        batch.samples[i].masked = True
    learner = copy.deepcopy(model)
    cfg, opt, guard = rl_setup(learner, **{"grpo.agg": "seq-mean-token-mean", "optim.grad_clip": 1e9})  # grads unclipped
    m = train.rl_step(cfg, learner, None, opt, guard, batch, version=0)
    assert m["train/masked"] == 3 and m["train/samples"] == len(comps) - 3
    got = torch.cat([p.grad.flatten() for p in learner.parameters() if p.grad is not None])
    # The reference, written out: advantages over the full groups, the loss over the kept samples only
    ref_model = copy.deepcopy(model)
    rewards = torch.tensor([s.reward for s in batch.samples], dtype=torch.float64)
    adv = grpo.group_advantages(rewards, 2)
    keep = [i for i in range(len(comps)) if i not in masked]
    per_sample = []
    for i in keep:
        s = batch.samples[i]
        logp, _, _, _ = train.packed_forward(ref_model, [s.row()], 0.7)
        ratio = torch.exp(logp - torch.tensor(s.gen_logprobs))
        clipped = torch.maximum(-adv[i] * ratio, -adv[i] * ratio.clamp(1 - 0.2, 1 + 0.28))
        w = torch.exp(logp.detach() - torch.tensor(s.gen_logprobs))
        per_sample.append((clipped * ((w >= 0.5) & (w <= 2.0))).mean())
    (torch.stack(per_sample).sum() / len(keep)).backward()
    want = torch.cat([p.grad.flatten() for p in ref_model.parameters() if p.grad is not None])
    torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("agg", grpo.AGG_MODES)
def test_micro_batches_sum_to_the_full_batch_gradient(rollouts, agg):
    model, _, prompts, comps = rollouts
    batch = make_batch(prompts, comps, [(0, 0)] * len(comps))
    grads = []
    for budget in (20, 10_000):  # many packed rows vs. one
        learner = copy.deepcopy(model)
        cfg, opt, guard = rl_setup(learner, **{"optim.max_tokens_per_micro_batch": budget, "grpo.agg": agg})
        train.rl_step(cfg, learner, None, opt, guard, batch, version=0)
        grads.append(torch.cat([p.grad.flatten() for p in learner.parameters() if p.grad is not None]))
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-7)


def test_an_rl_step_trains_the_mtp_layer_on_its_tokens_and_leaves_the_policy_gradient_to_grpo(rollouts):
    """model.mtp_layers: the MTP layer learns to draft the batch's model tokens (families/mtp.mtp_loss over one packed
    row of the trained samples, scaled by model.mtp_loss_scale), while every other weight gets exactly the gradient of
    a step without it (the trunk detached); model.mtp_loss_scale 0 freezes the layer (no gradient at all)."""
    from families import mtp
    _, _, prompts, comps = rollouts
    base = tiny_model()
    torch.manual_seed(1)
    model = GLM(GLMConfig(**{**base.cfg.__dict__, "mtp_layers": 1}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(base.get_parameter(name) if not name.startswith("mtp.") else p + torch.randn_like(p) * 0.2)
    batch = make_batch(prompts, comps, [(0, 0)] * len(comps))
    grads = {}
    for scale, clip in ((0.2, 1e9), (0.0, 1e9), (0.2, 1e-3), (0.0, 1e-3)):  # (a tight clip: each part clipped apart)
        learner = copy.deepcopy(model)
        cfg, opt, guard = rl_setup(learner, **{"model.mtp_loss_scale": scale, "optim.grad_clip": clip})
        m = train.rl_step(cfg, learner, None, opt, guard, batch, version=0)
        grads[scale, clip] = {n: p.grad for n, p in learner.named_parameters()}
        assert ("train/mtp_loss" in m) == (scale > 0) and (m["train/mtp_grad_norm"] > 0) == (scale > 0)
    for clip in (1e9, 1e-3):
        trunk = [n for n, g in grads[0.0, clip].items() if not n.startswith("mtp.") and g is not None]
        assert trunk and all(grads[0.0, clip][n] is None for n in grads[0.0, clip] if n.startswith("mtp."))
        for n in trunk:  # the policy's gradient is GRPO's alone
            torch.testing.assert_close(grads[0.2, clip][n], grads[0.0, clip][n], rtol=1e-5, atol=1e-8)
    grads = grads[0.2, 1e9]
    # The MTP layer's: the gradient of mtp_loss over the samples packed in one row (one micro-batch here)
    ref = copy.deepcopy(model)
    rows = [s.row() for s in batch.samples]
    ids = torch.tensor([t for seq, _ in rows for t in seq])[None]
    pos = torch.cat([torch.arange(len(seq)) for seq, _ in rows])[None]
    mask = torch.zeros_like(ids, dtype=torch.bool)
    at = 0
    for seq, spans in rows:
        for a, n in spans:
            mask[0, at + a:at + a + n] = True
        at += len(seq)
    trunk_hidden = ref(ids, position_ids=pos, return_hidden="trunk")
    mtp.mtp_loss(ref, trunk_hidden, ids, mask, pos, detach_trunk=True, scale=0.2, temperature=0.7).backward()  # (rollout)
    mtp_names = [n for n in grads if n.startswith("mtp.") and grads[n] is not None]
    assert mtp_names and any(grads[n].abs().max() > 0 for n in mtp_names)
    for n in mtp_names:
        torch.testing.assert_close(grads[n], ref.get_parameter(n).grad, rtol=1e-4, atol=1e-7)


def test_an_rl_step_with_an_mtp_layer_under_bf16_autocast(rollouts, monkeypatch):
    """The GPU's dtypes (fp32 masters under bf16 autocast): the MTP loss is finite and trains the MTP layer, and every
    other weight's gradient is the step's without it, to bf16's rounding (the trunk's last block runs every position)."""
    _, _, prompts, comps = rollouts
    base = tiny_model()
    model = GLM(GLMConfig(**{**base.cfg.__dict__, "mtp_layers": 1}))
    model.load_state_dict(base.state_dict(), strict=False)
    batch = make_batch(prompts, comps, [(0, 0)] * len(comps))
    for module in (train, variants):
        monkeypatch.setattr(module, "autocast", lambda device: torch.autocast("cpu", dtype=torch.bfloat16))
    grads = {}
    for scale in (0.2, 0.0):
        learner = copy.deepcopy(model)
        cfg, opt, guard = rl_setup(learner, **{"model.mtp_loss_scale": scale, "optim.grad_clip": 1e9})
        m = train.rl_step(cfg, learner, None, opt, guard, batch, version=0)
        assert m["train/skipped"] == 0.0 and math.isfinite(m["train/loss"])
        grads[scale] = {n: p.grad for n, p in learner.named_parameters() if p.grad is not None}
    assert 0 < m["train/grad_norm"] and math.isfinite(grads[0.2]["mtp.3.eh_proj.weight"].norm())
    assert grads[0.2]["mtp.3.eh_proj.weight"].abs().max() > 0 and "mtp.3.eh_proj.weight" not in grads[0.0]
    for n, g in grads[0.0].items():
        assert (grads[0.2][n] - g).norm() <= 2e-2 * g.norm() + 1e-8, n


def test_a_non_finite_step_is_skipped_and_changes_nothing(rollouts):
    model, _, prompts, comps = rollouts
    learner = copy.deepcopy(model)
    cfg, opt, guard = rl_setup(learner)
    before = {k: v.clone() for k, v in learner.state_dict().items()}
    batch = make_batch(prompts, comps, [(0, 0)] * len(comps))
    batch.samples[0].reward = float("nan")  # a grader returning NaN: the advantages of its group are NaN
    m = train.rl_step(cfg, learner, None, opt, guard, batch, version=0)
    assert m["train/skipped"] == 1.0 and not math.isfinite(m["train/loss"])
    assert all(torch.equal(v, learner.state_dict()[k]) for k, v in before.items())
    assert not opt.state and all(p.grad is None for p in learner.parameters())  # AdamW never saw it
    batch.samples[0].reward = 1.0
    m = train.rl_step(cfg, learner, None, opt, guard, batch, version=0)
    assert m["train/skipped"] == 0.0 and opt.state


def test_packed_logprobs_match_a_bf16_generator_under_autocast(rollouts):
    """The GPU's dtypes: the learner's fp32 master weights under bf16 autocast against a generator holding
    bf16 weights, with sparse attention (an indexer trained to imitate attention, as after the warm-up).
    Their logprob gap must stay near the dense model's own bf16 gap."""
    model, _, prompts, _ = rollouts
    model = copy.deepcopy(model)
    opt, g = torch.optim.Adam(model.indexer_parameters(), lr=1e-2), torch.Generator().manual_seed(0)
    for _ in range(60):  # the dense warm-up, in miniature
        _, kl = model(torch.randint(0, model.cfg.vocab_size, (4, 24), generator=g), indexer_loss="dense")
        opt.zero_grad()
        kl.backward()
        opt.step()
    gaps = {}
    for name, net in (("dsa", model), ("dense", GLM(GLMConfig(**{**model.cfg.__dict__, "dsa": None})))):
        if name == "dense":
            net.load_state_dict(model.state_dict(), strict=False)
        engine = TorchEngine(copy.deepcopy(net).cast_(torch.bfloat16), max_batch=16)
        comps = engine.generate(prompts, SamplingParams(temperature=0.7, max_new_tokens=12, stop_token_ids=(1,)), seed=3)
        rows = [(p + c.token_ids, [(len(p), len(c.token_ids))]) for p, c in zip(prompts, comps)]
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logp, _, _, _ = train.packed_forward(net, rows, temperature=0.7)
        gaps[name] = (logp - torch.tensor([x for c in comps for x in c.logprobs])).abs()
    assert max(len(p) + len(c.token_ids) for p, c in zip(prompts, comps)) > 4  # top-k 4: attention is sparse
    # measured: mean gap 0.004 (DSA) vs 0.011 (dense) nats; the worst token 0.69 vs 0.055 (one flipped key)
    assert gaps["dsa"].mean() < max(3 * gaps["dense"].mean(), 1e-2), (gaps["dsa"].mean(), gaps["dense"].mean())


def test_rl_step_under_bf16_autocast(rollouts, monkeypatch):
    """rl_step as it runs on a GPU (autocast bf16, fp32 master weights), DSA included: finite, and the
    same update as fp32 to bf16 precision."""
    model, _, prompts, comps = rollouts
    batch = make_batch(prompts, comps, [(0, 0)] * len(comps))
    grads = {}
    for dtype in ("fp32", "bf16"):
        if dtype == "bf16":
            monkeypatch.setattr(train, "autocast", lambda device: torch.autocast("cpu", dtype=torch.bfloat16))
            monkeypatch.setattr(variants, "autocast", lambda device: torch.autocast("cpu", dtype=torch.bfloat16))
        learner = copy.deepcopy(model)
        cfg, opt, guard = rl_setup(learner)
        m = train.rl_step(cfg, learner, None, opt, guard, batch, version=0)
        assert m["train/skipped"] == 0.0 and math.isfinite(m["train/loss"])
        grads[dtype] = torch.cat([p.grad.flatten() for p in learner.parameters() if p.grad is not None])
    cos = torch.nn.functional.cosine_similarity(grads["fp32"], grads["bf16"], dim=0)
    assert cos > 0.95, cos


class Echo:
    """A test env: the model's first turn gets an observation back, its second ends the episode."""
    tools = []

    def __init__(self, example):
        self.example, self.n = example, 0

    def reset(self):
        return [{"role": "user", "content": self.example["prompt"]}]

    def step(self, text):
        self.n += 1
        return ([] if self.n >= 2 else [{"role": "observation", "content": "obs " + text[:4]}]), float(len(text) % 2), \
            self.n >= 2


@pytest.fixture(scope="module")
def multi_turn():
    """A learner model and multi-turn samples its engine copy played with Echo: model turns, env tokens between."""
    tok = data.make_tiny_tokenizer(tools=True)
    model = tiny_model(vocab=len(tok))
    engine = TorchEngine(copy.deepcopy(model), max_batch=8)
    stops = tuple(sorted({tok.eos_token_id, *env.turn_ends(tok), *range(7, len(tok), 4)}))  # turns end early
    eps = [env.Episode({"prompt": p}, i) for i, p in enumerate(["1+2=", "3*4=", "5-6=", "7+8=", "9*9="]) for _ in range(2)]
    list(env.run_episodes(engine, eps, Echo, tok, SamplingParams(temperature=0.7, stop_token_ids=stops),
                          env.Limits(10, 60, 3), seed=1))
    samples = [Sample(ep.prompt, ep.response, ep.logprobs, ep.reward, k // 2, (0, 0), ep.finish, ep.example,
                      spans=ep.spans, turns=ep.turns) for k, ep in enumerate(eps)]
    assert sum(s.turns == 2 and len(s.response_ids) > len(s.gen_logprobs) for s in samples) >= 4  # env tokens inside
    return model, samples


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean"])
def test_multi_turn_loss_is_the_float64_loss_over_model_tokens_alone(multi_turn, agg, monkeypatch):
    """rl_step on trajectories with env tokens inside (packed, micro-batched) gives the gradient of a float64
    reference that runs each whole sequence unpacked and scores the model's tokens only: env tokens are
    context, never in lm_head, the loss or a denominator. fp32 to 1e-4; bf16 autocast to bf16 precision."""
    model, samples = multi_turn
    batch = RolloutBatch(samples, index=0, stream_state={}, metrics={})
    ref = copy.deepcopy(model).double()
    adv = grpo.group_advantages(torch.tensor([s.reward for s in samples], dtype=torch.float64), 2)
    terms, n_tokens = [], 0
    for s, a in zip(samples, adv):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logp = (ref(ids)[0].double() / 0.7).log_softmax(-1)
        where = torch.tensor([len(s.prompt_ids) + start + k for start, n in s.spans for k in range(n)])
        lp = logp[where - 1, ids[0, where]]  # position j - 1 predicts token j
        gen = torch.tensor(s.gen_logprobs, dtype=torch.float64)
        ratio = torch.exp(lp - gen)
        w = torch.exp(lp.detach() - gen)
        loss = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.28)) * ((w >= 0.5) & (w <= 2.0))
        terms.append(loss.mean() if agg == "seq-mean-token-mean" else loss.sum())
        n_tokens += len(lp)
    (torch.stack(terms).sum() / (len(samples) if agg == "seq-mean-token-mean" else n_tokens)).backward()
    want = torch.cat([p.grad.flatten() for p in ref.parameters() if p.grad is not None])
    for dtype in ("fp32", "bf16"):
        if dtype == "bf16":
            monkeypatch.setattr(train, "autocast", lambda device: torch.autocast("cpu", dtype=torch.bfloat16))
            monkeypatch.setattr(variants, "autocast", lambda device: torch.autocast("cpu", dtype=torch.bfloat16))
        learner = copy.deepcopy(model)
        cfg, opt, guard = rl_setup(learner, **{"grpo.agg": agg, "optim.grad_clip": 1e9, "optim.max_tokens_per_micro_batch": 40})
        m = train.rl_step(cfg, learner, None, opt, guard, batch, version=0)
        assert m["train/samples"] == len(samples) and m["train/skipped"] == 0.0
        got = torch.cat([p.grad.flatten() for p in learner.parameters() if p.grad is not None]).double()
        if dtype == "fp32":
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        else:
            # bf16 rounds every matmul (and can move a token across the clip or IcePop edges): the same update
            # to bf16 precision, where scoring one env token or one wrong denominator would not be
            assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.97
            assert (got - want).norm() < 0.25 * want.norm()


@pytest.mark.parametrize("outcome", [False, True])
def test_a_distillation_step_is_the_float64_loss_with_the_teachers_per_token_advantages(multi_turn, outcome):
    """rl_step with a teacher's logprobs on the samples (distill.teacher): the gradient of a float64 reference whose
    token advantages are coef * (log pi_teacher - log pi_theta), the policy's detached (+ the group's outcome
    advantage with distill.outcome), through the clipped surrogate and IcePop, env tokens scored by no one;
    train/distill_kl is the mean of log pi_theta - log pi_teacher over the model's tokens."""
    model, samples = multi_turn
    samples = with_a_teacher(samples)
    want, kl = float64_distill_gradient(model, samples, outcome, trained=[True] * len(samples))
    m, got = distill_step(model, samples, outcome)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert m["train/distill_kl"] == pytest.approx(kl, abs=1e-5)


def with_a_teacher(samples):
    """Copies of the samples with a teacher's logprobs that disagree with the generator's by ~0.5 nats a token."""
    g = torch.Generator().manual_seed(5)
    samples = [copy.copy(s) for s in samples]
    for s in samples:
        s.teacher_logprobs = (torch.tensor(s.gen_logprobs) + 0.5 * torch.randn(len(s.gen_logprobs), generator=g)).tolist()
    return samples


def float64_distill_gradient(model, samples, outcome, trained, coef=0.5):
    """(the float64 gradient of a distillation step's loss over the trained samples, seq-mean-token-mean, the mean
    of log pi_theta - log pi_teacher over their tokens): token advantages coef * (log pi_teacher - log pi_theta) (+
    the group's outcome advantage with outcome: True, or "not cut", where a cut sample's is 0), the groups' advantages
    over every sample, trained or not."""
    ref = copy.deepcopy(model).double()
    adv = grpo.group_advantages(torch.tensor([s.reward for s in samples], dtype=torch.float64), 2)
    terms, kls = [], []
    for s, a, keep in zip(samples, adv, trained):
        if not keep:
            continue
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logp = (ref(ids)[0].double() / 0.7).log_softmax(-1)
        where = torch.tensor([len(s.prompt_ids) + start + k for start, n in s.spans for k in range(n)])
        lp = logp[where - 1, ids[0, where]]
        gen, teacher = torch.tensor(s.gen_logprobs, dtype=torch.float64), torch.tensor(s.teacher_logprobs, dtype=torch.float64)
        a_t = coef * (teacher - lp.detach()) + (a if outcome is True or (outcome and s.finish_reason != "length") else 0.0)
        ratio, w = torch.exp(lp - gen), torch.exp(lp.detach() - gen)
        loss = torch.maximum(-a_t * ratio, -a_t * ratio.clamp(0.8, 1.28)) * ((w >= 0.5) & (w <= 2.0))
        terms.append(loss.mean())
        kls.append(lp.detach() - teacher)
    (torch.stack(terms).sum() / len(terms)).backward()
    return torch.cat([p.grad.flatten() for p in ref.parameters() if p.grad is not None]), torch.cat(kls).mean().item()


def distill_step(model, samples, outcome, **overrides):
    """rl_step of a copy of model on the samples with distill.teacher (coef 0.5) -> (its metrics, its gradient)."""
    learner = copy.deepcopy(model)
    cfg, opt, guard = rl_setup(learner, **{"optim.grad_clip": 1e9, "optim.max_tokens_per_micro_batch": 40,
                                           "distill.teacher": "teacher", "distill.coef": 0.5, "distill.outcome": outcome}
                               | overrides)
    m = train.rl_step(cfg, learner, None, opt, guard, RolloutBatch(samples, index=0, stream_state={}, metrics={}), 0)
    return m, torch.cat([p.grad.flatten() for p in learner.parameters() if p.grad is not None]).double()


@pytest.mark.parametrize("outcome", [False, True])
def test_distillation_keeps_a_cut_sample_at_outcome_advantage_zero(multi_turn, outcome):
    """rollout.truncated: mask with a teacher: a sample masked because the length limit cut it stays in the loss with
    its per-token distillation term (the teacher scored each of its tokens) and no outcome advantage (its reward is
    the noise the mask is for; it still counts in its group's baseline); a void trajectory leaves whole. The gradient
    is the float64 reference's over every sample but the void one, the cut ones' outcome advantage 0; train/masked
    counts the void one alone."""
    model, samples = multi_turn
    samples = with_a_teacher(samples)
    for i, finish in ((0, "length"), (3, "length"), (6, "void")):  # a rewarded group's, another group's; a void one
        samples[i].masked, samples[i].finish_reason = True, finish
    assert {samples[i].reward for i in (0, 3)} != {0.0}  # a cut sample's outcome advantage would not be 0 by itself
    trained = [i != 6 for i in range(len(samples))]
    want, kl = float64_distill_gradient(model, samples, "not cut" if outcome else False, trained)
    m, got = distill_step(model, samples, outcome)
    assert m["train/masked"] == 1 and m["train/samples"] == len(samples) - 1
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert m["train/distill_kl"] == pytest.approx(kl, abs=1e-5)


# ----------------------------------------------------------------------------- end to end


def run_train(run_dir, *overrides, resume=False, wait=True, config=None, fork=False, cwd=ROOT):
    """`python train.py --config CONFIG run_dir=RUN_DIR FAST... OVERRIDES` in cwd: waits and checks that it succeeded
    (the finished process), or wait=False: the running process (Popen's interface). fork=True: forked, not a new
    interpreter (ForkedTrain)."""
    args = ["--config", config or TINY, f"run_dir={run_dir}", *FAST, *overrides] + (["--resume"] if resume else [])
    p = start_train(args, cwd, fork, stdout=subprocess.PIPE if wait else subprocess.DEVNULL)
    if not wait:
        return p
    p = finish(p, 300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def start_train(args, cwd=ROOT, fork=False, stdout=subprocess.PIPE):
    """train.py ARGS in cwd, started: a new interpreter (stdout: PIPE, or DEVNULL when nothing reads it while the
    run goes on), or fork=True a child of the fork server (ForkedTrain, its output in files)."""
    if fork:
        return ForkedTrain(args, cwd)
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=cwd, stdout=stdout,
                            stderr=subprocess.PIPE, text=True)


def finish(proc, timeout):
    """Wait for a started run (killed past timeout): subprocess.run's CompletedProcess."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# A run forked from a server process that imported train.py (and what a run imports lazily) once, instead of a
# new interpreter: it skips the interpreter's start and the imports, about half of a FAST run's CPU seconds. The
# child does what `python train.py ARGS` does (checkpoint.run_main(train.main), with its exit codes, stdout and
# stderr). The forked children share the server's hash seed and memory layout, so a run that others are held to
# bit for bit is started as a new interpreter (fork=False): every exact comparison still spans two interpreters.
FORK_PRELOAD = ["train", "torch._dynamo", "transformers.models.glm4"]
FORK_CHILD = """
import os, sys
os.chdir(cwd)
os.environ.clear()
os.environ.update(environ)
for fd, path in ((1, out), (2, err)):
    f = os.open(path, os.O_WRONLY)
    os.dup2(f, fd)
    os.close(f)
sys.path[:] = [root] + [p for p in sys.path if p not in ("", root)]  # as `python ROOT/train.py` has it
import train
assert os.path.dirname(os.path.abspath(train.__file__)) == root, (train.__file__, root)
from machinery.checkpoint import run_main
run_main(lambda: train.main(args))
"""


def fork_server():
    """multiprocessing's fork server, started once (it lives as long as this process) with FORK_PRELOAD imported from
    this checkout: PYTHONPATH names it while the server starts (what a child runs sees the environment as it is)."""
    import multiprocessing
    import multiprocessing.forkserver
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(FORK_PRELOAD)
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT] + ([before] if before else []))
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    return ctx


class ForkedTrain:
    """A forked run (FORK_CHILD) with the part of Popen's interface the tests use."""

    def __init__(self, args, cwd):
        import tempfile
        ctx = fork_server()
        self.args, self._dir = ["train.py", *args], tempfile.TemporaryDirectory(prefix="forked_train_")
        self._out, self._err = (os.path.join(self._dir.name, name) for name in ("stdout", "stderr"))
        for path in (self._out, self._err):
            open(path, "w").close()
        env = dict(args=list(args), cwd=str(cwd), environ=dict(os.environ), out=self._out, err=self._err, root=ROOT)
        self._proc = ctx.Process(target=exec, args=(FORK_CHILD, env), daemon=True)  # (exec pickles by name)
        self._proc.start()
        self.pid = self._proc.pid

    @property
    def stderr(self):  # what the run wrote to stderr so far (a finished Popen's stderr.read() gives all of it)
        with open(self._err) as f:
            return io.StringIO(f.read())

    @property
    def returncode(self):
        return self._proc.exitcode  # like Popen's: -N if signal N ended it

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        self._proc.join(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, signum):
        os.kill(self.pid, signum)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout=None):
        self.wait(timeout)
        with open(self._out) as f:
            return f.read(), self.stderr.read()


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def train_error(*argv):
    """The one-line error train.py ends with (checkpoint.run_main), run in this process: a check that fails before
    any training saves the seconds a new interpreter takes to import torch."""
    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit) as e:
            checkpoint.run_main(lambda: train.main(list(argv)))
    finally:
        torch.set_num_threads(threads)
    return str(e.value.code)


EXPECTED_STEPS = ([("dsa_warmup", s) for s in range(1, 3)] + [("sft", s) for s in range(1, 5)] +
                  [("rl", s) for s in range(0, 5)])


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("async"))
    run_train(run_dir, "rollout.max_staleness=1")
    return run_dir


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("sync"))
    run_train(run_dir, "rollout.max_staleness=0", fork=True)  # (held to others within tolerances only)
    return run_dir


def test_metrics_one_line_per_step(async_run):
    rows = metrics(async_run)
    assert [(r["stage"], r["step"]) for r in rows] == EXPECTED_STEPS
    rl = [r for r in rows if r["stage"] == "rl"]
    assert [r["step"] for r in rl if "eval/synthetic/accuracy" in r] == [0, 2, 4]
    for r in rl[1:]:
        for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/lr", "train/clip_frac_high", "rollout/reward",
                    "rollout/response_len", "staleness/max", "staleness/dropped", "perf/tokens_per_s",
                    "perf/generator_idle", "perf/learner_wait_s", "time/elapsed_s"):
            assert key in r, key
    assert [r["global_step"] for r in rows] == [1, 2, 3, 4, 5, 6, 6, 7, 8, 9, 10]


@pytest.mark.parametrize("which, bound", [("sync_run", 0), ("async_run", 1)])
def test_staleness_never_exceeds_the_bound(which, bound, request):
    rl = [r for r in metrics(request.getfixturevalue(which)) if r["stage"] == "rl" and r["step"] > 0]
    assert all(r["staleness/max"] <= bound and r["staleness/dropped"] == 0 for r in rl)
    if bound == 1:  # batch 1 is generated while step 0 trains: the async path really ran ahead
        assert max(r["staleness/max"] for r in rl) == 1


def test_sync_mode_is_on_policy(sync_run):
    rl = [r for r in metrics(sync_run) if r["stage"] == "rl" and r["step"] > 0]
    assert all(r["train/logp_diff_max"] < 1e-4 for r in rl)


def test_checkpoints_are_model_directories(async_run):
    ckpts = checkpoint.checkpoints(async_run)
    assert [os.path.basename(c) for c in ckpts] == ["step_000002", "step_000004", "step_000006", "step_000008", "step_000010"]
    model = GLM.from_pretrained(ckpts[-1])
    assert model.cfg.dsa is not None and model.cfg.dsa.topk == 8
    state = torch.load(os.path.join(ckpts[-1], "state.pt"), weights_only=False)
    assert (state["stage"], state["step"], state["global_step"]) == ("rl", 4, 10)
    assert state["ranks"][0]["stream"]["position"] == 4 * 4  # 4 RL batches of 4 prompts consumed
    assert os.path.isfile(os.path.join(ckpts[-1], "tokenizer.json"))
    assert not [d for d in os.listdir(os.path.join(async_run, "checkpoints")) if d.startswith(".")]


def test_fresh_run_refuses_an_existing_run_dir(async_run):
    assert "already holds a run; pass --resume" in train_error(f"run_dir={async_run}")


def wait_for(cond, proc, timeout=120):
    deadline = time.time() + timeout
    while not cond():
        assert proc.poll() is None, f"run ended early: {proc.stderr.read()[-2000:]}"
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


def test_ctrl_c_stops_cleanly(tmp_path):
    run_dir = str(tmp_path / "interrupted")
    proc = run_train(run_dir, "train.rl_steps=1000", "train.eval_every=0", "train.save_every=1000", wait=False, fork=True)
    wait_for(lambda: os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and
             any(r["stage"] == "rl" and r["step"] > 1 for r in metrics(run_dir)), proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)  # the generator thread was stopped and joined
    assert proc.returncode == 128 + signal.SIGINT, err[-2000:]
    assert "stopped by SIGINT after rl step" in err and f"continue with: python train.py --resume run_dir={run_dir}" in err
    assert "Traceback" not in err
    assert not [d for d in os.listdir(os.path.join(run_dir, "checkpoints")) if d.startswith(".")]
    for line in open(os.path.join(run_dir, "metrics.jsonl")):
        json.loads(line)  # no half-written line


def test_a_blown_up_run_stops_with_one_line_and_clean_checkpoints(tmp_path):
    """optim.lr=1e4: the weights overflow within a few RL steps. The run must end with one line naming
    what was non-finite (no traceback), and no checkpoint may hold a non-finite tensor."""
    run_dir = str(tmp_path / "blown")
    p = finish(start_train(["--config", TINY, f"run_dir={run_dir}", *FAST, "optim.lr=1e4", "train.rl_steps=30",
                            "train.save_every=1"], fork=True), 300)
    last = p.stderr.strip().splitlines()[-1] if p.returncode else ""
    if p.returncode:  # stopped: one line, no traceback
        assert last.startswith("error:") and ("non-finite" in last or "not finite" in last), p.stderr[-2000:]
        assert "Traceback" not in p.stderr
    rows = [r for r in metrics(run_dir) if r["stage"] == "rl"]
    assert any(r.get("train/skipped") for r in rows) or p.returncode  # skipped steps are counted
    for ckpt in checkpoint.checkpoints(run_dir):
        for name, t in GLM.from_pretrained(ckpt).state_dict().items():
            assert torch.isfinite(t).all(), (ckpt, name)


def test_every_optional_path_runs(tmp_path):
    """KL loss with a frozen reference and the KL guard, TIS + IcePop + dual clip, entropy bonus,
    dynamic sampling, partial rollouts (weights landing mid-batch), token-mean."""
    run_dir = str(tmp_path / "options")
    run_train(run_dir, "grpo.kl_coef=0.01", "grpo.kl_guard=true", "grpo.kl_guard_threshold=1e-9", "grpo.tis_cap=2",
              "grpo.dual_clip=3", "grpo.entropy_coef=0.01", "grpo.agg=token-mean",
              "rollout.dynamic_sampling=true", "rollout.partial_rollout=true", "train.dsa_warmup_steps=0", fork=True)
    rl = [r for r in metrics(run_dir) if r["stage"] == "rl" and r["step"] > 0]
    assert len(rl) == 4 and os.path.isfile(os.path.join(run_dir, "reference", "config.json"))
    assert all("train/kl" in r and "train/is_weight_mean" in r and "train/dual_clip_frac" in r for r in rl)
    assert rl[-1]["kl_guard/fired"] == 1.0 and rl[-1]["kl_guard/scale"] < 1.0  # any KL is above a 1e-9 threshold
    assert rl[-1]["train/lr"] == pytest.approx(5e-4 * rl[-1]["kl_guard/scale"])  # the guard brakes the lr
    assert all("train/logp_diff_max" in r and "train/mismatch_k3" in r and "train/icepop_masked_frac" in r for r in rl)


def test_the_mtp_demo_trains_its_mtp_layer_from_the_warm_up_on_and_drafts_the_rollouts(tmp_path):
    """configs/tiny_mtp_cpu.yaml, shortened: the MTP layer's loss in the SFT stage and every RL step, its gradient norm
    apart from the policy's, and the engine's calls drafting with it (the first speculates; rollout/spec_on)."""
    run_dir = str(tmp_path / "mtp")
    run_train(run_dir, config=os.path.join(ROOT, "configs", "tiny_mtp_cpu.yaml"), fork=True)
    rows = metrics(run_dir)
    sft, rl = [r for r in rows if r["stage"] == "sft"], [r for r in rows if r["stage"] == "rl" and r["step"] > 0]
    assert sft and all(r["train/mtp_loss"] > 0 and math.isfinite(r["train/mtp_grad_norm"]) for r in sft)
    assert "train/mtp_loss" not in next(r for r in rows if r["stage"] == "dsa_warmup")
    assert len(rl) == 4 and all(r["train/mtp_loss"] > 0 and r["train/mtp_grad_norm"] > 0 for r in rl)
    assert rl[0]["rollout/spec_on"] > 0 and 1.0 <= rl[0]["rollout/spec_tokens_per_verify"] <= 3.0
    assert sft[-1]["train/mtp_loss"] < sft[0]["train/mtp_loss"]  # it learns to draft
    saved = json.load(open(os.path.join(run_dir, "checkpoints", "step_000004", "config.json")))
    assert saved["num_nextn_predict_layers"] == 1  # saved as the published checkpoints hold it


# ----------------------------------------------------------------------------- a run you can trust

# wall-clock figures, and the handoff's (co-located runs alone report them): the only keys that may differ
TIMES = ("time/", "perf/", "rollout/gen_s", "rollout/gen_tokens_per_s", "colocate/")


def without_times(rows):
    return [{k: v for k, v in r.items() if not k.startswith(TIMES)} for r in rows]


def final_weights(run_dir):
    return lora.load_model(checkpoint.checkpoints(run_dir)[-1], GLM.from_pretrained).state_dict()  # (LoRA: base + adapters)


def assert_same_run(run_dir, reference):
    """Bit-identical metrics (times aside) and final weights."""
    assert without_times(metrics(run_dir)) == without_times(metrics(reference))
    a, b = final_weights(run_dir), final_weights(reference)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_an_fp8_run_resumes_exactly_and_colocated_is_the_same_run(sync_run, tmp_path):
    """rollout.quantization: fp8 (the generator's decoder linears in e4m3 blocks, published quantized): a run
    stopped after RL step 2 and resumed ends as the uninterrupted one, and its rollouts really came from the fp8
    generator: its logprobs sit ~1e-2 from the learner's, where the CPU's fp32 generator's sit ~1e-6 away. The
    stopped-and-resumed run is co-located (train.colocate: the engine's e4m3 weights and KV pool released while the
    learner steps, the learner's masters and AdamW state offloaded while the engine generates), the uninterrupted
    one is not: with max_staleness 0 and the same thread counts (parallel.set_threads) they are the same run."""
    whole, split = str(tmp_path / "whole"), str(tmp_path / "split")
    fp8 = ["rollout.max_staleness=0", "rollout.quantization=fp8", "train.dsa_warmup_steps=0", "train.sft_steps=0"]
    run_train(whole, *fp8)  # a new interpreter; the stopped and resumed run forked (ForkedTrain)
    run_train(split, *fp8, "train.rl_steps=2", "train.colocate=true", fork=True)
    run_train(split, *fp8, "train.rl_steps=4", resume=True, fork=True)
    assert_same_run(split, whole)
    rl = [r for r in metrics(split) if r["stage"] == "rl" and r["step"] > 0]
    assert all(r["colocate/offloaded_gib"] > 0 and r["perf/to_learner_s"] >= 0 for r in rl)  # the handoff ran
    gap = lambda run: max(r["train/logp_diff_mean"] for r in metrics(run) if "train/logp_diff_mean" in r)  # noqa: E731
    assert gap(whole) > 1e-3 > 1e-4 > gap(sync_run)


def test_a_lora_run_trains_adapters_on_the_frozen_base_and_resumes_exactly(tmp_path):
    """model.lora: the warm-ups train the whole model, then RL trains adapters on that base, frozen; publishes the
    adapters alone (the generator's logprobs stay the learner's, ~1e-6), takes the KL to the base with the adapters
    off, and checkpoints adapters (peft's layout) + state, the base once in run_dir/lora_base. A run stopped after RL
    step 2 and resumed ends as the uninterrupted one (metrics and weights), the stopped one co-located (the engine
    shares the learner's base: no copy)."""
    args = ["model.lora={rank: 4}", "rollout.max_staleness=0", "grpo.kl_coef=0.01", "grpo.entropy_coef=0.01"]  # (moves B
    # whatever the rewards: the tiny warm-up here solves nothing)
    whole, split = str(tmp_path / "whole"), str(tmp_path / "split")
    run_train(whole, *args)  # a new interpreter; the stopped and resumed run forked (ForkedTrain)
    run_train(split, *args, "train.rl_steps=2", "train.colocate=true", fork=True)  # co-located: the engine decodes on
    run_train(split, *args, "train.rl_steps=4", resume=True, fork=True)  # the learner's base tensors, adapters offloaded
    assert_same_run(split, whole)
    last, sft_end = checkpoint.checkpoints(whole)[-1], os.path.join(whole, "checkpoints", "step_000006")
    assert {"adapter_config.json", "adapter_model.safetensors", "state.pt"} <= set(os.listdir(last))
    assert not any(f.endswith(".safetensors") and f != "adapter_model.safetensors" for f in os.listdir(last))
    base, warm = GLM.from_pretrained(os.path.join(whole, "lora_base")).state_dict(), GLM.from_pretrained(sft_end).state_dict()
    final = final_weights(whole)
    assert all(torch.equal(base[k], warm[k]) and torch.equal(final[k], warm[k]) for k in warm)  # the base never moved
    assert any(k.endswith(".lora_B") and final[k].abs().sum() > 0 for k in final)  # the adapters did
    rl = [r for r in metrics(whole) if r["stage"] == "rl" and "train/logp_diff_max" in r]
    assert rl and all(r["train/logp_diff_max"] < 1e-4 and "train/kl" in r for r in rl)
    assert max(r["train/grad_norm"] for r in rl) > 0


def test_kill_anywhere_and_resume_is_exact(async_run, tmp_path):
    """SIGKILL at random moments across all stages (seeded), --resume after each, in the default async
    mode: the run ends exactly as the uninterrupted one (metrics and weights), which also says that two runs of
    one seed are identical: weights reach the generator between batches, and every kernel is deterministic."""
    import random
    rng, run_dir, kills = random.Random(0), str(tmp_path / "killed"), 0
    while kills < 5:
        proc = run_train(run_dir, "rollout.max_staleness=1", resume=kills > 0, wait=False)
        try:
            proc.wait(timeout=rng.uniform(3.0, 9.0))  # import + start-up take ~3 s; a whole run ~12 s
            break  # finished before the kill
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
    else:  # (the kills above hit new interpreters, on the schedule their start-up was timed for; the last resume
        run_train(run_dir, "rollout.max_staleness=1", resume=True, fork=True)  # is forked: ForkedTrain)
    assert proc.returncode in (0, -signal.SIGKILL), proc.stderr.read()[-2000:]
    assert_same_run(run_dir, async_run)


def sigterm_after_rl_step_1(run_dir, *overrides, config=None):
    """A forked run, SIGTERM'd once RL step 1 is logged: it must stop with the SIGTERM exit code and no traceback.
    Returns (its last checkpoint's state.pt, its stderr)."""
    proc = run_train(run_dir, *overrides, wait=False, config=config, fork=True)
    wait_for(lambda: os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and
             any(r["stage"] == "rl" and r["step"] == 1 for r in metrics(run_dir)), proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err[-2000:]
    return torch.load(os.path.join(checkpoint.checkpoints(run_dir)[-1], "state.pt"), weights_only=False), err


def test_sigterm_checkpoints_at_the_step_boundary_and_resumes_exactly(async_run, tmp_path):
    run_dir = str(tmp_path / "term")
    state, err = sigterm_after_rl_step_1(run_dir, "rollout.max_staleness=1")  # (async_run: a new interpreter)
    stopped = metrics(run_dir)[-1]
    assert f"stopped by SIGTERM after rl step {stopped['step']}, checkpoint saved" in err
    assert (state["stage"], state["step"]) == ("rl", stopped["step"])  # saved at the step it stopped after
    run_train(run_dir, "rollout.max_staleness=1", resume=True, fork=True)
    assert_same_run(run_dir, async_run)


def test_a_distillation_run_resumes_exactly_and_runs_co_located(async_run, tmp_path):
    """distill.teacher (the async run's last checkpoint: the synthetic task's tokenizer too): every RL step logs
    train/distill_kl and perf/teacher_s. A run SIGTERM'd after RL step 1, whose checkpoint keeps a batch sampled (and
    scored by the teacher) before it, resumes to the uninterrupted run's metrics and weights bit for bit; co-located
    (synchronous, the teacher on the one device throughout) with the outcome advantage added, it runs too."""
    args = [f"distill.teacher={checkpoint.checkpoints(async_run)[-1]}", "rollout.max_staleness=1",
            "train.dsa_warmup_steps=0", "train.sft_steps=0"]
    whole, term, co = str(tmp_path / "whole"), str(tmp_path / "term"), str(tmp_path / "co")
    run_train(whole, *args)  # a new interpreter; the stopped and resumed run forked (ForkedTrain)
    rl = [r for r in metrics(whole) if r["stage"] == "rl" and r["step"] > 0]
    # (the FAST teacher is barely trained: its KL to a fresh student is ~0.01 either way, so only nonzero here)
    assert len(rl) == 4 and all(math.isfinite(r["train/distill_kl"]) and r["train/distill_kl"] != 0
                                and r["perf/teacher_s"] > 0 for r in rl)
    state, _ = sigterm_after_rl_step_1(term, *args)
    pending = [s for b in state["ranks"][0]["pending"] for s in b.samples]
    assert pending and all(len(s.teacher_logprobs) == len(s.gen_logprobs) for s in pending)
    again = [copy.copy(s) for s in pending]  # the kept numbers are the teacher's own, not the generator's
    Teacher(args[0].split("=", 1)[1], "cpu", train.packed_forward, temperature=2.0, max_tokens=64).score(again)  # tiny_cpu.yaml
    kept, fresh = (torch.tensor([x for s in ss for x in s.teacher_logprobs]) for ss in (pending, again))
    assert torch.allclose(kept, fresh, atol=1e-5) and not torch.allclose(kept, torch.tensor([x for s in pending
                                                                                               for x in s.gen_logprobs]))
    run_train(term, *args, resume=True, fork=True)
    assert_same_run(term, whole)
    run_train(co, *args, "rollout.max_staleness=0", "train.colocate=true", "distill.outcome=true", "train.rl_steps=2",
              fork=True)
    assert all("train/distill_kl" in r for r in metrics(co) if r["stage"] == "rl" and r["step"] > 0)


TOOL = os.path.join(ROOT, "configs", "tiny_tool_cpu.yaml")
# The calculator demo, small: enough supervised steps that the model calls the tool, a few RL steps
TOOL_FAST = ["data.train_size=256", "data.eval_size=16", "train.sft_steps=80", "train.warmup_batch_size=32",
             "optim.sft_lr=1e-2",
             "train.rl_steps=4", "rollout.max_staleness=1", "rollout.dump_fraction=1.0"]


@pytest.fixture(scope="module")
def tool_run(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("tool"))
    run_train(run_dir, *TOOL_FAST, config=TOOL)
    return run_dir


def test_a_multi_turn_run_with_the_calculator_resumes_exactly(tool_run, tmp_path):
    """The calculator env, multi-turn episodes, one step off-policy: SIGTERM after an RL step, --resume, and the
    run ends as the uninterrupted one (metrics and weights): env answers are admitted at fixed engine iterations
    (rollout.env_admit_after) and each turn's seed is fixed, so a resumed batch plays the same episodes."""
    rl = [r for r in metrics(tool_run) if r["stage"] == "rl" and "rollout/turns" in r]
    assert max(r["rollout/turns"] for r in rl) > 1 and max(r["rollout/tool_calls"] for r in rl) > 0  # multi-turn
    assert all(r["rollout/env_failures"] == 0 for r in rl)
    assert "eval/multiply/tool_call_rate" in metrics(tool_run)[-1]
    dumped = [json.loads(line) for f in sorted(os.listdir(os.path.join(tool_run, "rollouts")))
              for line in open(os.path.join(tool_run, "rollouts", f))]  # the dump: a sampled fraction, turn by turn
    assert dumped and any({"model", "env"} <= {t["role"] for t in d["turns"]} and d["tool_io"] for d in dumped)
    run_dir = str(tmp_path / "term")
    proc = run_train(run_dir, *TOOL_FAST, config=TOOL, wait=False, fork=True)  # (tool_run: a new interpreter)
    wait_for(lambda: os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and  # (80 SFT steps first: the
             any(r["stage"] == "rl" and r["step"] == 1 for r in metrics(run_dir)), proc, timeout=300)  # run's bound)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    run_train(run_dir, *TOOL_FAST, config=TOOL, resume=True, fork=True)
    assert_same_run(run_dir, tool_run)


README_ENV_DATA = [{"question": "What is the capital of Atlantis?", "answer": "Poseidonia",
                    "table": {"atlantis": "Poseidonia", "lemuria": "Mu"}, "solution": "\\boxed{Poseidonia}"}] * 8


def test_the_readme_env_runs_unchanged_and_a_crashing_tool_is_survived(tmp_path):
    """The README's example env, copied out of the README, trains end to end on a JSONL file (no prompt or label
    key: the env reads what it needs); a variant whose tool crashes now and then loses those trajectories, not
    the run."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    code = readme.split("# my_envs.py", 1)[1].split("```", 1)[0]
    (tmp_path / "my_envs.py").write_text("# my_envs.py" + code + textwrap.dedent("""

        class Flaky(Lookup):
            calls = 0

            def step(self, text):
                Flaky.calls += 1
                if Flaky.calls % 5 == 0:
                    raise ConnectionError("the tool's server went away")
                return super().step(text)
        """))
    (tmp_path / "facts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in README_ENV_DATA))
    for cls in ("Lookup", "Flaky"):
        run_dir = str(tmp_path / cls)
        p = run_train(run_dir, "data.env=my_envs:" + cls, f"data.train={tmp_path / 'facts.jsonl'}",
                      f"data.eval={tmp_path / 'facts.jsonl'}", "data.response_key=solution", "rollout.max_prompt_tokens=40",
                      "model.init.max_position_embeddings=64", "rollout.max_total_tokens=24", "train.eval_max_new_tokens=16",
                      cwd=tmp_path, fork=True)
        rl = [r for r in metrics(run_dir) if r["stage"] == "rl" and "rollout/turns" in r]
        assert len(rl) == 4 and all(r["rollout/env_failures"] == 0 for r in rl) == (cls == "Lookup")
        if cls == "Flaky":
            assert "env failure on example" in p.stdout and "Flaky.step raised ConnectionError" in p.stdout
            assert os.listdir(os.path.join(run_dir, "env_failures"))


@pytest.fixture(scope="module")
def short_rl_run(tmp_path_factory):
    """Two RL steps, no warm-up, greedy evals (test_greedy_eval) at a sampling temperature that is not the recipe's
    (test_resume_reads_the_runs_own_config resumes a copy of it)."""
    run_dir = str(tmp_path_factory.mktemp("short"))
    run_train(run_dir, "rollout.temperature=1.0", "train.eval_temperature=0", "train.rl_steps=2",
              "train.dsa_warmup_steps=0", "train.sft_steps=0", fork=True)
    return run_dir


def test_resume_reads_the_runs_own_config(short_rl_run, tmp_path):
    """--resume continues with run_dir/config.yaml: the recipe file and its defaults do not come back;
    an override may change only what is safe mid-run, anything else is refused naming both values."""
    run_dir = str(tmp_path / "own")
    shutil.copytree(short_rl_run, run_dir)  # (run_dir may change on resume)
    assert train_error(f"run_dir={run_dir}", "--resume", "rollout.temperature=2.0") == (
        f"error: --resume: rollout.temperature is 1.0 in {run_dir}/config.yaml but 2.0 on the command line; "
        "a resumed run may change only " + ", ".join(sorted(config.SAFE_ON_RESUME - {"run_dir"})))
    p = finish(start_train([f"run_dir={run_dir}", "--resume", "train.rl_steps=3"], fork=True), 300)  # no FAST: the
    assert p.returncode == 0, p.stderr[-2000:]  # saved config has it
    rows = metrics(run_dir)
    assert [r["step"] for r in rows if r["stage"] == "rl"] == [0, 1, 2, 3]
    saved = config.load_config(os.path.join(run_dir, "config.yaml"))
    assert saved.rollout.temperature == 1.0 and saved.train.rl_steps == 3 and saved.model.init["hidden_size"] == 32


def test_a_run_without_a_checkpoint_restarts_fresh(tmp_path):
    """Killed before its first checkpoint: a plain start refuses the directory, --resume starts it fresh
    and says so (the old metrics are dropped, not appended to)."""
    run_dir = str(tmp_path / "early")
    args = ("train.dsa_warmup_steps=0", "train.sft_steps=6", "train.rl_steps=0", "train.save_every=1000")
    proc = run_train(run_dir, *args, wait=False, fork=True)
    wait_for(lambda: os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and metrics(run_dir), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not checkpoint.checkpoints(run_dir)
    assert "already holds a run; pass --resume to continue it" in train_error(f"run_dir={run_dir}")
    p = run_train(run_dir, *args, resume=True, fork=True)
    assert f"{run_dir} has no checkpoint yet: starting it fresh" in p.stdout
    assert [(r["stage"], r["step"]) for r in metrics(run_dir)] == [("sft", s) for s in range(1, 7)]


def test_overlong_prompts_fail_before_any_work(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps({"prompt": "1+1=" * n, "label": "2"}) + "\n" for n in (1, 30, 40)))
    run_dir = str(tmp_path / "r")
    assert train_error(f"run_dir={run_dir}", f"data.eval={path}").startswith(
        f"error: 2 of 3 prompts in {path} are longer than rollout.max_prompt_tokens=32")
    assert not os.path.exists(os.path.join(run_dir, "metrics.jsonl"))  # failed before the first stage
    assert "none is left to train on" in train_error(f"run_dir={run_dir}", f"data.train={path}", "train.sft_steps=0",
                                                     "train.dsa_warmup_steps=0", "train.rl_steps=1",
                                                     "rollout.max_prompt_tokens=4")


def test_environment_failures_are_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert train_error(f"run_dir={blocker}/run") == f"error: not a directory: {blocker}/run"
    assert train_error(f"run_dir={tmp_path / 'r'}", "model.init=null", f"model.path={tmp_path}") == \
        f"error: model.path: {tmp_path} has no config.json"  # not sentencepiece advice


# ----------------------------------------------------------------------------- hooks: reward, data, eval

REWARD_MODULE = """
def from_field(response, example):  # the whole JSONL object arrives, extra fields included
    return example.get("bonus", 0.0)  # the synthetic eval set has no such field
"""


def test_custom_reward_sees_every_jsonl_field(tmp_path, monkeypatch):
    (tmp_path / "my_reward.py").write_text(REWARD_MODULE)
    rows = [{"question": f"{a}+{a}=", "answer": str(2 * a), "bonus": 0.25, "worked": f"\\boxed{{{2 * a}}}"} for a in range(8)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = str(tmp_path / "r")
    p = run_train(run_dir, f"data.train={path}", f"data.eval={{held_out: {path}, arith: synthetic}}",
                  "data.prompt_key=question", "data.label_key=answer", "data.response_key=worked",
                  "data.reward=my_reward:from_field", "train.eval_greedy=true", cwd=tmp_path, fork=True)
    rows = metrics(run_dir)
    assert [r["step"] for r in rows if r["stage"] == "sft"] == [1, 2, 3, 4]  # SFT on the file's own responses
    rl = [r for r in rows if r["stage"] == "rl" and r["step"] > 0]
    assert all(r["rollout/reward"] == 0.25 for r in rl)  # the field reached the reward
    last = rows[-1]
    for key in ("eval/held_out/accuracy", "eval/held_out/greedy_accuracy", "eval/arith/accuracy", "eval/arith/pass@2"):
        assert key in last, key
    assert last["eval/held_out/accuracy"] == 0.25 and "final held-out accuracy: held_out/accuracy 25.0%" in p.stdout
    # A name the module lacks: one line, from the same working directory (in this process: train_error)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # data.load_hook adds the working directory
    try:
        assert train_error(f"run_dir={tmp_path / 'x'}", "data.reward=my_reward:nope").startswith(
            "error: data.reward: 'my_reward:nope'")
    finally:
        sys.modules.pop("my_reward", None)  # (imported by the check)


def test_greedy_eval(short_rl_run):
    evals = [r for r in metrics(short_rl_run) if "eval/synthetic/accuracy" in r]  # RL steps 0 and 2
    assert len(evals) == 2 and not any("eval/synthetic/pass@2" in r for r in evals)  # one greedy sample per prompt


# ----------------------------------------------------------------------------- several processes
# torchrun with gloo on the CPU: the same code path as NCCL on GPUs, minus the kernels.

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]


_FIXED_BATCH = []  # generated once per process: fixed_global_batch hands out copies


def fixed_global_batch():
    """16 samples in 8 groups of 2 from a seeded engine: the same on every process (a fresh copy each call)."""
    if not _FIXED_BATCH:
        _FIXED_BATCH.append(_generate_fixed_global_batch())
    return copy.deepcopy(_FIXED_BATCH[0])


def _generate_fixed_global_batch():
    tok = data.make_tiny_tokenizer()
    model = tiny_model()
    engine = TorchEngine(copy.deepcopy(model), max_batch=16)
    prompts = [data.render_prompt(tok, ex["prompt"]) for ex in data.synthetic_task(8, seed=1)]
    sampling = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=12, stop_token_ids=(1,))
    flat = [p for p in prompts for _ in range(2)]
    comps = engine.generate(flat, sampling, seed=3)
    # Groups 6 and 7 come from an old version: dropped as stale at step 2, which leaves rank 1 of 2
    # (it owns them) with nothing to train on; it must still take part in every collective.
    versions = [(1, 1)] * 12 + [(0, 0)] * 4
    return model, [Sample(p, c.token_ids, c.logprobs, float((i * 7) % 3 == 0), i // 2, v, c.finish_reason, {})
                   for i, (p, c, v) in enumerate(zip(flat, comps, versions))]


def rl_steps_on_fixed_batch(mode, agg):
    """Three RL steps (versions 0, 1, 2): rank r of W trains its share of the fixed global batch
    (uneven: rank 0 gets groups 0-5, rank 1 groups 6-7). Returns the final weights."""
    model, samples = fixed_global_batch()
    if parallel.world() > 1:
        owned = range(0, 12) if parallel.rank() == 0 else range(12, 16)
        samples = [samples[i] for i in owned]
    cfg = config.load_config(TINY, ["rollout.temperature=0.7", "rollout.max_staleness=1", f"grpo.agg={agg}",
                                   f"train.parallel={mode}", "optim.max_tokens_per_micro_batch=40",
                                   "optim.warmup_steps=0", "optim.lr=0.5", "grpo.kl_coef=0.01"])
    for name, p in model.named_parameters():
        p.requires_grad_(".indexer." not in name)
    ref = copy.deepcopy(model).requires_grad_(False)
    learner = parallel.parallel_learner(model, torch.device("cpu"), mode)
    if mode == "fsdp":
        ref = parallel.parallel_learner(ref, torch.device("cpu"), mode)
    # SGD, not AdamW: the key biases have a zero gradient in exact arithmetic (softmax ignores a shift
    # shared by all keys), and Adam would blow their float noise up to lr-sized steps.
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for version in range(3):
        batch = RolloutBatch(samples, index=version, stream_state={}, metrics={})
        m = train.rl_step(cfg, learner, ref, opt, grpo.KLGuard(), batch, version)
    assert m["train/samples"] == (0 if parallel.rank() == 1 else 12)  # step 2: rank 1 had only stale samples
    if mode == "fsdp" and parallel.world() > 1:  # published to a bf16 engine: the indexer's fp32 weights stay fp32
        published = list(parallel.full_weights(learner, torch.bfloat16))  # every rank gathers every tensor
        wrong = [(n, t.dtype) for n, t in published if (t.dtype == torch.float32) != n.endswith(dsa.FP32_PARAMS)]
        assert not wrong, wrong
    return {k: v.clone() for k, v in parallel.full_weights(learner)}


TWO_PROCESS_CASES = [("fsdp", "seq-mean-token-mean"), ("ddp", "token-mean")]


@pytest.fixture(scope="module")
def two_process_weights(tmp_path_factory):
    """One torchrun (2 processes, one process group) runs every case of the test below, one after the other:
    {(parallel, agg): rank 0's final weights}."""
    out = tmp_path_factory.mktemp("two_weights")
    p = subprocess.run([*TORCHRUN, "tests/test_train.py", str(out), *(f"{m}:{a}" for m, a in TWO_PROCESS_CASES)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=os.environ | {"PYTHONPATH": ROOT})  # the worker imports train
    assert p.returncode == 0, p.stderr[-3000:]
    return {(m, a): torch.load(out / f"{m}-{a}.pt") for m, a in TWO_PROCESS_CASES}


@pytest.mark.parametrize("parallel, agg", TWO_PROCESS_CASES)
def test_two_processes_match_one_on_the_same_global_batch(parallel, agg, two_process_weights):
    two = two_process_weights[parallel, agg]
    one = rl_steps_on_fixed_batch(parallel, agg)
    start = dict(fixed_global_batch()[0].named_parameters())
    assert any((one[k] - start[k]).abs().max() > 1e-3 for k in one)  # the steps really moved the weights
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=1e-4, atol=1e-6, msg=k)


def run_procs(run_dir, *overrides, resume=False, launcher="self"):
    """train.py on 2 processes, started by train.py itself (train.pairs=2; that launcher forked, ForkedTrain: the
    2 processes it starts are new interpreters) or by torchrun."""
    args = ["--config", TINY, f"run_dir={run_dir}", *FAST, "rollout.max_staleness=0", *overrides]
    resume = ["--resume"] if resume else []
    if launcher == "self":
        p = finish(start_train([*args, "train.pairs=2", *resume], fork=True), 300)
    else:
        p = subprocess.run([*TORCHRUN, "train.py", *args, *resume], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


@pytest.fixture(scope="module")
def two_proc_run(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("two"))
    run_procs(run_dir, "train.parallel=fsdp")
    return run_dir


def test_two_processes_warm_up_like_one(two_proc_run, sync_run):
    """The warm-up stages split one global batch over the ranks: the losses, gradient norms and the
    weights at the end of SFT are those of one process (float tolerance)."""
    got, want = metrics(two_proc_run), metrics(sync_run)
    assert [(r["stage"], r["step"]) for r in got] == EXPECTED_STEPS
    for a, b in zip(got[:6], want[:6]):
        for key in ("train/loss", "train/indexer_kl", "train/grad_norm"):
            assert (key in a) == (key in b)
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), (a["stage"], a["step"], key)
    sft_end = [os.path.join(d, "checkpoints", "step_000006") for d in (two_proc_run, sync_run)]
    a, b = (dict(GLM.from_pretrained(d).named_parameters()) for d in sft_end)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)
    state = torch.load(os.path.join(checkpoint.checkpoints(two_proc_run)[-1], "state.pt"), weights_only=False)
    assert len(state["ranks"]) == 2 and all(r["stream"]["position"] == 4 * 2 for r in state["ranks"])  # 2 prompts/rank/step
    rl = [r for r in got if r["stage"] == "rl" and r["step"] > 0]
    assert all(r["train/samples"] == 16 and r["perf/publish_s"] >= 0 for r in rl)  # both ranks' 8 samples


def test_two_processes_killed_and_resumed_end_exactly(two_proc_run, tmp_path):
    """SIGKILL to both processes (and the launcher) in the RL stage, --resume under torchrun (the run was started
    by train.py itself): the same run as never killed, bit for bit (per-rank data positions and RNGs restored,
    FSDP optimizer state reloaded). This run is co-located (train.colocate; FSDP2's shards and AdamW state offloaded
    and brought back each step, the checkpoint taken from them), the uninterrupted one is split, max_staleness 0."""
    run_dir = str(tmp_path / "killed2")
    args = ["--config", TINY, f"run_dir={run_dir}", *FAST, "rollout.max_staleness=0", "train.parallel=fsdp",
            "train.colocate=true"]
    proc = subprocess.Popen([sys.executable, "train.py", *args, "train.pairs=2"], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for(lambda: any(os.path.basename(c) >= "step_000006" for c in checkpoint.checkpoints(run_dir)), proc, timeout=240)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher's children are in their own sessions: find them by their run_dir
    proc.wait()
    subprocess.run(["pkill", "-9", "-f", f"run_dir={run_dir}"])
    run_procs(run_dir, "train.parallel=fsdp", resume=True, launcher="torchrun")
    assert without_times(metrics(run_dir)) == without_times(metrics(two_proc_run))
    assert all(r["colocate/offloaded_gib"] > 0 for r in metrics(run_dir) if r["stage"] == "rl" and r["step"] > 0)
    a, b = final_weights(run_dir), final_weights(two_proc_run)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_multi_process_error_is_one_line(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps({"prompt": "1+1=" * n, "label": "2"}) + "\n" for n in (1, 40)))
    p = finish(start_train([f"run_dir={tmp_path / 'r'}", "train.pairs=2", f"data.eval={path}"], fork=True), 120)  # (the
    assert p.returncode == 1 and "Traceback" not in p.stderr  # launcher forked, its 2 processes new interpreters)
    assert [line for line in p.stderr.splitlines() if line.strip()] == [
        f"error: 1 of 2 prompts in {path} are longer than rollout.max_prompt_tokens=32 (the longest has 162 tokens)"]


def test_resume_needs_the_same_number_of_processes(two_proc_run, tmp_path):
    run_dir = str(tmp_path / "copy")
    shutil.copytree(two_proc_run, run_dir)
    p = subprocess.run([*TORCHRUN[:-1], "--nproc-per-node=1", "train.py", f"run_dir={run_dir}", "--resume"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "written by 2 processes; resume it with as many (this run has 1)" in p.stderr
    assert train_error(f"run_dir={run_dir}", "train.pairs=1", "--resume").startswith(  # (in this process)
        f"error: --resume: train.pairs is 2 in {run_dir}/config.yaml but 1 on the command line")


if __name__ == "__main__":  # the torchrun worker of test_two_processes_match_one_on_the_same_global_batch:
    torch.distributed.init_process_group("gloo")  # tests/test_train.py OUT_DIR PARALLEL:AGG ...
    torch.set_num_threads(1)
    for case in sys.argv[2:]:
        mode, agg = case.split(":")
        weights = rl_steps_on_fixed_batch(mode, agg)
        if parallel.rank() == 0:
            torch.save(weights, os.path.join(sys.argv[1], f"{mode}-{agg}.pt"))
        torch.distributed.barrier()  # neither rank tears gloo down while the other still uses it
    torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------- MoE: routing replay

MOE_CFG = os.path.join(ROOT, "configs", "tiny_moe_cpu.yaml")
# tiny_moe_cpu.yaml shrunk as FAST shrinks tiny_cpu.yaml (its MLA and MoE sections as they are)
FAST_MOE = [o for o in FAST if not o.startswith(("model.init.head_dim", "model.init.intermediate_size",
                                                  "model.init.num_layers"))] + [
    "model.init.intermediate_size=64", "model.init.num_layers=2", "model.init.moe.mlp_layer_types=[dense,sparse]"]


def tiny_moe(seed=0, experts=8):
    """A glm_moe_dsa-shaped model: MLA, a dense first layer, then MoE layers (top-2 of `experts`, a shared expert),
    DSA (top-4). Weights sharper than the init, so routes and top-k keys are far from ties."""
    torch.manual_seed(seed)
    cfg = GLMConfig(model_type="glm_moe_dsa", vocab_size=len(data.make_tiny_tokenizer()), hidden_size=32,
                    intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=4, eos_token_id=[1], pad_token_id=0,
                    mla=dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
                    moe=dict(n_routed_experts=experts, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                             n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                             mlp_layer_types=["dense", "sparse", "sparse"]),
                    dsa={"topk": 4, "heads": 2, "head_dim": 8, "rope_dim": 4, "pattern": "FS"})
    model = GLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


@pytest.fixture(scope="module")
def moe_rollouts():
    tok = data.make_tiny_tokenizer()
    model = tiny_moe()
    prompts = [data.render_prompt(tok, ex["prompt"]) for ex in data.synthetic_task(6, seed=1)]
    prompts = [p for p in prompts for _ in range(2)]
    sampling = SamplingParams(temperature=0.7, max_new_tokens=12, stop_token_ids=(1,))
    comps = TorchEngine(copy.deepcopy(model), max_batch=8).generate(prompts, sampling, seed=3)
    return model, prompts, comps


def moe_micro_batch(model, prompts, comps, apply=True):
    samples = [Sample(p, c.token_ids, c.logprobs, 0.0, i // 2, (0, 0), c.finish_reason, {}, routes=c.routes)
               for i, (p, c) in enumerate(zip(prompts, comps))]
    ((_, mb),) = parallel.packed_micro_batches(model, [s.row() for s in samples], 10**6, "cpu", [s.routes for s in samples])
    return mb, mb.routing(apply)


def moe_rl_step(net, prompts, comps, replay):
    """One RL step of net on the completions (rewards 1 for every third sample) with their routes -> its metrics."""
    cfg, opt, guard = rl_setup(net, **{"model.routing_replay": replay})
    batch = RolloutBatch([Sample(p, c.token_ids, c.logprobs, float(i % 3 == 0), i // 2, (0, 0), c.finish_reason, {},
                                routes=c.routes) for i, (p, c) in enumerate(zip(prompts, comps))], 0, {}, {})
    return train.rl_step(cfg, net, None, opt, guard, batch, 0)


def test_the_engine_records_every_fed_tokens_routes_as_the_learners_forward_chooses_them(moe_rollouts):
    """Each completion carries the experts its context's tokens took in the generator (prefill, then one decode step
    per token): one row per position fed (the last sampled token never is), and they are the experts the learner's
    own forward of the whole sequence chooses where that forward runs the layer (fp32 on both sides: no ties)."""
    from families.mla_moe import Routing, no_route
    model, prompts, comps = moe_rollouts
    n_moe, k = len(model.cfg.moe_layers), model.cfg.moe.num_experts_per_tok
    for p, c in zip(prompts, comps):
        ids = p + c.token_ids
        assert c.routes.shape == (len(ids) - 1, n_moe, k) and c.routes.dtype == torch.uint8
        r = Routing(record=True)
        with torch.no_grad():
            model(torch.tensor([ids[:-1]]), routing=r)
        mine = torch.stack(r.chosen)[:, 0].permute(1, 0, 2)  # [positions, n_moe, k]
        ran = c.routes != no_route(torch.uint8)
        # the prefill's last block ran its MLP at the prompt's last token only; every other layer and token ran
        assert ran[:len(p) - 1, :-1].all() and not ran[:len(p) - 1, -1].any() and ran[len(p) - 1:].all()
        assert torch.equal(c.routes[ran].sort(-1).values, mine[ran].sort(-1).values)


def test_replayed_routes_give_the_generators_logprobs(moe_rollouts):
    """The learner's packed forward replaying the generator's routes gives its logprobs (fp32, as the dense model's
    test_packed_logprobs_match_generator), agreement 1 with the routes it would choose itself; and the routes it is
    handed are the ones it uses: handing it other experts changes the logprobs."""
    model, prompts, comps = moe_rollouts
    mb, routing = moe_micro_batch(model, prompts, comps)
    with torch.no_grad():
        logp, _, _, _ = train.packed_forward(model, mb.rows, temperature=0.7, routing=routing)
    gen = torch.tensor([x for i in mb.samples for x in comps[i].logprobs])  # (packed in the micro-batch's order)
    assert (logp - gen).abs().max() < 1e-4
    agree, seen = (torch.stack(t).sum(0) for t in zip(*routing.agree))
    assert seen > 0 and agree == seen
    other = mb.routing(True)
    other.replay = (other.replay.long() + 1).remainder(model.cfg.moe.n_routed_experts).to(other.replay.dtype).where(
        other.replay != 255, other.replay)  # every recorded route shifted to the next experts
    with torch.no_grad():
        shifted, _, _, _ = train.packed_forward(model, mb.rows, temperature=0.7, routing=other)
    assert (shifted - gen).abs().max() > 1e-2


def test_rl_step_replays_routes_and_logs_agreement_and_both_gaps(moe_rollouts):
    """One RL step on an MoE batch: routing/agree (here 1: the generator's copy is the learner's) and the gap with
    replay and without; under bf16 autocast against a bf16 generator, replay keeps the gap near the dense model's
    (test_packed_logprobs_match_a_bf16_generator_under_autocast's bound) where fresh routing can only be as close."""
    model, prompts, comps = moe_rollouts
    for replay in ("rollout", "none"):
        m = moe_rl_step(copy.deepcopy(model), prompts, comps, replay)
        assert m["routing/agree"] == 1.0 and m["routing/logp_diff_mean_replay"] < 1e-5, m
        assert m["routing/logp_diff_mean_fresh"] < 1e-5  # (fp32 generator: fresh routes are the same here)
    model = GLM(GLMConfig(**{**model.cfg.__dict__, "dsa": None, "model_type": "glm4_moe_lite"}))  # routing alone: no DSA
    model.load_state_dict(moe_rollouts[0].state_dict(), strict=False)
    bf16 = TorchEngine(copy.deepcopy(model).cast_(torch.bfloat16), max_batch=8)
    comps = bf16.generate(prompts, SamplingParams(temperature=0.7, max_new_tokens=12, stop_token_ids=(1,)), seed=3)
    mb, _ = moe_micro_batch(model, prompts, comps)
    gen = torch.tensor([x for i in mb.samples for x in comps[i].logprobs])
    gaps = {}
    for apply in (True, False):
        routing = mb.routing(apply)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logp, _, _, _ = train.packed_forward(model, mb.rows, temperature=0.7, routing=routing)
        gaps[apply] = (logp - gen).abs()
    dense = tiny_model()  # the dense model's own bf16 gap, on the same prompts
    dense = GLM(GLMConfig(**{**dense.cfg.__dict__, "dsa": None}))
    dense.load_state_dict(tiny_model().state_dict(), strict=False)
    comps = TorchEngine(copy.deepcopy(dense).cast_(torch.bfloat16), max_batch=8).generate(
        prompts, SamplingParams(temperature=0.7, max_new_tokens=12, stop_token_ids=(1,)), seed=3)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _, _, _ = train.packed_forward(dense, [(p + c.token_ids, [(len(p), len(c.token_ids))])
                                                  for p, c in zip(prompts, comps)], temperature=0.7)
    dense_gap = (logp - torch.tensor([x for c in comps for x in c.logprobs])).abs().mean()
    # measured (seeds 0-2): replay mean 0.018-0.020, worst token 0.08-0.10; fresh 0.024-0.052, worst 0.57-1.8 (a
    # flipped route); dense 0.007-0.010. MLA's bf16 decode (absorbed) against the learner's (expanded) keeps the
    # replayed gap at ~2x the dense one; the flips are what replay removes
    assert gaps[True].mean() < 3 * dense_gap and gaps[True].max() < 0.25 < gaps[False].max(), (gaps, dense_gap)
    assert gaps[True].mean() < gaps[False].mean()


@pytest.mark.parametrize("bf16", [False, True])
def test_the_gaps_with_and_without_replay_are_measured_on_a_probe_of_the_first_micro_batch(moe_rollouts, monkeypatch,
                                                                                           bf16):
    """With more samples than variants.ROUTING_PROBE_SAMPLES, routing/logp_diff_mean_{replay,fresh} are the gaps over the
    probe's tokens (MicroBatch.probe): each probed sample's logprobs from a forward of it alone, routed afresh (fresh)
    or replaying its routes (replay), against the generator's. The learner's router is nudged, so fresh routes differ.
    bf16: the learner's autocast on (as on a GPU; train.autocast turns it on for CUDA only): the extra forward runs
    under it too, as the training forward does, so both gaps are the bf16 learner's."""
    model, prompts, comps = moe_rollouts
    net = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("gate.weight"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.2)
    precision = (lambda device: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else parallel.autocast
    monkeypatch.setattr(train, "autocast", precision)
    monkeypatch.setattr(variants, "autocast", precision)
    monkeypatch.setattr(variants, "ROUTING_PROBE_SAMPLES", 5)  # 12 samples: every 3rd, 4 of them
    mb, _ = moe_micro_batch(net, prompts, comps)
    probe, _ = mb.probe(5)
    assert len(probe.samples) == 4
    want = {}
    for apply in (True, False):
        gaps = []
        for i in probe.samples:
            p, c = prompts[i], comps[i]
            one = parallel.MicroBatch([(p + c.token_ids, [(len(p), len(c.token_ids))])], [0], torch.arange(len(c.token_ids)),
                                      torch.ones(1, len(c.token_ids), dtype=torch.bool), [c.routes])
            with torch.no_grad(), precision(torch.device("cpu")):
                logp = train.packed_forward(net, one.rows, temperature=0.7, routing=one.routing(apply))[0]
            gaps.append((logp - torch.tensor(c.logprobs)).abs())
        want[apply] = torch.cat(gaps).mean().item()
    assert want[False] > 2 * want[True] > 0  # the nudge flips routes: without replay the gap is larger (0.70 vs 0.12)
    for replay in ("rollout", "none"):
        m = moe_rl_step(copy.deepcopy(net), prompts, comps, replay)
        tol = 2e-3 if bf16 else 1e-5  # a packed row against one sequence alone: bf16 rounds them apart a little
        assert m["routing/logp_diff_mean_replay"] == pytest.approx(want[True], rel=tol, abs=1e-6), (replay, m)
        assert m["routing/logp_diff_mean_fresh"] == pytest.approx(want[False], rel=tol, abs=1e-6), (replay, m)


def nudged_router(model, scale=0.2):
    """A copy of model whose routers are nudged, so that on the generator's completions its own top-k differs from
    the recorded experts at many tokens."""
    net = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("gate.weight"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * scale)
    return net


def float64_moe_gradient(net, prompts, comps, replay):
    """The gradient of rl_step's loss (seq-mean-token-mean, clipped surrogate, IcePop) written out in float64, each
    sample's forward alone: its MoE layers take the generator's recorded experts (replay[i]; a position the generator
    never fed or routed, NO_ROUTE, routes by itself) or route by themselves (no Routing at all)."""
    from families.mla_moe import Routing, no_route
    ref = copy.deepcopy(net).double()
    adv = grpo.group_advantages(torch.tensor([float(i % 3 == 0) for i in range(len(comps))], dtype=torch.float64), 2)
    terms = []
    for p, c, a, replayed in zip(prompts, comps, adv, replay):
        ids = p + c.token_ids
        routing = None
        if replayed:  # [positions, n_moe, k] -> [n_moe, 1, L, k]; the last token was never fed: no route
            r = torch.cat([c.routes, torch.full((1, *c.routes.shape[1:]), no_route(c.routes.dtype), dtype=c.routes.dtype)])
            routing = Routing(replay=r.permute(1, 0, 2)[:, None])
        logp = (ref(torch.tensor([ids]), routing=routing)[0] / 0.7).log_softmax(-1)
        lp = logp[torch.arange(len(p) - 1, len(ids) - 1), torch.tensor(c.token_ids)]  # position j - 1 predicts token j
        gen = torch.tensor(c.logprobs, dtype=torch.float64)
        ratio, w = torch.exp(lp - gen), torch.exp(lp.detach() - gen)
        terms.append((torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.28)) * ((w >= 0.5) & (w <= 2.0))).mean())
    (torch.stack(terms).sum() / len(comps)).backward()
    return {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}


def test_the_training_forward_replays_the_recorded_routes_only_when_routing_replay_is_on(moe_rollouts):
    """The learner's router nudged off the generator's, so routing afresh takes other experts: rl_step's gradient is
    the float64 reference's that replays the recorded experts under model.routing_replay: rollout, and the one that
    routes afresh under none. The two references differ (most in the routers and the experts), so a learner that
    always, or never, replays fails one of the two; the routing/* metrics could not tell (they are the same numbers
    in both modes: test_the_gaps_with_and_without_replay_are_measured_on_a_probe_of_the_first_micro_batch)."""
    model, prompts, comps = moe_rollouts
    net = nudged_router(model)
    want = {replay: float64_moe_gradient(net, prompts, comps, [replay] * len(comps)) for replay in (True, False)}
    flat = lambda grads: torch.cat([g.flatten() for g in grads.values()])  # noqa: E731
    apart = (flat(want[True]) - flat(want[False])).norm() / flat(want[True]).norm()
    assert apart > 0.3, apart  # (measured 0.95) replaying or not changes the update by far more than the tolerance
    for replay in (True, False):
        learner = copy.deepcopy(net)
        cfg, opt, guard = rl_setup(learner, **{"model.routing_replay": "rollout" if replay else "none", "optim.grad_clip": 1e9,
                                               "grpo.agg": "seq-mean-token-mean", "optim.max_tokens_per_micro_batch": 60})
        batch = RolloutBatch([Sample(p, c.token_ids, c.logprobs, float(i % 3 == 0), i // 2, (0, 0), c.finish_reason, {},
                                     routes=c.routes) for i, (p, c) in enumerate(zip(prompts, comps))], 0, {}, {})
        train.rl_step(cfg, learner, None, opt, guard, batch, 0)
        got = {n: p.grad for n, p in learner.named_parameters() if p.grad is not None}
        assert set(got) == set(want[replay])
        torch.testing.assert_close(flat(got).double(), flat(want[replay]), rtol=1e-4, atol=1e-6)


def test_samples_without_routes_route_afresh_beside_replayed_ones_counted_and_said_once(moe_rollouts, monkeypatch,
                                                                                        capsys):
    """Samples that carry no generator routes (Sample.routes None) in a micro-batch with others that do: theirs route
    afresh token by token while the others still replay (the float64 reference's gradient, each sample as it routes),
    routing/unrecorded is their share of the step's samples, and the console says so once, not every step."""
    model, prompts, comps = moe_rollouts
    net, missing = nudged_router(model), {1, 4, 10}  # (the router nudged: routing afresh takes other experts)
    want = float64_moe_gradient(net, prompts, comps, [i not in missing for i in range(len(comps))])
    monkeypatch.setattr(variants, "SAID", set())
    learner = copy.deepcopy(net)
    cfg, opt, guard = rl_setup(learner, **{"optim.grad_clip": 1e9, "grpo.agg": "seq-mean-token-mean",
                                           "optim.max_tokens_per_micro_batch": 60})
    batch = RolloutBatch([Sample(p, c.token_ids, c.logprobs, float(i % 3 == 0), i // 2, (0, 0), c.finish_reason, {},
                                 routes=None if i in missing else c.routes)
                          for i, (p, c) in enumerate(zip(prompts, comps))], 0, {}, {})
    parts = parallel.packed_micro_batches(learner, [s.row() for s in batch.samples], 60, "cpu",
                                          [s.routes for s in batch.samples])
    assert any(0 < mb.unrecorded() < len(mb.samples) for _, mb in parts)  # a micro-batch mixes the two
    m = train.rl_step(cfg, learner, None, opt, guard, batch, 0)
    got = torch.cat([p.grad.flatten() for p in learner.parameters() if p.grad is not None]).double()
    torch.testing.assert_close(got, torch.cat([g.flatten() for g in want.values()]), rtol=1e-4, atol=1e-6)
    assert m["routing/unrecorded"] == pytest.approx(3 / 12) and 0 < m["routing/agree"] < 1
    out = capsys.readouterr().out
    assert out.count("carry no generator routes") == 1 and "routing/unrecorded" in out
    m = train.rl_step(cfg, learner, None, opt, guard, batch, 1)  # a second step: counted again, said no more
    assert m["routing/unrecorded"] == pytest.approx(3 / 12) and "no generator routes" not in capsys.readouterr().out
    assert moe_rl_step(copy.deepcopy(net), prompts, comps, "rollout")["routing/unrecorded"] == 0.0  # all recorded
    # none recorded: every token routes afresh, and nothing replayed has no agreement or gaps to report
    want = float64_moe_gradient(net, prompts, comps, [False] * len(comps))
    learner = copy.deepcopy(net)
    cfg, opt, guard = rl_setup(learner, **{"optim.grad_clip": 1e9, "grpo.agg": "seq-mean-token-mean"})
    for s in batch.samples:
        s.routes = None
    m = train.rl_step(cfg, learner, None, opt, guard, batch, 0)
    got = torch.cat([p.grad.flatten() for p in learner.parameters() if p.grad is not None]).double()
    torch.testing.assert_close(got, torch.cat([g.flatten() for g in want.values()]), rtol=1e-4, atol=1e-6)
    assert {k for k in m if k.startswith("routing/")} == {"routing/unrecorded"} and m["routing/unrecorded"] == 1.0


def test_an_moe_runs_routes_survive_a_checkpoint_and_resume_exactly(tmp_path):
    """tiny_moe_cpu.yaml end to end (indexer warm-up, SFT, async GRPO with routing replay), SIGTERM'd after RL step
    1 (its checkpoint holds batch 2, sampled before it by older weights, with its routes) and resumed: the same
    metrics and weights as the uninterrupted run, so those routes came back exactly; routing/* logged every step."""
    whole, split = str(tmp_path / "whole"), str(tmp_path / "split")
    run_train(whole, *FAST_MOE, "rollout.max_staleness=1", config=MOE_CFG)
    state, _ = sigterm_after_rl_step_1(split, *FAST_MOE, "rollout.max_staleness=1", config=MOE_CFG)  # (whole: new)
    pending = [s for b in state["ranks"][0]["pending"] for s in b.samples]
    if state["step"] < 4:  # (a checkpoint after the last step has nothing pending)
        assert pending and all(s.routes is not None and len(s.routes) == len(s.prompt_ids) + len(s.response_ids) - 1
                               for s in pending)
    run_train(split, *FAST_MOE, "rollout.max_staleness=1", resume=True, config=MOE_CFG, fork=True)
    assert_same_run(split, whole)
    rl = [r for r in metrics(whole) if r["stage"] == "rl" and r["step"] > 0]
    assert len(rl) == 4 and all(0 <= r["routing/agree"] <= 1 and r["routing/logp_diff_mean_fresh"] >= 0 for r in rl)
