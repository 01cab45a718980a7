"""Exact resume: a run continued from its checkpoint goes on exactly as if never stopped."""

from __future__ import annotations

import errno
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eagleforge.atomic import this_host
from eagleforge.checkpoint import TRAINING_STATE, read_progress
from eagleforge.config import compose_config
from eagleforge.errors import CheckpointError, ResumeRefused
from eagleforge.files import CHECKSUMS, record_checksums
from eagleforge.train import run
from eagleforge.trainer import Trainer
from helpers.processes import dead_pid
from helpers.runs import PADDED, start_from, tiny_run_overrides, weights
from helpers.weights import overlaps, sampled_spans, scale_tensor, tensor_span, tiny_target_copy

pytestmark = pytest.mark.integration


def overrides(tmp_path: Path, name: str, *extra: str) -> list[str]:
    return tiny_run_overrides(
        tmp_path, "data.max_tokens_per_batch=192", "trainer.max_num_steps=6",
        "trainer.grad_accum_steps=2", "trainer.save_every_n_steps=2", "optimizer.lr=1e-3",
        "draft.ttt_length=3", *extra, name=name,
    )  # fmt: skip


def packed(packing: str) -> tuple[str, ...]:
    return PADDED if packing == "false" else ("data.packing=true",)


@pytest.mark.parametrize("packing", ["true", "false"])
def test_resumed_run_is_bit_identical(tmp_path: Path, packing: str) -> None:
    full = run(compose_config(overrides(tmp_path, "full", *packed(packing))))
    # the same run, stopped after its step-2 checkpoint: a torn step-4 save left behind, and a
    # step-4 checkpoint with one flipped bit in its weights (a disk or copy error)
    resumed_dir = tmp_path / "resumed" / "checkpoints"
    resumed_dir.mkdir(parents=True)
    for step in ("step_00000002", "step_00000004"):
        shutil.copytree(tmp_path / "full" / "checkpoints" / step, resumed_dir / step)
    flipped = bytearray((resumed_dir / "step_00000004" / "model.safetensors").read_bytes())
    flipped[-1] ^= 0x01
    (resumed_dir / "step_00000004" / "model.safetensors").write_bytes(bytes(flipped))
    torn = resumed_dir / f".step_00000006.{dead_pid()}@{this_host()}.abcd1234"  # a killed save
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(b"torn")
    resumed = run(compose_config(overrides(tmp_path, "resumed", *packed(packing))))
    assert resumed.step == full.step == 6
    assert resumed.train_losses == full.train_losses[2:]  # steps 3..6, bit for bit
    final_full, final_resumed = weights(full.checkpoint), weights(resumed.checkpoint)
    assert all(torch.equal(final_full[k], final_resumed[k]) for k in final_full)
    assert not list(resumed_dir.glob(".*"))
    assert resumed.final_eval == full.final_eval


def test_muon_resumed_run_is_bit_identical(tmp_path: Path) -> None:
    """optimizer=muon (Muon's momentum buffers and AdamW's moments in one optimizer state,
    through torch.distributed.checkpoint's state dicts): 6 steps, or 2, a stop, and 4 more from
    the step-2 checkpoint, end in the same weights, bit for bit."""
    full = run(compose_config(overrides(tmp_path, "full", "optimizer=muon")))
    step_2 = tmp_path / "full" / "checkpoints" / "step_00000002"
    saved = torch.load(step_2 / TRAINING_STATE, weights_only=True)["optimizer"]["state"]
    assert saved["draft.fc.weight"].keys() == {"momentum_buffer"}  # Muon's
    assert saved["draft.lm_head.weight"].keys() == {"step", "exp_avg", "exp_avg_sq"}  # AdamW's
    start_from(step_2, tmp_path / "resumed")
    resumed = run(compose_config(overrides(tmp_path, "resumed", "optimizer=muon")))
    assert resumed.step == full.step == 6
    assert resumed.train_losses == full.train_losses[2:]  # steps 3..6, bit for bit
    final_full, final_resumed = weights(full.checkpoint), weights(resumed.checkpoint)
    assert all(torch.equal(final_full[k], final_resumed[k]) for k in final_full)
    assert not torch.equal(final_full["fc.weight"], weights(step_2)["fc.weight"])  # it trained


