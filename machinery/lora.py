"""
LoRA: low-rank adapters on the decoder's linear layers, for RL on one GPU (model.lora). The base weights are
frozen (bf16 on a GPU: no fp32 masters, no gradients, no optimizer state for them) and only the adapters train:

    y = x W^T + (alpha / r) * (x A^T) B^T        W [out, in] frozen; A [r, in], B [out, r] trained, fp32

B starts at zero, so at the start of RL the model is exactly the base (the one the warm-up stages trained in
full). Why these defaults (LoRAConfig): Thinking Machines' "LoRA Without Regret" (2025) found that in RL LoRA
matches full fine-tuning even at small rank, provided it is on every layer (attention and MLP, not attention
alone) and its learning rate is about 10x full fine-tuning's; with the alpha / r scale and a fixed alpha, the
best learning rate barely moves with the rank. RL learns few bits per episode, so a low rank holds them.

The DSA indexer gets no adapters: it is trained by its own KL loss in the warm-up, never by the policy loss.

The MoE families (GLM-4.7-Flash, GLM-5): adapters on every nn.Linear a token always passes through: MLA's
projections (q_a_proj, q_b_proj or q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj), the first dense layers'
SwiGLU and each MoE layer's shared experts (gate_proj, up_proj, down_proj). Two things get none, and stay frozen:
  - The routed experts. Their weights are stacked [E, ...] tensors multiplied by grouped matmuls (kernels/moe.py),
    not linear layers; per-expert adapters would need their own grouped low-rank matmuls in the learner and the
    engine, E pairs of adapters per layer (64 for GLM-4.7-Flash), and each pair would learn from the ~k/E of the
    tokens routed to its expert (4/64) where the shared expert's adapters see every token. What this gives up:
    most of an MoE model's MLP parameters are its routed experts, and LoRA Without Regret found that adapters on
    attention alone fall short of full fine-tuning where adapters on the MLPs too do not; adapting the experts
    (per expert, inside experts_forward) is the extension to try if the always-on adapters fall short.
  - The router (mlp.gate.weight, an fp32 [E, hidden] matrix, with its score-correction bias buffer). LoRA on a
    64-row matrix saves nothing, and training it directly would break what LoRA's sharing rests on: the KL
    reference is this model with its adapters off (Base), and the generator holds the base and receives only
    adapters (share_base, full_weights), so every weight but the adapters must stay the base's. A frozen router
    also keeps the experts' choice as the warm-up stages left it (routing replay then replays the generator's
    choice of that same router).

The MTP layers (model.mtp_layers, families/mtp.py): their decoder block's linears get adapters as the decoder's
do; their glue (eh_proj, enorm, hnorm, shared_head.norm) stays frozen with the base, and so do the embedding and
head they share with the main model. In RL the MTP loss trains those adapters alone (mtp_loss detaches the trunk,
and parallel.optimizer_step clips the parameters named mtp.* apart), GRPO the decoder's. They travel with every
publish like the others (adapter_named), so the engine drafts with the trained MTP layer. In peft's layout they go
under the name the published checkpoints give the layer, model.layers.{L + j}.* (model.hf_name, as the MTP layer's
base weights are saved): transformers' models have no MTP layer, and peft loading the file onto one leaves them
aside, as transformers leaves the layer's base weights; load_model reads them back onto our MTP layers, and the
merged export merges them into the MTP layer it writes.

What sharing the base buys: the adapters are megabytes where the model is gigabytes, so a publish moves the
adapters alone, a checkpoint holds adapters and their optimizer state, and the KL reference is the same model
with its adapters switched off (`disabled`), at no memory. Adapters are saved in peft's layout
(adapter_config.json + adapter_model.safetensors), which peft loads onto transformers' Glm4ForCausalLM.

The file in reading order: the config, the layer (LoRALinear), putting adapters on a model (add), their
tensors (adapter_named, load_adapters), switching them off (disabled), merging (merged_weight, merged; a full
export: `python -m machinery.lora merge CHECKPOINT OUT`), peft's layout (save_adapters).
"""
import contextlib
import json
import math
import os
import shutil
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import FP32_PARAMS, hf_name

# Every linear layer of a decoder block, by module name: GLM-4's, then the MoE families' MLA projections and SwiGLU
# (dense layers and shared experts: gate_proj, up_proj, down_proj). The indexer's (dsa.Indexer), lm_head, the MoE
# router (mlp.gate) and the routed experts (stacked tensors, not linears) are never targets (the docstring says why).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj",
           "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "gate_proj", "up_proj")


