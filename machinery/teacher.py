"""
On-policy distillation's teacher (the distill section of config.py; the objective is grpo.distill_advantages): a
frozen model that scores every token the policy sampled. It lives on the generator's device beside the engine and
runs in the generator thread once a batch's trajectories have ended: a no-grad forward over the samples packed into
rows (a prefill: no sampling, no KV cache kept), whose log-prob of each model token travels with its Sample as the
generator's own do (rollout.Sample.teacher_logprobs; env tokens are context, never scored). So the learner's step
keeps its shape, pending batches carry the teacher's numbers through a checkpoint, and the learner waits on the
teacher only where it would wait on the generator anyway.

The teacher must share the student's tokenizer: its log-probs are read at the student's token ids. start-up checks
that (check_tokenizer) before any weights load.
"""
import time

import torch
from transformers import AutoTokenizer

import data
from machinery import ConfigError, fp8, hub
from model import GLM


def check_tokenizer(cfg, tokenizer):
    """One ConfigError line unless distill.teacher's tokenizer maps every token to the id the student's does (the
    student's: `tokenizer`, already loaded). Reads the teacher's tokenizer files alone."""
    spec = cfg.distill.teacher
    if spec is None:
        return
    try:
        theirs = AutoTokenizer.from_pretrained(hub.model_dir(spec, "distill.teacher"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"distill.teacher: {spec}: its tokenizer cannot be read ({str(e).splitlines()[0]})") from None
    mine, other = tokenizer.get_vocab(), theirs.get_vocab()
    if mine == other:
        return
    by_id = [{i: t for t, i in v.items()} for v in (mine, other)]
    first = min(i for i in set(by_id[0]) | set(by_id[1]) if by_id[0].get(i) != by_id[1].get(i))
    student = cfg.model.tokenizer or cfg.model.path or f"the synthetic task's ({cfg.data.train})"
    raise ConfigError(f"distill.teacher: {spec}'s vocabulary ({len(other)} tokens) is not the student's {student} "
                      f"({len(mine)} tokens): id {first} is {by_id[1].get(first)!r} for the teacher, "
                      f"{by_id[0].get(first)!r} for the student; a teacher must share the student's tokenizer")


class Teacher:
    """A frozen GLM on the generator's device in the generator's dtype (dtype None: bf16 on a GPU, fp32 on a CPU;
    quantization fp8: its decoder linears block-wise e4m3, as the generator's). forward: train.packed_forward, the
    learner's own, so the teacher's log-probs are computed exactly as the student's are (passed in: machinery never
    imports the spine)."""

    def __init__(self, path, device, forward, *, temperature, max_tokens, quantization=None, outcome=False, dtype=None):
        gpu = torch.device(device).type == "cuda"
        dtype = dtype or (torch.bfloat16 if gpu else torch.float32)
        # fp8 on a GPU: loaded and quantized in host memory, then moved, so the GPU never holds the bf16 teacher beside
        # the engine (GLM-Z1-32B: 65 GB bf16, 33 GB fp8)
        host = quantization == "fp8" and gpu
        model = GLM.from_pretrained(path, device="cpu" if host else device, dtype=dtype)
        if quantization == "fp8":
            fp8.quantize_model_(model, published=path)  # a published FP8 checkpoint: its own blocks where ours
        self.model = model.to(device).eval().requires_grad_(False)
        self.forward, self.temperature, self.max_tokens = forward, temperature, max_tokens
        self.outcome = outcome  # distill.outcome: GRPO's outcome advantage too (else every group teaches)

    def score(self, samples) -> float:
        """Set each Sample's teacher_logprobs: log pi_teacher of every model token, at the sampling temperature
        (the one the generator's and the learner's log-probs are at), in gen_logprobs' order. Samples are packed
        first-fit into rows of at most max_tokens (optim.max_tokens_per_micro_batch: one row costs the teacher
        what a learner micro-batch's forward costs it). Returns the seconds it took."""
        t0 = time.perf_counter()
        rows = [s.row() for s in samples]
        with torch.no_grad():
            for part in data.pack_by_tokens([len(ids) for ids, _ in rows], self.max_tokens):
                logp = self.forward(self.model, [rows[i] for i in part], self.temperature)[0].float().tolist()  # [N]
                at = 0
                for i in part:  # the packed row's scored tokens are its samples' model tokens, one sample after another
                    n = len(samples[i].gen_logprobs)
                    samples[i].teacher_logprobs, at = logp[at:at + n], at + n
                assert at == len(logp), f"teacher scored {len(logp)} tokens for samples holding {at}"
        return time.perf_counter() - t0


def load_teacher(cfg, device, forward) -> Teacher | None:
    """distill.teacher's Teacher on the generator's device (None: no distillation)."""
    d = cfg.distill
    if d.teacher is None:
        return None
    try:
        return Teacher(hub.model_dir(d.teacher, "distill.teacher"), device, forward, temperature=cfg.rollout.temperature,
                       max_tokens=cfg.optim.max_tokens_per_micro_batch, quantization=d.quantization, outcome=d.outcome)
    except (OSError, ValueError) as e:
        raise ConfigError(f"distill.teacher: {d.teacher}: {str(e).splitlines()[0]}") from None