def test_resume_never_and_bad_checkpoints(tmp_path: Path) -> None:
    first = run(compose_config(overrides(tmp_path, "run", "trainer.max_num_steps=2")))
    fresh = run(
        compose_config(
            overrides(tmp_path, "run", "trainer.max_num_steps=2", "trainer.resume=never")
        )
    )
    assert fresh.train_losses == first.train_losses  # started over, same seed
    assert first.checkpoint is not None
    (first.checkpoint / TRAINING_STATE).write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"every checkpoint is damaged \(step_00000002: "
                       r"training_state.pt does not match its checksum"):  # fmt: skip
        run(compose_config(overrides(tmp_path, "run", "trainer.max_num_steps=4")))
    (first.checkpoint / CHECKSUMS).unlink()  # as saved by an older eagleforge: no checksums
    with pytest.raises(CheckpointError, match=r"step_00000002: unreadable checkpoint"):
        run(compose_config(overrides(tmp_path, "run", "trainer.max_num_steps=4")))
    from eagleforge.errors import ConfigError

    with pytest.raises(ConfigError, match=r"trainer.resume=.*not a training checkpoint"):
        run(compose_config(overrides(tmp_path, "x", f"trainer.resume={tmp_path}")))


# SIGUSR1 is slow only: tests/dist/test_sbatch.py stops a job with it (exit 138, requeue) and
# tests/unit/test_launch.py records every stop signal alike.
@pytest.mark.parametrize(
    "signum",
    [signal.SIGTERM, signal.SIGINT, pytest.param(signal.SIGUSR1, marks=pytest.mark.slow)],
)
def test_preemption_signal_finishes_the_step_saves_and_exits_for_requeue(
    tmp_path: Path, signum: int
) -> None:
    args = overrides(tmp_path, "pre", "trainer.max_num_steps=500", "trainer.save_every_n_steps=0",
                     "trainer.log_every_n_steps=1")  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "eagleforge.train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # wait until a few steps have run
        if "step 3 train:" in line:
            break
    proc.send_signal(signum)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 128 + signum, output
    assert "Traceback" not in output
    if signum == signal.SIGINT:  # Ctrl-C says what it does
        assert "Ctrl-C: finishing this step, then saving a checkpoint and exiting" in output
    (checkpoint,) = (tmp_path / "pre" / "checkpoints").glob("step_*")
    stopped_at = int(checkpoint.name.removeprefix("step_"))
    assert 3 <= stopped_at < 500
    resumed = run(
        compose_config(overrides(tmp_path, "pre", f"trainer.max_num_steps={stopped_at + 2}"))
    )
    assert resumed.step == stopped_at + 2 and len(resumed.train_losses) == 2


def test_a_second_ctrl_c_stops_at_once_without_a_traceback(tmp_path: Path) -> None:
    args = overrides(tmp_path, "int", "trainer.max_num_steps=500", "trainer.save_every_n_steps=0",
                     "trainer.log_every_n_steps=1")  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "eagleforge.train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if "step 3 train:" in line:
            proc.send_signal(signal.SIGINT)
        if "Ctrl-C: finishing this step" in line:  # the first was seen: the second now
            proc.send_signal(signal.SIGINT)
            break
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 130, output
    assert "Traceback" not in output
    # the second Ctrl-C landed in the step (nothing saved) or, on a fast machine, in the save
    # the first one asked for; either way what is on disk is whole
    assert "interrupted: stopped without saving" in output or "stopped by SIGINT" in output
    for checkpoint in (tmp_path / "int" / "checkpoints").glob("step_*"):
        assert (checkpoint / TRAINING_STATE).is_file()


def test_keep_last_n_rotates_step_checkpoints(tmp_path: Path) -> None:
    result = run(compose_config(overrides(tmp_path, "keep", "trainer.keep_last_n=2")))
    kept = sorted(p.name for p in (tmp_path / "keep" / "checkpoints").iterdir())
    assert kept == ["step_00000004", "step_00000006"] and result.checkpoint is not None


