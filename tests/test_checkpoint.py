"""Tests for checkpoint.py: atomic writes that survive a full disk, init_model/ rebuilt when its settings
change, resume falling back past a checkpoint it cannot read, the metrics log on a fresh start and on
resume (and its Weights & Biases run, offline), and the preemption message."""
import errno
import json
import os
import pathlib
import signal
import sys

import pytest
import torch

from machinery import checkpoint
from machinery import config
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


def wandb_records(run_dir):
    """Every record the offline wandb runs in run_dir wrote, read back with wandb's own protobuf. A .wandb file
    is a 7-byte header, then a LevelDB log: 32 KiB blocks of records, each with a 7-byte header (checksum,
    length, type: 1 whole, 2-4 first, middle, last piece). wandb 0.31 ships no Python reader of its own."""
    from wandb.proto import wandb_internal_pb2 as pb
    records = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):  # one directory per session
        data, pos, piece = path.read_bytes(), 7, b""
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # the end of a block too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            n, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
            piece, pos = piece + data[pos + 7:pos + 7 + n], pos + 7 + n
            if kind in (1, 4):
                records.append(pb.Record.FromString(piece))
                piece = b""
    return records


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """A config with train.wandb_project set, and wandb offline with all its files under tmp_path."""
    for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": tmp_path,
                       "WANDB_CACHE_DIR": tmp_path / "cache", "WANDB_CONFIG_DIR": tmp_path / "config",
                       "WANDB_DATA_DIR": tmp_path / "data"}.items():
        monkeypatch.setenv(key, str(value))
    run_dir = tmp_path / "r"
    run_dir.mkdir()  # train.py makes it before the MetricsLog
    return config.load_config(TINY, [f"run_dir={run_dir}", "train.wandb_project=test"])


def test_metrics_log_feeds_one_wandb_run_across_a_resume(wandb_offline):
    wandb = pytest.importorskip("wandb")  # CI installs it (the test extra)
    cfg, run_dir = wandb_offline, pathlib.Path(wandb_offline.run_dir)
    log = checkpoint.MetricsLog(cfg)
    for s in (1, 2, 3):  # sft step s is global step 20 + s (20 indexer warm-up steps)
        log.write("sft", s, {"train/loss": float(s), "note": "text"})
    log.finish()
    kept = json.loads((run_dir / "wandb_run.json").read_text())
    assert kept["project"] == "test" and kept["last_step"] == 23
    # Killed after step 3, resumed from the checkpoint at step 1: steps 2 and 3 are redone with other values
    log = checkpoint.MetricsLog(cfg, {"stage": "sft", "step": 1, "global_step": 21})
    for s in (2, 3, 4):
        log.write("sft", s, {"train/loss": 10.0 * s})
    log.finish()
    wandb.teardown()  # waits until wandb's service process has written everything out (files may lag finish())
    assert json.loads((run_dir / "wandb_run.json").read_text()) == kept | {"last_step": 24}
    records = wandb_records(run_dir)
    runs = [r.run for r in records if r.HasField("run")]
    assert [(r.run_id, r.project, r.display_name) for r in runs] == [(kept["id"], "test", "r")] * 2  # the same run
    assert any(u.key == "train" and json.loads(u.value_json)["wandb_project"] == "test" for u in runs[0].config.update)
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.HasField("history")]
    # Each step once: the redone steps keep their first values on the dashboard; metrics.jsonl has the redone ones
    assert [(h["_step"], h["train/loss"]) for h in history] == [(21, 1.0), (22, 2.0), (23, 3.0), (24, 40.0)]
    assert "note" not in history[0] and history[0]["time/elapsed_s"] >= 0
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["train/loss"] for row in lines] == [1.0, 20.0, 30.0, 40.0]


def test_metrics_log_without_wandb_installed_says_what_to_install(wandb_offline, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(config.ConfigError, match=r'wandb is not installed: pip install -e "\.\[wandb\]"'):
        checkpoint.MetricsLog(wandb_offline)


def test_preempted_says_how_to_continue():
    e = checkpoint.Preempted(signal.SIGTERM, "runs/x", "rl step 7")
    assert str(e) == ("stopped by SIGTERM after rl step 7, checkpoint saved; continue with: "
                      "python train.py --resume run_dir=runs/x")
