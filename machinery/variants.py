"""
What train.rl_step adds to the objective when a variant is on, each through calls named for it (a line each, not
interleaved with the formula): the KL reference's log-probs (grpo.kl_coef: reference_logprobs) and the KL guard's
lr scale (grpo.kl_guard: kl_guard_scale), on-policy distillation's samples and per-token advantages (distill.teacher:
keep_cut keeps the cut ones, distill; rl_step calls them only with a teacher), routing replay's diagnostics (an MoE
model: routing_metrics per micro-batch, routing_ratios at the end), and the dummy micro-batch a rank runs to keep in
step with a busier one (several processes: its rows parallel.dummy_rows, then dummy_micro_batch). With a variant off
each call returns at once: None (reference_logprobs), 1.0 (kl_guard_scale) or {} (routing_metrics, routing_ratios). The learner's forward, train.packed_forward, is handed in: the machinery
never imports a chapter above it.
"""
import torch

import grpo
from families import mtp
from machinery.parallel import autocast, dummy_rows, learner_backward, unwrap, world

ROUTING_PROBE_SAMPLES = 32  # routing_metrics' extra forward: this many samples of each rank's first micro-batch at most
SAID = set()  # the console lines said once per process (routing_metrics': "unrecorded")


def reference_logprobs(ref_model, parts, forward, temperature, like):
    """[N] log pi_ref of the batch's scored tokens (like gen_logp: sample after sample), no grad, before the update;
    None without a reference model. parts: the step's (k, MicroBatch or None) micro-batches."""
    if ref_model is None:
        return None
    ref_logp = torch.zeros_like(like)
    with torch.no_grad(), autocast(like.device):
        for _, mb in parts:  # every rank runs every micro-batch, a dummy one too (FSDP's gathers are collectives)
            lp = forward(ref_model, mb.rows if mb else dummy_rows(ref_model), temperature)[0]
            if mb:
                ref_logp[mb.tokens] = lp
    return ref_logp


def mtp_loss(net, trunk, ids, pos, where, scale, temperature):
    """Training the MTP layers (model.mtp_layers, model.mtp_loss_scale > 0) beside a stage's objective, from one
    forward: trunk [1, L, hidden] (the trunk's states at every position, before the final norm: the MTP layers read
    every position, the prompt's too) -> (the model's hidden states [1, N, hidden] at the kept positions `where`, as
    packed_forward needs them, and families/mtp.mtp_loss over the row's scored tokens, each predicted two ahead
    from the position before the one that predicts it). The trunk is detached: only the MTP layers learn from it, and
    the policy's gradient stays the stage's own (RL: GRPO's; SFT: the next-token loss). temperature: the step's
    (RL: the rollout's, at which its tokens were sampled and the engine drafts; SFT: 1)."""
    targets = torch.zeros_like(ids, dtype=torch.bool)
    targets[0, where + 1] = True  # [1, L]: the scored tokens, what the MTP layers learn to draft
    return net.norm(trunk[:, where]), mtp.mtp_loss(net, trunk, ids, targets, pos, detach_trunk=True, scale=scale,
                                                       temperature=temperature)


def mtp_share(loss, n, n_rank, sums):
    """A micro-batch's MTP loss (a mean over its n scored tokens) as its share of the step's: n / n_rank of this
    rank's tokens, and 1 / world() so that the ranks' parts (learner_backward multiplies by world(), DDP averages)
    add up to the mean over ranks. Summed into sums["mtp_loss"] times n (train/mtp_loss: a token mean, as the
    other metrics)."""
    sums["mtp_loss"] = sums.get("mtp_loss", 0.0) + loss.detach() * n
    return loss * n / n_rank / world()


def keep_cut(samples, adv):
    """On-policy distillation's choice of the samples the loss trains on, from the fresh samples and adv [S] (their
    groups'): all but the masked (rollout.truncated: mask, void turns), as without a teacher, except that a sample
    masked because the length limit cut it stays, at outcome advantage 0: the teacher scored each of its tokens, a
    per-token signal that the cut does not turn into noise the way it does the outcome's reward (a void trajectory
    still leaves: the env voided all of it). -> (the kept samples' indices, adv [S] with the cut ones' set to 0)."""
    cut = [s.masked and s.finish_reason == "length" for s in samples]
    kept = [i for i, s in enumerate(samples) if not s.masked or cut[i]]
    return kept, adv.masked_fill(torch.tensor(cut, dtype=torch.bool), 0.0)  # [S]: a cut one's outcome 0


