"""A checkpoint records the sha256 of its files when saved: a flipped byte is found before the
run resumes from it. Resuming automatically skips it (with a warning) for the one before; a
checkpoint given explicitly stops the run; checkpoints without checksums still load."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from eagleforge.builder import resume_from
from eagleforge.checkpoint import newest_checkpoint, save_checkpoint
from eagleforge.draft.attention import AttentionBackend
from eagleforge.draft.ttt import TTTModule
from eagleforge.errors import CheckpointError, ConfigError, ResumeRefused
from eagleforge.files import CHECKSUMS
from eagleforge.formats.directory import check_draft, load_checked_draft
from eagleforge.parallel import ParallelDims
from eagleforge.parallel.dist import World
from helpers.drafts import tiny_draft

pytestmark = pytest.mark.unit


def save_steps(output_dir: Path, *steps: int) -> list[Path]:
    module = TTTModule(tiny_draft(), 2, AttentionBackend.eager)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    world = World(torch.device("cpu"), ParallelDims())
    return [
        save_checkpoint(
            output_dir / "checkpoints" / f"step_{step:08d}",
            module,
            optimizer,
            scheduler,
            {"step": step},
            "a: 1\n",
            world,
        )
        for step in steps
    ]


def flip_last_byte(path: Path) -> None:
    """One bit of the last tensor's data: the file still parses, a weight is off."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def test_auto_resume_skips_a_corrupt_checkpoint_for_the_one_before(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = save_steps(tmp_path, 2, 4)
    assert newest_checkpoint(tmp_path) == second
    flip_last_byte(second / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="eagleforge"):
        assert newest_checkpoint(tmp_path) == first
        assert resume_from("auto", tmp_path) == first
    assert "step_00000004" in caplog.text and "model.safetensors" in caplog.text


def test_explicit_resume_of_a_corrupt_checkpoint_is_a_config_error(tmp_path: Path) -> None:
    (checkpoint,) = save_steps(tmp_path, 2)
    assert resume_from(str(checkpoint), tmp_path) == checkpoint
    flip_last_byte(checkpoint / "model.safetensors")
    with pytest.raises(ConfigError, match=r"trainer.resume=.*step_00000002: model.safetensors "
                       r"does not match its checksum") as error:  # fmt: skip
        resume_from(str(checkpoint), tmp_path)
    assert "\n" not in str(error.value)


def test_every_checkpoint_corrupt_stops_instead_of_starting_over(tmp_path: Path) -> None:
    (checkpoint,) = save_steps(tmp_path, 2)
    flip_last_byte(checkpoint / "training_state.pt")
    with pytest.raises(CheckpointError, match=r"step_00000002: training_state.pt does not match"):
        newest_checkpoint(tmp_path)


def test_a_missing_file_is_corruption(tmp_path: Path) -> None:
    first, second = save_steps(tmp_path, 2, 4)
    (second / "config.json").unlink()
    assert newest_checkpoint(tmp_path) == first


