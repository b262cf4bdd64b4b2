"""
The run's settings: every key with its default and its meaning (this file is their one home), loading
a YAML recipe plus `key.sub=value` overrides, checking every value before any work starts, what a
resumed run may change, and the bridge from a config to memory.py's plan that `--dry-run` prints.

A recipe (configs/*.yaml) states only what differs from the defaults below. The defaults are GLM-5's
RL method at the 9B scale: GRPO with clip-higher, IcePop and one step off-policy, AdamW at lr 1e-6.
The grpo section is the objective's own dataclass, grpo.GRPOConfig, documented where it is used.
"""
import difflib
import json
import math
import os
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace

import yaml
from transformers import AutoTokenizer

import data
import grpo
from machinery import ConfigError, hub
from machinery import lora
from grpo import GRPOConfig
from machinery.memory import GiB, PREFILL_TOKENS, memory_plan
from model import GLMConfig

H100_BYTES = 80 * 10**9  # what --dry-run plans for: 80 GB = 74.5 GiB (an H100 SXM reports 79.6 GiB: the rest is margin)
TRUNCATED = ("keep", "zero", "mask")  # what rollout.truncated may say (rollout.py, "beyond one RL step")
LOGIT_CHUNK = 1024  # response tokens per lm_head call: a [1024, 151552] fp32 block is 620 MB
# A micro-batch whose fp32 logits [response tokens, vocab] take at most this keeps them for backward instead
# of recomputing lm_head there (at 9B: at most 110 response tokens; small models: every micro-batch)
LOGIT_KEEP_BYTES = 64 * 2**20


@dataclass
class ModelConfig:
    # A Hugging Face checkpoint (Glm4ForCausalLM layout): a local directory, or a Hub id (owner/name[@revision]) that
    # hub.py fetches into the Hub cache at start-up; the revision it resolved is written back here (run_dir/config.yaml)
    path: str | None = None
    init: dict | None = None  # or: model.GLMConfig fields of a fresh random model (vocab, eos, pad: the tokenizer's)
    dsa: dict | None = None  # dsa.DSAConfig fields (topk, heads, head_dim, rope_dim, pattern); null: the checkpoint's own
    tokenizer: str | None = None  # a tokenizer directory or Hub id; null: the checkpoint's (with init: the synthetic task's)
    gradient_checkpointing: bool = False  # recompute each block in backward: less learner memory, ~1/3 more compute
    dsa_kernels: bool = True  # on CUDA, DSA and the engine's sampler run dsa_triton.py's kernels (false: PyTorch)
    # LoRA for RL (lora.LoRAConfig: rank, alpha, targets, lr; {} takes its defaults): the warm-up stages train the
    # whole model, then RL trains adapters on every decoder linear of that frozen base (bf16 on a GPU), publishes
    # the adapters alone, and checkpoints adapters + their optimizer state. null: RL trains the whole model
    lora: dict | None = None
    # MoE models (GLM-4.7-Flash, GLM-5): the learner's forward uses the experts the generator chose for each token
    # (rollout), or routes afresh (none). A tiny numeric difference between the two copies flips a token's top-k
    # experts, and the importance ratios of the tokens after it blow up; replaying the rollout's routes (slime's
    # rollout routing replay, verl's R3) keeps the learner on the generator's computation, while the router's
    # weight still learns through the weights it gives the replayed experts (in full fine-tuning: under model.lora
    # the router stays frozen). routing/* in metrics.jsonl shows the agreement and the learner-generator gap with
    # and without, and routing/unrecorded the share of samples that carried no routes (their tokens route afresh).
    # The router's score-correction bias (a buffer the pre-training balancer nudged, never a gradient's) stays as
    # loaded. Dense models ignore this key
    routing_replay: str = "rollout"
    # Multi-token-prediction layers (families/mtp.py; config.json's num_nextn_predict_layers): null keeps the
    # checkpoint's own (GLM-4.7-Flash and GLM-5 ship one, GLM-Z1-9B none), 0 drops them on load, more adds fresh ones
    # (model.init: a fresh model with that many). They draft tokens for speculative decoding and train on the MTP loss
    mtp_layers: int | None = None
    # The MTP loss's weight beside the RL objective (families/mtp.py's mtp_loss(..., scale=); slime's
    # --mtp-loss-scaling-factor 0.2); it trains the MTP layers alone (the trunk's hidden states detached)
    mtp_loss_scale: float = 0.2


@dataclass
class DataConfig:
    # A prompt file, JSONL or Parquet (.parquet, with pyarrow), or a synthetic task's train split (data.SYNTHETIC:
    # `synthetic`, the arithmetic task; `synthetic:multiply`, two-digit products for the calculator env;
    # `synthetic:multiply-no-tool`)
    train: str = "synthetic"
    # Held-out prompts: one file or task (named by its stem), or several as {name: file}; a set whose file names
    # its fields differently (AIME sets: problem, answer) is {name: {path: file, prompt_key: ..., label_key: ...}}
    eval: str | dict = "synthetic"
    # The keys below name a field of each row, or a path into nested objects (`reward_model.ground_truth`): a
    # top-level key of exactly that name wins, else each dot goes one level down
    prompt_key: str = "prompt"  # key of the prompt: a string or a list of chat messages
    label_key: str = "label"  # key of the reference answer the reward grades against
    response_key: str = "solution"  # key of a reference response, for the supervised stage (sft_steps > 0)
    # Drop rows whose prompt repeats an earlier row's, keeping the first, in data.train and every eval set (a repeated
    # eval prompt would count twice): DAPO-Math-17k's original release has ~1.79M rows for its 17,917 prompts. One
    # line says how many were dropped, and how many of those carried another label than the row kept
    dedup: bool = False
    # data:math_reward also takes DAPO's final "Answer: ..." line as the answer (its prompts ask for one): of that
    # line and the last \boxed{}, whichever comes later. For the built-in grader only (an error with another
    # data.reward or with data.env), which load_reward binds it to
    answer_line: bool = False
    reward: str = "data:math_reward"  # module:function called as fn(response_text, example) -> float
    # module:Class of a multi-turn environment (rollout.py's contract, e.g. machinery.env:Calculator, machinery.tools:PythonMath); its reward
    # replaces data.reward. null: one turn graded by data.reward
    env: str | None = None
    # Keyword arguments of the env class's setup() (rollout.py's contract; called once per process before the model
    # loads: machinery.tools:PythonMath takes its sandbox's workers, timeout_s, memory_mb, max_procs, max_output_chars)
    env_args: dict = field(default_factory=dict)
    train_size: int | None = None  # use the first this many train examples; null: all
    eval_size: int | None = None  # ... and of each eval set