def test_draft_init_starts_from_a_checkpoint_with_a_fresh_optimizer(tmp_path: Path) -> None:
    first = run(compose_config(overrides(tmp_path, "first", "trainer.max_num_steps=2")))
    assert first.checkpoint is not None
    tuned = run(
        compose_config(
            overrides(
                tmp_path, "tuned", "trainer.max_num_steps=2", f"model.draft_init={first.checkpoint}"
            )
        )
    )
    # the untrained baseline of the fine-tuning run is the first run's trained draft
    assert tuned.initial_eval == first.final_eval
    assert tuned.step == 2 and len(tuned.train_losses) == 2  # steps counted from 0 again
    from eagleforge.errors import ConfigError

    with pytest.raises(
        ConfigError,
        match="model.draft_init=.*: not a draft eagleforge reads: no config.json and no .gguf file",
    ):
        run(compose_config(overrides(tmp_path, "bad", f"model.draft_init={tmp_path}")))


# what a full disk raises: the OS's error, or torch.save's own word for its short write
FULL_DISK = {
    "enospc": OSError(errno.ENOSPC, "No space left on device"),
    "torch": RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 191424 vs 191312"),
}  # fmt: skip


@pytest.mark.parametrize("raised", FULL_DISK)
def test_a_failed_save_stops_with_a_clear_error_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, raised: str
) -> None:
    import eagleforge.checkpoint as checkpoint_module

    real_save = checkpoint_module.torch.save
    calls = {"n": 0}

    def disk_fills_up(obj, path, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += isinstance(path, Path)  # files, not the in-memory RNG states
        if calls["n"] == 2:  # the second checkpoint (step 4) hits a full disk
            raise FULL_DISK[raised]
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module.torch, "save", disk_fills_up)
    with pytest.raises(CheckpointError, match=r"step_00000004: could not write the checkpoint "
                       r"\(no space left on device\); the earlier checkpoints"):  # fmt: skip
        run(compose_config(overrides(tmp_path, "full-disk")))
    kept = sorted(p.name for p in (tmp_path / "full-disk" / "checkpoints").iterdir())
    assert kept == ["step_00000002"]  # no torn directory left behind
    monkeypatch.setattr(checkpoint_module.torch, "save", real_save)
    resumed = run(compose_config(overrides(tmp_path, "full-disk")))
    assert resumed.step == 6 and len(resumed.train_losses) == 4


