"""
The run directory, and everything that makes a run survive a kill:

    run_dir/config.yaml         the resolved config; --resume continues from it
    run_dir/metrics.jsonl       one JSON line per step (MetricsLog)
    run_dir/init_model/         a fresh model's starting weights (model.init), rebuilt if its config changes
    run_dir/reference/          the KL reference (grpo.kl_coef > 0 or kl_guard), the policy RL started from
    run_dir/checkpoints/step_001020/   a Hugging Face model directory plus state.pt, named by the step
                                across stages: stage, step, optimizer, KL guard, skipped steps, and per
                                rank the data position, the RNGs and the rollout batches already sampled

Every directory is written under a temporary name and renamed into place, so a kill, a full disk or
Ctrl-C never leaves half a checkpoint; resume falls back past a checkpoint it cannot read.
A SIGTERM or SIGINT asks for a checkpoint at the next step boundary (Preemption).
"""
import errno
import json
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from transformers import AutoTokenizer

import data
from machinery import hub
from machinery import lora
from machinery.config import ConfigError
from model import GLM, GLMConfig
from machinery.parallel import all_gather, barrier, load_learner, rank, unwrap
from machinery.env import TooManyFailures

STAGES = ("dsa_warmup", "sft", "rl")
FULL_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 gets it all, in CPU memory


def global_step(cfg, stage, step):
    """Steps across stages, in order: names checkpoints and is TensorBoard's x axis."""
    t = cfg.train
    return step + {"dsa_warmup": 0, "sft": t.dsa_warmup_steps, "rl": t.dsa_warmup_steps + t.sft_steps}[stage]


def _disk_full(e, path):
    """A write failed for want of space? Libraries word it their own way (safetensors, torch.save)."""
    text = str(e)
    if getattr(e, "errno", None) == errno.ENOSPC or "No space left" in text or "StorageFull" in text:
        return True
    try:
        return shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free < 64 * 2**20
    except OSError:
        return False


def save_dir(path, model, tokenizer, state=None, files=None):
    """Write into a temp directory, then rename: a crash never leaves a half-written directory, and the
    previous checkpoint stays intact when the disk fills up. files: {name: text} written beside."""
    tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if state is not None:
            torch.save(state, os.path.join(tmp, "state.pt"))
        for name, text in (files or {}).items():
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
    except BaseException as e:  # Ctrl-C included: leave no partial directory behind
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and _disk_full(e, tmp):
            raise OSError(errno.ENOSPC, "no space left on device", path) from None
        raise
    shutil.rmtree(path, ignore_errors=True)
    os.rename(tmp, path)


def rng_state():
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def set_rng_state(rng):
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def save_checkpoint(cfg, model, tokenizer, stage, step, optimizer, rank_state, **state):
    """run_dir/checkpoints/step_<global step, 6 digits>/: an HF model directory plus state.pt, all needed to
    continue exactly. rank_state is this rank's own (data position, pending rollout batches); state is
    global (KL guard, skipped steps). Every rank takes part (FSDP gathers the full weights and optimizer
    state onto rank 0, in CPU memory); rank 0 writes. Several machines: run_dir must be storage that all
    of them read (resume loads it)."""
    optim = get_optimizer_state_dict(model, optimizer, options=FULL_ON_RANK0)
    ranks = all_gather(rank_state | {"rng": rng_state()})
    gs = global_step(cfg, stage, step)
    state = {"stage": stage, "step": step, "global_step": gs, "optimizer": optim, "ranks": ranks} | state
    root = os.path.join(cfg.run_dir, "checkpoints")
    if hasattr(unwrap(model), "lora"):
        save_lora(model, tokenizer, os.path.join(root, f"step_{gs:06d}"), state)
    else:
        save_full(model, tokenizer, os.path.join(root, f"step_{gs:06d}"), state)
    if rank() == 0:
        for old in checkpoints(cfg.run_dir)[:-cfg.train.keep_checkpoints]:
            shutil.rmtree(old)


def save_full(model, tokenizer, path, state=None):
    """Save a (possibly sharded) model as one HF directory. Every rank takes part in the gathers, rank 0
    writes, and nobody runs ahead of a directory that is still being written."""
    weights = get_model_state_dict(model, options=FULL_ON_RANK0)  # {name: tensor} on rank 0, {} elsewhere
    if rank() == 0:
        with torch.device("meta"):  # a shell around the gathered tensors, to save through save_pretrained
            net = GLM(unwrap(model).cfg)
        net.load_state_dict(weights, assign=True)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_dir(path, net, tokenizer, state)
    barrier()