@dataclass
class LoRAConfig:
    rank: int = 32  # RL learns with small ranks (LoRA Without Regret: even rank 1); 32 leaves room for SFT-like data
    alpha: float = 32.0  # the scale is alpha / rank: with alpha fixed, the best learning rate hardly moves with rank
    targets: tuple = TARGETS  # module names; every decoder linear by default (attention-only LoRA underperforms);
    # names a model does not have adapt nothing (GLM-4 has no q_a_proj, the MoE families no gate_up_proj)
    lr: float | None = None  # the adapters' learning rate; null: 10x optim.lr (LoRA Without Regret's ratio)

    def __post_init__(self):
        self.targets = tuple(self.targets)
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets:
            raise ValueError(f"model.lora.targets: {unknown or 'empty'}; choose among {list(TARGETS)}")
        if self.rank < 1 or not self.alpha > 0:
            raise ValueError(f"model.lora: rank must be >= 1 and alpha > 0, got rank {self.rank}, alpha {self.alpha}")

    @property
    def scale(self):
        return self.alpha / self.rank


class LoRALinear(nn.Linear):
    """nn.Linear plus adapters: `weight` (and `bias`) keep their names, so checkpoints, publishes and the
    engine see the base as before; `lora_A` [r, in] and `lora_B` [out, r] are new parameters beside them."""

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        if not self.lora_on:
            return y
        # x [..., in] -> [..., r] -> [..., out]. Under autocast F.linear runs both in bf16 from the fp32 adapters;
        # without it (the generator's bf16 model), the adapters are cast to x's dtype
        a, b = self.lora_A, self.lora_B
        if not torch.is_autocast_enabled(x.device.type):
            a, b = a.to(x.dtype), b.to(x.dtype)
        return y + F.linear(F.linear(x, a), b) * self.lora_scale

    def matrix(self):
        """The layer's effective weight [out, in] as one matrix, in the weight's dtype: W + scale * B A (adapters
        on), for a caller that uses the weight as a matrix rather than through forward (MLA's absorbed decode
        folds kv_b_proj's key half into the query)."""
        if not self.lora_on:
            return self.weight
        return (self.weight.float() + self.lora_scale * self.lora_B.float() @ self.lora_A.float()).to(self.weight.dtype)


def add(model, cfg: LoRAConfig, seed: int = 0):
    """Put adapters on every targeted linear of model's decoder blocks, in place: A drawn as nn.Linear draws
    its weight (Kaiming-uniform, from `seed`, the same on every rank), B zeros, both fp32; every other parameter
    frozen. Returns the model."""
    gen = torch.Generator().manual_seed(seed)
    model.requires_grad_(False)
    for name, m in list(model.named_modules()):
        # (the MoE router, mlp.gate, and the routed experts, mlp.experts, are no nn.Linear: never adapted)
        if name.rsplit(".", 1)[-1] not in cfg.targets or ".indexer" in name or not isinstance(m, nn.Linear):
            continue
        m.__class__ = LoRALinear  # the same module, weight and bias untouched: only the adapters are added
        device = m.weight.device
        a = torch.empty(cfg.rank, m.in_features)
        bound = 1 / math.sqrt(m.in_features)  # kaiming_uniform_(a=sqrt(5)), nn.Linear's (and peft's) draw
        a.uniform_(-bound, bound, generator=gen)
        m.lora_A = nn.Parameter(a.to(device))
        m.lora_B = nn.Parameter(torch.zeros(m.out_features, cfg.rank, device=device))
        m.lora_scale, m.lora_on = cfg.scale, True
    model.lora = cfg
    return model


def rl_trainable(model, cfg):
    """Set what RL trains (train.py, at the start of RL; cfg: the run's Config). Without model.lora: every
    parameter but the DSA indexer's (GLM-5 keeps the indexer frozen during RL). With it: adapters on the base
    the warm-up stages trained (once: a resumed model has them already, from its checkpoint), the base cast to
    bf16 on a GPU (no fp32 masters: it never steps)."""
    if cfg.model.lora is None:
        for name, p in model.named_parameters():
            p.requires_grad_(".indexer." not in name)
        return model
    if model.lm_head.weight.device.type == "cuda":  # the base in bf16 (the indexer's fp32 islands kept)
        for name, p in model.named_parameters():
            if not name.endswith((".lora_A", ".lora_B") + FP32_PARAMS):
                p.data = p.data.to(torch.bfloat16)
    if not hasattr(model, "lora"):
        add(model, LoRAConfig(**cfg.model.lora), seed=cfg.seed)
    return model


def share_base(engine, model) -> bool:
    """A generator on the learner's device decodes on the learner's frozen base itself, not on a copy
    (engine.share; its own copy is freed). True if it does: then even the first publish carries the adapters only."""
    if not hasattr(model, "lora") or getattr(engine, "device", None) != model.lm_head.weight.device:
        return False
    engine.share((n, p) for n, p in model.named_parameters() if not n.endswith((".lora_A", ".lora_B")))
    return True


