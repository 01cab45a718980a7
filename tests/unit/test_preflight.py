"""Every input a command names is checked before any heavy work, with one line naming the
field (eagleforge.preflight, target.source.check_model_path)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from eagleforge import builder, train
from eagleforge.config import compose_config, to_typed
from eagleforge.errors import ConfigError, DataError
from eagleforge.preflight import check_inputs

pytestmark = pytest.mark.unit


def typed(*overrides: str):  # type: ignore[no-untyped-def]
    return to_typed(compose_config(["+model=smollm2", "data=chitchat", "output_dir=.", *overrides]))


def model_dir(tmp_path: Path, *files: str) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    for name in files:
        (path / name).write_text("{}")
    return path


def test_missing_local_model_dir_is_named(tmp_path: Path) -> None:
    config = typed("model.source=pretrained", f"model.path={tmp_path}/nonexistent/dir")
    with pytest.raises(ConfigError, match=r"model\.path=.*nonexistent/dir: no such directory"):
        check_inputs(config)


def test_hub_id_not_cached_while_offline_is_named() -> None:
    # +model=llama3 with no model.path: its default hub id, which this offline machine lacks
    config = to_typed(compose_config(["+model=llama3", "data=chitchat", "output_dir=."]))
    with pytest.raises(
        ConfigError,
        match=r"model\.path=meta-llama/Llama-3\.1-8B-Instruct .*"
        r"offline \(HF_HUB_OFFLINE=1\)",
    ):
        check_inputs(config)


def test_directory_that_is_not_a_model_lists_what_it_lacks(tmp_path: Path) -> None:
    path = model_dir(tmp_path, "config.json")
    config = typed("model.source=pretrained", f"model.path={path}")
    with pytest.raises(ConfigError, match="lacks a tokenizer, weights"):
        check_inputs(config)
    # inspect_data reads the tokenizer only: no weights needed
    (path / "tokenizer.json").write_text("{}")
    check_inputs(config, need_weights=False)
    with pytest.raises(ConfigError, match="lacks weights"):
        check_inputs(config)


def test_missing_data_prompts_store_init_and_resume_are_named(tmp_path: Path) -> None:
    cases = [
        (["data=jsonl", f"data.path={tmp_path}/none.jsonl"], DataError, "none.jsonl does not"),
        ([f"data.eval_path={tmp_path}/held.jsonl"], DataError, "held.jsonl does not exist"),
        ([f"data.features={tmp_path}/store"], ConfigError, r"data\.features=.*no feature store"),
        (
            ["trainer.eval_tau_every_n_steps=5", "eval.prompts=nope.jsonl"],
            ConfigError,
            r"eval\.prompts=nope\.jsonl: no such file",
        ),
        ([f"model.draft_init={tmp_path}/d"], ConfigError, r"model\.draft_init=.*no such dir"),
        ([f"trainer.resume={tmp_path}"], ConfigError, r"trainer\.resume=.*not a training"),
    ]
    for overrides, error, message in cases:
        with pytest.raises(error, match=message):
            check_inputs(typed(*overrides))


def test_train_checks_data_before_loading_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def heavy(*_: object, **__: object) -> None:
        raise AssertionError("the model was loaded before the inputs were checked")

    monkeypatch.setattr(builder, "resolve_model_dir", heavy)
    monkeypatch.setattr(train, "distributed", heavy)
    cfg = compose_config(
        [
            "+model=tiny",
            "data=jsonl",
            f"data.path={tmp_path}/missing.jsonl",
            f"output_dir={tmp_path / 'run'}",
        ]
    )
    with pytest.raises(DataError, match="missing.jsonl does not exist"):
        train.run(cfg)


def test_entry_point_prints_one_line_and_exits_2(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "eagleforge.train",
            "+model=llama3",
            "model.path=/nonexistent/dir",
            "data=chitchat",
            "tracker=console",
            f"hydra.run.dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: model.path=/nonexistent/dir: no such directory (and not a hub id); check the path."
    ]


def test_regenerate_checks_the_model_only_for_the_hf_backend(tmp_path: Path) -> None:
    def regenerate(*overrides: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "eagleforge.regenerate", "+model=llama3",
             "model.path=/nonexistent/dir", "data=jsonl", f"regenerate.output={tmp_path}/o.jsonl",
             *overrides],
            capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path,
        )  # fmt: skip

    result = regenerate("regenerate.backend=hf", f"data.path={tmp_path}/in.jsonl")
    assert result.returncode == 2
    assert result.stderr.startswith("error: model.path=/nonexistent/dir: no such directory")
    result = regenerate("regenerate.backend=server", f"data.path={tmp_path}/in.jsonl")
    assert result.returncode == 2  # no model needed: the data file is the missing input
    assert "in.jsonl does not exist" in result.stderr.strip().splitlines()[0]


def test_an_unreachable_tracking_server_is_named_before_loading(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = typed(f"tracker.tracking_uri=http://127.0.0.1:{port}")
    check_inputs(config)  # commands that log nothing do not ask
    with pytest.raises(ConfigError, match=rf"tracker\.tracking_uri=http://127\.0\.0\.1:{port}: "
                       "no MLflow server answers"):  # fmt: skip
        check_inputs(config, tracking=True)
    check_inputs(typed(f"tracker.tracking_uri=sqlite:///{tmp_path}/m.db"), tracking=True)
    check_inputs(typed(f"tracker.tracking_uri=http://127.0.0.1:{port}", "tracker=console"),
                 tracking=True)  # fmt: skip


def test_a_run_that_cannot_be_created_is_one_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server went away between the preflight and the run's creation."""
    import socket

    from eagleforge.tracking import TrackerConfig, build_tracker

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = TrackerConfig(tracking_uri=f"http://127.0.0.1:{port}")
    with pytest.raises(ConfigError, match=r"tracker\.tracking_uri=.*could not start the run"):
        build_tracker(cfg, tmp_path, "run", output_dir=tmp_path / "run")
