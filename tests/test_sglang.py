"""sglang.py: the SGLang adapter (SGLangEngine, its sessions, fp8_checkpoint) against a fake sglang module:
its arguments, completions, sessions, chunked weight pushes, fp8 checkpoints, updates mid-generation, abort."""
import asyncio
import dataclasses
import json
import os
import pickle
import sys
import threading
import time
import types

import pytest
import torch

from machinery import parallel
from machinery.engine import Completion, SamplingParams
from machinery.sglang import SGLangEngine
from model import hf_name
from test_engine import tiny_model


def model_dir(tmp_path, dsa=None):
    cfg = {"architectures": ["Glm4ForCausalLM"]} | ({"dsa": dsa} if dsa else {})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_sglang_missing_gives_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang raises ImportError
    with pytest.raises(ImportError, match=r"pip install -e '\.\[sglang\]' \(it is not installed\)"):
        SGLangEngine(model_dir(tmp_path), "cuda:0")


def test_sglang_refuses_cpu_and_dsa(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(ValueError, match="CUDA"):
        SGLangEngine(model_dir(tmp_path), "cpu")
    with pytest.raises(ValueError, match="engine: torch is the only engine that runs our DSA models"):
        SGLangEngine(model_dir(tmp_path, dsa={"topk": 4}), "cuda:0")
    with pytest.raises(ValueError, match="DSA"):
        SGLangEngine(model_dir(tmp_path), "cuda:0", dsa=True)
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    with pytest.raises(ValueError, match="SGLANG_RETURN_ORIGINAL_LOGPROB"):
        SGLangEngine(model_dir(tmp_path), "cuda:0")


def fake_serialize(chunk):  # pickle, which cannot load an fp8 storage back: fp8 tensors travel as their bytes
    return pickle.dumps([(n, t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t, t.dtype == torch.float8_e4m3fn)
                         for n, t in chunk])


def fake_deserialize(b):
    return [(n, t.view(torch.float8_e4m3fn) if is_fp8 else t) for n, t, is_fp8 in pickle.loads(b)]


class FakeTokenizerManager:
    """The TokenizerManager calls the adapter makes, as we read them in SGLang 0.5.9: new requests wait
    while paused, pause "retract" holds the running ones until continue_generation (they keep their
    tokens); update_weights_from_tensor takes one serialized [(name, tensor)] per TP rank and answers
    (success, message); abort_request(abort_all=True) makes every request inside return "abort"."""

    def __init__(self, session):
        self.paused, self.running, self.calls, self.weights = False, [], [], 0
        if session:  # newer SGLang: weight loads inside begin/end_weight_update
            self.begin_weight_update = lambda obj, request: self._log(("begin",))
            self.end_weight_update = lambda obj, request: self._log(("end",))

    async def _log(self, call):
        self.calls.append(call)
        return True, "Success"

    async def pause_generation(self, obj):
        self.calls.append(("pause", obj.mode))
        self.paused = True

    async def continue_generation(self, obj):
        self.calls.append(("continue",))
        self.paused = False

    async def update_weights_from_tensor(self, obj, request):
        (chunk,) = [fake_deserialize(b) for b in obj.serialized_named_tensors]
        # bf16 travels; with fp8, the quantized weights and their fp32 scales as they are
        assert all(t.dtype == (torch.float32 if n.endswith("_scale_inv") else torch.bfloat16) or t.dtype == torch.float8_e4m3fn
                   for n, t in chunk)
        self.weights += obj.flush_cache  # the fake model changes once the whole update has landed
        return await self._log(("update", [n for n, _ in chunk], obj.flush_cache, [t.dtype for _, t in chunk]))

    def abort_request(self, rid="", abort_all=False):
        self.calls.append(("abort",))
        for req in self.running:
            req["abort"] = True


class FakeEngine:
    """sglang.Engine as the adapter uses it: `loop`, `tokenizer_manager`, `async_generate(input_ids=,
    sampling_params=, return_logprob=True)` -> {"output_ids", "meta_info": {"finish_reason": {"type"},
    "output_token_logprobs": [(logprob, id, None)]}} with output_ids through the stop token, and the
    length checked before stop tokens. Its "model" emits last token + 1 + weight updates so far (mod 40),
    one token per `step` seconds, with logprob -0.5 per token."""
    step = 0.0
    last = None  # the latest instance, for the tests to inspect

    def __init__(self, **kwargs):
        self.kwargs, self.loop, self.shut = kwargs, asyncio.new_event_loop(), False
        session = hasattr(sys.modules["sglang.srt.managers.io_struct"], "BeginWeightUpdateReqInput")
        self.tokenizer_manager = FakeTokenizerManager(session)
        self.seen = []  # sampling params of every request
        FakeEngine.last = self

    async def async_generate(self, input_ids, sampling_params, return_logprob=False):
        tm, sp, req = self.tokenizer_manager, sampling_params, {"abort": False}
        self.seen.append(sp)
        while tm.paused:
            await asyncio.sleep(0.001)
        tm.running.append(req)
        ids, finish, last = [], {"type": "length"}, input_ids[-1]
        while not req["abort"]:
            last = (last + 1 + tm.weights) % 40
            ids.append(last)
            if len(ids) == sp["max_new_tokens"]:
                break
            if last in sp["stop_token_ids"]:
                finish = {"type": "stop", "matched": last}
                break
            await asyncio.sleep(self.step)
            while tm.paused and not req["abort"]:  # retracted until continue_generation
                await asyncio.sleep(0.001)
        if req["abort"]:
            finish = {"type": "abort", "message": "Abort"}
        tm.running.remove(req)
        return {"output_ids": ids, "meta_info": {"finish_reason": finish,
                                                 "output_token_logprobs": [(-0.5, t, None) for t in ids]}}

    def shutdown(self):
        self.shut = True


@pytest.fixture
def fake_sglang(monkeypatch):
    """Injects a fake `sglang` (Engine, srt.managers.io_struct, srt.utils.MultiprocessingSerializer). It
    tests our adapter against our reading of SGLang's API, not SGLang itself (which needs a GPU)."""
    io = types.ModuleType("sglang.srt.managers.io_struct")
    io.PauseGenerationReqInput = dataclasses.make_dataclass("PauseGenerationReqInput", [("mode", str, "abort")])
    io.ContinueGenerationReqInput = dataclasses.make_dataclass("ContinueGenerationReqInput", [])
    io.UpdateWeightsFromTensorReqInput = dataclasses.make_dataclass(
        "UpdateWeightsFromTensorReqInput", [("serialized_named_tensors", list), ("flush_cache", bool, True)])
    utils = types.ModuleType("sglang.srt.utils")
    utils.MultiprocessingSerializer = types.SimpleNamespace(serialize=fake_serialize)  # CUDA IPC handles in SGLang
    sgl, srt, managers = (types.ModuleType(n) for n in ("sglang", "sglang.srt", "sglang.srt.managers"))
    sgl.Engine, sgl.srt, srt.managers, srt.utils, managers.io_struct = FakeEngine, srt, managers, utils, io
    for m in (sgl, srt, managers, io, utils):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    monkeypatch.setattr(FakeEngine, "step", 0.0)
    engines = []

    def make(tmp_path, **kw):
        engine = SGLangEngine(model_dir(tmp_path), "cuda:1", **kw)
        engine.device = torch.device("cpu")  # the fake runs on CPU; the CUDA-only steps are skipped there
        engines.append(engine)
        return engine, FakeEngine.last

    yield make
    for e in engines:
        e.shutdown()


def test_sglang_engine_args_and_completions(tmp_path, fake_sglang):
    engine, fake = fake_sglang(tmp_path, max_batch=8)
    assert fake.kwargs | {"model_path": None} == {
        "model_path": None, "skip_tokenizer_init": True, "tp_size": 1, "base_gpu_id": 1, "dtype": "bfloat16",
        "random_seed": 0, "mem_fraction_static": 0.8, "max_running_requests": 8}
    sp = SamplingParams(temperature=0.7, max_new_tokens=4, stop_token_ids=(12,))
    stop, length = engine.generate([[1, 2, 9], [20]], sp)
    assert stop == Completion([10, 11, 12], [-0.5] * 3, "stop", (0, 0))  # the stop token is kept
    assert length == Completion([21, 22, 23, 24], [-0.5] * 4, "length", (0, 0))
    # SGLang says "length" when the stop token is also the last allowed one; TorchEngine says "stop"
    assert engine.generate([[9]], SamplingParams(max_new_tokens=3, stop_token_ids=(12,)))[0].finish_reason == "stop"
    assert fake.seen[0] == {"temperature": 0.7, "top_p": 1.0, "max_new_tokens": 4, "stop_token_ids": [12]}
    engine.generate([[1]] * 3, sp, seed=5)
    engine.generate([[1]] * 3, sp, seed=5)
    seeds = [s["sampling_seed"] for s in fake.seen[-6:]]
    assert seeds[:3] == seeds[3:] and len(set(seeds[:3])) == 3  # reproducible, distinct within a call
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate([[]], sp)
    engine.shutdown()
    assert fake.shut and not engine._thread.is_alive()


def test_sglang_session_drives_episodes_by_token_ids(tmp_path, fake_sglang):
    """env.py's episode loop on SGLang: a session takes requests while others run and returns each as it ends,
    with the completions generate() gives, each request's seed its sampling_seed; and a whole multi-turn episode
    loop runs on it (token ids in and out)."""
    from machinery import env
    engine, fake = fake_sglang(tmp_path, max_batch=8)
    sp = SamplingParams(temperature=0.7, max_new_tokens=4, stop_token_ids=(12,))
    with engine.session(sp, 64) as call:
        a = call.submit([1, 2, 9], 4, 5)
        got = {}
        while call.busy:
            for i, c in call.step():
                got[i] = c
                if i == a:
                    call.submit([20], 3, 2**40 + 6, key="t")  # submitted while the call runs; seeds kept to 31 bits
    assert got == {0: Completion([10, 11, 12], [-0.5] * 3, "stop", (0, 0)), 1: Completion([21, 22, 23], [-0.5] * 3, "length", (0, 0))}
    assert [s["sampling_seed"] for s in fake.seen] == [5, 6]

    from data import make_tiny_tokenizer
    tok = make_tiny_tokenizer(tools=True)
    from test_env import Scripted  # an observation after each turn but the last
    eps = [env.Episode({"prompt": "1+1=", "turns": 2}, 0)]
    sp = SamplingParams(max_new_tokens=8, stop_token_ids=(10,))  # the fake counts up from the context's last id
    ends = list(env.run_episodes(engine, eps, Scripted, tok, sp, env.Limits(8, 60, 3), seed=0))
    assert [i for i, _ in ends] == [0] and eps[0].turns == 2 and eps[0].failure is None and eps[0].reward == 1.0
    assert eps[0].response[:5] == [6, 7, 8, 9, 10]  # the first turn, through its stop token


@pytest.mark.parametrize("partial,session", [(True, False), (False, True)])
def test_sglang_weight_push_is_chunked_and_lazy(tmp_path, fake_sglang, partial, session):
    if session:
        io = sys.modules["sglang.srt.managers.io_struct"]
        io.BeginWeightUpdateReqInput = io.EndWeightUpdateReqInput = io.ContinueGenerationReqInput  # empty requests
    engine, fake = fake_sglang(tmp_path, partial_rollout=partial, update_chunk_bytes=2048)
    tm, params = fake.tokenizer_manager, list(tiny_model().named_parameters())
    pushed_before = []

    def lazy():  # like an FSDP gather: tensors are produced one at a time
        for name, p in params:
            pushed_before.append(sum(c[0] == "update" for c in tm.calls))
            yield name, p.detach()

    engine.update_weights(lazy(), version=3)
    updates = [c for c in tm.calls if c[0] == "update"]
    assert len(updates) > 2 and pushed_before[-1] > 0  # pushed while the generator was still running
    assert [c[2] for c in updates] == [False] * (len(updates) - 1) + [True]  # only the last one flushes
    names = [n for c in updates for n in c[1]]
    assert names == [hf_name(n) for n, _ in params]
    assert {"model.layers.0.self_attn.q_proj.weight", "lm_head.weight"} <= set(names)  # HF names
    steps = [c[0] for c in tm.calls if c[0] != "update"]
    assert steps == ["pause"] + ["abort"] * (not partial) + ["begin", "end"] * session + ["continue"]
    assert tm.calls[0] == ("pause", "retract") and engine.version == 3
    engine.update_weights([], version=4)  # nothing to push: only the version moves
    assert engine.version == 4 and len(tm.calls) == len(updates) + len(steps)


def test_sglang_fp8_runs_an_fp8_checkpoint_and_pushes_fp8_tensors(tmp_path, fake_sglang):
    """rollout.quantization: fp8 with SGLang: it is started on an e4m3 copy of the checkpoint whose config asks
    for block-wise FP8 (SGLang's Fp8LinearMethod), and publishes keep the fp8 weights and fp32 scales as they are."""
    from safetensors import safe_open
    model = tiny_model()
    model.save_pretrained(str(tmp_path / "ckpt"))
    engine, fake = fake_sglang(tmp_path / "ckpt", fp8=True)
    path = fake.kwargs["model_path"]
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
                                                       "dynamic", "weight_block_size": [128, 128]}
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        q, s = f.get_tensor("model.layers.0.mlp.down_proj.weight"), f.get_tensor("model.layers.0.mlp.down_proj.weight_scale_inv")
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16  # lm_head and embeddings stay bf16
    engine.update_weights(parallel.full_weights(model, torch.bfloat16, "fp8"), version=1)
    pushed = dict(kv for c in fake.tokenizer_manager.calls if c[0] == "update" for kv in zip(c[1], c[3]))
    assert pushed["model.layers.0.mlp.down_proj.weight"] == torch.float8_e4m3fn
    assert pushed["model.layers.0.mlp.down_proj.weight_scale_inv"] == torch.float32
    assert pushed["model.embed_tokens.weight"] == torch.bfloat16
    engine.shutdown()
    assert not os.path.exists(path)  # the fp8 copy goes with the engine


