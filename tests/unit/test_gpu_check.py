"""The GPU check's CPU dry run (``scripts/gpu_check.sh --dry-run``): it lists every part with
its command and timeout, within the check's budget, and checks the wheel bundle that
``make gpu-wheels`` builds (complete, under the carry limit), with no network and no GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
PARTS = ["setup", "bench-sdpa", "bench-specforge", "compare", "bench-long", "bench-compile",
         "gpu-tests", "train-eager", "train-sdpa", "train-flex", "train-flash", "losses",
         "evaluate"]  # fmt: skip


def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def dry_run(wheels: Path, out: Path) -> subprocess.CompletedProcess[str]:
    command = ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run",
               "--wheels", str(wheels), "--out", str(out)]  # fmt: skip
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)


def fake_bundle(directory: Path) -> Path:
    """Empty files named as ``make gpu-wheels`` names the wheels and fixtures."""
    check = gpu_check()
    directory.mkdir()
    for dist, version in check.WHEELS.items():
        (directory / f"{check.normalize(dist)}-{version}-py3-none-any.whl").write_bytes(b"")
    (directory / check.FIXTURES).write_bytes(b"")
    return directory


def test_dry_run_lists_every_part_within_the_budget(tmp_path: Path) -> None:
    done = dry_run(fake_bundle(tmp_path / "wheels"), tmp_path / "out")
    assert done.returncode == 0, done.stdout + done.stderr
    listed = re.findall(r"^- (\S+) +timeout +(\d+) s", done.stdout, re.MULTILINE)
    assert [name for name, _ in listed] == PARTS
    timeouts = {name: int(seconds) for name, seconds in listed}
    # 8 minutes in all, the parts that need flash-attn (not carried) aside
    assert sum(timeouts.values()) - timeouts["train-flash"] <= gpu_check().TOTAL_BUDGET_S == 480
    assert "the check stops at 480 s" in done.stdout
    assert "-m pytest -m gpu tests/gpu" in done.stdout
    assert "draft.attention=flash  [only if flash_attn imports]" in done.stdout
    shape = "--hidden-size 4096 --intermediate-size 14336 --heads 32 --kv-heads 8 --vocab 128256 --draft-vocab 32000 --ttt-length 7"
    assert (
        done.stdout.count(shape) == 4 and "--dtype bfloat16 --master-dtype float32" in done.stdout
    )
    assert "--seq-len 2048 --steps 10 --loss-kernel torch,auto" in done.stdout
    assert "--seq-len 8192,16384,32768" in done.stdout
    assert (
        "benchmarks/specforge_step.py" in done.stdout
        and "--attention flex --compile" in done.stdout
    )
    assert "bundle" in done.stdout and "0.0 MiB + the working tree" in done.stdout
    assert not (tmp_path / "out").exists()  # a dry run runs and writes nothing


def test_dry_run_names_the_missing_wheels(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    done = dry_run(tmp_path / "empty", tmp_path / "out")
    assert done.returncode == 1
    assert "error: missing from" in done.stdout and "run `make gpu-wheels`" in done.stdout
    for spec in ("hydra-core==1.3.8", "pyarrow==25.0.1", "datasets==5.2.0", "fixtures.tar.xz"):
        assert spec in done.stdout
    assert "pytest==" not in done.stdout  # the image has it


def test_dry_run_refuses_a_bundle_over_the_carry_limit_with_the_tree(tmp_path: Path) -> None:
    """The bundle travels with the working tree: the two together must fit."""
    wheels = fake_bundle(tmp_path / "wheels")
    tree = gpu_check().tree_mib()
    assert tree > 0.5  # src/, tests/, docs/ at least
    with (wheels / "pyarrow-25.0.1-py3-none-any.whl").open("wb") as f:
        f.truncate(int((64 - tree / 2) * 2**20))  # sparse: under 64 MiB alone, over with the tree
    done = dry_run(wheels, tmp_path / "out")
    assert done.returncode == 1
    assert "MiB, over the 64 MiB limit" in done.stdout and "the working tree" in done.stdout


@pytest.mark.skipif(
    not (REPO / "gpu-wheels").is_dir(), reason="no gpu-wheels/ (make gpu-wheels needs network)"
)
def test_the_built_bundle_is_complete_and_fits() -> None:
    check = gpu_check()
    assert check.missing_wheels(REPO / "gpu-wheels") == []
    assert check.bundle_mib(REPO / "gpu-wheels") + check.tree_mib() <= check.BUNDLE_LIMIT_MIB


def test_a_hung_part_is_stopped_at_its_timeout_and_reported(tmp_path: Path) -> None:
    check = gpu_check()
    (tmp_path / "logs").mkdir()
    hang = "import time; print('started', flush=True); time.sleep(60)"
    part = check.Part("hang", 1, "sleeps", [sys.executable, "-c", hang])
    outcome = check.run_part(part, dict(os.environ), tmp_path / "logs", 1)
    assert outcome.status == "timeout" and outcome.seconds < 10
    assert "started" in (tmp_path / "logs" / "hang.log").read_text()
    check.write_summary(tmp_path, [outcome], outcome.seconds)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["passed"] is False and summary["parts"][0]["status"] == "timeout"
    assert "| hang | timeout |" in (tmp_path / "summary.md").read_text()


def test_backend_losses_are_compared_step_by_step(tmp_path: Path) -> None:
    check = gpu_check()
    traces = {"eager": [10.0, 9.0, 8.0], "sdpa": [10.01, 9.0, 8.0], "flex": [10.0, 9.5, 8.0]}
    for backend, losses in traces.items():
        (tmp_path / f"train-{backend}.json").write_text(json.dumps({"losses": losses}))
    outcome = check.compare_losses(tmp_path)
    assert outcome.status == "fail" and outcome.note.startswith("flex:")
    assert outcome.figures["sdpa"]["max_step_rel_diff"] == 0.001


def test_a_backend_stopped_early_is_named_as_such_not_as_off(tmp_path: Path) -> None:
    """A train-* part killed at its timeout keeps the steps it logged: that is a short trace,
    not a loss off the reference (the first H200 run reported flex's 18 steps as 'off')."""
    check = gpu_check()
    traces = {"eager": [10.0, 9.0, 8.0], "flex": [10.0, 9.0]}
    for backend, losses in traces.items():
        (tmp_path / f"train-{backend}.json").write_text(json.dumps({"losses": losses}))
    outcome = check.compare_losses(tmp_path)
    assert outcome.status == "fail" and outcome.note == "flex: 2 of 3 steps (stopped early)"


def _bench_log(logs: Path, name: str, *runs: dict) -> None:
    lines = ["warming up", *(json.dumps(run) for run in runs)]
    (logs / f"{name}.log").write_text("\n".join(lines) + "\n")


def test_ours_is_set_beside_specforge_against_the_targets(tmp_path: Path) -> None:
    check = gpu_check()
    ours = {"bench": "ttt_step", "loss_kernel": "triton", "tokens_per_s": 30000.0,
            "peak_cuda_mib": 20000.0, "mfu": 0.45}  # fmt: skip
    torch_loss = {**ours, "loss_kernel": "torch", "tokens_per_s": 10000.0}
    peer = {"bench": "specforge_step", "tokens_per_s": 20000.0, "peak_cuda_mib": 40000.0}
    _bench_log(tmp_path, "bench-sdpa", torch_loss, ours)
    _bench_log(tmp_path, "bench-specforge", peer)
    met = check.compare_peer(tmp_path)
    assert met.status == "pass" and met.note == "every target met"
    assert met.figures["tokens_per_s_ratio"] == 1.5 and met.figures["peak_memory_ratio"] == 0.5
    _bench_log(tmp_path, "bench-sdpa", {**ours, "tokens_per_s": 22000.0, "mfu": 0.3})
    missed = check.compare_peer(tmp_path)
    assert missed.status == "fail"
    assert missed.note == "tokens/s 1.10x SpecForge's (target 1.2x); MFU 0.3 (target 40%)"
    (tmp_path / "bench-specforge.log").unlink()
    alone = check.compare_peer(tmp_path)
    assert alone.status == "skip" and alone.note == "no figures from bench-specforge"


def test_a_benchmark_of_several_runs_keeps_each(tmp_path: Path) -> None:
    """bench-long's lengths each keep their figures, also when the last ran out of memory."""
    check = gpu_check()
    runs = [{"bench": "ttt_step", "seq_len": n, "tokens_per_s": 1.0, "peak_cuda_mib": 2.0}
            for n in (8192, 16384)]  # fmt: skip
    _bench_log(tmp_path, "bench-long", *runs)
    with (tmp_path / "bench-long.log").open("a") as log:
        log.write("torch.OutOfMemoryError: CUDA out of memory\n")
    outcome = check.Outcome("bench-long", "fail", 1.0, 90)
    check.figures_of(outcome, tmp_path, tmp_path)
    assert [run["seq_len"] for run in outcome.figures["runs"]] == [8192, 16384]
