"""startup.py: what start-up hands an env's setup. The Python tool's sandbox must hide the run's own files (the
run_dir's checkpoints and rollout dumps hold every problem's label; the data files hold them too) wherever they
lie, not only inside the working directory that it hides by itself. The check of every example's opening through
the env keeps the run's own deadline."""
import os
import re
import sys
import threading
import time
import types

import rollout
from machinery import config, env, startup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_an_env_that_hides_paths_is_given_the_run_dir_and_the_local_data_files(tmp_path):
    train = tmp_path / "data" / "train.jsonl"
    train.parent.mkdir()
    train.write_text('{"prompt": "1+1=", "label": "2"}\n')
    cfg = config.load_config(os.path.join(ROOT, "configs", "glm9b_tool_math.yaml"),
                             [f"run_dir={tmp_path / 'run'}", f"data.train={train}", "data.env_args.hide=[/srv/extra]"])
    args = startup.env_args(cfg)
    assert args["hide"] == ["/srv/extra", str(tmp_path / "run"), str(train)]  # the recipe's own list kept first
    assert {k: v for k, v in args.items() if k != "hide"} == {k: v for k, v in cfg.data.env_args.items() if k != "hide"}


def test_an_env_without_hide_gets_its_args_unchanged(tmp_path):
    cfg = config.load_config(os.path.join(ROOT, "configs", "tiny_tool_cpu.yaml"), [f"run_dir={tmp_path / 'run'}"])
    assert startup.env_args(cfg) == dict(cfg.data.env_args or {})  # the calculator has no setup at all


def test_the_openings_check_waits_rollout_env_timeout_s_and_says_so(tmp_path):
    """Start-up renders every example's opening (reset()) through the env: an env whose reset never returns fails
    start-up with one line naming rollout.env_timeout_s's own value, after about that long (before: 60 s, whatever
    the key said, and the line named 60 s)."""
    never = threading.Event()

    class HangingReset:
        def __init__(self, example):
            self.example = example

        def reset(self):
            never.wait()

        def step(self, text):
            return [], 0.0, True

    sys.modules["hanging_reset_env"] = types.SimpleNamespace(HangingReset=HangingReset, __file__="hanging_reset_env.py")
    out = {}

    argv = ["--config", os.path.join(ROOT, "configs", "tiny_tool_cpu.yaml"), f"run_dir={tmp_path / 'run'}",
            "data.env=hanging_reset_env:HangingReset", "rollout.env_timeout_s=0.3", "data.train_size=200"]

    def start():
        try:
            startup.start(argv, "test", "train.py", None, rollout.single_turn)
        except config.ConfigError as e:
            out["error"] = str(e)

    try:
        t = threading.Thread(target=start, daemon=True)
        t.start()
        t.join(30)  # (a start-up that waits 60 s fails here)
        assert not t.is_alive(), "start-up still waiting for reset() after 30 s"
    finally:
        never.set()
        del sys.modules["hanging_reset_env"]
        deadline = time.perf_counter() + 5
        while (env.POOL.timeouts or env.POOL.lost) and time.perf_counter() < deadline:  # the calls return
            time.sleep(0.01)
    assert re.fullmatch(r'data.env: HangingReset.reset raised TimeoutError: no answer in 0.3 s '
                        r'\(rollout.env_timeout_s\) \(example \{"prompt": .*', out["error"])
