"""
Generation: the engine that samples completions, and the generator thread that turns prompts into
graded, grouped rollout batches while the learner trains (docs/design.md, "Processes").

    prompts --> [Generator thread] --render--> engine.generate (n per prompt) --grade--> RolloutBatch
                       ^                                                                      |
                       |  publish(weights, version)                 queue (bounded)           v
                       +-------------------------------------------------------------- learner

Asynchrony with bounded staleness: batch i may only start once the learner has published weight
version >= i - max_staleness. With max_staleness 0 the generator waits for every update (synchronous
RL); with 1 it generates batch i+1 while the learner trains on batch i (one-step off-policy).
The learner counts versions as optimizer steps done, so a sample trained at step s was produced by
weights at most max_staleness versions old.

When do new weights reach the generator? By default between batches only: batch i is sampled wholly by
version i - max_staleness, so two runs with one seed are identical and a resumed run continues exactly.
With `partial_rollout` (as in slime and AReaL) they land in the middle of a batch: generation continues
under the new weights, keeping the KV cache computed under the old ones, and each sample records the
(oldest, newest) versions it spans; the learner's off-policy correction (TIS / IcePop on the generator's
logprobs) accounts for the mix, but which token saw which version depends on timing.
"""
import asyncio
import itertools
import json
import os
import queue
import random
import threading
import time
from dataclasses import dataclass, field

import torch

from data import eval_metrics, math_reward, render_prompt
from model import GLM, KVCache, hf_name

# Dynamic sampling draws new prompts to replace groups whose samples all got the same reward. A run
# whose model solves nothing (or everything) would redraw forever: after this many rounds the batch
# is topped up with such groups (zero advantage, so they add nothing to the gradient).
MAX_SAMPLING_ROUNDS = 4


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    # Nucleus sampling, for eval and tools. RL rollouts keep 1.0: the logprobs are of the full tempered
    # distribution, which is what the learner recomputes; a truncated sampler would not match them.
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
    distribution (before top-p truncation), which is what the learner recomputes. A row whose logits are
    not finite (weights blown up) gets logprob NaN, for the caller to report on its next host sync,
    instead of a multinomial crash in the middle of the batch."""
    logits = logits.float()
    finite = torch.isfinite(logits).all(-1, keepdim=True)  # [B, 1]
    logits = torch.where(finite, logits, 0.0)
    tokens, logp = _sample(logits, sampling, generator)
    return tokens, torch.where(finite[:, 0], logp, float("nan"))


def _sample(logits, sampling, generator):
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
    One batch (one KV cache) exists at a time: the generator thread's rollouts and the learner thread's
    eval take turns batch by batch, so the GPU never holds two caches that the memory plan did not count.
    The engine owns its model: it is put in eval mode and frozen, so never hand it the learner's."""

    def __init__(self, model: GLM, max_batch: int = 64):
        self.model = model.eval().requires_grad_(False)
        self.max_batch = max_batch
        self.version = 0
        self.lock = threading.Lock()  # held for one forward or one weight update
        self.batch_lock = threading.Lock()  # held for a whole batch: its KV cache is the only one
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
            with self.batch_lock:
                done = self._generate_batch([prompts[i] for i in rows], sampling, gen)
            for i, c in zip(rows, done):
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
                if l != l:  # NaN: this row's logits were not finite
                    raise FloatingPointError(f"generator: non-finite logits at weight version {version} "
                                             "(the published weights overflow: lower the learning rate?)")
                tokens[r].append(t)
                logps[r].append(l)
                versions[r][0], versions[r][1] = min(versions[r][0], version), max(versions[r][1], version)
            for r in alive[done.cpu()].tolist():
                finish[r] = "stop"
            keep = ~done.cpu()
            if step + 1 == sampling.max_new_tokens or not keep.any():
                break
            if self._abort.is_set():
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


# ----------------------------------------------------------------------------- the SGLang engine

SGLANG_MISSING = ("rollout.engine: sglang needs SGLang on a GPU machine: pip install -e '.[sglang]' "
                  "(it is not installed)")


