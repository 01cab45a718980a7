"""Named training corpora on the Hugging Face Hub, and mixtures of them.

``CORPORA`` maps each name of ``conf/data/<name>.yaml`` to where its rows live (hub id, subset,
split) and the row format its converter reads (``eagleforge.data.conversations``). A hub
source is read through ``datasets.load_dataset`` (cached by ``datasets``; streamed where the
corpus is large) into the same ``(location, row)`` stream the file readers give, so templates,
masks and the preprocessing cache are unchanged:

    python -m eagleforge.train +model=llama3 data=ultrachat
    python -m eagleforge.train +model=llama3 data=ultrachat data.path=/data/ultrachat.parquet

A mixture (``data=mix``, ``data.mixture: [...]``) takes a seeded random share of each corpus,
drops conversations whose normalised content it has already seen, and interleaves the rest with
the same seed. ``check_hub_source`` is the preflight: offline (``HF_HUB_OFFLINE=1`` /
``HF_DATASETS_OFFLINE=1``) or unreachable, a source missing from the local caches is one line
that names it and says how to point ``data.path`` at a local copy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from omegaconf import MISSING

from eagleforge.data.conversations import DataFormat, RawRow, RowError, normalise_row
from eagleforge.errors import ConfigError, DataError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Corpus:
    """Where a named corpus lives and how its rows read (see docs/datasets.md)."""

    hub_id: str  # the data set's repository on the Hugging Face Hub
    format: DataFormat  # the row converter
    split: str = "train"
    subset: str | None = None  # the data set's config name (load_dataset's second argument)
    streaming: bool = False  # large: read row by row instead of downloading it whole


CORPORA: dict[str, Corpus] = {
    "sharegpt": Corpus("Aeala/ShareGPT_Vicuna_unfiltered", DataFormat.sharegpt),
    "ultrachat": Corpus("HuggingFaceH4/ultrachat_200k", DataFormat.openai, split="train_sft"),
    "magpie_qwen25_pro": Corpus(
        "Magpie-Align/Magpie-Qwen2.5-Pro-1M-v0.1", DataFormat.sharegpt, streaming=True
    ),
    "perfectblend": Corpus("mlabonne/open-perfectblend", DataFormat.sharegpt, streaming=True),
    "perfectblend_llama3_8b": Corpus(
        "frankleeeee/PerfectBlend-Regenerated-Llama-3.1-8B-Instruct",
        DataFormat.sharegpt,
        streaming=True,
    ),
    "perfectblend_llama3_70b": Corpus(
        "frankleeeee/PerfectBlend-Regenerated-Llama-3.3-70B-Instruct",
        DataFormat.sharegpt,
        streaming=True,
    ),
    "opencoder_sft1": Corpus(
        "OpenCoder-LLM/opc-sft-stage1",
        DataFormat.opencoder,
        subset="largescale_diverse_instruct",
        streaming=True,
    ),
    "gsm8k": Corpus("openai/gsm8k", DataFormat.gsm8k, subset="main"),
}


@dataclass
class MixSource:
    """One corpus of a mixture (``data.mixture``)."""

    # A corpus name (the conf/data file): sharegpt, ultrachat, magpie_qwen25_pro, perfectblend,
    # perfectblend_llama3_8b, perfectblend_llama3_70b, opencoder_sft1, gsm8k.
    corpus: str = MISSING
    # A local copy of the corpus's rows (file, saved dataset dir or glob); null = the hub.
    path: str | None = None
    # Conversations taken from it, a seeded random choice (before deduplication); null = all
    # of it, or its weight's share of data.max_num_samples when that is set.
    num_samples: int | None = None
    # Share of data.max_num_samples (relative to the other weighted corpora) when num_samples
    # is null.
    weight: float = 1.0
    # The hub split to read; null = the corpus's default (train, UltraChat: train_sft).
    split: str | None = None
    # The hub config name; null = the corpus's default (OpenCoder: largescale_diverse_instruct).
    subset: str | None = None
    # Hub revision (a commit, tag or branch); null = the main branch.
    revision: str | None = None

    def __post_init__(self) -> None:
        if self.corpus not in CORPORA:
            raise ConfigError(
                f"data.mixture corpus '{self.corpus}' is unknown; use one of {', '.join(CORPORA)}."
            )
        if self.num_samples is not None and self.num_samples < 1:
            raise ConfigError(
                f"data.mixture {self.corpus}: num_samples must be >= 1, got {self.num_samples}."
            )
        if self.weight <= 0:
            raise ConfigError(f"data.mixture {self.corpus}: weight must be > 0, got {self.weight}.")


class RowSource(Protocol):
    """Where one split's rows come from: files, a hub data set, or a mixture of those."""

    fmt: DataFormat  # how its rows are normalised

    def identity(self) -> dict[str, Any]:
        """What identifies the rows, for the preprocessing cache key."""
        ...

    def rows(self, seed: int = 0, quota: int | None = None) -> Iterator[RawRow]:
        """Its rows; with ``quota``, a seeded random ``quota`` of them."""
        ...

    def describe(self) -> str: ...


