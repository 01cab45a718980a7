"""A place a command cannot write -- a read-only directory, or a regular file where a directory
should be -- ends the command in one line naming the setting to change, before any model loads:
the run or sweep directory (before Hydra writes into it), output_root, the MLflow store, the
cache, and each command's own output.

The tests put the place under a regular file: that stops root too (CI runs as root, where a
chmod does not stop writes). The read-only variant is the same code path; it runs as a user,
and as root with ``os.access`` saying no."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict

from eagleforge import evaluate, export, inspect_data, prepare, regenerate, train
from eagleforge.config import compose_config, conf_dir, register_configs
from eagleforge.errors import ConfigError
from eagleforge.files import unwritable_reason
from eagleforge.formats.config import ExportConfig
from eagleforge.locking import run_dir_problem

pytestmark = pytest.mark.unit


@pytest.fixture
def blocker(tmp_path: Path) -> Path:
    """A regular file: nothing can be made under it."""
    path = tmp_path / "a-file"
    path.write_text("")
    return path


def test_unwritable_reason_names_what_is_in_the_way(
    tmp_path: Path, blocker: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert unwritable_reason(tmp_path / "new" / "deeper") is None  # made when written
    assert unwritable_reason(blocker / "run") == f"{blocker} is a file, not a directory"
    assert unwritable_reason(blocker / "x" / "y") == f"{blocker} is a file, not a directory"
    monkeypatch.setattr(os, "access", lambda *_: False)  # what a read-only directory answers
    assert unwritable_reason(tmp_path / "run") == f"{tmp_path} is read-only to this user"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_read_only_directory_is_named(tmp_path: Path) -> None:
    tmp_path.chmod(0o555)
    try:
        assert unwritable_reason(tmp_path / "run") == f"{tmp_path} is read-only to this user"
    finally:
        tmp_path.chmod(0o755)


def test_a_run_dir_that_cannot_be_written_is_one_line_before_hydra_writes(blocker: Path) -> None:
    """Hydra's own attempt ends in chained tracebacks ("Unable to configure handler 'file'")."""
    done = subprocess.run(
        [sys.executable, "-m", "eagleforge.train", "+model=tiny", "data=chitchat",
         f"hydra.run.dir={blocker}/run"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.splitlines() == [
        f"error: hydra.run.dir={blocker}/run: cannot write the run directory {blocker}/run "
        f"({blocker} is a file, not a directory); set hydra.run.dir to a writable directory."
    ]


def hydra_config(*overrides: str, multirun: bool = False) -> DictConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    if multirun:
        with open_dict(cfg):
            cfg.hydra.overrides.hydra.append("hydra.mode=MULTIRUN")
    return cfg


def test_the_run_dir_check_names_the_setting_that_chose_it(blocker: Path) -> None:
    # default run directory under output_root: output_root is what to change
    cfg = hydra_config("+model=tiny", f"output_root={blocker}/out")
    run_dir = cfg.hydra.run.dir
    assert run_dir_problem(cfg, run_dir, "hydra.run.dir") == (
        f"output_root={blocker}/out: cannot write the run directory {run_dir} ({blocker} is "
        "a file, not a directory); set output_root (or hydra.run.dir) to a writable directory."
    )
    # a sweep directory given on the command line
    cfg = hydra_config("+model=tiny", f"hydra.sweep.dir={blocker}/sweep", multirun=True)
    assert run_dir_problem(cfg, f"{blocker}/sweep", "hydra.sweep.dir") == (
        f"hydra.sweep.dir={blocker}/sweep: cannot write the sweep directory {blocker}/sweep "
        f"({blocker} is a file, not a directory); set hydra.sweep.dir to a writable directory."
    )
    assert run_dir_problem(hydra_config("+model=tiny"), "outputs/runs/x", "hydra.run.dir") is None


def not_loaded(*_: Any, **__: Any) -> None:
    raise AssertionError("the model was loaded before the outputs were checked")


@pytest.fixture
def no_models(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (train, evaluate, inspect_data, prepare, regenerate):
        for name in ("resolve_model_dir", "distributed", "build_hf_target"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, not_loaded)
    monkeypatch.setattr(prepare, "run", not_loaded)
    monkeypatch.setattr(regenerate, "run", not_loaded)


def one_line_error(capsys: pytest.CaptureFixture[str], main: Any, cfg: DictConfig) -> str:
    """An entry point's hydra-decorated main, given its config: status 2 and one line."""
    with pytest.raises(SystemExit) as stop:
        main(cfg)
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    return line


@pytest.mark.usefixtures("no_models")
def test_each_command_names_the_place_it_cannot_write(
    tmp_path: Path,
    blocker: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    a_file = f"({blocker} is a file, not a directory)"
    run = ["+model=tiny", "data=chitchat", f"output_dir={tmp_path / 'run'}"]
    fine = [*run, f"output_root={tmp_path}"]

    with pytest.raises(ConfigError, match=rf"^output_root={blocker}/out: cannot write there "):
        train.run(compose_config([*run, f"output_root={blocker}/out"]))
    with pytest.raises(ConfigError, match=rf"^output_dir={blocker}/run: .* choose another "):
        train.run(compose_config([*fine, f"output_dir={blocker}/run"]))
    uri = f"sqlite:///{blocker}/mlflow.db"
    with pytest.raises(ConfigError, match=rf"^tracker\.tracking_uri={uri}: .*point tracker"):
        train.run(compose_config([*fine, f"tracker.tracking_uri={uri}"]))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"{blocker}/mlruns")
    with pytest.raises(ConfigError, match=rf"^MLFLOW_TRACKING_URI={blocker}/mlruns: "):
        train.run(compose_config(fine))
    monkeypatch.delenv("MLFLOW_TRACKING_URI")

    monkeypatch.setenv("EAGLEFORGE_CACHE_DIR", f"{blocker}/cache")
    cache = (
        f"error: EAGLEFORGE_CACHE_DIR={blocker}/cache: cannot write there {a_file}; set "
        "EAGLEFORGE_CACHE_DIR (or cache_dir=DIR) to a writable directory."
    )
    with pytest.raises(ConfigError, match=r"^EAGLEFORGE_CACHE_DIR="):
        train.run(compose_config(fine))
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"^EAGLEFORGE_CACHE_DIR="):
        evaluate.run(compose_config([*fine, f"eval.draft={draft}"]))
    with pytest.raises(ConfigError, match=r"^EAGLEFORGE_CACHE_DIR="):
        inspect_data.inspect(compose_config(fine))
    assert one_line_error(capsys, prepare._hydra_main, compose_config(fine)) == cache
    regen = [*fine, "regenerate.backend=hf", f"regenerate.output={tmp_path}/o.jsonl"]
    assert one_line_error(capsys, regenerate._hydra_main, compose_config(regen)) == cache
    monkeypatch.setenv("HOME", str(blocker))
    monkeypatch.delenv("EAGLEFORGE_CACHE_DIR")
    with pytest.raises(ConfigError, match=r"^the cache .*EAGLEFORGE_CACHE_DIR unset\): cannot"):
        inspect_data.inspect(compose_config(fine))
    monkeypatch.setenv("EAGLEFORGE_CACHE_DIR", str(tmp_path / "cache"))

    store = [*fine, f"prepare.output_dir={blocker}/store"]
    assert one_line_error(capsys, prepare._hydra_main, compose_config(store)) == (
        f"error: prepare.output_dir={blocker}/store: cannot write there {a_file}; choose "
        "another prepare.output_dir."
    )
    regen = [*fine, "regenerate.backend=server", f"regenerate.output={blocker}/o.jsonl"]
    line = one_line_error(capsys, regenerate._hydra_main, compose_config(regen))
    assert line.startswith(f"error: regenerate.output={blocker}/o.jsonl: cannot write there")


def test_export_names_its_output_dir(tmp_path: Path, blocker: Path) -> None:
    from eagleforge.formats.eagle3 import export_sglang
    from helpers.drafts import tiny_draft

    draft = export_sglang(tiny_draft(), tmp_path / "step_00000001")
    with pytest.raises(ConfigError) as error:
        export.export(ExportConfig(draft=str(draft), output_dir=f"{blocker}/out"))
    assert str(error.value) == (
        f"export.output_dir={blocker}/out: cannot write there ({blocker} is a file, not a "
        "directory); set export.output_dir to a writable directory."
    )
