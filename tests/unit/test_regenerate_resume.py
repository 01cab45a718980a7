"""Resuming an interrupted regeneration: every source row exactly once whatever
``regenerate.chunk_rows`` the second run uses, and a clear refusal when a setting that
defines the data (sampling, model, source) changed. The target is a scripted function."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagleforge.config import compose_config, to_typed
from eagleforge.errors import ConfigError
from eagleforge.regenerate import run
from eagleforge.regeneration.rows import Reply, RequestFailed

pytestmark = pytest.mark.unit
FIXTURE = Path(__file__).parents[1] / "fixtures" / "sharegpt_small.jsonl"
NUM_ROWS = len(FIXTURE.read_text().splitlines())


class Killed(Exception):
    """Stands for the job being killed."""


def target(histories: list[list[dict]]) -> list[Reply | RequestFailed]:  # type: ignore[type-arg]
    """Replies that depend only on their history, so two runs write the same rows."""
    return [Reply(f"reply to {h[-1]['content'][:20]!r}") for h in histories]


def killed_after(num_chunks: int, chunks_dir: Path):  # type: ignore[no-untyped-def]
    """``target``, killed before the first turn of the chunk after ``num_chunks`` chunks."""

    def generate(histories: list[list[dict]]) -> list[Reply | RequestFailed]:  # type: ignore[type-arg]
        chunks = [p for p in chunks_dir.glob("*.jsonl") if not p.name.endswith(".failed.jsonl")]
        if len(chunks) >= num_chunks:
            raise Killed
        return target(histories)

    return generate


def config(output: Path, *extra: str, data: Path = FIXTURE):  # type: ignore[no-untyped-def]
    return to_typed(compose_config([
        "+model=smollm2", "data=sharegpt", f"data.path={data}", f"regenerate.output={output}",
        "regenerate.model=target-a", f"output_dir={output.parent}", *extra]))  # fmt: skip


def rows(path: Path) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in path.read_text().splitlines()]


def interrupted(output: Path, *extra: str) -> None:
    """A run with chunks of 2 rows, killed after two chunks (4 of the rows done)."""
    with pytest.raises(Killed):
        run(config(output, "regenerate.chunk_rows=2", *extra), killed_after(2, _chunks(output)))


def _chunks(output: Path) -> Path:
    return output.with_name(f"{output.name}.chunks")


@pytest.mark.parametrize("chunk_rows", [1, 2, 3, 5])
def test_resume_with_other_chunk_rows_writes_every_row_once(
    tmp_path: Path, chunk_rows: int
) -> None:
    reference = tmp_path / "reference.jsonl"
    run(config(reference), target)
    output = tmp_path / "regen.jsonl"
    interrupted(output)
    summary = run(config(output, f"regenerate.chunk_rows={chunk_rows}"), target)
    assert summary.rows == NUM_ROWS - 4 and summary.written == NUM_ROWS
    assert rows(output) == rows(reference)  # same rows, same order, none twice
    assert not _chunks(output).exists()


@pytest.mark.parametrize(
    "override",
    [
        "regenerate.temperature=0.7",
        "regenerate.top_p=0.9",
        "regenerate.max_new_tokens=7",
        "regenerate.model=target-b",
        "regenerate.keep_reasoning=true",
    ],
)
def test_resume_with_other_sampling_or_model_is_refused(tmp_path: Path, override: str) -> None:
    output = tmp_path / "regen.jsonl"
    interrupted(output)
    field, value = override.split("=")
    with pytest.raises(ConfigError, match=rf"{field}={value}.*other regenerate\.output"):
        run(config(output, "regenerate.chunk_rows=2", override), target)
    # the old value resumes
    assert run(config(output, "regenerate.chunk_rows=2"), target).written == NUM_ROWS


def test_resume_with_other_source_data_is_refused(tmp_path: Path) -> None:
    output = tmp_path / "regen.jsonl"
    interrupted(output)
    edited = tmp_path / "edited.jsonl"
    lines = FIXTURE.read_text().splitlines()
    edited.write_text("\n".join([lines[1], lines[0], *lines[2:]]) + "\n")  # rows swapped
    with pytest.raises(ConfigError, match=r"data\.path"):
        run(config(output, "regenerate.chunk_rows=2", data=edited), target)
    with pytest.raises(ConfigError, match=r"regenerate\.max_rows"):
        run(config(output, "regenerate.chunk_rows=2", "regenerate.max_rows=5"), target)


def test_settings_are_kept_beside_the_output(tmp_path: Path) -> None:
    output = tmp_path / "regen.jsonl"
    run(config(output, "regenerate.temperature=0.5"), target)
    settings = json.loads(output.with_name("regen.jsonl.settings.json").read_text())
    assert settings["temperature"] == 0.5 and settings["model"] == "target-a"
    assert settings["source"]["rows"] == NUM_ROWS


def test_a_stopped_job_says_how_many_conversations_it_kept(tmp_path: Path) -> None:
    """The line a stop signal or Ctrl-C ends a job with counts the rows of its chunks on disk
    (not their failures' files) and says that the same command goes on."""
    from eagleforge.regenerate import stop_line

    output = tmp_path / "regen.jsonl"
    assert stop_line(str(output), "stopped by SIGTERM").startswith(
        "stopped by SIGTERM: regenerate stopped before its end; 0 conversations are written"
    )
    interrupted(output)
    assert stop_line(str(output), "interrupted (Ctrl-C)") == (
        "interrupted (Ctrl-C): regenerate stopped before its end; 4 conversations are written, "
        f"in chunks in {_chunks(output)}, and kept; run the same command again to go on from "
        "there."
    )
