"""
GRPO for GLM models the way GLM-5 trains them. This file is the algorithm: the stages, the RL step and the
loop. rollout.py makes the batches; machinery/ holds the plumbing, reached through a few calls: startup.start
(config, data, weights, engine), parallel (ranks, FSDP2/DDP, micro-batches, the optimizer step, the weights a
publish sends), checkpoint (saves, resume, the KL reference), variants (what a variant adds to a step), colocate
(one GPU for both halves), lora (adapters), teacher (distillation). In the default run (one process) parallel's
collectives are the identity, and variants, colocate, lora and teacher change nothing.

    python train.py                                      # configs/tiny_cpu.yaml: a tiny DSA model, CPU, minutes
    python train.py --config configs/glm9b_math.yaml     # GLM-Z1-9B-0414 on dapo-math-17k
    python train.py --config configs/glm9b_math_1gpu.yaml   # the same on one H100: LoRA, co-located
    python train.py rollout.temperature=0.8 run_dir=runs/t08     # any key.sub=value overrides the YAML
    python train.py --resume run_dir=runs/t08            # continue the run from its own config and checkpoint
    python train.py --config configs/glm9b_math.yaml --dry-run   # parameter count + per-GPU memory plan
    python train.py train.pairs=2                        # the multi-process path on one CPU (gloo)
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        train.py --config configs/glm9b_math.yaml        # several machines (run_dir on shared storage)

One run goes through up to three stages, each skipped when its step count is 0:
  1. dsa_warmup  only the DSA indexer trains, to imitate the (dense) attention of a frozen model;
  2. sft         supervised warm-up on reference responses (a random model has no reward signal yet);
                 on a DSA model this is also the sparse stage: top-k attention on, indexer KL on;
  3. rl          asynchronous GRPO. A generator thread (rollout.py) samples and grades groups with its
                 own copy of the weights; the learner pops a batch, trains one step on it and publishes
                 the new weights. Batch i is sampled by weights max(0, i - max_staleness) (rollout.py says when).
                 Co-located (train.colocate) one GPU serves both in turn, synchronously, each half's memory out
                 during the other's. With distill.teacher (on-policy distillation) a frozen teacher beside the
                 engine scores every sampled token, and each token's advantage becomes how much more the teacher
                 likes it than the policy does (grpo.distill_advantages), with or without GRPO's.

Each process (one per generator/learner GPU pair) generates and trains its own share of the batch; every
loss below is a partial sum over the global batch's denominator, so the ranks' gradients add up to that of
one process on the whole batch.

Simplified on purpose: one optimizer step per batch (no PPO epochs), constant learning rates after an
optional linear warm-up (which the optional KL guard may scale down), and the learner keeps fp32 master
weights (bf16 compute on GPU) because bf16 weights would round an lr-1e-6 update away.
"""
import functools
import itertools
import os
import sys
import time

import torch
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

import data
import grpo
from machinery import colocate, lora, startup, variants
from machinery.teacher import load_teacher
from machinery.checkpoint import Preempted, reference_model, restore, resumed, run_main, save_checkpoint
from machinery.config import LOGIT_CHUNK, LOGIT_KEEP_BYTES, Config
from machinery.parallel import (Skips, autocast, combine_ranks, dummy_rows, full_weights, global_sum, learner_backward,
                                loss_metrics, micro_batches, optimizer_step, packed_micro_batches, parallel_learner, rank,
                                set_threads, unwrap, world)
from rollout import Generator, accuracy_line, run_eval, sampling_params, sft_rows, single_turn

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "tiny_cpu.yaml")


# ----------------------------------------------------------------------------- the learner's forward


def _chunk_logprobs(lm_head, h, targets, temperature, entropy):
    logits = lm_head(h).float() / temperature  # [c, V]: what the generator sampled from
    if entropy is None:
        return grpo.token_logprobs(logits, targets), None
    logp, ent = grpo.token_logprobs(logits, targets, entropy=True)  # one log_softmax for both
    return logp, ent if entropy == "grad" else ent.detach()  # the metric alone needs no backward


