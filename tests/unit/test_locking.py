"""One writer per output: a second train, prepare or regenerate into what a live process writes
refuses in one line naming that process, before writing anything; a lock its holder left by
dying (kill -9) is stale and simply taken."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from eagleforge.atomic import this_host
from eagleforge.config import compose_config, to_typed
from eagleforge.locking import RUN_DIR_LOCK, RunLocked, beside, exclusive
from eagleforge.prepare import run as prepare
from eagleforge.regenerate import run as regenerate
from eagleforge.train import run as train
from helpers.runs import tiny_run_overrides

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

HOLD = """
import sys, time
from pathlib import Path
from eagleforge.locking import exclusive
lock, output = Path(sys.argv[1]), Path(sys.argv[2])
with exclusive(lock, output=output, field="output"):
    print("held", flush=True)
    time.sleep(600)
"""


@contextmanager
def held_by_another_process(lock: Path, output: Path) -> Iterator[subprocess.Popen[str]]:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(lock), str(output)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        holder.kill()
        holder.wait()


def test_a_second_holder_is_refused_with_the_first_named(tmp_path: Path) -> None:
    lock, output = tmp_path / "out" / RUN_DIR_LOCK, tmp_path / "out"
    with (
        held_by_another_process(lock, output) as holder,
        pytest.raises(RunLocked) as refused,
        exclusive(lock, output=output, field="hydra.run.dir"),
    ):
        pytest.fail("two processes hold one lock")
    message = str(refused.value)
    assert (
        f"{output} is being written by another eagleforge process (pid {holder.pid} on " in message
    )
    assert this_host().split("~")[0] in message
    assert message.endswith("or choose another hydra.run.dir.")
    assert "\n" not in message


def test_a_lock_left_by_a_killed_process_is_taken(tmp_path: Path) -> None:
    lock, output = tmp_path / RUN_DIR_LOCK, tmp_path
    with held_by_another_process(lock, output) as holder:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        assert json.loads(lock.read_text())["pid"] == holder.pid  # its record is left behind
        with exclusive(lock, output=output, field="output_dir"):
            assert json.loads(lock.read_text())["pid"] == os.getpid()
    with exclusive(lock, output=output, field="output_dir"):  # and released after the block
        pass


def test_one_process_takes_its_own_lock_again(tmp_path: Path) -> None:
    lock = tmp_path / RUN_DIR_LOCK
    with exclusive(lock, output=tmp_path, field="f"), exclusive(lock, output=tmp_path, field="f"):
        pass


def test_train_into_a_run_directory_in_use_refuses_and_writes_nothing(tmp_path: Path) -> None:
    """The run directory is locked before Hydra writes its .hydra/ and log file there."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "train.log").write_text("the first run's log\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with held_by_another_process(run_dir / RUN_DIR_LOCK, run_dir) as holder:
        second = subprocess.run(
            [sys.executable, "-m", "eagleforge.train", *tiny_run_overrides(tmp_path, name=None),
             f"hydra.run.dir={run_dir}"],
            capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
        )  # fmt: skip
    assert second.returncode == 2, second.stderr
    assert second.stderr.strip().splitlines() == [
        f"error: {run_dir} is being written by another eagleforge process (pid {holder.pid} on "
        f"{this_host().split('~')[0]}, started "
        + second.stderr.split("started ", 1)[1].split(")", 1)[0]
        + "); wait for it to end or stop it, or choose another hydra.run.dir."
    ]
    assert sorted(p.name for p in run_dir.iterdir()) == [RUN_DIR_LOCK, "train.log"]
    assert (run_dir / "train.log").read_text() == "the first run's log\n"


def test_train_run_locks_its_output_dir(tmp_path: Path) -> None:
    """Without Hydra's callback (a run started from Python) the output directory is locked too."""
    overrides = tiny_run_overrides(tmp_path)
    output = tmp_path / "run"
    with (
        held_by_another_process(output / RUN_DIR_LOCK, output),
        pytest.raises(RunLocked, match="or choose another output_dir"),
    ):
        train(compose_config(overrides))
    assert not (output / "checkpoints").exists()


def test_prepare_into_a_store_in_use_refuses(tmp_path: Path) -> None:
    store = tmp_path / "features"
    config = to_typed(
        compose_config([*tiny_run_overrides(tmp_path), f"prepare.output_dir={store}"])
    )
    with (
        held_by_another_process(beside(store), store),
        pytest.raises(RunLocked, match="or choose another prepare.output_dir"),
    ):
        prepare(config)
    assert not store.exists()


def test_regenerate_into_an_output_in_use_refuses(tmp_path: Path) -> None:
    output = tmp_path / "regen.jsonl"
    config = to_typed(
        compose_config([*tiny_run_overrides(tmp_path), f"regenerate.output={output}"])
    )

    def generate(*args: object, **kwargs: object) -> object:
        pytest.fail("a refused regenerate generated")

    with (
        held_by_another_process(beside(output), output),
        pytest.raises(RunLocked, match="or choose another regenerate.output"),
    ):
        regenerate(config, generate)  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == [beside(output).name]


def test_a_sweep_jobs_refused_resume_puts_back_its_own_record_in_the_jobs_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LockRunDir keeps every job's .hydra/ of a sweep as it found it and takes it along to the
    job's own process (submitit pickles it with the launcher): a job whose resume is refused
    puts back its own .hydra/, not the other jobs', and one new to the sweep loses what Hydra
    wrote into it."""
    import copy
    import pickle

    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import open_dict

    from eagleforge import locking
    from eagleforge.config import conf_dir, register_configs

    sweep = tmp_path / "sweep"
    for job in ("0", "1"):
        (sweep / job / ".hydra").mkdir(parents=True)
        (sweep / job / ".hydra" / "overrides.yaml").write_text(f"- optimizer.lr={job}\n")
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("config", overrides=["+model=tiny", f"output_root={tmp_path}",
                                           f"hydra.sweep.dir={sweep}"], return_hydra_config=True)  # fmt: skip
    with open_dict(cfg):
        cfg.hydra.mode = RunMode.MULTIRUN
    callback = locking.LockRunDir()
    callback.on_multirun_start(cfg)
    try:
        in_job = pickle.loads(pickle.dumps(callback))
        monkeypatch.setattr(locking, "_RECORDS", {})  # the job's process knows nothing else
        in_job.on_job_start(cfg)
        for job in ("0", "1", "2"):  # Hydra writes each job's record for this command
            (sweep / job / ".hydra").mkdir(parents=True, exist_ok=True)
            (sweep / job / ".hydra" / "overrides.yaml").write_text("- the refused command\n")
            (sweep / job / ".hydra" / "config.yaml").write_text("a: 1\n")
        for job in ("1", "2"):
            job_cfg = copy.deepcopy(cfg)  # set_config makes it read-only
            with open_dict(job_cfg):
                job_cfg.hydra.runtime.output_dir = str(sweep / job)
            HydraConfig.instance().set_config(job_cfg)
            locking.restore_run_records()
    finally:
        callback.on_multirun_end(cfg)
        HydraConfig.instance().cfg = None  # type: ignore[assignment]
    assert (sweep / "1" / ".hydra" / "overrides.yaml").read_text() == "- optimizer.lr=1\n"
    assert sorted(p.name for p in (sweep / "1" / ".hydra").iterdir()) == ["overrides.yaml"]
    assert list((sweep / "2" / ".hydra").iterdir()) == []
    assert (sweep / "0" / ".hydra" / "overrides.yaml").read_text() == "- the refused command\n"