def rl_lr(cfg):
    """RL's learning rate: optim.lr, or with model.lora its lr (null: 10x optim.lr, LoRA Without Regret's ratio)."""
    if cfg.model.lora is None:
        return cfg.optim.lr
    lr = LoRAConfig(**cfg.model.lora).lr
    return lr if lr is not None else 10 * cfg.optim.lr


def adapter_named(model):
    """(name, parameter) of every adapter, in module order: what trains, publishes and checkpoints."""
    return [(n, p) for n, p in model.named_parameters() if n.endswith((".lora_A", ".lora_B"))]


def load_adapters(model, tensors):
    """Copy adapters in by name (a checkpoint's, or a publish's); every adapter must be there."""
    params = dict(adapter_named(model))
    if set(tensors) != set(params):
        missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
        raise ValueError(f"adapters do not match the model's: missing {missing[:3]}, unexpected {extra[:3]}")
    with torch.no_grad():
        for n, t in tensors.items():
            params[n].copy_(t)


@contextlib.contextmanager
def disabled(model):
    """The base model: every adapter off (the KL reference, at no extra memory)."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in layers:
        m.lora_on = False
    try:
        yield model
    finally:
        for m in layers:
            m.lora_on = True


def merged_weight(m: LoRALinear, dtype=torch.float32):
    """W + scale * B A of one layer, computed in fp32, returned in dtype (a bf16 merge rounds small deltas
    away: an update below W's bf16 spacing vanishes)."""
    return (m.weight.float() + m.lora_scale * m.lora_B.float() @ m.lora_A.float()).to(dtype)


@torch.no_grad()
def merged(model, dtype=torch.float32):
    """A plain GLM, no adapters: each adapted linear W + scale B A (merged_weight, in fp32, then cast), the rest
    the model's own, every weight in dtype but model.FP32_PARAMS. Returns (the model, the rounding's error as a
    share of the adapters' delta, mean over the layers: 0 in fp32)."""
    from model import GLM
    state = {n: t for n, t in model.state_dict().items() if not n.endswith((".lora_A", ".lora_B"))}
    errors = []
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            exact = merged_weight(m)
            state[name + ".weight"] = exact.to(dtype)
            delta = (exact - m.weight.float()).norm()
            if delta > 0:  # (untrained adapters, B = 0: no delta to lose)
                errors.append(float((exact.to(dtype).float() - exact).norm() / delta))
    with torch.device("meta"):  # cast before the values arrive: model.FP32_PARAMS (and the routers' biases) are
        out = GLM(model.cfg).cast_(dtype)  # then copied in as they are, not rounded through dtype and back
    out.to_empty(device="cpu").load_state_dict(state)
    return out, sum(errors) / max(1, len(errors))


def export_merged(checkpoint, out_dir, dtype=torch.float32):
    """A LoRA run's checkpoint (adapters + its run's lora_base) as one full model directory, merged (`merged`),
    with the checkpoint's tokenizer files. Returns the rounding's error share (merged's)."""
    from model import GLM
    model, error = merged(load_model(checkpoint, GLM.from_pretrained), dtype)
    model.save_pretrained(out_dir)
    for folder in (base_dir(checkpoint), checkpoint):  # the tokenizer, generation_config.json: the checkpoint's last
        for name in os.listdir(folder):
            if name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
                shutil.copy(os.path.join(folder, name), out_dir)
    return error


PEFT_PREFIX = "base_model.model.model."  # peft's PeftModel > Glm4ForCausalLM > Glm4Model (the MoE families alike)


def peft_name(name: str) -> str:
    """Our adapter name (layers.0.self_attn.q_proj.lora_A) -> peft's key on Glm4ForCausalLM; an MTP layer's
    (mtp.{L}.self_attn.q_proj.lora_A) under the layer's published name, model.layers.{L}.* (model.hf_name)."""
    return "base_model.model." + hf_name(name) + ".weight"  # (PeftModel > Glm4ForCausalLM: PEFT_PREFIX's first two)


def our_adapter_name(key: str, num_layers: int) -> str:
    """peft's key -> our adapter name (peft_name's inverse): layers.{i} from num_layers on are the MTP layers."""
    name = key.removeprefix(PEFT_PREFIX).removesuffix(".weight")
    if name.startswith("layers.") and int(name.split(".")[1]) >= num_layers:
        return "mtp." + name.removeprefix("layers.")
    return name  # (a decoder layer's, or mtp.{i}.*: how files written before that naming spell an MTP layer's)


def write_adapters(model, folder, base_model: str | None = None):
    """The adapters in peft's layout, into folder: adapter_config.json and adapter_model.safetensors (fp32).
    peft loads them onto transformers' model of the base (Glm4ForCausalLM, Glm4MoeLiteForCausalLM, ...: the same
    module names as ours)."""
    from safetensors.torch import save_file
    cfg = model.lora
    # The modules that hold adapters (of cfg.targets, those this model has): what peft looks for, and what load_model
    # adds again. MoE families: spelled within the layer (mlp.shared_experts.gate_proj, mlp.gate_proj), since peft
    # under transformers 5 reads a bare gate_proj / up_proj / down_proj of these models as the routed experts (their
    # transformers 4 per-expert names) and moves it onto mlp.experts; peft releases up to 0.21 do so with the
    # qualified names too (huggingface/peft#3711), so those load our MLP adapters onto the wrong weights.
    adapted = [n for n, m in model.named_modules() if isinstance(m, LoRALinear)]  # layers.<i>.<path in the layer>
    targets = sorted({n.split(".", 2)[2] if model.cfg.moe is not None else n.rsplit(".", 1)[-1] for n in adapted})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": cfg.alpha,
              "target_modules": targets, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "use_dora": False, "init_lora_weights": True, "base_model_name_or_path": base_model}
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tensors = {peft_name(n): p.detach().float().cpu().contiguous() for n, p in adapter_named(model)}
    save_file(tensors, os.path.join(folder, ADAPTERS), metadata={"format": "pt"})


