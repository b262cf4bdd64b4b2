"""Tests for checkpoint.py: atomic writes that survive a full disk, init_model/ rebuilt when its settings
change, resume falling back past a checkpoint it cannot read, the metrics log on a fresh start and on
resume, and the preemption message."""
import errno
import json
import os
import signal

import pytest
import torch

import checkpoint
import config
import data
from model import GLM, GLMConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")


def tiny():
    return GLM(GLMConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=8))


def test_a_full_disk_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    tok, path = data.make_tiny_tokenizer(), str(tmp_path / "step_000002")
    checkpoint.save_dir(path, tiny(), tok, state={"step": 1})
    before = sorted(os.listdir(path))

    def full(*args, **kwargs):  # what torch.save raises when the disk fills up halfway
        raise RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed: No space left on device")
    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError) as e:
        checkpoint.save_dir(path, tiny(), tok, state={"step": 2})
    assert e.value.errno == errno.ENOSPC and e.value.filename == path and e.value.strerror == "no space left on device"
    assert sorted(os.listdir(path)) == before  # the old one, whole
    assert os.listdir(tmp_path) == ["step_000002"]  # no temp directory left behind


def test_init_model_is_rebuilt_when_its_settings_change(tmp_path, capsys):
    run_dir = str(tmp_path)
    cfg = config.load_config(TINY, [f"run_dir={run_dir}"])
    out = checkpoint.starting_point(cfg, run_dir)
    assert GLM.from_pretrained(out).cfg.hidden_size == 96
    assert checkpoint.starting_point(cfg, run_dir) == out and "rebuilding" not in capsys.readouterr().out  # reused
    cfg = config.load_config(TINY, [f"run_dir={run_dir}", "model.init.hidden_size=128"])  # a retry with other settings
    checkpoint.starting_point(cfg, run_dir)
    assert "made from other settings: rebuilding it" in capsys.readouterr().out
    assert GLM.from_pretrained(out).cfg.hidden_size == 128


def test_resume_falls_back_past_an_unreadable_checkpoint(tmp_path, capsys):
    tok, root = data.make_tiny_tokenizer(), tmp_path / "checkpoints"
    models = {}
    for step in (2, 4):
        models[step] = tiny()
        checkpoint.save_dir(str(root / f"step_00000{step}"), models[step], tok, state={"step": step, "ranks": [{}]})
    with open(root / "step_000004" / "model.safetensors", "r+b") as f:  # a garbled latest checkpoint
        f.truncate(100)
    ckpt, state, model = checkpoint.load_latest(str(tmp_path), GLM.from_pretrained, processes=1)
    assert ckpt.endswith("step_000002") and state["step"] == 2
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), models[2].state_dict().values()))
    assert "step_000004 cannot be read" in capsys.readouterr().err
    (root / "step_000002" / "state.pt").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="no readable checkpoint"):
        checkpoint.load_latest(str(tmp_path), GLM.from_pretrained, processes=1)


def test_metrics_log_starts_fresh_or_cuts_at_the_checkpoint(tmp_path):
    cfg = config.load_config(TINY, [f"run_dir={tmp_path}"])
    path = tmp_path / "metrics.jsonl"
    rows = [{"stage": "sft", "step": s, "global_step": 20 + s} for s in range(1, 5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"stage": "sft", "st')  # the last line cut by a kill
    checkpoint.MetricsLog(cfg, {"stage": "sft", "step": 2, "global_step": 22})
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    checkpoint.MetricsLog(cfg, None)  # a fresh start (a run with no checkpoint yet): a new file
    assert path.read_text() == ""


def test_preempted_says_how_to_continue():
    e = checkpoint.Preempted(signal.SIGTERM, "runs/x", "rl step 7")
    assert str(e) == ("stopped by SIGTERM after rl step 7, checkpoint saved; continue with: "
                      "python train.py --resume run_dir=runs/x")
