"""
The sampler of the torch engine: logits in, tokens and their logprobs out, with per-request noise. Every draw is
a Gumbel-max over the tempered distribution, argmax(logp + g) with g = -log(-log u), whose uniform u is a hash
of three integers: the request's seed, how many tokens it has sampled (its step) and the token id. Nothing else
enters: no RNG state, no row index, no batch size. So a request's t-th token is the same whichever rows share its
batch, whether it ran alone, beside a thousand others, after a retraction and re-prefill, as an agent's turn or
(machinery/speculative.py) as the target's token at a verified draft position, whose drafter draws with the same
key: batching, retraction and speculation change which forwards run, never a draw.

  request_seeds  a call's seeds, one per request (32 bits: from the call's seed and the request's index)
  sample_keys    a row's noise key for one step: hash(seed, step)
  sample_tokens  logits [B, V] and keys [B] -> tokens [B], logprobs [B] (the fused GPU kernel where it applies)

engine.py (TorchEngine) samples with these and re-exports them; kernels/dsa_triton.py's fused sampler is this
file's sample_tokens on chip, the same draws.
"""
import functools
import random

import torch

import dsa
from kernels import dsa_triton
from machinery.scheduler import SamplingParams

_M32 = 0xFFFFFFFF


def _mix32(x):
    """A bijective hash of int64 tensors holding 32-bit values (two multiply-xorshift rounds; every
    product stays below 2^63)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def sample_keys(seeds, steps):
    """One 32-bit noise key per row: its request's seed and how many tokens it has sampled (int64 [B])."""
    return _mix32(seeds ^ _mix32(steps & _M32))


def request_seeds(seed: int | None, n: int) -> list[int]:
    """The noise seeds (32 bits) of a call's n requests: one base from the call's seed (None: fresh, from
    torch's RNG), hashed with each request's index, in one op (not one each)."""
    base = random.Random(seed).getrandbits(32) if seed is not None else int(torch.randint(0, 2**32, ()))
    return (base ^ _mix32(torch.arange(n))).tolist()


@functools.lru_cache(maxsize=8)
def _vocab_hash(vocab_size, device):
    """_mix32 of every token id [V], the same at every step: hashed once per vocabulary and device."""
    return _mix32(torch.arange(vocab_size, device=device))


def sample_tokens(logits, sampling: SamplingParams, keys):
    """logits [B, V], keys [B] (sample_keys) -> tokens [B], logprobs [B]. Gumbel-max: argmax(logp + g)
    with g = -log(-log u) draws exactly from softmax(logp), and u is a hash of (key, token id), so a row's
    draw depends on its own request and step only, never on which rows share its batch (no RNG state).
    The logprob is of the full temperature-scaled distribution (before top-p truncation), which is what
    the learner recomputes. A row whose logits are not finite (weights blown up) gets logprob NaN, for the
    engine to report at its next host sync, instead of a crash in the middle of the batch.

    The place to change how tokens are drawn, with one catch: where temperature > 0, top_p >= 1 (RL's case),
    dsa.USE_TRITON is on (model.dsa_kernels, default true, dense models too) and the logits are on CUDA (or a CPU
    under TRITON_INTERPRET=1), the fused kernels.dsa_triton.sample runs instead (the same draws from two reads of
    the logits; here ~20 passes over [B, V]): a sampler hack edits both, or sets model.dsa_kernels: false."""
    if sampling.temperature > 0 and sampling.top_p >= 1.0 and dsa._triton(logits):
        return dsa_triton.sample(logits, sampling.temperature, keys)
    logits = logits.float()
    finite = torch.isfinite(logits).all(-1, keepdim=True)  # [B, 1]
    logits = torch.where(finite, logits, 0.0)
    if sampling.temperature == 0:
        logp = logits.log_softmax(-1)
        tokens = logits.argmax(-1)
    else:
        logp = (logits / sampling.temperature).log_softmax(-1)
        scores = logp
        if sampling.top_p < 1.0:  # keep the smallest prefix of tokens reaching top_p, sample among them
            sorted_p, order = logp.exp().sort(-1, descending=True)
            drop = torch.zeros_like(logp, dtype=torch.bool).scatter(-1, order, sorted_p.cumsum(-1) - sorted_p > sampling.top_p)
            scores = logp.masked_fill(drop, float("-inf"))
        # u in (0, 1) from 23 bits: (n + 0.5) / 2^23 is exact in fp32 up to 1 - 2^-24 (with 24 bits the top value
        # rounds to 1.0, and its noise -log(-log 1) = inf would pick that token whatever its probability)
        u = (_mix32(keys[:, None] ^ _vocab_hash(logp.shape[-1], logp.device)[None]) >> 9).float().add_(0.5).mul_(2.0 ** -23)
        tokens = (scores - u.log_().neg_().log_()).argmax(-1)
    logp = logp.gather(-1, tokens[:, None])[:, 0]
    return tokens, torch.where(finite[:, 0], logp, float("nan"))