@dataclass
class RolloutConfig:
    prompts_per_step: int = 32  # prompt groups per RL step
    n: int = 8  # samples per prompt: the GRPO group
    temperature: float = 1.0  # sampling temperature; the learner divides its logits by it too
    max_new_tokens: int = 8192  # response length limit; what a response cut there trains as is `truncated`
    # A response cut at max_new_tokens: keep (its graded reward), zero (reward 0) or mask (dropped from the loss,
    # its reward still in its group's mean and std; DAPO's overlong filtering). The recipe masks: a cut
    # response's reward says little about its reasoning (a sound chain that ran out of room scores like a wrong
    # one), and DAPO found training on that noise less stable than filtering it out. rollout/truncated and
    # train/masked show how much of a batch it drops. Eval always reports the grader's reward. With distill.teacher
    # a cut response stays in the loss under mask for distillation's per-token term (the teacher scored each of its
    # tokens: no noise the cut made), at outcome advantage 0 (variants.keep_cut); a void one still leaves.
    truncated: str = "mask"
    # Multi-turn episodes (data.env; env.py): at most this many model turns, and this many tokens after the prompt,
    # model and env together (null: max_new_tokens; eval: eval_max_new_tokens). A trajectory cut by either ends
    # with finish "length" and follows `truncated`. Each env message is cut to max_env_chars characters first.
    max_turns: int = 8  # model turns per trajectory
    max_total_tokens: int | None = None  # tokens after the prompt, model and env (null: one turn's max_new_tokens)
    max_env_chars: int = 4096  # each env message's content is cut to this many characters before rendering
    # A call into the env (or the reward hook) that runs longer than env_timeout_s fails its trajectory; a call that
    # waits for a thread (64 run calls at once) starts as soon as one is free (a stuck one is replaced at once). A call
    # that times out, no call of its kind (MyEnv.step; __init__, reset and close are kinds of their own) having answered
    # while it ran, puts that kind down: until one of its calls answers, each call of it gets env_timeout_s / 10 from
    # its submission, and one still queued then never starts. So every call ends within env_timeout_s of its start, and
    # an env whose step hangs costs the run one env_timeout_s (two if it dies while earlier calls still answer), then a
    # tenth of it per engine iteration that ends turns, in that episode loop and every later one (eval sets, rounds,
    # batches: their __init__ and reset calls that answer change nothing): its calls all fail and the run stops with one
    # line (max_failure_fraction). The start-up check of every example's reset() keeps this deadline too. A call written
    # off keeps its thread until it returns: past 256 such threads (4 x 64) the env is down and the run stops with one
    # line. A close() that fails or times out changes no trajectory (it is counted in rollout/env_close_failures)
    env_timeout_s: float = 60.0
    # When an env's answer becomes the trajectory's next turn, in engine iterations after its turn ended (env.py's
    # episode loop; the engine decodes the other trajectories meanwhile). A number makes runs reproducible and
    # resume exact (the loop waits for an answer that is late: set it above the tool's time / one decode step's);
    # null admits each answer as soon as it arrives (fastest with slow or uneven tools, but timing then decides
    # which rows decode together: same-seed runs differ)
    env_admit_after: int | None = 0
    # A failed trajectory is dropped (its group trains at its reduced size while more than half remains); more than
    # this fraction of a batch failing stops the run with one line
    max_failure_fraction: float = 0.5
    dump_fraction: float = 0.05  # this fraction of each batch's trajectories, as text, to run_dir/rollouts/*.jsonl
    max_prompt_tokens: int = 1024  # prompts longer than this are skipped (all of them: an error at start-up)
    chat_template: bool = True  # render prompts with the tokenizer's chat template
    max_staleness: int = 1  # batch i is sampled by weights max(0, i - max_staleness) (1: one step off-policy; 0: sync)
    dynamic_sampling: bool = False  # replace groups whose rewards all agree (zero advantage) with fresh prompts
    # Dynamic sampling's over-sampling: each round draws this fraction more prompts than it still needs and
    # generates them all at once (rows that free up take the extra ones); it stops taking groups, in prompt
    # order, once enough informative ones are done, and cancels the rest. 0: sequential rounds only.
    oversample: float = 0.5
    # false: new weights reach the generator between batches, so batch i is sampled wholly by version
    # max(0, i - max_staleness), which makes runs reproducible and resume exact. true: they land at the next decode
    # step of the batch in flight (fresher tokens; which token saw which version then depends on timing).
    partial_rollout: bool = False
    # With partial_rollout, what the rows in flight do when weights land: keep_kv (continue over the KV the
    # old weights computed, as PRIME-RL and SkyRL) or reprefill (compute it again under the new ones, as AReaL)
    update_mode: str = "keep_kv"
    max_batch: int = 64  # rows the torch engine decodes at once (continuous batching: a finished row is refilled)
    # Token slots of the torch engine's paged KV pool (rows take blocks as they grow; when it is full the
    # newest rows wait, prefilled again later). null: max_batch rows of the call's longest context (its longest prompt
    # plus the response budget; the memory plan counts max_prompt_tokens + the longest response)
    kv_cache_tokens: int | None = None
    # The torch engine on a GPU replays each decode step as a CUDA graph (graphs.DecodeGraphs: buckets of
    # rows and keys, captured on first use, checked against eager; an eager fallback). A CPU decodes eagerly.
    cuda_graphs: bool = True
    # Speculative decoding in the torch engine (machinery/speculative.py): a drafter (the model's MTP layer) proposes
    # this many tokens per row and one forward verifies them all. Draft and verification share the sampling noise, so
    # tokens and logprobs are the plain engine's: only the speed changes. 0: off (needs a model with a drafter). It pays
    # only where a draft costs less than the forwards it saves, so the engine measures both modes' decode tokens per
    # second and speculates in the calls (a batch's generation, an eval set: each wholly one mode) where that is faster,
    # running the other mode every PROBE_EVERY-th call (8) to keep its figure fresh
    speculative_tokens: int = 0
    engine: str = "torch"  # torch: our engine (runs DSA) | sglang: SGLang's (optional extra, dense checkpoints, GPU)
    # fp8: the generator holds the decoder's linear weights in block-wise e4m3 (fp8.py: 128x128 blocks, fp32 scales;
    # embeddings, norms, lm_head and the whole DSA indexer stay bf16/fp32), quantized by the learner after each
    # tensor's gather at publish, so half the bytes travel. A larger train/inference mismatch, which IcePop (the
    # default grpo.icepop_beta) absorbs: README, 'The objective'. null: bf16 weights
    quantization: str | None = None
    sglang_mem_fraction: float = 0.8  # engine: sglang only: share of the generator GPU for weights + KV cache


