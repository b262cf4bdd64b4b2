"""Tests for grpo.py. Every expected value is written out by hand in float64 python loops."""
import json
import math

import pytest
import torch

import grpo

MODES = ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"]


def ref_loss(logp, old, adv, mask, agg, eps_low=0.2, eps_high=0.28, dual=None, weight=None, loss_scale=None):
    """Hand reference: returns (loss, grad wrt logp) as python floats / nested lists."""
    B, T = len(logp), len(logp[0])
    val = [[0.0] * T for _ in range(B)]
    der = [[0.0] * T for _ in range(B)]  # d val / d logp
    for i in range(B):
        for t in range(T):
            if not mask[i][t]:
                continue
            a = adv[i][t] if isinstance(adv[i], list) else adv[i]
            r = math.exp(logp[i][t] - old[i][t])
            unclipped, clipped = -a * r, -a * min(max(r, 1 - eps_low), 1 + eps_high)
            v, g = (unclipped, -a * r) if unclipped >= clipped else (clipped, 0.0)
            if dual is not None and a < 0 and v > -a * dual:
                v, g = -a * dual, 0.0
            w = 1.0 if weight is None else weight[i][t]
            val[i][t], der[i][t] = v * w, g * w
    n = [sum(1 for t in range(T) if mask[i][t]) for i in range(B)]
    nseq = sum(1 for i in range(B) if n[i] > 0)
    if agg == "seq-mean-token-mean":
        D = loss_scale or nseq
        loss = sum(sum(val[i]) / n[i] for i in range(B) if n[i]) / D
        grad = [[der[i][t] / (n[i] * D) if n[i] else 0.0 for t in range(T)] for i in range(B)]
    else:
        D = loss_scale or (sum(n) if agg == "token-mean" else nseq)
        loss = sum(map(sum, val)) / D
        grad = [[der[i][t] / D for t in range(T)] for i in range(B)]
    return loss, grad


def ref_agg(x, mask, agg):
    B, T = len(x), len(x[0])
    n = [sum(mask[i]) for i in range(B)]
    if agg == "seq-mean-token-mean":
        return sum(sum(x[i][t] for t in range(T) if mask[i][t]) / n[i] for i in range(B) if n[i]) / sum(1 for k in n if k)
    s = sum(x[i][t] for i in range(B) for t in range(T) if mask[i][t])
    return s / (sum(n) if agg == "token-mean" else sum(1 for k in n if k))


def make_batch(B=5, T=7, seed=0, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = old + spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = [T, 3, 1, T - 2, 5][:B]
    mask = torch.tensor([[1 if t < L else 0 for t in range(T)] for L in lengths])
    return logp, old, adv, mask


def cfg(**kw):
    """A GRPOConfig with no off-policy correction unless asked for (the dataclass default is IcePop 2)."""
    return grpo.GRPOConfig(**({"icepop_beta": None} | kw))


def run(logp, gen, adv, mask, prox_logp=None, ref_logp=None, entropy=None, loss_scale=None, **kw):
    """policy_loss with cfg(**kw); the hand references call gen_logp "old": PPO's pi_old is the sampler."""
    logp = logp.clone().requires_grad_(True)
    loss, metrics = grpo.policy_loss(logp, gen, adv, mask, cfg(**kw), prox_logp=prox_logp, ref_logp=ref_logp,
                                     entropy=entropy, loss_scale=loss_scale)
    loss.backward()
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())  # read with one host sync
    return loss.item(), logp.grad, {k: v.item() for k, v in metrics.items()}


def assert_close(x, y, tol=1e-10):
    torch.testing.assert_close(torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(y, dtype=torch.float64), rtol=tol, atol=tol)


# --- advantages and filters -----------------------------------------------------------------

