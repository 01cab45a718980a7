"""The root config schema, its registration in Hydra's ConfigStore, and typed resolution.

Each section's dataclass lives beside the code it configures; this module only assembles
them. ``conf/`` YAML files pick values; typing and invariants are checked when the composed
config is turned into these dataclasses (``to_typed``), before anything is built.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
import typing
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from eagleforge.data.config import DataConfig
from eagleforge.data.features import PrepareConfig
from eagleforge.data.inspection import InspectConfig
from eagleforge.draft.attention import AttentionBackend
from eagleforge.draft.config import DraftConfig
from eagleforge.draft.loss import LossConfig
from eagleforge.engine.config import LlamaCppConfig, VLLMConfig
from eagleforge.errors import ConfigError
from eagleforge.families import check_model_draft_defaults, family_for, not_applying
from eagleforge.files import resolve_cache_dir
from eagleforge.formats.config import ExportConfig
from eagleforge.optim import OptimizerConfig
from eagleforge.parallel import DeviceKind, ParallelConfig
from eagleforge.profiling import ProfileConfig
from eagleforge.regeneration.config import RegenerateConfig
from eagleforge.speculative.config import EvalConfig
from eagleforge.targets.config import ServeTargetConfig, TargetBackendKind, TargetConfig
from eagleforge.targets.source import ModelConfig
from eagleforge.tracking import TrackerConfig
from eagleforge.trainer import TrainerConfig

SCHEMA_NAME = "eagleforge_schema"


@dataclass
class EagleForgeConfig:
    """Root of every run's config."""

    # The frozen target LLM (chosen with +model=NAME; no default).
    model: ModelConfig = MISSING
    # Training conversations.
    data: DataConfig = MISSING
    # How the target runs (backend).
    target: TargetConfig = MISSING
    # Devices and processes.
    parallel: ParallelConfig = MISSING
    # Optimizer, schedule and clipping.
    optimizer: OptimizerConfig = MISSING
    # Metrics destination.
    tracker: TrackerConfig = MISSING
    # The draft's training loss against the teacher (kl by default; docs/losses.md).
    loss: LossConfig = MISSING
    # The draft head and its training-time test.
    draft: DraftConfig = field(default_factory=DraftConfig)
    # Loop, eval and checkpoint cadence.
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # torch.profiler traces of a few training steps.
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    # Options of eagleforge.inspect_data.
    inspect: InspectConfig = field(default_factory=InspectConfig)
    # Options of eagleforge.prepare (capturing a feature store for offline training).
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    # Options of eagleforge.evaluate (speculative decoding with a trained draft).
    eval: EvalConfig = field(default_factory=EvalConfig)
    # Options of eagleforge.export (a draft for SGLang, vLLM or speculators).
    export: ExportConfig = field(default_factory=ExportConfig)
    # Options of eagleforge.regenerate (assistant turns rewritten by the target).
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    # The vLLM engine: judge (eval.engine=vllm), data engine (regenerate.backend=vllm), target.
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    # A capture server for training runs elsewhere (python -m eagleforge.serve_target).
    serve_target: ServeTargetConfig = field(default_factory=ServeTargetConfig)
    # llama.cpp's llama-server: judge of GGUF drafts (eval.engine=llamacpp).
    llamacpp: LlamaCppConfig = field(default_factory=LlamaCppConfig)
    # Seed of weights init, data split and shuffling.
    seed: int = 0
    # Root of run outputs and of the default MLflow store.
    output_root: str = "outputs"
    # This run's directory (Hydra's run dir by default).
    output_dir: str = MISSING
    # Converted models and tokenized data; null = $EAGLEFORGE_CACHE_DIR or ~/.cache/eagleforge.
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        """Checks that span sections (each section checks its own fields)."""
        self._check_draft_family()
        check_model_draft_defaults(self.model.draft_defaults)
        parallel, offline = self.parallel, bool(self.data.features)
        if parallel.tp > 1 and offline:
            raise ConfigError(
                f"parallel.tp={parallel.tp} splits the target, but data.features trains from "
                "stored features without one; set parallel.tp=1 (or train online)."
            )
        if parallel.tp > 1 and self.trainer.eval_tau_every_n_steps:
            raise ConfigError(
                f"trainer.eval_tau_every_n_steps needs the whole target on one rank, not "
                f"parallel.tp={parallel.tp}; set it to 0 and run eagleforge.evaluate on the "
                "saved checkpoints."
            )
        if self.data.is_vlm:
            self._check_vlm()
        if self.data.packing is not None or offline:  # known before the target is (else: builder)
            check_batch_shape(self, packing=self.data.packing is not False)
        # the τ probe decodes with the transformers target (KV cache): the run's own, or one
        # rank 0 loads beside an engine in another process (target=vllm) or a feature store
        beside = (TargetBackendKind.hf, TargetBackendKind.vllm)
        if self.trainer.eval_tau_every_n_steps and self.target.backend not in beside:
            raise ConfigError(
                "trainer.eval_tau_every_n_steps decodes with the transformers target (KV cache), "
                f"not target.backend={self.target.backend.value}; set it to 0 and run "
                "eagleforge.evaluate on the saved checkpoints."
            )
        if self.target.backend == TargetBackendKind.sglang:
            self._check_sglang(offline)
        usp = self.draft.attention == AttentionBackend.usp
        if parallel.sp > 1 and not (usp and offline):
            raise ConfigError(
                f"parallel.sp_ulysses x sp_ring = {parallel.sp} splits sequences, which needs "
                "draft.attention=usp and offline training (data.features); set those, or "
                "parallel.sp_ulysses=1 parallel.sp_ring=1."
            )
        if usp and parallel.sp == 1:
            raise ConfigError(
                "draft.attention=usp needs parallel.sp_ulysses x sp_ring > 1; set them, or "
                "choose another draft.attention."
            )

    def _check_draft_family(self) -> None:
        """Settings the chosen draft family never reads are refused, not recorded as if
        applied: another family's draft fields, and the loss section where the family has its
        own objective."""
        family = family_for(self.draft.family)
        ignored = not_applying(family, self.draft, self.loss)
        if ignored:
            raise ConfigError(
                f"{', '.join(ignored)}: not read by draft={family.name.value} ({family.docs}); "
                f"remove {'it' if len(ignored) == 1 else 'them'}, or choose the draft family "
                f"{'it belongs' if len(ignored) == 1 else 'they belong'} to."
            )

    def _check_sglang(self, offline: bool) -> None:
        """target=sglang: what its code paths cannot do (offline training never loads the
        target, so nothing applies there)."""
        if offline:
            return
        if self.parallel.device == DeviceKind.cpu:
            raise ConfigError(
                "target.backend=sglang runs on CUDA only, but parallel.device=cpu; use "
                "target=hf on CPU, or parallel.device=cuda|auto on a GPU machine."
            )
        if self.data.packing:
            raise ConfigError(
                "data.packing=true packs conversations into one row, which target.backend=sglang "
                "cannot run (it sends each row to SGLang as one sequence); set data.packing=false "
                "or null, or use target=hf."
            )

    def _check_vlm(self) -> None:
        """What a vision-language run (data.is_vlm) does not do yet: the fields to unset."""
        refused = {
            f"parallel.tp={self.parallel.tp}": self.parallel.tp > 1,
            f"target.backend={self.target.backend.value}": (
                self.target.backend != TargetBackendKind.hf
            ),
            # sequence parallelism cuts 1-D positions only
            f"parallel.sp_ulysses x sp_ring = {self.parallel.sp}": self.parallel.sp > 1,
        }
        for name, set_ in refused.items():
            if set_:
                raise ConfigError(
                    f"{name} is not supported with data.is_vlm=true (vision-language targets "
                    "run with the hf backend on whole-target ranks); change it, or see "
                    "docs/vlm.md."
                )

    def resolved_cache_dir(self) -> Path:
        return resolve_cache_dir(self.cache_dir)


