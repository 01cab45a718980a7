"""The `optimizer` config section: AdamW, 8-bit AdamW, APOLLO or Muon (with AdamW, ``muon.py``),
with linear warmup + cosine decay and gradient clipping shared by all four; and the dtype the
trainable draft weights are kept in (``fp32_master``). See docs/optimizers.md.

Only trainable draft parameters are optimised (the embedding copied from the target is frozen).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from eagleforge.errors import ConfigError
from eagleforge.muon import MuonConfig, make_muon

OPTIM_EXTRA = "pip install 'eagleforge[optim]'"


class OptimizerKind(str, Enum):
    adamw = "adamw"  # torch.optim.AdamW
    adamw_8bit = "adamw_8bit"  # bitsandbytes AdamW8bit: 8-bit block-quantised Adam moments
    apollo = "apollo"  # apollo-torch APOLLOAdamW: Adam moments in a random low-rank space
    muon = "muon"  # torch.optim.Muon for the matrices, torch.optim.AdamW for the rest


class Schedule(str, Enum):
    """The lr's decay after warmup, from lr to lr x min_lr_ratio at the run's last step."""

    cosine = "cosine"  # half a cosine (SpecForge, EAGLE-3)
    linear = "linear"  # a straight line (vLLM speculators)


class ApolloScaleType(str, Enum):
    channel = "channel"  # one gradient scale per row or column (APOLLO)
    tensor = "tensor"  # one gradient scale per matrix (APOLLO-Mini)


class ApolloProjection(str, Enum):
    random = "random"  # seeded Gaussian projection, no SVD (the APOLLO method)
    svd = "svd"  # GaLore's SVD of the gradient


class ApolloProjectionSide(str, Enum):
    std = "std"  # project the longer side of each matrix away
    reverse_std = "reverse_std"  # project the shorter side away
    left = "left"  # always multiply from the left
    right = "right"  # always multiply from the right


@dataclass
class ApolloConfig:
    """`optimizer.apollo`: APOLLO's options, used only with ``kind: apollo``. They apply to the
    trainable matrices; norms and other 1-d weights get plain AdamW updates. Defaults are
    APOLLO-Mini's (rank 1, tensor-wise scaling, scale 128) from the apollo-torch README."""

    # Rank of the auxiliary space the gradient scaling is estimated in (1 = APOLLO-Mini; the
    # paper uses about a quarter of the hidden size for APOLLO).
    rank: int = 1
    # channel (APOLLO) or tensor (APOLLO-Mini) gradient scaling.
    scale_type: ApolloScaleType = ApolloScaleType.tensor
    # How the low-rank projection is drawn: random (APOLLO) or svd (GaLore).
    proj: ApolloProjection = ApolloProjection.random
    # Which side of each matrix is projected.
    proj_type: ApolloProjectionSide = ApolloProjectionSide.std
    # Optimizer steps between fresh projections.
    update_proj_gap: int = 200
    # Update multiplier (applied as sqrt(scale)) that makes up for the low rank: 1 for
    # APOLLO at rank ~dim/4, 128 for APOLLO-Mini.
    scale: float = 128.0
    # Apply sqrt(scale) before the norm-growth limiter instead of after it (for short warmups).
    scale_front: bool = False
    # Turn off Fira's norm-growth limiter (which caps each update's norm at 1.01x the last).
    disable_nl: bool = False

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ConfigError(f"optimizer.apollo.rank must be >= 1, got {self.rank}.")
        if self.update_proj_gap < 1:
            raise ConfigError(
                f"optimizer.apollo.update_proj_gap must be >= 1 step, got {self.update_proj_gap}."
            )
        if self.scale <= 0:
            raise ConfigError(f"optimizer.apollo.scale must be > 0, got {self.scale}.")


@dataclass
class OptimizerConfig:
    """The `optimizer` config section."""

    # Optimizer algorithm: adamw, adamw_8bit (bitsandbytes), apollo (apollo-torch) or muon.
    kind: OptimizerKind = OptimizerKind.adamw
    # Peak learning rate (reached at the end of warmup); with muon, the AdamW group's.
    lr: float = 1e-4
    # Adam betas.
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    # Adam epsilon.
    eps: float = 1e-8
    # Decoupled weight decay (per step, times lr); with muon, the AdamW group's.
    weight_decay: float = 0.0
    # Fraction of the optimizer steps spent in linear warmup from 0.
    warmup_ratio: float = 0.015
    # The decay after warmup: cosine | linear.
    schedule: Schedule = Schedule.cosine
    # Final learning rate as a fraction of lr at the end of the decay.
    min_lr_ratio: float = 0.0
    # Clip the global gradient norm to this value (0 = no clipping).
    max_grad_norm: float = 0.5
    # Keep the trainable draft weights in fp32, so the optimizer updates fp32 master weights
    # while CUDA compute runs in bf16; false = store them in bf16 (half the weight, gradient
    # and AdamW-state memory, but small updates can round away).
    fp32_master: bool = True
    # APOLLO's options (kind: apollo only).
    apollo: ApolloConfig = field(default_factory=ApolloConfig)
    # Muon's options (kind: muon only).
    muon: MuonConfig = field(default_factory=MuonConfig)

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"optimizer.lr must be > 0, got {self.lr}.")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optimizer.betas must be two values in [0, 1), got {self.betas}.")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ConfigError(f"optimizer.warmup_ratio must be in [0, 1), got {self.warmup_ratio}.")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"optimizer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}.")
        if self.max_grad_norm < 0:
            raise ConfigError(f"optimizer.max_grad_norm must be >= 0, got {self.max_grad_norm}.")