def test_group_advantages_hand_formula():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 3.0]
    G = 4
    out = grpo.group_advantages(torch.tensor(rewards), G)
    out_dr = grpo.group_advantages(torch.tensor(rewards), G, std_normalize=False)
    for g in range(3):
        grp = rewards[g * G:(g + 1) * G]
        mean = sum(grp) / G
        std = math.sqrt(sum((r - mean) ** 2 for r in grp) / (G - 1))  # unbiased, like torch.std
        for k, r in enumerate(grp):
            assert out[g * G + k].item() == pytest.approx((r - mean) / (std + 1e-6), rel=1e-5)
            assert out_dr[g * G + k].item() == pytest.approx(r - mean, abs=1e-6)
    assert torch.all(out[4:8] == 0) and not torch.isnan(out).any()  # constant group: 0, not NaN
    assert torch.all(grpo.group_advantages(torch.tensor([1.0, 2.0]), 1) == 0)
    with pytest.raises(ValueError):
        grpo.group_advantages(torch.zeros(5), 2)


def test_informative():
    assert [grpo.informative(g) for g in ([1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0] * 3, [0.5])] == [False, True, False, False]
    nan = float("nan")  # unequal even to itself: not two different rewards
    assert not grpo.informative([nan, nan]) and not grpo.informative([float("nan"), float("nan"), 1.0])


def test_fresh_mask():
    assert grpo.fresh_mask([5, 4, 3, 2, 5], 5, 2).tolist() == [True, True, True, False, True]
    assert grpo.fresh_mask(torch.tensor([5, 4]), 5, 0).tolist() == [True, False]
    with pytest.raises(ValueError):
        grpo.fresh_mask([1], 1, -1)


# --- the clipped loss -----------------------------------------------------------------------

@pytest.mark.parametrize("agg", MODES)
def test_aggregation_modes_match_hand_reference(agg):
    logp, old, adv, mask = make_batch()
    loss, grad, metrics = run(logp, old, adv, mask, agg=agg)
    ref, ref_grad = ref_loss(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), agg)
    assert_close(loss, ref)
    assert_close(grad, ref_grad)
    assert metrics["pg_loss"] == pytest.approx(ref)
    assert all(isinstance(v, float) for v in metrics.values())