def check_batch_shape(config: EagleForgeConfig, packing: bool) -> None:
    """``data.max_tokens_per_batch`` shapes packed rows only: set away from its default in a
    run that pads batches of ``trainer.batch_size`` samples, it is refused rather than
    recorded as if it shaped them."""
    data = config.data
    if packing or data.max_tokens_per_batch == DataConfig.max_tokens_per_batch:
        return
    why = (
        f"data.packing={str(data.packing).lower()}"
        if data.packing is not None
        else "data.packing=null does not pack with this target"
    )
    raise ConfigError(
        f"data.max_tokens_per_batch={data.max_tokens_per_batch} is read only when rows are "
        f"packed, and this run pads batches of trainer.batch_size={config.trainer.batch_size} "
        f"({why}); remove it, or set data.packing=true."
    )


def register_configs() -> None:
    ConfigStore.instance().store(name=SCHEMA_NAME, node=EagleForgeConfig)


def conf_dir() -> Path:
    """The Hydra config tree: inside the installed package, or at the checkout's root."""
    packaged = Path(__file__).parent / "conf"
    return packaged if packaged.is_dir() else Path(__file__).resolve().parents[2] / "conf"


def group_choices(group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def to_typed(cfg: DictConfig) -> EagleForgeConfig:
    """Validate a composed config into dataclasses; raises ConfigError naming the field."""
    if OmegaConf.is_missing(cfg, "model"):
        raise ConfigError(
            "No target model chosen: add +model=NAME to the command, one of: "
            f"{', '.join(group_choices('model'))}."
        )
    try:
        typed = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise ConfigError(f"{key}: {e.msg}" if key else str(e)) from None
    assert isinstance(typed, EagleForgeConfig)
    return typed


def compose_config(overrides: list[str]) -> DictConfig:
    """Compose the config as the CLI would (for tests, notebooks and other entry points)."""
    from hydra import compose, initialize_config_dir

    for override in overrides:
        refusal = draft_family_refusal(override)
        if refusal:
            raise ConfigError(refusal)
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose("config", overrides=overrides)


def draft_family_refusal(override: str) -> str | None:
    """Why an override that sets ``draft.family`` is refused (None for any other): the family
    is the draft group's choice, whose file (conf/draft/<family>.yaml) gives that family's
    section its defaults, a model file's fitted ones among them; set alone, the field would
    give the group's file (another family's) this family's name and train with its values."""
    key, _, value = override.partition("=")
    if key.lstrip("+~") != "draft.family":
        return None
    return (
        f"{override}: choose the draft family with its config group, draft={value or '<family>'} "
        "(its file gives the family's defaults, which draft.family alone does not apply); "
        "remove draft.family."
    )


def check_cli_overrides(args: list[str] | None = None) -> None:
    """Every ``key=value`` of the command line (``sys.argv``) as Hydra will read it; one that
    Hydra's parser refuses -- typically a path with spaces or non-ASCII letters typed as a
    shell user types it -- ends the command in one line showing the quoting that works, where
    Hydra would print its lexer's exception; so does one setting ``draft.family`` (see
    ``draft_family_refusal``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for arg in sys.argv[1:] if args is None else args:
        if arg.startswith("-") or "=" not in arg:
            continue  # Hydra's own flags (-m, --cfg job, ...) and their values
        refusal = draft_family_refusal(arg)
        if refusal:
            print(f"error: {refusal}", file=sys.stderr)
            sys.exit(2)
        try:
            (override,) = parser.parse_overrides([arg])
        except OverrideParseException:
            key, value = arg.split("=", 1)
            quoted = value.replace("\\", "\\\\").replace('"', '\\"')
            hydra_quoted = shlex.quote(f'{key}="{quoted}"')
            print(
                f"error: Hydra cannot read the override {shlex.quote(arg)}: quote the value "
                f"for Hydra, inside quotes for the shell: {hydra_quoted}",
                file=sys.stderr,
            )
            sys.exit(2)
        refusal = enum_refusal(override)
        if refusal:
            print(f"error: {refusal}", file=sys.stderr)
            sys.exit(2)


def enum_refusal(override: Any) -> str | None:
    """The one line refusing a value that the override's setting (one of the choices of an
    Enum, e.g. prepare.compress) does not take -- Hydra would print six lines of its merge --
    or None: another kind of setting, or a value (each value of a sweep) it takes."""
    key = override.key_or_group.lstrip("+~")
    kind: Any = EagleForgeConfig
    for name in key.split("."):
        hints = typing.get_type_hints(kind) if dataclasses.is_dataclass(kind) else {}
        kind = hints.get(name)
        if kind is None:
            return None
        args = [a for a in typing.get_args(kind) if a is not type(None)]  # X | None
        kind = args[0] if len(args) == 1 else kind
    if not (isinstance(kind, type) and issubclass(kind, Enum)) or override.is_delete():
        return None
    taken = [str(member.value) for member in kind]
    values = (
        list(override.sweep_string_iterator())
        if override.is_sweep_override()
        else [override.get_value_element_as_str()]
    )
    wrong = [v for v in values if v not in taken and v not in kind.__members__]
    if not wrong:
        return None
    return f"{key}={wrong[0]}: expected one of {', '.join(taken)}."
