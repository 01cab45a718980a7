"""The `data` config section, preprocessing (render + tokenize, several processes) and its cache.

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
import logging
import multiprocessing
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import MISSING
from tqdm.auto import tqdm

from eagleforge.atomic import atomic_directory, remove_stale_temps
from eagleforge.data.conversations import (
    ROW_CONVERTERS,
    DataFormat,
    RawRow,
    RowError,
    SkipReason,
    normalise_row,
    preformatted_text,
    read_rows,
    source_files,
)
from eagleforge.data.corpora import (
    CORPORA,
    HubSource,
    MixSource,
    Mixture,
    RowSource,
    quotas,
    reservoir,
)
from eagleforge.data.named_templates import TEMPLATES
from eagleforge.data.rendered import Rendered
from eagleforge.data.template import (
    VisionSettings,
    expand_images,
    make_renderer,
    tokenize_rendered,
)
from eagleforge.errors import ConfigError, DataError

if TYPE_CHECKING:
    from eagleforge.targets.source import VisionProcessor

log = logging.getLogger(__name__)

# Bump when rendering, tokenization or masking changes, so old cache entries are not reused.
PIPELINE_VERSION = 4  # 4: rows with images are image_error rows in text runs
CHUNK_ROWS = 256


# raise: stop before training at the first bad row; skip: leave bad rows out and report how
# many, by reason. Functional form because OmegaConf takes an Enum field by member *name* and
# the documented `raise` is a keyword no class body can name.
OnError = Enum("OnError", {"raise": "raise", "skip": "skip"}, module=__name__, type=str)


@dataclass
class DataConfig:
    """The `data` config section: which conversations to train on and how to tokenize them."""

    # Short name of the data set, used in run names.
    name: str = MISSING
    # Row format (auto | sharegpt | openai | gsm8k | opencoder) or the bundled chitchat set.
    format: DataFormat = DataFormat.auto
    # Training data: a .jsonl/.json/.parquet file, a saved HF dataset dir, or a glob of them.
    # Set, it wins over hub_id and mixture (a local copy of a named corpus: same converter).
    path: str | None = None
    # More training sources (files, dirs or globs), read after `path`.
    extra_paths: list[str] = field(default_factory=list)
    # A Hugging Face Hub data set read when path is null (data=ultrachat, ...; docs/datasets.md).
    hub_id: str | None = None
    # The hub data set's config name (load_dataset's `name`, e.g. main for GSM8K); null = default.
    subset: str | None = None
    # The hub split to train on.
    split: str = "train"
    # Hub revision: a commit sha, tag or branch; null = main (pin a commit to reproduce a run).
    revision: str | None = None
    # Read the hub data set row by row instead of downloading it whole (large corpora).
    streaming: bool = False
    # Corpora mixed into one training set when path is null (data=mix): each a corpus name
    # with num_samples or weight; deduplicated by content (see eagleforge.data.corpora).
    mixture: list[MixSource] = field(default_factory=list)
    # Seed of the mixture's per-corpus sampling and interleaving.
    mix_seed: int = 0
    # Held-out data (same kinds as path); null = hold out num_eval_samples of the training rows.
    eval_path: str | None = None
    # Conversations held out for eval when eval_path is null (0 = no eval); null = 5% of the
    # usable conversations, at most 64 (none with fewer than 20).
    num_eval_samples: int | None = None
    # Use only the first N rows of the source (null = all).
    max_num_samples: int | None = None
    # Tokens per sample.
    max_length: int = 2048
    # Over-long samples: true = keep the first max_length tokens; false = a too_long row error.
    truncate: bool = True
    # Supervise only the last assistant turn of each conversation.
    train_only_last_turn: bool = False
    # Chat template: auto = the tokenizer's own; or a named one (llama3, chatml, qwen3, ...).
    template: str = "auto"
    # Rows hold a `text` column with the chat template already applied.
    preformatted: bool = False
    # Bad rows: raise (stop before training) or skip (count by reason and go on).
    on_error: OnError = OnError["raise"]
    # Processes used for preprocessing.
    num_proc: int = 1
    # A feature store written by eagleforge.prepare: train offline from its hidden states
    # (the target's layers are not loaded). null = online.
    features: str | None = None
    # With features: check every shard's sha256 before training (reads the whole store);
    # null = only for stores up to 4 GiB. Sizes and headers are always checked.
    verify_features: bool | None = None
    # Pack whole conversations into rows instead of padding (a micro-batch is then one row of
    # max_tokens_per_batch tokens and trainer.batch_size is unused); null = offline always,
    # online when the target can mask packed documents (not a vision-language target).
    packing: bool | None = None
    # Token budget of one packed row (tokens per micro-batch with packing); at least max_length.
    max_tokens_per_batch: int = 4096
    # Conversations may carry images for a vision-language target (e.g. +model=qwen2_5_vl,
    # which sets it): rendered with the processor's chat template, images fed to the target's
    # vision tower. The hf target backend only; online or from a feature store (docs/vlm.md).
    is_vlm: bool = False
    # Fewest pixels an image is resized to, aspect ratio kept (50176 = 224 x 224).
    min_pixels: int = 50176
    # Most pixels an image is resized to (802816 = 1024 tokens of 28 x 28 pixels).
    max_pixels: int = 802816

    def __post_init__(self) -> None:
        if self.max_length < 4:
            raise ConfigError(f"data.max_length must be >= 4 tokens, got {self.max_length}.")
        if self.num_eval_samples is not None and self.num_eval_samples < 0:
            raise ConfigError(f"data.num_eval_samples must be >= 0, got {self.num_eval_samples}.")
        if self.num_proc < 1:
            raise ConfigError(f"data.num_proc must be >= 1, got {self.num_proc}.")
        if self.template != "auto" and self.template not in TEMPLATES:
            raise ConfigError(
                f"data.template={self.template} is unknown; use auto or one of {', '.join(sorted(TEMPLATES))}."
            )
        if self.packing is not False and self.max_tokens_per_batch < self.max_length:
            raise ConfigError(
                f"data.max_tokens_per_batch={self.max_tokens_per_batch} must be >= data.max_length="
                f"{self.max_length} so that every sample fits in a packed row."
            )
        if self.is_vlm:
            self._check_vlm()
        if self.preformatted and self.format == DataFormat.chitchat:
            raise ConfigError(
                "data.preformatted=true needs a file of {'text': ...} rows, not data=chitchat."
            )
        if self.extra_paths and not self.path:
            raise ConfigError(
                "data.extra_paths are read after data.path, which is not set; set data.path."
            )

    def _check_vlm(self) -> None:
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ConfigError(
                f"data.min_pixels={self.min_pixels} and data.max_pixels={self.max_pixels} must "
                "satisfy 0 < min_pixels <= max_pixels; change one of them."
            )
        refused = {
            "data.template": self.template != "auto",  # named templates place no images
            "data.preformatted": self.preformatted,
            # online, packed rows would need per-document M-RoPE positions; a feature store
            # keeps each sample's own, so offline rows pack
            "data.packing": self.packing is True and not self.features,
        }
        for name, set_ in refused.items():
            if set_:
                raise ConfigError(
                    f"{name} is not supported with data.is_vlm=true (images are rendered with "
                    "the processor's template; online batches are padded, not packed); "
                    f"unset {name}."
                )

    def sources(self) -> list[str]:
        """The files to read (none for chitchat, a hub data set or a mixture); ConfigError
        when the data needs a path and none is set (checked here, not at config time: entry
        points that read no data need none)."""
        if (
            self.format != DataFormat.chitchat
            and not self.path
            and not self.hub_id
            and not self.mixture
        ):
            raise ConfigError(
                f"data.path is required for data '{self.name}' (format={self.format.value}): "
                "set data.path=/path/to/conversations.jsonl."
            )
        return [p for p in [self.path, *self.extra_paths] if p]


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


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else "").encode())
        with file.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


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
    key = hashlib.sha256(json.dumps(key_parts, sort_keys=True).encode()).hexdigest()[:20]
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


# data.num_eval_samples=null holds out this fraction of the usable conversations, at most
# DEFAULT_MAX_EVAL: an eval loss needs a few dozen conversations, training needs the rest.
DEFAULT_EVAL_FRACTION = 0.05
DEFAULT_MAX_EVAL = 64


def num_held_out(num_eval_samples: int | None, num_usable: int) -> int:
    """Conversations to hold out of ``num_usable`` for ``data.num_eval_samples`` (null: the
    scaled default); ConfigError when an explicit count leaves nothing to train on."""
    if num_eval_samples is None:
        return min(DEFAULT_MAX_EVAL, int(num_usable * DEFAULT_EVAL_FRACTION))
    if num_eval_samples >= num_usable:
        raise ConfigError(
            f"data.num_eval_samples={num_eval_samples} leaves no training data ({num_usable} "
            "usable conversations); lower it, or unset it for 5% of them."
        )
    return num_eval_samples


@dataclass
class PreparedData:
    train: TokenizedDataset
    eval: TokenizedDataset | None
    report: DataReport  # of the training source, before the hold-out split
    cache_key: str  # identifies the training rows: the cache entry name plus the split


def build_datasets(
    cfg: DataConfig,
    tokenizer: Any,
    cache_dir: str | Path,
    seed: int,
    processor: VisionProcessor | None = None,
) -> PreparedData:
    """Train and eval datasets (without eval_path: a seeded random hold-out) and the train report.

    ``processor``: the target's processor parts, for vision-language data (``data.is_vlm``)."""
    limit = cfg.max_num_samples
    full, report, entry = preprocess_source(
        cfg, cfg.format, cfg.sources(), tokenizer, cache_dir, limit, processor
    )
    log.info("data %s: %s", cfg.name, report.summary())
    if processor is not None:
        log.info(
            "data %s: conversations with images are not cached; preprocessed each run", cfg.name
        )
    if cfg.eval_path:
        # rows of a converter's shape (gsm8k's test split) need it; others are told apart per row
        eval_format = cfg.format if cfg.format in ROW_CONVERTERS else DataFormat.auto
        held_out, _, _ = preprocess_source(
            cfg, eval_format, [cfg.eval_path], tokenizer, cache_dir, None, processor
        )
        return PreparedData(full, held_out, report, entry.name)
    num_eval = num_held_out(cfg.num_eval_samples, len(full))
    if num_eval == 0:
        return PreparedData(full, None, report, entry.name)
    order = torch.randperm(len(full), generator=torch.Generator().manual_seed(seed)).tolist()
    held_out_ids = sorted(order[:num_eval])
    train_ids = sorted(order[num_eval:])
    key = f"{entry.name}-holdout{num_eval}-seed{seed}"
    return PreparedData(full.subset(train_ids), full.subset(held_out_ids), report, key)


