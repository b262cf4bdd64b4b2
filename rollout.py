"""
Generation: the engine that samples completions, and the generator thread that turns prompts into
graded, grouped rollout batches while the learner trains (DESIGN.md, "The process layout").

    prompts --> [Generator thread] --render--> engine.generate (n per prompt) --grade--> RolloutBatch
                       ^                                                                      |
                       |  publish(weights, version)                 queue (bounded)           v
                       +-------------------------------------------------------------- learner

Asynchrony with bounded staleness: batch i may only start once the learner has published weight
version >= i - max_staleness. With max_staleness 0 the generator waits for every update (synchronous
RL); with 1 it generates batch i+1 while the learner trains on batch i (one-step off-policy).
The learner counts versions as optimizer steps done, so a sample trained at step s was produced by
weights at most max_staleness versions old.

Weights can change in the middle of a batch. With `partial_rollout` (the default, as in slime and
AReaL) generation continues under the new weights, keeping the KV cache computed under the old ones,
and each sample records the (oldest, newest) versions it spans; the learner's off-policy correction
(TIS / IcePop on the generator's logprobs) accounts for the mix. Without it, unfinished samples are
aborted and regenerated from scratch under the new weights.

Engines implement two calls: `generate(prompt_ids, sampling) -> [Completion]` and
`update_weights(named_tensors, version)`. `TorchEngine` is ours: batched sampling on model.py with
its KV cache (and DSA decode), the only engine that runs our DSA models.
"""
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from data import eval_metrics, math_reward, render_prompt
from model import GLM, KVCache

# Dynamic sampling draws new prompts to replace groups whose samples all got the same reward. A run
# whose model solves nothing (or everything) would redraw forever: after this many rounds the batch
# is topped up with such groups (zero advantage, so they add nothing to the gradient).
MAX_SAMPLING_ROUNDS = 4


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop_token_ids: tuple = ()


@dataclass
class Completion:
    token_ids: list[int]  # the sampled tokens, stop token included: the learner trains on these exact ids
    logprobs: list[float]  # log softmax(logits / temperature) of each sampled token
    finish_reason: str  # "stop" | "length" | "abort"
    versions: tuple[int, int]  # (oldest, newest) weight version that produced its tokens


# ----------------------------------------------------------------------------- the torch engine

def sample_tokens(logits, sampling: SamplingParams, generator=None):
    """logits [B, V] -> tokens [B], logprobs [B]. The logprob is of the full temperature-scaled
    distribution (before top-p truncation), which is what the learner recomputes."""
    logits = logits.float()
    if sampling.temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, logits.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
    logp = (logits / sampling.temperature).log_softmax(-1)
    probs = logp.exp()
    if sampling.top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > sampling.top_p  # keep the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))
    tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]


