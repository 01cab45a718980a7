"""Preprocessing (render + tokenize, several processes) into a ``TokenizedDataset``, and its cache.

Rows come from a source of ``eagleforge.data.sources``; ``build_datasets``
(``eagleforge.data.split``) runs this for the train and eval data of a config.

Preprocessed data is cached under ``<cache_dir>/data/<key>`` where the key hashes the *content*
of every input file, the tokenizer and chat template, and every option that changes the result:
editing a file rebuilds it even when its path is unchanged, and nothing else does. A hub data
set (``data=ultrachat``) or a mixture (``data=mix``; ``eagleforge.data.corpora``) is keyed by its
hub id, subset, split, revision and ``datasets``' fingerprint of the downloaded files (and each
corpus's share and the mixture seed). Entries are
written to a temporary directory and renamed, so a crash never leaves one that later loads; the
temporary directory of a killed write is removed by a later lookup (``eagleforge.atomic``).

Conversations with images (``data.is_vlm``) bypass that cache on purpose: their token counts
depend on image files the key does not hash, so they are preprocessed in every run (only
image headers are read then); the pixels are loaded batch by batch by the ``Collator``.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from eagleforge.atomic import atomic_directory, remove_stale_temps
from eagleforge.data.config import DataConfig, OnError
from eagleforge.data.conversations import (
    DataFormat,
    RawRow,
    RowError,
    SkipReason,
    normalise_row,
    preformatted_text,
)
from eagleforge.data.corpora import Mixture, RowSource
from eagleforge.data.rendered import Rendered
from eagleforge.data.sources import row_source
from eagleforge.data.template import (
    VisionSettings,
    expand_images,
    make_renderer,
    tokenize_rendered,
)
from eagleforge.errors import ConfigError, DataError

if TYPE_CHECKING:
    from eagleforge.targets.source import VisionProcessor

# Bump when rendering, tokenization or masking changes, so old cache entries are not reused.
PIPELINE_VERSION = 5  # 5: a leading BOM is read, lone surrogates are invalid_unicode rows
CHUNK_ROWS = 256


@dataclass
class DataReport:
    """What preprocessing kept and dropped; logged to the console and MLflow."""

    rows: int = 0
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    truncated: int = 0
    tokens: int = 0
    supervised_tokens: int = 0

    def metrics(self, prefix: str) -> dict[str, float]:
        out = {f"{prefix}/{k}": float(v) for k, v in asdict(self).items() if k != "skipped"}
        out.update({f"{prefix}/skipped_{reason}": float(n) for reason, n in self.skipped.items()})
        return out

    def summary(self) -> str:
        skipped = ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items())) or "none"
        return (
            f"{self.rows} rows, {self.kept} kept, skipped: {skipped}; {self.truncated} truncated; "
            f"{self.tokens} tokens, {self.supervised_tokens} supervised"
        )


class TokenizedDataset(torch.utils.data.Dataset):
    """(input_ids, loss_mask) pairs of python int lists; with ``images`` (vision-language
    data) samples are (input_ids, loss_mask, image paths)."""

    def __init__(
        self,
        input_ids: list[list[int]],
        loss_mask: list[list[int]],
        images: list[list[str]] | None = None,
    ) -> None:
        self.input_ids = input_ids
        self.loss_mask = loss_mask
        self.images = images

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        if self.images is not None:
            return self.input_ids[index], self.loss_mask[index], self.images[index]
        return self.input_ids[index], self.loss_mask[index]

    def __iter__(self) -> Iterator[tuple[list[int], list[int]]]:
        return zip(self.input_ids, self.loss_mask, strict=True)

    def subset(self, indices: list[int]) -> TokenizedDataset:
        return TokenizedDataset(
            [self.input_ids[i] for i in indices],
            [self.loss_mask[i] for i in indices],
            None if self.images is None else [self.images[i] for i in indices],
        )

    def lengths(self) -> list[int]:
        return [len(ids) for ids in self.input_ids]

    def num_tokens(self) -> int:
        return sum(self.lengths())


# ---------------------------------------------------------------------------------------------
# Processing rows (in worker processes)


@dataclass
class _Settings:
    fmt: DataFormat
    preformatted: bool
    max_length: int
    truncate: bool
    train_only_last_turn: bool
    vision: VisionSettings | None = None  # vision-language data


_WORKER: dict[str, Any] = {}


def _init_worker(renderer: Any, tokenizer: Any, settings: _Settings) -> None:
    _WORKER.update(renderer=renderer, tokenizer=tokenizer, settings=settings)


def _render_row(where: str, row: Any, renderer: Any, settings: _Settings) -> Rendered:
    if isinstance(row, RowError):
        raise row
    rendered: Rendered
    if settings.preformatted:
        rendered = renderer.render(preformatted_text(row, where), where)
    else:
        try:
            messages = normalise_row(row, settings.fmt, where, settings.vision is not None)
            rendered = renderer.render(messages, where)
        except DataError as e:  # the template rejected the conversation
            detail = str(e).removeprefix(f"{where}: ")
            raise RowError(SkipReason.template_error, where, detail) from None
    return rendered.last_turn_only() if settings.train_only_last_turn else rendered


# (where, ids, mask, truncated, image paths)
Processed = tuple[str, list[int], list[int], bool, list[str]] | RowError


def process_chunk(chunk: list[RawRow]) -> list[Processed]:
    """Render and tokenize a chunk of rows with the worker's renderer and tokenizer."""
    renderer, tokenizer, settings = _WORKER["renderer"], _WORKER["tokenizer"], _WORKER["settings"]
    rendered: list[tuple[str, Rendered]] = []
    out: list[Processed | None] = []
    for where, row in chunk:
        try:
            rendered.append((where, _render_row(where, row, renderer, settings)))
            out.append(None)
        except RowError as e:
            out.append(e)
    encoded = iter(tokenize_rendered([r for _, r in rendered], tokenizer))
    places = iter(rendered)
    for index, item in enumerate(out):
        if item is not None:
            continue
        where, rendered_row = next(places)
        ids, mask = next(encoded)
        images = rendered_row.images
        last_vision = -1
        if settings.vision is not None:
            try:
                ids, mask, _ = expand_images(ids, mask, images, settings.vision, where)
            except RowError as e:
                out[index] = e
                continue
            vision_ids = {settings.vision.image_token_id, *settings.vision.vision_token_ids}
            last_vision = max((i for i, t in enumerate(ids) if t in vision_ids), default=-1)
        too_long = len(ids) > settings.max_length
        if too_long and last_vision >= settings.max_length:  # never cut into an image
            out[index] = RowError(
                SkipReason.too_long,
                where,
                f"its images end at token {last_vision + 1}, past data.max_length="
                f"{settings.max_length} (raise it, or lower data.max_pixels).",
            )
            continue
        if too_long and not settings.truncate:
            out[index] = RowError(
                SkipReason.too_long,
                where,
                f"{len(ids)} tokens exceed data.max_length={settings.max_length} "
                "(raise it, or set data.truncate=true).",
            )
            continue
        ids, mask = ids[: settings.max_length], mask[: settings.max_length]
        if not any(mask):  # every reply was cut off by truncation
            out[index] = RowError(
                SkipReason.too_long,
                where,
                f"no reply within the first {settings.max_length} tokens.",
            )
            continue
        out[index] = (where, ids, mask, too_long, images)
    return [item for item in out if item is not None]