@dataclass
class Collator:
    """Right-pads a list of samples into tensors: input_ids, attention_mask, loss_mask [B, T];
    samples from a feature store also carry aux [T, A] and final [T, H] hidden states, padded
    with zeros into aux_hidden [B, T, A] and final_hidden [B, T, H], and a vision-language
    store's M-RoPE positions [3, T] into mrope_position_ids [3, B, T].

    Vision-language samples (ids, mask, image paths) also give the images of the whole batch,
    in sample order, through ``image_processor``: pixel_values [patches, C*t*p*p] and
    image_grid_thw [images, 3] (absent when the batch has no image)."""

    pad_token_id: int
    image_processor: Any = None  # the target's, with data.min_pixels / max_pixels
    image_token_id: int | None = None

    def __call__(self, samples: list[tuple[Any, ...]]) -> dict[str, torch.Tensor]:
        length = max(len(sample[0]) for sample in samples)
        input_ids = torch.full((len(samples), length), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(samples), length), dtype=torch.bool)
        loss_mask = torch.zeros((len(samples), length), dtype=torch.bool)
        for row, (ids, mask, *_) in enumerate(samples):
            input_ids[row, : len(ids)] = torch.as_tensor(ids)
            attention[row, : len(ids)] = True
            loss_mask[row, : len(mask)] = torch.as_tensor(mask, dtype=torch.bool)
        batch = {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask}
        if len(samples[0]) == 3:
            batch.update(self._images([path for sample in samples for path in sample[2]]))
            self._check_image_tokens(batch, [sample[2] for sample in samples])
        if len(samples[0]) >= 4:
            for key, position in (("aux_hidden", 2), ("final_hidden", 3)):
                first = samples[0][position]
                out = first.new_zeros(len(samples), length, first.shape[-1])
                for row, sample in enumerate(samples):
                    out[row, : len(sample[position])] = sample[position]
                batch[key] = out
        if len(samples[0]) == 5:  # stored M-RoPE positions [3, T]; zeros at padding
            positions_3BT = torch.zeros(3, len(samples), length, dtype=torch.long)
            for row, sample in enumerate(samples):
                positions_3BT[:, row, : sample[4].shape[1]] = sample[4]
            batch["mrope_position_ids"] = positions_3BT
        return batch

    def _images(self, paths: list[str]) -> dict[str, torch.Tensor]:
        if not paths:
            return {}
        if self.image_processor is None or self.image_token_id is None:
            raise ValueError(
                "vision-language samples need Collator(image_processor=..., image_token_id=...)"
            )
        from PIL import Image, ImageOps

        images = []
        for path in paths:
            try:
                with Image.open(path) as image:
                    # upright, as transformers' load_image (and serving) reads it
                    images.append(ImageOps.exif_transpose(image).convert("RGB"))
            except OSError as e:
                raise DataError(
                    f"image {path} cannot be read ({e}); it was readable when the data was "
                    "preprocessed: restore the file."
                ) from None
        out = self.image_processor(images=images, return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    def _check_image_tokens(self, batch: dict[str, torch.Tensor], paths: list[list[str]]) -> None:
        """Each sample's images still need the image tokens written at preprocessing."""
        grid = batch.get("image_grid_thw")
        merged = int(getattr(self.image_processor, "merge_size", 1)) ** 2
        tokens = [] if grid is None else (grid.prod(-1) // merged).tolist()
        image_id = -1 if self.image_token_id is None else self.image_token_id
        found = batch["input_ids"].eq(image_id).sum(-1).tolist()
        start = 0
        for row, sample_paths in enumerate(paths):
            expected = sum(tokens[start : start + len(sample_paths)])
            start += len(sample_paths)
            if expected != found[row]:
                raise DataError(
                    f"images {sample_paths} need {expected} image tokens but their preprocessed "
                    f"sample holds {found[row]}: a file changed since preprocessing; rerun it."
                )


def pack_indices(lengths: list[int], order: list[int], max_tokens: int) -> list[list[int]]:
    """Greedy packing: consecutive samples of ``order`` share a row while they fit ``max_tokens``."""
    rows: list[list[int]] = []
    row: list[int] = []
    used = 0
    for index in order:
        if row and used + lengths[index] > max_tokens:
            rows.append(row)
            row, used = [], 0
        row.append(index)
        used += lengths[index]
    if row:
        rows.append(row)
    return rows


@dataclass
class PackedCollator:
    """Concatenates samples into one row [1, L] with document_ids and per-document
    position_ids (and the feature store's hidden states, when samples carry them)."""

    def __call__(self, samples: list[tuple[Any, ...]]) -> dict[str, torch.Tensor]:
        ids = [torch.as_tensor(sample[0]) for sample in samples]
        batch = {
            "input_ids": torch.cat(ids).unsqueeze(0),
            "attention_mask": torch.ones(1, sum(len(i) for i in ids), dtype=torch.bool),
            "loss_mask": torch.cat(
                [torch.as_tensor(sample[1], dtype=torch.bool) for sample in samples]
            ).unsqueeze(0),
            "document_ids": torch.cat(
                [torch.full((len(i),), n) for n, i in enumerate(ids)]
            ).unsqueeze(0),
            "position_ids": torch.cat([torch.arange(len(i)) for i in ids]).unsqueeze(0),
        }
        if len(samples[0]) >= 4:
            batch["aux_hidden"] = torch.cat([sample[2] for sample in samples]).unsqueeze(0)
            batch["final_hidden"] = torch.cat([sample[3] for sample in samples]).unsqueeze(0)
        if len(samples[0]) == 5:  # each document's own M-RoPE positions, back to back
            batch["mrope_position_ids"] = torch.cat([s[4] for s in samples], 1).unsqueeze(1)
        return batch


def make_loader(
    dataset: Any,  # TokenizedDataset or data.features.FeatureDataset: samples and lengths()
    packing: bool,
    max_tokens_per_batch: int,
    batch_size: int,
    pad_token_id: int,
    shuffle_seed: int | None = None,
    shard: int = 0,
    num_shards: int = 1,
    start: int = 0,
    processor: VisionProcessor | None = None,
) -> torch.utils.data.DataLoader:
    """Batches of ``batch_size`` padded samples, or with ``packing`` one row of whole samples
    up to ``max_tokens_per_batch`` tokens per batch.

    ``shuffle_seed``: the order is a seeded permutation (one per epoch); None keeps file order.
    ``start``: leave out the order's first ``start`` batches (already used by a resumed run).
    ``shard`` of ``num_shards`` (data-parallel ranks): see ``shard_batches``.
    ``processor``: loads the images of vision-language samples (not with ``packing``).
    """
    order = list(range(len(dataset)))
    if shuffle_seed is not None:
        order = torch.randperm(
            len(dataset), generator=torch.Generator().manual_seed(shuffle_seed)
        ).tolist()
    if packing:
        batches = pack_indices(dataset.lengths(), order, max_tokens_per_batch)
        collate: Any = PackedCollator()
    else:
        batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
        collate = Collator(
            pad_token_id,
            processor.image_processor if processor is not None else None,
            processor.image_token_id if processor is not None else None,
        )
    batches = batches[start:]
    if num_shards > 1:
        batches = shard_batches(batches, shard, num_shards)
        dataset = _WithFillers(dataset)
    return torch.utils.data.DataLoader(dataset, batch_sampler=batches, collate_fn=collate)


def shard_batches(batches: list[list[int]], shard: int, num_shards: int) -> list[list[int]]:
    """Shard ``shard``'s batches: every ``num_shards``-th batch of the global order, so that
    step s of N ranks sees the batches that one process with N x the accumulation would.

    Every shard gets the same number of batches (the ranks step together); a shard short of
    one gets *filler* batches, encoded as negative indices (-1 - i): sample i with nothing
    supervised, so no sample is skipped and none counts twice.
    """
    own = batches[shard::num_shards]
    count = -(-len(batches) // num_shards)
    fillers = [[-1 - i for i in batches[j % len(batches)]] for j in range(count - len(own))]
    return own + fillers


class _WithFillers(torch.utils.data.Dataset):
    """Index -1 - i reads sample i with its loss mask cleared (see ``shard_batches``)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        if index >= 0:
            return self.dataset[index]
        ids, mask, *rest = self.dataset[-1 - index]
        return (ids, [0] * len(mask), *rest)
