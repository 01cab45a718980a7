"""profile.enabled: a Chrome trace of the chosen steps per rank, logged to MLflow, and a
top-operators table printed at the end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagleforge.config import compose_config
from eagleforge.train import run
from helpers.runs import tiny_run_overrides

pytestmark = pytest.mark.integration


def test_profiled_steps_give_a_trace_and_a_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run(compose_config(tiny_run_overrides(
        tmp_path, "data.max_num_samples=30", "data.num_eval_samples=0", "data.max_length=64",
        "draft.ttt_length=2", "profile.enabled=true", "profile.start_step=2",
        "profile.num_steps=2", "profile.record_shapes=true", "tracker=mlflow",
    )))  # fmt: skip
    trace = tmp_path / "run" / "profile" / "trace_rank0.json"
    events = json.loads(trace.read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#1", "ProfilerStep#2"}  # steps 2 and 3, nothing else
    assert any(e.get("name") == "aten::mm" for e in events)
    out = capsys.readouterr().out
    assert "Top operators (rank 0, self_cpu_time_total)" in out and "Self CPU" in out

    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (found,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert "trace_rank0.json" in {a.path for a in client.list_artifacts(found.info.run_id)}
