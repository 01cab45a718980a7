"""Commands that write nothing under a run (export, inspect_data, regenerate, prepare) leave no
``outputs/runs/<time>/`` directory and no Hydra log file behind; evaluate, which writes its
results under the run directory, still gets one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from eagleforge.config import conf_dir, register_configs

pytestmark = pytest.mark.unit

# Each stops with a user error (exit 2) after Hydra has set up its job, which is where the run
# directory, .hydra/ and <command>.log used to be written.
FAILING_COMMANDS = {
    "export": [],  # export.draft is not set
    "inspect_data": ["data=chitchat"],  # no +model
    "regenerate": ["data=chitchat"],
    "prepare": ["data=chitchat"],
}


@pytest.mark.parametrize("command", sorted(FAILING_COMMANDS))
def test_commands_that_write_no_run_leave_no_run_dir(command: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", f"eagleforge.{command}", *FAILING_COMMANDS[command]],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and done.stderr.startswith("error: "), done.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_export_check_leaves_nothing(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "eagleforge.export", "--check", str(tmp_path / "missing")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1 and "no such directory" in done.stdout
    assert list(tmp_path.iterdir()) == []


def test_the_run_config_still_has_a_run_dir_and_its_log() -> None:
    """train and evaluate (config.yaml) keep outputs/runs/<time>/ with .hydra/ and a log."""
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("config", overrides=["+model=tiny"], return_hydra_config=True)
        no_run = compose("no_run_dir", overrides=["+model=tiny"], return_hydra_config=True)
    try:
        HydraConfig.instance().set_config(cfg)
        assert cfg.hydra.run.dir.startswith("outputs/runs/")
        assert cfg.hydra.output_subdir == ".hydra" and "file" in cfg.hydra.job_logging.handlers
        HydraConfig.instance().set_config(no_run)
        assert (no_run.hydra.run.dir, no_run.hydra.output_subdir) == (".", None)
        assert "file" not in no_run.hydra.job_logging.handlers
        # the same task config: only Hydra's own section differs
        task, no_run_task = (OmegaConf.to_container(c, resolve=False) for c in (cfg, no_run))
        assert isinstance(task, dict) and isinstance(no_run_task, dict)
        assert task.keys() == no_run_task.keys()
        assert all(task[k] == no_run_task[k] for k in task if k != "hydra")
    finally:
        HydraConfig.instance().cfg = None  # type: ignore[assignment]
