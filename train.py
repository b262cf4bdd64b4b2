"""
GRPO for GLM models the way GLM-5 trains them. This file is the algorithm: the stages, the RL step
and the loop; config.py, parallel.py and checkpoint.py hold the plumbing.

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
                 the new weights. Batch i is sampled by weights i - max_staleness. Co-located (train.colocate,
                 colocate.py) one GPU serves both in turn, synchronously, each half's memory out during the other's.

Each process (one per generator/learner GPU pair, parallel.py) generates and trains its own share of
the batch; every loss below is a partial sum over the global batch's denominator, so the ranks'
gradients add up to that of one process on the whole batch.

Simplified on purpose: one optimizer step per batch (no PPO epochs), constant learning rates after an
optional linear warm-up, and the learner keeps fp32 master weights (bf16 compute on GPU) because bf16
weights would round an lr-1e-6 update away.
"""
import argparse
import itertools
import os
import sys
import time

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
from tqdm import tqdm
from transformers import AutoTokenizer

import colocate
import data
import dsa
import env
import grpo
import hub
from checkpoint import (MetricsLog, Preempted, Preemption, checkpoints, load_latest, reference_model, run_main,
                        save_checkpoint, seed_all, set_rng_state, starting_point)
from config import (LOGIT_CHUNK, LOGIT_KEEP_BYTES, Config, ConfigError, architecture, check_memory, check_paths, eval_sets,
                    load_config, load_run_config, save_config)
from parallel import (Skips, all_gather, autocast, barrier, combine_ranks, dummy_rows, full_weights, global_sum,
                      init_processes, launch, learner_backward, load_learner, micro_batches, once_per_machine,
                      optimizer_step, pair_devices, parallel_learner, rank, set_threads, unwrap, world)
from engine import SamplingParams, make_engine
from lora import base_dir, rl_lr, rl_trainable, share_base
from rollout import Generator, evaluate

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "tiny_cpu.yaml")


# ----------------------------------------------------------------------------- the learner's forward


def _chunk_logprobs(lm_head, h, targets, temperature, entropy):
    logits = lm_head(h).float() / temperature  # [c, V]: what the generator sampled from
    if entropy is None:
        return grpo.token_logprobs(logits, targets), None
    logp, ent = grpo.token_logprobs(logits, targets, entropy=True)  # one log_softmax for both
    return logp, ent if entropy == "grad" else ent.detach()  # the metric alone needs no backward


def packed_forward(model, rows, temperature=1.0, indexer_loss=None, logprobs=True, entropy=None):
    """One forward over several sequences packed into a single row, without padding.
    rows: [(token ids, the prompt's length, or the (start, length) spans of the tokens to score: a multi-turn
    trajectory's model turns)]. Position ids restart at 0 for every sequence, which is how model.py knows
    where one ends: no token attends across sequences, and attention costs sum_i L_i^2 (model.Packed).
    entropy: None (not needed), "metric" (no gradient) or "grad" (the loss has an entropy term). Returns
    (logprobs [N] of every scored token, the sequences one after the other; entropies [N] or None; indexer
    KL or None)."""
    net = unwrap(model)  # model may be DDP/FSDP-wrapped: call it, but reach its lm_head directly
    device = net.embed_tokens.weight.device
    lengths = [len(seq) for seq, _ in rows]
    ids = torch.tensor([t for seq, _ in rows for t in seq], device=device)[None]  # [1, L]
    pos = data.spans([0] * len(rows), lengths, device)[None]  # [1, L]: 0 .. L_i - 1 for each sequence
    # Position j predicts token j+1: a span of R scored tokens from position P is scored at the sequence's
    # positions P-1 .. P+R-2. Only those are kept past the last block's attention (the others, env tokens
    # included, are context only), and only they ever meet the [hidden, vocab] head.
    scored = [data.scored_spans(*row) for row in rows]
    starts = [o + a - 1 for o, sp in zip(itertools.accumulate([0] + lengths), scored) for a, _ in sp]
    where = (data.spans(starts, [n for sp in scored for _, n in sp], device) if logprobs
             else torch.zeros(0, dtype=torch.long, device=device))  # [N]; none for the indexer alone
    out = model(ids, position_ids=pos, indexer_loss=indexer_loss, return_hidden=True, keep=where)
    hidden, kl = out if indexer_loss is not None else (out, None)  # [1, N, hidden]
    if not logprobs:
        return None, None, kl
    h, targets = hidden[0], ids[0, where + 1]  # [N, hidden], [N]
    logp, ent = [], []
    recompute = len(where) * net.cfg.vocab_size * 4 > LOGIT_KEEP_BYTES  # large logits: recompute, do not keep
    for c in range(0, len(where), LOGIT_CHUNK):
        args = (net.lm_head, h[c:c + LOGIT_CHUNK], targets[c:c + LOGIT_CHUNK], temperature, entropy)
        if torch.is_grad_enabled() and recompute:  # the chunk's logits are made again in backward
            lp, en = torch.utils.checkpoint.checkpoint(_chunk_logprobs, *args, use_reentrant=False)
        else:
            lp, en = _chunk_logprobs(*args)
        logp.append(lp)
        ent.append(en)
    return torch.cat(logp), torch.cat(ent) if entropy else None, kl