def distill(adv, mb, logp, teacher_logp, d, sums):
    """On-policy distillation (grpo.distill_advantages): with a teacher, the micro-batch's advantages become per token,
    [B, T] = coef * (log pi_teacher - log pi_prox) (+ the outcome's [B] with distill.outcome), and the reverse KL to the
    teacher is summed into sums["distill_kl"]. Without one (teacher_logp None), adv [B] as it is."""
    if teacher_logp is None:
        return adv
    adv, kl = grpo.distill_advantages(mb.pad(teacher_logp[mb.tokens]), mb.pad(logp), d.coef, adv if d.outcome else None)
    sums["distill_kl"] = sums.get("distill_kl", 0.0) + kl[mb.mask].sum()
    return adv


def dummy_micro_batch(model, logp, last, first, forward, temperature, mtp_loss=None):
    """A rank with fewer micro-batches than another runs the same collectives at weight 0 (logp, mtp_loss: its forward
    over parallel.dummy_rows): a zero backward (through the MTP layers too, where they train: DDP reduces every
    gradient) and, on an MoE model, routing_metrics' extra forward."""
    learner_backward(model, logp.sum() * 0.0 + (0.0 if mtp_loss is None else mtp_loss * 0.0), last)
    if first and unwrap(model).cfg.moe is not None:
        with torch.no_grad():
            forward(model, dummy_rows(model), temperature)


def routing_metrics(model, mb, routing, gap, gen_logp, temperature, sums, first, forward):
    """MoE diagnostics, summed like the step's other metrics ({} for a dense model, routing None): routing/agree
    (tokens x MoE layers whose learner top-k set equals the generator's, from the training forward itself) and, on a
    probe of each rank's first micro-batch (at most ROUTING_PROBE_SAMPLES samples spread over it), the learner-generator
    gap |log pi_learner - log pi_gen| with replay and without, the second from one more forward (no grad) that routes
    the other way: the price of the computation routing replay avoids, measured on a sample to keep it cheap. And
    routing/unrecorded, the share of the step's samples that carried no generator routes (MicroBatch.routing routes
    their tokens afresh, replay or not, and leaves them out of routing/agree), said on the console the first time."""
    if routing is None:
        return {}
    agree, seen = (torch.stack(t).sum(0) for t in zip(*routing.agree))
    unrecorded = mb.unrecorded()
    if unrecorded and "unrecorded" not in SAID:
        SAID.add("unrecorded")
        print(f"[train] {unrecorded} of a micro-batch's {len(mb.samples)} samples carry no generator routes: their "
              "tokens route afresh, replay or not (routing/unrecorded counts them in every step; said once)", flush=True)
    out = {"routing_agree": sums.get("routing_agree", 0.0) + agree, "routing_seen": sums.get("routing_seen", 0.0) + seen}
    for name, n in (("routing_samples", len(mb.samples)), ("routing_unrecorded", unrecorded)):  # (on the device, as
        out[name] = sums.get(name, 0.0) + torch.tensor(float(n), device=gap.device)  # the others: one host sync)
    if first:
        probe, mine = mb.probe(ROUTING_PROBE_SAMPLES)  # mine [N_probe]: its tokens among mb's
        with torch.no_grad(), autocast(gap.device):  # in the training forward's precision (bf16 autocast on GPU)
            other = forward(model, probe.rows, temperature, routing=probe.routing(not routing.apply))[0]
        gaps = {routing.apply: gap[mine], not routing.apply: (other - gen_logp[probe.tokens]).abs()}
        out |= {"routing_gap_replay": gaps[True].sum(), "routing_gap_fresh": gaps[False].sum(),
                "routing_gap_tokens": torch.tensor(float(len(mine)), device=gap.device)}
    return out


def routing_ratios(total):
    """routing/* from routing_metrics' sums over every rank ({} for a dense model): ratios of their own sums; with no
    recorded route anywhere in the step (nothing replayed, nothing to agree with) routing/unrecorded alone (1.0)."""
    if "routing_samples" not in total:
        return {}
    out = {"routing/unrecorded": total["routing_unrecorded"] / max(1, total["routing_samples"])}
    if not total["routing_seen"]:
        return out
    return out | {"routing/agree": total["routing_agree"] / total["routing_seen"],
                  **{f"routing/logp_diff_mean_{w}": total[f"routing_gap_{w}"] / max(1, total["routing_gap_tokens"])
                     for w in ("replay", "fresh")}}


def kl_guard_scale(guard, metrics, on):
    """The KL guard (grpo.KLGuard, with a reference model: on): the lr's scale this step, fed the step's train/kl, its
    state added to metrics; 1.0 without one."""
    if not on:
        return 1.0
    scale = guard.update(metrics["train/kl"])
    metrics.update({"kl_guard/scale": scale, "kl_guard/fired": float(guard.fired), "kl_guard/kl_mean": guard.window_mean})
    return scale