def save_lora(model, tokenizer, path, state):
    """A LoRA run's RL checkpoint: its adapters (peft's layout) and state.pt, no weights. The frozen base they
    sit on is written once, to run_dir/lora_base (lora.base_dir finds it). The ranks' replicas are equal: rank 0
    writes its own."""
    if rank() == 0:
        net, base = unwrap(model), os.path.join(os.path.dirname(os.path.dirname(path)), lora.BASE)
        if not os.path.isdir(base):
            with torch.device("meta"):
                shell = GLM(net.cfg)
            shell.load_state_dict({k: v for k, v in net.state_dict().items() if not k.endswith((".lora_A", ".lora_B"))},
                                  assign=True)
            save_dir(base, shell, tokenizer)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_dir(path, _Adapters(net, base), tokenizer, state)
    barrier()


class _Adapters:
    """What save_dir saves for a LoRA checkpoint: the adapters, in peft's layout, naming their base."""
    def __init__(self, net, base):
        self.net, self.base = net, base

    def save_pretrained(self, folder):
        os.makedirs(folder, exist_ok=True)
        lora.write_adapters(self.net, folder, base_model=os.path.abspath(self.base))


def resumed(resume, stage, key, default):
    """A value of the checkpoint we resume from, if it was taken in this stage."""
    return resume[key] if resume is not None and resume["stage"] == stage else default


def restore(resume, stage, learner, optimizer, stream, guard=None):
    """A stage resumed mid-way (its checkpoint's step > 0): the optimizer's state (FSDP: each rank its shards), this
    rank's prompt stream and the KL guard come back; otherwise nothing."""
    if not resumed(resume, stage, "step", 0):
        return
    set_optimizer_state_dict(learner, optimizer, resume["optimizer"], options=StateDictOptions(full_state_dict=True))
    stream.load_state_dict(resume["ranks"][rank()]["stream"])
    if guard is not None:
        guard.load_state_dict(resume["kl_guard"])


def reference_model(cfg, model, tokenizer, resume):
    """The frozen KL reference: the policy as RL started, saved once to run_dir/reference (so that a resumed
    run keeps it) and loaded on the learner device like the policy (FSDP: each rank reads only its shards).
    bf16 on a GPU: the learner's forward computes in bf16 there (autocast, FSDP's bf16 gathers), so fp32
    reference weights would be rounded to the same bf16 at every use and only cost memory; fp32 on the CPU."""
    if cfg.model.lora is not None:  # the base under the adapters: the same model with them off (lora.Base)
        return lora.Base(model)
    ref_dir, device = os.path.join(cfg.run_dir, "reference"), model.lm_head.weight.device
    if not os.path.isdir(ref_dir):
        if resume is not None and resume["stage"] == "rl" and resume["step"] > 0:
            raise ConfigError(f"{ref_dir} is missing; the KL reference of this run is lost")
        save_full(model, tokenizer, ref_dir)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return load_learner(ref_dir, None, device, cfg.train.parallel, dtype).eval().requires_grad_(False)


def checkpoints(run_dir):
    root = os.path.join(run_dir, "checkpoints")
    names = sorted(d for d in os.listdir(root) if d.startswith("step_")) if os.path.isdir(root) else []
    return [os.path.join(root, d) for d in names]


def load_latest(run_dir, load_model, processes):
    """(checkpoint path, state, model) of the newest checkpoint that loads, falling back past any that
    cannot be read (a garbled file, a disk that filled up outside our atomic writes), saying which."""
    for ckpt in reversed(checkpoints(run_dir)):
        try:  # our own file (RNG states are not tensors); mmap: processes share one copy in memory
            state = torch.load(os.path.join(ckpt, "state.pt"), weights_only=False, mmap=True)
            model = lora.load_model(ckpt, load_model)  # (a LoRA checkpoint: its base, then its adapters)
        except Exception as e:  # noqa: BLE001 - any unreadable checkpoint: try the one before
            if rank() == 0:
                print(f"[train] {ckpt} cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); "
                      "trying the previous checkpoint", file=sys.stderr, flush=True)
            continue
        if len(state["ranks"]) != processes:
            raise ValueError(f"{ckpt} was written by {len(state['ranks'])} processes; resume it with as many "
                             f"(this run has {processes})")
        return ckpt, state, model
    raise ValueError(f"--resume: no readable checkpoint in {run_dir}/checkpoints")


