"""Checks, before any heavy work, that every input a command names exists.

A missing model directory, data file, feature store or prompt file should cost the user one
line and a second, not a minute of model loading and a page of Hugging Face tracebacks. Each
entry point calls ``check_inputs`` right after typing its config; everything here is a file
system lookup (plus a look into the local Hugging Face cache for a hub id or a named
benchmark while offline).
The loaders still check what they read in full (formats, manifests, checksums).

Every place a command writes is checked the same way (``check_outputs``), so that a read-only
directory or a file in the way costs one line naming the setting to change, not a traceback
after the model loaded. The run directory itself is checked earlier still, before Hydra
writes into it (``eagleforge.locking.LockRunDir``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from eagleforge.checkpoint import explicit_checkpoint
from eagleforge.config import EagleForgeConfig
from eagleforge.data.config import DataConfig
from eagleforge.data.conversations import DataFormat, expand_sources, source_files
from eagleforge.data.corpora import check_hub_source
from eagleforge.data.sources import config_hub_source, mixture_hub_source
from eagleforge.errors import ConfigError, DataError
from eagleforge.files import resolve_cache_dir, unwritable_reason
from eagleforge.formats.directory import family_problem
from eagleforge.speculative.prompts import hub_unavailable, offline_message, parse_spec
from eagleforge.targets.source import check_model_path
from eagleforge.tracking import (
    TrackerConfig,
    TrackerKind,
    resolve_tracking_uri,
    server_down,
    store_paths,
)


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


def check_outputs(
    config: EagleForgeConfig,
    outputs: Mapping[str, str | None] | None = None,
    *,
    output_root: bool = False,
    tracking: bool = False,
    cache: bool = True,
) -> None:
    """ConfigError naming the setting to change for the first place this command would write
    but cannot (a read-only directory, a file in the way): ``outputs`` (setting -> path: the
    command's own, e.g. ``{"prepare.output_dir": ...}``; None is skipped), ``output_root``
    (the runs and the default MLflow store), the MLflow store (``tracking``: a local one) and
    the cache (``cache``: converted models, tokenized data)."""
    for setting, path in (outputs or {}).items():
        if path:
            where = f"{setting}={path}{_relative_note(path)}"
            _check_writable(path, where, f"choose another {setting}")
    if output_root:
        _check_writable(
            config.output_root,
            f"output_root={config.output_root}{_relative_note(config.output_root)}",
            "set output_root to a writable directory",
        )
    if tracking:
        check_tracking_store(config.tracker, config.output_root)
    if cache:
        check_cache_dir(config.cache_dir)


def _check_writable(path: str | Path, setting: str, fix: str) -> None:
    reason = unwritable_reason(path)
    if reason:
        raise ConfigError(f"{setting}: cannot write there ({reason}); {fix}.")


def _relative_note(path: str | Path) -> str:
    """Where a relative path lands: in the working directory, which may be read-only."""
    return "" if Path(path).is_absolute() else f" (in the working directory {Path.cwd()})"


def check_cache_dir(cache_dir: str | None) -> None:
    """The cache (converted models, tokenized data, vocab maps) can be written: ``cache_dir``,
    else $EAGLEFORGE_CACHE_DIR, else ~/.cache/eagleforge -- whose setting is named."""
    path = resolve_cache_dir(cache_dir)
    if cache_dir:
        setting = f"cache_dir={cache_dir}{_relative_note(path)}"
    elif os.environ.get("EAGLEFORGE_CACHE_DIR"):
        setting = f"EAGLEFORGE_CACHE_DIR={path}{_relative_note(path)}"
    else:
        setting = f"the cache {path} (in $HOME; EAGLEFORGE_CACHE_DIR unset)"
    _check_writable(
        path, setting, "set EAGLEFORGE_CACHE_DIR (or cache_dir=DIR) to a writable directory"
    )


def check_tracking_store(tracker: TrackerConfig, output_root: str) -> None:
    """A local MLflow store (a sqlite file, or a directory of runs) can be written; the
    setting that chose it is named: tracker.tracking_uri, $MLFLOW_TRACKING_URI, or
    output_root for the default store. A server is asked by check_tracking_server."""
    if tracker.kind != TrackerKind.mlflow:
        return
    uri = resolve_tracking_uri(tracker, output_root)
    elsewhere = "at a writable place (e.g. sqlite:////DIR/mlflow.db)"
    if tracker.tracking_uri:
        setting, fix = f"tracker.tracking_uri={uri}", f"point tracker.tracking_uri {elsewhere}"
    elif os.environ.get("MLFLOW_TRACKING_URI"):
        setting = f"MLFLOW_TRACKING_URI={uri}"
        fix = f"point MLFLOW_TRACKING_URI (or tracker.tracking_uri) {elsewhere}"
    else:
        setting = f"output_root={output_root} (its MLflow store {uri})"
        fix = f"set output_root to a writable directory, or point tracker.tracking_uri {elsewhere}"
    for place in store_paths(uri):
        _check_writable(place, setting, fix)


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