def packed_forward(model, rows, temperature=1.0, indexer_loss=None, logprobs=True, entropy=None, routing=None, mtp=0.0):
    """One forward over several sequences packed into a single row, without padding.
    rows: [(token ids, spans)], spans the (start, length) runs of tokens to score: a response after its prompt,
    or a multi-turn trajectory's model turns. Position ids restart at 0 for every sequence, which is how model.py
    knows where one ends: no token attends across sequences, and attention costs sum_i L_i^2 (model.Packed).
    entropy: None (not needed), "metric" (no gradient) or "grad" (the loss has an entropy term). Returns
    (logprobs [N] of every scored token, the sequences one after the other; entropies [N] or None; indexer
    KL or None; MTP loss or None). routing (MoE): a mla_moe.Routing over the row, the generator's experts to replay
    (MicroBatch.routing). mtp: model.mtp_loss_scale, where the model's MTP layers train (variants.mtp_loss)."""
    net = unwrap(model)  # model may be DDP/FSDP-wrapped: call it, but reach its lm_head directly
    device = net.embed_tokens.weight.device
    lengths = [len(seq) for seq, _ in rows]
    ids = torch.tensor([t for seq, _ in rows for t in seq], device=device)[None]  # [1, L]
    pos = data.spans([0] * len(rows), lengths, device)[None]  # [1, L]: 0 .. L_i - 1 for each sequence
    # Position j predicts token j+1, so a span of n tokens from index a of a sequence that starts at offset o
    # of the row is predicted at row positions o+a-1 .. o+a+n-2. Only those pass the last block's attention
    # (the other positions, env tokens included, are context only) and meet the [hidden, vocab] head.
    offsets = itertools.accumulate([0] + lengths)  # where each sequence starts in the row
    predicting = [(o + a - 1, n) for o, (_, spans) in zip(offsets, rows) for a, n in spans]
    where = (data.spans(*zip(*predicting), device) if logprobs and predicting
             else torch.zeros(0, dtype=torch.long, device=device))  # [N]; none for the indexer alone
    trunk = bool(mtp and net.cfg.mtp_layers)  # the MTP loss reads the trunk's states at every position
    out = model(ids, position_ids=pos, indexer_loss=indexer_loss, return_hidden="trunk" if trunk else True,
                keep=None if trunk else where, routing=routing)
    hidden, kl = out if indexer_loss is not None else (out, None)  # [1, N, hidden]
    hidden, mtp_loss = variants.mtp_loss(net, hidden, ids, pos, where, mtp, temperature) if trunk else (hidden, None)
    if not logprobs:
        return None, None, kl, mtp_loss
    h, targets = hidden[0], ids[0, where + 1]  # [N, hidden], [N]: the token each kept position predicts
    logp, ent = [], []
    # Large logits are not kept for backward: each chunk's are made again there (activation checkpointing)
    recompute = torch.is_grad_enabled() and len(where) * net.cfg.vocab_size * 4 > LOGIT_KEEP_BYTES
    chunk = functools.partial(checkpoint, _chunk_logprobs, use_reentrant=False) if recompute else _chunk_logprobs
    for c in range(0, len(where), LOGIT_CHUNK):
        lp, en = chunk(net.lm_head, h[c:c + LOGIT_CHUNK], targets[c:c + LOGIT_CHUNK], temperature, entropy)
        logp.append(lp)
        ent.append(en)
    return torch.cat(logp), torch.cat(ent) if entropy else None, kl, mtp_loss


def lr_at(cfg: Config, base_lr, step):
    """Linear warm-up over a stage's first optim.warmup_steps. A fresh AdamW's first updates are sign(g) * lr for
    every weight (m / sqrt(v) = +-1 until v has history): with noisy RL gradients that alone can wreck a policy."""
    return base_lr * min(1.0, (step + 1) / max(1, cfg.optim.warmup_steps))


