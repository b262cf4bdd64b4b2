"""Tests for train.py: config loading and validation, the learner's packed logprobs against the
generator's, one RL step in-process (staleness filter, on-policy check, micro-batch gradients), short
end-to-end runs of the tiny config in a subprocess (metrics, checkpoints, Ctrl-C, resume after a kill),
and several processes (torchrun, gloo on CPU) against one: RL steps on a fixed global batch with DDP and
FSDP2, the warm-up stages end to end, and checkpoint/resume with 2 processes.

This file is also the worker of the RL-step test: `torchrun ... tests/test_train.py OUT PARALLEL AGG`."""
import copy
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

import data
import grpo
import train
from model import GLM, GLMConfig
from rollout import RolloutBatch, Sample, SamplingParams, TorchEngine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
GLM9B = os.path.join(ROOT, "configs", "glm9b_math.yaml")
DICT_KEYS = {"model.init", "model.dsa"}  # free-form mappings, checked by GLMConfig / DSAConfig

# A few seconds per run: a smaller model, every stage a few steps, a checkpoint every 2 steps.
FAST = ["model.init.hidden_size=32", "model.init.intermediate_size=64", "model.init.num_layers=2",
        "model.init.head_dim=8", "train.dsa_warmup_steps=2", "train.sft_steps=4", "train.rl_steps=4",
        "train.warmup_batch_size=16", "rollout.prompts_per_step=4", "rollout.n=4", "train.eval_every=2",
        "train.eval_n=2", "data.eval_size=8", "train.save_every=2", "train.keep_checkpoints=20",
        "optim.warmup_steps=2"]


# ----------------------------------------------------------------------------- config


