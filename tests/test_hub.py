"""hub.py: Hub ids for the model and the data, against a local cache laid out as the Hub's (conftest.py sets
HF_HUB_OFFLINE=1: nothing reaches the network), and a whole run that starts from Hub ids and resumes pinned."""
import json
import os
import subprocess
import sys

import pytest
import yaml
from huggingface_hub import constants

from machinery import config
import data
from machinery import hub
from machinery.config import ConfigError
from model import GLM, GLMConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
SHA = "0123456789abcdef0123456789abcdef01234567"


def snapshot(cache, kind, repo, sha=SHA, ref="main"):
    """The folder huggingface_hub keeps a repo's files in: <cache>/<kind>s--owner--name/snapshots/<commit>/,
    with refs/<branch> naming the commit."""
    root = os.path.join(cache, f"{kind}s--{repo.replace('/', '--')}")
    os.makedirs(os.path.join(root, "refs"), exist_ok=True)
    with open(os.path.join(root, "refs", ref), "w") as f:
        f.write(sha)
    folder = os.path.join(root, "snapshots", sha)
    os.makedirs(folder, exist_ok=True)
    return folder


def write_jsonl(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A Hub cache with a tiny GLM model (weights and tokenizer) and a dataset of two splits."""
    cache = str(tmp_path / "hub")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache)
    tok = data.make_tiny_tokenizer()
    model = GLM(GLMConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=8, eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id))
    folder = snapshot(cache, "model", "owner/tiny-glm")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    rows = [{"prompt": ex["prompt"], "label": ex["label"]} for ex in data.synthetic_task(40, seed=0)]
    ds = snapshot(cache, "dataset", "owner/sums")
    write_jsonl(os.path.join(ds, "data", "train-00000-of-00002.jsonl"), rows[:16])
    write_jsonl(os.path.join(ds, "data", "train-00001-of-00002.jsonl"), rows[16:32])
    write_jsonl(os.path.join(ds, "test.jsonl"), rows[32:])
    return cache


def test_ids_and_local_paths(tmp_path):
    assert hub.model_id("zai-org/GLM-Z1-9B-0414") == ("zai-org/GLM-Z1-9B-0414", None)
    assert hub.model_id("zai-org/GLM-Z1-9B-0414@v1.0") == ("zai-org/GLM-Z1-9B-0414", "v1.0")
    assert hub.data_id("zhuzilin/dapo-math-17k/dapo-math-17k.jsonl") == ("zhuzilin/dapo-math-17k", None, "dapo-math-17k.jsonl", None)
    assert hub.data_id("o/n@abc:train") == ("o/n", "abc", None, "train")
    assert hub.data_id("o/n") is None and hub.model_id("a/b/c") is None  # a dataset needs its file or split
    (tmp_path / "o" / "n").mkdir(parents=True)
    os.chdir(tmp_path)
    assert hub.model_id("o/n") is None  # a local directory always wins
    os.chdir(ROOT)


def test_fetch_pins_the_commit_and_reads_splits(cache):
    cfg = config.load_config(TINY, ["model.init=null", "model.path=owner/tiny-glm", "data.train=owner/sums:train",
                                    "data.eval={heldout: owner/sums/test.jsonl}", "distill.teacher=owner/tiny-glm"])
    pins = hub.fetch(config.hub_specs(cfg))
    assert pins == {"model.path": f"owner/tiny-glm@{SHA}", "data.train": f"owner/sums@{SHA}:train",
                    "data.eval.heldout": f"owner/sums@{SHA}/test.jsonl", "distill.teacher": f"owner/tiny-glm@{SHA}"}
    hub.pin(cfg, pins)
    assert (cfg.model.path, cfg.data.train, cfg.data.eval) == (pins["model.path"], pins["data.train"],
                                                             {"heldout": pins["data.eval.heldout"]})
    assert cfg.distill.teacher == pins["distill.teacher"]
    assert config.architecture(cfg, "distill.teacher").num_layers == 2  # the teacher's cached config.json
    assert os.path.isfile(os.path.join(hub.model_dir(cfg.model.path), "config.json"))
    files = hub.data_files(cfg.data.train)
    assert [os.path.basename(f) for f in files] == ["train-00000-of-00002.jsonl", "train-00001-of-00002.jsonl"]
    config.check_paths(cfg)
    assert config.architecture(cfg).num_layers == 2  # the cached config.json
    for spec, name in (("owner/sums@abc/data/test.jsonl", "test"), ("owner/sums@abc:test", "sums-test")):
        cfg.data.eval = spec  # a single Hub eval set is named by its file or split, pinned or not
        assert config.eval_sets(cfg) == {name: spec}


@pytest.mark.parametrize("key, spec, message", [
    ("model.path", "owner/missing", "model.path: owner/missing: not in the local Hub cache"),
    ("model.path", "owner/tiny-glm@deadbeef", "model.path: owner/tiny-glm@deadbeef: not in the local Hub cache"),
    ("data.train", "owner/sums:validation", "data.train: owner/sums:validation: no file of split 'validation'"),
    ("data.train", "owner/sums/nope.jsonl", "data.train: owner/sums/nope.jsonl: no file nope.jsonl in dataset owner/sums"),
    ("distill.teacher", "owner/no-teacher", "distill.teacher: owner/no-teacher: not in the local Hub cache"),
])
def test_a_wrong_id_is_one_line_naming_it(cache, key, spec, message):
    cfg = config.load_config(TINY, ["model.init=null", "model.path=owner/tiny-glm", f"{key}={spec}"])
    with pytest.raises(ConfigError) as e:
        hub.fetch(config.hub_specs(cfg))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_dry_run_of_the_recipe_needs_no_download(cache, capsys):
    """config.PUBLISHED knows GLM-Z1-9B-0414: no file is fetched (offline here, and not in this cache)."""
    cfg = config.load_config(os.path.join(ROOT, "configs", "glm9b_math.yaml"))
    assert hub.model_id(cfg.model.path)
    config.check_memory(cfg, 4, title="recipe")
    assert "9.40B parameters" in capsys.readouterr().out
    distill = config.load_config(os.path.join(ROOT, "configs", "glm9b_distill.yaml"))  # its teacher too
    config.check_memory(distill, 4, title="distill")
    assert "distillation teacher's fp8 weights (32.6B parameters)" in capsys.readouterr().out
    cfg.model.path = "owner/unknown-model"  # anything else: its config.json, which offline is an error
    with pytest.raises(ConfigError, match="model.path: owner/unknown-model: not in the local Hub cache"):
        config.architecture(cfg)


def test_a_run_from_hub_ids_records_the_revision_and_resumes(cache, tmp_path):
    run_dir = str(tmp_path / "run")
    args = [sys.executable, "train.py", "--config", TINY, f"run_dir={run_dir}", "model.init=null",
            "model.path=owner/tiny-glm", "model.dsa=null", "data.train=owner/sums:train",
            "data.eval={sums: owner/sums/test.jsonl}", "train.dsa_warmup_steps=0", "train.sft_steps=0",
            "train.rl_steps=1", "rollout.prompts_per_step=2", "rollout.n=2", "train.eval_n=1", "data.eval_size=4",
            "rollout.max_new_tokens=8", "train.eval_max_new_tokens=8"]
    env = os.environ | {"HF_HUB_CACHE": cache, "HF_HUB_OFFLINE": "1"}
    p = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    saved = yaml.safe_load(open(os.path.join(run_dir, "config.yaml")))
    assert saved["model"]["path"] == f"owner/tiny-glm@{SHA}" and saved["data"]["train"] == f"owner/sums@{SHA}:train"
    assert saved["data"]["eval"] == {"sums": f"owner/sums@{SHA}/test.jsonl"}
    # The branch moves on; the run resumes from the commit it started with (a new one would not be in the cache)
    with open(os.path.join(cache, "models--owner--tiny-glm", "refs", "main"), "w") as f:
        f.write("f" * 40)
    p = subprocess.run([sys.executable, "train.py", "--resume", f"run_dir={run_dir}", "train.rl_steps=2"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in rows if r["stage"] == "rl"] == [0, 1, 2]


def test_two_processes_start_from_hub_ids(cache, tmp_path):
    """train.pairs=2: this process fetches, its two processes (started through torchrun's launcher) agree on rank
    0's pinned commits through parallel.once_per_machine and read the cache only."""
    run_dir = str(tmp_path / "two")
    args = [sys.executable, "train.py", "--config", TINY, f"run_dir={run_dir}", "model.init=null", "train.pairs=2",
            "model.path=owner/tiny-glm", "model.dsa=null", "data.train=owner/sums:train", "data.eval=owner/sums/test.jsonl",
            "train.dsa_warmup_steps=0", "train.sft_steps=0", "train.rl_steps=1", "rollout.prompts_per_step=2",
            "rollout.n=2", "train.eval_n=1", "data.eval_size=4", "rollout.max_new_tokens=8", "train.eval_max_new_tokens=8"]
    env = os.environ | {"HF_HUB_CACHE": cache, "HF_HUB_OFFLINE": "1"}
    p = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    saved = yaml.safe_load(open(os.path.join(run_dir, "config.yaml")))
    assert saved["model"]["path"] == f"owner/tiny-glm@{SHA}" and saved["data"]["eval"] == f"owner/sums@{SHA}/test.jsonl"
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in rows if r["stage"] == "rl"] == [0, 1] and "eval/test/accuracy" in rows[0]