@dataclass
class OptimConfig:
    lr: float = 1e-6  # RL learning rate (AdamW; constant after the warm-up)
    betas: list = field(default_factory=lambda: [0.9, 0.98])  # AdamW betas, every stage
    weight_decay: float = 0.1  # AdamW weight decay in RL and the indexer warm-up
    grad_clip: float = 1.0  # global gradient-norm clip, every stage
    max_skipped_steps: int = 5  # a step with a non-finite loss or gradient is skipped; this many in a row stop the run
    # Learner token budget: one micro-batch is one packed row of at most this many tokens. At 9B, 16K is one
    # or two maximal responses (1K prompt + 8K) or many short ones: fewer passes, each of which gathers every
    # layer under FSDP. --dry-run of glm9b_math: 55.9 of 74.5 GiB per learner GPU (64.9 with a bf16 KL
    # reference and DSA); a larger budget would leave the KL reference no room.
    max_tokens_per_micro_batch: int = 16384
    warmup_steps: int = 0  # linear lr warm-up over this many steps at the start of every stage
    sft_lr: float = 1e-5  # supervised warm-up learning rate
    sft_weight_decay: float = 0.1  # supervised warm-up weight decay
    dsa_warmup_lr: float = 1e-3  # indexer warm-up learning rate


@dataclass
class TrainConfig:
    dsa_warmup_steps: int = 0  # stage 1: only the DSA indexer trains, imitating dense attention (0: skip)
    sft_steps: int = 0  # stage 2: supervised warm-up on reference responses (data.response_key; 0: skip)
    rl_steps: int = 100  # stage 3: GRPO steps, one rollout batch and one optimizer step each
    warmup_batch_size: int = 32  # examples per step of stages 1 and 2
    eval_every: int = 20  # held-out eval every this many RL steps (and at RL step 0 and the last); 0: only those
    eval_n: int = 16  # samples per held-out prompt: accuracy is their mean, pass@k for k <= eval_n
    eval_max_new_tokens: int = 16384  # response length limit at eval
    eval_temperature: float | None = None  # null: the rollout temperature; 0: greedy (one sample per prompt)
    eval_greedy: bool = False  # also report greedy accuracy (eval/<set>/greedy_accuracy) beside the sampled one
    save_every: int = 50  # checkpoint every this many steps of each stage (and at each stage's end)
    keep_checkpoints: int = 2  # older checkpoints are deleted
    # Also log every metric live to this Weights & Biases project (pip install -e ".[wandb]"; WANDB_MODE=offline
    # works without a network, `wandb sync` uploads later); the run is named after run_dir. null: no dashboard
    wandb_project: str | None = None
    pairs: int = 1  # generator/learner GPU pairs = processes that `python train.py` starts on this machine
    parallel: str = "fsdp"  # how the learners share the work: fsdp (sharded weights, grads, AdamW) or ddp (replicas)
    learner_device: str | None = None  # null: cuda:r+G for process r of G (cuda:0 with one GPU), cpu without GPUs
    generator_device: str | None = None  # null: cuda:r, cpu without GPUs; set both only with pairs: 1
    # Co-located (colocate.py): each process's one GPU generates, then trains, in turn (pairs = GPUs); synchronous
    # (rollout.max_staleness: 0). The split layout (false) gives each process a generator GPU and a learner GPU
    colocate: bool = False
    # colocate only: move the learner's fp32 masters and AdamW state to pinned host memory while the engine
    # generates. null: when the memory plan says they do not fit beside the generator (always on a CPU)
    offload: bool | None = None


@dataclass
class DistillConfig:
    # On-policy distillation (grpo.distill_advantages, machinery/teacher.py): a teacher scores every token the policy
    # samples, by a prefill on the generator's device, and each token's advantage becomes coef * (log pi_teacher -
    # log pi_prox): a dense reward that learns from every token, a cut response's too (rollout.truncated: mask drops
    # only its outcome advantage). The teacher: a local directory or Hub id like model.path, sharing the student's
    # tokenizer (checked at start-up). null: no distillation
    teacher: str | None = None
    coef: float = 1.0  # the weight of the per-token distillation advantage
    # also add GRPO's outcome advantage (the reward's, per response) to every token's; false: distillation alone (the
    # reward is still logged, and dynamic sampling has nothing to filter: every group teaches)
    outcome: bool = False
    quantization: str | None = None  # the teacher's weights: null (bf16 on a GPU, fp32 on a CPU) or fp8 (block-wise e4m3)


@dataclass
class Config:
    run_dir: str | None = None  # checkpoints/, metrics.jsonl, config.yaml go here; null: runs/<recipe file's name>
    seed: int = 0  # model init, data order, sampling
    model: ModelConfig = field(default_factory=ModelConfig)  # the policy: a checkpoint or a fresh model, DSA
    data: DataConfig = field(default_factory=DataConfig)  # prompts, references, the reward
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # generation: sampling, group size, asynchrony
    grpo: GRPOConfig = field(default_factory=GRPOConfig)  # the objective (grpo.py)
    optim: OptimConfig = field(default_factory=OptimConfig)  # AdamW per stage, the learner's token budget
    train: TrainConfig = field(default_factory=TrainConfig)  # stages, eval, checkpoints, processes and devices
    distill: DistillConfig = field(default_factory=DistillConfig)  # on-policy distillation from a teacher