def test_per_token_advantages():
    logp, old, adv, mask = make_batch(seed=3)
    adv_bt = torch.randn(logp.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    loss, grad, _ = run(logp, old, adv_bt, mask)
    ref, ref_grad = ref_loss(logp.tolist(), old.tolist(), adv_bt.tolist(), mask.tolist(), "seq-mean-token-mean")
    assert_close(loss, ref)
    assert_close(grad, ref_grad)


def test_clipping_zero_grad_on_clipped_tokens():
    # token ratios 1.5, 0.5, 1.1 with A = +1 (row 0) and A = -1 (row 1)
    old = torch.zeros(2, 3, dtype=torch.float64)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1], [1.5, 0.5, 1.1]], dtype=torch.float64))
    adv, mask = torch.tensor([1.0, -1.0], dtype=torch.float64), torch.ones(2, 3)
    loss, grad, m = run(logp, old, adv, mask, agg="token-mean")
    assert grad[0, 0] == 0 and grad[1, 1] == 0  # high clip (A > 0), low clip (A < 0)
    assert_close(grad[0, 1], -1 * 0.5 / 6)
    assert_close(grad[0, 2], -1 * 1.1 / 6)
    assert_close(grad[1, 0], 1 * 1.5 / 6)
    assert_close(grad[1, 2], 1 * 1.1 / 6)
    assert_close(loss, (-1.28 - 0.5 - 1.1 + 1.5 + 0.8 + 1.1) / 6)
    assert m["clip_frac_high"] == pytest.approx(1 / 6) and m["clip_frac_low"] == pytest.approx(1 / 6)
    assert m["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1) * 2 / 6)
    # pi_prox = pi_theta here: the mismatch is KL(pi_gen || pi_theta), k3 = r - log r - 1
    assert m["mismatch_k3"] == pytest.approx(2 * sum(r - math.log(r) - 1 for r in (1.5, 0.5, 1.1)) / 6)


def test_dual_clip():
    old = torch.zeros(1, 3, dtype=torch.float64)
    logp = torch.log(torch.tensor([[5.0, 2.0, 0.5]], dtype=torch.float64))
    adv, mask = torch.tensor([-2.0], dtype=torch.float64), torch.ones(1, 3)
    loss, grad, m = run(logp, old, adv, mask, agg="token-mean", dual_clip=3.0)
    assert_close(loss, (2 * 3.0 + 2 * 2.0 + 2 * 0.8) / 3)
    assert grad[0, 0] == 0 and grad[0, 2] == 0
    assert_close(grad[0, 1], 2 * 2.0 / 3)
    assert m["dual_clip_frac"] == pytest.approx(1 / 3)
    logp2, old2, adv2, mask2 = make_batch(seed=4, spread=1.5)
    loss2, grad2, _ = run(logp2, old2, adv2, mask2, dual_clip=2.0)
    ref, ref_grad = ref_loss(logp2.tolist(), old2.tolist(), adv2.tolist(), mask2.tolist(), "seq-mean-token-mean", dual=2.0)
    assert_close(loss2, ref)
    assert_close(grad2, ref_grad)
    with pytest.raises(ValueError):
        grpo.policy_loss(logp, old, adv, mask, cfg(dual_clip=1.0))


@pytest.mark.parametrize("agg", MODES)
def test_on_policy_is_plain_policy_gradient(agg):
    _, old, adv, mask = make_batch(seed=1)
    loss, grad, m = run(old.clone(), old, adv, mask, agg=agg)
    n = mask.sum(1).tolist()
    D = sum(n) if agg == "token-mean" else sum(1 for k in n if k)
    for i in range(len(n)):
        for t in range(mask.shape[1]):
            expect = 0.0 if not mask[i, t] else -adv[i].item() / (D * (n[i] if agg == "seq-mean-token-mean" else 1))
            assert grad[i, t].item() == pytest.approx(expect, abs=1e-12)
    assert m["ratio_mean"] == 1.0 and m["clip_frac_low"] == 0 and m["clip_frac_high"] == 0 and m["mismatch_k3"] == 0


def test_bad_agg_name_raises():
    logp, old, adv, mask = make_batch()
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        grpo.policy_loss(logp, old, adv, mask, cfg(agg="seq-mean"))
    with pytest.raises(ValueError):
        grpo.loss_denominator(mask, "mean")


# --- off-policy corrections -----------------------------------------------------------------

def test_tis_weights_and_cap():
    """TIS: where the clip is inactive the gradient is -A * min(w, cap) * grad log pi, w = pi_prox / pi_gen."""
    logp, gen, adv, mask = make_batch(seed=2, spread=0.6)
    loss, grad, m = run(logp, gen, adv, mask, tis_cap=1.2)
    w = [[math.exp(a - b) for a, b in zip(ra, rb)] for ra, rb in zip(logp.tolist(), gen.tolist())]  # prox = logp
    c = [[min(x, 1.2) / x for x in row] for row in w]
    ref, ref_grad = ref_loss(logp.tolist(), gen.tolist(), adv.tolist(), mask.tolist(), "seq-mean-token-mean", weight=c)
    assert_close(loss, ref)
    assert_close(grad, ref_grad)
    flat = [w[i][t] for i in range(5) for t in range(7) if mask[i, t]]
    assert max(flat) > 1.2 and m["is_weight_mean"] == pytest.approx(sum(min(x, 1.2) for x in flat) / len(flat))
    # an unclipped token with w above the cap: A < 0 and r > 1 is never clipped above (only below)
    n = mask.sum(1).tolist()
    for i in range(5):
        for t in range(7):
            if mask[i, t] and adv[i] < 0 and w[i][t] > 1.2:
                assert_close(grad[i, t], -adv[i].item() * 1.2 / (n[i] * 5))
    # with pi_prox given (several steps per batch), w comes from it, not from pi_theta
    prox = gen + 0.3
    _, grad2, _ = run(logp, gen, adv, mask, prox_logp=prox, tis_cap=1.2)
    c2 = [[min(math.exp(0.3), 1.2) / math.exp(0.3)] * 7 for _ in range(5)]
    _, ref_grad2 = ref_loss(logp.tolist(), gen.tolist(), adv.tolist(), mask.tolist(), "seq-mean-token-mean", weight=c2)
    assert_close(grad2, ref_grad2)


def test_icepop_weights_in_band_tokens_by_the_ratio_and_zeroes_the_rest():
    """IcePop as the paper and slime define it: in [1/beta, beta] a token's gradient carries w = pi_prox /
    pi_gen (not 1), outside it carries nothing; masked tokens stay in the denominator."""
    gen = torch.zeros(1, 6, dtype=torch.float64)
    w = torch.tensor([[0.4, 0.6, 0.9, 1.1, 1.9, 2.5]], dtype=torch.float64)
    logp = w.log()  # pi_prox = pi_theta, so r = w
    for a in (1.0, -1.0):
        loss, grad, m = run(logp, gen, torch.tensor([a], dtype=torch.float64), torch.ones(1, 6), agg="token-mean",
                            icepop_beta=2.0, eps_low=10.0, eps_high=10.0)  # wide clip: only IcePop acts
        assert grad[0, 0] == 0 and grad[0, 5] == 0
        for t in range(1, 5):
            assert_close(grad[0, t], -a * w[0, t].item() / 6)
        assert_close(loss, -a * sum(w[0, 1:5].tolist()) / 6)
        assert m["icepop_masked_frac"] == pytest.approx(2 / 6)
    # against the hand reference on a random batch, with the PPO clip active, and with TIS on top
    logp, gen, adv, mask = make_batch(seed=5, spread=0.8)
    keep = [[1.0 if 0.5 <= math.exp(a - b) <= 2.0 else 0.0 for a, b in zip(ra, rb)] for ra, rb in zip(logp.tolist(), gen.tolist())]
    loss, grad, _ = run(logp, gen, adv, mask, agg="token-mean", icepop_beta=2.0)
    ref, ref_grad = ref_loss(logp.tolist(), gen.tolist(), adv.tolist(), mask.tolist(), "token-mean", weight=keep)
    assert_close(loss, ref)
    assert_close(grad, ref_grad)
    assert 0 < sum(1 - k for row in keep for k in row) < 35  # some tokens out of band, some in
    loss2, grad2, _ = run(logp, gen, adv, mask, agg="token-mean", icepop_beta=2.0, tis_cap=1.5)
    c = [[keep[i][t] * min(math.exp(logp[i, t] - gen[i, t]), 1.5) / math.exp(logp[i, t] - gen[i, t]) for t in range(7)]
         for i in range(5)]
    ref2, ref_grad2 = ref_loss(logp.tolist(), gen.tolist(), adv.tolist(), mask.tolist(), "token-mean", weight=c)
    assert_close(loss2, ref2)
    assert_close(grad2, ref_grad2)


def test_the_trust_region_is_held_against_the_sampler():
    """With pi_prox = pi_theta (one step per batch) a clip on pi_theta / pi_prox could never bind; ours clips
    r = pi_theta / pi_gen, so a token the policy already pushed past 1 + eps_high since sampling gets no more."""
    gen = torch.zeros(1, 2, dtype=torch.float64)
    logp = torch.log(torch.tensor([[1.5, 1.1]], dtype=torch.float64))
    _, grad, m = run(logp, gen, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2), agg="token-mean", icepop_beta=2.0)
    assert grad[0, 0] == 0 and grad[0, 1] != 0 and m["clip_frac_high"] == 0.5


