"""The learning-rate schedule (linear warmup, then cosine to min_lr_ratio) and the optimizer
config's validation."""

from __future__ import annotations

import math

import pytest
import torch

from eagleforge.errors import ConfigError
from eagleforge.optim import OptimizerConfig, build_optimizer, warmup_cosine

pytestmark = pytest.mark.unit


def test_linear_warmup_reaches_one() -> None:
    """With 10 warmup steps the multiplier is (step+1)/10: 0.1, 0.2, ..., 1.0 at step 9."""
    got = [warmup_cosine(step, 100, 10, 0.1) for step in range(10)]
    assert got == pytest.approx([(s + 1) / 10 for s in range(10)])


def test_cosine_decay_to_min_ratio() -> None:
    """After warmup: 1.0 at its start, (1+min)/2 half-way, min_ratio at total_steps and beyond."""
    total, warmup, floor = 100, 10, 0.1
    assert warmup_cosine(10, total, warmup, floor) == pytest.approx(1.0)
    assert warmup_cosine(55, total, warmup, floor) == pytest.approx(0.55)
    progress = (32 - warmup) / (total - warmup)
    expected = floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    assert warmup_cosine(32, total, warmup, floor) == pytest.approx(expected)
    assert warmup_cosine(100, total, warmup, floor) == pytest.approx(floor)
    assert warmup_cosine(150, total, warmup, floor) == pytest.approx(floor)
    decay = [warmup_cosine(s, total, warmup, floor) for s in range(warmup, total + 1)]
    assert all(a >= b for a, b in zip(decay[:-1], decay[1:], strict=True))
    assert decay[-2] > floor


def test_no_warmup_and_zero_floor() -> None:
    """warmup_steps=0 starts at 1.0; min_ratio=0 decays to 0."""
    assert warmup_cosine(0, 20, 0, 0.0) == pytest.approx(1.0)
    assert warmup_cosine(10, 20, 0, 0.0) == pytest.approx(0.5)
    assert warmup_cosine(20, 20, 0, 0.0) == pytest.approx(0.0, abs=1e-12)


def test_build_optimizer_follows_schedule_and_skips_frozen() -> None:
    """build_optimizer optimises only trainable params; lr at step s is lr * warmup_cosine(s)."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    model[0].weight.requires_grad_(False)
    cfg = OptimizerConfig(lr=1e-2, warmup_ratio=0.2, min_lr_ratio=0.1)
    optimizer, scheduler = build_optimizer(cfg, model, total_steps=10)
    params = optimizer.param_groups[0]["params"]
    assert len(params) == 3
    assert all(p is not model[0].weight for p in params)
    lrs = []
    for _ in range(10):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([1e-2 * warmup_cosine(s, 10, 2, 0.1) for s in range(10)])
    assert lrs[:2] == pytest.approx([5e-3, 1e-2])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"lr": -1}, "optimizer.lr"),
        ({"lr": 0.0}, "optimizer.lr"),
        ({"warmup_ratio": 1.0}, "optimizer.warmup_ratio"),
        ({"warmup_ratio": -0.1}, "optimizer.warmup_ratio"),
        ({"min_lr_ratio": 1.5}, "optimizer.min_lr_ratio"),
        ({"max_grad_norm": -1.0}, "optimizer.max_grad_norm"),
    ],
)
def test_config_errors_name_the_field(kwargs: dict, field: str) -> None:
    """Invalid optimizer settings raise ConfigError naming the field."""
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        OptimizerConfig(**kwargs)


def test_default_config_is_valid() -> None:
    """The defaults construct without error and have a positive lr."""
    assert OptimizerConfig().lr > 0