def starting_point(cfg, run_dir) -> str:
    """The directory the run starts from: model.path, or a fresh random model (plus its tokenizer)
    written to run_dir/init_model, so that it loads through the same code as a real checkpoint. A leftover
    init_model/ made from other settings (a failed start, then a retry) is rebuilt, never reused.
    (config.check_paths has made sure that model.path and model.tokenizer hold what they must.)"""
    if cfg.model.path is not None:
        return hub.model_dir(cfg.model.path)  # a Hub id: its snapshot in the cache (fetched at start-up)
    out = os.path.join(run_dir, "init_model")
    tokenizer = cfg.model.tokenizer or ("tiny-tools" if data.uses_tools(cfg.data.train) else None)
    made_from = {"init": cfg.model.init, "dsa": cfg.model.dsa, "tokenizer": tokenizer, "seed": cfg.seed}
    mtp = {} if cfg.model.mtp_layers is None else {"mtp_layers": cfg.model.mtp_layers}  # (a fresh model's own MTP layers)
    made_from |= mtp
    stamp = os.path.join(out, "made_from.json")
    if os.path.isdir(out):
        try:
            with open(stamp) as f:
                if json.load(f) == made_from:
                    return out
        except (OSError, json.JSONDecodeError):
            pass
        print(f"[train] {out} was made from other settings: rebuilding it", flush=True)
    tok = (AutoTokenizer.from_pretrained(hub.model_dir(cfg.model.tokenizer, "model.tokenizer")) if cfg.model.tokenizer
           else data.synthetic_tokenizer(cfg.data.train))
    glm_cfg = GLMConfig(**{**cfg.model.init, **mtp}, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                        eos_token_id=[tok.eos_token_id], dsa=cfg.model.dsa)
    torch.manual_seed(cfg.seed)
    save_dir(out, GLM(glm_cfg), tok, files={"made_from.json": json.dumps(made_from)})
    return out


class MetricsLog:
    """One JSON object per line in run_dir/metrics.jsonl (and TensorBoard when it is installed, and a Weights &
    Biases run with train.wandb_project). A fresh run starts a new file; on resume, lines past the checkpoint
    are cut first: those steps are about to be redone. metrics.jsonl is the record; the others are views."""

    def __init__(self, cfg, resume=None):
        self.cfg, self.path, self.t0 = cfg, os.path.join(cfg.run_dir, "metrics.jsonl"), time.time()
        self.tb, self.wandb, self.on = None, None, rank() == 0  # rank 0 writes the (already combined) metrics
        if cfg.train.wandb_project is not None:  # checked on every rank: all stop with the same line, before training
            try:
                import wandb  # noqa: F401
            except ImportError:
                raise ConfigError('train.wandb_project is set but wandb is not installed: '
                                  'pip install -e ".[wandb]"') from None
        if not self.on:
            return
        keep = []
        if resume is not None and os.path.exists(self.path):
            with open(self.path) as f:
                for line in f:
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a line cut short by a kill
                    if (STAGES.index(row["stage"]), row["step"]) <= (STAGES.index(resume["stage"]), resume["step"]):
                        keep.append(line)
        with open(self.path + ".tmp", "w") as f:
            f.writelines(keep)
        os.replace(self.path + ".tmp", self.path)
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(cfg.run_dir, purge_step=resume["global_step"] + 1 if resume else None)
        except ImportError:
            pass
        if cfg.train.wandb_project is not None:
            self._start_wandb(resume)

    def _start_wandb(self, resume):
        """One wandb run per training run: run_dir/wandb_run.json keeps its id, so that --resume continues the
        same run, and the last step sent to it. wandb refuses a step at or below one it already has, so the
        steps a resume redoes are not sent again: the dashboard keeps their first values, while metrics.jsonl
        has the redone ones. A fresh start (like its new metrics.jsonl) or another project is a new wandb run."""
        import wandb
        project, state = self.cfg.train.wandb_project, None
        self.wandb_file = os.path.join(self.cfg.run_dir, "wandb_run.json")
        if resume is not None and os.path.exists(self.wandb_file):
            with open(self.wandb_file) as f:
                state = json.load(f)
            if state["project"] != project:
                state = None
        try:  # WANDB_MODE and the rest of wandb's environment apply (offline: no network, `wandb sync` uploads later)
            self.wandb = wandb.init(project=project, id=state["id"] if state else None, resume="allow",
                                    dir=self.cfg.run_dir, config=asdict(self.cfg),
                                    name=os.path.basename(os.path.normpath(self.cfg.run_dir)))
        except wandb.errors.Error as e:  # e.g. not logged in: one line, before any training
            raise ConfigError(f"wandb: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        self.wandb_state = state or {"project": project, "id": self.wandb.id, "last_step": -1}
        self.wandb_floor = self.wandb_state["last_step"]  # sent before this resume: not again
        self._save_wandb_state()  # now: a kill before the first row still resumes this run

    def _save_wandb_state(self):
        with open(self.wandb_file + ".tmp", "w") as f:
            json.dump(self.wandb_state, f)
        os.replace(self.wandb_file + ".tmp", self.wandb_file)

    def write(self, stage, step, metrics):
        if not self.on:
            return
        gs = global_step(self.cfg, stage, step)
        row = {"stage": stage, "step": step, "global_step": gs, "time/elapsed_s": time.time() - self.t0} | metrics
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        scalars = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k not in ("step", "global_step")}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, gs)
        # Steps above the floor only. In one session a step may come twice (a stage's last step and RL step 0 share
        # a global step): wandb merges the two rows into one.
        if self.wandb is not None and gs > self.wandb_floor:
            self.wandb.log(scalars, step=gs)
            if gs > self.wandb_state["last_step"]:
                self.wandb_state["last_step"] = gs
                self._save_wandb_state()

    def finish(self):
        """The end of training: the wandb run is marked finished (left open, wandb would end it at exit, by the
        exit code) and TensorBoard's events are flushed. Every rank may call it."""
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None


