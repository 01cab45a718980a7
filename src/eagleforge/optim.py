"""The `optimizer` config section: AdamW, linear warmup + cosine decay, gradient clipping.

Only trainable draft parameters are optimised (the embedding copied from the target is frozen).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

import torch

from eagleforge.errors import ConfigError


class OptimizerKind(str, Enum):
    adamw = "adamw"


@dataclass
class OptimizerConfig:
    """The `optimizer` config section."""

    # Optimizer algorithm.
    kind: OptimizerKind = OptimizerKind.adamw
    # Peak learning rate (reached at the end of warmup).
    lr: float = 1e-4
    # Adam betas.
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    # Adam epsilon.
    eps: float = 1e-8
    # Decoupled weight decay.
    weight_decay: float = 0.0
    # Fraction of the optimizer steps spent in linear warmup from 0.
    warmup_ratio: float = 0.015
    # Final learning rate as a fraction of lr at the end of the cosine decay.
    min_lr_ratio: float = 0.0
    # Clip the global gradient norm to this value (0 = no clipping).
    max_grad_norm: float = 0.5

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"optimizer.lr must be > 0, got {self.lr}.")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ConfigError(f"optimizer.warmup_ratio must be in [0, 1), got {self.warmup_ratio}.")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"optimizer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}.")
        if self.max_grad_norm < 0:
            raise ConfigError(f"optimizer.max_grad_norm must be >= 0, got {self.max_grad_norm}.")


def warmup_cosine(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """LR multiplier at optimizer step ``step`` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, progress))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    cfg: OptimizerConfig, model: torch.nn.Module, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=(cfg.betas[0], cfg.betas[1]),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
    )
    warmup_steps = int(cfg.warmup_ratio * total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, total_steps, warmup_steps, cfg.min_lr_ratio)
    )
    return optimizer, scheduler