def adamw(cfg: Config, model, lr, weight_decay):
    """AdamW over the stage's trainable parameters; fused: one pass over every tensor (FSDP's DTensors too)."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=tuple(cfg.optim.betas),
                             weight_decay=weight_decay, fused=True)


# ----------------------------------------------------------------------------- stages 1 and 2: warm-ups


def train_warmup(stage, run: startup.Run):
    """dsa_warmup: the rest of the model frozen, the indexer minimises KL(attention || indexer) with dense attention.
    sft: next-token loss on the reference responses; with DSA, attention is top-k and the indexer learns from the KL
    over its selected keys, and MTP layers learn the same tokens (inputs detached: the losses train disjoint
    parameters). Every rank draws the same global batch and trains its share of it."""
    cfg, model, resume, log = run.cfg, run.model, run.resume, run.log
    steps = cfg.train.dsa_warmup_steps if stage == "dsa_warmup" else cfg.train.sft_steps
    indexer_only, device = stage == "dsa_warmup", model.lm_head.weight.device
    for name, p in model.named_parameters():
        p.requires_grad_(not indexer_only or ".indexer." in name)
    learner = parallel_learner(model, device, cfg.train.parallel)  # FSDP swaps in sharded parameters
    lr, wd = (cfg.optim.dsa_warmup_lr, cfg.optim.weight_decay) if indexer_only else (cfg.optim.sft_lr, cfg.optim.sft_weight_decay)
    optimizer = adamw(cfg, model, lr, wd)
    stream, tokens = data.PromptStream(run.train_examples, seed=cfg.seed), {}
    step, skips = resumed(resume, stage, "step", 0), Skips(cfg.optim.max_skipped_steps, *resumed(resume, stage, "skipped", (0, 0)))
    restore(resume, stage, learner, optimizer, stream)  # a stage resumed mid-way: optimizer state, prompt stream
    indexer_loss = "dense" if indexer_only else ("sparse" if model.cfg.dsa else None)
    mtp_scale = 0.0 if indexer_only else cfg.model.mtp_loss_scale  # sft: MTP layers learn the references' tokens too
    bar = tqdm(total=steps, initial=step, desc=stage, dynamic_ncols=True, disable=rank() != 0)
    while step < steps:
        t0 = time.perf_counter()
        batch = stream.next(cfg.train.warmup_batch_size)
        new = list({id(ex): ex for ex in batch if id(ex) not in tokens}.values())  # each example's tokens once
        tokens |= {id(ex): r for ex, r in zip(new, sft_rows(cfg, run.tokenizer, new, run.env_cls)) if r}  # (a trace plays its env)
        if not (rows := [tokens[id(ex)] for ex in batch if id(ex) in tokens]):
            raise ValueError("data.env: every supervised trace of a batch failed (the lines above say why)")
        n_answer = sum(n for _, spans in rows for _, n in spans)  # the LM loss: a mean over the model's tokens
        n_all = sum(len(s) for s, _ in rows)  # the indexer KL is a mean over all query tokens
        mine = data.split_across_ranks([len(s) for s, _ in rows], world())[rank()]  # this rank's share
        groups = [[mine[j] for j in mb] for mb in
                  data.pack_by_tokens([len(rows[i][0]) for i in mine], cfg.optim.max_tokens_per_micro_batch)]
        optimizer.zero_grad(set_to_none=True)
        nll_sum = kl_sum = mtp_sum = 0.0
        parts = micro_batches(learner, groups)
        for k, mb in parts:
            part = [rows[i] for i in mb] if mb is not None else dummy_rows(model)
            with autocast(device):
                logp, _, kl, mtp = packed_forward(learner, part, 1.0, indexer_loss, logprobs=not indexer_only, mtp=mtp_scale)
                nll = -logp.sum() / n_answer if logp is not None else torch.zeros((), device=device)
                kl = kl * sum(len(s) for s, _ in part) / n_all if kl is not None else torch.zeros((), device=device)
                mtp = mtp * sum(n for _, spans in part for _, n in spans) / n_answer if mtp is not None else torch.zeros((), device=device)
            learner_backward(learner, (nll + kl + mtp) * (mb is not None), last=k == len(parts) - 1)  # parts of global means
            if mb is not None:
                nll_sum, kl_sum, mtp_sum = nll_sum + float(nll.detach()), kl_sum + float(kl.detach()), mtp_sum + float(mtp.detach())
        nll_sum, kl_sum, mtp_sum = global_sum(nll_sum, kl_sum, mtp_sum)
        row = optimizer_step(optimizer, model, nll_sum + kl_sum + mtp_sum, cfg.optim.grad_clip, lambda: lr_at(cfg, lr, step))
        step += 1
        row |= {"perf/step_s": time.perf_counter() - t0, "perf/tokens_per_s": n_all / (time.perf_counter() - t0)}
        row |= {} if indexer_only else {"train/loss": nll_sum}
        row |= {"train/indexer_kl": kl_sum} if indexer_loss is not None else {}
        row |= {"train/mtp_loss": mtp_sum} if mtp_scale and model.cfg.mtp_layers else {}
        skips.update(stage, step, row | {"train/loss": nll_sum + kl_sum})
        row["train/skipped_steps"] = skips.total
        log.write(stage, step, row)
        bar.update(1)
        bar.set_postfix(loss=f"{kl_sum if indexer_only else nll_sum:.3g}")  # the indexer KL can be ~1e-4
        stop = run.preempt.requested()
        if step % cfg.train.save_every == 0 or step == steps or stop:
            save_checkpoint(cfg, learner, run.tokenizer, stage, step, optimizer, {"stream": stream.state_dict()},
                            skipped=skips.state())
        if stop:
            raise Preempted(run.preempt.signum, cfg.run_dir, f"{stage} step {step}")
    bar.close()
    for p in model.parameters():
        p.requires_grad_(True)


# ----------------------------------------------------------------------------- stage 3: RL


def rl_step(cfg: Config, model, ref_model, optimizer, guard, batch, version):
    """One GRPO update on this rank's rollout batch (all ranks step together); returns the step's metrics. Loss sums
    and token means are global; sample counts are this rank's. In one process (the default) parallel's calls are
    plain: global_sum and loss_metrics sum this rank's numbers, learner_backward is loss.backward(), no dummies."""
    g, device = cfg.grpo, unwrap(model).lm_head.weight.device
    # The staleness guard: the generator's gate already bounds every sample's age (rollout.py's docstring),
    # so this drops nothing unless that gate is broken, and staleness/dropped then says so.
    fresh = grpo.fresh_mask([s.versions[0] for s in batch.samples], version, cfg.rollout.max_staleness)
    samples = [s for s, keep in zip(batch.samples, fresh.tolist()) if keep]
    ages = [version - s.versions[0] for s in samples]  # each fresh sample's staleness, in versions

    # Advantages within each group. Groups are contiguous; a group may have lost stale or failed members and
    # then uses its remaining size. Masked samples (rollout.truncated: mask, void turns) count in their group's
    # baseline, then leave: no loss, no forward.
    adv = torch.zeros(len(samples))  # [S]: one per sample
    for _, idx in itertools.groupby(range(len(samples)), key=lambda i: samples[i].group):
        idx = list(idx)
        adv[idx] = grpo.group_advantages([samples[i].reward for i in idx], len(idx), g.std_normalize)
    kept = [i for i, s in enumerate(samples) if not s.masked]
    if cfg.distill.teacher:  # distillation keeps a cut sample, at outcome advantage 0 (variants.py says why)
        kept, adv = variants.keep_cut(samples, adv)
    samples, adv = [samples[i] for i in kept], adv[kept]
    metrics = {"staleness/max": max(ages, default=0), "staleness/mean": sum(ages) / max(1, len(ages)),
               "staleness/dropped": len(batch.samples) - len(ages), "train/masked": len(ages) - len(samples),
               "train/samples": len(samples)}
    if global_sum(len(samples))[0] == 0:
        return metrics  # nothing to train on anywhere: no step

    # Token bookkeeping. The N scored tokens of the batch (each sample's model tokens, sample after sample, in
    # samples' order) are flat [N] tensors: gen_logp [N] = log pi_gen, the generator's. A micro-batch mb packs
    # whole samples into one row (parallel.MicroBatch): mb.samples [B] indexes samples and adv (packing puts the
    # longest first: not in order), mb.tokens [N_mb] picks its scored tokens out of the flat [N] (packed_forward
    # returns them in that same order), mb.pad lays [N_mb] out as [B, T] for the loss, mb.mask [B, T] is True at
    # real tokens. E.g. samples of 3, 1 and 2 scored tokens: gen_logp = [a0 a1 a2 b0 c0 c1]; a micro-batch of
    # samples 0 and 2 has mb.samples [0, 2], mb.tokens [0, 1, 2, 4, 5], mb.mask [[1, 1, 1], [1, 1, 0]], and
    # mb.pad(gen_logp[mb.tokens]) = [[a0, a1, a2], [c0, c1, 0]]. mb None: a dummy micro-batch that keeps this rank
    # in step with a busier one (the same collectives on every rank), contributing nothing.
    gen_logp = torch.tensor([x for s in samples for x in s.gen_logprobs], device=device)  # [N]
    parts = packed_micro_batches(model, [s.row() for s in samples], cfg.optim.max_tokens_per_micro_batch, device,
                                 [s.routes for s in samples])
    ref_logp = variants.reference_logprobs(ref_model, parts, packed_forward, cfg.rollout.temperature, gen_logp)  # [N];
    # None without a reference model (grpo.kl_coef 0, no KL guard: the default)
    teacher_logp = (torch.tensor([x for s in samples for x in s.teacher_logprobs], device=device)  # [N]: distillation
                    if cfg.distill.teacher else None)

    # Micro-batch losses are partial sums over one global denominator (all ranks' micro-batches: loss_scale, a
    # count of sequences or tokens by grpo.agg), so gradients add up to the gradient of the whole batch's loss.
    # pi_prox, the policy at the step's start, is the training forward itself (policy_loss detaches it): one
    # optimizer step per batch.
    loss_scale = global_sum(sum(float(grpo.loss_denominator(mb.mask, g.agg)) for _, mb in parts if mb))[0]
    optimizer.zero_grad(set_to_none=True)
    sums, n_tokens, gap_sum, gap_max = {}, 0, torch.zeros((), device=device), torch.zeros((), device=device)
    entropy = "grad" if g.entropy_coef else "metric"
    replay = cfg.model.routing_replay == "rollout"  # MoE: the learner takes the experts the generator took
    mtp_scale = cfg.model.mtp_loss_scale  # (a model with MTP layers: their loss; 0 freezes them)
    temperature = cfg.rollout.temperature  # the learner's log-probs are of the distribution the generator sampled
    for k, mb in parts:
        last = k == len(parts) - 1
        routing = mb.routing(replay) if mb else None  # None for a dense model
        with autocast(device):  # bf16 autocast on a GPU (fp32 master weights); off on a CPU
            logp, ent, _, mtp = packed_forward(model, mb.rows if mb else dummy_rows(model), temperature, entropy=entropy,
                                               routing=routing, mtp=mtp_scale)  # [N_mb] log pi_theta (= pi_prox in value)
            if mb is None:
                variants.dummy_micro_batch(model, logp, last, k == 0, packed_forward, temperature, mtp)
                continue
            a = adv[mb.samples].to(device)  # [B]: each sample's advantage, for every one of its tokens
            if teacher_logp is not None:  # on-policy distillation: per token, [B, T]
                a = variants.distill(a, mb, logp, teacher_logp, cfg.distill, sums)
            loss, m = grpo.policy_loss(mb.pad(logp), mb.pad(gen_logp[mb.tokens]), a, mb.mask, g,
                                       ref_logp=None if ref_logp is None else mb.pad(ref_logp[mb.tokens]),
                                       entropy=mb.pad(ent), loss_scale=loss_scale)
        if mtp is not None:  # the MTP layers (model.mtp_layers) learn to draft this policy's tokens, beside GRPO
            loss = loss + variants.mtp_share(mtp, len(mb.tokens), len(gen_logp), sums)
        learner_backward(model, loss, last)  # (loss * world()).backward(): DDP/FSDP average ranks' gradients
        gap = (logp.detach() - gen_logp[mb.tokens]).abs()  # learner vs generator, per token
        gap_sum, gap_max = gap_sum + gap.sum(), torch.maximum(gap_max, gap.max())
        sums |= variants.routing_metrics(model, mb, routing, gap, gen_logp, temperature, sums, k == 0,
                                         packed_forward)  # MoE's routing/* sums ({} for a dense model)
        n = len(mb.tokens)  # pg_loss adds up over micro-batches; the other metrics are token means
        for name, v in m.items():
            sums[name] = sums.get(name, 0.0) + (v if name == "pg_loss" else v * n)
        sums["loss"] = sums.get("loss", 0.0) + loss.detach()
        n_tokens += n
    sums["logp_diff_mean"] = gap_sum  # the health signal of the train/inference gap (and staleness)
    step, total = loss_metrics(sums, n_tokens, gap_max)  # over every rank: train/loss, train/pg_loss, token means
    metrics |= step | variants.routing_ratios(total)  # (MoE: routing/*)
    metrics["train/tokens"] = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)

    def lr():  # the KL guard brakes the lr while the policy drifts too fast from the reference
        return lr_at(cfg, lora.rl_lr(cfg), version) * variants.kl_guard_scale(guard, metrics, ref_model is not None)
    # optimizer_step: clip the gradient to grad_clip and step AdamW at lr(), or, if the loss or the gradient norm
    # is not finite, drop the gradients and change nothing; returns train/grad_norm, train/skipped, train/lr (if taken)
    return metrics | optimizer_step(optimizer, model, metrics["train/loss"], cfg.optim.grad_clip, lr)


