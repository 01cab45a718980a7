"""A regenerate that is refused or fails says so in one line and leaves nothing it made: a
server's error page becomes status, URL and a short reason (the body goes to the debug log);
no empty ``<name>.chunks/``, lock file or output directory stays behind. The lock file of an
output goes with its lock, safely for a writer that opened it meanwhile."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from eagleforge import locking
from eagleforge.config import compose_config, to_typed
from eagleforge.errors import ConfigError
from eagleforge.locking import beside, exclusive
from eagleforge.regenerate import run
from eagleforge.regeneration.rows import Reply, RequestFailed
from helpers.http_stand_in import QuietHandler, serving

pytestmark = pytest.mark.unit
FIXTURE = Path(__file__).parents[1] / "fixtures" / "sharegpt_small.jsonl"
TOO_LONG = "This model's maximum context length is 2048 tokens.\nPlease reduce the length."


class WrongServer(QuietHandler):
    """A web server that is not an OpenAI-compatible one (an HTML 404 page of 11 lines), but
    answers chat completions with a JSON error, as vLLM does for a too-long prompt."""

    def do_GET(self) -> None:
        self.send_error(404)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({"object": "error", "message": TOO_LONG, "code": 400}).encode()
        self.send_body(body, status=400, content_type="application/json")


@pytest.fixture
def server() -> Iterator[str]:
    with serving(WrongServer) as url:
        yield url


def config(output: Path, *extra: str):  # type: ignore[no-untyped-def]
    return to_typed(compose_config([
        "+model=smollm2", "data=sharegpt", f"data.path={FIXTURE}", f"regenerate.output={output}",
        "regenerate.max_retries=0", "regenerate.max_rows=2", f"output_dir={output.parent}",
        *extra]))  # fmt: skip


def test_a_server_error_page_is_one_line_and_nothing_is_left(tmp_path: Path, server: str) -> None:
    output = tmp_path / "out" / "regen.jsonl"
    with pytest.raises(ConfigError) as refused:
        run(config(output, f"regenerate.base_urls=[{server}/v1]"))
    message = str(refused.value)
    assert f"HTTP 404 from {server}/v1/models: Not Found)" in message
    assert "\n" not in message and "<" not in message
    assert list(tmp_path.iterdir()) == []  # no out/, no chunks, no lock file


def test_a_json_error_is_the_short_reason(tmp_path: Path, server: str) -> None:
    output = tmp_path / "regen.jsonl"
    run(config(output, f"regenerate.base_urls=[{server}/v1]", "regenerate.model=m"))
    failures = output.with_name("regen.jsonl.failed.jsonl").read_text().splitlines()
    reason = json.loads(failures[0])["reason"]
    assert reason == (
        f"HTTP 400 from {server}/v1/chat/completions: This model's maximum context length is "
        "2048 tokens. Please reduce the length."
    )
    # a finished job leaves its output, settings and failures, and no lock file
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "regen.jsonl",
        "regen.jsonl.failed.jsonl",
        "regen.jsonl.settings.json",
    ]


def test_a_refusal_leaves_nothing_it_made(tmp_path: Path) -> None:
    output = tmp_path / "regen.jsonl"
    output.write_text("")  # a finished job's

    def target(histories: list[list[dict]]) -> list[Reply | RequestFailed]:  # type: ignore[type-arg]
        return [Reply("hi") for _ in histories]

    with pytest.raises(ConfigError, match=r"regen\.jsonl exists \(a finished job\)"):
        run(config(output), target)
    assert list(tmp_path.iterdir()) == [output]
    # an unreadable source row with data.on_error=raise: refused before any work
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"conversations": 3}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:1: "):
        run(config(tmp_path / "sub" / "o.jsonl", f"data.path={bad}", "data.on_error=raise"), target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "regen.jsonl"]


def test_the_lock_file_goes_with_the_lock(tmp_path: Path) -> None:
    lock = beside(tmp_path / "o.jsonl")
    with exclusive(lock, output=tmp_path / "o.jsonl", field="f", remove=True):
        assert lock.exists()
    assert not lock.exists()
    with exclusive(lock, output=tmp_path / "o.jsonl", field="f"):  # kept unless asked
        pass
    assert lock.exists()


def test_a_writer_that_opened_a_removed_lock_file_locks_the_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its holder removed the file between our open and our flock: the lock we took is on a
    file nobody else will open, so we lock the one at the path instead."""
    lock, opened = tmp_path / ".o.lock", []
    real_open = os.open

    def open_then_removed(path: str, flags: int, mode: int = 0o777) -> int:
        fd = real_open(path, flags, mode)
        if not opened:
            os.unlink(path)
        opened.append(fd)
        return fd

    monkeypatch.setattr(locking.os, "open", open_then_removed)
    fd = locking.acquire(lock, output=tmp_path / "o", field="f")
    monkeypatch.undo()
    try:
        assert len(opened) == 2 and fd == opened[1]
        assert os.fstat(fd).st_ino == os.stat(lock).st_ino
    finally:
        locking.release(fd)
