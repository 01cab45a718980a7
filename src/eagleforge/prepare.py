"""Capture the target's hidden states once into a feature store, for offline training.

    python -m eagleforge.prepare +model=smollm2 data=chitchat prepare.output_dir=/data/features
    python -m eagleforge.train +model=smollm2 data=chitchat data.features=/data/features

Uses the same data path, template and cache as training. Prints the store's expected size and
refuses to start when the disk lacks room; writes shard by shard, atomically; re-running the
same command after a crash continues with the first missing shard. Under torchrun each rank
captures every WORLD_SIZE-th shard. See docs/offline.md.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

import hydra
import torch
from omegaconf import DictConfig

from eagleforge.batch import IMAGE_KEYS
from eagleforge.config import (
    EagleForgeConfig,
    check_cli_overrides,
    conf_dir,
    register_configs,
    to_typed,
)
from eagleforge.data.collate import Collator
from eagleforge.data.features import (
    Compression,
    Manifest,
    expected_manifest,
    read_sidecar,
    shard_complete,
    write_shard,
)
from eagleforge.data.preprocess import TokenizedDataset
from eagleforge.data.split import build_datasets
from eagleforge.engine.server import engine_python
from eagleforge.errors import (
    ConfigError,
    EagleForgeError,
    exit_on_user_error,
    stop_on_signals,
    stopped_in_one_line,
)
from eagleforge.locking import beside, exclusive
from eagleforge.parallel import resolve_device
from eagleforge.preflight import check_inputs, check_outputs
from eagleforge.progress import Progress, quiet_library_bars
from eagleforge.targets.base import TargetBackend, TargetOutput, release
from eagleforge.targets.config import TargetBackendKind
from eagleforge.targets.registry import build_target
from eagleforge.targets.source import (
    VisionProcessor,
    checked_aux_layer_ids,
    load_processor,
    load_tokenizer,
    resolve_model_dir,
)

log = logging.getLogger("eagleforge.prepare")

# a collated batch and what the target returned for it
_Captured = tuple[dict[str, torch.Tensor], TargetOutput]


def bytes_per_token(
    hidden_size: int, dtype: torch.dtype, compress: Compression, mrope: bool = False
) -> int:
    """aux (3 H) + final (H) hidden states, int32 id and uint8 mask (+ 4 fp32 scales, + 3
    int32 M-RoPE positions)."""
    extra = 5 + (3 * 4 if mrope else 0)
    if compress == Compression.fp8:
        return 4 * hidden_size + 4 * 4 + extra
    return 4 * hidden_size * dtype.itemsize + extra


def capture_split(
    store: Path,
    dataset: TokenizedDataset,
    manifest: Manifest,
    target: TargetBackend,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    processor: VisionProcessor | None = None,
) -> dict[str, int]:
    """Capture the missing shards of this rank into ``store``; counts of what was written.
    With ``processor`` (vision-language data) the samples' images go to the target, and its
    M-RoPE positions are stored with each sample."""
    store.mkdir(parents=True, exist_ok=True)
    if (store / "manifest.json").is_file():
        _check_continues(store, manifest)
    else:
        manifest.write(store)
    per_shard = manifest.samples_per_shard
    todo = [
        shard
        for shard in range(manifest.num_shards)
        if shard % world_size == rank and not shard_complete(store, shard)
    ]
    lengths = dataset.lengths()
    tokens = sum(sum(lengths[s * per_shard : (s + 1) * per_shard]) for s in todo)
    counts = {"shards": len(todo), "samples": 0, "tokens": 0, "nonfinite": 0}
    device = target.lm_head_weight().device
    collate = Collator(
        0,
        processor.image_processor if processor is not None else None,
        processor.image_token_id if processor is not None else None,
    )
    bar = Progress(tokens, f"capture {store.name}", "tok", unit_scale=True)
    chunks: list[tuple[int, list[int]]] = []  # (shard, the indices of one forward)
    for shard in todo:
        indices = list(range(shard * per_shard, min((shard + 1) * per_shard, len(dataset))))
        chunks += [(shard, indices[s : s + batch_size]) for s in range(0, len(indices), batch_size)]

    def forward(chunk: list[int]) -> _Captured:
        batch = collate([dataset[i] for i in chunk])
        images = {k: batch[k].to(device) for k in IMAGE_KEYS if k in batch}
        ids_BT, mask_BT = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        return batch, target.forward(ids_BT, mask_BT, **images)

    captured = _in_order(forward, [chunk for _, chunk in chunks], target.forward_in_engine)
    samples: list[tuple[Any, ...]] = []
    nonfinite: list[int] = []
    for k, ((shard, chunk), (batch, out)) in enumerate(zip(chunks, captured, strict=True)):
        aux_BTA, final_BTH = out.aux_BTA.cpu(), out.final_hidden_BTH.cpu()  # one copy
        positions_3BT = out.position_ids_3BT
        if manifest.mrope and positions_3BT is None:
            raise ConfigError(
                "data.is_vlm=true but the target returned no M-RoPE positions; capture a "
                "vision-language target (e.g. +model=qwen2_5_vl) or set data.is_vlm=false."
            )
        for row, index in enumerate(chunk):
            n = lengths[index]
            aux, final = aux_BTA[row, :n], final_BTH[row, :n]
            if not (bool(torch.isfinite(aux).all()) and bool(torch.isfinite(final).all())):
                nonfinite.append(index)
                continue
            ids, mask = batch["input_ids"][row, :n], batch["loss_mask"][row, :n]
            if manifest.mrope:
                assert positions_3BT is not None
                samples.append((index, ids, mask, aux, final, positions_3BT[:, row, :n].cpu()))
            else:
                samples.append((index, ids, mask, aux, final))
        bar.update(sum(lengths[i] for i in chunk))
        if k + 1 < len(chunks) and chunks[k + 1][0] == shard:
            continue  # the shard's last batch is still to come
        record = write_shard(store, shard, samples, nonfinite, Compression(manifest.compress))
        counts["samples"] += record["samples"]
        counts["tokens"] += record["tokens"]
        counts["nonfinite"] += len(nonfinite)
        if nonfinite:
            log.warning(
                "%s shard %d: left out samples %s (non-finite hidden states)",
                store,
                shard,
                nonfinite,
            )
        samples, nonfinite = [], []
    bar.close()
    return counts


def _in_order(
    forward: Callable[[list[int]], _Captured], chunks: list[list[int]], ahead: bool
) -> Iterator[_Captured]:
    """``forward`` of each chunk, in order. ``ahead`` (a target whose forward waits on an
    engine process): the next chunk is sent while the caller stores this one, so the engine
    never waits for the shard writes."""
    if not ahead:
        yield from map(forward, chunks)
        return
    pool = ThreadPoolExecutor(1, thread_name_prefix="capture")
    try:
        pending: Future[_Captured] | None = None
        for chunk in chunks:
            sent = pool.submit(forward, chunk)  # runs once the chunk before it is done
            if pending is not None:
                yield pending.result()
            pending = sent
        if pending is not None:
            yield pending.result()
    except BaseException:
        # a stop or an error: the request in flight is not waited for (an engine that hangs
        # would hold the stop for vllm.request_timeout_s); release() stops the engine, which
        # ends it, and its states were never to be written
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def run(config: EagleForgeConfig) -> Path:
    cfg = config.prepare
    if not cfg.output_dir:
        raise ConfigError(
            "prepare.output_dir is not set: give the directory for the feature store."
        )
    check_inputs(config)
    out = Path(cfg.output_dir)
    # rank 0 speaks for a torchrun job: refused, it exits and torchrun stops the other ranks
    # before their target is loaded, long before they write a shard
    lock = (
        exclusive(beside(out), output=out, field="prepare.output_dir")
        if int(os.environ.get("RANK", 0)) == 0
        else nullcontext()
    )
    with lock:
        return _prepare(config, out)


def _prepare(config: EagleForgeConfig, out: Path) -> Path:
    # under torchrun each rank captures on its own GPU (a target backend each, no process group)
    device = resolve_device(config.parallel, int(os.environ.get("LOCAL_RANK", 0)))
    cache_dir = config.resolved_cache_dir()
    model_dir = resolve_model_dir(config.model, cache_dir)
    tokenizer = load_tokenizer(config.model, model_dir)
    processor = (
        load_processor(config.model, model_dir, config.data.min_pixels, config.data.max_pixels)
        if config.data.is_vlm
        else None
    )
    if config.target.backend == TargetBackendKind.vllm:
        _check_producers(config)
    data = build_datasets(config.data, tokenizer, cache_dir, config.seed, processor)
    dtype = config.model.dtype.torch_dtype(device)
    splits = _plan(config, model_dir, data, dtype)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    # a store of another setup is refused, and a complete one left as it is, before the
    # target loads (a vLLM engine takes minutes to start)
    if all(_complete(out / split, manifest, rank, world) for split, _, manifest in splits):
        tokens = sum(dataset.num_tokens() for _, dataset, _ in splits)
        print(f"feature store {out}: complete ({tokens:,} tokens), nothing to capture", flush=True)
        return out
    out.mkdir(parents=True, exist_ok=True)
    with stop_on_signals():
        target = build_target(
            config.model, config.target, model_dir, device,
            engine=config.vllm, engine_log=out / "vllm.log",
        )  # fmt: skip
        try:
            return _capture(config, out, splits, target, processor, rank, world)
        finally:
            release(target)


def _check_producers(config: EagleForgeConfig) -> None:
    """target=vllm: a missing engine costs a line before the data is read, and training's
    queue between the producers and the step, which a capture has not, is refused if set."""
    producers = config.target.producers
    if producers.queue_batches != type(producers)().queue_batches:
        raise ConfigError(
            f"target.producers.queue_batches={producers.queue_batches} sizes training's queue "
            "between the producers and the step; prepare has none (it sends a batch ahead while "
            "it writes the last); remove it."
        )
    if not producers.urls:
        engine_python(config.vllm)


class _Split(NamedTuple):
    """One split of the store: its name, its rows and the manifest its directory must have."""

    name: str
    dataset: TokenizedDataset
    manifest: Manifest


def _plan(
    config: EagleForgeConfig, model_dir: Path | str, data: Any, dtype: torch.dtype
) -> list[_Split]:
    """Each split's manifest, from the target's config file and the run's settings alone."""
    from transformers import AutoConfig

    cfg = config.prepare
    text = AutoConfig.from_pretrained(
        model_dir, trust_remote_code=config.model.trust_remote_code, revision=config.model.revision
    ).get_text_config()
    fields = expected_manifest(
        config.model.name,
        Path(model_dir),
        text,
        checked_aux_layer_ids(config.model.aux_layer_ids, text.num_hidden_layers),
        config.data.template,
        config.data.max_length,
        config.data.is_vlm,
        config.resolved_cache_dir(),
        config.model.revision,
    )
    named = [("train", data.train)] + ([("eval", data.eval)] if data.eval is not None else [])
    return [
        _Split(
            split,
            dataset,
            Manifest(
                **fields,
                dtype=str(dtype).removeprefix("torch."),
                data_key=f"{data.cache_key}/{split}",
                samples_per_shard=cfg.samples_per_shard,
                num_samples=len(dataset),
                num_shards=-(-len(dataset) // cfg.samples_per_shard),
                compress=cfg.compress.value,
                data_source=config.data.describe(),
                captured_by=config.target.backend.value,
            ),
        )
        for split, dataset in named
    ]


def _complete(store: Path, manifest: Manifest, rank: int, world_size: int) -> bool:
    """Whether ``store`` holds every shard of this rank, captured for ``manifest``'s setup
    (DataError naming the fields where it was captured for another)."""
    if not (store / "manifest.json").is_file():
        return False
    _check_continues(store, manifest)
    return all(
        shard_complete(store, shard)
        for shard in range(manifest.num_shards)
        if shard % world_size == rank
    )


def _check_continues(store: Path, manifest: Manifest) -> None:
    """A capture goes on in ``store`` only for the same setup: every field must agree, the
    dtype and shard layout included; the record fields need not (another backend may go on:
    its states are the same)."""
    noted = ("data_source", "captured_by")
    planned = {k: v for k, v in asdict(manifest).items() if k not in noted}
    Manifest.read(store).check_matches(planned, store, "prepare.output_dir")


def _capture(
    config: EagleForgeConfig,
    out: Path,
    splits: list[_Split],
    target: TargetBackend,
    processor: VisionProcessor | None,
    rank: int,
    world: int,
) -> Path:
    """Every split through ``target`` into the store ``out``."""
    cfg = config.prepare
    planned = splits[0].manifest
    loaded = (target.aux_layer_ids, int(target.config.get_text_config().hidden_size))
    # the plan read the config file the target loaded: a bug if they differ
    if loaded != (planned.aux_layer_ids, planned.hidden_size):
        raise RuntimeError(f"the target loaded layers and width {loaded}, the plan {planned}")
    dtype = getattr(torch, planned.dtype)
    per_token = bytes_per_token(planned.hidden_size, dtype, cfg.compress, planned.mrope)
    tokens = sum(dataset.num_tokens() for _, dataset, _ in splits)
    needed = tokens * per_token
    free = shutil.disk_usage(out).free
    print(
        f"feature store {out}: {tokens:,} tokens x "
        f"{per_token:,} bytes = {needed / 2**30:.2f} GiB ({free / 2**30:.1f} GiB free)",
        flush=True,
    )
    if needed > free:
        raise ConfigError(
            f"{out}: the store needs {needed / 2**30:.2f} GiB but only {free / 2**30:.2f} GiB "
            "are free; free space or choose another prepare.output_dir."
        )
    for split, dataset, manifest in splits:
        start = time.perf_counter()
        counts = capture_split(
            out / split, dataset, manifest, target, cfg.batch_size, rank, world, processor
        )
        seconds = time.perf_counter() - start
        print(
            f"{split}: wrote {counts['shards']} shards, {counts['samples']} samples, "
            f"{counts['tokens']:,} tokens ({counts['tokens'] / max(seconds, 1e-9):,.0f} tokens/s); "
            f"left out {counts['nonfinite']} samples with non-finite values",
            flush=True,
        )
    return out


def stop_line(output_dir: str | None, how: str) -> str:
    """What a stopped capture prints: each split's whole shards on disk, which are kept, and
    that the same command captures the rest (it goes on with the first missing shard)."""
    if not output_dir:
        return f"{how}: prepare stopped before it wrote anything."
    out = Path(output_dir)
    splits = []
    for store in sorted(p.parent for p in out.glob("*/manifest.json")):
        try:
            manifest = Manifest.read(store)
        except EagleForgeError:  # unreadable: the rerun says so
            continue
        done = [s for s in range(manifest.num_shards) if shard_complete(store, s)]
        samples = sum(int(read_sidecar(store, s)["samples"]) for s in done)
        splits.append(
            f"{store.name} {len(done)} of {manifest.num_shards} shards ({samples:,} samples)"
        )
    if not splits:
        return (
            f"{how}: prepare stopped before it wrote a shard into {out}; run the same command "
            "again to start the capture."
        )
    return (
        f"{how}: prepare stopped before its end; the whole shards in {out} are kept "
        f"({', '.join(splits)}); run the same command again to capture the rest."
    )


@hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="no_run_dir")
@exit_on_user_error
def _hydra_main(cfg: DictConfig) -> None:
    """One capture; SIGTERM, SIGHUP or Ctrl-C end it in one line (the shards on disk are
    whole and kept), its engine stopped, with status 128 + the signal."""
    config = to_typed(cfg)
    check_outputs(config, {"prepare.output_dir": config.prepare.output_dir})
    with stopped_in_one_line(functools.partial(stop_line, config.prepare.output_dir)):
        run(config)


def main() -> None:
    quiet_library_bars()
    register_configs()
    check_cli_overrides()
    _hydra_main()


if __name__ == "__main__":
    main()
