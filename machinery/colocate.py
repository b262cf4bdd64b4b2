"""
Co-located mode (train.colocate: true): each process has one GPU and both halves use it in turn, as slime's
--colocate and TRL's and verl's co-located engines do. It suits one GPU (with model.lora, a 9B model fits on
one H100: configs/glm9b_math_1gpu.yaml), and runs where generation is the whole step (long responses): all
GPUs generate, then all train, instead of half of them idling through the other half's phase.

It is synchronous RL: the learner trains batch i with the weights that sampled it (rollout.max_staleness 0),
so a co-located run gives the same metrics and weights as the split layout with max_staleness 0 (tested).
What it adds is the handoff, this file: each half's memory leaves the GPU while the other half runs.

    generate batch i        learner state on the host (offload);  engine: its weights + a KV pool
      | to_learner()          KV pool and CUDA graphs freed, the engine's unshared weights released;
      v                       (offload) the learner's fp32 masters and AdamW state copied back
    train on batch i        RL step; gradients freed after it, not kept
      | publish               the new weights fill the released ones (the engine's update_weights)
      | to_generator()        gradients freed; (offload) the masters and AdamW state copied to pinned host memory
      v
    generate batch i + 1    the engine makes a new pool (and captures new CUDA graphs) on its next call

Offloading works on storages: a tensor's bytes are copied out and its storage shrinks to nothing (resize_(0));
bringing it back grows the same storage and copies the bytes in. Every view of it (FSDP2's shards, the
optimizer's references) stays valid, and reading a tensor whose storage is out fails loudly instead of
reading garbage. With model.lora the base is the learner's frozen tensors, which the engine shares (no second
copy): it never moves, and only the adapters and their AdamW state are offloaded.

CUDA graphs bake in the addresses of the pool and the weights they read. Both come back at new addresses, so
the graphs are dropped with the pool and captured again, a bucket at a time as the next call meets it; what
that costs per handoff is bench/gpu.sh's (colocate handoff). Keeping the addresses (CUDA virtual memory, as
vLLM's sleep mode and torch_memory_saver do) would need a native allocator hook beside torch's: a dependency
this codebase does not take for a cost that a minutes-long RL step hides.
"""
import contextlib
import time

import torch

from machinery.config import colocate_offload


def handoff(cfg, engine, model, optimizer, device, processes):
    """train.py's handoff: a Handoff when co-located (train.offload, or the memory plan's choice on this GPU), else
    the split layout's, which moves nothing."""
    if not cfg.train.colocate:
        return Split()
    gpu_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    return Handoff(engine, model, optimizer, device, colocate_offload(cfg, processes, gpu_bytes))


class Split:
    """Each half on its own GPU (or both on the CPU, as threads): nothing to hand over."""
    stats = {}

    def to_generator(self):
        pass

    def to_learner(self):
        pass

    def resident(self):
        return contextlib.nullcontext()


def offloaded_tensors(model, optimizer):
    """What leaves the device while the engine generates: the trainable parameters (fp32 masters; FSDP2: this
    rank's shards) and the optimizer's state. The frozen base (LoRA) stays: the engine reads it."""
    params = [p for p in model.parameters() if p.requires_grad]
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return [(t.to_local() if hasattr(t, "to_local") else t).detach() for t in params + state]  # (DTensors: the shard)


class Handoff:
    """One device, two halves in turn (this file's docstring). offload: move the learner's state to host memory
    while the engine generates (train.offload; null decides by the memory plan: config.py)."""

    def __init__(self, engine, model, optimizer, device, offload: bool):
        self.engine, self.model, self.optimizer, self.device, self.offload = engine, model, optimizer, device, offload
        self.host = {}  # a storage (its StorageImpl, stable while it resizes) -> its bytes on the host (pinned on a GPU)
        self.out = []  # the storages now offloaded: (storage, its size in bytes)
        self.stats = {"perf/to_learner_s": 0.0, "perf/to_generator_s": 0.0, "colocate/offloaded_gib": 0.0}

    def to_generator(self):
        """The learner has stepped and published: free its gradients and, with offload, move its state out."""
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        # MoE experts' bf16 copies (kernels/moe.py's CastCache): an optimizer step drops them, a skipped one does
        # not, and the memory plan holds them in the train phase only
        for m in self.model.modules():
            if hasattr(m, "casts"):
                m.casts.copies.clear()
        if self.offload and not self.out:
            seen = set()
            for t in offloaded_tensors(self.model, self.optimizer):
                storage = t.untyped_storage()
                if storage._cdata in seen or storage.nbytes() == 0 or not storage.resizable():
                    continue  # (not resizable: a CPU run's state resumed from its memory-mapped checkpoint, host already)
                seen.add(storage._cdata)
                host = self.host.get(storage._cdata)
                if host is None or host.numel() != storage.nbytes():
                    host = self.host[storage._cdata] = torch.empty(storage.nbytes(), dtype=torch.uint8,
                                                                   pin_memory=self.device.type == "cuda")
                host.copy_(_bytes(storage), non_blocking=True)
                self.out.append((storage, storage.nbytes()))
            self._sync()  # the copies land before the storages go
            for storage, _ in self.out:
                storage.resize_(0)
            self.stats["colocate/offloaded_gib"] = sum(n for _, n in self.out) / 2**30
        self.stats["perf/to_generator_s"] = time.perf_counter() - t0

    def to_learner(self):
        """The batch is generated: the engine lets go of its pool and unshared weights, the learner's state
        comes back, byte for byte."""
        t0 = time.perf_counter()
        self.engine.release()
        self._back()
        self.stats["perf/to_learner_s"] = time.perf_counter() - t0

    @contextlib.contextmanager
    def resident(self):
        """The learner's state on the device for a moment (a checkpoint reads it), then out again."""
        out = bool(self.out)
        self._back()
        try:
            yield
        finally:
            if out:
                self.to_generator()

    def _back(self):
        for storage, nbytes in self.out:
            storage.resize_(nbytes)
            _bytes(storage).copy_(self.host[storage._cdata], non_blocking=True)
        self.out = []
        self._sync()

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _bytes(storage):
    """A uint8 tensor over the whole storage: what every view into it holds."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
