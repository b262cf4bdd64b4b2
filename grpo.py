"""
GRPO, the objective: pure functions over tensors. No models, no data, no threads.

For one prompt we sample a group of G responses o_1..o_G and grade them, r_1..r_G. A response's
advantage is how much better it did than its siblings, so no value network is needed:

    A_i = (r_i - mean(r)) / (std(r) + eps)        GRPO (std_normalize=False drops the std: Dr.GRPO)

Every response token t is trained with the PPO clipped surrogate, asymmetric clip ("clip higher"):

    rho_it = pi_theta(o_it | q, o_i<t) / pi_gen(o_it | q, o_i<t)
    l_it   = c_it * max(-A_i rho_it, -A_i clip(rho_it, 1 - eps_low, 1 + eps_high))
    L      = 1/|B| sum_i 1/|o_i| sum_t l_it  +  kl_coef * KL(pi_theta || pi_ref)  -  entropy_coef * H

(written in the default "seq-mean-token-mean" aggregation; see `aggregate` for the others).

Asynchronous RL brings three policies. pi_gen sampled the tokens: at most max_staleness weight versions
old (rollout.py tells how), and a different kernel stack (on a GPU a bf16 inference engine vs. the trainer).
pi_prox is the learner's own policy at the start of the step (its forward's logprobs, detached: with
one optimizer step per batch no extra pass is needed). pi_theta is the policy being optimised, equal to
pi_prox in value but carrying the gradient. The clipped ratio is rho = pi_theta / pi_gen: the trust region is held against the policy that
sampled, as PPO's surrogate requires. (Decoupled PPO, as in AReaL, clips pi_theta / pi_prox and weights
by pi_prox / pi_gen; with one step per batch that clip can never bind, since pi_theta = pi_prox, and
nothing would stop a stale batch from pushing the policy far from its sampler.) Where the clip is not
active the ascent direction (minus the loss's gradient) is A * rho * grad log pi_theta = A * w * grad log
pi_theta, w = pi_prox / pi_gen: the importance weight is already in it. The off-policy corrections act on that
mismatch w through c:
  none    c = 1;
  TIS     c = min(w, cap) / w: the weight w becomes min(w, cap) (truncated importance sampling);
  IcePop  c = 0 where w is outside [1/beta, beta] (the mismatch is too large to trust), else 1, so
          in-band tokens keep their importance weight w (GLM-5, IcePop, slime's icepop_function).
GLM-5's direct double-sided importance sampling (surrogate "dis") replaces the clipped surrogate: with one
optimizer step per batch rho equals w in value, so DIS is IcePop with the band [1 - eps_low, 1 + eps_high]
on rho and no PPO clip: l = -A rho where rho is in the band, 0 (masked, not clipped) where it is not.
Log-ratios are clamped to +-20 before exp: one token the policies disagree on wildly must give a huge
but finite number, never inf. Whole samples older than max_staleness versions are dropped before any of
this (`fresh_mask`, a guard: the generator's gate already keeps them fresh), and groups whose rewards
all agree have A = 0 and teach nothing (`informative`, dynamic sampling).

On-policy distillation (`distill_advantages`, at the end of the file) swaps the one-number-per-response
advantage for a teacher's per-token one, through the same surrogate and corrections.

Shapes: B sequences (one per row of a [B, T] tensor, right padded: not train.py's packed rows), T tokens; `mask` is
1 on response tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

AGG_MODES = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum")
SURROGATES = ("clip", "dis")
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
LOG_RATIO_CLAMP = 20.0  # |log pi / pi'| before exp (as verl and slime clamp)


@dataclass
class GRPOConfig:
    """The objective's settings (the `grpo:` section of a config). A new loss knob is a field here, its
    use in policy_loss, and its range in config.py's RULES (every value is checked at start-up)."""
    # clip: the PPO surrogate, rho clipped to [1 - eps_low, 1 + eps_high]. dis: GLM-5's direct double-sided
    # importance sampling, tokens with rho outside that band masked instead (needs icepop_beta and tis_cap null)
    surrogate: str = "clip"
    eps_low: float = 0.2  # clip rho = pi_theta / pi_gen below 1 - eps_low (dis: mask it) ...
    eps_high: float = 0.28  # ... and above 1 + eps_high ("clip higher")
    dual_clip: float | None = None  # cap the loss of A < 0 tokens at -A * dual_clip (> 1)
    agg: str = "seq-mean-token-mean"  # one of AGG_MODES
    std_normalize: bool = True  # advantages divided by the group's std (False: Dr.GRPO)
    tis_cap: float | None = None  # TIS: the importance weight pi_prox / pi_gen capped at this
    icepop_beta: float | None = 2.0  # IcePop: drop tokens with pi_prox / pi_gen outside [1/beta, beta]
    kl_coef: float = 0.0  # KL(pi_theta || pi_ref) weight; > 0 needs a reference model
    kl_estimator: str = "low_var_kl"  # one of KL_ESTIMATORS
    entropy_coef: float = 0.0  # entropy bonus weight
    kl_guard: bool = False  # scale the lr down while the windowed KL to the reference is high (KLGuard)
    kl_guard_threshold: float = 0.15  # ... fires while the windowed mean KL is above this
    kl_guard_factor: float = 0.6  # ... multiplying the lr by this at every step while it fires (compounding)
    kl_guard_window: int = 10  # ... over this many steps

