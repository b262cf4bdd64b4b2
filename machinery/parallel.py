"""
Processes, devices, and the learner across ranks: the plumbing that lets train.py read as if there
were one process.

One process per generator/learner GPU pair. Process r of G on a machine with 2G GPUs generates on
cuda:r and learns on cuda:r+G. `python train.py` starts the G = train.pairs processes itself (through
torchrun's launcher); under torchrun, --nproc-per-node decides. Every process generates and trains on
its own prompt groups; the learners form one data-parallel group (FSDP2 or DDP) whose gradient is
exactly that of one process on the whole batch. Without torchrun there is no process group and every
helper here is the identity, so the single-process path is the same code with world() == 1. A reader of
one RL step needs only the section "what train.rl_step calls"; processes, devices and FSDP2 come last.

The contract that makes the gradient exact: each rank's loss is a partial sum over the *global*
denominator of the step's batch. DDP and FSDP2 average gradients over ranks when they reduce, so
learner_backward multiplies the loss by world() to turn their mean back into that sum.
"""
import datetime
import itertools
import math
import os
import signal
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import data
from machinery import fp8
from machinery import lora
from machinery.config import ConfigError
from families.mla_moe import MoE, Routing, no_route, route_dtype
from model import FP32_PARAMS, GLM


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def world():
    return dist.get_world_size() if dist.is_initialized() else 1


def all_gather(obj):
    """Every rank's (picklable) obj, in rank order. Small things only: metrics, counts, RNG states."""
    if world() == 1:
        return [obj]
    out = [None] * world()
    dist.all_gather_object(out, obj)
    return out


def global_sum(*values):
    """The sum over ranks of each value (floats, or tuples of floats)."""
    parts = all_gather(values)
    return tuple(sum(p[i] for p in parts) for i in range(len(values)))


def barrier():
    if world() > 1:
        dist.barrier()


# ----------------------------------------------------------------------------- what train.rl_step calls
# In its order: the micro-batches, the backward, the loss metrics, the optimizer step; then full_weights, what
# train_rl's publish after the step sends. In one process every collective here is the identity.

def packed_micro_batches(model, rows, budget, device, routes=None):
    """[(k, MicroBatch or None)]: this rank's samples (rows: (ids, spans of scored tokens); routes: their generator
    routes, MoE) packed first-fit decreasing into micro-batches of at most budget tokens (a longer sample alone),
    padded with None to the busiest rank's count (micro_batches). An MoE model (model None: as a dense one) lends
    them its route shape: samples that carry no routes route afresh, each token of theirs NO_ROUTE in a Routing
    that still replays the others' and counts them all (MicroBatch.routing, variants.routing_metrics)."""
    cfg = None if model is None else unwrap(model).cfg
    shape = None if cfg is None or cfg.moe is None else (len(cfg.moe_layers), cfg.moe.num_experts_per_tok, route_dtype(cfg))
    sizes = [sum(n for _, n in spans) for _, spans in rows]  # scored tokens per sample
    first = list(itertools.accumulate([0] + sizes))  # where each sample's tokens start in the flat tensors
    parts = []
    for k, mb in micro_batches(model, data.pack_by_tokens([len(ids) for ids, _ in rows], budget)):
        if mb is not None:
            n = torch.tensor([sizes[i] for i in mb])
            mb = MicroBatch([rows[i] for i in mb], mb, data.spans([first[i] for i in mb], n.tolist(), device),
                            (torch.arange(int(n.max())) < n[:, None]).to(device),
                            None if routes is None else [routes[i] for i in mb], shape)
        parts.append((k, mb))
    return parts


