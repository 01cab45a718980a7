"""A submitit task's torch.distributed environment, and the stop signals handed on to the
launcher's own handler (submitit's checkpoint-and-requeue)."""

from __future__ import annotations

import signal
import socket
import subprocess
from typing import Any

import pytest

from eagleforge.errors import ConfigError
from eagleforge.parallel import ParallelConfig
from eagleforge.parallel.launch import TORCH_ENV, export_submitit_env, is_main_process
from eagleforge.trainer import StopSignals

pytestmark = pytest.mark.unit


def submitit_local_task(
    monkeypatch: pytest.MonkeyPatch, rank: int, num_tasks: int, job_id: str = "4242"
) -> None:
    """The environment submitit's local executor gives task ``rank`` of a job."""
    for name in TORCH_ENV:  # set then removed: monkeypatch restores what the export sets
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")
    monkeypatch.setenv("SUBMITIT_LOCAL_JOB_ID", job_id)
    monkeypatch.setenv("SUBMITIT_LOCAL_NTASKS", str(num_tasks))
    monkeypatch.setenv("SUBMITIT_LOCAL_JOB_NUM_NODES", "1")
    monkeypatch.setenv("SUBMITIT_LOCAL_NODEID", "0")
    monkeypatch.setenv("SUBMITIT_LOCAL_GLOBALID", str(rank))
    monkeypatch.setenv("SUBMITIT_LOCAL_LOCALID", str(rank))


def test_a_multi_task_submitit_job_gets_torchruns_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("submitit")
    submitit_local_task(monkeypatch, rank=0, num_tasks=2)
    first = export_submitit_env()
    submitit_local_task(monkeypatch, rank=1, num_tasks=2)
    second = export_submitit_env()

    assert (first["RANK"], second["RANK"]) == ("0", "1")
    assert first["WORLD_SIZE"] == second["WORLD_SIZE"] == "2"
    assert second["LOCAL_RANK"] == "1" and second["LOCAL_WORLD_SIZE"] == "2"
    # every task meets at the same address, from the job id alone
    assert first["MASTER_ADDR"] == second["MASTER_ADDR"] == socket.gethostname()
    assert first["MASTER_PORT"] == second["MASTER_PORT"]
    assert 20000 <= int(first["MASTER_PORT"]) <= 60000
    assert not is_main_process()
    # exported before the config is typed, the process count is checked at compose time
    with pytest.raises(ConfigError, match="world size 2"):
        ParallelConfig(dp=4)


def test_one_task_or_torchrun_or_no_launcher_is_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("submitit")
    submitit_local_task(monkeypatch, rank=0, num_tasks=1)
    assert export_submitit_env() == {}
    submitit_local_task(monkeypatch, rank=1, num_tasks=2)
    monkeypatch.setenv("RANK", "5")  # srun torchrun inside the job: torchrun's values win
    assert export_submitit_env() == {}
    monkeypatch.delenv("SUBMITIT_EXECUTOR")
    monkeypatch.delenv("RANK")
    assert export_submitit_env() == {} and is_main_process()


class FakeRequeue:
    """Stands for submitit's handler: records the calls it gets."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, signum: int, _frame: Any) -> None:
        self.calls.append(signum)


def test_stop_signals_record_and_then_hand_on_to_the_launchers_handler() -> None:
    requeue = FakeRequeue()
    previous = signal.signal(signal.SIGUSR2, requeue)
    try:
        stop = StopSignals()
        with stop:
            signal.raise_signal(signal.SIGUSR2)
            # the rest of a preemption does not replace the requeue signal
            signal.raise_signal(signal.SIGTERM)
            assert stop.signal == signal.SIGUSR2 and requeue.calls == []
        assert signal.getsignal(signal.SIGUSR2) is requeue
        StopSignals.hand_on(stop.signal)
        assert requeue.calls == [signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, previous)


@pytest.mark.parametrize(
    ("command", "returncode", "handed_on"),
    [
        (["scontrol", "requeue", "26"], -signal.SIGTERM, True),  # SLURM ends the step for it
        (["scontrol", "requeue", "26"], 1, False),  # scontrol refused: the job is not requeued
        (["scontrol", "show", "job"], -signal.SIGTERM, False),
    ],
)
def test_a_requeue_whose_scontrol_slurm_terminates_is_the_requeue_not_a_failure(
    command: list[str], returncode: int, handed_on: bool
) -> None:
    """submitit's requeue runs ``scontrol requeue``; SLURM ends the job's step for that
    requeue with SIGTERM, which on a busy controller reaches scontrol before it returns."""

    def requeue(_signum: int, _frame: Any) -> None:
        raise subprocess.CalledProcessError(returncode, command)

    previous = signal.signal(signal.SIGUSR2, requeue)
    try:
        if handed_on:
            StopSignals.hand_on(signal.SIGUSR2)
        else:
            with pytest.raises(subprocess.CalledProcessError):
                StopSignals.hand_on(signal.SIGUSR2)
    finally:
        signal.signal(signal.SIGUSR2, previous)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2])
def test_each_stop_signal_is_recorded_and_default_handlers_are_not_raised(sig: int) -> None:
    previous = signal.signal(sig, signal.SIG_DFL)
    try:
        stop = StopSignals()
        with stop:
            signal.raise_signal(sig)
        assert stop.signal == sig
        StopSignals.hand_on(sig)  # SIG_DFL would kill the process: left to the caller's exit
    finally:
        signal.signal(sig, previous)