def test_log_ratios_are_clamped_before_exp():
    gen = torch.tensor([[-1000.0, 0.0]], dtype=torch.float64)
    logp = torch.tensor([[0.0, -1000.0]], dtype=torch.float64)
    for a in (-1.0, 1.0):
        loss, grad, m = run(logp, gen, torch.tensor([a], dtype=torch.float64), torch.ones(1, 2), tis_cap=2.0, kl_coef=0.1,
                            ref_logp=gen)
        assert math.isfinite(loss) and torch.isfinite(grad).all() and all(math.isfinite(v) for v in m.values())


# --- KL and entropy -------------------------------------------------------------------------

def test_kl_estimators_by_hand():
    logp = torch.tensor([-1.0, -0.5, -2.0, 0.0, -30.0], dtype=torch.float64)
    ref = torch.tensor([-1.2, -0.5, -0.1, -25.0, 0.0], dtype=torch.float64)
    for kind in ("k1", "k2", "k3", "low_var_kl"):
        out = grpo.kl_penalty(logp, ref, kind).tolist()
        for a, b, o in zip(logp.tolist(), ref.tolist(), out):
            if kind == "k1":
                e = a - b
            elif kind == "k2":
                e = 0.5 * (a - b) ** 2
            else:
                x = min(max(b - a, -20.0), 20.0)
                e = min(max(math.exp(x) - x - 1, -10.0), 10.0)
            assert o == pytest.approx(e, abs=1e-12)
    # extreme log-ratios: the value is clamped to 10, and the log-ratio clamp keeps exp (and so the
    # gradient) finite instead of 0 * inf = NaN
    x = torch.tensor([-1000.0, 1000.0, -1.0], dtype=torch.float64, requires_grad=True)
    k3 = grpo.kl_penalty(x, torch.zeros(3, dtype=torch.float64), "k3")
    k3.sum().backward()
    assert k3[:2].tolist() == [10.0, 10.0] and torch.isfinite(x.grad).all()
    assert x.grad[2].item() == pytest.approx(1 - math.exp(1.0))
    with pytest.raises(ValueError):
        grpo.kl_penalty(logp, ref, "k4")


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_and_entropy_terms_in_loss(kind):
    logp, old, adv, mask = make_batch(seed=6)
    g = torch.Generator().manual_seed(7)
    ref_lp = logp + 0.3 * torch.randn(logp.shape, generator=g, dtype=torch.float64)
    ent = torch.rand(logp.shape, generator=g, dtype=torch.float64)
    loss, grad, m = run(logp, old, adv, mask, ref_logp=ref_lp, kl_coef=0.1, kl_estimator=kind, entropy=ent, entropy_coef=0.01)
    pg, pg_grad = ref_loss(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), "seq-mean-token-mean")
    kl, dkl = [], []
    for a_row, b_row in zip(logp.tolist(), ref_lp.tolist()):
        kl.append([(a - b) if kind == "k1" else 0.5 * (a - b) ** 2 if kind == "k2" else math.exp(b - a) - (b - a) - 1 for a, b in zip(a_row, b_row)])
        dkl.append([1.0 if kind == "k1" else (a - b) if kind == "k2" else 1 - math.exp(b - a) for a, b in zip(a_row, b_row)])
    ml = mask.tolist()
    assert_close(loss, pg + 0.1 * ref_agg(kl, ml, "seq-mean-token-mean") - 0.01 * ref_agg(ent.tolist(), ml, "seq-mean-token-mean"))
    n = mask.sum(1).tolist()
    expect = [[pg_grad[i][t] + (0.1 * dkl[i][t] / (n[i] * 5) if ml[i][t] else 0.0) for t in range(7)] for i in range(5)]
    assert_close(grad, expect)
    flat = lambda x: [x[i][t] for i in range(5) for t in range(7) if ml[i][t]]
    assert m["kl"] == pytest.approx(sum(flat(kl)) / len(flat(kl)))
    assert m["entropy"] == pytest.approx(sum(flat(ent.tolist())) / len(flat(kl)))


