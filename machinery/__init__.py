"""
The machinery that runs the model, behind a few calls from the chapters (train.py, rollout.py). Nothing here
imports a chapter above it (rollout.py, train.py): what it needs from them is handed in.

    startup.py     the command line to a loaded run: config, Hub ids, files, processes, data, weights, engine
    config.py      every config key with its default and comment, loading, validation, the memory plan's entry
    memory.py      what one learner and one generator GPU hold, from shapes (--dry-run)
    parallel.py    ranks, devices, FSDP2/DDP, micro-batches, the optimizer step, the weights a publish sends
    variants.py    what a variant adds to a step: the KL reference, distillation, routing replay's diagnostics, MTP
    checkpoint.py  the run directory, atomic checkpoints, resume, the KL reference, metrics, signals, one-line errors
    engine.py      generation: TorchEngine (scheduler.py: its rows; sampler.py: the per-request sampler;
                   speculative.py: the MTP layer's drafts, verified; graphs.py: CUDA graphs; sglang.py: SGLang's
                   engine behind the same calls), make_engine
    env.py         the episode loop: trajectories played turn by turn on the engine, env calls with deadlines
    tools.py       the Python tool env (PythonMath), on sandbox.py's worker processes
    teacher.py     on-policy distillation's teacher: a frozen model's log-prob of every sampled token
    colocate.py    one GPU for both halves in turn (train.colocate)
    lora.py        LoRA adapters for RL, their checkpoints, the merged export (python -m machinery.lora merge)
    fp8.py         block-wise fp8 generator weights
    hub.py         Hugging Face Hub ids for the model and the data
    plot.py        a run's curves from metrics.jsonl (python -m machinery.plot RUN_DIR)
"""
import families.mla_moe  # noqa: F401 (it registers GLM-4.7-Flash's and GLM-5's layers in model.FAMILIES, for every run)
from machinery import fp8  # noqa: F401,E402 (it registers the block-wise FP8 checkpoints' reader in model.QUANTIZED)


class ConfigError(ValueError):
    """A setting that cannot work: one line naming the key or file (checkpoint.run_main prints it as `error: ...`)."""