def offline() -> bool:
    """The Hugging Face libraries are told not to use the network."""
    truthy = {"1", "ON", "YES", "TRUE"}
    return any(
        os.environ.get(name, "").strip().upper() in truthy
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def unreadable(label: str, hub_id: str) -> str:
    return f"{label} ({hub_id}) cannot be read from the Hugging Face Hub"


def local_copy_hint(path_field: str) -> str:
    return f"set {path_field}=/local/copy (.jsonl/.parquet of its rows, or a saved dataset dir)"


@dataclass
class HubSource:
    """A split of a data set on the Hugging Face Hub, read through ``datasets``."""

    label: str  # names it in messages: data=ultrachat, data=mix corpus sharegpt
    hub_id: str
    fmt: DataFormat
    split: str = "train"
    subset: str | None = None
    revision: str | None = None
    streaming: bool = False
    path_field: str = "data.path"  # where a local copy goes instead

    def __post_init__(self) -> None:
        self._table: Any = None

    def describe(self) -> str:
        return f"{self.hub_id}[{self.subset or 'default'}/{self.split}]"

    def _load(self) -> Any:
        if self._table is None:
            import datasets

            try:
                self._table = datasets.load_dataset(
                    self.hub_id,
                    self.subset,
                    split=self.split,
                    revision=self.revision,
                    streaming=self.streaming,
                )
            except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise DataError(
                    f"{unreadable(self.label, self.hub_id)} ({first}); "
                    f"{local_copy_hint(self.path_field)}."
                ) from None
        return self._table

    def identity(self) -> dict[str, Any]:
        table = self._load()
        return {
            "hub_id": self.hub_id,
            "subset": self.subset,
            "split": self.split,
            "revision": self.revision,
            # datasets' fingerprint hashes the downloaded files: a new upload is a new key
            # even on an unpinned revision. A stream has none: pin data.revision for that.
            "fingerprint": getattr(table, "_fingerprint", None),
        }

    def rows(self, seed: int = 0, quota: int | None = None) -> Iterator[RawRow]:
        table = self._load()
        if quota is not None:
            if self.streaming:  # an approximate shuffle, within a buffer of rows
                table = table.shuffle(seed=seed, buffer_size=10_000).take(quota)
            else:
                table = table.shuffle(seed=seed).select(range(min(quota, len(table))))
        for index, row in enumerate(table):
            yield f"{self.hub_id}:{self.split}[row {index}]", row


def reservoir(rows: Iterator[RawRow], quota: int, seed: int) -> list[RawRow]:
    """A seeded uniform choice of ``quota`` rows of a stream, in stream order."""
    rng = random.Random(seed)
    chosen: list[tuple[int, RawRow]] = []
    for index, row in enumerate(rows):
        if index < quota:
            chosen.append((index, row))
        else:
            slot = rng.randrange(index + 1)
            if slot < quota:
                chosen[slot] = (index, row)
    return [row for _, row in sorted(chosen, key=lambda item: item[0])]


def quotas(entries: list[MixSource], max_num_samples: int | None) -> list[int | None]:
    """Conversations to take from each entry: its num_samples; else, with max_num_samples, its
    weight's share of what the counted entries leave; else all (None)."""
    if max_num_samples is None:
        return [entry.num_samples for entry in entries]
    weighted = [entry for entry in entries if entry.num_samples is None]
    counted = sum(entry.num_samples or 0 for entry in entries)
    left = max(0, max_num_samples - counted)
    total = sum(entry.weight for entry in weighted)
    shares = {id(entry): int(left * entry.weight / total) for entry in weighted}
    for entry in weighted[: left - sum(shares.values())]:  # the rounding remainder
        shares[id(entry)] += 1
    return [
        entry.num_samples if entry.num_samples is not None else shares[id(entry)]
        for entry in entries
    ]


def content_key(messages: list[dict[str, Any]]) -> str:
    """A hash of a conversation's roles, texts (whitespace collapsed) and tool calls: equal
    chats, equal keys."""
    normal = [
        [m["role"], " ".join(str(m.get("content", "")).split()), m.get("tool_calls")]
        for m in messages
    ]
    return hashlib.sha256(json.dumps(normal, ensure_ascii=False).encode()).hexdigest()


@dataclass
class Mixture:
    """Several sources, a seeded share of each, deduplicated by content, interleaved by seed.

    Rows come out as OpenAI rows (each source's converter already applied), so one format
    (``openai``) reads them all; rows a converter rejects pass through as their RowError."""

    parts: list[tuple[RowSource, int | None]]  # each source and how many rows to take
    seed: int
    fmt: DataFormat = DataFormat.openai
    duplicates: int = field(default=0, init=False)  # left out by the last rows()

    def describe(self) -> str:
        return " + ".join(source.describe() for source, _ in self.parts)

    def identity(self) -> dict[str, Any]:
        return {
            "mixture": [
                {"source": source.identity(), "format": source.fmt.value, "quota": quota}
                for source, quota in self.parts
            ],
            "seed": self.seed,
        }

    def rows(self, seed: int = 0, quota: int | None = None) -> Iterator[RawRow]:
        seen: set[str] = set()
        kept: list[RawRow] = []
        duplicates = 0
        for source, part_quota in self.parts:
            for where, row in source.rows(self.seed, part_quota):
                if isinstance(row, RowError):
                    kept.append((where, row))
                    continue
                try:
                    messages = normalise_row(row, source.fmt, where)
                except RowError as e:
                    kept.append((where, e))
                    continue
                key = content_key(messages)
                if key in seen:
                    duplicates += 1
                    continue
                seen.add(key)
                kept.append((where, {"messages": messages, "id": row.get("id", where)}))
        if duplicates:
            log.info("data mixture: %d duplicate conversations left out", duplicates)
        self.duplicates = duplicates
        random.Random(self.seed).shuffle(kept)
        yield from kept


def hub_cached(hub_id: str) -> bool:
    """``hub_id`` has files in the local datasets or hub cache (one directory lookup each)."""
    from huggingface_hub import constants

    datasets_cache = Path(
        os.environ.get("HF_DATASETS_CACHE") or Path(constants.HF_HOME) / "datasets"
    )
    namespace, _, name = hub_id.rpartition("/")
    candidates = [
        datasets_cache / (f"{namespace}___{name}" if namespace else name),
        Path(constants.HF_HUB_CACHE) / f"datasets--{hub_id.replace('/', '--')}",
    ]
    return any(path.is_dir() for path in candidates)


def check_hub_source(source: HubSource) -> None:
    """ConfigError when a hub source cannot be read: offline (no network attempted) and not
    in the local caches, or the hub unreachable and not cached, or no such data set."""
    what, fix = unreadable(source.label, source.hub_id), local_copy_hint(source.path_field)
    if offline():
        if source.streaming:
            raise ConfigError(
                f"{what}: it is streamed and the hub is offline (HF_HUB_OFFLINE/"
                f"HF_DATASETS_OFFLINE=1); {fix}, or data.streaming=false once it is cached."
            )
        if not hub_cached(source.hub_id):
            raise ConfigError(
                f"{what}: the hub is offline (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE=1) and it is "
                f"not in the local datasets cache; {fix}."
            )
        return
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    try:
        HfApi().dataset_info(source.hub_id, revision=source.revision, timeout=10)
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise ConfigError(
            f"{what}: no such data set or revision ({source.revision or 'main'}) on the hub; "
            f"check the hub id and revision, or {fix}."
        ) from None
    except Exception as e:  # a probe: any failure to reach the hub means the same thing here
        if source.streaming or not hub_cached(source.hub_id):
            raise ConfigError(
                f"{what}: the hub is unreachable ({type(e).__name__}); {fix}."
            ) from None