# Keys that existed once, and why they are gone: an old config gets this instead of "unknown key".
REMOVED = {
    "grpo.old_logp": "pi_old is now the learner's own forward (pi_prox), free with one optimizer step per "
                     "batch, and the clip is held against the sampler (README, 'The objective')",
    "rollout.top_p": "RL samples from the full tempered distribution, the one the learner's logprobs are of; "
                     "a truncated sampler would be a silent mismatch",
}

# What `--resume` may change: when and how often things happen, how much memory they take, and where
# they run. Everything else would make the resumed run a different run than the one it continues.
# train.wandb_project only says where metrics are shown too: a run that had none gets a dashboard from the
# resumed step on, and another project starts a new wandb run there (checkpoint.MetricsLog).
SAFE_ON_RESUME = {
    "run_dir", "train.rl_steps", "train.eval_every", "train.eval_n", "train.eval_max_new_tokens", "train.wandb_project",
    "train.eval_temperature", "train.eval_greedy", "train.save_every", "train.keep_checkpoints",
    "train.learner_device", "train.generator_device", "train.colocate", "train.offload", "data.eval", "data.eval_size", "rollout.max_batch",
    "rollout.kv_cache_tokens", "rollout.cuda_graphs", "rollout.dump_fraction", "rollout.speculative_tokens",
    "rollout.sglang_mem_fraction", "optim.max_tokens_per_micro_batch", "optim.max_skipped_steps",
    "model.gradient_checkpointing", "model.dsa_kernels",
}


def config_keys(cls=Config, prefix=""):
    """Every dotted key, e.g. ["run_dir", ..., "rollout.temperature", ...]."""
    keys = []
    for f in fields(cls):
        sub = typing.get_type_hints(cls)[f.name]
        keys += config_keys(sub, f"{prefix}{f.name}.") if is_dataclass(sub) else [prefix + f.name]
    return keys


def get(cfg, key):
    """get(cfg, "optim.lr") -> cfg.optim.lr"""
    for name in key.split("."):
        cfg = getattr(cfg, name)
    return cfg


# ----------------------------------------------------------------------------- loading


def _unknown(where, key, valid):
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    return ConfigError(f"{where}: unknown key {key}" + (f" (did you mean {close[0]}?)" if close else ""))


def _typed(value, tp, key, where):
    """Check value against a field type (int, float, bool, str, list, dict, or X | None)."""
    allowed = typing.get_args(tp) or (tp,)
    if value is None and type(None) in allowed:
        return None
    for t in allowed:
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if t is float and isinstance(value, str):  # YAML 1.1 reads "1e-6" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if t is int and isinstance(value, bool):
            continue  # True is an int to python, never to us
        if t in (int, bool, str, list, dict) and isinstance(value, t):
            return value
    names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
    raise ConfigError(f"{where}: {key} must be {names}, got {value!r} ({type(value).__name__})")


def _from_dict(cls, d, where, prefix=""):
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: {prefix.rstrip('.') or 'the file'} must be a mapping of keys, got {d!r}")
    hints, kwargs = typing.get_type_hints(cls), {}
    for key, value in d.items():
        if key not in hints:
            if prefix + key in REMOVED:
                raise ConfigError(f"{where}: {prefix + key} was removed: {REMOVED[prefix + key]}")
            raise _unknown(where, prefix + key, config_keys())
        sub = hints[key]
        kwargs[key] = (_from_dict(sub, value or {}, where, f"{prefix}{key}.") if is_dataclass(sub)
                       else _typed(value, sub, prefix + key, where))
    return cls(**kwargs)


def _read_yaml(path):
    try:
        with open(path) as f:
            return yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror.lower()}") from None


def _apply(raw, overrides):
    """`key.sub=value` items (values parsed as YAML) into the raw mapping, in place."""
    for item in overrides:
        key, eq, text = item.partition("=")
        if not eq:
            raise ConfigError(f"command line: expected key=value, got {item!r}")
        *parents, last = key.split(".")
        d = raw
        for name in parents:  # into sections, and into mappings such as model.init
            if not isinstance(d.get(name) or {}, dict):
                raise ConfigError(f"command line: {key}: {name} is not a mapping")
            d[name] = d.get(name) or {}
            d = d[name]
        try:
            d[last] = yaml.safe_load(text)
        except yaml.YAMLError:
            raise ConfigError(f"command line: {key}: cannot read {text!r} as a value") from None


def load_config(path, overrides=()) -> Config:
    """YAML file, then `key.sub=value` overrides, then every value checked. The file is read alone
    first, so that an error names the file or the command line correctly."""
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such config file")
    raw = _read_yaml(path)
    cfg = _from_dict(Config, raw, path)
    if overrides:
        _apply(raw, overrides)
        cfg = _from_dict(Config, raw, "command line")
    if cfg.run_dir is None:
        cfg.run_dir = os.path.join("runs", os.path.splitext(os.path.basename(path))[0])
    check_config(cfg, f"{path} + command line" if overrides else path)
    return cfg


def load_run_config(cfg: Config, overrides=()) -> Config:
    """The config of the run in cfg.run_dir (its config.yaml), with the command line's overrides applied
    if each is safe to change mid-run (SAFE_ON_RESUME); anything else is refused with both values."""
    path = os.path.join(cfg.run_dir, "config.yaml")
    raw = _read_yaml(path)
    saved = _from_dict(Config, raw, path)
    _apply(raw, overrides)
    new = _from_dict(Config, raw, "command line")
    new.run_dir = cfg.run_dir
    for key in config_keys():
        old, now = get(saved, key), get(new, key)
        if old != now and key not in SAFE_ON_RESUME:
            raise ConfigError(f"--resume: {key} is {old!r} in {path} but {now!r} on the command line; a resumed run "
                              f"may change only {', '.join(sorted(SAFE_ON_RESUME - {'run_dir'}))}")
    check_config(new, f"{path} + command line" if overrides else path)
    return new