class SGLangEngine:
    """TorchEngine's interface on SGLang's offline `sglang.Engine` (one GPU, tensor parallel 1, bf16),
    for dense GLM-4 checkpoints. Written against SGLang 0.5.9 (python/sglang/srt/entrypoints/engine.py,
    managers/tokenizer_manager.py, io_struct.py, layers/sampler.py); pause modes need >= 0.5.6, and the
    begin/end_weight_update session that newer releases (0.5.23) require is opened when SGLang has it.

    - token_ids: output_ids (ids in and out: skip_tokenizer_init), through the stop token. SGLang also
      stops at the checkpoint's own eos_token_id(s).
    - logprobs: meta_info["output_token_logprobs"], which SGLang's sampler computes as log softmax
      (logits / T) over the full vocabulary, before top-p (greedy: log softmax(logits)), as the learner
      does; SGLANG_RETURN_ORIGINAL_LOGPROB=1 would drop the T, so it is refused.
    - seed: one sampling_seed per request, honoured only with enable_deterministic_inference=True.
    - A weight update pauses generation in mode "retract": running requests go back to SGLang's queue,
      holding no KV, so the flush that ends the update cannot fail on them. With partial_rollout each
      one's prompt + tokens so far are prefilled again under the new weights on resume (TorchEngine
      keeps the old KV); versions are (version at submission, at return). Without, they are aborted.

    Threads: the Engine's sync methods run its asyncio loop until their call is done, so the generator
    and the learner calling them at once would run one loop twice. Instead a thread of ours runs that
    loop forever and every call submits coroutines to it (run_coroutine_threadsafe): the tokenizer
    manager and its zmq sockets are only used from that thread. Never call self.engine's sync methods."""

    def __init__(self, model_path: str, device, *, partial_rollout: bool = True, max_batch: int = 64,
                 mem_fraction_static: float = 0.8, seed: int = 0, dsa: bool | None = None,
                 update_chunk_bytes: int = 2**30, **engine_kwargs):
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"rollout.engine: sglang runs on a CUDA generator device, got {device} "
                             "(use engine: torch)")
        config = os.path.join(model_path, "config.json")
        if dsa is None and os.path.isfile(config):  # our checkpoints have a "dsa" section when they use it
            with open(config) as f:
                dsa = bool(json.load(f).get("dsa"))
        if dsa:
            raise ValueError(f"{model_path}: a DSA model, and SGLang has no DSA kernel for our GLM-4 models; "
                             "engine: torch is the only engine that runs our DSA models")
        if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true", "yes", "on"):
            raise ValueError("unset SGLANG_RETURN_ORIGINAL_LOGPROB: SGLang would return logprobs without the "
                             "temperature, not the log softmax(logits / T) the learner recomputes")
        try:
            import sglang
            from sglang.srt.managers import io_struct
            from sglang.srt.utils import MultiprocessingSerializer
        except ImportError:
            raise ImportError(SGLANG_MISSING) from None
        self.io, self.serializer = io_struct, MultiprocessingSerializer
        self.device, self.dtype = device, torch.bfloat16
        self.partial_rollout, self.chunk_bytes = partial_rollout, update_chunk_bytes
        self.version = 0
        self.engine = sglang.Engine(model_path=model_path, skip_tokenizer_init=True, tp_size=1,
                                    base_gpu_id=device.index or 0, dtype="bfloat16", random_seed=seed,
                                    mem_fraction_static=mem_fraction_static, max_running_requests=max_batch,
                                    **engine_kwargs)
        self.tm, self.loop = self.engine.tokenizer_manager, self.engine.loop
        self._aborted = threading.Event()
        self._inflight = 0  # our requests inside SGLang; read and written on the loop thread only
        self._thread = threading.Thread(target=self.loop.run_forever, name="sglang-loop", daemon=True)
        self._thread.start()

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, seed: int | None = None) -> list[Completion]:
        if any(len(p) == 0 for p in prompts):
            raise ValueError("cannot generate from an empty prompt")
        rng = random.Random(seed)
        futures = []
        for p in prompts:  # all at once: SGLang's scheduler batches them (up to max_batch running)
            sp = {"temperature": sampling.temperature, "top_p": sampling.top_p,
                  "max_new_tokens": sampling.max_new_tokens, "stop_token_ids": list(sampling.stop_token_ids)}
            if seed is not None:  # one seed per request: the n copies of a prompt must differ
                sp["sampling_seed"] = rng.getrandbits(31)
            futures.append(asyncio.run_coroutine_threadsafe(self._generate_one(list(p), sp), self.loop))
        return [f.result() for f in futures]

    async def _generate_one(self, prompt, sp):
        start = self.version
        if self._aborted.is_set():
            return Completion([], [], "abort", (start, start))
        self._inflight += 1
        try:
            out = await self.engine.async_generate(input_ids=prompt, sampling_params=sp, return_logprob=True)
        finally:
            self._inflight -= 1
        ids, meta = list(out["output_ids"]), out["meta_info"]
        finish = (meta.get("finish_reason") or {}).get("type")  # "stop" | "length" | "abort"
        if finish == "length" and ids and ids[-1] in sp["stop_token_ids"]:
            finish = "stop"  # SGLang checks the length first; TorchEngine calls this a stop
        finish = finish if finish in ("stop", "length") else "abort"  # abort (or unknown): regenerated
        entries = (meta.get("output_token_logprobs") or [])[:len(ids)]  # [(logprob, token id, text)]
        if [e[1] for e in entries] != ids[:len(entries)] or (len(entries) < len(ids) and finish != "abort"):
            raise RuntimeError(f"SGLang returned {len(ids)} token ids and {len(entries)} logprobs that do not line up")
        return Completion(ids[:len(entries)], [float(e[0]) for e in entries], finish, (start, self.version))

    @torch.no_grad()
    def update_weights(self, named_tensors, version: int):
        """Push (our name, tensor) pairs as HF names with update_weights_from_tensor, about chunk_bytes
        at a time, consuming the iterable as it goes: a lazy one (FSDP gathering a layer at a time) never
        has every weight alive at once. Its tensors must stay valid while we hold them (fresh tensors,
        as DTensor.full_tensor() returns). Each chunk is copied to the generator GPU in bf16 and handed
        to SGLang by CUDA IPC; the last one flushes SGLang's KV/radix cache."""
        items = iter(named_tensors)
        first = next(items, None)
        if first is None:  # nothing to push: only the version moves
            self.version = version
            return
        self._run(self.tm.pause_generation(self.io.PauseGenerationReqInput(mode="retract")))
        session = hasattr(self.io, "BeginWeightUpdateReqInput")  # newer SGLang loads weights inside a session
        try:
            if not self.partial_rollout:  # unfinished requests return "abort", to be regenerated
                self._run(self._abort_all())
            if session:
                self._check(self._run(self.tm.begin_weight_update(self.io.BeginWeightUpdateReqInput(), None)))
            chunk, size = [], 0
            for name, t in itertools.chain([first], items):
                t = t.detach().to(self.device, self.dtype)
                if chunk and size + t.nbytes > self.chunk_bytes:
                    self._push(chunk, flush=False)  # not the last: another tensor follows
                    chunk, size = [], 0
                chunk.append((hf_name(name), t))
                size += t.nbytes
            self._push(chunk, flush=True)
            if session:
                self._check(self._run(self.tm.end_weight_update(self.io.EndWeightUpdateReqInput(), None)))
            self.version = version  # before resuming: whatever returns from now on ran on the new weights
        finally:  # resume even after a failure, or paused requests (and the generator thread) would hang
            self._run(self.tm.continue_generation(self.io.ContinueGenerationReqInput()))

    def _push(self, chunk, flush: bool):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the copies must be done before SGLang's process reads them
        req = self.io.UpdateWeightsFromTensorReqInput(serialized_named_tensors=[self.serializer.serialize(chunk)],
                                                      flush_cache=flush)  # one payload per TP rank
        self._check(self._run(self.tm.update_weights_from_tensor(req, None)))
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()  # free the chunk's memory once SGLang has closed its IPC handles

    @staticmethod
    def _check(result):
        success, message = result
        if not success:
            raise RuntimeError(f"SGLang weight update failed: {message}")

    def abort(self):
        """Make in-flight generate calls return now (finish_reason "abort"); clear with resume()."""
        self._aborted.set()
        asyncio.run_coroutine_threadsafe(self._abort_in_flight(), self.loop)

    async def _abort_in_flight(self):
        while self._aborted.is_set() and self._inflight:  # one may reach the scheduler after an abort: repeat
            await self._abort_all()
            await asyncio.sleep(0.05)

    async def _abort_all(self):  # a coroutine: the tokenizer manager is used on the loop thread only
        self.tm.abort_request(abort_all=True)

    def resume(self):
        self._aborted.clear()

    def shutdown(self):
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
        self.engine.shutdown()


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
    that version on resume, and `ready` the batches a checkpoint kept (sampled before it was taken).
    Do not evaluate on the engine while stop() runs: it aborts in-flight work.

    When do new weights reach the engine? With partial_rollout off, only between batches: publish(v)
    waits until batch v + max_staleness - 1 is done, so batch i is sampled wholly by version
    i - max_staleness and a run is reproducible. The learner loses nothing by waiting with
    max_staleness 1: its next step needs exactly that batch. With partial_rollout on, they land at the
    next decode step of the batch in flight."""

    def __init__(self, engine, stream, tokenizer, *, prompts_per_step: int, n: int, sampling: SamplingParams,
                 max_staleness: int, dynamic_sampling: bool, chat_template: bool, max_prompt_tokens: int,
                 reward_fn=math_reward, seed: int = 0, first_index: int = 0, partial_rollout: bool = False,
                 ready: list = ()):
        self.engine, self.stream, self.tokenizer = engine, stream, tokenizer
        self.prompts_per_step, self.n, self.sampling = prompts_per_step, n, sampling
        self.max_staleness, self.dynamic_sampling = max_staleness, dynamic_sampling
        self.chat_template, self.max_prompt_tokens = chat_template, max_prompt_tokens
        self.reward_fn, self.seed, self.partial_rollout = reward_fn, seed, partial_rollout
        self.queue = queue.Queue(maxsize=max_staleness + 1)
        for batch in ready:
            self.queue.put(batch)
        self.index = first_index + len(ready)  # next batch to produce
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
        with self.gate:
            while not (self.partial_rollout or self.index >= version + self.max_staleness or self.stopping.is_set()
                       or self.error is not None or not self.thread.is_alive()):
                self.gate.wait(0.1)
        self.engine.update_weights(named_tensors, version)
        with self.gate:
            self.gate.notify_all()

    def get(self, timeout: float | None = None) -> RolloutBatch:
        """The next batch; re-raises at once if the generator thread failed (a FloatingPointError as it
        is: a one-line diagnosis, not a bug)."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        while True:
            if isinstance(self.error, FloatingPointError):
                raise self.error
            if self.error is not None:
                raise RuntimeError("the generator thread failed (see the error above)") from self.error
            try:
                return self.queue.get(timeout=0.1)
            except queue.Empty:
                if deadline is not None and time.perf_counter() > deadline:
                    raise TimeoutError("no rollout batch arrived in time") from None
                if not self.thread.is_alive() and self.error is None:
                    raise RuntimeError("the generator thread has stopped")

    def pending(self, version: int) -> list:
        """The finished batches the learner has not taken yet, from batch `version` on (they go into a
        checkpoint: sampled by older weights, they could not be sampled again after a resume)."""
        with self.queue.mutex:
            return [b for b in self.queue.queue if version <= b.index < version + self.max_staleness]

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
                with self.gate:  # a publish may be waiting for this batch
                    self.index += 1
                    self.gate.notify_all()
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
        top_up = spare[:self.prompts_per_step - len(kept)]  # too few informative groups: uniform ones fill in
        dropped, kept = len(spare) - len(top_up), kept + top_up
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
                group.append(Sample(prompts[p], c.token_ids, c.logprobs, float(self.reward_fn(text, ex)),
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
    rewards = [[float(reward_fn(tokenizer.decode(c.token_ids, skip_special_tokens=True), ex))
                for c in comps[i * n:(i + 1) * n]] for i, ex in enumerate(examples)]
    return eval_metrics(rewards, ks=tuple(k for k in (1, 2, 4, 8, 16, 32, 64) if k <= n))


def make_engine(rollout, model_dir, device, *, dsa, seed: int):
    """The generator's engine (rollout.engine) on this process's generator device, holding a copy of
    model_dir. rollout: the config's rollout section; dsa: model.dsa."""
    if rollout.engine == "sglang":  # SGLang missing, a CPU device or a DSA model: one line naming the problem
        return SGLangEngine(model_dir, device, partial_rollout=rollout.partial_rollout, max_batch=rollout.max_batch,
                            mem_fraction_static=rollout.sglang_mem_fraction, seed=seed, dsa=True if dsa else None)
    model = GLM.from_pretrained(model_dir, dsa=dsa, device=device)
    return TorchEngine(model, max_batch=rollout.max_batch)  # when weights land is the Generator's choice