# -----------------------------------------------------------------------------
# Advantages, and the staleness guard applied before the loss (variants of the advantage: the end of the file)


def group_advantages(rewards, group_size, std_normalize=True, eps=1e-6):
    """[N] rewards -> [N] advantages; group g is rows g*G .. g*G+G-1 (contiguous). train.rl_step calls it once per
    group, with G its current size (a group may have lost stale or failed samples).
    std is torch.std's default (unbiased, N-1), as in slime and verl. A constant group gets 0."""
    r = torch.as_tensor(rewards).float()
    if r.ndim != 1 or group_size < 1 or r.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} rows, got {tuple(r.shape)}")
    r = r.view(-1, group_size)  # [num_groups, G]
    adv = r - r.mean(dim=1, keepdim=True)
    if std_normalize and group_size > 1:  # one sample has no spread; its advantage is 0 anyway
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    # exactly 0 for a constant group: a mean that float32 rounds ([3.7] * 16) would leave residues, and the std's
    # eps would blow them up to ~0.2
    return torch.where((r == r[:, :1]).all(dim=1, keepdim=True), 0.0, adv).view(-1)


def fresh_mask(sample_versions, current_version, max_staleness):
    """[N] bool: keep samples at most `max_staleness` weight versions behind the learner.
    A partial rollout spans several versions (generation paused, weights swapped, resumed); the caller
    passes the OLDEST version a sample touched, so staleness is bounded for every token in it.
    max_staleness = 0 is the synchronous baseline. The learner applies it as a guard: the generator's
    staleness gate (rollout.py) already holds every sample to this bound."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    v = torch.as_tensor(sample_versions, dtype=torch.long)
    return (current_version - v) <= max_staleness


# -----------------------------------------------------------------------------
# Aggregation: how per-token terms become one number. This choice changes what is optimised.
#   seq-mean-token-mean  every sequence weighs the same, long ones are diluted per token (GLM-5)
#   token-mean           every token weighs the same, long responses dominate (DAPO)
#   seq-mean-token-sum   no length normalisation, no length bias in the gradient (Dr.GRPO; they
#                        divide by a constant max length, here folded into the learning rate)
#
# The learner splits a global batch into micro-batches (and across ranks) and sums their gradients.
# A plain mean per micro-batch would weight micro-batches equally instead of sequences/tokens. So the
# learner first sums `loss_denominator` over the whole global batch and passes it as `loss_scale`;
# each micro-batch loss is then (its partial sum) / (global count), and the micro-batch losses add up
# to exactly the whole-batch loss. For seq modes the per-sequence mean needs nothing global: a
# sequence never straddles micro-batches. (DDP/FSDP average gradients over ranks rather than sum
# them, so with loss_scale counted over all ranks the learner multiplies the loss by world size.)


def loss_denominator(mask, agg):
    """The count that the final mean divides by: sequences with any response token (seq modes) or
    response tokens (token-mean). Sum it over the global batch to get `loss_scale`."""
    m = mask.bool()
    if agg == "token-mean":
        return int(m.sum())
    if agg in ("seq-mean-token-mean", "seq-mean-token-sum"):
        return int(m.any(dim=-1).sum())
    raise ValueError(f"unknown agg {agg!r}; expected one of {AGG_MODES}")


def aggregate(values, mask, agg, loss_scale=None):
    """[B, T] per-token values -> scalar. Masked positions are ignored even if they hold NaN."""
    m = mask.bool()
    if loss_scale is None:
        denom = max(loss_denominator(m, agg), 1)  # an empty batch gives 0, not NaN
    elif loss_scale > 0:
        denom = loss_scale
    else:
        raise ValueError(f"loss_scale must be > 0, got {loss_scale}")
    values = torch.where(m, values, 0.0)
    if agg == "seq-mean-token-mean":
        per_seq = values.sum(dim=-1) / m.sum(dim=-1).clamp(min=1)  # [B], empty rows give 0
        return per_seq.sum() / denom
    return values.sum() / denom  # token-mean and seq-mean-token-sum differ only in denom


# -----------------------------------------------------------------------------
# The loss


def policy_loss(logp, gen_logp, advantages, mask, cfg: GRPOConfig, prox_logp=None, ref_logp=None, entropy=None,
                loss_scale=None):
    """Clipped GRPO loss for one (micro-)batch. Returns (loss, metrics as 0-dim tensors).

    logp [B, T] carries the gradient (and `entropy` [B, T], when the bonus is on); every other tensor is
    detached here. gen_logp [B, T]: the sampler's logprobs. prox_logp [B, T]: pi_prox; None means logp
    itself (one optimizer step per batch: the learner's forward is the step's starting policy).
    advantages are [B] (one per sequence) or [B, T].
    Metric semantics: "pg_loss" is aggregated like the loss (so with loss_scale it sums across
    micro-batches); every other metric is a plain mean over this call's response tokens
    ("mismatch_k3" is the k3 estimate of KL(pi_gen || pi_prox), the train/inference gap;
    "kl" is the chosen estimator vs pi_ref)."""
    check_loss_args(cfg, logp, gen_logp, mask, ref_logp, entropy)  # one-line errors for a bad config or shape

    # Padding may hold anything (garbage, -inf). Zeroing it before any exp keeps every intermediate
    # finite, so masked positions get exactly zero gradient instead of 0 * inf = NaN.
    m = mask.bool()  # [B, T]
    pad = ~m
    logp = logp.masked_fill(pad, 0.0)
    gen_logp = gen_logp.detach().to(logp.dtype).masked_fill(pad, 0.0)
    prox_logp = (logp if prox_logp is None else prox_logp).detach().masked_fill(pad, 0.0)
    adv = advantages.detach().to(logp.dtype)
    adv = (adv.unsqueeze(-1) if adv.ndim == 1 else adv).expand_as(logp).masked_fill(pad, 0.0)  # [B, T]

    ratio = torch.exp((logp - gen_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [B, T] rho = pi_theta / pi_gen
    lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    if cfg.surrogate == "dis":  # in the band: -A rho, unclipped; outside: masked (still in the denominators)
        band = ((ratio >= lo) & (ratio <= hi)).detach()
        pg = -adv * ratio * band
    else:
        pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(lo, hi))  # [B, T]
    if cfg.dual_clip is not None:
        # With A < 0 the max() above is unbounded as the ratio grows (the policy already made a
        # bad token far more likely than pi_gen did); cap it at -A * c so one token cannot dominate.
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * cfg.dual_clip), pg)

    log_w = (prox_logp - gen_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, T] log pi_prox / pi_gen
    w = torch.exp(log_w)
    c = torch.ones_like(w)  # [B, T], detached off-policy factor
    if cfg.tis_cap is not None:
        c = c * w.clamp(max=cfg.tis_cap) / w
    if cfg.icepop_beta is not None:
        # Dropped tokens stay in the denominators, so the loss scale does not depend on how many
        # tokens happened to be dropped this step.
        keep = (w >= 1.0 / cfg.icepop_beta) & (w <= cfg.icepop_beta)
        c = c * keep
    pg = pg * c

    pg_loss = aggregate(pg, m, cfg.agg, loss_scale)
    loss = pg_loss
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp.detach().masked_fill(pad, 0.0), cfg.kl_estimator)  # [B, T]
        if cfg.kl_coef:
            loss = loss + cfg.kl_coef * aggregate(kl, m, cfg.agg, loss_scale)
    if entropy is not None:
        entropy = entropy.masked_fill(pad, 0.0)
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * aggregate(entropy, m, cfg.agg, loss_scale)

    with torch.no_grad():  # 0-dim tensors: the caller reads them all with one host sync
        n = m.sum().clamp_min(1)
        token_mean = lambda x: torch.where(m, x, 0.0).sum() / n
        metrics = {
            "pg_loss": pg_loss.detach(),
            "clip_frac_low": token_mean(((adv < 0) & (ratio < lo)).float()),
            "clip_frac_high": token_mean(((adv > 0) & (ratio > hi)).float()),
            "ratio_mean": token_mean(ratio),
            "mismatch_k3": token_mean(kl_penalty(gen_logp, prox_logp, "k3")),
        }
        if cfg.surrogate == "dis":
            metrics["dis_masked_frac"] = token_mean((~band).float())
        if cfg.dual_clip is not None:
            metrics["dual_clip_frac"] = token_mean(((adv < 0) & (ratio > cfg.dual_clip)).float())
        if cfg.tis_cap is not None:
            metrics["is_weight_mean"] = token_mean(w.clamp(max=cfg.tis_cap))
        if cfg.icepop_beta is not None:
            metrics["icepop_masked_frac"] = token_mean((~keep).float())
        if ref_logp is not None:
            metrics["kl"] = token_mean(kl)
        if entropy is not None:
            metrics["entropy"] = token_mean(entropy)
    return loss, metrics


def check_loss_args(cfg: GRPOConfig, logp, gen_logp, mask, ref_logp, entropy):
    """policy_loss's arguments, checked before any arithmetic (config.py checks the config's ranges at start-up;
    this catches a direct caller's mistakes)."""
    if cfg.agg not in AGG_MODES:
        raise ValueError(f"unknown agg {cfg.agg!r}; expected one of {AGG_MODES}")
    if cfg.surrogate not in SURROGATES:
        raise ValueError(f"unknown surrogate {cfg.surrogate!r}; expected one of {SURROGATES}")
    if cfg.surrogate == "dis" and (cfg.icepop_beta is not None or cfg.tis_cap is not None):
        raise ValueError("surrogate dis is its own off-policy correction: it needs icepop_beta and tis_cap null")
    if cfg.dual_clip is not None and cfg.dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {cfg.dual_clip}")
    if cfg.kl_coef and ref_logp is None:
        raise ValueError("kl_coef > 0 needs ref_logp")
    if cfg.entropy_coef and entropy is None:
        raise ValueError("entropy_coef > 0 needs entropy")
    if logp.shape != gen_logp.shape or logp.shape != mask.shape:
        shapes = [tuple(x.shape) for x in (logp, gen_logp, mask)]
        raise ValueError(f"logp, gen_logp and mask must have one [B, T] shape, got {shapes}")


