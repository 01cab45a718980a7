"""Train an EAGLE-3 draft for a frozen target LLM.

    python -m eagleforge.train +model=smollm2 data=chitchat [key=value ...]
    python -m eagleforge.train -m +model=tiny data=chitchat optimizer.lr=1e-4,3e-4   # sweep
    python -m eagleforge.train +model=qwen2_5_vl data=vlm data.path=/data/vlm.jsonl  # images

Builds the components from the typed config and hands them to the Trainer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from eagleforge.batch import TTTBatch
from eagleforge.checkpoint import (
    checksum_problem,
    explicit_checkpoint,
    load_draft_weights,
    newest_checkpoint,
    read_progress,
)
from eagleforge.config import EagleForgeConfig, conf_dir, register_configs, to_typed
from eagleforge.data.dataset import DataReport, TokenizedDataset, build_datasets, make_loader
from eagleforge.data.features import FeatureDataset
from eagleforge.data.vocab import cached_vocab_map
from eagleforge.draft.model import AttentionBackend, DraftArchitecture, Eagle3Draft
from eagleforge.draft.ttt import TTTModule, step_weights
from eagleforge.errors import ConfigError, EagleForgeError
from eagleforge.formats import check_draft, load_sglang
from eagleforge.optim import apply_master_dtype, build_optimizer
from eagleforge.parallel.dist import World, distributed
from eagleforge.parallel.fsdp import shard_draft
from eagleforge.parallel.launch import is_main_process
from eagleforge.parallel.tp import tp_axis
from eagleforge.parallel.usp import SequenceParallel, USPBackend, check_heads, shard_sequence
from eagleforge.preflight import check_inputs
from eagleforge.prepare import expected_manifest
from eagleforge.profiling import StepProfiler
from eagleforge.speculative.probe import TauProbe
from eagleforge.speculative.prompts import PromptRenderer
from eagleforge.speculative.report import plot_tau_by_step
from eagleforge.targets import build_target
from eagleforge.targets.head import HeadOnlyTarget
from eagleforge.targets.hf import HFTarget
from eagleforge.targets.source import (
    VisionProcessor,
    load_processor,
    load_tokenizer,
    resolve_model_dir,
)
from eagleforge.targets.teacher import teacher_batch
from eagleforge.tracking import (
    MLflowTracker,
    Tracker,
    build_tracker,
    default_run_name,
    flatten,
    record_failure,
    record_stop,
)
from eagleforge.trainer import StopSignals, Trainer, TrainResult

log = logging.getLogger("eagleforge.train")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class Inputs:
    """The data and the target a run trains from."""

    train: TokenizedDataset | FeatureDataset
    eval: TokenizedDataset | FeatureDataset | None
    target: Any  # a target backend online (build_target), HeadOnlyTarget offline
    token_samples: Iterable[tuple[list[int], list[int]]]  # for the draft vocab map
    vocab_cache_dir: Path
    report: DataReport | None  # preprocessing counts (online)
    processor: VisionProcessor | None = None  # loads the images of vision-language data


def online_inputs(
    config: EagleForgeConfig, model_dir: Any, tokenizer: Any, world: World, cache_dir: Path
) -> Inputs:
    """Tokenized conversations; the full target runs in every step (split over the tp ranks)."""
    processor = (
        load_processor(config.model, model_dir, config.data.min_pixels, config.data.max_pixels)
        if config.data.is_vlm
        else None
    )
    with world.main_first():  # rank 0 fills the tokenized-data cache
        data = build_datasets(config.data, tokenizer, cache_dir, config.seed, processor)
    target = build_target(
        config.model, config.target, model_dir, world.device, tp_mesh=tp_axis(world.mesh)
    )
    key = data.cache_key
    if data.train.images is not None:
        # image sizes (not in the cache key) decide which conversations fit data.max_length
        kept = json.dumps(data.train.lengths()).encode()
        key += "-" + hashlib.sha256(kept).hexdigest()[:12]
    vocab_dir = Path(cache_dir) / "vocab" / key
    if processor is not None and not getattr(target, "is_vlm", False):
        raise ConfigError(
            f"data.is_vlm=true but the target ({model_dir}) has no vision tower; choose a "
            "vision-language model (e.g. +model=qwen2_5_vl) or set data.is_vlm=false."
        )
    return Inputs(data.train, data.eval, target, data.train, vocab_dir, data.report, processor)


def offline_inputs(
    config: EagleForgeConfig, model_dir: Path, device: torch.device, cache_dir: Path
) -> Inputs:
    """A feature store from eagleforge.prepare, checked against this run; the target's
    embedding and lm_head only."""
    store = Path(config.data.features or "")
    verify = config.data.verify_features
    train_set = FeatureDataset(store / "train", verify)
    eval_set = FeatureDataset.eval_split(store, verify)
    dtype = config.model.dtype.torch_dtype(device)
    target = HeadOnlyTarget(model_dir, dtype, device, config.model.aux_layer_ids)
    expected = expected_manifest(config, model_dir, target)
    for dataset in (train_set, eval_set):
        if dataset is not None:
            dataset.manifest.check_matches(expected, dataset.store)
    key = hashlib.sha256(
        f"{store.resolve()}|{train_set.manifest.data_key}|{train_set.manifest.weight_hash}".encode()
    ).hexdigest()[:16]
    vocab_dir = Path(cache_dir) / "vocab" / f"features-{key}"
    return Inputs(train_set, eval_set, target, train_set.token_samples(), vocab_dir, None)


def tau_probe(
    config: EagleForgeConfig,
    target: Any,
    model_dir: Path,
    tokenizer: Any,
    inputs: Inputs,
    world: World,
) -> TauProbe | None:
    """The real-τ probe (trainer.eval_tau_every_n_steps), on rank 0 only. Offline training
    has no decoding target: rank 0 loads one for the probe, reading the store's layers."""
    if not config.trainer.eval_tau_every_n_steps or not world.is_main:
        return None
    if config.data.features:
        target = HFTarget.from_config(
            config.model, config.target, model_dir, world.device, target.aux_layer_ids
        )
    renderer = PromptRenderer(
        tokenizer, inputs.processor, config.data.min_pixels, config.data.max_pixels
    )
    return TauProbe(config.eval, config.trainer.eval_tau_prompts, target, renderer, config.seed)