def test_token_logprobs_and_entropy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=g) * 4
    logits[1, 2] += 1e4  # large offset must not overflow
    ids = torch.randint(0, 5, (2, 3), generator=g)
    lp, ent = grpo.token_logprobs(logits, ids, entropy=True)
    assert torch.equal(lp, grpo.token_logprobs(logits, ids))
    for i in range(2):
        for t in range(3):
            z = logits[i, t].tolist()
            mx = max(z)
            lse = mx + math.log(sum(math.exp(v - mx) for v in z))
            assert ent[i, t].item() == pytest.approx(-sum(math.exp(v - lse) * (v - lse) for v in z), abs=1e-4)
            assert lp[i, t].item() == pytest.approx(z[ids[i, t]] - lse, abs=1e-4)
    assert grpo.token_logprobs(logits.bfloat16(), ids).dtype == torch.float32
    assert grpo.token_logprobs(logits.bfloat16(), ids, entropy=True)[1].dtype == torch.float32
    # a token whose probability underflows to 0 leaves H and its gradient finite
    z = torch.tensor([[0.0, -200.0, 5.0]], requires_grad=True)
    _, h = grpo.token_logprobs(z, torch.tensor([0]), entropy=True)
    h.sum().backward()
    assert torch.isfinite(h).all() and torch.isfinite(z.grad).all()


