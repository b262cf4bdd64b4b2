"""
Start-up: from the command line to a loaded run, everything train.main needs before its first stage. In order:
the config (the YAML, overrides, or the run's own on --resume) -> --dry-run's memory plan -> devices and the
process group -> Hub ids fetched once per machine and pinned -> files checked -> the architecture (config.json
alone) -> other processes launched (train.pairs) -> the memory plan against the real GPU -> config.yaml ->
seeds and threads -> the tokenizer (a distillation teacher's must be the same), the reward or env, every prompt
tokenized -> the learner's weights (its FSDP shards; on resume the latest readable checkpoint) -> the engine -> the
metrics log and the signal handler. (The distillation teacher's weights load when RL starts: train.train_rl.)

Each check fails with one line naming the key or file (config.ConfigError), before any weights load where it can.
"""
import argparse
import inspect
import os
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer

import data
import dsa
from machinery import env, hub
from machinery.checkpoint import MetricsLog, Preemption, checkpoints, load_latest, seed_all, set_rng_state, starting_point
from machinery.config import (Config, ConfigError, architecture, check_memory, check_paths, eval_sets, hub_specs,
                              load_config, load_run_config, prefill_budget, save_config, sources)
from machinery.engine import make_engine
from machinery.lora import base_dir
from machinery.teacher import check_tokenizer
from machinery.parallel import (barrier, init_processes, launch, load_learner, once_per_machine, pair_devices, rank,
                                set_threads, world)


@dataclass
class Run:
    """What a started process holds: the settings, the data, the learner's model, the engine, where it resumes."""
    cfg: Config
    devices: tuple  # (generator device, learner device)
    tokenizer: object
    env_cls: type  # data.env's class, or rollout.single_turn(data.reward)
    train_examples: list
    sets: dict  # eval set name -> examples
    model: object  # the learner's GLM (FSDP: its shards)
    engine: object  # the generator (None without RL steps)
    resume: dict | None  # the checkpoint's state.pt (None: a fresh run)
    log: MetricsLog
    preempt: Preemption


def env_args(cfg):
    """data.env_args, plus the run's own paths for an env whose setup hides paths from model code (PythonMath's
    sandbox takes `hide`): the run_dir (checkpoints, rollout dumps: the labels) and the local data files, wherever
    they are (PythonMath hides the working directory and the Hub cache by itself)."""
    args = dict(cfg.data.env_args or {})
    setup = getattr(data.load_object(cfg.data.env, "data.env"), "setup", None)
    if callable(setup) and "hide" in inspect.signature(setup).parameters:
        local = [os.path.abspath(p) for p in sources(cfg).values() if os.path.exists(p)]
        args["hide"] = [*args.get("hide", ()), os.path.abspath(cfg.run_dir), *local]
    return args


def parse(argv, description, default_config):
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=default_config, help="YAML recipe (default: configs/tiny_cpu.yaml)")
    parser.add_argument("--resume", action="store_true", help="continue the run in run_dir from its config and latest checkpoint")
    parser.add_argument("--dry-run", action="store_true", help="print the parameter count and per-GPU memory plan, then exit")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="override config keys")
    return parser.parse_intermixed_args(argv)  # flags and key=value overrides in any order


def start(argv, description, script, default_config, single_turn) -> Run | None:
    """The run of this process, or None when nothing more is to be done here (--dry-run printed its plan, or this
    process launched train.pairs others, which ran the run). script: train.py's path (what launch starts again);
    single_turn: rollout.single_turn, which makes the reward hook an env when data.env is not set."""
    args = parse(argv, description, default_config)
    cfg = load_config(args.config, args.overrides)
    if args.resume and os.path.isfile(os.path.join(cfg.run_dir, "config.yaml")):
        cfg = load_run_config(cfg, args.overrides)  # the run's own settings, plus what may change mid-run
    dsa.USE_TRITON, run_dir = cfg.model.dsa_kernels, cfg.run_dir
    under_torchrun = "RANK" in os.environ
    if args.dry_run:
        check_memory(cfg, int(os.environ.get("WORLD_SIZE", 1)) if under_torchrun else cfg.train.pairs, title=args.config)
        return None  # printed the plan, or raised what does not fit
    fresh = not (args.resume and checkpoints(run_dir))
    if not args.resume and (checkpoints(run_dir) or os.path.exists(os.path.join(run_dir, "metrics.jsonl"))):
        raise ConfigError(f"{run_dir} already holds a run; pass --resume to continue it, or run_dir=... for a new one")
    devices = pair_devices(cfg)  # (generator, learner)
    init_processes(devices[1])  # under torchrun: the process group comes first, the downloads are shared out by rank
    # Hub ids (hub.py): fetched once per machine, pinned, before `python train.py` starts its processes
    once_per_machine(lambda: hub.fetch(hub_specs(cfg)), lambda pins: hub.pin(cfg, pins))
    check_paths(cfg)
    arch = architecture(cfg)  # config.json only: the checks below need no weights
    if cfg.train.dsa_warmup_steps and arch.dsa is None:
        raise ConfigError("train.dsa_warmup_steps > 0 needs a DSA model (set model.dsa)")
    if cfg.train.pairs > 1 and not under_torchrun:
        launch(cfg.train.pairs, script, argv)
        return None
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
        check_tokenizer(cfg, tokenizer)  # a distillation teacher must share it
        reward = data.load_reward(cfg.data.reward, cfg.data.answer_line)  # (answer_line: the built-in grader's option)
        env_cls = env.load_env(cfg.data.env, env_args(cfg)) if cfg.data.env else single_turn(reward)
        examples_of = lambda src, split: data.load_examples(  # noqa: E731  (all prompts tokenized now: fail in seconds)
            src, tokenizer, cfg.data, split=split, seed=cfg.seed, sft=cfg.train.sft_steps > 0, chat_template=
            cfg.rollout.chat_template, max_prompt_tokens=cfg.rollout.max_prompt_tokens, verbose=rank() == 0,
            openings=cfg.data.env and (lambda exs: env.openings(env_cls, exs, tokenizer, cfg.rollout.chat_template,
                                                              cfg.rollout.env_timeout_s)),
            files_of=hub.data_files)
        train_examples = examples_of(cfg.data.train, "train")
        sets = {name: examples_of(src, "eval") for name, src in eval_sets(cfg).items()}
        frozen = cfg.model.lora is not None and devices[1].type == "cuda" and not (cfg.train.dsa_warmup_steps or cfg.train.sft_steps)
        load = lambda path: load_learner(path, cfg.model.dsa, devices[1], cfg.train.parallel,  # noqa: E731  (FSDP: its shards)
                                         torch.bfloat16 if frozen else torch.float32,  # (LoRA, RL alone: a base that never trains)
                                         mtp=cfg.model.mtp_layers)
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
                             seed=cfg.seed + 7919 * rank(), lora_cfg=cfg.model.lora, empty=cfg.train.colocate,
                             mtp=cfg.model.mtp_layers, prefill_tokens=prefill_budget(cfg)) \
            if cfg.train.rl_steps > 0 else None
    except (ImportError, ValueError) as e:
        raise ConfigError(str(e)) from None
    if cfg.train.colocate and engine is not None:  # co-located: the warm-ups have the GPU to themselves; RL's first
        engine.release()  # publish fills the engine (made without weights, but fp8's load to be quantized)
    return Run(cfg, devices, tokenizer, env_cls, train_examples, sets, model, engine, resume, MetricsLog(cfg, resume),
               Preemption())