def resolve_packing(config: EagleForgeConfig, target: Any) -> bool:
    """data.packing, or when null whether this run packs: offline always, online when the
    backend (target.supports_packing) and the target itself can mask packed documents."""
    if config.data.features:
        return config.data.packing is not False
    blocker = target.packing_blocker()
    if config.data.packing and blocker is not None:
        raise ConfigError(f"data.packing=true: {blocker}; set data.packing=false.")
    if config.data.packing is not None:
        return config.data.packing
    return blocker is None and config.target.supports_packing()


def init_from(draft: Eagle3Draft, path: Path, target_num_layers: int) -> None:
    """Fine-tune: the draft's weights and vocab map from a checkpoint or a draft exported in
    any format (by any tool), checked first."""
    problems = check_draft(path, target_num_layers)
    if problems:
        raise ConfigError(
            f"model.draft_init={path}: not a usable draft directory: {'; '.join(problems)}; "
            "give a checkpoints/step_* directory or a draft exported for this target."
        )
    _, tensors = load_sglang(path)
    load_draft_weights(draft, tensors, path)
    log.info("draft initialised from %s", path)


def resume_from(resume: str, output_dir: Path) -> Path | None:
    """The checkpoint that trainer.resume asks for (auto: the run's newest intact one, if any),
    its checksums verified."""
    if resume == "never":
        return None
    if resume == "auto":
        return newest_checkpoint(output_dir)
    path = explicit_checkpoint(resume)
    problem = checksum_problem(path)
    if problem is not None:
        raise ConfigError(
            f"trainer.resume={resume}: {problem}, so the checkpoint is corrupt; give an earlier "
            "checkpoints/step_* directory, or auto to resume from the newest intact one."
        )
    return path