# A kill after step 5 is slow only: after step 2 the same save, cleanup and resume run.
@pytest.mark.parametrize("kill_after", [2, pytest.param(5, marks=pytest.mark.slow)])
def test_sigkill_at_any_point_then_resume_is_bit_identical(tmp_path: Path, kill_after: int) -> None:
    """A real SIGKILL (no handler runs) once step ``kill_after``'s checkpoint exists -- often
    in the middle of the next save -- then the same command: the run ends exactly as one
    that never stopped."""
    args = ("trainer.max_num_steps=7", "trainer.save_every_n_steps=1", "parallel.num_threads=1")
    full = run(compose_config(overrides(tmp_path, "full", *args)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "eagleforge.train", *overrides(tmp_path, "killed", *args)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    checkpoints = tmp_path / "killed" / "checkpoints"
    while not (checkpoints / f"step_{kill_after:08d}").exists() and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    saved = int(sorted(checkpoints.glob("step_*"))[-1].name.removeprefix("step_"))
    assert kill_after <= saved < 7  # killed before the end
    resumed = run(compose_config(overrides(tmp_path, "killed", *args)))
    assert resumed.train_losses == full.train_losses[saved:]
    final_full, final_resumed = weights(full.checkpoint), weights(resumed.checkpoint)
    assert all(torch.equal(final_full[k], final_resumed[k]) for k in final_full)
    assert not list(checkpoints.glob(".*"))  # a torn save was cleaned up


def test_rerunning_a_finished_run_does_nothing_and_names_its_checkpoint(tmp_path: Path) -> None:
    args = overrides(tmp_path, "done", "trainer.max_num_steps=2")
    first = run(compose_config(args))
    summary_path = tmp_path / "done" / "summary.json"
    summary = summary_path.read_text()
    assert json.loads(summary)["checkpoint"] == str(first.checkpoint) and first.final_eval
    done = subprocess.run(
        [sys.executable, "-m", "eagleforge.train", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "already complete" in output and str(first.checkpoint) in output
    assert "eval: loss" not in output and "train: loss" not in output  # no step, no eval again
    assert "None" not in output
    assert summary_path.read_text() == summary  # the finished run's record stays
    assert first.checkpoint is not None
    assert sorted(p.name for p in first.checkpoint.parent.iterdir()) == ["step_00000002"]
    # killed between its last save and writing the summary: the rerun writes one, evaluates
    # nothing
    summary_path.unlink()
    again = run(compose_config(args))
    assert again.already_complete and again.checkpoint == first.checkpoint
    assert not again.final_eval and not again.train_losses
    assert json.loads(summary_path.read_text())["checkpoint"] == str(first.checkpoint)


def test_the_last_checkpoint_is_written_after_the_final_eval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """save_every_n_steps dividing the run's length: the last save still follows the final
    eval, so a run killed after it has nothing left to do."""
    calls: list[str] = []
    real_save, real_evaluate = Trainer.save, Trainer.evaluate

    def save(self: Trainer, name: str | None = None) -> Path:
        calls.append(f"save {self.step}")
        return real_save(self, name)

    def evaluate(self: Trainer) -> dict[str, float]:
        calls.append(f"eval {self.step}")
        return real_evaluate(self)

    monkeypatch.setattr(Trainer, "save", save)
    monkeypatch.setattr(Trainer, "evaluate", evaluate)
    args = ("trainer.max_num_steps=2", "trainer.save_every_n_steps=1")
    result = run(compose_config(overrides(tmp_path, "order", *args)))
    assert calls == ["eval 0", "save 1", "eval 2", "save 2"]
    assert result.checkpoint is not None and read_progress(result.checkpoint)["step"] == 2


def test_a_resumed_run_goes_on_in_the_same_mlflow_run_and_keeps_its_first_eval(
    tmp_path: Path,
) -> None:
    import mlflow

    args = ("tracker=mlflow", "trainer.log_every_n_steps=1")
    first = run(compose_config(overrides(tmp_path, "one", *args, "trainer.max_num_steps=4")))
    resumed = run(compose_config(overrides(tmp_path, "one", *args, "trainer.max_num_steps=6")))
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (only,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    recorded = json.loads((tmp_path / "one" / "mlflow_run.json").read_text())
    assert recorded["run_id"] == only.info.run_id and only.info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(only.info.run_id, "train/loss")]
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    assert resumed.initial_eval == first.initial_eval != {}
    summary = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert summary["initial_eval"] == first.initial_eval
    assert sorted(summary["eval_by_step"]) == ["0", "4", "6"]


def _logged(client, run_id: str, name: str) -> dict[int, float]:  # type: ignore[no-untyped-def]
    return {m.step: m.value for m in client.get_metric_history(run_id, name)}


def test_a_resume_applies_what_may_change_records_it_and_refuses_the_rest(
    tmp_path: Path,
) -> None:
    """The policy of docs/training.md#resuming. A finished 4-step run extended to 6 steps at
    another lr: each step logs the lr it used, which is the config's schedule at that step
    (the cosine stretched over the new length: no step at the old run's final lr of 0); the
    change is logged at its step, and what is recorded is what ran. Another target, or another
    draft, is refused before anything loads, naming the field."""
    import math

    import mlflow
    import yaml

    from eagleforge.errors import ConfigError
    from eagleforge.optim import warmup_cosine

    args = ("tracker=mlflow", "trainer.log_every_n_steps=1", "trainer.save_every_n_steps=0")
    run(compose_config(overrides(tmp_path, "ext", *args, "trainer.max_num_steps=4")))
    extended = run(compose_config(overrides(tmp_path, "ext", *args, "optimizer.lr=2e-3")))
    assert extended.step == 6 and len(extended.train_losses) == 2
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (only,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert only.info.status == "FINISHED"
    lrs = _logged(client, only.info.run_id, "train/lr")
    for step in (1, 2, 3, 4):  # warmup_ratio 0.015 of 4 steps: no warmup step
        assert math.isclose(lrs[step], 1e-3 * warmup_cosine(step - 1, 4, 0, 0.0), rel_tol=1e-6)
    for step in (5, 6):
        assert math.isclose(lrs[step], 2e-3 * warmup_cosine(step - 1, 6, 0, 0.0), rel_tol=1e-6)
    assert lrs[5] > 0
    params = only.data.params
    assert params["optimizer.lr"] == "0.001"  # the start, as logged then
    assert params["resumed_at_step_4.optimizer.lr"] == "0.002"
    assert params["resumed_at_step_4.trainer.max_num_steps"] == "6"
    checkpoint = tmp_path / "ext" / "checkpoints" / "step_00000006"
    assert yaml.safe_load((checkpoint / "config.yaml").read_text())["optimizer"]["lr"] == 2e-3
    record = json.loads((checkpoint / "run.json").read_text())
    assert record["changes"] == [
        {"step": 4, "changes": {"optimizer.lr": [1e-3, 2e-3], "trainer.max_num_steps": [4, 6]}}
    ]
    assert set(record["identity"]) == {"target_weights", "data"}
    for refused, field in (
        ("model.random.seed=1", r"model.random.seed: 0 -> 1"),
        ("draft.ttt_length=2", r"draft.ttt_length: 3 -> 2"),
        ("optimizer.weight_decay=0.1", r"optimizer.weight_decay: 0.0 -> 0.1"),
    ):
        with pytest.raises(ConfigError, match=rf"step_00000006 was trained with other settings \({field}\)"):  # fmt: skip
            run(
                compose_config(
                    overrides(tmp_path, "ext", *args, "trainer.max_num_steps=8", refused)
                )
            )
    # a refused resume changed nothing
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == ["step_00000004", "step_00000006"]


def test_a_refused_resume_leaves_the_runs_record_as_it_was(tmp_path: Path) -> None:
    """From the command line: one line, status 2, and the run directory's record untouched --
    .hydra/ still says what ran, mlflow_run.json still names the run's MLflow run (no FAILED
    run of its own replaces it), no checkpoint written."""
    run_dir = tmp_path / "cli"
    args = [*tiny_run_overrides(tmp_path, "trainer.max_num_steps=2", "tracker=mlflow",
                                "draft.ttt_length=3", name=None), f"hydra.run.dir={run_dir}"]  # fmt: skip
    first = subprocess.run([sys.executable, "-m", "eagleforge.train", *args], capture_output=True,
                           text=True, timeout=300)  # fmt: skip
    assert first.returncode == 0, first.stderr
    before = {
        p: p.read_bytes() for p in [*(run_dir / ".hydra").iterdir(), run_dir / "mlflow_run.json"]
    }
    refused = subprocess.run(
        [sys.executable, "-m", "eagleforge.train", *args, "draft.ttt_length=2",
         "trainer.max_num_steps=4"], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "draft.ttt_length: 3 -> 2" in errors[0]
    assert "Traceback" not in refused.stderr + refused.stdout
    assert {p: p.read_bytes() for p in before} == before
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000002"]


def test_a_target_edited_on_disk_is_refused_on_resume(tmp_path: Path) -> None:
    """Layer 3's down_proj x 1.5 in the target's safetensors, in place, where the sampled
    fingerprint of older eagleforge read nothing: the resume is refused in one line naming the
    target's weights, and nothing of the run changes; with the weights put back it resumes. A
    checkpoint that records an older sampled fingerprint is refused as such."""
    target = tiny_target_copy(tmp_path / "target")
    args = ("model.source=pretrained", f"model.path={target}")
    run(compose_config(overrides(tmp_path, "edited", *args, "trainer.max_num_steps=2")))
    checkpoints = tmp_path / "edited" / "checkpoints"
    record = json.loads((checkpoints / "step_00000002" / "run.json").read_text())
    assert record["identity"]["target_weights"].startswith("xxh3-128:")
    weights, name = target / "model.safetensors", "model.layers.3.mlp.down_proj.weight"
    original = weights.read_bytes()
    assert not overlaps(tensor_span(weights, name)[:2], sampled_spans(weights))
    scale_tensor(weights, name, 1.5)
    with pytest.raises(ResumeRefused) as refused:
        run(compose_config(overrides(tmp_path, "edited", *args, "trainer.max_num_steps=3")))
    message = str(refused.value)
    assert "\n" not in message
    assert "step_00000002 was trained on other inputs: the target's weights (model.*)" in message
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000002"]
    weights.write_bytes(original)
    resumed = run(compose_config(overrides(tmp_path, "edited", *args, "trainer.max_num_steps=3")))
    assert resumed.step == 3
    # as a checkpoint of an older eagleforge records it (checksums.json agreeing)
    step_3 = checkpoints / "step_00000003"
    record = json.loads((step_3 / "run.json").read_text())
    record["identity"]["target_weights"] = "0123456789abcdef0123456789abcdef"
    (step_3 / "run.json").write_text(json.dumps(record))
    record_checksums(step_3)
    with pytest.raises(ResumeRefused) as refused:
        run(compose_config(overrides(tmp_path, "edited", *args, "trainer.max_num_steps=4")))
    message = str(refused.value)
    assert "\n" not in message
    assert (
        "run.json records the target's weights (identity.target_weights) by the sampled " in message
    )
    assert f"model.draft_init={step_3}" in message


def _mlflow_runs(store: Path) -> list[tuple[str, str]]:
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{store}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    return sorted((r.info.run_id, r.info.status) for r in client.search_runs(experiments))


def test_every_refusal_of_a_resume_leaves_the_runs_record_and_mlflow_as_they_were(
    tmp_path: Path,
) -> None:
    """From the command line, each kind of refused resume -- a damaged checkpoint, one of a
    newer format, other inputs (run.json's identity), a changed setting -- prints one line,
    exits 2, and leaves the run's .hydra/ and the MLflow store as they were: no FAILED run,
    no overrides rewritten with the refused command."""
    from eagleforge.checkpoint import RUN_RECORD

    run_dir = tmp_path / "cli"
    args = [*tiny_run_overrides(tmp_path, "trainer.max_num_steps=2", "tracker=mlflow",
                                "draft.ttt_length=3", name=None), f"hydra.run.dir={run_dir}"]  # fmt: skip
    command = [sys.executable, "-m", "eagleforge.train", *args]
    first = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    step_2 = run_dir / "checkpoints" / "step_00000002"
    saved = {p: p.read_bytes() for p in step_2.iterdir()}
    record = json.loads((step_2 / RUN_RECORD).read_text())
    before = {p: p.read_bytes() for p in [*(run_dir / ".hydra").iterdir(), run_dir / "mlflow_run.json"]}  # fmt: skip
    runs_before = _mlflow_runs(tmp_path / "mlflow.db")
    assert [status for _, status in runs_before] == ["FINISHED"]

    def rewrite_record(**changes: object) -> None:
        (step_2 / RUN_RECORD).write_text(json.dumps({**record, **changes}))
        record_checksums(step_2)  # the checksums agree: only what run.json says is refused

    def flip_a_weight() -> None:
        data = bytearray((step_2 / "model.safetensors").read_bytes())
        data[-1] ^= 0x01
        (step_2 / "model.safetensors").write_bytes(bytes(data))

    kinds = [
        (flip_a_weight, [], "every checkpoint is damaged (step_00000002: model.safetensors"),
        (lambda: rewrite_record(version=record["version"] + 1), [], "written by a newer"),
        (lambda: rewrite_record(identity={**record["identity"], "data": "other/train"}), [],
         "trained on other inputs: the training data"),
        (lambda: None, ["draft.ttt_length=2"], "other settings (draft.ttt_length: 3 -> 2)"),
    ]  # fmt: skip
    for tamper, extra, said in kinds:
        tamper()
        refused = subprocess.run([*command, "trainer.max_num_steps=4", *extra],
                                 capture_output=True, text=True, timeout=300)  # fmt: skip
        assert refused.returncode == 2, refused.stderr[-3000:]
        errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and said in errors[0], refused.stderr[-3000:]
        assert "Traceback" not in refused.stderr + refused.stdout
        assert {p: p.read_bytes() for p in before} == before, said
        assert _mlflow_runs(tmp_path / "mlflow.db") == runs_before, said
        for path, data in saved.items():  # the checkpoint as saved, for the next kind
            path.write_bytes(data)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000002"]
