"""The assembly of a training run: the typed config in, the trainer's components out.

``build`` resolves the target model, opens the data (tokenized conversations online, a feature
store offline), builds the draft with its vocabulary map, wraps it for the world's
parallelism, and makes the optimizer, schedule, tracker and real-τ probe -- each from its own
config section, in the order the ranks must agree on. ``train.py`` hands the result to the
``Trainer``; nothing here runs a training step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from omegaconf import DictConfig, OmegaConf

from eagleforge.checkpoint import (
    check_identity,
    checkpoint_problem,
    explicit_checkpoint,
    newest_checkpoint,
    read_progress,
    read_run_record,
    refuse_writing_over_newer,
    resume_changes,
    run_record,
)
from eagleforge.config import EagleForgeConfig, check_batch_shape
from eagleforge.data.features import (
    FeatureDataset,
    check_store_data,
    expected_manifest,
    open_store,
    weight_hash,
)
from eagleforge.data.loader import plan_batches
from eagleforge.data.preprocess import DataReport, TokenizedDataset, source_key
from eagleforge.data.split import build_datasets
from eagleforge.data.stream import FeatureStream
from eagleforge.data.vocab import VocabMap, cached_vocab_map
from eagleforge.draft.family import AnyBatch, AnyDraft, TrainingModule
from eagleforge.errors import CheckpointRefused, ConfigError, ResumeSettingRefused
from eagleforge.families import DraftInputs, family_for
from eagleforge.fingerprint import SAMPLED_TEXT, is_sampled_fingerprint
from eagleforge.optim import apply_master_dtype, build_optimizer
from eagleforge.parallel.dist import World
from eagleforge.parallel.fsdp import shard_draft
from eagleforge.parallel.tp import tp_axis
from eagleforge.parallel.usp import SequenceParallel
from eagleforge.precision import announce
from eagleforge.speculative.probe import TauProbe
from eagleforge.speculative.prompts import PromptRenderer
from eagleforge.targets.base import TargetBackend, release
from eagleforge.targets.config import TargetBackendKind
from eagleforge.targets.head import HeadOnlyTarget
from eagleforge.targets.registry import build_hf_target, build_target
from eagleforge.targets.source import (
    VisionProcessor,
    load_processor,
    load_tokenizer,
    resolve_model_dir,
)
from eagleforge.tracking import build_tracker, default_run_name, flatten
from eagleforge.trainer import Components, Loader

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
    target: TargetBackend  # a backend online (build_target), HeadOnlyTarget offline
    token_samples: Iterable[tuple[list[int], list[int]]]  # for the draft vocab map
    vocab_cache_dir: Path
    report: DataReport | None  # preprocessing counts (online)
    # what identifies the training rows (the tokenized data's cache key and split), the same
    # online and from a feature store of the same data (its manifest's data_key)
    data_key: str
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
        config.model, config.target, model_dir, world.device, tp_mesh=tp_axis(world.mesh),
        engine=config.vllm, engine_log=Path(config.output_dir) / "vllm.log",
    )  # fmt: skip
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
    return Inputs(
        data.train, data.eval, target, data.train, vocab_dir, data.report, f"{data.cache_key}/train",
        processor,
    )  # fmt: skip


def offline_inputs(
    config: EagleForgeConfig, model_dir: Path, tokenizer: Any, device: torch.device, cache_dir: Path
) -> Inputs:
    """A feature store from eagleforge.prepare, checked against this run -- its data first,
    before anything is loaded; the target's embedding and lm_head only."""
    store = Path(config.data.features or "")
    processor = (
        load_processor(config.model, model_dir, config.data.min_pixels, config.data.max_pixels)
        if config.data.is_vlm
        else None
    )
    data = config.data
    check_store_data(
        store,
        source_key(data, tokenizer, processor),
        data.describe(),
        {"template": data.template, "max_length": data.max_length},
    )
    dtype = config.model.dtype.torch_dtype(device)
    target = HeadOnlyTarget(model_dir, dtype, device, config.model.aux_layer_ids)
    expected = expected_manifest(
        config.model.name,
        model_dir,
        target.config.get_text_config(),
        target.aux_layer_ids,
        config.data.template,
        config.data.max_length,
        config.data.is_vlm,
        cache_dir,
        config.model.revision,
    )
    train_set, eval_set = open_store(store, expected, config.data.verify_features)
    # the target's lm_head (the teacher) takes the stored states in the capture's dtype
    captured, computes = train_set.manifest.dtype, str(dtype).removeprefix("torch.")
    if captured != computes:
        raise ConfigError(
            f"data.features={store} holds {captured} states (captured with model.dtype="
            f"{captured}) and this run's model.dtype={config.model.dtype.value} computes in "
            f"{computes}: set model.dtype={captured} to train from it, or capture the store "
            "again in this dtype."
        )
    key = hashlib.sha256(
        f"{store.resolve()}|{train_set.manifest.data_key}|{train_set.manifest.weight_hash}".encode()
    ).hexdigest()[:16]
    vocab_dir = Path(cache_dir) / "vocab" / f"features-{key}"
    return Inputs(
        train_set, eval_set, target, train_set.token_samples(), vocab_dir, None,
        train_set.manifest.data_key,
    )  # fmt: skip


