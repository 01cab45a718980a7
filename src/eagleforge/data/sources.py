"""Where the training rows of a data config come from: local files, a hub data set or a mixture.

Each source gives ``(location, row)`` pairs and an *identity* (the content digest of its files,
or the hub id, revision and fingerprint) that keys the preprocessing cache
(``eagleforge.data.preprocess``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagleforge.data.config import DataConfig
from eagleforge.data.conversations import DataFormat, RawRow, read_rows, source_files
from eagleforge.data.corpora import CORPORA, HubSource, Mixture, RowSource, quotas, reservoir


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes, or of a directory's files (relative names and bytes, sorted)."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else "").encode())
        with file.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


@dataclass
class FileSource:
    """Rows of local files (or the bundled chitchat file), read in order."""

    fmt: DataFormat
    files: list[Path]

    def describe(self) -> str:
        return ", ".join(map(str, self.files))

    def identity(self) -> dict[str, Any]:
        return {"files": [file_digest(f) for f in self.files]}

    def rows(self, seed: int = 0, quota: int | None = None) -> Iterator[RawRow]:
        rows = read_rows(self.fmt, self.files)
        return rows if quota is None else iter(reservoir(rows, quota, seed))


def mixture_hub_source(cfg: DataConfig, index: int) -> HubSource:
    """Mixture entry ``index``'s corpus on the hub."""
    entry = cfg.mixture[index]
    corpus = CORPORA[entry.corpus]
    return HubSource(
        f"data={cfg.name} corpus {entry.corpus}",
        corpus.hub_id,
        corpus.format,
        entry.split or corpus.split,
        entry.subset or corpus.subset,
        entry.revision,
        corpus.streaming,
        path_field=f"data.mixture.{index}.path",
    )


def config_hub_source(cfg: DataConfig) -> HubSource:
    """The hub data set of a data config without a path (data=ultrachat, ...)."""
    assert cfg.hub_id is not None
    return HubSource(
        f"data={cfg.name}",
        cfg.hub_id,
        cfg.format,
        cfg.split,
        cfg.subset,
        cfg.revision,
        cfg.streaming,
    )


def row_source(cfg: DataConfig, fmt: DataFormat, patterns: list[str]) -> RowSource:
    """Where rows come from: the files of ``patterns`` (the bundled file for chitchat); with
    none (``cfg.sources()`` gives none for them), ``cfg``'s mixture or hub data set."""
    if patterns or fmt == DataFormat.chitchat:
        return FileSource(fmt, source_files(fmt, patterns))
    if cfg.mixture:
        parts: list[tuple[RowSource, int | None]] = []
        counts = quotas(cfg.mixture, cfg.max_num_samples)
        for index, (entry, count) in enumerate(zip(cfg.mixture, counts, strict=True)):
            entry_format = CORPORA[entry.corpus].format
            part: RowSource = (
                FileSource(entry_format, source_files(entry_format, [entry.path]))
                if entry.path
                else mixture_hub_source(cfg, index)
            )
            parts.append((part, count))
        return Mixture(parts, cfg.mix_seed)
    if cfg.hub_id:
        return config_hub_source(cfg)
    return FileSource(fmt, source_files(fmt, cfg.sources()))  # ConfigError: no path


def training_source(cfg: DataConfig) -> RowSource:
    """The training rows of ``cfg`` (files, hub data set or mixture), as preprocessing reads them."""
    return row_source(cfg, cfg.format, cfg.sources())