def _chunks(rows: Iterator[RawRow], limit: int | None) -> Iterator[list[RawRow]]:
    chunk: list[RawRow] = []
    for index, row in enumerate(rows):
        if limit is not None and index >= limit:
            break
        chunk.append(row)
        if len(chunk) == CHUNK_ROWS:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def preprocess_rows(
    rows: Iterator[RawRow],
    renderer: Any,
    tokenizer: Any,
    settings: _Settings,
    on_error: OnError,
    num_proc: int = 1,
    limit: int | None = None,
    desc: str = "preprocess",
) -> tuple[TokenizedDataset, DataReport]:
    """Render + tokenize every row; returns the dataset and the report."""
    report, skipped = DataReport(), Counter[str]()
    input_ids: list[list[int]] = []
    loss_mask: list[list[int]] = []
    images: list[list[str]] = []
    pool = None
    if num_proc > 1:
        # fork: workers inherit the tokenizer and renderer without pickling them; a worker that
        # dies raises BrokenProcessPool here instead of hanging.
        pool = ProcessPoolExecutor(
            num_proc,
            multiprocessing.get_context("fork"),
            _init_worker,
            (renderer, tokenizer, settings),
        )
        results: Iterator[list[Processed]] = pool.map(process_chunk, _chunks(rows, limit))
    else:
        _init_worker(renderer, tokenizer, settings)
        results = map(process_chunk, _chunks(rows, limit))
    try:
        with tqdm(desc=desc, unit="row", disable=None) as bar:
            for processed in results:
                for item in processed:
                    report.rows += 1
                    if isinstance(item, RowError):
                        if on_error == OnError["raise"]:
                            raise DataError(
                                f"{item} (set data.on_error=skip to leave such rows out)"
                            )
                        skipped[item.reason.value] += 1
                        continue
                    _, ids, mask, truncated, row_images = item
                    input_ids.append(ids)
                    loss_mask.append(mask)
                    images.append(row_images)
                    report.truncated += int(truncated)
                    report.tokens += len(ids)
                    report.supervised_tokens += sum(mask)
                bar.update(len(processed))
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    report.kept = len(input_ids)
    report.skipped = dict(skipped)
    dataset = TokenizedDataset(input_ids, loss_mask, images if settings.vision else None)
    return dataset, report


# ---------------------------------------------------------------------------------------------
# Cache


def tokenizer_digest(tokenizer: Any) -> str:
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    digest.update(
        (
            backend.to_str() if backend is not None else str(sorted(tokenizer.get_vocab().items()))
        ).encode()
    )
    digest.update(str(getattr(tokenizer, "chat_template", None)).encode())
    return digest.hexdigest()


def _save(dataset: TokenizedDataset, report: DataReport, out: Path) -> None:
    import datasets

    columns = {"input_ids": dataset.input_ids, "loss_mask": dataset.loss_mask}
    datasets.Dataset.from_dict(columns).save_to_disk(str(out / "dataset"))
    (out / "report.json").write_text(json.dumps(asdict(report), indent=2))


