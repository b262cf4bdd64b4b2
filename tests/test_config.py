"""Tests for config.py: loading YAML + overrides, one-line errors naming the key, every value checked
against its domain, the recipes stating only what differs from the documented defaults, what --resume
may change, and the dry-run memory plan."""
import glob
import os
import re
import subprocess
import sys
from dataclasses import fields

import pytest
import yaml

from machinery import config
from machinery.config import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
GLM9B = os.path.join(ROOT, "configs", "glm9b_math.yaml")
DICT_KEYS = {"model.init", "model.dsa", "model.lora", "data.eval", "data.env_args"}  # free-form mappings, checked by
# GLMConfig / DSAConfig / LoRAConfig / eval_sets / the env's setup()


def write_yaml(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


def test_unknown_key_names_key_and_suggestion(tmp_path):
    path = write_yaml(tmp_path, "model:\n  init: {hidden_size: 8}\nrollout:\n  temprature: 0.5\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"{path}: unknown key rollout.temprature (did you mean rollout.temperature?)"
    with pytest.raises(ConfigError, match=r"^command line: unknown key optim\.lrr \(did you mean optim\.lr\?\)$"):
        load_config(TINY, ["optim.lrr=0.1"])
    with pytest.raises(ConfigError, match="unknown key zzz_qqq$"):  # nothing close: no suggestion
        load_config(TINY, ["zzz_qqq=1"])
    with pytest.raises(ConfigError, match=r"unknown key model\.init\.hiden_size \(did you mean model\.init\.hidden_size\?\)"):
        load_config(TINY, ["model.init.hiden_size=8"])


@pytest.mark.parametrize("override, message", [
    ("rollout.n=abc", "rollout.n must be int, got 'abc'"),
    ("rollout.n=true", "rollout.n must be int, got True"),
    ("rollout.n=2.5", "rollout.n must be int, got 2.5"),
    ("rollout.temperature=hot", "rollout.temperature must be float, got 'hot'"),
    ("rollout.chat_template=1", "rollout.chat_template must be bool, got 1"),
    ("model.path=3", "model.path must be str or null, got 3"),
    ("optim.betas=0.9", "optim.betas must be list, got 0.9"),
    ("rollout=3", "rollout must be a mapping of keys, got 3"),
    ("rollout.n.x=3", "rollout.n must be int, got {'x': 3}"),
    ("rollout.temperature=0", "rollout.temperature must be a finite number > 0, got 0.0"),
    # every numeric key against its domain, at start-up (these used to pass, or to fail hours later in AdamW)
    ("optim.grad_clip=-1", "optim.grad_clip must be a finite number > 0, got -1.0"),
    ("optim.lr=-1e-3", "optim.lr must be a finite number > 0, got -0.001"),
    ("optim.lr=.nan", "optim.lr must be a finite number > 0, got nan"),
    ("optim.sft_lr=.inf", "optim.sft_lr must be a finite number > 0, got inf"),
    ("optim.betas=[0.9,1.5]", "optim.betas must be [beta1, beta2], each in [0, 1), got [0.9, 1.5]"),
    ("optim.weight_decay=-0.1", "optim.weight_decay must be a finite number >= 0"),
    ("grpo.eps_low=-3", "grpo.eps_low must be in [0, 1), got -3.0"),
    ("grpo.eps_high=-0.1", "grpo.eps_high must be a finite number >= 0"),
    ("grpo.dual_clip=0.5", "grpo.dual_clip must be > 1 (or null)"),
    ("grpo.kl_guard_factor=2", "grpo.kl_guard_factor must be in (0, 1]"),
    ("data.train_size=0", "data.train_size must be >= 1 (or null: all), got 0"),
    ("train.eval_temperature=-1", "train.eval_temperature must be >= 0 (0: greedy) or null"),
    ("train.rl_steps=-1", "train.rl_steps must be >= 0"),
    ("rollout.max_batch=0", "rollout.max_batch must be >= 1"),
    ("rollout.prompts_per_step=3", "rollout.prompts_per_step (3) must divide evenly over train.pairs (2)"),
    ("rollout.max_new_tokens=64", "(96 tokens) must fit model.init.max_position_embeddings (64)"),
    ("data.eval={a/b: x.jsonl}", "data.eval must be a file or a mapping of set names to files"),
    ("data.eval={2024: x.jsonl}", "data.eval must be a file or a mapping of set names to files"),
    ("data.eval={aime: {path: a.jsonl, prompt_keys: problem}}",
     "unknown key data.eval.aime.prompt_keys (did you mean data.eval.aime.prompt_key?)"),
    ("data.eval={aime: {prompt_key: problem}}", "data.eval.aime needs a path (the set's file)"),
    ("data.eval={aime: {path: a.jsonl, label_key: null}}",
     "data.eval.aime.label_key must be a non-empty string, got None"),
    ("data.eval={path: a.jsonl, prompt_key: problem}",
     "data.eval: a set with its own keys is written {<name>: {path: file, prompt_key: ..., label_key: ...}}"),
    ("data.dedup=1", "data.dedup must be bool, got 1"),
    ("rollout.quantization=int4", "rollout.quantization must be fp8 or null, got 'int4'"),
    ("distill.quantization=int8", "distill.quantization must be fp8 or null, got 'int8'"),
    ("distill.coef=0", "distill.coef must be a finite number > 0, got 0"),
    ("distill.outcome=maybe", "distill.outcome must be bool"),
    ("distill.teachr=x", "unknown key distill.teachr (did you mean distill.teacher?)"),
    (["distill.teacher=/x", "rollout.engine=sglang"], "distill.teacher needs rollout.engine: torch"),
    ("grpo.agg=mean", "grpo.agg must be one of"),
    ("grpo.old_logp=recompute", "grpo.old_logp was removed: pi_old is now the learner's own forward"),
    ("rollout.top_p=0.9", "rollout.top_p was removed: RL samples from the full tempered distribution"),
    ("grpo.icepop_beta=0.5", "grpo.icepop_beta must be > 1"),
    ("grpo.tis_cap=0", "grpo.tis_cap must be > 0"),
    ("grpo.kl_estimator=k9", "grpo.kl_estimator must be one of"),
    ("optim.max_skipped_steps=0", "optim.max_skipped_steps must be >= 1"),
    ("model.path=/some/dir", "set exactly one of model.path and model.init"),
    ("model.init.vocab_size=10", "model.init must not set ['vocab_size']"),
    ("model.init.num_kv_heads=3", "num_heads (4) must be a multiple of num_kv_heads (3)"),
    ("model.dsa.pattern=SF", "dsa.pattern must be a string of F/S starting with F"),
    ("model.dsa.top_k=8", "unknown dsa key(s) ['top_k']"),
    ("rollout.truncated=drop", "rollout.truncated must be keep or zero or mask, got 'drop'"),
    ("grpo.surrogate=ppo", "grpo.surrogate must be clip or dis, got 'ppo'"),
    ("grpo.surrogate=dis", "grpo.surrogate: dis is its own off-policy correction: set grpo.icepop_beta: null and "
                           "grpo.tis_cap: null (they are 2.0 and None)"),
    ("rollout.max_total_tokens=60", "(92 tokens) must fit model.init.max_position_embeddings (64)"),
    ("rollout.max_failure_fraction=1.5", "rollout.max_failure_fraction must be in [0, 1], got 1.5"),
    ("rollout.env_timeout_s=0", "rollout.env_timeout_s must be a finite number > 0"),
    ("rollout.n=1", "rollout.n must be >= 2, got 1: a group of one has no baseline (every advantage is 0)"),
])
def test_bad_values_fail_with_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ([override] if isinstance(override, str) else override)
                    + (["train.pairs=2"] if "pairs" in message else []))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_eval_sets_with_their_own_keys_and_answer_line():
    cfg = load_config(TINY, ["data.eval={aime: {path: aime.parquet, prompt_key: problem, label_key: answer}, "
                             "syn: synthetic}", "data.answer_line=true", "data.dedup=true"])
    assert config.eval_sets(cfg) == {"aime": {"path": "aime.parquet", "prompt_key": "problem", "label_key": "answer"},
                                     "syn": "synthetic"}
    assert cfg.data.answer_line and cfg.data.dedup and "data.dedup" not in config.SAFE_ON_RESUME  # the data changes
    for override, why in [("data.reward=my_rewards:f", "data.reward is 'my_rewards:f'"),
                          ("data.env=machinery.env:Calculator", "data.env is 'machinery.env:Calculator': the env grades")]:
        with pytest.raises(ConfigError) as e:  # a key that would be ignored is an error
            load_config(TINY, ["data.answer_line=true", override])
        assert str(e.value) == (f"{TINY} + command line: data.answer_line is read by the built-in grader only "
                                f"(data.reward: data:math_reward, no data.env), but {why}, so it would be ignored")


def test_overrides_and_yaml_number_forms(tmp_path):
    cfg = load_config(TINY, ["run_dir=/tmp/x", "optim.lr=1e-6", "rollout.temperature=1", "model.init.num_layers=5",
                                   "grpo.tis_cap=2", "grpo.icepop_beta=null", "optim.betas=[0.8, 0.9]"])
    assert cfg.run_dir == "/tmp/x"
    assert cfg.optim.lr == 1e-6 and isinstance(cfg.optim.lr, float)  # YAML reads "1e-6" as a string
    assert cfg.rollout.temperature == 1.0 and isinstance(cfg.rollout.temperature, float)
    assert cfg.model.init["num_layers"] == 5 and cfg.model.init["hidden_size"] == 96  # the rest of init kept
    assert cfg.grpo.tis_cap == 2.0 and cfg.grpo.icepop_beta is None and cfg.optim.betas == [0.8, 0.9]
    assert load_config(write_yaml(tmp_path, "model: {init: {}}\n")).rollout.n == 8  # defaults fill in


def yaml_keys(d, prefix=""):
    keys = []
    for k, v in d.items():
        name = prefix + k
        keys += yaml_keys(v, name + ".") if isinstance(v, dict) and name not in DICT_KEYS else [name]
    return keys


@pytest.mark.parametrize("path", [TINY, GLM9B])
def test_recipes_state_only_what_differs_from_the_defaults(path):
    """One home for defaults: config.py. A recipe key equal to its default would be a second statement
    of it (free to drift from the first)."""
    with open(path) as f:
        raw = yaml.safe_load(f)
    defaults = config.Config()
    for key in yaml_keys(raw):
        assert key in config.config_keys(), f"{path}: {key} is not a config key"
        value = config.get(load_config(path), key)
        assert value != config.get(defaults, key), f"{path}: {key}: {value!r} is the default; state it once, in config.py"
    assert load_config(path).run_dir == os.path.join("runs", os.path.basename(path)[:-5])  # null: runs/<recipe>


def test_every_key_has_its_default_documented_once():
    """Every field of config.py's dataclasses (and grpo.GRPOConfig, the objective's own) carries a comment:
    on its line, or on the lines just above it."""
    for cls in (config.ModelConfig, config.DataConfig, config.RolloutConfig, config.OptimConfig, config.TrainConfig,
                config.Config, config.GRPOConfig):
        src = open(os.path.join(ROOT, cls.__module__.replace(".", os.sep) + ".py")).read().splitlines()
        body = src[next(i for i, line in enumerate(src) if line.startswith(f"class {cls.__name__}")):]
        for f in fields(cls):
            i = next(i for i, line in enumerate(body) if re.match(rf"\s+{f.name}:", line))
            assert "#" in body[i] or body[i - 1].strip().startswith("#"), f"{cls.__name__}.{f.name} has no comment"


def test_every_key_is_read():
    """Every key is read somewhere outside config.py's own definitions (the stages, the engine, the
    objective, the plumbing)."""
    files = ["train.py", "grpo.py", "data.py", "rollout.py"] + glob.glob(os.path.join(ROOT, "machinery", "*.py"))
    src = "".join(open(os.path.join(ROOT, n)).read() for n in files if not n.endswith(os.path.join("machinery", "config.py")))
    src += "".join(line for line in open(os.path.join(ROOT, "machinery", "config.py"))
                   if not re.match(r"\s+\w+: [\w |]+ = ", line))
    for key in config.config_keys():
        assert re.search(rf"\.{key.rpartition('.')[2]}\b", src), f"nothing reads {key}"


def test_glm9b_recipe_numbers():
    cfg = load_config(GLM9B)
    r, g, o, t = cfg.rollout, cfg.grpo, cfg.optim, cfg.train
    assert cfg.model.path.endswith("GLM-Z1-9B-0414") and cfg.data.train.endswith("dapo-math-17k.jsonl")
    assert (r.prompts_per_step, r.n, r.temperature, r.max_new_tokens) == (32, 8, 1.0, 8192)
    assert (g.eps_low, g.eps_high, g.agg, g.kl_coef, g.icepop_beta) == (0.2, 0.28, "seq-mean-token-mean", 0.0, 2.0)
    assert (o.lr, o.weight_decay, o.betas, o.max_tokens_per_micro_batch) == (1e-6, 0.1, [0.9, 0.98], 16384)
    assert (t.eval_every, t.eval_n, t.eval_max_new_tokens) == (20, 16, 16384)


def dry_run(capsys, *argv):
    """train.py --dry-run in this process: (stdout, the one-line error or None)."""
    from machinery import checkpoint
    import train
    try:
        checkpoint.run_main(lambda: train.main(["--dry-run", *argv]))
        error = None
    except SystemExit as e:
        error = str(e.code)
    return capsys.readouterr().out, error


def test_dry_run_prints_the_9b_memory_plan(capsys):
    out, error = dry_run(capsys, "--config", GLM9B)
    assert error is None and "9.40B parameters" in out and "learner GPU (fsdp over 4)" in out
    assert out.count("fits in 74.5 GiB") == 2  # learner and generator
    out, error = dry_run(capsys, "--config", GLM9B, "train.parallel=ddp")
    assert "does NOT fit" in out
    assert error.startswith("error: does not fit on H100s: learner GPU (ddp over 4)") and "train.parallel: fsdp" in error


def test_the_one_gpu_recipe_plans_each_phase(capsys):
    """configs/glm9b_math_1gpu.yaml: LoRA, co-located, on one H100. --dry-run shows each phase (load, generate, train,
    checkpoint) and the same recipe on 8 co-located GPUs with and without LoRA. The phases follow from the two halves'
    items: the base counts once (the engine shares it), the train phase is the learner's step alone (the engine's
    pool released), and offloading takes exactly the learner's masters and AdamW state out of the generate phase."""
    out, error = dry_run(capsys, "--config", os.path.join(ROOT, "configs", "glm9b_math_1gpu.yaml"))
    assert error is None and "1 co-located GPU(s)" in out
    for phase in ("load:", "generate:", "train:", "checkpoint (and the first publish):", "with model.lora, ddp",
                  "without LoRA, fsdp"):
        assert phase in out, phase
    assert "does NOT fit" not in out.split("the same recipe on 8")[0]
    cfg = load_config(os.path.join(ROOT, "configs", "glm9b_math_1gpu.yaml"), [])
    assert cfg.train.colocate and cfg.model.lora == {} and cfg.rollout.max_staleness == 0
    kept, out_ = config.plan_memory(cfg, 1, offload=False), config.plan_memory(cfg, 1, offload=True)
    (_, _, load), (_, items, gen_kept), (_, _, train_b), _ = kept.phases()
    assert train_b == kept.learner_bytes()
    weights = [b for i, b in kept.generator if i.startswith("bf16 weights")][0]
    assert sum(b for i, b in items if "base" in i) == weights  # the base once: it is the engine's weights
    masters = sum(b for i, b in items if "masters" in i)  # the adapters' fp32 weights + AdamW: 12 bytes a parameter
    assert gen_kept == kept.generator_bytes() + masters and masters % 12 == 0
    assert gen_kept - out_.phases()[1][2] == masters == out_.settings["pinned_host"] > 0
    assert load == sum(b for _, b in kept.learner_load)  # the engine gets its weights at the first publish: none at load
    assert kept.learner_load[0] == ("bf16 weights", weights)  # LoRA with no warm-up: the base loads in bf16
    assert not config.colocate_offload(cfg, 1, config.H100_BYTES)  # the adapters' state fits: kept
    assert config.colocate_offload(cfg, 1)  # (on a CPU it always moves: the GPU's path, under test)
    assert config.colocate_offload(load_config(os.path.join(ROOT, "configs", "glm9b_math_1gpu.yaml"),
                                               ["model.lora=null", "train.parallel=fsdp"]), 8, config.H100_BYTES) is False


def test_colocate_settings_are_checked_in_one_line():
    for overrides, message in [(["train.colocate=true"], "rollout.max_staleness: 0"),
                               (["train.colocate=true", "rollout.max_staleness=0", "rollout.partial_rollout=true"],
                                "rollout.max_staleness: 0 and rollout.partial_rollout: false"),
                               (["train.colocate=true", "rollout.max_staleness=0", "rollout.engine=sglang"], "engine: torch"),
                               (["train.offload=true"], "train.offload is for train.colocate"),
                               (["train.colocate=true", "rollout.max_staleness=0", "train.generator_device=cpu"],
                                "alike")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(TINY, overrides)


def test_the_tool_recipe_plans_its_longest_trajectory():
    """configs/glm9b_tool_math.yaml: the plan counts 1024 prompt + 16384 trajectory tokens, in the generator's
    sequences and in the learner's micro-batch (one trajectory longer than the micro-batch budget is one alone)."""
    cfg = load_config(os.path.join(ROOT, "configs", "glm9b_tool_math.yaml"), [])
    assert cfg.data.env == "machinery.tools:PythonMath" and cfg.rollout.env_admit_after is None
    plan = config.plan_memory(cfg, cfg.train.pairs)
    text = plan.text(config.H100_BYTES)
    assert "prefill of 17408 packed tokens" in text and text.count("fits in 74.5 GiB") == 2
    shorter = config.plan_memory(load_config(os.path.join(ROOT, "configs", "glm9b_tool_math.yaml"),
                                             ["rollout.max_total_tokens=8192"]), cfg.train.pairs)
    assert shorter.text(config.H100_BYTES) != text  # the learner's micro-batch follows the trajectory's length


@pytest.mark.parametrize("name, tokens", [("glm9b_math", 17408), ("glm47flash_math", 17408), ("tiny_cpu", 4096)])
def test_the_engine_packs_the_prefill_its_plan_counts(name, tokens):
    """config.prefill_budget, what start-up hands make_engine: the tokens of one prefill forward are those the memory
    plan counts, the longest sequence (rollout.max_prompt_tokens + the longest response) or PREFILL_TOKENS."""
    cfg = load_config(os.path.join(ROOT, "configs", f"{name}.yaml"), [])
    assert config.prefill_budget(cfg) == tokens
    if name == "glm9b_math":
        assert f"prefill of {tokens} packed tokens" in config.plan_memory(cfg, cfg.train.pairs).text(config.H100_BYTES)


def test_lora_settings_are_checked_in_one_line(monkeypatch):
    """model.lora's own keys and values, and the combinations it cannot run, fail at load with one line."""
    assert load_config(TINY, ["model.lora={rank: 8, lr: 1.0e-4}"]).model.lora == {"rank": 8, "lr": 1.0e-4}
    for override, message in [("model.lora={rnk: 8}", "model.lora: .*rnk"),
                              ("model.lora={targets: [indexer]}", "model.lora: .*targets"),
                              ("model.lora={rank: 0}", "rank must be >= 1")]:
        with pytest.raises(ConfigError, match=message):
            load_config(TINY, [override])
    # the plan of a LoRA learner: a frozen bf16 base and fp32 adapters with their AdamW (DDP fits where full DDP cannot)
    full = config.plan_memory(load_config(GLM9B, ["train.parallel=ddp"]), 4).text(config.H100_BYTES)
    with_lora = config.plan_memory(load_config(GLM9B, ["train.parallel=ddp", "model.lora={}"]), 4).text(config.H100_BYTES)
    assert "does NOT fit" in full.split("generator GPU")[0] and "fits in" in with_lora.split("generator GPU")[0]
    assert "LoRA adapters rank 32 fp32" in with_lora and "LoRA adapters fp32, rank 32" in with_lora  # both sides
    for extra, message in [("rollout.quantization=fp8", "rollout.quantization: fp8 is not supported"),
                           ("rollout.engine=sglang", "needs rollout.engine: torch"),
                           ("train.pairs=2", "set train.parallel: ddp")]:
        with pytest.raises(ConfigError, match=message):
            load_config(TINY, ["model.lora={}", extra, "train.parallel=fsdp"])
    monkeypatch.setenv("WORLD_SIZE", "2")  # started by torchrun: as many processes, whatever train.pairs says
    with pytest.raises(ConfigError, match="set train.parallel: ddp"):
        load_config(TINY, ["model.lora={}", "train.parallel=fsdp"])


def test_sglang_engine_on_cpu_fails_before_training(tmp_path):
    """In this process (train.py's checkpoint.run_main around train.main: the one-line error is the exit message),
    which saves the seconds a new interpreter takes to import torch."""
    import torch
    import train
    from machinery import checkpoint
    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit) as e:
            checkpoint.run_main(lambda: train.main([f"run_dir={tmp_path / 'r'}", "rollout.engine=sglang"]))
    finally:
        torch.set_num_threads(threads)  # (train.main sets the run's thread count)
    assert str(e.value.code).startswith("error: rollout.engine: sglang runs on a CUDA")
    assert not os.path.exists(tmp_path / "r" / "metrics.jsonl")  # nothing trained


def test_cli_config_error_is_one_line():
    p = subprocess.run([sys.executable, "train.py", "rollout.temprature=1"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode != 0
    assert p.stderr.strip().splitlines() == [
        "error: command line: unknown key rollout.temprature (did you mean rollout.temperature?)"]




def test_model_paths_are_checked_before_any_work(tmp_path):
    cfg = load_config(TINY, [f"run_dir={tmp_path}", "model.init=null", f"model.path={tmp_path}"])
    with pytest.raises(ConfigError, match=rf"^model.path: {tmp_path} has no config.json$"):
        config.check_paths(cfg)  # an empty directory: not transformers' advice to install sentencepiece
    cfg.model.path = str(tmp_path / "missing")
    with pytest.raises(ConfigError, match="is neither a directory nor a Hub id"):
        config.check_paths(cfg)
    cfg = load_config(TINY, [f"run_dir={tmp_path}", f"model.tokenizer={tmp_path}"])
    with pytest.raises(ConfigError, match="model.tokenizer: .* has no tokenizer_config.json"):
        config.check_paths(cfg)


# ----------------------------------------------------------------------------- MoE: routing replay, the MoE recipes

TINY_MOE = os.path.join(ROOT, "configs", "tiny_moe_cpu.yaml")
FLASH = os.path.join(ROOT, "configs", "glm47flash_math.yaml")


def test_routing_replay_takes_rollout_or_none_and_names_the_key_otherwise():
    assert load_config(TINY_MOE).model.routing_replay == "rollout"  # the default: replay the generator's experts
    assert load_config(TINY_MOE, ["model.routing_replay=none"]).model.routing_replay == "none"
    assert load_config(TINY_MOE, ["model.routing_replay=rollout"]).model.routing_replay == "rollout"
    for bad, message in (("replay", "model.routing_replay must be rollout or none, got 'replay'"),
                         ("Rollout", "model.routing_replay must be rollout or none, got 'Rollout'"),
                         ("true", "model.routing_replay must be str, got True"),
                         ("null", "model.routing_replay must be str, got None")):
        with pytest.raises(ConfigError) as e:
            load_config(TINY_MOE, [f"model.routing_replay={bad}"])
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_sglang_with_an_moe_model_is_refused_in_one_line(capsys):
    """rollout.engine: sglang serves dense checkpoints (no routes, no MLA): with an MoE model.init the plan refuses it
    in one line naming the engine and the model, before any work (--dry-run too); a dense model still plans there."""
    cfg = load_config(TINY_MOE, ["rollout.engine=sglang"])
    with pytest.raises(ConfigError) as e:
        config.plan_memory(cfg, 1)
    assert str(e.value).startswith("rollout.engine: sglang") and "glm_moe_dsa" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="^rollout.engine: sglang"):
        config.check_memory(cfg, 1)
    out, error = dry_run(capsys, "--config", TINY_MOE, "rollout.engine=sglang")
    assert error == f"error: {e.value}" and "memory plan" not in out
    assert config.plan_memory(load_config(TINY, ["rollout.engine=sglang"]), 1).settings["engine"] == "sglang"


def test_the_tiny_moe_recipe_loads_and_plans():
    """configs/tiny_moe_cpu.yaml: a glm_moe_dsa-shaped model.init (MLA, MoE top-2 of 8 after a dense layer, DSA F S F)
    that plans on the default layout, with each KV slot's routes and the learner's replayed routes counted; it
    states only what differs from the defaults."""
    cfg = load_config(TINY_MOE)
    arch = config.architecture(cfg)
    assert arch.model_type == "glm_moe_dsa" and arch.mla.kv_lora_rank == 32 and arch.dsa.layer_kinds(3) == "FSF"
    assert (arch.moe.n_routed_experts, arch.moe.num_experts_per_tok, arch.moe_layers) == (8, 2, [1, 2])
    config.check_memory(cfg, cfg.train.pairs)  # fits
    plan = config.plan_memory(cfg, cfg.train.pairs)
    assert any(i.startswith("MoE routes [n_moe, T, k]") for i, _ in plan.learner)
    assert any("each slot's routes (4 B)" in i for i, _ in plan.generator)  # 2 MoE layers x top-2, uint8
    test_recipes_state_only_what_differs_from_the_defaults(TINY_MOE)


def test_the_glm47flash_recipe_loads_and_its_plan_fits_on_h100s():
    """configs/glm47flash_math.yaml plans with no download (config.PUBLISHED's GLM-4.7-Flash: glm4_moe_lite, 47 layers,
    30.59B parameters with its MTP layer, kept), co-located on 8 H100s, every phase within 74.5 GiB (check_memory's verdict:
    the adapters' state offloaded while the engine generates, as colocate_offload chooses: kept, the generate phase would
    need 74.5 GiB and a few MiB more); it states only what differs from the defaults."""
    cfg = load_config(FLASH)
    assert cfg.model.path == "zai-org/GLM-4.7-Flash" and cfg.model.routing_replay == "rollout" and cfg.train.colocate
    arch = config.architecture(cfg)
    assert (arch.model_type, arch.num_layers, arch.dsa, len(arch.moe_layers)) == ("glm4_moe_lite", 47, None, 46)
    offload = config.colocate_offload(cfg, cfg.train.pairs, config.H100_BYTES)
    assert offload and config.plan_memory(cfg, cfg.train.pairs, offload=False).problems(config.H100_BYTES)
    plan = config.plan_memory(cfg, cfg.train.pairs, offload=offload)
    assert f"{plan.params / 1e9:.2f}" == "30.59" and arch.mtp_layers == 1
    assert plan.problems(config.H100_BYTES) == [] and max(b for _, _, b in plan.phases()) <= config.H100_BYTES
    test_recipes_state_only_what_differs_from_the_defaults(FLASH)
