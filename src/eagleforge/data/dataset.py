"""The `data` config section and the tokenized, cached train/eval datasets.

Tokenized conversations are cached under ``<cache_dir>/data/<key>`` as an HF dataset, where
the key hashes the source file's bytes, the tokenizer and chat template, and every setting
that changes the result -- so an edited file is re-tokenized even when its path is the same.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import MISSING

from eagleforge.data.conversations import DataFormat, chitchat_source_file, read_conversations
from eagleforge.data.template import end_of_turn_marker, render, tokenize_rendered
from eagleforge.errors import ConfigError, DataError

log = logging.getLogger(__name__)

# Bump when tokenization or masking changes, so old caches are not reused.
PIPELINE_VERSION = 2


@dataclass
class DataConfig:
    """The `data` config section: which conversations to train on and how to tokenize them."""

    # Short name of the data set, used in run names.
    name: str = MISSING
    # Row format of the file (auto | sharegpt | openai) or the bundled chitchat set.
    format: DataFormat = DataFormat.auto
    # Training conversations, a .jsonl or .json file (not used by format=chitchat).
    path: str | None = None
    # Held-out conversations file; null = hold out num_eval_samples of the training data.
    eval_path: str | None = None
    # Conversations held out for eval when eval_path is null (0 = no eval).
    num_eval_samples: int = 64
    # Use only the first N conversations of the source (null = all).
    max_num_samples: int | None = None
    # Tokens per sample; longer conversations are truncated (their tail is dropped).
    max_length: int = 2048
    # Supervise only the last assistant turn of each conversation.
    train_only_last_turn: bool = False

    def __post_init__(self) -> None:
        if self.format != DataFormat.chitchat and not self.path:
            raise ConfigError(
                f"data.path is required for data '{self.name}' (format={self.format.value}): "
                "set data.path=/path/to/conversations.jsonl."
            )
        if self.max_length < 4:
            raise ConfigError(f"data.max_length must be >= 4 tokens, got {self.max_length}.")
        if self.num_eval_samples < 0:
            raise ConfigError(f"data.num_eval_samples must be >= 0, got {self.num_eval_samples}.")


class TokenizedDataset(torch.utils.data.Dataset):
    """(input_ids, loss_mask) pairs of python int lists."""

    def __init__(self, input_ids: list[list[int]], loss_mask: list[list[int]]) -> None:
        self.input_ids = input_ids
        self.loss_mask = loss_mask

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> tuple[list[int], list[int]]:
        return self.input_ids[index], self.loss_mask[index]

    def __iter__(self) -> Iterator[tuple[list[int], list[int]]]:
        return zip(self.input_ids, self.loss_mask, strict=True)

    def subset(self, indices: list[int]) -> TokenizedDataset:
        return TokenizedDataset(
            [self.input_ids[i] for i in indices], [self.loss_mask[i] for i in indices]
        )

    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.input_ids)


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _tokenizer_digest(tokenizer) -> str:  # type: ignore[no-untyped-def]
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    digest.update(
        (backend.to_str() if backend is not None else str(tokenizer.get_vocab())).encode()
    )
    digest.update(str(tokenizer.chat_template).encode())
    return digest.hexdigest()


def tokenize_source(
    fmt: DataFormat,
    path: str | None,
    tokenizer,  # type: ignore[no-untyped-def]
    max_length: int,
    train_only_last_turn: bool,
    max_num_samples: int | None,
    cache_dir: str | Path,
) -> TokenizedDataset:
    """Tokenize one source (cached by content); samples without supervised tokens are dropped."""
    source_file = chitchat_source_file() if fmt == DataFormat.chitchat else Path(str(path))
    if not source_file.is_file():
        raise DataError(
            f"data file {source_file} does not exist; check data.path / data.eval_path."
        )
    key_parts = {
        "source": _file_digest(source_file),
        "format": fmt.value,
        "tokenizer": _tokenizer_digest(tokenizer),
        "max_length": max_length,
        "train_only_last_turn": train_only_last_turn,
        "max_num_samples": max_num_samples,
        "version": PIPELINE_VERSION,
    }
    key = hashlib.sha256(json.dumps(key_parts, sort_keys=True).encode()).hexdigest()[:16]
    cached = Path(cache_dir) / "data" / key
    import datasets

    if (cached / "dataset_info.json").exists():
        columns = datasets.load_from_disk(str(cached)).to_dict()
        return TokenizedDataset(columns["input_ids"], columns["loss_mask"])

    eot = end_of_turn_marker(tokenizer)
    rendered = []
    for index, (where, messages) in enumerate(read_conversations(fmt, path)):
        if max_num_samples is not None and index >= max_num_samples:
            break
        rendered.append(render(messages, tokenizer, eot, train_only_last_turn, where))
    samples = tokenize_rendered(rendered, tokenizer, max_length)
    kept = [(ids, mask) for ids, mask in samples if sum(mask) > 0]
    if len(kept) < len(samples):
        log.info(
            "%s: dropped %d conversations with no supervised tokens",
            source_file,
            len(samples) - len(kept),
        )
    if not kept:
        raise DataError(f"{source_file}: no conversation has an assistant turn to train on.")
    input_ids = [ids for ids, _ in kept]
    loss_mask = [mask for _, mask in kept]

    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=cached.parent))
    try:
        datasets.Dataset.from_dict({"input_ids": input_ids, "loss_mask": loss_mask}).save_to_disk(
            str(tmp)
        )
        tmp.rename(cached)
    except OSError:
        if not (cached / "dataset_info.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return TokenizedDataset(input_ids, loss_mask)


def build_datasets(
    cfg: DataConfig, tokenizer, cache_dir: str | Path, seed: int
) -> tuple[TokenizedDataset, TokenizedDataset | None]:  # type: ignore[no-untyped-def]
    """Train and eval datasets; without eval_path a seeded random hold-out of the training data."""
    common = dict(
        tokenizer=tokenizer,
        max_length=cfg.max_length,
        train_only_last_turn=cfg.train_only_last_turn,
        cache_dir=cache_dir,
    )
    full = tokenize_source(cfg.format, cfg.path, max_num_samples=cfg.max_num_samples, **common)
    if cfg.eval_path:
        return full, tokenize_source(DataFormat.auto, cfg.eval_path, max_num_samples=None, **common)
    if cfg.num_eval_samples == 0:
        return full, None
    if cfg.num_eval_samples >= len(full):
        raise ConfigError(
            f"data.num_eval_samples={cfg.num_eval_samples} leaves no training data "
            f"({len(full)} conversations); lower it."
        )
    order = torch.randperm(len(full), generator=torch.Generator().manual_seed(seed)).tolist()
    held_out = sorted(order[: cfg.num_eval_samples])
    train = sorted(order[cfg.num_eval_samples :])
    return full.subset(train), full.subset(held_out)


@dataclass
class Collator:
    """Right-pads a list of samples into tensors: input_ids, attention_mask, loss_mask [B, T]."""

    pad_token_id: int

    def __call__(self, samples: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
        length = max(len(ids) for ids, _ in samples)
        input_ids = torch.full((len(samples), length), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(samples), length), dtype=torch.bool)
        loss_mask = torch.zeros((len(samples), length), dtype=torch.bool)
        for row, (ids, mask) in enumerate(samples):
            input_ids[row, : len(ids)] = torch.as_tensor(ids)
            attention[row, : len(ids)] = True
            loss_mask[row, : len(mask)] = torch.as_tensor(mask, dtype=torch.bool)
        return {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask}