def _load(entry: Path) -> tuple[TokenizedDataset, DataReport]:
    import datasets

    columns = datasets.load_from_disk(str(entry / "dataset")).to_dict()
    report = DataReport(**json.loads((entry / "report.json").read_text()))
    return TokenizedDataset(columns["input_ids"], columns["loss_mask"]), report


def _keyed_source(
    cfg: DataConfig,
    fmt: DataFormat,
    patterns: list[str],
    tokenizer: Any,
    limit: int | None,
    processor: VisionProcessor | None,
) -> tuple[RowSource, str]:
    """The rows ``preprocess_source`` reads and the key of their cache entry: what identifies
    the rows, their format, the tokenizer, template and tokenization settings."""
    if cfg.is_vlm and processor is None:
        raise ConfigError(
            "data.is_vlm=true: this command does not load the target's processor (only "
            "eagleforge.train takes images); set data.is_vlm=false."
        )
    vision = None
    if processor is not None:
        vision = vision_settings(processor, cfg.min_pixels, cfg.max_pixels)
        tokenizer = processor.tokenizer
    source = row_source(cfg, fmt, patterns)
    key_parts: dict[str, Any] = {
        **source.identity(),
        "format": source.fmt.value,
        "tokenizer": tokenizer_digest(tokenizer),
        "template": cfg.template,
        "preformatted": cfg.preformatted,
        "max_length": cfg.max_length,
        "truncate": cfg.truncate,
        "train_only_last_turn": cfg.train_only_last_turn,
        "on_error": cfg.on_error.value,
        "limit": limit,
        "version": PIPELINE_VERSION,
    }
    if vision is not None:
        key_parts["vision"] = asdict(vision)
        key_parts["processor_template"] = processor.chat_template if processor else None
    return source, hashlib.sha256(json.dumps(key_parts, sort_keys=True).encode()).hexdigest()[:20]


def source_key(cfg: DataConfig, tokenizer: Any, processor: VisionProcessor | None = None) -> str:
    """The cache key of ``cfg``'s training rows, as ``preprocess_source`` names their entry,
    without reading or tokenizing the rows: a feature store's ``data_key`` begins with it."""
    limit = cfg.max_num_samples
    _, key = _keyed_source(cfg, cfg.format, cfg.sources(), tokenizer, limit, processor)
    return key


def preprocess_source(
    cfg: DataConfig,
    fmt: DataFormat,
    patterns: list[str],
    tokenizer: Any,
    cache_dir: str | Path,
    limit: int | None,
    processor: VisionProcessor | None = None,
) -> tuple[TokenizedDataset, DataReport, Path]:
    """Preprocess one source (train or eval) through the content-keyed cache; also the entry dir.

    ``patterns``: the files to read; none (``cfg.sources()`` for a hub data set or a mixture):
    ``cfg``'s hub data set or mixture (``row_source``). With ``processor`` (vision-language
    data) the cache is bypassed (see the module docstring); the entry dir is then only a name
    for this data and settings."""
    source, key = _keyed_source(cfg, fmt, patterns, tokenizer, limit, processor)
    vision = None
    if processor is not None:
        vision = vision_settings(processor, cfg.min_pixels, cfg.max_pixels)
        tokenizer = processor.tokenizer
    entry = Path(cache_dir) / "data" / key
    remove_stale_temps(entry.parent)  # left by writes that were killed
    if vision is None and (entry / "report.json").exists():
        return (*_load(entry), entry)
    settings = _Settings(
        source.fmt, cfg.preformatted, cfg.max_length, cfg.truncate, cfg.train_only_last_turn, vision
    )
    renderer = make_renderer(
        cfg.template,
        tokenizer,
        cfg.preformatted,
        processor.chat_template if processor is not None else None,
    )
    dataset, report = preprocess_rows(
        source.rows(), renderer, tokenizer, settings, cfg.on_error, cfg.num_proc, limit
    )
    if isinstance(source, Mixture) and source.duplicates:  # read, and left out before this
        report.rows += source.duplicates
        report.skipped["duplicate"] = source.duplicates
    if report.kept == 0:
        raise DataError(
            f"{source.describe()}: no usable conversation ({report.summary()}); check the rows and data.format, or inspect them with python -m eagleforge.inspect_data."
        )
    if vision is None:
        with atomic_directory(entry, complete="report.json") as out:
            _save(dataset, report, out)
    return dataset, report, entry


def vision_settings(processor: VisionProcessor, min_pixels: int, max_pixels: int) -> VisionSettings:
    """How the target's processor turns images into image tokens (``data.min_pixels`` /
    ``data.max_pixels`` bound the resized image)."""
    image_processor = processor.image_processor
    return VisionSettings(
        image_token_id=processor.image_token_id,
        vision_token_ids=processor.vision_token_ids(),
        patch_size=int(image_processor.patch_size),
        merge_size=int(image_processor.merge_size),
        min_pixels=min_pixels,
        max_pixels=max_pixels,
    )
