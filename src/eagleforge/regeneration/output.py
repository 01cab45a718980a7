"""The files of a resumable regeneration job: chunks named by the source rows they cover,
the settings they were made with, and the output they are joined into.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path
from typing import Any

from eagleforge.atomic import atomic_file
from eagleforge.data.config import DataConfig
from eagleforge.data.conversations import source_files
from eagleforge.errors import ConfigError
from eagleforge.regeneration.config import RegenerateConfig
from eagleforge.regeneration.rows import Row

# A chunk file is named by the source rows it covers, [start, end): resume needs no chunk size.
CHUNK_NAME = re.compile(r"^(\d+)-(\d+)\.jsonl$")
OLD_CHUNK_NAME = re.compile(r"^\d{6}\.jsonl$")  # numbered chunks, before settings were kept


def chunk_path(chunks_dir: Path, span: tuple[int, int], suffix: str = ".jsonl") -> Path:
    return chunks_dir / f"{span[0]:09d}-{span[1]:09d}{suffix}"


def finished_chunks(chunks_dir: Path, num_rows: int) -> list[tuple[int, int]]:
    """The source row spans [start, end) whose chunks are on disk, in order; ConfigError for a
    file that cannot be a chunk of this job."""
    spans = []
    for path in sorted(chunks_dir.glob("*.jsonl")):
        if OLD_CHUNK_NAME.match(path.name):
            raise ConfigError(
                f"{chunks_dir} holds chunks of an older eagleforge, which did not record the "
                "settings they were made with; finish the job with that version, or remove the "
                "directory to start over."
            )
        if (match := CHUNK_NAME.match(path.name)) is not None:
            spans.append((int(match.group(1)), int(match.group(2))))
    for (start, end), previous_end in zip(spans, [0] + [e for _, e in spans], strict=False):
        if not previous_end <= start < end <= num_rows:
            raise ConfigError(
                f"{chunk_path(chunks_dir, (start, end))} overlaps another chunk or lies past "
                f"the {num_rows} source conversations; remove {chunks_dir} to start over."
            )
    return spans


def unfinished_chunks(
    num_rows: int, done: list[tuple[int, int]], chunk_rows: int
) -> list[tuple[int, int]]:
    """The spans of at most ``chunk_rows`` rows that cover every row no finished chunk does."""
    todo, start = [], 0
    for done_start, done_end in [*done, (num_rows, num_rows)]:
        todo += [(i, min(i + chunk_rows, done_start)) for i in range(start, done_start, chunk_rows)]
        start = done_end
    return todo


def write_lines_atomically(path: Path, lines: list[str]) -> None:
    """``lines`` as the whole of ``path``, through a temporary file and a rename."""
    with atomic_file(path) as tmp:
        tmp.write_text("".join(line + "\n" for line in lines))


def join_chunks(chunks_dir: Path, spans: list[tuple[int, int]], output: Path) -> int:
    """Every chunk, in order, into ``output`` (atomically); the chunks are then removed."""
    lines = []
    for span in spans:
        lines += chunk_path(chunks_dir, span).read_text().splitlines()
    write_lines_atomically(output, lines)
    for span in spans:
        chunk_path(chunks_dir, span).unlink()
    return len(lines)


def join_failures(
    chunks_dir: Path, spans: list[tuple[int, int]], bad_rows: list[dict[str, Any]], path: Path
) -> int:
    lines = [json.dumps(row) for row in bad_rows]
    for span in spans:
        part = chunk_path(chunks_dir, span, ".failed.jsonl")
        lines += part.read_text().splitlines()
        part.unlink()
    if lines:
        write_lines_atomically(path, lines)
    return len(lines)


def run_settings(cfg: RegenerateConfig, data: DataConfig, rows: list[Row]) -> dict[str, Any]:
    """What defines the output: the source conversations and how the target rewrites them.
    Kept beside the chunks; a resumed job must match it (``model`` is added once known)."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps([row.id, row.messages], sort_keys=True).encode() + b"\n")
    magpie = cfg.magpie.num_prompts > 0
    return {
        "source": {
            "format": "magpie" if magpie else data.format.value,
            "files": [] if magpie else [str(f) for f in source_files(data.format, data.sources())],
            "max_rows": cfg.max_rows if cfg.max_rows is not None else data.max_num_samples,
            "rows": len(rows),
            "sha256": digest.hexdigest(),
        },
        "magpie": dataclasses.asdict(cfg.magpie) if magpie else None,
        "backend": cfg.backend.value,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "max_new_tokens": cfg.max_new_tokens,
        "max_turns": cfg.max_turns,
        "keep_reasoning": cfg.keep_reasoning,
        "num_samples": cfg.num_samples,
        # last: a change of sampling is named by its own field first
        "seed": cfg.seed if magpie or cfg.temperature > 0 else None,
    }


def check_same_settings(
    recorded: dict[str, Any], settings: dict[str, Any], chunks_dir: Path
) -> None:
    """ConfigError naming the first field of ``settings`` that differs from ``recorded``."""
    redo = (
        f"or choose another regenerate.output (resuming would make one data set of two), or "
        f"remove {chunks_dir} to start over."
    )
    for name, value in settings.items():
        old: Any = recorded.get(name)
        # a field missing from ``recorded`` is one an older eagleforge did not record
        if isinstance(value, dict) and isinstance(old, dict):  # older ones recorded fewer keys
            value = {k: v for k, v in value.items() if k in old}
        if value is None or value == old or name not in recorded:
            continue
        if name == "source":  # the same conversations, wherever the files are now
            if (value["rows"], value["sha256"]) == (old["rows"], old["sha256"]):
                continue
            if value["max_rows"] != old["max_rows"]:
                raise ConfigError(
                    f"regenerate.max_rows={_show(value['max_rows'])} (or data.max_num_samples) "
                    f"but the chunks in {chunks_dir} were made from "
                    f"{'all' if old['max_rows'] is None else 'the first ' + str(old['max_rows'])} "
                    "conversations: rerun with that limit to resume, " + redo
                )
            raise ConfigError(
                f"data.path={','.join(value['files']) or value['format']} gives other "
                f"conversations than the {old['rows']} the chunks in {chunks_dir} were made "
                f"from (read from {','.join(old['files']) or old['format']}; ids are file:line "
                "where rows have none): rerun with that data to resume, " + redo
            )
        raise ConfigError(
            f"regenerate.{name}={_show(value)} but the chunks in {chunks_dir} were made with "
            f"regenerate.{name}={_show(old)}: rerun with that value to resume, " + redo
        )


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)