def warmup_cosine(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """LR multiplier at optimizer step ``step`` (0-based): linear warmup, then a cosine decay."""
    return lr_multiplier(step, total_steps, warmup_steps, min_ratio, Schedule.cosine)


def lr_multiplier(
    step: int, total_steps: int, warmup_steps: int, min_ratio: float, schedule: Schedule
) -> float:
    """LR multiplier at optimizer step ``step`` (0-based): linear warmup, then ``schedule``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, progress))
    left = (
        0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == Schedule.cosine else 1 - progress
    )
    return min_ratio + (1.0 - min_ratio) * left


def master_dtype(cfg: OptimizerConfig) -> torch.dtype:
    """The dtype trainable draft weights are stored (and updated) in."""
    return torch.float32 if cfg.fp32_master else torch.bfloat16


def apply_master_dtype(model: torch.nn.Module, cfg: OptimizerConfig) -> None:
    """Store the trainable parameters in ``master_dtype(cfg)``, in place (the Parameter objects
    stay the same); call before sharding and before building the optimizer.

    Frozen parameters (the embedding) and buffers are left as they are: they get no updates, and
    the draft casts what it reads from them to the compute dtype.
    """
    dtype = master_dtype(cfg)
    for param in model.parameters():
        if param.requires_grad and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def _import_8bit_adamw() -> Any:
    try:
        import bitsandbytes as bnb  # type: ignore[import-not-found]
    except ImportError as e:
        raise ConfigError(
            f"optimizer.kind=adamw_8bit needs bitsandbytes, which is not installed ({e}); "
            f"{OPTIM_EXTRA}, or use optimizer=adamw."
        ) from e
    return bnb.optim.AdamW8bit


def _import_apollo() -> Any:
    try:
        from apollo_torch import APOLLOAdamW  # type: ignore[import-not-found]
    except ImportError as e:
        raise ConfigError(
            f"optimizer.kind=apollo needs apollo-torch, which is not installed ({e}); "
            f"{OPTIM_EXTRA}, or use optimizer=adamw."
        ) from e
    return APOLLOAdamW


def _apollo_groups(cfg: ApolloConfig, params: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
    """APOLLO's two parameter groups: the matrices get the low-rank options, the rest (norms)
    plain Adam updates (its projector only handles 2-d tensors)."""
    matrices = [p for p in params if p.ndim == 2]
    others = [p for p in params if p.ndim != 2]
    low_rank = {
        "params": matrices,
        "rank": cfg.rank,
        "proj": cfg.proj.value,
        "scale_type": cfg.scale_type.value,
        "scale": cfg.scale,
        "update_proj_gap": cfg.update_proj_gap,
        "proj_type": cfg.proj_type.value,
    }
    return [group for group in ({"params": others}, low_rank) if group["params"]]


def make_optimizer(
    cfg: OptimizerConfig, named_params: list[tuple[str, torch.nn.Parameter]]
) -> torch.optim.Optimizer:
    """The optimizer ``cfg.kind`` names, over ``named_params`` (the trainable ones)."""
    params = [p for _, p in named_params]
    betas = (cfg.betas[0], cfg.betas[1])
    common: dict[str, Any] = {
        "lr": cfg.lr,
        "betas": betas,
        "eps": cfg.eps,
        "weight_decay": cfg.weight_decay,
    }
    if cfg.kind == OptimizerKind.adamw:
        return torch.optim.AdamW(
            params, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    if cfg.kind == OptimizerKind.muon:
        return make_muon(cfg.muon, named_params, cfg.lr, common)
    sharded = [p for p in params if isinstance(p, DTensor)]
    if sharded:
        # Neither library handles DTensors: their updates mix the sharded parameter with plain
        # tensors and stop at the first step ("got mixed torch.Tensor and DTensor", seen with
        # bitsandbytes 0.50.2 and apollo-torch 1.0.3 on two gloo ranks).
        raise ConfigError(
            f"optimizer.kind={cfg.kind.value} is not supported with the draft sharded over "
            f"several ranks (FSDP2); use optimizer=adamw, or train on one process."
        )
    if cfg.kind == OptimizerKind.adamw_8bit:
        optimizer: torch.optim.Optimizer = _import_8bit_adamw()(params, **common)
        return optimizer
    apollo = _import_apollo()
    optimizer = apollo(
        _apollo_groups(cfg.apollo, params),
        **common,
        scale_front=cfg.apollo.scale_front,
        disable_nl=cfg.apollo.disable_nl,
    )
    _seed_projectors_lazily(optimizer)
    optimizer.register_state_dict_post_hook(_projectors_to_tensors)
    optimizer.register_load_state_dict_post_hook(_projectors_from_tensors)
    return optimizer


def _seed_projectors_lazily(optimizer: torch.optim.Optimizer) -> None:
    """APOLLO's constructor stores each parameter's projection seed in the optimizer state; a
    non-empty state before the first step stops torch.distributed.checkpoint from setting the
    state up to load into (resume fails). Keep the seeds aside and hand them to the projector
    when APOLLO first builds it."""
    seeds = {id(p): state.pop("seed") for p, state in optimizer.state.items() if "seed" in state}
    optimizer.state.clear()
    build_projector = optimizer._initialize_projector  # type: ignore[attr-defined]

    def initialize_projector(group: dict[str, Any], param_state: dict[str, Any]) -> Any:
        if "seed" not in param_state:
            param = next(p for p, s in optimizer.state.items() if s is param_state)
            param_state = {**param_state, "seed": seeds[id(param)]}
        return build_projector(group, param_state)

    optimizer._initialize_projector = initialize_projector  # type: ignore[attr-defined]


# APOLLO keeps each matrix's projector (a Python object) in its optimizer state, which neither
# torch.distributed.checkpoint's state dicts nor torch.load(weights_only=True) accept: state
# dicts hold its current matrix (a tensor) and seed (an int) instead, and loading rebuilds it, so a
# resumed run projects exactly as the uninterrupted one.
_MATRIX, _SEED = "projector_matrix", "projector_seed"


def _projectors_to_tensors(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    states = state_dict["state"]
    for key, param_state in list(states.items()):
        projector = param_state.get("projector")
        if projector is None or projector.ortho_matrix is None:
            continue
        # a new dict: state_dict() shares the per-parameter dicts with the live optimizer
        saved = {k: v for k, v in param_state.items() if k != "projector"}
        saved[_MATRIX] = projector.ortho_matrix
        if hasattr(projector, "seed"):
            # an int, not a tensor: load_state_dict casts float-param state tensors to float
            saved[_SEED] = int(projector.seed)
        states[key] = saved


def _projectors_from_tensors(optimizer: torch.optim.Optimizer) -> None:
    # runs after load_state_dict has moved the saved tensors to each parameter's device
    for group in optimizer.param_groups:
        for param in group["params"]:
            param_state = optimizer.state.get(param, {})
            if _MATRIX not in param_state:
                continue
            build_projector = optimizer._initialize_projector  # type: ignore[attr-defined]
            projector = build_projector(group, param_state)
            projector.ortho_matrix = param_state.pop(_MATRIX)
            seed = param_state.pop(_SEED, None)
            if seed is not None:
                projector.seed = int(seed)
            param_state["projector"] = projector


def build_optimizer(
    cfg: OptimizerConfig, model: torch.nn.Module, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The optimizer over the trainable parameters and its warmup + decay schedule (the same
    for every kind; gradient clipping at ``cfg.max_grad_norm`` is the trainer's)."""
    named_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = make_optimizer(cfg, named_params)
    warmup_steps = int(cfg.warmup_ratio * total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_multiplier(step, total_steps, warmup_steps, cfg.min_lr_ratio, cfg.schedule),
    )
    return optimizer, scheduler


def continue_schedule(scheduler: torch.optim.lr_scheduler.LRScheduler, peak_lrs: list[Any]) -> None:
    """After a resume loaded the saved optimizer and scheduler: the schedule is this run's.
    The saved state keeps the step count (``last_epoch``); the peak lrs (``peak_lrs``, the
    new run's ``base_lrs``) and the schedule's shape (its lambdas, made from this run's config
    and length) are this run's, and each group's lr is set to the schedule's value at that
    step -- the lr the next optimizer step uses. Without this the first step after a resume
    would use the saved lr (0 at the end of a finished cosine)."""
    assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR)  # build_optimizer's
    step = scheduler.last_epoch
    scheduler.base_lrs = list(peak_lrs)
    groups = scheduler.optimizer.param_groups
    for group, peak, factor in zip(groups, peak_lrs, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = peak
        group["lr"] = peak * factor(step)
    scheduler._last_lr = [group["lr"] for group in groups]  # what get_last_lr() reports
