"""Atomic writes appear whole or not at all; temporary directories left by killed writers are
removed, and only those: never a live writer's, never one of another host that may still be
written."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagleforge.atomic import (
    STALE_AFTER_S,
    DiskFull,
    atomic_directory,
    atomic_file,
    remove_stale_temps,
    this_host,
    writer_temp_dir,
)
from helpers.processes import dead_pid

pytestmark = pytest.mark.unit


def _temp(parent: Path, name: str, age_s: float = 0.0) -> Path:
    path = parent / name
    (path / "dataset").mkdir(parents=True)
    (path / "dataset" / "data.arrow").write_bytes(b"partial")
    then = time.time() - age_s
    for p in (path / "dataset" / "data.arrow", path / "dataset", path):
        os.utime(p, (then, then))
    return path


def test_only_abandoned_temporaries_are_removed(tmp_path: Path) -> None:
    host, day = this_host(), STALE_AFTER_S + 60
    dead = _temp(tmp_path, f".k1.{dead_pid()}@{host}.abcd1234")
    live = _temp(tmp_path, f".k2.{os.getppid()}@{host}.abcd1234")
    mine = _temp(tmp_path, f".k3.{os.getpid()}@{host}.abcd1234", age_s=day)
    other_host_recent = _temp(tmp_path, ".k4.1@elsewhere.example.abcd1234", age_s=3600)
    other_host_old = _temp(tmp_path, ".k5.1@elsewhere.example.abcd1234", age_s=day)
    unnamed_recent = _temp(tmp_path, ".k6.abcd1234", age_s=3600)
    unnamed_old = _temp(tmp_path, ".k7.abcd1234", age_s=day)
    entry = _temp(tmp_path, "k8", age_s=day)  # a finished entry
    dotted = _temp(tmp_path, ".cache", age_s=day)  # not a temporary directory
    (other_host_old / "dataset" / "new.arrow").write_bytes(b"still written")  # touched now
    removed = remove_stale_temps(tmp_path)
    assert sorted(removed) == sorted([dead, unnamed_old])
    for kept in (live, mine, other_host_recent, other_host_old, unnamed_recent, entry, dotted):
        assert kept.is_dir(), kept
    assert remove_stale_temps(tmp_path / "missing") == []


def test_a_write_killed_midway_is_cleaned_by_the_next_write(tmp_path: Path) -> None:
    final = tmp_path / "data" / "key"
    killed = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from eagleforge.atomic import atomic_directory\n"
        f"with atomic_directory(Path({str(final)!r}), complete='report.json') as out:\n"
        "    (out / 'half').write_text('x')\n"
        "    os._exit(9)\n"
    )
    assert subprocess.run([sys.executable, "-c", killed], check=False).returncode == 9
    (left,) = final.parent.iterdir()
    assert left.name.startswith(".key.")
    with atomic_directory(final, complete="report.json") as out:
        (out / "report.json").write_text("{}")
    assert [p.name for p in final.parent.iterdir()] == ["key"]


def test_writer_temp_dir_is_named_by_its_writer(tmp_path: Path) -> None:
    tmp = writer_temp_dir(tmp_path / "sub" / "model")
    assert tmp.parent == tmp_path / "sub" and tmp.is_dir()
    assert tmp.name.startswith(f".model.{os.getpid()}@{this_host()}.")
    assert remove_stale_temps(tmp.parent) == []  # this process is alive


def test_a_killed_model_conversion_is_cleaned_by_the_next_lookup(tmp_path: Path) -> None:
    from eagleforge.targets.source import _atomic_build

    final = tmp_path / "models" / "converted"
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")
    left = _temp(final.parent, f".converted.{dead_pid()}@{this_host()}.abcd1234")

    def build(_: Path) -> None:
        raise AssertionError("a cached model is not built again")

    assert _atomic_build(final, build) == final
    assert not left.exists() and final.is_dir()


def test_a_failed_directory_write_leaves_the_old_one_whole(tmp_path: Path) -> None:
    final = tmp_path / "best"
    with atomic_directory(final) as out:
        (out / "weights").write_text("old")
    with pytest.raises(RuntimeError), atomic_directory(final, replace=True) as out:
        (out / "weights").write_text("half")
        raise RuntimeError("disk full")
    assert (final / "weights").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["best"]
    with atomic_directory(final, replace=True, durable=True) as out:
        (out / "weights").write_text("new")
    assert (final / "weights").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["best"]


def test_without_replace_an_existing_directory_is_an_error(tmp_path: Path) -> None:
    final = tmp_path / "export"
    (final / "x").parent.mkdir()
    (final / "x").write_text("theirs")
    with pytest.raises(OSError), atomic_directory(final) as out:
        (out / "y").write_text("ours")
    assert [p.name for p in final.iterdir()] == ["x"]
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


def test_a_complete_entry_of_another_writer_is_kept_a_torn_one_replaced(tmp_path: Path) -> None:
    final = tmp_path / "entry"
    final.mkdir()
    (final / "half").write_text("torn")  # no report.json: half-written by something else
    with atomic_directory(final, complete="report.json") as out:
        (out / "report.json").write_text("ours")
    assert [p.name for p in final.iterdir()] == ["report.json"]
    with atomic_directory(final, complete="report.json") as out:  # lost the race: kept
        (out / "report.json").write_text("second")
    assert (final / "report.json").read_text() == "ours"
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]


def test_atomic_file_replaces_whole_or_not_at_all(tmp_path: Path) -> None:
    path = tmp_path / "manifest.json"
    with atomic_file(path) as tmp:
        tmp.write_text("one")
    with pytest.raises(ValueError), atomic_file(path) as tmp:
        tmp.write_text("tw")
        raise ValueError("killed")
    assert path.read_text() == "one"
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_a_write_on_a_full_disk_is_named_in_one_line(tmp_path: Path) -> None:
    """The temporary file is /dev/full: torch.save's short write ("unexpected pos") and a
    plain write end in one DiskFull naming the final path, as does safetensors' error (its
    save_file replaces a symlink, so its error is raised as it words it)."""
    import torch
    from safetensors import SafetensorError

    def safetensors_full(tmp: Path) -> None:
        raise SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    writes = {
        "torch.save": lambda tmp: torch.save({"w": torch.zeros(4096)}, tmp),
        "safetensors": safetensors_full,
        "text": lambda tmp: tmp.write_text("x" * 65536),
    }
    for what, write in writes.items():
        final = tmp_path / f"{what}.out"
        final.write_text("the earlier version\n")
        with pytest.raises(DiskFull) as full, atomic_file(final) as tmp:
            tmp.symlink_to("/dev/full")
            write(tmp)
        message = str(full.value)
        assert message.startswith(f"{final}: no space left on device (") and "\n" not in message
        assert "free space and run the same command again" in message
        assert final.read_text() == "the earlier version\n"  # untouched
        assert not tmp.exists() and not tmp.is_symlink()


def test_other_errors_are_not_called_a_full_disk(tmp_path: Path) -> None:
    with pytest.raises(PermissionError), atomic_directory(tmp_path / "d"):
        raise PermissionError(13, "Permission denied")
    with pytest.raises(RuntimeError, match="a bug"), atomic_file(tmp_path / "f"):
        raise RuntimeError("a bug")