def save_config(cfg: Config, run_dir):
    tmp = os.path.join(run_dir, ".config.yaml.tmp")
    with open(tmp, "w") as f:
        yaml.safe_dump(asdict(cfg), f, sort_keys=False)
    os.replace(tmp, os.path.join(run_dir, "config.yaml"))


# ----------------------------------------------------------------------------- checks
# Every value is checked against its domain here, at start-up: a negative learning rate or clip would
# train the model backwards, and a NaN one would only fail in AdamW hours later, after the warm-ups.


def _positive(x):
    return math.isfinite(x) and x > 0


def _non_negative(x):
    return math.isfinite(x) and x >= 0


RULES = [  # (keys, test, what each must be)
    (("optim.lr", "optim.sft_lr", "optim.dsa_warmup_lr", "optim.grad_clip", "rollout.temperature",
      "grpo.kl_guard_threshold"), _positive, "a finite number > 0"),
    (("optim.weight_decay", "optim.sft_weight_decay", "grpo.eps_high", "grpo.kl_coef", "grpo.entropy_coef"),
     _non_negative, "a finite number >= 0"),
    (("grpo.eps_low",), lambda x: 0 <= x < 1, "in [0, 1)"),
    (("grpo.kl_guard_factor",), lambda x: 0 < x <= 1, "in (0, 1]"),
    (("rollout.sglang_mem_fraction",), lambda x: 0 < x < 1, "in (0, 1)"),
    (("grpo.tis_cap",), lambda x: x is None or _positive(x), "> 0 (or null)"),
    (("grpo.icepop_beta",), lambda x: x is None or (math.isfinite(x) and x > 1), "> 1 (or null): the band is [1/beta, beta]"),
    (("grpo.dual_clip",), lambda x: x is None or (math.isfinite(x) and x > 1), "> 1 (or null)"),
    (("train.eval_temperature",), lambda x: x is None or _non_negative(x), ">= 0 (0: greedy) or null"),
    (("rollout.prompts_per_step", "rollout.n", "rollout.max_new_tokens", "rollout.max_prompt_tokens", "rollout.max_batch",
      "optim.max_skipped_steps", "optim.max_tokens_per_micro_batch", "train.warmup_batch_size", "train.eval_n",
      "train.eval_max_new_tokens", "train.save_every", "train.keep_checkpoints", "train.pairs", "grpo.kl_guard_window"),
     lambda x: x >= 1, ">= 1"),
    (("rollout.max_staleness", "optim.warmup_steps", "train.dsa_warmup_steps", "train.sft_steps", "train.rl_steps",
      "train.eval_every"), lambda x: x >= 0, ">= 0"),
    (("rollout.oversample",), lambda x: math.isfinite(x) and x >= 0, ">= 0"),
    (("data.train_size", "data.eval_size"), lambda x: x is None or x >= 1, ">= 1 (or null: all)"),
    (("rollout.kv_cache_tokens",), lambda x: x is None or x >= 1, ">= 1 (or null: every row at full length)"),
    (("rollout.update_mode",), lambda x: x in ("keep_kv", "reprefill"), "keep_kv or reprefill"),
    (("rollout.truncated",), lambda x: x in TRUNCATED, " or ".join(TRUNCATED)),
    (("grpo.surrogate",), lambda x: x in grpo.SURROGATES, " or ".join(grpo.SURROGATES)),
    (("rollout.max_turns", "rollout.max_env_chars"), lambda x: x >= 1, ">= 1"),
    (("rollout.max_total_tokens",), lambda x: x is None or x >= 1, ">= 1 (or null: max_new_tokens)"),
    (("rollout.env_timeout_s",), _positive, "a finite number > 0"),
    (("rollout.env_admit_after",), lambda x: x is None or x >= 0, ">= 0 (or null: as soon as it arrives)"),
    (("rollout.max_failure_fraction", "rollout.dump_fraction"), lambda x: 0 <= x <= 1, "in [0, 1]"),
    (("optim.betas",), lambda b: len(b) == 2 and all(isinstance(x, (int, float)) and 0 <= x < 1 for x in b),
     "[beta1, beta2], each in [0, 1)"),
    (("rollout.engine",), lambda x: x in ("torch", "sglang"), "torch or sglang"),
    (("rollout.quantization", "distill.quantization"), lambda x: x in (None, "fp8"), "fp8 or null"),
    (("distill.coef",), _positive, "a finite number > 0"),
    (("model.routing_replay",), lambda x: x in ("rollout", "none"), "rollout or none"),
    (("rollout.speculative_tokens",), lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0,
     "an integer >= 0"),
    (("model.mtp_layers",), lambda x: x is None or (isinstance(x, int) and x >= 0), "an integer >= 0 (or null)"),
    (("model.mtp_loss_scale",), lambda x: isinstance(x, (int, float)) and 0 <= x < float("inf"), "a finite number >= 0"),
    (("train.parallel",), lambda x: x in ("fsdp", "ddp"), "fsdp or ddp"),
    (("grpo.agg",), lambda x: x in grpo.AGG_MODES, f"one of {grpo.AGG_MODES}"),
    (("grpo.kl_estimator",), lambda x: x in grpo.KL_ESTIMATORS, f"one of {grpo.KL_ESTIMATORS}"),
]


