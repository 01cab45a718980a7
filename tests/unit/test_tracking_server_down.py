"""An MLflow server that is down costs the user one line, ours: a job it stopped is not
recorded in MLflow (that would only add MLflow's retry warnings and a "could not record"
warning to the console before the error), and the preflight and the recorder ask the server
the same way (tracking.server_down)."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from eagleforge.config import compose_config
from eagleforge.errors import ConfigError
from eagleforge.tracking import MLflowTracker, record_failure, server_down

pytestmark = pytest.mark.unit


@pytest.fixture
def dead_uri() -> str:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_a_failure_is_not_recorded_on_a_server_that_is_down(
    tmp_path: Path,
    dead_uri: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(MLflowTracker, "last", None)  # no run of an earlier test to end
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    cfg = compose_config([
        "+model=tiny", "data=chitchat", f"tracker.tracking_uri={dead_uri}",
        f"output_root={tmp_path}", f"output_dir={tmp_path / 'run'}",
    ])  # fmt: skip
    error = ConfigError(f"tracker.tracking_uri={dead_uri}: no MLflow server answers")
    with caplog.at_level(logging.DEBUG):
        record_failure(error, cfg)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert list(tmp_path.iterdir()) == []  # nothing written either


def test_server_down_names_the_reason_only_for_a_server(dead_uri: str, tmp_path: Path) -> None:
    assert "Connection refused" in (server_down(dead_uri, timeout_s=2.0) or "")
    assert server_down(f"sqlite:///{tmp_path}/mlflow.db") is None  # a local store
    assert server_down(str(tmp_path)) is None