@pytest.mark.parametrize("partial", [True, False])
def test_sglang_update_mid_generation(tmp_path, fake_sglang, partial, monkeypatch):
    engine, fake = fake_sglang(tmp_path, partial_rollout=partial)
    monkeypatch.setattr(FakeEngine, "step", 0.01)
    result = {}
    sp = SamplingParams(max_new_tokens=80)
    t = threading.Thread(target=lambda: result.update(out=engine.generate([[1], [2]], sp)))
    t.start()
    time.sleep(0.15)
    engine.update_weights(tiny_model().named_parameters(), version=1)
    t.join()
    for c in result["out"]:
        steps = {(b - a) % 40 for a, b in zip(c.token_ids, c.token_ids[1:])}
        if partial:  # continued under the new weights (the fake model's step changed from 1 to 2)
            assert c.versions == (0, 1) and c.finish_reason == "length" and len(c.token_ids) == 80
            assert steps == {1, 2}
        else:  # aborted at the update, to be regenerated
            assert c.finish_reason == "abort" and 0 < len(c.token_ids) < 80 and steps == {1}
            assert len(c.logprobs) == len(c.token_ids)


def test_sglang_abort_and_resume(tmp_path, fake_sglang, monkeypatch):
    engine, fake = fake_sglang(tmp_path)
    monkeypatch.setattr(FakeEngine, "step", 0.01)
    result = {}
    sp = SamplingParams(max_new_tokens=1000)  # 10 s at the fake's pace
    t = threading.Thread(target=lambda: result.update(out=engine.generate([[1]] * 3, sp)))
    t.start()
    time.sleep(0.1)
    t0 = time.perf_counter()
    engine.abort()
    t.join()
    assert time.perf_counter() - t0 < 2 and all(c.finish_reason == "abort" for c in result["out"])
    assert engine.generate([[1]], SamplingParams(max_new_tokens=5))[0] == Completion([], [], "abort", (0, 0))
    engine.resume()
    assert engine.generate([[1]], SamplingParams(max_new_tokens=5))[0].finish_reason == "length"