def train_rl(run: startup.Run, ref_model):
    """Each rank generates prompts_per_step / world() groups from its own slice of the prompts, and all
    ranks' learners take one optimizer step together on the union: the global batch."""
    cfg, model, engine, resume, t = run.cfg, run.model, run.engine, run.resume, run.cfg.train
    # What RL trains: every weight but the DSA indexer, which GLM-5 keeps frozen in RL (the warm-ups taught it which
    # keys attention needs), or, with model.lora, only low-rank adapters on the frozen base's decoder linears.
    lora.rl_trainable(model, cfg)
    learner = parallel_learner(model, model.lm_head.weight.device, t.parallel)  # FSDP swaps in sharded parameters
    optimizer, g = adamw(cfg, model, lora.rl_lr(cfg), cfg.optim.weight_decay), cfg.grpo
    guard = grpo.KLGuard(g.kl_guard_threshold, g.kl_guard_factor, g.kl_guard_window, g.kl_guard)
    stream = data.PromptStream(run.train_examples[rank()::world()], seed=cfg.seed)  # groups never cross processes
    skips = Skips(cfg.optim.max_skipped_steps, *resumed(resume, "rl", "skipped", (0, 0)))
    version = resumed(resume, "rl", "step", 0)  # RL steps done = the weight version the learner holds
    ready = resumed(resume, "rl", "ranks", [{}] * world())[rank()].get("pending", [])  # batches sampled before the checkpoint
    restore(resume, "rl", learner, optimizer, stream, guard)  # ... and the KL guard
    sampling = sampling_params(cfg, model, run.tokenizer, cfg.rollout.max_new_tokens)
    teacher = load_teacher(cfg, run.devices[0], packed_forward)  # distill.teacher, beside the engine (None: off)
    gen = Generator(engine, stream, run.tokenizer, cfg.rollout, sampling, env_cls=run.env_cls, seed=cfg.seed + 7919 * rank(),
                    first_index=version, end=t.rl_steps, rank=rank(), world=world(), run_dir=cfg.run_dir, ready=ready,
                    teacher=teacher)
    # The layout decides what happens around each publish: split (two GPUs, or one CPU's threads) moves nothing;
    # co-located, the engine's pool and weights leave the GPU while the learner steps, and back (colocate.py). Weights
    # reach the engine by gen.publish (LoRA on one device: the engine decodes the learner's own base; adapters travel).
    layout = colocate.handoff(cfg, engine, learner, optimizer, model.lm_head.weight.device, world())
    gen_dtype, shared = getattr(engine, "dtype", None), lora.share_base(engine, model)
    gen.publish(full_weights(learner, gen_dtype, cfg.rollout.quantization, base=not shared), version)
    layout.to_generator()
    if version == 0:
        run.log.write("rl", 0, run_eval(cfg, engine, run.tokenizer, run.sets, sampling.stop_token_ids, run.env_cls))
    bar, m, acc = tqdm(total=t.rl_steps, initial=version, desc="rl", dynamic_ncols=True, disable=rank() != 0), {}, None
    gen.start()
    try:
        while version < t.rl_steps:
            t0 = time.perf_counter()
            batch = gen.get()  # batch `version`, sampled by weights at most max_staleness versions older
            wait = time.perf_counter() - t0
            layout.to_learner()
            assert batch.index == version, f"generator sent batch {batch.index} to learner step {version}"
            m = rl_step(cfg, learner, ref_model, optimizer, guard, batch, version)
            version += 1
            skips.update("rl", version, m)
            t1 = time.perf_counter()
            # Every step publishes, a skipped one too (its weights are unchanged, but co-located they were released).
            # full_weights yields (name, tensor): the learner's own tensors in one process (DDP too), under FSDP each
            # gathered in turn in the generator's dtype, so one full tensor exists at a time (fp8: quantized first);
            # publish waits for the batches older weights must sample, then the engine copies each tensor into its
            # model in place, in its own dtype (Generator.publish).
            gen.publish(full_weights(learner, gen_dtype, cfg.rollout.quantization), version)
            layout.to_generator()
            step_s = time.perf_counter() - t0
            m |= batch.metrics | layout.stats | {"perf/learner_wait_s": wait, "perf/step_s": step_s, "perf/publish_s": time.perf_counter() - t1,
                                                 "perf/tokens_per_s": m.get("train/tokens", 0) / step_s, "perf/generator_idle": gen.idle_fraction()}
            m = combine_ranks(m)
            if version == t.rl_steps or (t.eval_every and version % t.eval_every == 0):
                m |= run_eval(cfg, engine, run.tokenizer, run.sets, sampling.stop_token_ids, run.env_cls)
            run.log.write("rl", version, m)
            bar.update(1)
            acc = next((v for k, v in m.items() if k.endswith("/accuracy")), acc)  # the latest eval's first set
            bar.set_postfix(reward=f"{m['rollout/reward']:.2f}", acc="-" if acc is None else f"{acc:.2f}")
            stop = run.preempt.requested()
            if version % t.save_every == 0 or version == t.rl_steps or stop:
                pending = gen.pending(version)  # what the next steps train on: sampled by weights older than these
                with layout.resident():  # (co-located: the learner's state comes back for it)
                    save_checkpoint(cfg, learner, run.tokenizer, "rl", version, optimizer,
                                    {"stream": (pending[-1] if pending else batch).stream_state, "pending": pending},
                                    kl_guard=guard.state_dict(), skipped=skips.state())
            if stop:
                raise Preempted(run.preempt.signum, cfg.run_dir, f"rl step {version}")
            gen.open(version)  # after eval and checkpoint: co-located, the engine has the GPU from here on
    finally:
        gen.stop()  # also on an error or a signal: the thread must not outlive the loop
        bar.close()
    return m