# --- padding and micro-batching -------------------------------------------------------------

def test_padding_values_never_matter():
    logp, old, adv, mask = make_batch(seed=8)
    g = torch.Generator().manual_seed(1)
    gen = old + 0.5 * torch.randn(logp.shape, generator=g, dtype=torch.float64)
    ref_lp = old + 0.2 * torch.randn(logp.shape, generator=g, dtype=torch.float64)
    ent = torch.rand(logp.shape, generator=g, dtype=torch.float64)
    kw = dict(dual_clip=3.0, tis_cap=2.0, icepop_beta=2.0, kl_coef=0.1, entropy_coef=0.01)
    base = run(logp, gen, adv, mask, prox_logp=old, ref_logp=ref_lp, entropy=ent, **kw)
    pad = mask == 0
    garbage = lambda x, v: x.masked_fill(pad, v)
    other = run(garbage(logp, 50.0), garbage(gen, float("nan")), adv, mask, prox_logp=garbage(old, -1e4),
                ref_logp=garbage(ref_lp, float("inf")), entropy=garbage(ent, float("nan")), **kw)
    assert base[0] == other[0] and base[2] == other[2]
    assert torch.equal(base[1], other[1]) and (base[1][pad] == 0).all()


@pytest.mark.parametrize("agg", MODES)
def test_loss_scale_microbatches_sum_to_full_batch(agg):
    logp, old, adv, mask = make_batch(B=5, seed=10, spread=0.6)
    mask[2] = 0  # a sequence with no response tokens must not count
    gen = old - 0.1
    kw = dict(agg=agg, tis_cap=2.0, icepop_beta=2.0, ref_logp=old + 0.05, kl_coef=0.2)
    full_loss, full_grad, _ = run(logp, gen, adv, mask, **kw)
    hand_count = mask.sum().item() if agg == "token-mean" else 4
    scale = sum(grpo.loss_denominator(mask[a:b], agg) for a, b in [(0, 2), (2, 4), (4, 5)])
    assert scale == hand_count == grpo.loss_denominator(mask, agg)
    x = logp.clone().requires_grad_(True)
    total = 0.0
    for a, b in [(0, 2), (2, 4), (4, 5)]:
        c = cfg(**{k: v for k, v in kw.items() if k != "ref_logp"})
        loss, _ = grpo.policy_loss(x[a:b], gen[a:b], adv[a:b], mask[a:b], c, ref_logp=kw["ref_logp"][a:b], loss_scale=scale)
        loss.backward()
        total += loss.item()
    assert_close(total, full_loss)
    assert_close(x.grad, full_grad)