def write_yaml(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


def test_unknown_key_names_key_and_suggestion(tmp_path):
    path = write_yaml(tmp_path, "model:\n  init: {hidden_size: 8}\nrollout:\n  temprature: 0.5\n")
    with pytest.raises(train.ConfigError) as e:
        train.load_config(path)
    assert str(e.value) == f"{path}: unknown key rollout.temprature (did you mean rollout.temperature?)"
    with pytest.raises(train.ConfigError, match=r"^command line: unknown key optim\.lrr \(did you mean optim\.lr\?\)$"):
        train.load_config(TINY, ["optim.lrr=0.1"])
    with pytest.raises(train.ConfigError, match="unknown key zzz_qqq$"):  # nothing close: no suggestion
        train.load_config(TINY, ["zzz_qqq=1"])
    with pytest.raises(train.ConfigError, match=r"unknown key model\.init\.hiden_size \(did you mean model\.init\.hidden_size\?\)"):
        train.load_config(TINY, ["model.init.hiden_size=8"])


@pytest.mark.parametrize("override, message", [
    ("rollout.n=abc", "rollout.n must be int, got 'abc'"),
    ("rollout.n=true", "rollout.n must be int, got True"),
    ("rollout.n=2.5", "rollout.n must be int, got 2.5"),
    ("rollout.temperature=hot", "rollout.temperature must be float, got 'hot'"),
    ("rollout.chat_template=1", "rollout.chat_template must be bool, got 1"),
    ("model.path=3", "model.path must be str or null, got 3"),
    ("optim.betas=0.9", "optim.betas must be list, got 0.9"),
    ("rollout=3", "rollout must be a mapping of keys, got 3"),
    ("rollout.n.x=3", "rollout.n.x: n is not a mapping"),
    ("rollout.temperature=0", "rollout.temperature must be > 0"),
    ("grpo.agg=mean", "grpo.agg must be one of"),
    ("grpo.old_logp=recompute", "grpo.old_logp was removed: pi_old is now the learner's own forward"),
    ("rollout.top_p=0.9", "rollout.top_p was removed: RL samples from the full tempered distribution"),
    ("grpo.icepop_beta=0.5", "grpo.icepop_beta must be > 1"),
    ("grpo.tis_cap=0", "grpo.tis_cap must be > 0"),
    ("optim.max_skipped_steps=0", "optim.max_skipped_steps must be >= 1"),
    ("model.path=/some/dir", "set exactly one of model.path and model.init"),
    ("model.init.vocab_size=10", "model.init must not set ['vocab_size']"),
    ("model.init.num_kv_heads=3", "num_heads (4) must be a multiple of num_kv_heads (3)"),
    ("model.dsa.pattern=SF", "dsa.pattern must be a string of F/S starting with F"),
    ("model.dsa.top_k=8", "unknown dsa key(s) ['top_k']"),
])
def test_bad_values_fail_with_the_key(override, message):
    with pytest.raises(train.ConfigError) as e:
        train.load_config(TINY, [override])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_overrides_and_yaml_number_forms(tmp_path):
    cfg = train.load_config(TINY, ["run_dir=/tmp/x", "optim.lr=1e-6", "rollout.temperature=1", "model.init.num_layers=5",
                                   "grpo.tis_cap=2", "grpo.icepop_beta=null", "optim.betas=[0.8, 0.9]"])
    assert cfg.run_dir == "/tmp/x"
    assert cfg.optim.lr == 1e-6 and isinstance(cfg.optim.lr, float)  # YAML reads "1e-6" as a string
    assert cfg.rollout.temperature == 1.0 and isinstance(cfg.rollout.temperature, float)
    assert cfg.model.init["num_layers"] == 5 and cfg.model.init["hidden_size"] == 96  # the rest of init kept
    assert cfg.grpo.tis_cap == 2.0 and cfg.grpo.icepop_beta is None and cfg.optim.betas == [0.8, 0.9]
    assert train.load_config(write_yaml(tmp_path, "model: {init: {}}\n")).rollout.n == 8  # defaults fill in


def yaml_keys(d, prefix=""):
    keys = []
    for k, v in d.items():
        name = prefix + k
        keys += yaml_keys(v, name + ".") if isinstance(v, dict) and name not in DICT_KEYS else [name]
    return keys


@pytest.mark.parametrize("path", [TINY, GLM9B])
def test_yaml_has_every_key_and_documents_it(path):
    with open(path) as f:
        raw = yaml.safe_load(f)
    assert sorted(yaml_keys(raw)) == sorted(train.config_keys()), "YAML keys and Config fields differ"
    train.load_config(path)  # and it validates
    lines = open(path).read().splitlines()
    for i, line in enumerate(lines):  # every key line has a comment, on it or just above it
        if re.match(r"^\s*[A-Za-z_]\w*:", line):
            above = lines[i - 1].strip() if i else ""
            assert "#" in line or above.startswith("#"), f"{path}:{i + 1}: key without a comment: {line.strip()}"


def test_every_key_is_read():
    """train.py reads every key; the grpo section is the objective's own GRPOConfig, read in grpo.py too."""
    src = {name: open(os.path.join(ROOT, name)).read() for name in ("train.py", "grpo.py")}
    for key in train.config_keys():
        where = ("train.py", "grpo.py") if key.startswith("grpo.") else ("train.py",)
        assert any(re.search(rf"\.{key.rpartition('.')[2]}\b", src[w]) for w in where), f"nothing in {where} reads {key}"


def test_glm9b_recipe_numbers():
    cfg = train.load_config(GLM9B)
    r, g, o, t = cfg.rollout, cfg.grpo, cfg.optim, cfg.train
    assert cfg.model.path.endswith("GLM-Z1-9B-0414") and cfg.data.train.endswith("dapo-math-17k.jsonl")
    assert (r.prompts_per_step, r.n, r.temperature, r.max_new_tokens) == (32, 8, 1.0, 8192)
    assert (g.eps_low, g.eps_high, g.agg, g.kl_coef, g.icepop_beta) == (0.2, 0.28, "seq-mean-token-mean", 0.0, 2.0)
    assert (o.lr, o.weight_decay, o.betas, o.max_tokens_per_micro_batch) == (1e-6, 0.1, [0.9, 0.98], 4608)
    assert (t.eval_every, t.eval_n, t.eval_max_new_tokens) == (20, 16, 16384)


def test_dry_run_prints_the_9b_memory_plan():
    p = subprocess.run([sys.executable, "train.py", "--config", GLM9B, "--dry-run"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "9.40B parameters" in p.stdout and "learner GPU (fsdp over 4)" in p.stdout
    assert p.stdout.count("fits in 74.5 GiB") == 2  # learner and generator
    p = subprocess.run([sys.executable, "train.py", "--config", GLM9B, "--dry-run", "train.parallel=ddp"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "does NOT fit" in p.stdout
    assert p.stderr.startswith("error: does not fit on H100s: learner GPU (ddp over 4)") and "train.parallel: fsdp" in p.stderr


def test_sglang_engine_on_cpu_fails_before_training(tmp_path):
    p = subprocess.run([sys.executable, "train.py", f"run_dir={tmp_path / 'r'}", "rollout.engine=sglang"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and p.stderr.strip().splitlines()[-1].startswith("error: rollout.engine: sglang runs on a CUDA")
    assert not os.path.exists(tmp_path / "r" / "metrics.jsonl")  # nothing trained


def test_cli_config_error_is_one_line():
    p = subprocess.run([sys.executable, "train.py", "rollout.temprature=1"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode != 0
    assert p.stderr.strip().splitlines() == [
        f"error: command line: unknown key rollout.temprature (did you mean rollout.temperature?)"]


# ----------------------------------------------------------------------------- learner vs generator


def tiny_model(seed=0, topk=4):
    torch.manual_seed(seed)
    cfg = GLMConfig(vocab_size=len(data.make_tiny_tokenizer()), hidden_size=32, intermediate_size=64,
                    num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, eos_token_id=[1], pad_token_id=0,
                    dsa={"topk": topk, "heads": 2, "head_dim": 8, "rope_dim": 4, "pattern": "FS"})
    model = GLM(cfg)
    with torch.no_grad():  # sharper than the 0.02 init, so probabilities and top-k choices differ
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


@pytest.fixture(scope="module")
def rollouts():
    """A learner model, an engine holding an identical copy, and completions sampled from it."""
    tok = data.make_tiny_tokenizer()
    model = tiny_model()
    engine = TorchEngine(copy.deepcopy(model), max_batch=8)
    prompts = [data.render_prompt(tok, ex["prompt"]) for ex in data.synthetic_task(6, seed=1)] + [[4, 9], [4, 9, 9, 9, 9]]
    sampling = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=12, stop_token_ids=(1,))
    comps = engine.generate([p for p in prompts for _ in range(2)], sampling, seed=3)  # groups of 2
    return model, engine, [p for p in prompts for _ in range(2)], comps


def test_packed_logprobs_match_generator(rollouts):
    """The learner's packed forward (several samples per row, positions restarting at 0) gives the
    generator's logprobs: same tokens, same temperature, same DSA top-k, full distribution (top-p aside)."""
    model, _, prompts, comps = rollouts
    assert max(len(p) + len(c.token_ids) for p, c in zip(prompts, comps)) > 4  # top-k 4: attention is sparse
    rows = [(p + c.token_ids, len(p)) for p, c in zip(prompts, comps)]
    with torch.no_grad():
        for mb in data.pack_by_tokens([len(s) for s, _ in rows], 60):
            logp, ent, _ = train.packed_forward(model, [rows[i] for i in mb], temperature=0.7)
            for i, lp in zip(mb, logp):
                assert len(lp) == len(comps[i].token_ids)
                assert (lp - torch.tensor(comps[i].logprobs)).abs().max() < 1e-4


def make_batch(prompts, comps, versions, n=2):
    samples = [Sample(p, c.token_ids, c.logprobs, float(i % 3 == 0), i // n, v, c.finish_reason, {})
               for i, (p, c, v) in enumerate(zip(prompts, comps, versions))]
    return RolloutBatch(samples, index=0, stream_state={}, metrics={})


def rl_setup(model, **overrides):
    overrides = {"rollout.temperature": 0.7} | overrides
    cfg = train.load_config(TINY, [f"{k}={v}" for k, v in overrides.items()])
    return cfg, torch.optim.AdamW(p for n, p in model.named_parameters() if ".indexer." not in n), grpo.KLGuard()


def test_rl_step_on_policy_and_staleness_filter(rollouts):
    model, _, prompts, comps = rollouts
    learner = copy.deepcopy(model)
    cfg, opt, guard = rl_setup(learner, **{"rollout.max_staleness": 1})
    # Learner at version 5: samples from versions 5 and 4 are fresh, one touched by version 3 is not.
    versions = [(5, 5)] * 8 + [(4, 5)] * 6 + [(3, 5)] + [(4, 4)]
    m = train.rl_step(cfg, learner, None, opt, guard, make_batch(prompts, comps, versions), version=5)
    assert m["staleness/dropped"] == 1 and m["staleness/max"] == 1 and m["train/samples"] == 15
    # Same weights as the generator, so the learner's own forward (pi_prox) is the generator's logprobs.
    assert m["train/logp_diff_max"] < 1e-4
    assert m["train/ratio_mean"] == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("agg", grpo.AGG_MODES)
def test_micro_batches_sum_to_the_full_batch_gradient(rollouts, agg):
    model, _, prompts, comps = rollouts
    batch = make_batch(prompts, comps, [(0, 0)] * len(comps))
    grads = []
    for budget in (20, 10_000):  # many packed rows vs. one
        learner = copy.deepcopy(model)
        cfg, opt, guard = rl_setup(learner, **{"optim.max_tokens_per_micro_batch": budget, "grpo.agg": agg})
        train.rl_step(cfg, learner, None, opt, guard, batch, version=0)
        grads.append(torch.cat([p.grad.flatten() for p in learner.parameters() if p.grad is not None]))
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-7)


def test_a_non_finite_step_is_skipped_and_changes_nothing(rollouts):
    model, _, prompts, comps = rollouts
    learner = copy.deepcopy(model)
    cfg, opt, guard = rl_setup(learner)
    before = {k: v.clone() for k, v in learner.state_dict().items()}
    batch = make_batch(prompts, comps, [(0, 0)] * len(comps))
    batch.samples[0].reward = float("nan")  # a grader returning NaN: the advantages of its group are NaN
    m = train.rl_step(cfg, learner, None, opt, guard, batch, version=0)
    assert m["train/skipped"] == 1.0 and not math.isfinite(m["train/loss"])
    assert all(torch.equal(v, learner.state_dict()[k]) for k, v in before.items())
    assert not opt.state and all(p.grad is None for p in learner.parameters())  # AdamW never saw it
    batch.samples[0].reward = 1.0
    m = train.rl_step(cfg, learner, None, opt, guard, batch, version=0)
    assert m["train/skipped"] == 0.0 and opt.state


def test_skips_in_a_row_stop_with_one_line():
    skips = train.Skips(limit=3)
    for step in range(1, 3):
        skips.update("rl", step, {"train/skipped": 1.0, "train/loss": float("nan"), "train/grad_norm": 1.0})
    skips.update("rl", 3, {"train/skipped": 0.0})  # a good step resets the run
    assert (skips.total, skips.run) == (2, 0)
    for step in range(4, 6):
        skips.update("rl", step, {"train/skipped": 1.0, "train/loss": 1.0, "train/grad_norm": float("inf")})
    with pytest.raises(FloatingPointError) as e:
        skips.update("rl", 6, {"train/skipped": 1.0, "train/loss": 1.0, "train/grad_norm": float("inf")})
    assert str(e.value).startswith("rl step 6: grad_norm inf for 3 steps in a row") and "\n" not in str(e.value)


def test_packed_logprobs_match_a_bf16_generator_under_autocast(rollouts):
    """The GPU's dtypes: the learner's fp32 master weights under bf16 autocast against a generator holding
    bf16 weights, with sparse attention (an indexer trained to imitate attention, as after the warm-up).
    Their logprob gap must stay near the dense model's own bf16 gap."""
    model, _, prompts, _ = rollouts
    model = copy.deepcopy(model)
    opt, g = torch.optim.Adam(model.indexer_parameters(), lr=1e-2), torch.Generator().manual_seed(0)
    for _ in range(60):  # the dense warm-up, in miniature
        _, kl = model(torch.randint(0, model.cfg.vocab_size, (4, 24), generator=g), indexer_loss="dense")
        opt.zero_grad()
        kl.backward()
        opt.step()
    gaps = {}
    for name, net in (("dsa", model), ("dense", GLM(GLMConfig(**{**model.cfg.__dict__, "dsa": None})))):
        if name == "dense":
            net.load_state_dict(model.state_dict(), strict=False)
        engine = TorchEngine(copy.deepcopy(net).cast_(torch.bfloat16), max_batch=16)
        comps = engine.generate(prompts, SamplingParams(temperature=0.7, max_new_tokens=12, stop_token_ids=(1,)), seed=3)
        rows = [(p + c.token_ids, len(p)) for p, c in zip(prompts, comps)]
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logp, _, _ = train.packed_forward(net, rows, temperature=0.7)
        gaps[name] = torch.cat([(lp - torch.tensor(c.logprobs)).abs() for lp, c in zip(logp, comps)])
    assert max(len(p) + len(c.token_ids) for p, c in zip(prompts, comps)) > 4  # top-k 4: attention is sparse
    # measured: mean gap 0.004 (DSA) vs 0.011 (dense) nats; the worst token 0.69 vs 0.055 (one flipped key)
    assert gaps["dsa"].mean() < max(3 * gaps["dense"].mean(), 1e-2), (gaps["dsa"].mean(), gaps["dense"].mean())


def test_rl_step_under_bf16_autocast(rollouts, monkeypatch):
    """rl_step as it runs on a GPU (autocast bf16, fp32 master weights), DSA included: finite, and the
    same update as fp32 to bf16 precision."""
    model, _, prompts, comps = rollouts
    batch = make_batch(prompts, comps, [(0, 0)] * len(comps))
    grads = {}
    for dtype in ("fp32", "bf16"):
        if dtype == "bf16":
            monkeypatch.setattr(train, "autocast", lambda device: torch.autocast("cpu", dtype=torch.bfloat16))
        learner = copy.deepcopy(model)
        cfg, opt, guard = rl_setup(learner)
        m = train.rl_step(cfg, learner, None, opt, guard, batch, version=0)
        assert m["train/skipped"] == 0.0 and math.isfinite(m["train/loss"])
        grads[dtype] = torch.cat([p.grad.flatten() for p in learner.parameters() if p.grad is not None])
    cos = torch.nn.functional.cosine_similarity(grads["fp32"], grads["bf16"], dim=0)
    assert cos > 0.95, cos


# ----------------------------------------------------------------------------- end to end


def run_train(run_dir, *overrides, resume=False, wait=True):
    cmd = [sys.executable, "train.py", "--config", TINY, f"run_dir={run_dir}", *FAST, *overrides]
    if resume:
        cmd.append("--resume")
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


EXPECTED_STEPS = ([("dsa_warmup", s) for s in range(1, 3)] + [("sft", s) for s in range(1, 5)] +
                  [("rl", s) for s in range(0, 5)])


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("async"))
    run_train(run_dir, "rollout.max_staleness=1")
    return run_dir


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("sync"))
    run_train(run_dir, "rollout.max_staleness=0")
    return run_dir


def test_metrics_one_line_per_step(async_run):
    rows = metrics(async_run)
    assert [(r["stage"], r["step"]) for r in rows] == EXPECTED_STEPS
    rl = [r for r in rows if r["stage"] == "rl"]
    assert [r["step"] for r in rl if "eval/accuracy" in r] == [0, 2, 4]
    for r in rl[1:]:
        for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/lr", "train/clip_frac_high", "rollout/reward",
                    "rollout/response_len", "staleness/max", "staleness/dropped", "perf/tokens_per_s",
                    "perf/generator_idle", "perf/learner_wait_s", "time/elapsed_s"):
            assert key in r, key
    assert [r["global_step"] for r in rows] == [1, 2, 3, 4, 5, 6, 6, 7, 8, 9, 10]


@pytest.mark.parametrize("which, bound", [("sync_run", 0), ("async_run", 1)])
def test_staleness_never_exceeds_the_bound(which, bound, request):
    rl = [r for r in metrics(request.getfixturevalue(which)) if r["stage"] == "rl" and r["step"] > 0]
    assert all(r["staleness/max"] <= bound and r["staleness/dropped"] == 0 for r in rl)
    if bound == 1:  # batch 1 is generated while step 0 trains: the async path really ran ahead
        assert max(r["staleness/max"] for r in rl) == 1


def test_sync_mode_is_on_policy(sync_run):
    rl = [r for r in metrics(sync_run) if r["stage"] == "rl" and r["step"] > 0]
    assert all(r["train/logp_diff_max"] < 1e-4 for r in rl)


def test_checkpoints_are_model_directories(async_run):
    ckpts = train.checkpoints(async_run)
    assert [os.path.basename(c) for c in ckpts] == ["step_000002", "step_000004", "step_000006", "step_000008", "step_000010"]
    model = GLM.from_pretrained(ckpts[-1])
    assert model.cfg.dsa is not None and model.cfg.dsa.topk == 8
    state = torch.load(os.path.join(ckpts[-1], "state.pt"), weights_only=False)
    assert (state["stage"], state["step"], state["global_step"]) == ("rl", 4, 10)
    assert state["ranks"][0]["stream"]["position"] == 4 * 4  # 4 RL batches of 4 prompts consumed
    assert os.path.isfile(os.path.join(ckpts[-1], "tokenizer.json"))
    assert not [d for d in os.listdir(os.path.join(async_run, "checkpoints")) if d.startswith(".")]


def test_fresh_run_refuses_an_existing_run_dir(async_run):
    p = subprocess.run([sys.executable, "train.py", f"run_dir={async_run}"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode != 0 and "already holds a run; pass --resume" in p.stderr


def wait_for(cond, proc, timeout=120):
    deadline = time.time() + timeout
    while not cond():
        assert proc.poll() is None, f"run ended early: {proc.stderr.read()[-2000:]}"
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


def test_resume_after_kill_continues_exactly(sync_run, tmp_path):
    """SIGKILL right after the first checkpoint, --resume, and the run ends as if never stopped:
    same (stage, step) sequence with nothing repeated or skipped, and, in synchronous mode where
    everything is seeded, the same losses and eval numbers."""
    run_dir = str(tmp_path / "killed")
    proc = run_train(run_dir, "rollout.max_staleness=0", wait=False)
    wait_for(lambda: train.checkpoints(run_dir), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        assert len(f.readlines()) < len(EXPECTED_STEPS)  # killed mid-run (its last line may be cut short)
    run_train(run_dir, "rollout.max_staleness=0", resume=True)
    got, want = metrics(run_dir), metrics(sync_run)
    assert [(r["stage"], r["step"]) for r in got] == EXPECTED_STEPS
    for a, b in zip(got, want):
        for key in ("train/loss", "train/indexer_kl", "rollout/reward", "eval/accuracy", "train/grad_norm"):
            assert (key in a) == (key in b)
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["stage"], a["step"], key)
    state = torch.load(os.path.join(train.checkpoints(run_dir)[-1], "state.pt"), weights_only=False)
    assert state["ranks"][0]["stream"] == torch.load(os.path.join(train.checkpoints(sync_run)[-1], "state.pt"),
                                                     weights_only=False)["ranks"][0]["stream"]


def test_ctrl_c_stops_cleanly(tmp_path):
    run_dir = str(tmp_path / "interrupted")
    proc = run_train(run_dir, "train.rl_steps=1000", "train.eval_every=0", "train.save_every=1000", wait=False)
    wait_for(lambda: os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and
             any(r["stage"] == "rl" and r["step"] > 1 for r in metrics(run_dir)), proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)  # the generator thread was stopped and joined
    assert proc.returncode == 1 and "interrupted; continue with" in err
    assert not [d for d in os.listdir(os.path.join(run_dir, "checkpoints")) if d.startswith(".")]
    for line in open(os.path.join(run_dir, "metrics.jsonl")):
        json.loads(line)  # no half-written line


def test_a_blown_up_run_stops_with_one_line_and_clean_checkpoints(tmp_path):
    """optim.lr=1e4: the weights overflow within a few RL steps. The run must end with one line naming
    what was non-finite (no traceback), and no checkpoint may hold a non-finite tensor."""
    run_dir = str(tmp_path / "blown")
    cmd = [sys.executable, "train.py", "--config", TINY, f"run_dir={run_dir}", *FAST, "optim.lr=1e4",
           "train.rl_steps=30", "train.save_every=1"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    last = p.stderr.strip().splitlines()[-1] if p.returncode else ""
    if p.returncode:  # stopped: one line, no traceback
        assert last.startswith("error:") and ("non-finite" in last or "not finite" in last), p.stderr[-2000:]
        assert "Traceback" not in p.stderr
    rows = [r for r in metrics(run_dir) if r["stage"] == "rl"]
    assert any(r.get("train/skipped") for r in rows) or p.returncode  # skipped steps are counted
    for ckpt in train.checkpoints(run_dir):
        for name, t in GLM.from_pretrained(ckpt).state_dict().items():
            assert torch.isfinite(t).all(), (ckpt, name)


def test_every_optional_path_runs(tmp_path):
    """KL loss with a frozen reference and the KL guard, TIS + IcePop + dual clip, entropy bonus,
    dynamic sampling, aborting instead of partial rollouts, token-mean."""
    run_dir = str(tmp_path / "options")
    run_train(run_dir, "grpo.kl_coef=0.01", "grpo.kl_guard=true", "grpo.kl_guard_threshold=1e-9", "grpo.tis_cap=2",
              "grpo.dual_clip=3", "grpo.entropy_coef=0.01", "grpo.agg=token-mean",
              "rollout.dynamic_sampling=true", "rollout.partial_rollout=false", "train.dsa_warmup_steps=0")
    rl = [r for r in metrics(run_dir) if r["stage"] == "rl" and r["step"] > 0]
    assert len(rl) == 4 and os.path.isfile(os.path.join(run_dir, "reference", "config.json"))
    assert all("train/kl" in r and "train/is_weight_mean" in r and "train/dual_clip_frac" in r for r in rl)
    assert rl[-1]["kl_guard/fired"] == 1.0 and rl[-1]["kl_guard/scale"] < 1.0  # any KL is above a 1e-9 threshold
    assert rl[-1]["train/lr"] == pytest.approx(5e-4 * rl[-1]["kl_guard/scale"])  # the guard brakes the lr
    assert all("train/logp_diff_max" in r and "train/mismatch_k3" in r and "train/icepop_masked_frac" in r for r in rl)


# ----------------------------------------------------------------------------- several processes
# torchrun with gloo on the CPU: the same code path as NCCL on GPUs, minus the kernels.

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]


def fixed_global_batch():
    """16 samples in 8 groups of 2 from a seeded engine: the same on every process."""
    tok = data.make_tiny_tokenizer()
    model = tiny_model()
    engine = TorchEngine(copy.deepcopy(model), max_batch=16)
    prompts = [data.render_prompt(tok, ex["prompt"]) for ex in data.synthetic_task(8, seed=1)]
    sampling = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=12, stop_token_ids=(1,))
    flat = [p for p in prompts for _ in range(2)]
    comps = engine.generate(flat, sampling, seed=3)
    # Groups 6 and 7 come from an old version: dropped as stale at step 2, which leaves rank 1 of 2
    # (it owns them) with nothing to train on; it must still take part in every collective.
    versions = [(1, 1)] * 12 + [(0, 0)] * 4
    return model, [Sample(p, c.token_ids, c.logprobs, float((i * 7) % 3 == 0), i // 2, v, c.finish_reason, {})
                   for i, (p, c, v) in enumerate(zip(flat, comps, versions))]


def rl_steps_on_fixed_batch(parallel, agg):
    """Three RL steps (versions 0, 1, 2): rank r of W trains its share of the fixed global batch
    (uneven: rank 0 gets groups 0-5, rank 1 groups 6-7). Returns the final weights."""
    model, samples = fixed_global_batch()
    if train.world() > 1:
        owned = range(0, 12) if train.rank() == 0 else range(12, 16)
        samples = [samples[i] for i in owned]
    cfg = train.load_config(TINY, ["rollout.temperature=0.7", "rollout.max_staleness=1", f"grpo.agg={agg}",
                                   f"train.parallel={parallel}", "optim.max_tokens_per_micro_batch=40",
                                   "optim.warmup_steps=0", "optim.lr=0.5", "grpo.kl_coef=0.01"])
    for name, p in model.named_parameters():
        p.requires_grad_(".indexer." not in name)
    ref = copy.deepcopy(model).requires_grad_(False)
    learner = train.parallel_learner(cfg, model, torch.device("cpu"))
    if parallel == "fsdp":
        ref = train.parallel_learner(cfg, ref, torch.device("cpu"))
    # SGD, not AdamW: the key biases have a zero gradient in exact arithmetic (softmax ignores a shift
    # shared by all keys), and Adam would blow their float noise up to lr-sized steps.
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for version in range(3):
        batch = RolloutBatch(samples, index=version, stream_state={}, metrics={})
        m = train.rl_step(cfg, learner, ref, opt, grpo.KLGuard(), batch, version)
    assert m["train/samples"] == (0 if train.rank() == 1 else 12)  # step 2: rank 1 had only stale samples
    return {k: v.clone() for k, v in train.full_weights(learner)}


@pytest.mark.parametrize("parallel, agg", [("fsdp", "seq-mean-token-mean"), ("ddp", "token-mean")])
def test_two_processes_match_one_on_the_same_global_batch(parallel, agg, tmp_path):
    out = str(tmp_path / "weights.pt")
    p = subprocess.run([*TORCHRUN, "tests/test_train.py", out, parallel, agg], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=os.environ | {"PYTHONPATH": ROOT})  # the worker imports train
    assert p.returncode == 0, p.stderr[-3000:]
    two = torch.load(out)
    one = rl_steps_on_fixed_batch(parallel, agg)
    start = dict(fixed_global_batch()[0].named_parameters())
    assert any((one[k] - start[k]).abs().max() > 1e-3 for k in one)  # the steps really moved the weights
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=1e-4, atol=1e-6, msg=k)


def run_procs(run_dir, *overrides, resume=False, launcher="self"):
    """train.py on 2 processes, started by train.py itself (train.pairs=2) or by torchrun."""
    args = ["--config", TINY, f"run_dir={run_dir}", *FAST, "rollout.max_staleness=0", *overrides]
    cmd = ([sys.executable, "train.py", *args, "train.pairs=2"] if launcher == "self" else
           [*TORCHRUN, "train.py", *args])
    p = subprocess.run(cmd + (["--resume"] if resume else []), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


@pytest.fixture(scope="module")
def two_proc_run(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("two"))
    run_procs(run_dir, "train.parallel=fsdp")
    return run_dir


def test_two_processes_warm_up_like_one(two_proc_run, sync_run):
    """The warm-up stages split one global batch over the ranks: the losses, gradient norms and the
    weights at the end of SFT are those of one process (float tolerance)."""
    got, want = metrics(two_proc_run), metrics(sync_run)
    assert [(r["stage"], r["step"]) for r in got] == EXPECTED_STEPS
    for a, b in zip(got[:6], want[:6]):
        for key in ("train/loss", "train/indexer_kl", "train/grad_norm"):
            assert (key in a) == (key in b)
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), (a["stage"], a["step"], key)
    sft_end = [os.path.join(d, "checkpoints", "step_000006") for d in (two_proc_run, sync_run)]
    a, b = (dict(GLM.from_pretrained(d).named_parameters()) for d in sft_end)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)
    state = torch.load(os.path.join(train.checkpoints(two_proc_run)[-1], "state.pt"), weights_only=False)
    assert len(state["ranks"]) == 2 and all(r["stream"]["position"] == 4 * 2 for r in state["ranks"])  # 2 prompts/rank/step
    rl = [r for r in got if r["stage"] == "rl" and r["step"] > 0]
    assert all(r["train/samples"] == 16 and r["perf/publish_s"] >= 0 for r in rl)  # both ranks' 8 samples


def test_two_processes_resume_exactly(two_proc_run, tmp_path):
    """Stop 2 processes (torchrun) after RL step 2, resume with torchrun: the run ends as the
    uninterrupted one did (per-rank data positions and RNGs restored, FSDP optimizer state reloaded)."""
    run_dir = str(tmp_path / "resumed")
    run_procs(run_dir, "train.parallel=fsdp", "train.rl_steps=2", launcher="torchrun")
    run_procs(run_dir, "train.parallel=fsdp", resume=True, launcher="torchrun")
    got, want = metrics(run_dir), metrics(two_proc_run)
    assert [(r["stage"], r["step"]) for r in got] == EXPECTED_STEPS
    for a, b in zip(got, want):
        for key in ("train/loss", "rollout/reward", "eval/accuracy", "train/grad_norm", "train/pg_loss"):
            assert (key in a) == (key in b)
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["stage"], a["step"], key)
    a, b = (dict(GLM.from_pretrained(train.checkpoints(d)[-1]).named_parameters()) for d in (run_dir, two_proc_run))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)


def test_resume_needs_the_same_number_of_processes(two_proc_run, tmp_path):
    run_dir = str(tmp_path / "copy")
    shutil.copytree(two_proc_run, run_dir)
    p = subprocess.run([sys.executable, "train.py", "--config", TINY, f"run_dir={run_dir}", *FAST, "--resume"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "written by 2 processes; resume it with as many (this run has 1)" in p.stderr


if __name__ == "__main__":  # the torchrun worker of test_two_processes_match_one_on_the_same_global_batch
    torch.distributed.init_process_group("gloo")
    torch.set_num_threads(1)
    weights = rl_steps_on_fixed_batch(sys.argv[2], sys.argv[3])
    if train.rank() == 0:
        torch.save(weights, sys.argv[1])
    torch.distributed.destroy_process_group()