def tau_probe(
    config: EagleForgeConfig,
    target: Any,
    model_dir: Path,
    tokenizer: Any,
    inputs: Inputs,
    world: World,
) -> TauProbe | None:
    """The real-τ probe (trainer.eval_tau_every_n_steps), on rank 0 only. Offline training
    and target=vllm (the engine in its own process) have no decoding target: rank 0 loads
    one for the probe, reading the same layers."""
    if not config.trainer.eval_tau_every_n_steps or not world.is_main:
        return None
    if config.data.features or config.target.backend == TargetBackendKind.vllm:
        target = build_hf_target(
            config.model, config.target, model_dir, world.device, target.aux_layer_ids
        )
    renderer = PromptRenderer(
        tokenizer, inputs.processor, config.data.min_pixels, config.data.max_pixels
    )
    decoder = family_for(config.draft.family).decoder
    return TauProbe(
        config.eval, config.trainer.eval_tau_prompts, target, renderer, config.seed, decoder
    )


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


def resume_from(resume: str, output_dir: Path) -> Path | None:
    """The checkpoint that trainer.resume asks for (auto: the run's newest intact one, if any),
    its checksums verified."""
    if resume == "never":
        refuse_writing_over_newer(output_dir)
        return None
    if resume == "auto":
        return newest_checkpoint(output_dir)
    path = explicit_checkpoint(resume)
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ResumeSettingRefused(
            f"trainer.resume={resume}: {problem}, so the checkpoint is damaged; give an earlier "
            "checkpoints/step_* directory, or auto to resume from the newest intact one."
        )
    read_run_record(path)  # a newer checkpoint format is refused
    return path


def saved_config(checkpoint: Path) -> dict[str, Any]:
    """The flattened config a checkpoint was saved with (its config.yaml)."""
    try:
        saved = yaml.safe_load((checkpoint / "config.yaml").read_text())
    except (OSError, yaml.YAMLError) as e:
        raise CheckpointRefused(
            f"{checkpoint / 'config.yaml'}: unreadable ({type(e).__name__}); delete the "
            "checkpoint to resume from the one before, or start a new run in another directory "
            "(another hydra.run.dir)."
        ) from None
    return flatten(saved) if isinstance(saved, dict) else {}


@dataclass
class Resume:
    """What a resumed run continues from, and what it changes (``resume_changes``)."""

    checkpoint: Path
    step: int
    saved: dict[str, Any]  # the checkpoint's flattened config
    changes: dict[str, tuple[Any, Any]]  # resumable fields that differ: {key: (saved, now)}

    @classmethod
    def check(cls, checkpoint: Path, params: dict[str, Any]) -> Resume:
        """ConfigError, before anything heavy is loaded, where the config differs from the
        checkpoint's in a field that defines the run."""
        saved = saved_config(checkpoint)
        changes = resume_changes(saved, params, checkpoint)
        return cls(checkpoint, read_progress(checkpoint)["step"], saved, changes)

    def keeps_length(self) -> bool:
        """The run's length is the saved one (``trainer.max_num_steps`` or ``num_epochs`` is
        not changed): a run resumed on another number of ranks keeps its schedule."""
        return not {"trainer.max_num_steps", "trainer.num_epochs"} & self.changes.keys()

    def record(
        self, identity: dict[str, str], precision: dict[str, dict[str, str]]
    ) -> dict[str, Any]:
        """The run.json of the checkpoints it saves: the changes made so far, this one's too."""
        history = list(read_run_record(self.checkpoint).get("changes") or [])
        if self.changes:
            changed = {key: [old, new] for key, (old, new) in self.changes.items()}
            history.append({"step": self.step, "changes": changed})
        return run_record(identity, history, precision)

    def params(self, params: dict[str, Any], continued: bool) -> dict[str, Any]:
        """The params to log: into the MLflow run it continues (``continued``) only what that
        run lacks -- fields new to this version, and each change under
        ``resumed_at_step_<s>.<field>`` (MLflow never changes a logged param) -- else all."""
        changed = {f"resumed_at_step_{self.step}.{k}": new for k, (_, new) in self.changes.items()}
        if not continued:
            return {**params, **changed}
        return {**{k: v for k, v in params.items() if k not in self.saved}, **changed}

    def describe(self) -> str:
        return ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in self.changes.items())