# --- KL guard -------------------------------------------------------------------------------

def test_kl_guard_sequence_and_state_dict():
    guard = grpo.KLGuard(threshold=0.15, factor=0.5, window=3, enabled=True)
    # window means: 0.1, 0.2, 0.2333, 0.2, 0.1
    steps = [(0.1, 1.0, False), (0.3, 0.5, True), (0.3, 0.25, True), (0.0, 0.125, True), (0.0, 1.0, False)]
    for kl, scale, fired in steps:
        assert guard.update(kl) == scale and guard.fired == fired
    assert guard.num_fired == 3
    guard.update(1.0)
    state = json.loads(json.dumps(guard.state_dict()))  # plain python types
    clone = grpo.KLGuard(threshold=0.15, factor=0.5, window=3, enabled=True)
    clone.load_state_dict(state)
    for kl in (1.0, 0.5, 0.0, 0.0, 0.0):
        assert clone.update(kl) == guard.update(kl) and clone.fired == guard.fired
    assert clone.state_dict() == guard.state_dict()


def test_kl_guard_floor_and_disabled():
    guard = grpo.KLGuard(threshold=0.1, factor=0.5, window=2, enabled=True, min_scale=0.2)
    assert [guard.update(1.0) for _ in range(4)] == [0.5, 0.25, 0.2, 0.2]
    off = grpo.KLGuard()
    assert all(off.update(5.0) == 1.0 for _ in range(20)) and not off.fired and off.window_mean == 5.0


@pytest.mark.parametrize("agg", MODES)
def test_dis_is_the_unclipped_surrogate_masked_outside_the_band(agg):
    """GLM-5's direct double-sided importance sampling against a float64 hand loop: a token whose rho is in
    [1 - eps_low, 1 + eps_high] gives -A rho with gradient -A rho (never clipped, even where PPO's clip would
    be active); outside the band it gives 0 and no gradient, yet still counts in the denominators."""
    logp, gen, adv, mask = make_batch(seed=11, spread=0.2)
    loss, grad, m = run(logp, gen, adv, mask, agg=agg, surrogate="dis")
    B, T = logp.shape
    val, der = [[0.0] * T for _ in range(B)], [[0.0] * T for _ in range(B)]
    inside = outside = 0
    for i in range(B):
        for t in range(T):
            if not mask[i][t]:
                continue
            r = math.exp(logp[i][t].item() - gen[i][t].item())
            if 0.8 <= r <= 1.28:
                val[i][t], der[i][t] = -adv[i].item() * r, -adv[i].item() * r
                inside += 1
            else:
                outside += 1
    n = [int(mask[i].sum()) for i in range(B)]
    if agg == "seq-mean-token-mean":
        want = sum(sum(val[i]) / n[i] for i in range(B)) / B
        want_grad = [[der[i][t] / (n[i] * B) for t in range(T)] for i in range(B)]
    else:
        D = sum(n) if agg == "token-mean" else B
        want, want_grad = sum(map(sum, val)) / D, [[der[i][t] / D for t in range(T)] for i in range(B)]
    assert inside > 3 and outside > 3  # both sides of the band are exercised
    assert_close(loss, want)
    assert_close(grad, want_grad)
    assert m["dis_masked_frac"] == pytest.approx(outside / sum(n))
    # where PPO would clip (rho in the band's outer part for A > 0 past 1 + eps_high) DIS masks instead: not equal
    clip_loss, _, _ = run(logp, gen, adv, mask, agg=agg)
    assert abs(clip_loss - loss) > 1e-6