def check_config(cfg: Config, where):
    for keys, ok, what in RULES:
        for key in keys:
            if not ok(get(cfg, key)):
                raise ConfigError(f"{where}: {key} must be {what}, got {get(cfg, key)!r}")

    def need(ok, msg):
        if not ok:
            raise ConfigError(f"{where}: {msg}")
    need(cfg.rollout.n >= 2, f"rollout.n must be >= 2, got {cfg.rollout.n}: a group of one has no baseline (every "
                             "advantage is 0)")
    need((cfg.model.path is None) != (cfg.model.init is None), "set exactly one of model.path and model.init")
    reserved = {"vocab_size", "eos_token_id", "pad_token_id", "dsa"} & set(cfg.model.init or {})
    need(not reserved, f"model.init must not set {sorted(reserved)} (they come from the tokenizer and model.dsa)")
    valid = [f"model.init.{f.name}" for f in fields(GLMConfig)]
    for k in cfg.model.init or {}:
        if f"model.init.{k}" not in valid:
            raise _unknown(where, f"model.init.{k}", valid)
    try:  # the model's own checks (head counts, DSA pattern, ...)
        GLMConfig(**(cfg.model.init or {}), dsa=cfg.model.dsa)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: model: {e}") from None
    source_keys, sets = set(data.SOURCE_KEYS), cfg.data.eval
    need(not (isinstance(sets, dict) and "path" in sets and source_keys & set(sets) - {"path"}),  # not set names
         f"data.eval: a set with its own keys is written {{<name>: {{path: file, prompt_key: ..., label_key: ...}}}}, "
         f"got {sets!r}")
    for name, spec in eval_sets(cfg).items():
        need(isinstance(spec, (str, dict)) and isinstance(name, str) and name and "/" not in name,
             f"data.eval must be a file or a mapping of set names to files (or to {{path: file, prompt_key: ..., "
             f"label_key: ...}}), got {cfg.data.eval!r}")
        if isinstance(spec, dict):  # a set with its own keys
            for key, value in spec.items():
                if key not in source_keys:
                    raise _unknown(where, f"data.eval.{name}.{key}", [f"data.eval.{name}.{k}" for k in source_keys])
                need(isinstance(value, str) and value,
                     f"data.eval.{name}.{key} must be a non-empty string, got {value!r}")
            need("path" in spec, f"data.eval.{name} needs a path (the set's file)")
    need(not cfg.data.answer_line or (cfg.data.reward == "data:math_reward" and cfg.data.env is None),
         "data.answer_line is read by the built-in grader only (data.reward: data:math_reward, no data.env), but "
         + (f"data.env is {cfg.data.env!r}: the env grades" if cfg.data.env else f"data.reward is {cfg.data.reward!r}")
         + ", so it would be ignored")
    need(not cfg.data.env_args or cfg.data.env, "data.env_args are for data.env's setup(), but data.env is not set")
    if cfg.model.lora is not None:
        try:
            lora.LoRAConfig(**cfg.model.lora)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}: model.lora: {str(e).removeprefix('model.lora: ')}") from None
        need(cfg.rollout.quantization is None, "model.lora with rollout.quantization: fp8 is not supported (the "
             "adapters would decode on a base rounded to e4m3 that the learner never saw); set one of them")
        need(cfg.rollout.engine == "torch", "model.lora needs rollout.engine: torch (the SGLang adapter does not "
             "take adapters)")
        processes = max(cfg.train.pairs, int(os.environ.get("WORLD_SIZE", 1)))  # (torchrun sets WORLD_SIZE)
        need(processes == 1 or cfg.train.parallel == "ddp", "model.lora replicates the frozen base on every "
             "learner and all-reduces the adapters' gradients: set train.parallel: ddp")
    if cfg.train.colocate:
        need(cfg.rollout.max_staleness == 0 and not cfg.rollout.partial_rollout, "train.colocate is synchronous: one "
             "GPU generates, then trains; set rollout.max_staleness: 0 and rollout.partial_rollout: false")
        need(cfg.rollout.engine == "torch", "train.colocate needs rollout.engine: torch (SGLang's memory release "
             "and resume are not wired to the handoff)")
        need(cfg.train.generator_device == cfg.train.learner_device, "train.colocate runs both halves on one device: "
             "set train.generator_device and train.learner_device alike (or both null)")
    else:
        need(cfg.train.offload is None, "train.offload is for train.colocate: true (the split layout moves nothing)")
    if cfg.distill.teacher is not None:
        need(cfg.rollout.engine == "torch", "distill.teacher needs rollout.engine: torch (the teacher runs on the "
             "generator's device, beside our engine; SGLang's static pool leaves it no planned room)")
    need(cfg.rollout.speculative_tokens == 0 or cfg.rollout.engine == "torch", "rollout.speculative_tokens needs "
         "rollout.engine: torch (its drafts share our sampler's noise; SGLang's speculative decoding is its own)")
    need(cfg.rollout.prompts_per_step % cfg.train.pairs == 0,
         f"rollout.prompts_per_step ({cfg.rollout.prompts_per_step}) must divide evenly over train.pairs ({cfg.train.pairs})")
    need(cfg.grpo.surrogate != "dis" or (cfg.grpo.icepop_beta is None and cfg.grpo.tis_cap is None),
         "grpo.surrogate: dis is its own off-policy correction: set grpo.icepop_beta: null and grpo.tis_cap: null "
         f"(they are {cfg.grpo.icepop_beta} and {cfg.grpo.tis_cap})")
    if cfg.model.init is not None:
        longest = cfg.rollout.max_prompt_tokens + response_budget(cfg)
        limit = cfg.model.init.get("max_position_embeddings", GLMConfig.max_position_embeddings)
        need(longest <= limit, f"rollout.max_prompt_tokens + the longest response ({longest} tokens) must fit "
                               f"model.init.max_position_embeddings ({limit})")


def check_paths(cfg: Config):
    """The files a run reads exist (after hub.fetch, before processes start and before any weights load)."""
    for key, needed in (("model.path", "config.json"), ("model.tokenizer", "tokenizer_config.json"),
                        ("distill.teacher", "config.json")):
        where = hub.model_dir(get(cfg, key), key)  # a Hub id: its snapshot in the local cache
        if where is not None and not os.path.isfile(os.path.join(where, needed)):
            what = f"has no {needed}" if os.path.isdir(where) else "is neither a directory nor a Hub id (owner/name)"
            raise ConfigError(f"{key}: {get(cfg, key)} {what}")
    for key, path in sources(cfg).items():
        if path not in data.SYNTHETIC and not hub.data_id(path) and not os.path.isfile(path):
            raise ConfigError(f"{key}: {path}: no such file (expected a JSONL or Parquet file, a Hub dataset's file or "
                              f"split (owner/name/file.jsonl, owner/name:train), or one of {data.SYNTHETIC})")


