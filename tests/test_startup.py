"""startup.py: what start-up hands an env's setup. The Python tool's sandbox must hide the run's own files (the
run_dir's checkpoints and rollout dumps hold every problem's label; the data files hold them too) wherever they
lie, not only inside the working directory that it hides by itself."""
import os

from machinery import config, startup

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
