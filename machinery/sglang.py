"""
TorchEngine's calls on SGLang (rollout.engine: sglang; the optional `.[sglang]` extra, one GPU, dense GLM-4
checkpoints): generate, session (submit / step / end, for env.py's episode loop), update_weights, abort /
resume, shutdown. engine.py's make_engine makes one when the config asks for SGLang (sglang itself is
imported only then, by SGLangEngine).
fp8_checkpoint writes the e4m3 copy of a checkpoint that SGLang runs with rollout.quantization: fp8.
"""
import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import os
import random
import shutil
import threading

import torch

from machinery import fp8
from machinery.scheduler import Completion, SamplingParams
from model import hf_name, our_name

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
      keeps the old KV unless rollout.update_mode: reprefill); versions are (version at submission, at
      return). Without, they are aborted.

    Threads: the Engine's sync methods run its asyncio loop until their call is done, so the generator
    and the learner calling them at once would run one loop twice. Instead a thread of ours runs that
    loop forever and every call submits coroutines to it (run_coroutine_threadsafe): the tokenizer
    manager and its zmq sockets are only used from that thread. Never call self.engine's sync methods."""

    def __init__(self, model_path: str, device, *, partial_rollout: bool = True, max_batch: int = 64,
                 mem_fraction_static: float = 0.8, seed: int = 0, dsa: bool | None = None, fp8: bool = False,
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
        if fp8:  # SGLang's block-wise FP8 runs a checkpoint that says so: an e4m3 copy of this one, in a temp dir
            self._fp8_dir = fp8_checkpoint(model_path)
            model_path = self._fp8_dir.name
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

    def generate(self, prompts: list[list[int]], sampling, seed: int | None = None) -> list[Completion]:
        """sampling: a SamplingParams, or one per prompt (a multi-turn call's turns have their own budgets)."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("cannot generate from an empty prompt")
        per = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        rng = random.Random(seed)
        futures = []
        for p, s in zip(prompts, per):  # all at once: SGLang's scheduler batches them (up to max_batch running)
            sp = self._sampling_dict(s, s.max_new_tokens)
            if seed is not None:  # one seed per request: the n copies of a prompt must differ
                sp["sampling_seed"] = rng.getrandbits(31)
            futures.append(asyncio.run_coroutine_threadsafe(self._generate_one(list(p), sp), self.loop))
        return [f.result() for f in futures]

    @contextlib.contextmanager
    def session(self, sampling: SamplingParams, longest: int, width: int | None = None):
        """TorchEngine.session's calls on SGLang, for env.py's episode loop (token ids in and out, so nothing
        is re-tokenized): submit() sends a request at once, step() returns those that have finished (waiting a
        little for one), end() is a no-op (SGLang's radix cache keeps a trajectory's prefix while it has room,
        and its next turn reuses it). Each request's seed is its sampling_seed, honoured only with SGLang's
        deterministic inference: runs on SGLang are not reproducible, whatever rollout.env_admit_after says."""
        yield _SGLangSession(self, sampling)

    def _sampling_dict(self, s: SamplingParams, max_new: int):
        return {"temperature": s.temperature, "top_p": s.top_p, "max_new_tokens": max_new,
                "stop_token_ids": list(s.stop_token_ids)}

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
            for name, t in itertools.chain([first], items):  # fp8 weights and their fp32 scales travel as they are
                t = t.detach().to(self.device, self.dtype if t.dtype in (torch.float32, torch.bfloat16)
                                  and not name.endswith("_scale_inv") else t.dtype)
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
        if getattr(self, "_fp8_dir", None) is not None:  # the e4m3 copy of the checkpoint goes with the engine
            self._fp8_dir.cleanup()


class _SGLangSession:
    """One session of an SGLangEngine (SGLangEngine.session): requests in flight as futures on its loop."""

    def __init__(self, engine, sampling):
        self.engine, self.sampling, self.futures, self.submitted = engine, sampling, {}, 0

    def submit(self, prompt, max_new, seed, key=None, park=True):
        if len(prompt) == 0:
            raise ValueError("cannot generate from an empty prompt")
        sp = self.engine._sampling_dict(self.sampling, max_new) | {"sampling_seed": seed & 0x7FFFFFFF}
        self.futures[self.submitted] = asyncio.run_coroutine_threadsafe(self.engine._generate_one(list(prompt), sp),
                                                                        self.engine.loop)
        self.submitted += 1
        return self.submitted - 1

    def step(self, wait_s=0.01):
        """The requests that have finished, in submission order (waiting up to wait_s for the first)."""
        if self.futures:
            concurrent.futures.wait(list(self.futures.values()), timeout=wait_s, return_when=concurrent.futures.FIRST_COMPLETED)
        done = [i for i, f in self.futures.items() if f.done()]
        return [(i, self.futures.pop(i).result()) for i in done]

    @property
    def busy(self):
        return bool(self.futures)

    def end(self, key):
        pass


def fp8_checkpoint(model_path):
    """A copy of an HF checkpoint directory with the decoder's linear weights in block-wise e4m3 and their
    weight_scale_inv (fp8.quantize), and a quantization_config that tells SGLang so (DeepSeek-V3's layout, the
    one SGLang's Fp8LinearMethod loads with block quantization): SGLang then runs fp8 GEMMs, and the learner's
    publishes (fp8.quantized_weights) replace these tensors under the same names. A TemporaryDirectory, removed
    when the engine goes."""
    import tempfile
    from safetensors import safe_open
    from safetensors.torch import save_file
    out = tempfile.TemporaryDirectory(prefix="glm-rl-fp8-")
    with open(os.path.join(model_path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [fp8.BLOCK, fp8.BLOCK]}
    with open(os.path.join(out.name, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in os.listdir(model_path):  # the tokenizer, generation_config.json and the rest, as they are
        if os.path.isfile(os.path.join(model_path, name)) and not name.endswith(".safetensors") and name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy(os.path.join(model_path, name), out.name)
    for fname in sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors")):
        with safe_open(os.path.join(model_path, fname), framework="pt") as f:
            tensors = {}
            for hf in f.keys():  # one file's tensors at a time
                t = f.get_tensor(hf)
                if fp8.is_quantized(our_name(hf)):
                    tensors[hf], tensors[hf + "_scale_inv"] = fp8.quantize(t)
                else:
                    tensors[hf] = t.to(torch.bfloat16) if t.is_floating_point() else t
        save_file(tensors, os.path.join(out.name, fname), metadata={"format": "pt"})
    if os.path.isfile(os.path.join(model_path, "model.safetensors.index.json")):
        with open(os.path.join(model_path, "model.safetensors.index.json")) as f:
            index = json.load(f)
        index["weight_map"] |= {k + "_scale_inv": v for k, v in index["weight_map"].items()
                                if fp8.is_quantized(our_name(k))}
        with open(os.path.join(out.name, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    return out