# ----------------------------------------------------------------------------- main


def main(argv=None):
    run = startup.start(sys.argv[1:] if argv is None else argv, __doc__.split("\n\n")[0], os.path.abspath(__file__),
                        DEFAULT_CONFIG, single_turn)
    if run is None:  # --dry-run printed its plan, or this process launched the others (train.pairs) and they ran
        return
    cfg = run.cfg
    done = ("dsa_warmup", "sft", "rl").index(run.resume["stage"]) if run.resume else 0  # stages before the checkpoint's are finished
    for i, stage in enumerate(("dsa_warmup", "sft")):
        if i >= done and getattr(cfg.train, f"{stage}_steps") > 0:
            train_warmup(stage, run)
    if cfg.train.rl_steps > 0:
        set_threads(run.devices, rl=True)
        ref_model = (reference_model(cfg, run.model, run.tokenizer, run.resume) if cfg.grpo.kl_coef > 0 or cfg.grpo.kl_guard
                     else None)
        try:
            last = train_rl(run, ref_model)
        finally:
            if hasattr(run.engine, "shutdown"):  # SGLang's server processes must not outlive us
                run.engine.shutdown()
        if rank() == 0:
            print(f"[train] final held-out accuracy: {accuracy_line(last)}")
    run.log.finish()  # the dashboard's run ends as finished, TensorBoard's file is flushed
    if rank() == 0:
        print(f"[train] done: {cfg.run_dir} (metrics: {os.path.join(cfg.run_dir, 'metrics.jsonl')})")


if __name__ == "__main__":
    run_main(main)  # checkpoint.py: one-line errors, exit codes, and a preempted run's resume hint