# -----------------------------------------------------------------------------
# Per-token quantities computed from logits (the caller runs the model): train.packed_forward's log-probs,
# the KL estimators of policy_loss


def token_logprobs(logits, target_ids, entropy=False):
    """[..., V] logits, [...] ids -> [...] log p(target), in float32 whatever the logits' dtype.
    bf16 log-probs are too coarse for ratios near 1. log_softmax subtracts the max before the lse, so
    large logits keep their precision (gather(logits) - logsumexp(logits) would not). With a 150k
    vocabulary the caller should chunk over tokens: each chunk costs one float32 [chunk, V] tensor.
    entropy=True: also the entropy H = -sum_v p log p [...], from the same log_softmax (one pass over V);
    log p stays finite where p underflows to 0, so H and its gradient do too."""
    logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    target = logp.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
    return (target, -(logp.exp() * logp).sum(-1)) if entropy else target


def kl_penalty(logp, ref_logp, kind="k3"):
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta (Schulman's k1/k2/k3).
    k1 is unbiased but can go negative; k2 is biased, low variance; k3 ("low_var_kl") is unbiased,
    always >= 0. k3 exponentiates a log-ratio, so it is clamped twice (as verl does) to survive the
    rare token where the two policies disagree wildly."""
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind in ("k3", "low_var_kl"):
        x = (-log_ratio).clamp(-20.0, 20.0)  # log(pi_ref / pi_theta)
        return (torch.exp(x) - x - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown kl estimator {kind!r}; expected one of {KL_ESTIMATORS}")


# ============================================================================= beyond one default RL step
# The default run builds a KL guard and checkpoints its state, which stays empty; the rest of this file serves
# variants: the guard's brake, dynamic sampling's test and on-policy distillation's advantages.

# -----------------------------------------------------------------------------
# KL guard: a brake on the learning rate when the policy drifts from the reference too fast


@dataclass
class KLGuard:
    """Feed it the policy's KL to the reference once per step; multiply the lr by what it returns.

    Rule: while the mean of the last `window` values (fewer at the start) is above `threshold`, the
    scale is multiplied by `factor` at every step (so it compounds: 0.6, 0.36, ..., floored at
    `min_scale`) and `fired` is True for that step. As soon as the mean is back at or below the
    threshold the scale returns to 1.0. Disabled, it still tracks the mean but always returns 1.0."""
    threshold: float = 0.15
    factor: float = 0.6
    window: int = 10
    enabled: bool = False
    min_scale: float = 1e-3
    history: list = field(default_factory=list, init=False)
    scale: float = field(default=1.0, init=False)
    fired: bool = field(default=False, init=False)
    num_fired: int = field(default=0, init=False)

    def __post_init__(self):
        assert self.threshold > 0, f"KLGuard threshold must be > 0, got {self.threshold}"
        assert 0 < self.factor <= 1, f"KLGuard factor must be in (0, 1], got {self.factor}"
        assert self.window >= 1, f"KLGuard window must be >= 1, got {self.window}"
        assert 0 < self.min_scale <= 1, f"KLGuard min_scale must be in (0, 1], got {self.min_scale}"

    def state_dict(self):
        return {"history": list(self.history), "scale": self.scale, "fired": self.fired, "num_fired": self.num_fired}

    def load_state_dict(self, state):
        self.history = [float(x) for x in state["history"]][-self.window:]
        self.scale = float(state["scale"])
        self.fired = bool(state["fired"])
        self.num_fired = int(state["num_fired"])

    @property
    def window_mean(self):
        return sum(self.history) / len(self.history) if self.history else 0.0

    def update(self, kl):
        self.history = (self.history + [float(kl)])[-self.window:]
        self.fired = self.enabled and self.window_mean > self.threshold
        if self.fired:
            self.scale = max(self.scale * self.factor, self.min_scale)
            self.num_fired += 1
        else:
            self.scale = 1.0
        return self.scale


# -----------------------------------------------------------------------------
# Variants of the advantage: dynamic sampling's test, on-policy distillation's per-token advantages


def informative(rewards) -> bool:
    """A group (its samples' rewards) with at least two different rewards. The others have A = 0 for
    every token, so they cost compute and shrink the effective batch; DAPO drops them and refills. A NaN is
    no value (it is unequal even to itself, so a set would count each NaN apart); machinery/env.py (reward_value) fails a
    trajectory with a non-finite reward before it gets here."""
    return len({r for r in rewards if not math.isnan(r)}) > 1


def distill_advantages(teacher_logp, logp, coef, outcome=None):
    """On-policy distillation (Agarwal et al.'s GKD, Thinking Machines' on-policy distillation, slime's OPD): the
    [B, T] advantages coef * (log pi_teacher(o_t) - log pi_prox(o_t)) of the tokens the policy sampled, plus the
    outcome advantages outcome [B] (one per sequence; None: distillation alone). Returns (advantages [B, T], the
    per-token reverse-KL estimate log pi_prox - log pi_teacher [B, T]).

    Both log-probs are at the sampling temperature, and logp is the learner's own (pi_prox, detached here): the
    token's advantage is how much more the teacher likes it than the policy being trained does, so its mean over the
    policy's samples is -coef * KL(pi_theta || pi_teacher), the reverse KL that the gradient lowers (mode seeking:
    the student drops what the teacher would not say rather than spreading over everything it might). The samples
    come from pi_gen, up to max_staleness versions older: the surrogate's importance weight and IcePop correct that.
    The log-ratio is clamped like every other one here: a token the teacher finds impossible must give a large but
    finite push, never inf."""
    kl = (logp.detach() - teacher_logp.to(logp.dtype)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, T]
    adv = -coef * kl
    return (adv if outcome is None else adv + outcome.to(adv.dtype).unsqueeze(-1)), kl
