"""python -m eagleforge.inspect_data: counts, histogram and marked samples; named errors."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from eagleforge.config import compose_config
from eagleforge.inspect_data import inspect

pytestmark = pytest.mark.integration
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def test_inspect_prints_counts_and_marks_supervised_text(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    bad_row = '{"messages": [{"role": "user", "content": "only a question"}]}\n'
    data = tmp_path / "chats.jsonl"
    data.write_text((FIXTURES / "openai_small.jsonl").read_text() + bad_row)
    inspect(compose_config([
        "+model=smollm2", "data=jsonl", f"data.path={data}", "data.on_error=skip",
        "data.num_eval_samples=0", "inspect.num_samples=1", "inspect.color=false",
        "output_dir=unused",
    ]))  # fmt: skip
    out = capsys.readouterr().out
    assert "rows read:          5" in out and "kept:               4" in out
    assert "no_assistant_turn   1" in out
    assert "length histogram:" in out
    assert "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n⟦4<|im_end|>⟧" in out


def test_inspect_bad_row_exits_2_naming_file_and_line(tmp_path: Path) -> None:
    data = tmp_path / "chats.jsonl"
    data.write_text((FIXTURES / "openai_small.jsonl").read_text() + "{not json\n")
    proc = subprocess.run(
        [sys.executable, "-m", "eagleforge.inspect_data", "+model=smollm2", "data=jsonl",
         f"data.path={data}", f"output_root={tmp_path}"],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2
    assert f"error: {data}:5: not valid JSON" in proc.stderr
    assert "data.on_error=skip" in proc.stderr


def test_inspect_needs_no_eval_split(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """A file too small to hold anything out is inspected whole, whatever num_eval_samples says."""
    data = tmp_path / "chats.jsonl"
    data.write_text((FIXTURES / "openai_small.jsonl").read_text())
    inspect(compose_config([
        "+model=smollm2", "data=jsonl", f"data.path={data}", "data.num_eval_samples=64",
        "inspect.num_samples=0", "inspect.num_buckets=1", "output_dir=unused",
    ]))  # fmt: skip
    out = capsys.readouterr().out
    assert "kept:               4" in out
    assert re.search(r"^\s+1-\d+\s+4\s", out, re.MULTILINE), out