def response_budget(cfg: Config, eval=None) -> int:
    """The most tokens a trajectory holds after its prompt: rollout.max_total_tokens, or else one turn of
    max_new_tokens (eval: eval_max_new_tokens); eval=None: the larger of RL's and eval's."""
    r = cfg.rollout
    if eval is None:
        return max(response_budget(cfg, False), response_budget(cfg, True))
    return r.max_total_tokens or (cfg.train.eval_max_new_tokens if eval else r.max_new_tokens)


def prefill_budget(cfg: Config) -> int:
    """The most tokens one prefill forward of the torch engine packs: the memory plan counts a prefill of the longest
    sequence (rollout.max_prompt_tokens + the longest response) or of PREFILL_TOKENS, the larger, so the engine packs
    that many (17,408 for the GPU recipes: a wave of 256-token prompts in forwards of 68 prompts, not 16)."""
    return max(PREFILL_TOKENS, cfg.rollout.max_prompt_tokens + response_budget(cfg))


def sources(cfg: Config) -> dict:
    """{config key: data spec} of the files a run reads: data.train and each eval set (data.eval.<set>)."""
    return {"data.train": cfg.data.train} | {f"data.eval.{n}": data.spec_path(s) for n, s in eval_sets(cfg).items()}


def hub_specs(cfg: Config) -> dict:
    """{config key: spec} of everything hub.fetch may download: model.path, model.tokenizer, distill.teacher and the
    data."""
    return ({"model.path": cfg.model.path, "model.tokenizer": cfg.model.tokenizer, "distill.teacher": cfg.distill.teacher}
            | sources(cfg))


def eval_sets(cfg: Config) -> dict:
    """{set name: spec}: data.eval as a mapping, or one file named by its stem. A spec is a file (or "synthetic"),
    or a mapping {path: file, prompt_key: ..., label_key: ...} of a set with its own keys (data.spec_path: its
    file; data.load_examples reads either)."""
    if isinstance(cfg.data.eval, dict):
        return dict(cfg.data.eval)
    hub_id = hub.data_id(cfg.data.eval)  # a Hub dataset: its file's stem, or name-split (never the revision)
    name = (os.path.basename(hub_id[2]) if hub_id[2] else f"{hub_id[0].split('/')[1]}-{hub_id[3]}") if hub_id else cfg.data.eval
    return {os.path.splitext(os.path.basename(name))[0]: cfg.data.eval}


# ----------------------------------------------------------------------------- the memory plan

# The architecture of the recipe's checkpoint (its published config.json), so that --dry-run can plan
# memory before the 18 GB download. A downloaded model.path (or a cached Hub snapshot) always wins over this table.
PUBLISHED = {"GLM-Z1-9B-0414": {"vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 13696,
                                "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 2,
                                "head_dim": 128, "partial_rotary_factor": 0.5, "rope_theta": 10000.0,
                                "rms_norm_eps": 1e-5, "attention_bias": True, "tie_word_embeddings": False,
                                "max_position_embeddings": 32768, "pad_token_id": 151329,
                                "eos_token_id": [151329, 151336, 151338]},
             # GLM-Z1-32B-0414, configs/glm9b_distill.yaml's teacher: GLM-Z1-9B-0414's family and tokenizer (the same
             # tokenizer.json, sha256 76ebeac0...), 61 layers, no attention bias (32.57B parameters)
             "GLM-Z1-32B-0414": {"vocab_size": 151552, "hidden_size": 6144, "intermediate_size": 23040,
                                 "num_hidden_layers": 61, "num_attention_heads": 48, "num_key_value_heads": 2,
                                 "head_dim": 128, "partial_rotary_factor": 0.5, "rope_theta": 10000.0,
                                 "rms_norm_eps": 1e-5, "attention_bias": False, "tie_word_embeddings": False,
                                 "max_position_embeddings": 32768, "pad_token_id": 151329,
                                 "eos_token_id": [151329, 151336, 151338]},
             # GLM-4.7-Flash (transformers' glm4_moe_lite): MLA, 64 routed experts + 1 shared, 4 active, the first
             # layer dense; its files also hold one multi-token-prediction layer (model.layers.47.*, families/mtp.py)
             "GLM-4.7-Flash": {"architectures": ["Glm4MoeLiteForCausalLM"], "model_type": "glm4_moe_lite",
                               "vocab_size": 154880, "hidden_size": 2048, "intermediate_size": 10240,
                               "moe_intermediate_size": 1536, "num_hidden_layers": 47, "num_attention_heads": 20,
                               "num_key_value_heads": 20, "q_lora_rank": 768, "kv_lora_rank": 512,
                               "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
                               "n_routed_experts": 64, "n_shared_experts": 1, "num_experts_per_tok": 4,
                               "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.8,
                               "first_k_dense_replace": 1, "rope_theta": 1000000, "partial_rotary_factor": 1.0,
                               "rms_norm_eps": 1e-5, "attention_bias": False, "tie_word_embeddings": False,
                               "max_position_embeddings": 202752, "pad_token_id": 154820, "bos_token_id": 0,
                               "num_nextn_predict_layers": 1,
                               "eos_token_id": [154820, 154827, 154829]}}