def test_checkpoints_without_checksums_load_unverified(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (checkpoint,) = save_steps(tmp_path, 2)
    (checkpoint / CHECKSUMS).unlink()  # as written before checksums were recorded
    with caplog.at_level(logging.INFO, logger="eagleforge"):
        assert newest_checkpoint(tmp_path) == checkpoint
        assert resume_from(str(checkpoint), tmp_path) == checkpoint
    assert "unverified" in caplog.text


def test_a_corrupt_checkpoint_is_refused_as_a_draft(tmp_path: Path) -> None:
    """model.draft_init, eagleforge.evaluate and eagleforge.export read checkpoints through
    check_draft / load_checked_draft: a flipped byte is named there too."""
    (checkpoint,) = save_steps(tmp_path, 2)
    assert check_draft(checkpoint) == []
    flip_last_byte(checkpoint / "model.safetensors")
    (problem,) = check_draft(checkpoint)
    assert "model.safetensors does not match its checksum" in problem
    with pytest.raises(ConfigError, match="files are corrupt"):
        load_checked_draft(checkpoint, 6)


class _RunsCode:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (print, ("this ran",))


@pytest.mark.parametrize("content", ["raw pickle", "code, checksums forged"])
def test_a_training_state_that_is_not_ours_is_named_without_torch_advice(
    tmp_path: Path, content: str
) -> None:
    """A raw pickle (torch's mmap complaint) or a torch.save archive holding code under
    recomputed checksums (torch's multi-line refusal, with its hint that weights_only=False
    'will likely succeed'): one line each, and never that hint."""
    import pickle

    from eagleforge.checkpoint import TRAINING_STATE, read_progress
    from eagleforge.files import record_checksums

    (checkpoint,) = save_steps(tmp_path, 2)
    state = checkpoint / TRAINING_STATE
    if content == "raw pickle":
        state.write_bytes(pickle.dumps({"progress": {"step": 2}}))
    else:
        torch.save({"progress": {"step": 2}, "x": _RunsCode()}, state)
    record_checksums(checkpoint)
    with pytest.raises(CheckpointError) as refused:
        read_progress(checkpoint)
    message = str(refused.value)
    assert "\n" not in message and "weights_only" not in message and "mmap" not in message
    expected = "not a torch.save archive" if content == "raw pickle" else "never unpickles"
    assert expected in message


def test_a_checkpoint_without_its_training_state_is_passed_over_with_a_word(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = save_steps(tmp_path, 2, 4)
    (second / "training_state.pt").unlink()
    with caplog.at_level(logging.WARNING, logger="eagleforge"):
        assert newest_checkpoint(tmp_path) == first
    assert "step_00000004 is damaged (no training_state.pt)" in caplog.text
    assert "saves this step anew" in caplog.text
    # given explicitly, it is named as the run's own damaged checkpoint
    with pytest.raises(
        ConfigError, match=r"step_00000004: no training_state.pt, so the checkpoint is damaged"
    ):
        resume_from(str(second), tmp_path)


def test_weights_and_checksums_both_gone_fall_back_with_the_runs_own_advice(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = save_steps(tmp_path, 2, 4)
    (second / "model.safetensors").unlink()
    (second / CHECKSUMS).unlink()
    with caplog.at_level(logging.WARNING, logger="eagleforge"):
        assert newest_checkpoint(tmp_path) == first
    assert "step_00000004 is damaged (no model.safetensors" in caplog.text
    with pytest.raises(ConfigError, match=r"no model.safetensors, so the checkpoint is damaged"):
        resume_from(str(second), tmp_path)
    (first / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"every checkpoint is damaged") as error:
        newest_checkpoint(tmp_path)
    assert "export" not in str(error.value)
    assert isinstance(error.value, ResumeRefused)  # the run's record is left as it was


def test_checkpoints_carry_a_format_version_and_a_newer_one_is_refused(tmp_path: Path) -> None:
    import json

    from eagleforge.checkpoint import CHECKPOINT_VERSION, RUN_RECORD
    from eagleforge.files import record_checksums

    first, second = save_steps(tmp_path, 2, 4)
    record = json.loads((second / RUN_RECORD).read_text())
    assert record["format"] == "eagleforge-checkpoint"
    assert record["version"] == CHECKPOINT_VERSION
    record["version"] = CHECKPOINT_VERSION + 1  # written by a future eagleforge
    (second / RUN_RECORD).write_text(json.dumps(record))
    record_checksums(second)
    # not passed over for step 2 (the run would go back and overwrite the newer one)
    with pytest.raises(CheckpointError, match=r"step_00000004: written by a newer eagleforge") as e:
        newest_checkpoint(tmp_path)
    assert isinstance(e.value, ResumeRefused)
    with pytest.raises(ResumeRefused, match=r"checkpoint format v2; this one reads up to v1"
                       r"\); resume it with that version, or start a new run in another "
                       r"directory"):  # fmt: skip
        resume_from(str(second), tmp_path)
    # the advice does not destroy what it refused: a new run here would write over it
    with pytest.raises(ResumeRefused, match=r"^trainer.resume=never: .*step_00000004 was written "
                       r"by a newer eagleforge \(checkpoint format v2\) and a new run here"):  # fmt: skip
        resume_from("never", tmp_path)
    assert json.loads((second / RUN_RECORD).read_text())["version"] == CHECKPOINT_VERSION + 1


def test_a_checkpoint_of_another_target_or_other_data_is_refused(tmp_path: Path) -> None:
    import json

    from eagleforge.checkpoint import RUN_RECORD, check_identity, run_record

    (checkpoint,) = save_steps(tmp_path, 2)
    identity = {"target_weights": "a1", "data": "k/train"}
    (checkpoint / RUN_RECORD).write_text(json.dumps(run_record(identity, [])))
    check_identity(checkpoint, identity)
    with pytest.raises(ConfigError, match=r"trained on other inputs: the target's weights") as e:
        check_identity(checkpoint, {**identity, "target_weights": "b2"})
    assert isinstance(e.value, ResumeRefused)
    with pytest.raises(ResumeRefused, match=r"trained on other inputs: the training data"):
        check_identity(checkpoint, {**identity, "data": "other/train"})


def _schema_fields(cls: type, prefix: str = "") -> set[str]:
    """Every section and field of a config dataclass, as flattened keys (``optimizer``,
    ``optimizer.muon``, ``optimizer.muon.lr_ratio``, ...)."""
    import dataclasses
    import typing

    found = set()
    for name, hint in typing.get_type_hints(cls).items():
        key = f"{prefix}{name}"
        found.add(key)
        inner = [a for a in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(a)]
        if inner:
            found |= _schema_fields(inner[0], key + ".")  # type: ignore[arg-type]
    return found


def test_every_section_of_the_config_is_classified_for_resume() -> None:
    """Each top-level section and field of the root schema is named as either resumable or
    defining the run -- once -- so that a new one cannot be left out silently (as llamacpp
    was, which refused a resume that changed the judge); and every name is a real field."""
    import dataclasses

    from eagleforge.checkpoint import DEFINES_RUN, RESUMABLE
    from eagleforge.config import EagleForgeConfig

    top = {f.name for f in dataclasses.fields(EagleForgeConfig)}
    named = [name for name in (*RESUMABLE, *DEFINES_RUN) if "." not in name]
    assert sorted(named) == sorted(top)  # every one, none twice
    assert not set(RESUMABLE) & set(DEFINES_RUN)
    assert set(RESUMABLE) | set(DEFINES_RUN) <= _schema_fields(EagleForgeConfig)


def test_a_resume_may_change_the_judges_and_what_is_resumable_inside_a_run_defining_section(
    tmp_path: Path,
) -> None:
    from eagleforge.checkpoint import resumable, resume_changes

    saved = {
        "llamacpp.threads": 2,
        "vllm.max_model_len": 2048,
        "optimizer.lr": 1e-3,
        "optimizer.muon.lr_ratio": 0.2,
        "optimizer.muon.momentum": 0.95,
        "seed": 0,
    }
    now = {**saved, "llamacpp.threads": 4, "vllm.max_model_len": 4096, "optimizer.lr": 2e-3}
    assert resume_changes(saved, now, tmp_path) == {
        "llamacpp.threads": (2, 4),
        "vllm.max_model_len": (2048, 4096),
        "optimizer.lr": (1e-3, 2e-3),
    }
    assert resumable("optimizer.muon.lr_ratio") and not resumable("optimizer.muon.momentum")
    assert not resumable("seed") and not resumable("a_section_no_list_names.field")
    assert resumable("loss.kernel") and not resumable("loss.kind")  # how it runs, not what
    with pytest.raises(ResumeRefused, match=r"other settings \(optimizer.muon.momentum: 0.95 -> 0.9; seed: 0 -> 1\)"):  # fmt: skip
        resume_changes(saved, {**now, "optimizer.muon.momentum": 0.9, "seed": 1}, tmp_path)