@dataclass
class MicroBatch:
    """One packed row of whole samples of an RL batch whose scored tokens lie end to end in flat [N] tensors
    (train.rl_step's gen_logp, ref_logp): where its tokens sit there, and their [B, T] layout for the loss."""
    rows: list  # [(ids, spans)] of its samples, for train.packed_forward
    samples: list[int]  # their indices in the batch
    tokens: torch.Tensor  # [N_mb]: the positions of its samples' scored tokens in the flat tensors
    mask: torch.Tensor  # [B, T] bool: B samples, T the most scored tokens of one; True at real tokens
    routes: list | None = None  # MoE: each sample's generator routes [positions, n_moe, k] (rollout.Sample.routes)
    route_shape: tuple | None = None  # MoE: (n_moe, k, dtype) of the model's routes (packed_micro_batches; None: a
    # recorded route's, or a dense model)

    def pad(self, flat):
        """[N_mb] (its tokens, sample after sample) -> [B, T], zeros after each sample's tokens."""
        return flat.new_zeros(self.mask.shape).masked_scatter(self.mask, flat)

    # MoE only (routing replay and its diagnostic): its samples' routes

    def unrecorded(self) -> int:
        """How many of its samples carry no generator routes (on an MoE model their tokens route afresh)."""
        return len(self.samples) if self.routes is None else sum(r is None for r in self.routes)

    def probe(self, n: int) -> tuple["MicroBatch", torch.Tensor]:
        """At most n of its samples, every ceil(B / n)-th (packing puts the longest first, so a stride spans the
        lengths), for a diagnostic forward -> (that MicroBatch, where its tokens sit among this one's [N_probe])."""
        pick = list(range(0, len(self.samples), -(-len(self.samples) // n)))
        j = torch.tensor(pick, device=self.mask.device)
        mine = self.pad(torch.arange(len(self.tokens), device=self.mask.device))[j][self.mask[j]]
        routes = None if self.routes is None else [self.routes[i] for i in pick]
        return MicroBatch([self.rows[i] for i in pick], [self.samples[i] for i in pick], self.tokens[mine], self.mask[j],
                          routes, self.route_shape), mine

    def routing(self, apply: bool) -> Routing | None:
        """The mla_moe.Routing of this packed row (None: a dense model): the generator's experts of every token, the
        samples end to end [n_moe, 1, L, k], mla_moe.no_route where none was recorded (a sequence's last token, never
        fed; a position the generator's last block skipped; every token of a sample that carries no routes: those
        route afresh, token by token, while the others keep their replay). apply: replay them (False: route afresh,
        and only count agreement with them)."""
        recorded = [r for r in self.routes or () if r is not None]
        shape = self.route_shape or ((*recorded[0].shape[1:], recorded[0].dtype) if recorded else None)
        if shape is None:
            return None
        *dims, dtype = shape
        parts = []
        for (ids, _), r in zip(self.rows, self.routes or [None] * len(self.rows)):  # each sample's, to its length
            r = torch.empty((0, *dims), dtype=dtype) if r is None else r
            parts += [r, torch.full((len(ids) - len(r), *dims), no_route(dtype), dtype=dtype)]
        replay = torch.cat(parts).to(self.mask.device, non_blocking=True).permute(1, 0, 2)[:, None]  # [n_moe, 1, L, k]
        return Routing(replay=replay, apply=apply)


def micro_batches(model, groups):
    """[(k, part or None)] over this rank's micro-batches (lists of indices), padded with None so that
    every rank runs as many forward and backward passes as the others: FSDP gathers each layer in every
    one, DDP reduces in the last. A None part runs as one dummy token at zero weight (dummy_rows)."""
    n = max(all_gather(len(groups)))
    return list(enumerate(groups + [None] * (n - len(groups))))


def dummy_rows(model):
    """What a rank with fewer micro-batches than another runs, at weight 0: one prompt and one scored token."""
    pad = unwrap(model).cfg.pad_token_id or 0
    return [([pad, pad], [(1, 1)])]  # (ids, the (start, length) spans of the scored tokens)


def autocast(device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def learner_backward(model, loss, last):
    """loss.backward() for this rank's part of a global-mean loss. DDP all-reduces in the last
    micro-batch's backward only (FSDP2 reduce-scatters in every one and accumulates sharded gradients:
    skipping that would keep full-size gradients on every GPU)."""
    with model.no_sync() if isinstance(model, DDP) and not last else nullcontext():
        (loss * world()).backward()  # world(): undo the mean over ranks of the gradient reduction


def loss_metrics(sums, n_tokens, gap_max):
    """rl_step's per-token sums over every rank, with one host sync: sums {name: 0-dim tensor or float} summed
    over this rank's micro-batches, n_tokens its scored tokens, gap_max its largest |log pi_learner - log pi_gen|.
    Returns ({train/<name>: the global sum for pg_loss and loss, else the global token mean, train/logp_diff_max},
    {name: the global sum}, the same on every rank)."""
    values = torch.stack([torch.as_tensor(v) for v in sums.values()] + [torch.as_tensor(gap_max)]).tolist()
    gap_max, sums = values.pop(), dict(zip(sums, values))
    ranks = all_gather((sums, n_tokens, gap_max))  # global: every rank decides alike
    n_tokens = sum(n for _, n, _ in ranks)
    total = {name: sum(p.get(name, 0.0) for p, _, _ in ranks) for name in dict.fromkeys(k for p, _, _ in ranks for k in p)}
    out = {f"train/{name}": v if name in ("pg_loss", "loss") else v / max(1, n_tokens)
           for name, v in total.items() if not name.startswith("routing_")}  # (routing_*: variants.routing_ratios)
    return out | {"train/logp_diff_max": max(d for _, _, d in ranks)}, total


# ----------------------------------------------------------------------------- non-finite steps
# A NaN or inf loss or gradient must never reach the weights: AdamW would write NaN into every weight it
# touches, the generator would sample from them and a checkpoint would keep them. Such a step is skipped
# whole (its gradients dropped, the optimizer state untouched) on every rank alike: the loss and the
# gradient norm it is judged on are global numbers. A few in a row stop the run with one line.


def optimizer_step(optimizer, model, loss, grad_clip, lr) -> dict:
    """Clip the gradient, then step at lr(), unless the step's global loss or gradient norm is not finite
    (then the gradients are dropped and nothing changes). lr is a function: the KL guard must see only
    steps that happen. Afterwards the trained weights must still be finite (one host sync), or nothing
    downstream (generator, checkpoint) may see them. Returns the step's train/ metrics. MTP layers (their own loss,
    the trunk detached) are clipped apart (train/mtp_grad_norm): their gradient never scales the policy's."""
    trained = [(n, p) for n, p in unwrap(model).named_parameters() if p.requires_grad]
    grad_norm = clip_grad_norm([p for n, p in trained if not n.startswith("mtp.")], grad_clip)
    drafter = [p for n, p in trained if n.startswith("mtp.")]
    mtp = {"train/mtp_grad_norm": clip_grad_norm(drafter, grad_clip)} if drafter else {}
    if not (math.isfinite(loss) and math.isfinite(grad_norm) and all(map(math.isfinite, mtp.values()))):
        optimizer.zero_grad(set_to_none=True)
        return {"train/grad_norm": grad_norm, "train/skipped": 1.0} | mtp
    lr = lr()
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    named = [(n, p.to_local() if hasattr(p, "to_local") else p)  # FSDP: each rank checks its own shards
             for n, p in unwrap(model).named_parameters() if p.requires_grad]
    ok = bool(torch.stack([torch.isfinite(p.detach()).all() for _, p in named]).all()) if named else True
    if not all(all_gather(ok)):
        bad = next((n for n, p in named if not torch.isfinite(p.detach()).all()), "a weight shard on another rank")
        raise FloatingPointError(f"the optimizer step at lr {lr:g} made {bad} non-finite; nothing was published or saved")
    return {"train/grad_norm": grad_norm, "train/lr": lr, "train/skipped": 0.0} | mtp


def clip_grad_norm(params, max_norm):
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP: a DTensor


def full_weights(model, dtype=None, quantization=None, base=False):
    """(name, full tensor) of every parameter, for publishing to the generator. Under FSDP each tensor
    is gathered from its shards when the consumer asks for it (cast to the generator's dtype first, so
    bf16 travels), so beyond the training state only one full tensor exists at a time. Every rank
    must consume the whole sequence: each gather is a collective. quantization "fp8": each decoder linear
    weight, once gathered (and cast to dtype: one rounding path with FSDP or without), is quantized here on
    the learner's device (fp8.quantized_weights), so those weights' bytes halve on the way. With LoRA the
    generator holds the frozen base already and only the adapters move, unless base=True (RL's first publish to an
    engine with its own copy of the base, which the warm-ups changed; one sharing the learner's needs none)."""
    if hasattr(unwrap(model), "lora") and not base:  # LoRA: only the adapters move
        return ((name, p.detach()) for name, p in lora.adapter_named(unwrap(model)))

    def gathered():
        for name, p in unwrap(model).named_parameters():
            p = p.detach()
            if hasattr(p, "full_tensor"):  # model.FP32_PARAMS travel in fp32: the engine keeps them so
                p = (p.to(dtype) if dtype is not None and not name.endswith(FP32_PARAMS) else p).full_tensor()
            elif quantization and dtype is not None and fp8.is_quantized(name):
                p = p.to(dtype)
            yield name, p
    return fp8.quantized_weights(gathered()) if quantization == "fp8" else gathered()


# ----------------------------------------------------------------------------- what train_rl's loop calls
# Beside rl_step: the count of skipped steps, and the metrics of every rank made one row.


@dataclass
class Skips:
    """Steps skipped for a non-finite loss or gradient norm: in a row (`run`) and in this stage (`total`)."""
    limit: int
    total: int = 0
    run: int = 0

    def state(self):
        return (self.total, self.run)

    def update(self, stage, step, metrics):
        """Count the step and add train/skipped_steps to metrics. A step that changed no weight says why on the
        console (rank 0), one line: a non-finite loss or gradient norm (`limit` in a row stop the run), or an RL
        batch with no sample left to train on (rl_step returned before any step: no train/skipped)."""
        what = ", ".join(f"{k.removeprefix('train/')} {metrics[k]}" for k in ("train/loss", "train/grad_norm")
                         if k in metrics and not math.isfinite(metrics[k])) or "the loss or gradient"
        if metrics.get("train/skipped"):
            self.total, self.run = self.total + 1, self.run + 1
            if rank() == 0 and self.run < self.limit:
                print(f"[train] {stage} step {step} skipped, no weight changed: {what} not finite ({self.run} in a "
                      f"row; optim.max_skipped_steps: {self.limit} in a row stop the run)", flush=True)
        else:
            self.run = 0
            if "train/skipped" not in metrics and rank() == 0:
                print(f"[train] {stage} step {step} trained nothing: no sample of its batch was left (stale, failed or "
                      f"masked)", flush=True)
        metrics["train/skipped_steps"] = self.total
        if self.run >= self.limit:
            raise FloatingPointError(f"{stage} step {step}: {what} for {self.run} steps in a row (optim.max_skipped_steps: "
                                     f"{self.limit}); the skipped steps changed no weights. Lower the learning rate?")


# Rank metrics become one row: counts and throughputs add up, maxima take the max, the rest (means
# of equal-sized shares, or values already global) is averaged over the ranks that have the key.
SUMMED = {"train/samples", "train/tokens", "train/masked", "staleness/dropped", "rollout/groups_dropped",
          "rollout/prompts_cancelled", "rollout/env_failures", "rollout/groups_failed", "rollout/gen_tokens_per_s",
          "perf/tokens_per_s"}
MAXED = {"staleness/max", "train/logp_diff_max", "perf/step_s", "perf/publish_s"}


def combine_ranks(metrics):
    """This rank's metrics -> the row of the whole step (the same on every rank)."""
    parts, out = all_gather(metrics), {}
    for k in dict.fromkeys(k for p in parts for k in p):
        vals = [p[k] for p in parts if k in p]
        out[k] = sum(vals) if k in SUMMED else max(vals) if k in MAXED else sum(vals) / len(vals)
    return out


def unwrap(model) -> GLM:
    return model.module if isinstance(model, DDP) else model


# ----------------------------------------------------------------------------- processes and devices


def local_layout():
    """(this process's index on its machine, processes on this machine), as torchrun set them."""
    return int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def pair_devices(cfg):
    """(generator device, learner device): cuda:r and cuda:r+G for process r of G on a machine with
    2G GPUs; one GPU shared by both in a single process on a one-GPU machine; cpu without GPUs.
    Co-located (train.colocate): cuda:r for both, G GPUs for G processes."""
    r, G = local_layout()
    n = torch.cuda.device_count()
    explicit = cfg.train.generator_device, cfg.train.learner_device
    if cfg.train.colocate and not any(explicit) and n:
        if n < G:
            raise ConfigError(f"{G} co-located processes on this machine need {G} GPUs, found {n}")
        return torch.device(f"cuda:{r}"), torch.device(f"cuda:{r}")
    if any(explicit):
        if G > 1:
            raise ConfigError("train.generator_device / learner_device name one device: set them to null when "
                              f"{G} processes share this machine (each takes its GPU pair)")
        return (torch.device(explicit[0] or ("cuda:0" if n else "cpu")),
                torch.device(explicit[1] or ("cuda:1" if n > 1 else "cuda:0" if n else "cpu")))
    if n == 0:
        return torch.device("cpu"), torch.device("cpu")
    if n >= 2 * G:
        return torch.device(f"cuda:{r}"), torch.device(f"cuda:{r + G}")
    if n == G == 1:
        return torch.device("cuda:0"), torch.device("cuda:0")
    raise ConfigError(f"{G} processes on this machine need {2 * G} GPUs (a generator and a learner each), "
                      f"found {n}: lower train.pairs or --nproc-per-node")


def init_processes(learner_device):
    """Join the process group torchrun describes in the environment (nothing to do in one process).
    NCCL carries the learners' collectives on GPUs, gloo on CPU."""
    if "RANK" not in os.environ or dist.is_initialized():
        return
    if learner_device.type == "cuda":
        torch.cuda.set_device(learner_device)
        dist.init_process_group("nccl", device_id=learner_device, timeout=datetime.timedelta(minutes=60))
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=60))


def once_per_machine(fetch, apply):
    """Downloads (hub.py) happen once per machine: global rank 0 fetches first and every rank applies its result
    (the revisions it resolved), then local rank 0 of every other machine fetches those same revisions while the
    rest wait. One process: fetch, then apply."""
    result = all_gather(fetch() if rank() == 0 else None)[0]
    apply(result)
    if rank() != 0 and local_layout()[0] == 0:
        fetch()
    barrier()


def launch(pairs, script, argv):
    """`python train.py` with train.pairs > 1: start the pairs through torchrun's own launcher (one
    machine, a free port), each running the script with the same arguments. Only the first failing
    process's one-line error is shown (the others stop quietly when it goes)."""
    import logging
    from torch.distributed.run import get_args_parser, run
    print(f"[train] starting {pairs} processes (one per generator/learner pair)", flush=True)
    os.environ["HF_HUB_OFFLINE"] = "1"  # this process fetched whatever the Hub had to give: they read the cache
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cpu_cores() // pairs)))  # set_threads refines it
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # its failure tables repeat ours
    try:
        run(get_args_parser().parse_args(["--standalone", f"--nproc-per-node={pairs}",
                                          script, *argv]))
    except Exception as e:  # noqa: BLE001 - a failing process printed its own one-line error already
        codes = [f.exitcode for f in getattr(e, "failures", {}).values()]
        killed = [-c for c in codes if c is not None and c < 0]
        # Once one process fails, torchrun ends the others with SIGTERM: beside a process's own error (a
        # positive exit code, its one line already printed) a SIGTERM is that teardown, not the cause
        if any(c is not None and c > 0 for c in codes):
            killed = [s for s in killed if s != signal.SIGTERM]
        raise SystemExit(f"error: a training process was killed by signal {killed[0]} (out of memory?)" if killed
                         else max([c for c in codes if c] or [1])) from None


def cpu_cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def set_threads(devices, rl: bool):
    """Processes on one machine split its cores; within a process, the learner (main thread) and the
    generator thread get half each during RL when both run on the CPU, so their op thread pools do not
    fight over the same cores. Co-located (train.colocate) too, though the halves then take turns: the same
    thread counts keep a co-located CPU run bit-identical to the split one."""
    cores = max(1, cpu_cores() // local_layout()[1])
    both_cpu = devices[0].type == devices[1].type == "cpu"
    torch.set_num_threads(max(1, cores // 2) if rl and both_cpu else cores)


# ----------------------------------------------------------------------------- the learner across ranks


def parallel_learner(model, device, parallel):
    """The module the learner steps. Across processes: FSDP2 shards the fp32 weights, gradients and
    AdamW state over the ranks (each decoder layer is gathered just before use, in bf16 on GPU, and
    reduced in fp32), or DDP keeps full replicas and all-reduces gradients. Called at the start of each
    stage once it has chosen which parameters train: DDP fixes that set when built, FSDP2 follows
    requires_grad by itself, so it shards once (at load: load_learner)."""
    if world() == 1:
        return model
    if parallel == "ddp":
        return DDP(model, device_ids=[device] if device.type == "cuda" else None)
    if not isinstance(model, FSDPModule):
        shard(model, device)
    return model


def shard(model, device):
    """FSDP2 over every rank: one unit per decoder layer and the root (embeddings, final norm, lm_head). Units of
    their own, gathered as stored (fp32) where the layer's are gathered in bf16: a layer's DSA indexer and an MoE
    layer's router (model.FP32_PARAMS: the router compares fp32 scores, which a bf16 weight would perturb enough
    to flip near-tied experts). The routed experts' [E, ...] tensors shard along dim 0 like any weight: each rank
    holds E / world() experts' rows. Works on a meta-device model too."""
    mp = gather_policy(device)
    mesh = init_device_mesh(device.type, (world(),))
    fp32 = MixedPrecisionPolicy(reduce_dtype=torch.float32)  # gathered as stored: fp32
    for layer in model.layers:
        if layer.self_attn.indexer is not None:
            fully_shard(layer.self_attn.indexer, mesh=mesh, mp_policy=fp32)
        if isinstance(layer.mlp, MoE):
            fully_shard(layer.mlp.gate, mesh=mesh, mp_policy=fp32)
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def gather_policy(device):
    """FSDP2's mixed precision for the decoder's units: on GPUs weights gathered in bf16 (what autocast would cast
    them to anyway) and gradients reduced in fp32; on the CPU everything as stored."""
    if device.type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def load_learner(path, dsa, device, parallel, dtype=torch.float32, mtp=None):
    """A learner's model (or the KL reference) from an HF directory. Under FSDP with several ranks it is
    sharded on the meta device before anything is allocated, and each rank reads only its own rows of
    each tensor from the files (model.GLM.from_pretrained): no rank ever holds the full fp32 model.
    mtp: model.mtp_layers (None keeps the checkpoint's MTP layers)."""
    sharded = world() > 1 and parallel == "fsdp"
    return GLM.from_pretrained(path, dsa=dsa, dtype=dtype, device=device,
                               shard=(lambda m: shard(m, device)) if sharded else None, mtp=mtp)