def lr_at(cfg: Config, base_lr, step):
    """Linear warm-up over the first optim.warmup_steps of a stage. A fresh AdamW's first updates are
    sign(g) * lr for every weight (m / sqrt(v) = +-1 until v has history): with noisy RL gradients
    that alone can wreck a policy."""
    return base_lr * min(1.0, (step + 1) / max(1, cfg.optim.warmup_steps))


def adamw(cfg: Config, model, lr, weight_decay):
    """AdamW over the parameters that train in this stage; the fused kernel updates every tensor in one
    pass (CPU and CUDA, FSDP's sharded DTensors too) instead of a dozen small ops per tensor."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=tuple(cfg.optim.betas),
                             weight_decay=weight_decay, fused=True)


def resumed(resume, stage, key, default):
    """A value of the checkpoint we resume from, if it was taken in this stage."""
    return resume[key] if resume is not None and resume["stage"] == stage else default


# ----------------------------------------------------------------------------- stages 1 and 2: warm-ups


def example_rows(cfg: Config, tokenizer, examples, env_cls):
    """[(prompt + reference response + eos, prompt length)]: the text the warm-up stages learn from. With
    data.env a reference is the model's turns of a trace, played through the env as an RL episode is
    (env.traces): (its tokens, the spans of the model's turns), so the warm-up learns only the model's."""
    if not cfg.data.env:
        prompts = [data.render_prompt(tokenizer, ex["prompt"], cfg.rollout.chat_template) for ex in examples]
        return [(p + tokenizer.encode(ex["solution"], add_special_tokens=False) + [tokenizer.eos_token_id], len(p))
                for p, ex in zip(prompts, examples)]
    turns = [ex["solution"] if isinstance(ex["solution"], list) else [ex["solution"]] for ex in examples]
    stop = env.handoff_token(tokenizer) if any(len(t) > 1 for t in turns) else None
    eps = env.traces(env_cls, examples, turns, tokenizer, env.limits_of(cfg.rollout, cfg.rollout.max_new_tokens), stop,
                     tokenizer.eos_token_id, cfg.rollout.chat_template)
    for ep in (ep for ep in eps if ep.failure is not None):  # a flaky env: skipped now, tried again when drawn again
        print(f"[train] the supervised trace of example {ep.example!r:.60} failed, skipped: {ep.failure}", flush=True)
    return [None if ep.failure else (ep.prompt + ep.response, [(len(ep.prompt) + a, n) for a, n in ep.spans]) for ep in eps]


def train_warmup(stage, cfg: Config, model, tokenizer, examples, env_cls, resume, log, preempt):
    """dsa_warmup: the rest of the model frozen, the indexer minimises KL(attention || indexer) with
    dense attention. sft: next-token loss on the reference responses; with DSA, attention is top-k and
    the indexer keeps learning from the KL over its selected keys (inputs detached: the two losses
    train disjoint parameters). Every rank draws the same global batch and trains its share of it."""
    steps = cfg.train.dsa_warmup_steps if stage == "dsa_warmup" else cfg.train.sft_steps
    indexer_only, device = stage == "dsa_warmup", model.lm_head.weight.device
    for name, p in model.named_parameters():
        p.requires_grad_(not indexer_only or ".indexer." in name)
    learner = parallel_learner(model, device, cfg.train.parallel)  # FSDP swaps in sharded parameters
    lr, wd = (cfg.optim.dsa_warmup_lr, cfg.optim.weight_decay) if indexer_only else (cfg.optim.sft_lr, cfg.optim.sft_weight_decay)
    optimizer = adamw(cfg, model, lr, wd)
    stream, tokens = data.PromptStream(examples, seed=cfg.seed), {}
    step, skips = resumed(resume, stage, "step", 0), Skips(cfg.optim.max_skipped_steps, *resumed(resume, stage, "skipped", (0, 0)))
    if step:
        set_optimizer_state_dict(learner, optimizer, resume["optimizer"], options=StateDictOptions(full_state_dict=True))
        stream.load_state_dict(resume["ranks"][rank()]["stream"])
    indexer_loss = "dense" if indexer_only else ("sparse" if model.cfg.dsa else None)
    bar = tqdm(total=steps, initial=step, desc=stage, dynamic_ncols=True, disable=rank() != 0)
    while step < steps:
        t0 = time.perf_counter()
        batch = stream.next(cfg.train.warmup_batch_size)
        new = list({id(ex): ex for ex in batch if id(ex) not in tokens}.values())  # each example's tokens once
        tokens |= {id(ex): r for ex, r in zip(new, example_rows(cfg, tokenizer, new, env_cls)) if r}  # (a trace plays its env)
        if not (rows := [tokens[id(ex)] for ex in batch if id(ex) in tokens]):
            raise ValueError("data.env: every supervised trace of a batch failed (the lines above say why)")
        n_answer = sum(n for row in rows for _, n in data.scored_spans(*row))  # the LM loss: a mean over the model's tokens
        n_all = sum(len(s) for s, _ in rows)  # the indexer KL is a mean over all query tokens
        mine = data.split_across_ranks([len(s) for s, _ in rows], world())[rank()]  # this rank's share
        groups = [[mine[j] for j in mb] for mb in
                  data.pack_by_tokens([len(rows[i][0]) for i in mine], cfg.optim.max_tokens_per_micro_batch)]
        optimizer.zero_grad(set_to_none=True)
        nll_sum = kl_sum = 0.0
        parts = micro_batches(learner, groups)
        for k, mb in parts:
            part = [rows[i] for i in mb] if mb is not None else dummy_rows(model)
            with autocast(device):
                logp, _, kl = packed_forward(learner, part, 1.0, indexer_loss, logprobs=not indexer_only)
                nll = -logp.sum() / n_answer if logp is not None else torch.zeros((), device=device)
                kl = kl * sum(len(s) for s, _ in part) / n_all if kl is not None else torch.zeros((), device=device)
            learner_backward(learner, (nll + kl) * (mb is not None), last=k == len(parts) - 1)  # parts of global means
            if mb is not None:
                nll_sum, kl_sum = nll_sum + float(nll.detach()), kl_sum + float(kl.detach())
        nll_sum, kl_sum = global_sum(nll_sum, kl_sum)
        row = optimizer_step(optimizer, model, nll_sum + kl_sum, cfg.optim.grad_clip, lambda: lr_at(cfg, lr, step))
        step += 1
        row |= {"perf/step_s": time.perf_counter() - t0, "perf/tokens_per_s": n_all / (time.perf_counter() - t0)}
        row |= {} if indexer_only else {"train/loss": nll_sum}
        row |= {"train/indexer_kl": kl_sum} if indexer_loss is not None else {}
        skips.update(stage, step, row | {"train/loss": nll_sum + kl_sum})
        row["train/skipped_steps"] = skips.total
        log.write(stage, step, row)
        bar.update(1)
        bar.set_postfix(loss=f"{kl_sum if indexer_only else nll_sum:.3g}")  # the indexer KL can be ~1e-4
        stop = preempt.requested()
        if step % cfg.train.save_every == 0 or step == steps or stop:
            save_checkpoint(cfg, learner, tokenizer, stage, step, optimizer, {"stream": stream.state_dict()},
                            skipped=skips.state())
        if stop:
            raise Preempted(preempt.signum, cfg.run_dir, f"{stage} step {step}")
    bar.close()
    for p in model.parameters():
        p.requires_grad_(True)


# ----------------------------------------------------------------------------- stage 3: RL


def rl_step(cfg: Config, model, ref_model, optimizer, guard, batch, version):
    """One GRPO update on this rank's rollout batch (all ranks step together); returns the step's
    metrics. Loss sums and token means are global; sample counts are this rank's."""
    g, device = cfg.grpo, unwrap(model).lm_head.weight.device
    # The staleness guard: the generator's gate already bounds every sample's age (rollout.py's docstring),
    # so this drops nothing unless that gate is broken, and staleness/dropped then says so.
    fresh = grpo.fresh_mask([s.versions[0] for s in batch.samples], version, cfg.rollout.max_staleness)
    samples = [s for s, keep in zip(batch.samples, fresh.tolist()) if keep]
    stale = [version - s.versions[0] for s in samples]

    # Advantages within each group. Groups are contiguous; a group may have lost stale members. Masked
    # samples (rollout.truncated: mask) count in their group's baseline, then leave: no loss, no forward.
    adv = torch.zeros(len(samples))
    for _, idx in itertools.groupby(range(len(samples)), key=lambda i: samples[i].group):
        idx = list(idx)
        adv[idx] = grpo.group_advantages([samples[i].reward for i in idx], len(idx), g.std_normalize)
    kept = [i for i, s in enumerate(samples) if not s.masked]
    samples, adv = [samples[i] for i in kept], adv[kept]
    metrics = {"staleness/max": max(stale, default=0), "staleness/mean": sum(stale) / max(1, len(stale)),
               "staleness/dropped": len(batch.samples) - len(stale), "train/masked": len(stale) - len(samples),
               "train/samples": len(samples)}
    if global_sum(len(samples))[0] == 0:
        return metrics  # nothing to train on anywhere: no step

    # The batch's response tokens as flat [N] arrays (sample after sample); a micro-batch picks its
    # tokens out with one index (spans), and pads them to [B, T] for the loss with one masked_scatter.
    # A multi-turn sample scores its model turns only (s.spans): the env's tokens are context, never loss
    rows = [(s.prompt_ids + s.response_ids, len(s.prompt_ids) if s.spans is None else
             [(len(s.prompt_ids) + a, n) for a, n in s.spans]) for s in samples]
    sizes = [len(s.gen_logprobs) for s in samples]  # model tokens
    first = list(itertools.accumulate([0] + sizes))  # where each sample's tokens start in the flat arrays
    gen_logp = torch.tensor([x for s in samples for x in s.gen_logprobs], device=device)  # [N]
    parts = micro_batches(model, data.pack_by_tokens([len(seq) for seq, _ in rows], cfg.optim.max_tokens_per_micro_batch))
    tokens = [data.spans([first[i] for i in mb], [sizes[i] for i in mb], device) if mb else None for _, mb in parts]
    ref_logp = None
    if ref_model is not None:  # pi_ref, no grad, before the update
        ref_logp = torch.zeros_like(gen_logp)
        with torch.no_grad(), autocast(device):
            for (_, mb), tok in zip(parts, tokens):
                lp = packed_forward(ref_model, [rows[i] for i in mb] if mb else dummy_rows(ref_model), cfg.rollout.temperature)[0]
                if mb:
                    ref_logp[tok] = lp

    # Micro-batch losses are partial sums over one global denominator (all ranks' micro-batches), so
    # gradients add up to the gradient of the whole batch's loss. pi_prox, the policy at the step's start,
    # is the training forward itself (policy_loss detaches it): one optimizer step per batch.
    masks = [torch.arange(max(sizes[i] for i in mb)) < torch.tensor([sizes[i] for i in mb])[:, None] if mb else None
             for _, mb in parts]  # [B, T] response tokens of each micro-batch
    loss_scale = global_sum(sum(float(grpo.loss_denominator(m, g.agg)) for m in masks if m is not None))[0]
    optimizer.zero_grad(set_to_none=True)
    sums, n_tokens, gap_sum, gap_max = {}, 0, torch.zeros((), device=device), torch.zeros((), device=device)
    entropy = "grad" if g.entropy_coef else "metric"
    for (k, mb), tok, mask in zip(parts, tokens, masks):
        last = k == len(parts) - 1
        with autocast(device):
            logp, ent, _ = packed_forward(model, [rows[i] for i in mb] if mb else dummy_rows(model), cfg.rollout.temperature,
                                          entropy=entropy)
            if mb is None:  # keeps this rank in step with the others; contributes nothing
                learner_backward(model, logp.sum() * 0.0, last)
                continue
            mask = mask.to(device)
            pad = lambda flat: flat.new_zeros(mask.shape).masked_scatter(mask, flat)  # [N_mb] -> [B, T]
            loss, m = grpo.policy_loss(pad(logp), pad(gen_logp[tok]), adv[mb].to(device), mask, g,
                                       ref_logp=None if ref_model is None else pad(ref_logp[tok]),
                                       entropy=pad(ent), loss_scale=loss_scale)
        learner_backward(model, loss, last)
        gap = (logp.detach() - gen_logp[tok]).abs()  # learner vs generator, per token
        gap_sum, gap_max = gap_sum + gap.sum(), torch.maximum(gap_max, gap.max())
        n = len(tok)  # pg_loss adds up over micro-batches; the other metrics are token means
        for name, v in m.items():
            sums[name] = sums.get(name, 0.0) + (v if name == "pg_loss" else v * n)
        sums["loss"] = sums.get("loss", 0.0) + loss.detach()
        n_tokens += n
    sums["logp_diff_mean"] = gap_sum  # the health signal of the train/inference gap (and staleness)
    values = torch.stack(list(sums.values()) + [gap_max]).tolist()  # one host sync for every metric
    gap_max, sums = values.pop(), dict(zip(sums, values))
    ranks = all_gather((sums, n_tokens, gap_max))  # global: every rank decides alike
    n_tokens = sum(n for _, n, _ in ranks)
    for name in dict.fromkeys(k for p, _, _ in ranks for k in p):
        v = sum(p.get(name, 0.0) for p, _, _ in ranks)
        metrics[f"train/{name}"] = v if name in ("pg_loss", "loss") else v / max(1, n_tokens)
    metrics["train/logp_diff_max"] = max(d for _, _, d in ranks)
    metrics["train/tokens"] = sum(len(seq) for seq, _ in rows)

    def lr():  # the KL guard brakes the lr while the policy drifts too fast from the reference
        scale = guard.update(metrics["train/kl"]) if ref_model is not None else 1.0
        if ref_model is not None:
            metrics.update({"kl_guard/scale": scale, "kl_guard/fired": float(guard.fired), "kl_guard/kl_mean": guard.window_mean})
        return lr_at(cfg, rl_lr(cfg), version) * scale
    return metrics | optimizer_step(optimizer, model, metrics["train/loss"], cfg.optim.grad_clip, lr)


def run_eval(cfg: Config, engine, tokenizer, sets, stop_ids, env_cls):
    """Each rank evaluates every world()-th example of each set on its own engine. Accuracy and pass@k
    are means over prompts, so the prompt-weighted mean of the ranks' numbers is that of the whole set."""
    t = cfg.train
    temp = cfg.rollout.temperature if t.eval_temperature is None else t.eval_temperature
    runs = [("", temp, t.eval_n if temp > 0 else 1)] + ([("greedy_", 0.0, 1)] if t.eval_greedy and temp > 0 else [])
    out = {}
    for name, examples in sets.items():
        mine = examples[rank()::world()]
        for prefix, temperature, n in runs:
            sampling = SamplingParams(temperature, max_new_tokens=t.eval_max_new_tokens, stop_token_ids=stop_ids)
            m = evaluate(engine, mine, tokenizer, n=n, sampling=sampling, seed=cfg.seed, env_cls=env_cls, chat_template=
                         cfg.rollout.chat_template, limits=env.limits_of(cfg.rollout, t.eval_max_new_tokens)) if mine else {}
            if prefix:
                m = {"accuracy": m["accuracy"]} if m else {}
            parts = [(k, pm) for k, pm in all_gather((len(mine), m)) if k]
            total = sum(k for k, _ in parts)
            out |= {f"eval/{name}/{prefix}{key}": sum(k * pm[key] for k, pm in parts) / total for key in parts[0][1]}
    return out


def train_rl(cfg: Config, model, engine, ref_model, tokenizer, train_examples, sets, env_cls, resume, log, preempt):
    """Each rank generates prompts_per_step / world() groups from its own slice of the prompts, and all
    ranks' learners take one optimizer step together on the union: the global batch."""
    r, t = cfg.rollout, cfg.train
    # A turn ends at eos, or (with an env) where the chat format hands over: <|observation|> (a tool), <|user|>
    stop_ids = tuple(sorted({*model.cfg.eos_token_id, tokenizer.eos_token_id, *(env.turn_ends(tokenizer) if cfg.data.env else ())}))
    sampling = SamplingParams(r.temperature, max_new_tokens=r.max_new_tokens, stop_token_ids=stop_ids)
    rl_trainable(model, cfg)  # all but the indexer, which GLM-5 keeps frozen; model.lora: adapters on a frozen base
    learner = parallel_learner(model, model.lm_head.weight.device, t.parallel)  # FSDP swaps in sharded parameters
    optimizer, g = adamw(cfg, model, rl_lr(cfg), cfg.optim.weight_decay), cfg.grpo
    guard = grpo.KLGuard(g.kl_guard_threshold, g.kl_guard_factor, g.kl_guard_window, g.kl_guard)
    stream = data.PromptStream(train_examples[rank()::world()], seed=cfg.seed)  # groups never cross processes
    skips = Skips(cfg.optim.max_skipped_steps, *resumed(resume, "rl", "skipped", (0, 0)))
    version = resumed(resume, "rl", "step", 0)  # RL steps done = the weight version the learner holds
    ready = resumed(resume, "rl", "ranks", [{}] * world())[rank()].get("pending", [])  # batches sampled before the checkpoint
    if version:
        set_optimizer_state_dict(learner, optimizer, resume["optimizer"], options=StateDictOptions(full_state_dict=True))
        stream.load_state_dict(resume["ranks"][rank()]["stream"])
        guard.load_state_dict(resume["kl_guard"])
    gen_dtype, shared = getattr(engine, "dtype", None), share_base(engine, model)  # LoRA: one base on one device
    engine.update_weights(full_weights(learner, gen_dtype, r.quantization, base=not shared), version)  # the generator starts here
    hand = colocate.handoff(cfg, engine, learner, optimizer, model.lm_head.weight.device, world())  # split: moves nothing
    hand.to_generator()  # co-located (colocate.py): the engine has the GPU while it generates, the learner while it trains
    gen = Generator(engine, stream, tokenizer, prompts_per_step=r.prompts_per_step // world(), n=r.n, sampling=sampling,
                    max_staleness=r.max_staleness, dynamic_sampling=r.dynamic_sampling, oversample=r.oversample,
                    chat_template=r.chat_template, max_prompt_tokens=r.max_prompt_tokens, env_cls=env_cls,
                    limits=env.limits_of(r, r.max_new_tokens), seed=cfg.seed + 7919 * rank(), first_index=version,
                    partial_rollout=r.partial_rollout, truncated=r.truncated, max_failures=r.max_failure_fraction,
                    run_dir=cfg.run_dir, dump_fraction=r.dump_fraction, rank=rank(), world=world(), ready=ready)
    if version == 0:
        log.write("rl", 0, run_eval(cfg, engine, tokenizer, sets, stop_ids, env_cls))
    bar, m, acc = tqdm(total=t.rl_steps, initial=version, desc="rl", dynamic_ncols=True, disable=rank() != 0), {}, None
    gen.start()
    try:
        while version < t.rl_steps:
            t0 = time.perf_counter()
            batch = gen.get()
            wait = time.perf_counter() - t0
            hand.to_learner()
            assert batch.index == version, f"generator sent batch {batch.index} to learner step {version}"
            m = rl_step(cfg, learner, ref_model, optimizer, guard, batch, version)
            version += 1
            skips.update("rl", version, m)
            t1 = time.perf_counter()
            # FSDP: gathered tensor by tensor. A skipped step publishes no weights, only the version number
            # (co-located, the engine's weights were released: they always come back).
            weights = () if m.get("train/skipped") and not t.colocate else full_weights(learner, gen_dtype, r.quantization)
            if version == t.rl_steps:  # the last weights go to the engine for the final eval only
                gen.stop()
            if version == t.rl_steps or t.colocate:  # co-located: the gate opens after eval and checkpoint, below
                engine.update_weights(weights, version)
                hand.to_generator()
            else:
                gen.publish(weights, version)
            step_s = time.perf_counter() - t0
            m |= batch.metrics | hand.stats | {"perf/learner_wait_s": wait, "perf/step_s": step_s, "perf/publish_s": time.perf_counter() - t1,
                                               "perf/tokens_per_s": m.get("train/tokens", 0) / step_s, "perf/generator_idle": gen.idle_fraction()}
            m = combine_ranks(m)
            if version == t.rl_steps or (t.eval_every and version % t.eval_every == 0):
                m |= run_eval(cfg, engine, tokenizer, sets, stop_ids, env_cls)
            log.write("rl", version, m)
            bar.update(1)
            acc = next((v for k, v in m.items() if k.endswith("/accuracy")), acc)  # the latest eval's first set
            bar.set_postfix(reward=f"{m['rollout/reward']:.2f}", acc="-" if acc is None else f"{acc:.2f}")
            stop = preempt.requested()
            if version % t.save_every == 0 or version == t.rl_steps or stop:
                pending = gen.pending(version)  # what the next steps train on: sampled by weights older than these
                with hand.resident():  # (co-located: the learner's state comes back for it)
                    save_checkpoint(cfg, learner, tokenizer, "rl", version, optimizer,
                                    {"stream": (pending[-1] if pending else batch).stream_state, "pending": pending},
                                    kl_guard=guard.state_dict(), skipped=skips.state())
            if stop:
                raise Preempted(preempt.signum, cfg.run_dir, f"rl step {version}")
            if t.colocate and version < t.rl_steps:
                gen.publish((), version)  # co-located: the engine's turn (its weights are in already)
    finally:
        gen.stop()  # also on an error or a signal: the thread must not outlive the loop
        bar.close()
    return m


# ----------------------------------------------------------------------------- main


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="YAML recipe (default: configs/tiny_cpu.yaml)")
    parser.add_argument("--resume", action="store_true", help="continue the run in run_dir from its config and latest checkpoint")
    parser.add_argument("--dry-run", action="store_true", help="print the parameter count and per-GPU memory plan, then exit")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="override config keys")
    args = parser.parse_intermixed_args(argv)  # flags and key=value overrides in any order
    cfg = load_config(args.config, args.overrides)
    if args.resume and os.path.isfile(os.path.join(cfg.run_dir, "config.yaml")):
        cfg = load_run_config(cfg, args.overrides)  # the run's own settings, plus what may change mid-run
    dsa.USE_TRITON, run_dir = cfg.model.dsa_kernels, cfg.run_dir
    under_torchrun = "RANK" in os.environ
    processes = int(os.environ.get("WORLD_SIZE", 1)) if under_torchrun else cfg.train.pairs
    if args.dry_run:
        return check_memory(cfg, processes, title=args.config)  # prints the plan, or says what does not fit
    fresh = not (args.resume and checkpoints(run_dir))
    if not args.resume and (checkpoints(run_dir) or os.path.exists(os.path.join(run_dir, "metrics.jsonl"))):
        raise ConfigError(f"{run_dir} already holds a run; pass --resume to continue it, or run_dir=... for a new one")
    devices = pair_devices(cfg)  # (generator, learner)
    init_processes(devices[1])  # under torchrun: the process group comes first, the downloads are shared out by rank
    # Hub ids (hub.py): fetched once per machine, pinned, before `python train.py` starts its processes (see hub.py)
    once_per_machine(lambda: hub.fetch(cfg), lambda pins: hub.pin(cfg, pins))
    check_paths(cfg)
    arch = architecture(cfg)  # config.json only: the checks below need no weights
    if cfg.train.dsa_warmup_steps and arch.dsa is None:
        raise ConfigError("train.dsa_warmup_steps > 0 needs a DSA model (set model.dsa)")
    if cfg.train.pairs > 1 and not under_torchrun:
        return launch(cfg.train.pairs, os.path.abspath(__file__), argv)
    if cfg.rollout.prompts_per_step % world():  # torchrun decides the world size, not train.pairs
        raise ConfigError(f"rollout.prompts_per_step ({cfg.rollout.prompts_per_step}) must divide evenly over {world()} processes")
    if devices[1].type == "cuda":  # fail now, not after loading 18 GB and compiling kernels
        check_memory(cfg, world(), torch.cuda.get_device_properties(devices[1]).total_memory, shared=devices[0] == devices[1])
    barrier()
    if rank() == 0:
        os.makedirs(run_dir, exist_ok=True)
        save_config(cfg, run_dir)
        if args.resume and fresh:
            print(f"[train] {run_dir} has no checkpoint yet: starting it fresh", flush=True)
    seed_all(cfg.seed)
    set_threads(devices, rl=False)
    start = starting_point(cfg, run_dir) if rank() == 0 else None  # rank 0 writes a fresh model's init_model/
    barrier()
    start = start or starting_point(cfg, run_dir)
    try:  # data.py, model.py and transformers name the file and what was wrong: show that, not a traceback
        tokenizer = AutoTokenizer.from_pretrained(hub.model_dir(cfg.model.tokenizer, "model.tokenizer") or start)
        reward = data.load_reward(cfg.data.reward, cfg.data.answer_line)  # (answer_line: the built-in grader's option)
        env_cls = env.load_env(cfg.data.env, cfg.data.env_args) if cfg.data.env else env.single_turn(reward)
        examples_of = lambda src, split: data.load_examples(  # noqa: E731  (all prompts tokenized now: fail in seconds)
            src, tokenizer, cfg.data, split=split, seed=cfg.seed, sft=cfg.train.sft_steps > 0, chat_template=
            cfg.rollout.chat_template, max_prompt_tokens=cfg.rollout.max_prompt_tokens, verbose=rank() == 0,
            openings=cfg.data.env and (lambda exs: env.openings(env_cls, exs, tokenizer, cfg.rollout.chat_template)))
        train_examples = examples_of(cfg.data.train, "train")
        sets = {name: examples_of(src, "eval") for name, src in eval_sets(cfg).items()}
        frozen = cfg.model.lora is not None and devices[1].type == "cuda" and not (cfg.train.dsa_warmup_steps or cfg.train.sft_steps)
        load = lambda path: load_learner(path, cfg.model.dsa, devices[1], cfg.train.parallel,  # noqa: E731  (FSDP: its shards)
                                         torch.bfloat16 if frozen else torch.float32)  # (LoRA, RL alone: a base that never trains)
        ckpt, resume, model = (None, None, load(start)) if fresh else load_latest(run_dir, load, world())
    except (OSError, ValueError) as e:
        raise ConfigError(str(e).splitlines()[0]) from e
    if resume is not None:
        set_rng_state(resume["ranks"][rank()]["rng"])
        if rank() == 0:
            print(f"[train] resuming {run_dir} from {ckpt} ({resume['stage']} step {resume['step']})", flush=True)
    model.gradient_checkpointing = cfg.model.gradient_checkpointing
    # The engine comes up first, so that a problem with it (SGLang missing, ...) shows before the warm-ups;
    # RL publishes the learner's weights to it before the first rollout.
    try:
        engine = make_engine(cfg.rollout, base_dir(ckpt or start), devices[0], dsa=cfg.model.dsa,
                             seed=cfg.seed + 7919 * rank(), lora_cfg=cfg.model.lora, empty=cfg.train.colocate) \
            if cfg.train.rl_steps > 0 else None
    except (ImportError, ValueError) as e:
        raise ConfigError(str(e)) from None
    if cfg.train.colocate and engine is not None:  # co-located: the warm-ups have the GPU to themselves; RL's first
        engine.release()  # publish fills the engine (made without weights, but fp8's load to be quantized)
    log, preempt = MetricsLog(cfg, resume), Preemption()

    done = ("dsa_warmup", "sft", "rl").index(resume["stage"]) if resume else 0  # stages before the checkpoint's are finished
    for i, stage in enumerate(("dsa_warmup", "sft")):
        if i >= done and getattr(cfg.train, f"{stage}_steps") > 0:
            train_warmup(stage, cfg, model, tokenizer, train_examples, env_cls, resume, log, preempt)
    if cfg.train.rl_steps > 0:
        set_threads(devices, rl=True)
        ref_model = reference_model(cfg, model, tokenizer, resume) if cfg.grpo.kl_coef > 0 or cfg.grpo.kl_guard else None
        try:
            last = train_rl(cfg, model, engine, ref_model, tokenizer, train_examples, sets, env_cls, resume, log, preempt)
        finally:
            if hasattr(engine, "shutdown"):  # SGLang's server processes must not outlive us
                engine.shutdown()
        if rank() == 0:
            acc = ", ".join(f"{k.removeprefix('eval/')} {v:.1%}" for k, v in last.items()
                            if k.startswith("eval/") and k.endswith("accuracy"))
            print(f"[train] final held-out accuracy: {acc or 'n/a'}")
    log.finish()  # the dashboard's run ends as finished, TensorBoard's file is flushed
    if rank() == 0:
        print(f"[train] done: {run_dir} (metrics: {os.path.join(run_dir, 'metrics.jsonl')})")


if __name__ == "__main__":
    run_main(main)  # checkpoint.py: one-line errors, exit codes, and a preempted run's resume hint