class TrainBatches:
    """The trainer's batch source: seeded loaders over this rank's shard of the data, and the
    teacher that turns each collated batch into the TTT's batch (this rank's sequence chunk
    under sequence parallelism)."""

    def __init__(
        self,
        config: EagleForgeConfig,
        inputs: Inputs,
        draft: AnyDraft,
        pad_id: int,
        packing: bool,
        world: World,
        sp: SequenceParallel,
    ) -> None:
        self.data, self.trainer = config.data, config.trainer
        self.seed = config.seed
        self.inputs, self.pad_id, self.packing = inputs, pad_id, packing
        self.world = world
        self.queue_batches = config.target.producers.queue_batches
        self.make = family_for(config.draft.family).batches(
            draft, config.draft, inputs.target, sp, config.seed, config.target.teacher_chunk_size
        )

    def close(self) -> None:
        """Stop what the target runs outside this process (target=vllm: its engine)."""
        release(self.inputs.target)

    def _loader(
        self, dataset: Any, shuffle_seed: int | None, start: int = 0, limit: int | None = None
    ) -> Loader:
        """The batches of ``dataset`` after ``start`` (at most ``limit``): read (a store, or
        the target run in each step), or, where the target's producers stream its states
        (target=vllm), from them."""
        plan = plan_batches(
            dataset,
            self.packing,
            self.data.max_tokens_per_batch,
            self.trainer.batch_size,
            self.pad_id,
            shuffle_seed,
            shard=self.world.data_rank,
            num_shards=self.world.dims.data_shards,
            start=start,
            processor=self.inputs.processor,
            limit=limit,
        )
        submit = getattr(self.inputs.target, "submit", None)
        if submit is None:
            return plan.loader()
        return FeatureStream(plan, submit, self.queue_batches)

    def producer_records(self) -> list[dict[str, Any]] | None:
        """What each producer of a streamed run did (``ProducerRecord``); None otherwise."""
        records = getattr(self.inputs.target, "producer_records", None)
        return records() if records is not None else None

    def train_loader(self, epoch: int, start: int = 0, limit: int | None = None) -> Loader:
        return self._loader(self.inputs.train, self.seed * 1_000_003 + epoch, start, limit)

    def eval_loader(self) -> Loader | None:
        if self.inputs.eval is None:
            return None
        return self._loader(self.inputs.eval, shuffle_seed=None)

    def make_batch(self, batch: dict[str, torch.Tensor], train: bool = True) -> AnyBatch:
        """The training module's batch of a collated batch (the target run on it online)."""
        return self.make(batch, train)


def build_draft(
    config: EagleForgeConfig, inputs: Inputs, world: World, tokenizer: Any = None
) -> AnyDraft:
    """The chosen family's draft for this target, initialised (from ``model.draft_init`` when
    given), on the device, in the optimizer's master dtype."""

    def vocab_map(vocab_size: int, draft_vocab_size: int) -> VocabMap:
        with world.main_first():  # rank 0 fills the vocab-map cache
            return cached_vocab_map(
                inputs.token_samples,
                vocab_size,
                draft_vocab_size,
                inputs.vocab_cache_dir / f"{vocab_size}-{draft_vocab_size}.safetensors",
            )

    draft_inputs = DraftInputs(
        target=inputs.target,
        target_name=config.target.backend.value,
        tokenizer=tokenizer,
        vocab_map=vocab_map,
        mask_token_id=config.model.mask_token_id,
        max_length=config.data.max_length,
        seed=config.seed,
        device=world.device,
        draft_init=Path(config.model.draft_init) if config.model.draft_init else None,
    )
    draft = family_for(config.draft.family).build(config.draft, draft_inputs)
    apply_master_dtype(draft, config.optimizer)  # optimizer.fp32_master: fp32 or bf16 weights
    return draft


def training_module(
    config: EagleForgeConfig, draft: AnyDraft, world: World, sp: SequenceParallel
) -> TrainingModule:
    """The draft with its family's training pass, sharded over every rank."""
    family = family_for(config.draft.family)
    module = family.training_module(draft, config.draft, config.loss, world.device, sp)
    return shard_draft(module, world, config.parallel)


