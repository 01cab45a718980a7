"""Where training runs: the `parallel` config section and the device it resolves to.

This release trains in one process on one device (CPU or one GPU); the device is resolved
once here and passed on -- no module calls ``.cuda()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from eagleforge.errors import ConfigError


class DeviceKind(str, Enum):
    auto = "auto"  # cuda when available, else cpu
    cpu = "cpu"
    cuda = "cuda"


@dataclass
class ParallelConfig:
    """The `parallel` config section."""

    # Device to train on.
    device: DeviceKind = DeviceKind.auto
    # CPU threads for intra-op parallelism (0 = torch's default).
    num_threads: int = 0

    def __post_init__(self) -> None:
        if self.num_threads < 0:
            raise ConfigError(f"parallel.num_threads must be >= 0, got {self.num_threads}.")


def resolve_device(cfg: ParallelConfig) -> torch.device:
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    if cfg.device == DeviceKind.cuda and not torch.cuda.is_available():
        raise ConfigError(
            "parallel.device=cuda but CUDA is not available; use parallel.device=cpu or auto."
        )
    if cfg.device == DeviceKind.cpu or (
        cfg.device == DeviceKind.auto and not torch.cuda.is_available()
    ):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())