def save_adapters(model, path, base_model: str | None = None):
    """write_adapters into a temporary directory, renamed into place (never half-written)."""
    tmp = path.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    write_adapters(model, tmp, base_model)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- checkpoints of a LoRA run

ADAPTERS = "adapter_model.safetensors"
BASE = "lora_base"  # run_dir/lora_base: the frozen base of a LoRA run's RL stage, written once beside checkpoints/


def base_dir(path):
    """The weights directory behind a checkpoint: itself, or for a LoRA checkpoint (adapters only) its run's
    lora_base (run_dir/checkpoints/step_N -> run_dir/lora_base)."""
    if not os.path.isfile(os.path.join(path, ADAPTERS)):
        return path
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(path))), BASE)


def load_model(path, load):
    """load(path) for a model directory; for a LoRA checkpoint, load(its base) with the checkpoint's adapters
    added and read back (their config from adapter_config.json)."""
    if not os.path.isfile(os.path.join(path, ADAPTERS)):
        return load(path)
    from safetensors.torch import load_file
    with open(os.path.join(path, "adapter_config.json")) as f:
        c = json.load(f)
    model = load(base_dir(path))
    targets = tuple(dict.fromkeys(t.rsplit(".", 1)[-1] for t in c["target_modules"]))  # (qualified: MoE families)
    add(model, LoRAConfig(rank=c["r"], alpha=c["lora_alpha"], targets=targets))
    tensors = load_file(os.path.join(path, ADAPTERS))
    try:
        load_adapters(model, {our_adapter_name(k, model.cfg.num_layers): t for k, t in tensors.items()})
    except ValueError as e:  # e.g. a base with another number of MTP layers (model.mtp_layers) than the adapters had
        raise ValueError(f"{os.path.join(path, ADAPTERS)}: {e} (the base in {base_dir(path)} has "
                         f"{model.cfg.num_layers} layers and {model.cfg.mtp_layers} MTP layers)") from None
    return model


class Base(nn.Module):
    """A LoRA model with its adapters off, sharing every tensor: the KL reference of a LoRA run (no memory)."""

    def __init__(self, model):
        super().__init__()
        self.__dict__["inner"] = model  # not a submodule: its parameters stay the learner's alone

    def forward(self, *args, **kwargs):
        with disabled(self.inner):
            return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.__dict__["inner"], name)


def main(argv=None):
    """python -m machinery.lora merge CHECKPOINT OUT [--dtype bfloat16]: a full model directory from a LoRA checkpoint."""
    import argparse
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("command", choices=["merge"])
    ap.add_argument("checkpoint", help="run_dir/checkpoints/step_N of a model.lora run")
    ap.add_argument("out", help="the merged model's directory (Hugging Face layout)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="float32 (default): exact; bfloat16 rounds W + delta, and small deltas with it (stated)")
    args = ap.parse_args(argv)
    if not os.path.isfile(os.path.join(args.checkpoint, ADAPTERS)):
        raise SystemExit(f"error: {args.checkpoint} holds no {ADAPTERS}: not a checkpoint of a model.lora run")
    error = export_merged(args.checkpoint, args.out, getattr(torch, args.dtype))
    print(f"[lora] merged {args.checkpoint} into {args.out} in {args.dtype}: " +
          ("exact (fp32)" if args.dtype == "float32" else
           f"bf16 rounding changes W + delta by {error:.1%} of the adapters' delta (mean over layers)"))


if __name__ == "__main__":
    main()
