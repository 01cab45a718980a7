"""The train and eval datasets of a data config: both sources preprocessed, or a seeded
hold-out of the training rows when no eval source is set."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eagleforge.data.config import DataConfig
from eagleforge.data.conversations import ROW_CONVERTERS, DataFormat
from eagleforge.data.preprocess import DataReport, TokenizedDataset, preprocess_source
from eagleforge.errors import ConfigError

if TYPE_CHECKING:
    from eagleforge.targets.source import VisionProcessor

log = logging.getLogger(__name__)


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