def architecture(cfg: Config, key="model.path") -> GLMConfig:
    """The policy's GLMConfig without loading any weights (key "distill.teacher": the distillation teacher's, as its
    config.json says: model.dsa is the policy's)."""
    if key == "model.path" and cfg.model.init is not None:
        tok = (AutoTokenizer.from_pretrained(hub.model_dir(cfg.model.tokenizer, "model.tokenizer")) if cfg.model.tokenizer
               else data.synthetic_tokenizer(cfg.data.train))
        mtp = {} if cfg.model.mtp_layers is None else {"mtp_layers": cfg.model.mtp_layers}
        return GLMConfig(**{**cfg.model.init, **mtp}, vocab_size=len(tok), dsa=cfg.model.dsa)
    spec = get(cfg, key)
    hub_id = hub.model_id(spec)
    path = hub.model_config(spec, key, fetch=False) if hub_id else os.path.join(spec, "config.json")
    name = os.path.basename(os.path.normpath(hub_id[0] if hub_id else spec))
    if not (path and os.path.isfile(path)) and name not in PUBLISHED and hub_id:
        path = hub.model_config(spec, key)  # --dry-run of a Hub model we know nothing of: its config.json alone
    if path and os.path.isfile(path):
        try:
            with open(path) as f:
                hf = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{key}: {path} cannot be read ({e})") from None
    elif name in PUBLISHED:
        hf = PUBLISHED[name]
    else:
        raise ConfigError(f"{key}: {spec} is neither a directory with a config.json nor a Hub id (owner/name)")
    arch = GLMConfig.from_hf(hf)
    if key == "model.path" and cfg.model.dsa is not None:
        arch.dsa = GLMConfig(**{**asdict(arch), "dsa": cfg.model.dsa}).dsa
    if key == "model.path" and cfg.model.mtp_layers is not None:  # the MTP layers the load keeps or adds
        arch = replace(arch, mtp_layers=cfg.model.mtp_layers)
    return arch


def check_memory(cfg: Config, processes, gpu_bytes=None, title=None, shared=None):
    """The memory plan against GPUs of gpu_bytes (None: H100s). title (--dry-run): print the plan first. shared:
    the generator and the learner share one GPU (None: when train.generator_device and learner_device name the
    same one), so their sum must fit; co-located, each phase must (colocate.py). One ConfigError line naming what
    does not fit and the fixes."""
    t, gpu = cfg.train, gpu_bytes or H100_BYTES
    shared = not t.colocate and (shared if shared is not None else t.generator_device is not None
                                 and t.generator_device == t.learner_device)
    plan = plan_memory(cfg, processes, shared, offload=colocate_offload(cfg, processes, gpu))
    if title is not None:
        layout = (f"{processes} co-located GPU(s)" if t.colocate else "the generator and the learner on one GPU" if shared
                  else f"{processes} generator/learner GPU pairs")
        print(f"{title}: {layout}, learners in {cfg.train.parallel}, on H100s\n{plan.text(gpu)}", flush=True)
        if t.colocate:  # the same recipe on a machine of 8: all 8 generate, then all 8 train
            print("the same recipe on 8 co-located H100s (all generate, then all train); peak per phase, GiB:")
            for what, c in (("with model.lora, ddp", replace(cfg, train=replace(t, parallel="ddp"))),
                            ("without LoRA, fsdp", replace(cfg, model=replace(cfg.model, lora=None),
                                                          train=replace(t, parallel="fsdp")))):
                p8 = plan_memory(c, 8, offload=colocate_offload(c, 8, gpu))
                print(f"  {what:<22}" + "  ".join(f"{ph.split(':')[0]} {b / GiB:.1f}" for ph, _, b in p8.phases())
                      + (f"  (learner state offloaded: {p8.settings['pinned_host'] / GiB:.1f} GiB pinned per GPU)"
                         if p8.settings["pinned_host"] else "  (learner state kept)"))
    if plan.problems(gpu):
        raise ConfigError(("does not fit on H100s: " if gpu_bytes is None else "this config does not fit: ")
                          + "; ".join(plan.problems(gpu)) + ("" if gpu_bytes is None else " (see --dry-run)"))


def colocate_offload(cfg: Config, processes, gpu_bytes=None) -> bool:
    """train.offload, or (null) whether the learner's state must leave the GPU while the engine generates: when
    the co-located plan with it kept does not fit in gpu_bytes (None: a CPU, where it always leaves, so the path
    a GPU takes runs under test)."""
    if cfg.train.offload is not None or not cfg.train.colocate:
        return bool(cfg.train.offload)
    if gpu_bytes is None:
        return True
    return max(b for _, _, b in plan_memory(cfg, processes, offload=False).phases()) > gpu_bytes


def plan_memory(cfg: Config, processes, shared=False, offload=True):
    """The per-GPU memory plan of this config with `processes` generator/learner pairs in all (shared: on one GPU;
    train.colocate: `processes` GPUs, each both in turn, offload: the learner's state leaving it while it generates)."""
    r, g, t = cfg.rollout, cfg.grpo, cfg.train
    arch = architecture(cfg)
    if arch.moe is not None and r.engine == "sglang":  # (the architecture is known here, not in check_config)
        raise ConfigError(f"rollout.engine: sglang with an MoE model ({arch.model_type}) is not supported: the SGLang "
                          "adapter returns no routes for routing replay and loads no MLA weights; use rollout.engine: torch")
    return memory_plan(arch, learner_gpus=processes, parallel=t.parallel,
                       # a sequence longer than the micro-batch budget is a micro-batch of its own (data.pack_by_tokens)
                       micro_batch_tokens=max(cfg.optim.max_tokens_per_micro_batch, r.max_prompt_tokens + response_budget(cfg, False)),
                       gradient_checkpointing=cfg.model.gradient_checkpointing,
                       trainable_indexer=t.dsa_warmup_steps > 0 or t.sft_steps > 0,
                       reference=g.kl_coef > 0 or g.kl_guard, generator_batch=r.max_batch,
                       kv_cache_tokens=r.kv_cache_tokens, cuda_graphs=r.cuda_graphs, group_size=max(r.n, t.eval_n),
                       prefill_tokens=prefill_budget(cfg),
                       generator_max_len=r.max_prompt_tokens + response_budget(cfg),
                       max_new_tokens=max(r.max_new_tokens, t.eval_max_new_tokens), engine=r.engine,
                       sglang_mem_fraction=r.sglang_mem_fraction, logit_chunk=LOGIT_CHUNK, logit_keep=LOGIT_KEEP_BYTES,
                       dsa_kernels=cfg.model.dsa_kernels, shared=shared, fp8=r.quantization == "fp8",
                       lora_cfg=None if cfg.model.lora is None else lora.LoRAConfig(**cfg.model.lora),
                       colocate=cfg.train.colocate, offload=offload,
                       teacher=architecture(cfg, "distill.teacher") if cfg.distill.teacher else None,
                       teacher_fp8=cfg.distill.quantization == "fp8", speculative_tokens=r.speculative_tokens)
