"""Temporary directories of cache writes left by killed writers are removed, and only those:
never a live writer's, never one of another host that may still be written."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagleforge.data.dataset import write_atomically
from eagleforge.tempdirs import STALE_AFTER_S, remove_stale_temps, this_host, writer_temp_dir

pytestmark = pytest.mark.unit


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


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
    dead = _temp(tmp_path, f".k1.{_dead_pid()}@{host}.abcd1234")
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
        "from eagleforge.data.dataset import write_atomically\n"
        "def write(out):\n"
        "    (out / 'half').write_text('x')\n"
        "    os._exit(9)\n"
        f"write_atomically(Path({str(final)!r}), write, 'report.json')\n"
    )
    assert subprocess.run([sys.executable, "-c", killed], check=False).returncode == 9
    (left,) = final.parent.iterdir()
    assert left.name.startswith(".key.")
    write_atomically(final, lambda out: (out / "report.json").write_text("{}"), "report.json")
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
    left = _temp(final.parent, f".converted.{_dead_pid()}@{this_host()}.abcd1234")

    def build(_: Path) -> None:
        raise AssertionError("a cached model is not built again")

    assert _atomic_build(final, build) == final
    assert not left.exists() and final.is_dir()
