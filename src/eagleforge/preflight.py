"""Checks, before any heavy work, that every input a command names exists.

A missing model directory, data file, feature store or prompt file should cost the user one
line and a second, not a minute of model loading and a page of Hugging Face tracebacks. Each
entry point calls ``check_inputs`` right after typing its config; everything here is a file
system lookup (plus a look into the local Hugging Face cache for a hub id or a named
benchmark while offline).
The loaders still check what they read in full (formats, manifests, checksums).
"""

from __future__ import annotations

import os
from pathlib import Path

from eagleforge.checkpoint import explicit_checkpoint
from eagleforge.config import EagleForgeConfig
from eagleforge.data.config import DataConfig
from eagleforge.data.conversations import DataFormat, expand_sources, source_files
from eagleforge.data.corpora import check_hub_source
from eagleforge.data.sources import config_hub_source, mixture_hub_source
from eagleforge.errors import ConfigError, DataError
from eagleforge.formats.check import family_problem
from eagleforge.speculative.prompts import hub_unavailable, offline_message, parse_spec
from eagleforge.targets.source import check_model_path
from eagleforge.tracking import TrackerConfig, TrackerKind, server_down


def check_inputs(
    config: EagleForgeConfig,
    *,
    model: bool = True,
    data: bool = True,
    need_weights: bool = True,
    prompts: bool = False,
    tracking: bool = False,
) -> None:
    """ConfigError/DataError naming the first missing input of this command: the target model
    (``model``: the command loads it), the training data (``data``: online data files, or the feature store of data.features),
    the prompts (``prompts``, or when training measures real τ), model.draft_init and an
    explicit trainer.resume, and (``tracking``: the command logs) a tracking server."""
    if model:
        check_model_path(config.model, need_weights=need_weights)
    if data:
        if config.data.features:
            check_feature_store(config.data.features)
        else:
            check_data_source(config.data)
            if config.data.eval_path:
                expand_sources([config.data.eval_path])
    if prompts or config.trainer.eval_tau_every_n_steps:
        check_prompts(config.eval.prompt_sets())
    if config.model.draft_init and not Path(config.model.draft_init).is_dir():
        raise ConfigError(
            f"model.draft_init={config.model.draft_init}: no such directory; give a "
            "checkpoints/step_* directory or an exported draft, or unset it."
        )
    mismatch = config.model.draft_init and family_problem(
        config.model.draft_init, config.draft.family
    )
    if mismatch:
        raise ConfigError(f"model.draft_init={config.model.draft_init}: {mismatch}.")
    if tracking:
        check_tracking_server(config.tracker)
    if config.trainer.resume not in ("auto", "never"):
        explicit_checkpoint(config.trainer.resume)


def check_data_source(data: DataConfig) -> None:
    """The training rows can be read: their files exist; a hub data set (each hub corpus of a
    mixture) is in the local cache or, online, on a reachable hub (one small request)."""
    patterns = data.sources()
    if patterns or data.format == DataFormat.chitchat:
        source_files(data.format, patterns)
    elif data.mixture:
        for index, entry in enumerate(data.mixture):
            if entry.path:
                expand_sources([entry.path])
            else:
                check_hub_source(mixture_hub_source(data, index))
    elif data.hub_id:
        check_hub_source(config_hub_source(data))


def check_feature_store(store: str) -> None:
    """data.features names a store that eagleforge.prepare wrote (its train split at least)."""
    if not (Path(store) / "train" / "manifest.json").is_file():
        raise ConfigError(
            f"data.features={store}: no feature store there (no train/manifest.json); write "
            "one with python -m eagleforge.prepare prepare.output_dir=DIR, or fix the path."
        )


def check_tracking_server(tracker: TrackerConfig, timeout_s: float = 5.0) -> None:
    """An MLflow server named by tracker.tracking_uri (or $MLFLOW_TRACKING_URI) answers. A run
    cannot be created without it, so this is found now rather than after the model loaded;
    once the run exists, an outage only spools (eagleforge.tracking)."""
    uri = tracker.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or ""
    reason = server_down(uri, timeout_s) if tracker.kind == TrackerKind.mlflow else None
    if reason is not None:
        raise ConfigError(
            f"tracker.tracking_uri={uri}: no MLflow server answers ({reason}); start it "
            "(make mlflow-server), point tracker.tracking_uri at a running one, or log to a "
            "local store with tracker.tracking_uri=null (and MLFLOW_TRACKING_URI unset)."
        )


def check_prompts(prompts: list[str]) -> None:
    """Every eval.prompts entry is a file, a bundled set, or a benchmark the hub can give:
    while the hub is offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE), one in the local cache
    (mtbench falls back to the bundled set). Nothing is fetched."""
    for text in prompts:
        try:
            spec = parse_spec(text)
        except DataError as e:
            raise ConfigError(str(e)) from None
        bench = spec.bench
        if bench and spec.path is None and bench.fallback is None and hub_unavailable(bench):
            raise ConfigError(offline_message(bench))
