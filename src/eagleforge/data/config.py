"""The `data` config section: which conversations to train on and how to tokenize them.

Read by every entry point that touches data (``eagleforge.train``, ``eagleforge.prepare``,
``eagleforge.inspect_data``, ...); where the rows come from is ``eagleforge.data.sources``,
how they become tokens is ``eagleforge.data.preprocess``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from omegaconf import MISSING

from eagleforge.data.conversations import DataFormat
from eagleforge.data.corpora import MixSource
from eagleforge.data.named_templates import TEMPLATES
from eagleforge.errors import ConfigError

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

    def describe(self) -> str:
        """The data in a few words, as the user configured it: ``data=jsonl
        (data.path=a.jsonl)``."""
        where = (
            f"data.path={self.path}" if self.path
            else f"data.hub_id={self.hub_id}" if self.hub_id
            else f"{len(self.mixture)} mixed corpora" if self.mixture
            else ""
        )  # fmt: skip
        return f"data={self.name}" + (f" ({where})" if where else "")

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
