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

What sharing the base buys: the adapters are megabytes where the model is gigabytes, so a publish moves the
adapters alone, a checkpoint holds adapters and their optimizer state, and the KL reference is the same model
with its adapters switched off (`disabled`), at no memory. Adapters are saved in peft's layout
(adapter_config.json + adapter_model.safetensors), which peft loads onto transformers' Glm4ForCausalLM.

The file in reading order: the config, the layer (LoRALinear), putting adapters on a model (add), their
tensors (adapter_named, load_adapters), switching them off (disabled), merging (merged_weight), peft's layout
(save_adapters).
"""
import contextlib
import json
import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# Every linear layer of a decoder block; the indexer's (dsa.Indexer) and lm_head are never targets
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass
class LoRAConfig:
    rank: int = 32  # RL learns with small ranks (LoRA Without Regret: even rank 1); 32 leaves room for SFT-like data
    alpha: float = 32.0  # the scale is alpha / rank: with alpha fixed, the best learning rate hardly moves with rank
    targets: tuple = TARGETS  # module names; every decoder linear by default (attention-only LoRA underperforms)
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


def add(model, cfg: LoRAConfig, seed: int = 0):
    """Put adapters on every targeted linear of model's decoder blocks, in place: A drawn as nn.Linear draws
    its weight (Kaiming-uniform, from `seed`, the same on every rank), B zeros, both fp32; every other parameter
    frozen. Returns the model."""
    gen = torch.Generator().manual_seed(seed)
    model.requires_grad_(False)
    for name, m in list(model.named_modules()):
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


def peft_name(name: str) -> str:
    """Our adapter name (layers.0.self_attn.q_proj.lora_A) -> peft's key on Glm4ForCausalLM."""
    module, which = name.rsplit(".", 1)
    return f"base_model.model.model.{module}.{which}.weight"


def save_adapters(model, path, base_model: str | None = None):
    """The adapters in peft's layout: adapter_config.json and adapter_model.safetensors (fp32), written into a
    temporary directory and renamed into place. peft loads it onto transformers' Glm4ForCausalLM of the base."""
    from safetensors.torch import save_file
    cfg = model.lora
    tmp = path.rstrip("/") + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": cfg.alpha,
              "target_modules": sorted(cfg.targets), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "use_dora": False, "init_lora_weights": True, "base_model_name_or_path": base_model}
    with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tensors = {peft_name(n): p.detach().float().cpu().contiguous() for n, p in adapter_named(model)}
    save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
    if os.path.isdir(path):
        import shutil
        shutil.rmtree(path)
    os.replace(tmp, path)