class Preemption:
    """SIGTERM (what schedulers send before they kill) and SIGINT (Ctrl-C) ask the run to checkpoint at
    the next step boundary and exit; a second signal exits at once. requested() is collective: every rank
    stops at the same step if any rank was signalled."""

    def __init__(self):
        self.signum = None
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        if self.signum is not None:
            print(f"\n[train] second {signal.Signals(signum).name}: exiting now", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.signum = signum
        if rank() == 0:
            print(f"\n[train] {signal.Signals(signum).name}: saving a checkpoint at the end of this step "
                  "(again to exit at once)", file=sys.stderr, flush=True)

    def requested(self) -> bool:
        return any(all_gather(self.signum is not None))


class Preempted(Exception):
    """Raised after the preemption checkpoint is written: the message says how to continue."""

    def __init__(self, signum, run_dir, where):
        super().__init__(f"stopped by {signal.Signals(signum).name} after {where}, checkpoint saved; continue with: "
                         f"python train.py --resume run_dir={run_dir}")
        self.signum = signum


def run_main(main):
    """Run train.main the way a user wants it to end: a preempted run exits 128 + signum with the command
    that continues it; a bad setting, the environment (OSError) or a blown-up run (FloatingPointError) is
    one `error: ...` line, shown once (rank 0: every rank has the same error); a rank whose collective broke
    because a peer failed exits quietly (the peer said why). Anything else is a bug: its traceback shows."""
    first = int(os.environ.get("RANK", 0)) == 0
    try:
        main()
    except Preempted as e:  # a checkpoint was written at the step boundary after SIGTERM / SIGINT
        if first:
            print(f"[train] {e}", file=sys.stderr)
        sys.exit(128 + e.signum)
    except (ConfigError, FloatingPointError, OSError, TooManyFailures) as e:  # a setting, the machine, a blown-up run, an env
        if first:
            sys.exit(f"error: {e.strerror.lower()}: {e.filename}" if isinstance(e, OSError) and e.filename else f"error: {e}")
        sys.exit(1)
    except KeyboardInterrupt:  # before training started: nothing to save
        sys.exit("interrupted")
    except Exception as e:  # noqa: BLE001
        if not first and isinstance(e, (RuntimeError, dist.DistError)):
            sys.exit(1)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
