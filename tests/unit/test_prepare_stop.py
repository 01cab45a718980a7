"""A capture stopped by SIGTERM (SLURM's preemption, scancel, kill) or Ctrl-C: one line saying
which shards are whole on disk and kept and what to run to go on, status 128 + the signal, the
shard written before it intact, and a vLLM engine it started (target=vllm) stopped even while
a request to it hangs.

``python -m eagleforge.prepare`` runs in its own process on the tiny target (a SIGTERM that is
not handled would end the test run itself); the test signals it once it has written a shard,
or, through the engine, once its first request is in flight."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from eagleforge.data.features import read_sidecar, shard_complete
from helpers.fake_vllm import fake_python
from helpers.processes import wait_gone

pytestmark = pytest.mark.unit

DATA = ["+model=tiny", "data=chitchat", "data.max_num_samples=60", "data.num_eval_samples=6",
        "data.max_length=96", "prepare.samples_per_shard=10"]  # fmt: skip

# prepare's main; with a number as its first argument, the first shard's write is followed by
# a capture slow enough for the test's signal to arrive in it
SCRIPT = """
import signal, sys, time
from eagleforge import prepare

# Ctrl-C as at a terminal, also where this test runs in a background job (SIGINT ignored there)
signal.signal(signal.SIGINT, signal.default_int_handler)
if sys.argv[1] == "slow":
    write_shard = prepare.write_shard

    def slow_write_shard(*args, **kwargs):
        record = write_shard(*args, **kwargs)
        print("wrote a shard", flush=True)
        time.sleep(300)
        return record

    prepare.write_shard = slow_write_shard
sys.argv = ["prepare.py", *sys.argv[2:]]
prepare.main()
"""


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[str]]]:
    """The processes a test starts, killed after it however it ends (a stop that hangs)."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _start(
    started: list[subprocess.Popen[str]],
    args: list[str],
    stderr: Path,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    with stderr.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", SCRIPT, *args],
            stdout=subprocess.PIPE, stderr=err, text=True, env=env,
        )  # fmt: skip
    started.append(proc)
    return proc


@pytest.mark.parametrize(
    ("signum", "said"),
    [(signal.SIGTERM, "stopped by SIGTERM"), (signal.SIGINT, "interrupted (Ctrl-C)")],
)
def test_a_stopped_capture_says_which_shards_it_kept(
    tmp_path: Path, started: list[subprocess.Popen[str]], signum: int, said: str
) -> None:
    store, stderr = tmp_path / "features", tmp_path / "stderr"
    proc = _start(started, ["slow", *DATA, f"prepare.output_dir={store}"], stderr)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == "wrote a shard":
            break
    proc.send_signal(signum)
    assert proc.wait(120) == 128 + signum, stderr.read_text()[-3000:]
    # bytes: text mode would turn a bar's carriage returns into newlines
    err = stderr.read_bytes().decode()
    assert "Traceback" not in err
    assert "\r" not in err  # stderr is a file: no bar (ours, transformers', datasets') redraws
    samples = read_sidecar(store / "train", 0)["samples"]
    assert err.splitlines()[-1] == (
        f"{said}: prepare stopped before its end; the whole shards in {store} are kept (train "
        f"1 of 3 shards ({samples} samples)); run the same command again to capture the rest."
    )
    assert shard_complete(store / "train", 0) and not shard_complete(store / "train", 1)
    assert not list(store.rglob(".tmp-*"))  # nothing half-written beside it


def test_a_stopped_capture_stops_its_engine_while_a_request_hangs(
    tmp_path: Path, started: list[subprocess.Popen[str]]
) -> None:
    """target=vllm: the engine's request in flight never answers, and the stop neither waits
    for it (vllm.request_timeout_s) nor leaves the engine and its children running."""
    store, stderr, hang, pids = (tmp_path / name for name in ("features", "stderr", "hang", "pids"))
    env = {**os.environ, "FAKE_VLLM_HANG": str(hang), "FAKE_VLLM_PIDS": str(pids)}
    python = fake_python(tmp_path)
    proc = _start(
        started,
        ["fast", *DATA, "target=vllm", f"vllm.python={python}", f"prepare.output_dir={store}"],
        stderr,
        env,
    )
    deadline = time.monotonic() + 120
    while not hang.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert hang.exists(), stderr.read_text()[-3000:]
    server_pid, child_pid = (int(p) for p in pids.read_text().split())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 128 + signal.SIGTERM, stderr.read_text()[-3000:]
    assert wait_gone(server_pid) and wait_gone(child_pid)
    err = stderr.read_text()
    assert "Traceback" not in err
    assert err.splitlines()[-1].startswith(
        f"stopped by SIGTERM: prepare stopped before its end; the whole shards in {store} are "
        "kept (train 0 of 3 shards (0 samples))"
    )