def test_dis_refuses_a_second_off_policy_correction():
    logp, gen, adv, mask = make_batch()
    with pytest.raises(ValueError, match="needs icepop_beta and tis_cap null"):
        run(logp, gen, adv, mask, agg="token-mean", surrogate="dis", icepop_beta=2.0)
    with pytest.raises(ValueError, match="unknown surrogate"):
        run(logp, gen, adv, mask, agg="token-mean", surrogate="ppo")


# --- on-policy distillation -----------------------------------------------------------------

@pytest.mark.parametrize("outcome", [False, True])
@pytest.mark.parametrize("agg", MODES)
def test_distillation_advantages_through_the_clipped_surrogate_and_icepop_match_float64(outcome, agg):
    """Each token's advantage is coef * (log pi_teacher - log pi_theta) (+ its sequence's outcome advantage),
    written out by hand; through policy_loss with the PPO clip and IcePop active it gives the hand reference's
    loss and gradient, the advantage held constant (the policy's logprob inside it is detached)."""
    logp, gen, adv, mask = make_batch(seed=6, spread=0.8)
    teacher = gen + 1.5 * torch.randn(gen.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    a, kl = grpo.distill_advantages(teacher, logp.clone().requires_grad_(True), 0.5, adv if outcome else None)
    want = [[0.5 * (teacher[i, t].item() - logp[i, t].item()) + (adv[i].item() if outcome else 0.0) for t in range(7)]
            for i in range(5)]
    assert_close(a, want)
    assert_close(kl, (logp - teacher).tolist())
    assert not a.requires_grad and not kl.requires_grad
    keep = [[1.0 if 0.5 <= math.exp(x - y) <= 2.0 else 0.0 for x, y in zip(rx, ry)] for rx, ry in zip(logp.tolist(), gen.tolist())]
    loss, grad, m = run(logp, gen, a, mask, agg=agg, icepop_beta=2.0)
    ref, ref_grad = ref_loss(logp.tolist(), gen.tolist(), want, mask.tolist(), agg, weight=keep)
    assert_close(loss, ref)
    assert_close(grad, ref_grad)
    assert 0 < sum(1 - k for row in keep for k in row) and m["clip_frac_low"] + m["clip_frac_high"] > 0  # both bind


def test_distillation_advantage_is_finite_where_the_teacher_finds_a_token_impossible():
    """A log-ratio of 1000 nats (a token the teacher gives probability ~0) is clamped like every other one: a large
    push, never inf or NaN."""
    logp = torch.tensor([[-0.1, -2.0]], dtype=torch.float64)
    teacher = torch.tensor([[-1000.0, float("-inf")]], dtype=torch.float64)
    a, kl = grpo.distill_advantages(teacher, logp, 1.0)
    assert a.tolist() == [[-grpo.LOG_RATIO_CLAMP] * 2] and kl.tolist() == [[grpo.LOG_RATIO_CLAMP] * 2]
    loss, grad, _ = run(logp, logp.clone(), a, torch.ones(1, 2))
    assert math.isfinite(loss) and torch.isfinite(grad).all()


def test_a_constant_group_gets_exactly_zero_advantages_whatever_float32_rounds():
    """A constant group has no signal: its advantages are 0 exactly, also where float32 rounds its mean (the std's eps
    would blow the rounding residue up to ~0.2 of an advantage). Reference: the float64 formula."""
    for value, g in ((3.7, 16), (0.1, 8), (999999.9, 8), (1.0, 6)):
        assert grpo.group_advantages([value] * g, g).abs().max() == 0.0
    rewards = [3.7] * 4 + [0.0, 1.0, 1.0, 0.0]
    r = torch.tensor(rewards, dtype=torch.float64).view(2, 4)
    want = torch.cat([torch.zeros(4), ((r[1] - r[1].mean()) / (r[1].std() + 1e-6)).float()])
    torch.testing.assert_close(grpo.group_advantages(rewards, 4), want)