class TorchEngine:
    """Batched generation on our own model: left-padded prefill into a KV cache, then one token per
    step for every unfinished row (finished rows are dropped from the cache). A lock is held around
    each forward, so update_weights from another thread lands between two decode steps.
    The engine owns its model: it is put in eval mode and frozen, so never hand it the learner's."""

    def __init__(self, model: GLM, max_batch: int = 64, partial_rollout: bool = True):
        self.model = model.eval().requires_grad_(False)
        self.max_batch, self.partial_rollout = max_batch, partial_rollout
        self.version = 0
        self.lock = threading.Lock()
        self._abort = threading.Event()
        self._params = dict(model.named_parameters())
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, seed: int | None = None) -> list[Completion]:
        gen = torch.Generator(self.device).manual_seed(seed) if seed is not None else None
        # Similar lengths share a batch, so left padding wastes little.
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        out = [None] * len(prompts)
        for b in range(0, len(order), self.max_batch):
            rows = order[b:b + self.max_batch]
            for i, c in zip(rows, self._generate_batch([prompts[i] for i in rows], sampling, gen)):
                out[i] = c
        return out

    @torch.no_grad()
    def _generate_batch(self, prompts, sampling, gen):
        B, P = len(prompts), max(len(p) for p in prompts)
        if any(len(p) == 0 for p in prompts):
            raise ValueError("cannot generate from an empty prompt")
        ids = torch.zeros(B, P, dtype=torch.long)
        mask = torch.zeros(B, P, dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every row's last prompt token is in slot P-1
            ids[i, P - len(p):] = torch.tensor(p)
            mask[i, P - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(1) - 1).clamp_min(0)
        cache = KVCache(self.model.cfg, B, P + sampling.max_new_tokens, self.device, self.dtype)
        with self.lock:
            logits = self.model(ids, position_ids=pos, attention_mask=mask, cache=cache, last_only=True)[:, -1]
            version = self.version
        start_version = version
        tokens = [[] for _ in range(B)]
        logps = [[] for _ in range(B)]
        versions = [[version, version] for _ in range(B)]
        finish = [None] * B
        alive = torch.arange(B)  # original row of each cache row
        next_pos = pos[:, -1] + 1
        stop = torch.tensor(sorted(set(sampling.stop_token_ids)), dtype=torch.long, device=self.device)
        for step in range(sampling.max_new_tokens):
            tok, lp = sample_tokens(logits, sampling, gen)
            done = torch.isin(tok, stop) if len(stop) else torch.zeros_like(tok, dtype=torch.bool)
            for r, t, l in zip(alive.tolist(), tok.tolist(), lp.tolist()):
                tokens[r].append(t)
                logps[r].append(l)
                versions[r][0], versions[r][1] = min(versions[r][0], version), max(versions[r][1], version)
            for r in alive[done.cpu()].tolist():
                finish[r] = "stop"
            keep = ~done.cpu()
            if step + 1 == sampling.max_new_tokens or not keep.any():
                break
            aborted = self._abort.is_set() or (not self.partial_rollout and self.version != start_version)
            if aborted:
                for r in alive[keep].tolist():
                    finish[r] = "abort"
                break
            if not keep.all():  # drop finished rows: later steps do no work for them
                cache.keep(keep.nonzero()[:, 0].to(self.device))
                alive, tok, next_pos = alive[keep], tok[keep.to(self.device)], next_pos[keep.to(self.device)]
            with self.lock:
                logits = self.model(tok[:, None], position_ids=next_pos[:, None], cache=cache)[:, -1]
                version = self.version
            next_pos = next_pos + 1
        return [Completion(tokens[i], logps[i], finish[i] or "length", tuple(versions[i])) for i in range(B)]

    @torch.no_grad()
    def update_weights(self, named_tensors, version: int):
        """Copy new weights in place (names as in model.named_parameters()); takes effect at the next
        decode step of any in-flight batch."""
        with self.lock:
            for name, t in named_tensors:
                if name not in self._params:
                    raise KeyError(f"update_weights: unknown parameter {name}")
                self._params[name].copy_(t, non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.version = version

    def abort(self):
        """Make in-flight generate calls return now (finish_reason "abort"); clear with resume()."""
        self._abort.set()

    def resume(self):
        self._abort.clear()


# ----------------------------------------------------------------------------- the generator thread

@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    gen_logprobs: list[float]  # the generator's logprob of each response token
    reward: float
    group: int  # index of the prompt's group within its batch
    versions: tuple[int, int]  # (oldest, newest) weight version; staleness is judged on the oldest
    finish_reason: str
    example: dict  # the dataset entry (prompt, label, ...)


@dataclass
class RolloutBatch:
    samples: list[Sample]  # prompts_per_step groups of n, each group contiguous
    index: int  # batch number: the learner trains batch i at step i
    stream_state: dict  # PromptStream state after this batch's prompts were drawn (for resume)
    metrics: dict = field(default_factory=dict)


class Generator:
    """Runs the generation loop in a background thread and hands RolloutBatches to the learner.
    The staleness gate compares batch numbers with engine.version, so before start() the engine must
    hold the learner's weights and version (engine.update_weights(weights, version)); first_index is
    that version on resume. Do not evaluate on the engine while stop() runs: it aborts in-flight work."""

    def __init__(self, engine, stream, tokenizer, *, prompts_per_step: int, n: int, sampling: SamplingParams,
                 max_staleness: int, dynamic_sampling: bool, chat_template: bool, max_prompt_tokens: int,
                 reward_fn=math_reward, seed: int = 0, first_index: int = 0):
        self.engine, self.stream, self.tokenizer = engine, stream, tokenizer
        self.prompts_per_step, self.n, self.sampling = prompts_per_step, n, sampling
        self.max_staleness, self.dynamic_sampling = max_staleness, dynamic_sampling
        self.chat_template, self.max_prompt_tokens = chat_template, max_prompt_tokens
        self.reward_fn, self.seed = reward_fn, seed
        self.index = first_index  # next batch to produce
        self.queue = queue.Queue(maxsize=max_staleness + 1)
        self.gate = threading.Condition()
        self.stopping = threading.Event()
        self.error = None
        self.waited = 0.0  # seconds spent blocked on the staleness gate or a full queue
        self.started = None
        self.thread = threading.Thread(target=self._run, name="generator", daemon=True)

    def start(self):
        self.started = time.perf_counter()
        self.thread.start()

    def stop(self):
        self.stopping.set()
        self.engine.abort()
        with self.gate:
            self.gate.notify_all()
        if self.thread.is_alive():
            self.thread.join()
        self.engine.resume()

    def publish(self, named_tensors, version: int):
        """Called by the learner after each optimizer step: new weights, and the gate opens."""
        self.engine.update_weights(named_tensors, version)
        with self.gate:
            self.gate.notify_all()

    def get(self, timeout: float | None = None) -> RolloutBatch:
        """The next batch; re-raises at once if the generator thread failed."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        while True:
            if self.error is not None:
                raise RuntimeError("the generator thread failed (see the error above)") from self.error
            try:
                return self.queue.get(timeout=0.1)
            except queue.Empty:
                if deadline is not None and time.perf_counter() > deadline:
                    raise TimeoutError("no rollout batch arrived in time") from None
                if not self.thread.is_alive() and self.error is None:
                    raise RuntimeError("the generator thread has stopped")

    def idle_fraction(self) -> float:
        return self.waited / max(1e-9, time.perf_counter() - self.started) if self.started else 0.0

    def _run(self):
        try:
            while not self.stopping.is_set():
                t0 = time.perf_counter()
                with self.gate:  # bounded staleness: wait for version >= index - max_staleness
                    while self.engine.version < self.index - self.max_staleness and not self.stopping.is_set():
                        self.gate.wait(0.1)
                self.waited += time.perf_counter() - t0
                if self.stopping.is_set():
                    return
                batch = self._make_batch()
                if batch is None:
                    return
                t0 = time.perf_counter()
                while not self.stopping.is_set():
                    try:
                        self.queue.put(batch, timeout=0.1)
                        break
                    except queue.Full:
                        pass
                self.waited += time.perf_counter() - t0
                self.index += 1
        except BaseException as e:  # surfaced in the learner by get()
            self.error = e

    def _make_batch(self):
        t0 = time.perf_counter()
        kept, spare, rounds, generated, skipped = [], [], 0, [], 0
        while len(kept) < self.prompts_per_step and rounds < MAX_SAMPLING_ROUNDS:
            examples, prompts = [], []
            for ex in self.stream.next(self.prompts_per_step - len(kept)):
                ids = render_prompt(self.tokenizer, ex["prompt"], self.chat_template)
                if len(ids) > self.max_prompt_tokens:
                    skipped += 1  # an overlong prompt would be cut mid-question: skip it
                    continue
                examples.append(ex)
                prompts.append(ids)
            rounds += 1
            if not prompts:
                if skipped > len(self.stream.examples):
                    raise ValueError(f"every prompt is longer than rollout.max_prompt_tokens={self.max_prompt_tokens}")
                continue
            groups = self._generate_groups(examples, prompts, seed=self.seed * 1_000_003 + self.index * 101 + rounds)
            if groups is None:
                return None
            for g in groups:
                generated += g
                rewards = {s.reward for s in g}
                (spare if self.dynamic_sampling and len(rewards) == 1 else kept).append(g)
        dropped = len(spare)
        kept += spare[:self.prompts_per_step - len(kept)]
        samples = []
        for gi, g in enumerate(kept):
            for s in g:
                s.group = gi
                samples.append(s)
        secs = time.perf_counter() - t0
        n_tok = sum(len(s.response_ids) for s in generated)
        metrics = {
            "rollout/reward": sum(s.reward for s in generated) / max(1, len(generated)),
            "rollout/reward_trained": sum(s.reward for s in samples) / max(1, len(samples)),
            "rollout/response_len": n_tok / max(1, len(generated)),
            "rollout/truncated": sum(s.finish_reason == "length" for s in generated) / max(1, len(generated)),
            "rollout/groups_dropped": dropped, "rollout/rounds": rounds, "rollout/prompts_skipped": skipped,
            "rollout/gen_s": secs, "rollout/gen_tokens_per_s": n_tok / max(secs, 1e-9),
        }
        return RolloutBatch(samples, self.index, self.stream.state_dict(), metrics)

    def _generate_groups(self, examples, prompts, seed):
        """n completions per prompt, graded; aborted ones (no partial rollout) are regenerated."""
        flat = [p for p in prompts for _ in range(self.n)]
        comps = self.engine.generate(flat, self.sampling, seed=seed)
        while not self.stopping.is_set():
            redo = [i for i, c in enumerate(comps) if c.finish_reason == "abort"]
            if not redo:
                break
            for i, c in zip(redo, self.engine.generate([flat[i] for i in redo], self.sampling, seed=seed + 7)):
                comps[i] = c
        if self.stopping.is_set():
            return None
        groups = []
        for p, ex in enumerate(examples):
            group = []
            for c in comps[p * self.n:(p + 1) * self.n]:
                text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
                group.append(Sample(prompts[p], c.token_ids, c.logprobs, float(self.reward_fn(text, ex["label"])),
                                    p, c.versions, c.finish_reason, ex))
            groups.append(group)
        return groups


def evaluate(engine, examples, tokenizer, *, n: int, sampling: SamplingParams, chat_template: bool,
             max_prompt_tokens: int, reward_fn=math_reward, seed=0) -> dict:
    """Accuracy and pass@k of the engine's current weights on held-out examples (n samples each)."""
    prompts = [render_prompt(tokenizer, ex["prompt"], chat_template) for ex in examples]
    if max(map(len, prompts)) > max_prompt_tokens:
        raise ValueError(f"an eval prompt has {max(map(len, prompts))} tokens, over rollout.max_prompt_tokens="
                         f"{max_prompt_tokens}")
    comps = engine.generate([p for p in prompts for _ in range(n)], sampling, seed=seed)
    rewards = [[float(reward_fn(tokenizer.decode(c.token_ids, skip_special_tokens=True), ex["label"]))
                for c in comps[i * n:(i + 1) * n]] for i, ex in enumerate(examples)]
    return eval_metrics(rewards, ks=tuple(k for k in (1, 2, 4, 8, 16, 32, 64) if k <= n))