def run(cfg: DictConfig) -> TrainResult:
    """Build everything from a composed config and train; returns the trainer's result.

    Under torchrun/SLURM every rank runs this; the process group lives as long as the run.
    """
    config: EagleForgeConfig = to_typed(cfg)
    check_inputs(config, tracking=is_main_process())
    with distributed(config.parallel) as world:
        if not world.is_main:  # one rank reports
            logging.getLogger("eagleforge").setLevel(logging.WARNING)
        return _run(cfg, config, world)


def _run(cfg: DictConfig, config: EagleForgeConfig, world: World) -> TrainResult:
    device = world.device
    attention = config.draft.attention_for(device)
    seed_everything(config.seed)
    cache_dir = config.resolved_cache_dir()
    # Each rank resolved Hydra's timestamped run dir itself: rank 0's is the run's.
    output_dir = Path(world.gather_objects(config.output_dir)[0])
    output_dir.mkdir(parents=True, exist_ok=True)

    with world.main_first():  # rank 0 fills the caches (converted model)
        model_dir = resolve_model_dir(config.model, cache_dir)
    tokenizer = load_tokenizer(config.model, model_dir)
    if config.data.features:
        inputs = offline_inputs(config, Path(model_dir), device, cache_dir)
    else:
        inputs = online_inputs(config, model_dir, tokenizer, world, cache_dir)
    train_set, eval_set, target = inputs.train, inputs.eval, inputs.target
    log.info(
        "data: %d train / %d eval conversations, %d train tokens",
        len(train_set),
        len(eval_set or []),
        train_set.num_tokens(),
    )
    arch = DraftArchitecture.from_target(target.config, config.draft, target.aux_layer_ids)
    with world.main_first():  # and the vocab-map cache
        vocab = cached_vocab_map(
            inputs.token_samples,
            arch.vocab_size,
            arch.draft_vocab_size,
            inputs.vocab_cache_dir / f"{arch.vocab_size}-{arch.draft_vocab_size}.safetensors",
        )
    draft = Eagle3Draft(arch, recompute_mlp=config.draft.recompute_mlp)
    draft.init_weights(config.draft.init_std, torch.Generator().manual_seed(config.seed))
    draft.load_embedding(target.input_embedding().detach().cpu())
    draft.set_vocab_map(vocab.d2t_W, vocab.t2d_V)
    if config.model.draft_init:
        init_from(
            draft, Path(config.model.draft_init), target.config.get_text_config().num_hidden_layers
        )
    draft.to(device)
    apply_master_dtype(draft, config.optimizer)  # optimizer.fp32_master: fp32 or bf16 weights
    # the draft's own map: with model.draft_init it is the initial draft's, not this data's
    draft_ids_W = draft.draft_to_target_ids(torch.arange(len(draft.d2t), device=device))
    t2d_V = draft.t2d
    ttt_length = config.draft.ttt_length
    sp = SequenceParallel.from_world(world)
    ttt_attention: AttentionBackend | USPBackend = attention
    if attention == AttentionBackend.usp:
        check_heads(arch.num_attention_heads, arch.num_key_value_heads, sp.ulysses_size)
        ttt_attention = USPBackend(sp, ttt_length)
    module = TTTModule(draft, ttt_length, ttt_attention, config.draft.compile)
    module = shard_draft(module, world, config.parallel)

    def make_batch(batch: dict[str, torch.Tensor]) -> TTTBatch:
        ttt_batch = teacher_batch(
            target, batch, draft_ids_W, t2d_V, config.target.teacher_chunk_size
        )
        return shard_sequence(ttt_batch, sp, ttt_length) if sp.size > 1 else ttt_batch

    trainer_cfg = config.trainer
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    packing = resolve_packing(config, target)
    if packing:
        log.info("packing conversations into rows of %d tokens", config.data.max_tokens_per_batch)

    def loader(
        dataset: Any, shuffle_seed: int | None, start: int = 0
    ) -> torch.utils.data.DataLoader:
        return make_loader(
            dataset,
            packing,
            config.data.max_tokens_per_batch,
            trainer_cfg.batch_size,
            pad_id,
            shuffle_seed,
            shard=world.data_rank,
            num_shards=world.dims.data_shards,
            start=start,
            processor=inputs.processor,
        )

    def train_loader(epoch: int, start: int = 0) -> torch.utils.data.DataLoader:
        return loader(train_set, config.seed * 1_000_003 + epoch, start)

    eval_loader = loader(eval_set, shuffle_seed=None) if eval_set is not None else None
    # rank 0 picks the checkpoint (ranks must agree, also on a lagging network filesystem)
    checkpoint = world.gather_objects(resume_from(trainer_cfg.resume, output_dir))[0]
    steps_per_epoch = math.ceil(len(train_loader(0)) / trainer_cfg.grad_accum_steps)
    # a resumed run keeps its own length (and so its schedule), whatever the ranks now
    max_num_steps = (
        trainer_cfg.max_num_steps
        or (checkpoint and read_progress(checkpoint).get("max_num_steps"))
        or trainer_cfg.num_epochs * steps_per_epoch
    )
    optimizer, scheduler = build_optimizer(config.optimizer, module, max_num_steps)

    container = OmegaConf.to_container(cfg, resolve=True)
    config_yaml = OmegaConf.to_yaml(container)
    run_name = default_run_name(config.model.name, config.data.name, output_dir)
    tracker = build_tracker(
        config.tracker, config.output_root, run_name, is_main=world.is_main, output_dir=output_dir
    )
    tracker.log_config(flatten(container), config_yaml)  # type: ignore[arg-type]
    if inputs.report is not None:
        tracker.log_metrics(inputs.report.metrics("data"), step=0)

    trainer = Trainer(
        module=module,
        make_batch=make_batch,
        train_loader=train_loader,
        eval_loader=eval_loader,
        optimizer=optimizer,
        scheduler=scheduler,
        tracker=tracker,
        cfg=trainer_cfg,
        weights_k=step_weights(config.draft.ttt_length, config.draft.step_weight_decay, device),
        max_grad_norm=config.optimizer.max_grad_norm,
        max_num_steps=max_num_steps,
        world=world,
        output_dir=output_dir,
        config_yaml=config_yaml,
        tau_probe=tau_probe(config, target, Path(model_dir), tokenizer, inputs, world),
    )
    if checkpoint is not None:
        trainer.resume(checkpoint)
    if config.profile.enabled:
        trainer.profiler = StepProfiler(
            config.profile, output_dir / "profile", world.rank, device, trainer.step
        )
    result = trainer.train()
    if trainer.profiler is not None:
        report_profile(trainer.profiler, world, tracker)
    if world.is_main:
        tracker.log_artifact(write_summary(result, output_dir / "summary.json"))
        if result.tau_by_step:  # the learning curve: real τ against the step
            series = {"real τ": sorted(result.tau_by_step.items())}
            tracker.log_artifact(plot_tau_by_step(series, output_dir / "tau_by_step.png"))
        print_summary(result, tracker)
    tracker.close()
    return result