def build(cfg: DictConfig, config: EagleForgeConfig, world: World) -> Components:
    """Every component of a training run, on every rank, from the composed (``cfg``) and
    typed (``config``) config."""
    seed_everything(config.seed)
    cache_dir = config.resolved_cache_dir()
    # Each rank resolved Hydra's timestamped run dir itself: rank 0's is the run's.
    output_dir = Path(world.gather_objects(config.output_dir)[0])
    output_dir.mkdir(parents=True, exist_ok=True)
    trainer_cfg = config.trainer
    # rank 0 picks the checkpoint (ranks must agree, also on a lagging network filesystem)
    checkpoint = world.gather_objects(resume_from(trainer_cfg.resume, output_dir))[0]
    container = OmegaConf.to_container(cfg, resolve=True)
    config_yaml = OmegaConf.to_yaml(container)
    params = flatten(yaml.safe_load(config_yaml))  # as the checkpoint's config.yaml reads back
    resume = Resume.check(checkpoint, params) if checkpoint is not None else None
    # what each dtype setting computes in on this machine, and why, said in one line
    # (precision.py); recorded in run.json and MLflow
    dtypes = (
        config.model.dtype.choice(world.device, say=False),
        config.trainer.compute_dtype.choice(world.device, say=False),
    )
    announce(*dtypes, device=world.device)
    precision = {c.setting: c.record() for c in dtypes}

    # rank 0 fills the caches (converted model, the digests of the target's weight files)
    with world.main_first():
        model_dir = resolve_model_dir(config.model, cache_dir)
        target_weights = weight_hash(model_dir, cache_dir, config.model.revision)
    tokenizer = load_tokenizer(config.model, model_dir)
    if config.data.features:
        inputs = offline_inputs(config, Path(model_dir), tokenizer, world.device, cache_dir)
    else:
        inputs = online_inputs(config, model_dir, tokenizer, world, cache_dir)
    log.info(
        "data: %d train / %d eval conversations, %d train tokens",
        len(inputs.train),
        len(inputs.eval or []),
        inputs.train.num_tokens(),
    )
    identity = {"target_weights": target_weights, "data": inputs.data_key}
    if resume is not None:
        saved = read_run_record(resume.checkpoint).get("identity")
        if isinstance(saved, dict) and is_sampled_fingerprint(saved.get("target_weights")):
            raise ResumeSettingRefused(
                f"{resume.checkpoint / 'run.json'} records the target's weights "
                f"(identity.target_weights) {SAMPLED_TEXT}; start a new run from it with "
                f"model.draft_init={resume.checkpoint} (another hydra.run.dir, or "
                "trainer.resume=never)."
            )
        check_identity(resume.checkpoint, identity)
    draft = build_draft(config, inputs, world, tokenizer)
    sp = SequenceParallel.from_world(world)
    module = training_module(config, draft, world, sp)
    packing = resolve_packing(config, inputs.target)
    check_batch_shape(config, packing)
    if packing:
        log.info("packing conversations into rows of %d tokens", config.data.max_tokens_per_batch)
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    batches = TrainBatches(config, inputs, draft, pad_id, packing, world, sp)

    steps_per_epoch = math.ceil(len(batches.train_loader(0)) / trainer_cfg.grad_accum_steps)
    # a resumed run keeps its own length (and so its schedule), whatever the ranks now, unless
    # the length is what changes
    max_num_steps = (
        trainer_cfg.max_num_steps
        or (
            resume
            and resume.keeps_length()
            and read_progress(resume.checkpoint).get("max_num_steps")
        )
        or trainer_cfg.num_epochs * steps_per_epoch
    )
    optimizer, scheduler = build_optimizer(config.optimizer, module, max_num_steps)
    if resume is not None and resume.changes:
        log.warning(
            "resuming %s with changed settings, in effect from step %d: %s",
            resume.checkpoint, resume.step + 1, resume.describe(),
        )  # fmt: skip

    run_name = default_run_name(config.model.name, config.data.name, output_dir)
    tracker = build_tracker(
        config.tracker,
        config.output_root,
        run_name,
        is_main=world.is_main,
        output_dir=output_dir,
        resume=checkpoint is not None,  # the MLflow run of the run that saved it goes on
    )
    chosen = {f"precision.{k}": v["dtype"] for k, v in precision.items()}
    if resume is not None and tracker.continued:  # MLflow never changes a logged param
        chosen = {f"resumed_at_step_{resume.step}.{k}": v for k, v in chosen.items()}
    tracker.log_config(
        {**(resume.params(params, tracker.continued) if resume is not None else params), **chosen},
        config_yaml,
    )
    if inputs.report is not None:
        tracker.log_metrics(inputs.report.metrics("data"), step=0)

    return Components(
        module=module,
        batches=batches,
        optimizer=optimizer,
        scheduler=scheduler,
        tracker=tracker,
        weights_k=family_for(config.draft.family).loss_weights(config.draft, world.device),
        max_grad_norm=config.optimizer.max_grad_norm,
        max_num_steps=max_num_steps,
        world=world,
        output_dir=output_dir,
        config_yaml=config_yaml,
        tau_probe=tau_probe(config, inputs.target, Path(model_dir), tokenizer, inputs, world),
        checkpoint=checkpoint,
        run_record=(
            resume.record(identity, precision)
            if resume is not None
            else run_record(identity, [], precision)
        ),
        profile=config.profile if config.profile.enabled else None,
    )