def report_profile(profiler: StepProfiler, world: World, tracker: Tracker) -> None:
    """Rank 0 logs every rank's trace and prints its own top-operators table."""
    world.barrier()  # every rank's trace is written
    if world.is_main and profiler.table:
        for trace in sorted(profiler.trace.parent.glob("trace_rank*.json")):
            tracker.log_artifact(trace)
        print(f"\nTop operators (rank 0, {profiler.sort_key}):\n{profiler.table}", flush=True)


def write_summary(result: TrainResult, path: Path) -> Path:
    """``summary.json``: the run's end (paths as strings, or null). Re-running a finished run
    keeps the summary that recorded its end; one killed before writing it gets one now."""
    if result.already_complete and path.is_file():
        try:
            if json.loads(path.read_text()).get("step") == result.step:
                return path
        except ValueError:
            pass  # unreadable: written anew
    summary = {
        "step": result.step,
        "checkpoint": str(result.checkpoint) if result.checkpoint else None,
        "initial_eval": result.initial_eval,
        "final_eval": result.final_eval,
        "tau_by_step": result.tau_by_step,
        "best_checkpoint": str(result.best_checkpoint) if result.best_checkpoint else None,
    }
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return path


def print_summary(result: TrainResult, tracker: object) -> None:
    if result.already_complete:
        lines = [
            f"\nThe run is already complete (step {result.step}); nothing to do. Set "
            "trainer.max_num_steps higher to train on."
        ]
    else:
        lines = [f"\nTrained {result.step} steps."]
    final, initial = result.final_eval, result.initial_eval
    if final:
        accs = sorted(
            (int(k.rsplit("_", 1)[1]), v) for k, v in final.items() if k.startswith("eval/acc_")
        )
        lines.append("eval accuracy per TTT position (untrained -> trained):")
        for position, value in accs:
            before = initial.get(f"eval/acc_{position}")
            prefix = f"{before:.3f} -> " if before is not None else ""
            lines.append(f"  acc_{position}: {prefix}{value:.3f}")
        before_tau = f"{initial['eval/tau_sim']:.3f} -> " if "eval/tau_sim" in initial else ""
        lines.append(
            f"tau_sim (simulated acceptance length): {before_tau}{final['eval/tau_sim']:.3f}"
        )
    if result.tau_by_step:
        taus = ", ".join(f"step {k}: {v:.3f}" for k, v in result.tau_by_step.items())
        lines.append(f"real tau (speculative decoding): {taus}")
    if result.best_checkpoint is not None:
        lines.append(f"best-tau checkpoint: {result.best_checkpoint}")
    if result.checkpoint is not None:
        lines.append(f"checkpoint (SGLang draft dir): {result.checkpoint}")
    if isinstance(tracker, MLflowTracker):
        lines.append(f"browse the run: mlflow ui --backend-store-uri {tracker.tracking_uri}")
    print("\n".join(lines), flush=True)


# Exit status of a run stopped by a signal after saving: 128 + the signal, as if the signal
# had killed it, so that SLURM and submitit treat it as preempted and requeue it.
def _exit_status(result: TrainResult) -> int:
    return 128 + result.preempted_by if result.preempted_by is not None else 0


@hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    """One run, or one job of a sweep (-m). A failure is recorded in MLflow; a user error
    prints one line. In a sweep the error is raised instead of exiting: Hydra's launchers
    record it as this job's failure, run the remaining jobs and end the multirun with status
    1, where sys.exit would stop the whole sweep here."""
    is_main = is_main_process()  # exports a submitit job's RANK/WORLD_SIZE before typing
    try:
        result = run(cfg)
    except (Exception, KeyboardInterrupt) as e:
        record_failure(e, cfg, is_main=is_main)
        if not isinstance(e, EagleForgeError):
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            raise
        sys.exit(2)
    if result.preempted_by is not None:
        record_stop(result.preempted_by, cfg, is_main=is_main)
        # saved: now the launcher's own handler (submitit's requeues the job), then exit
        StopSignals.hand_on(result.preempted_by)
        sys.exit(_exit_status(result))


def main() -> None:
    register_configs()
    _hydra_main()


if __name__ == "__main__":
    main()
