"""Where training runs: the `parallel` config section, the parallel dimensions and the device.

A run is one process (CPU or one GPU) or ``world_size`` processes started by torchrun or
SLURM. The ranks form a DeviceMesh with the named axes ``dp`` (data), ``sp`` (sequence,
``ring`` x ``ulysses``) and ``tp`` (target tensor parallelism). The draft is small: it is
data-parallel (FSDP2) over every rank; the axes only say how its inputs are produced:

- ``tp`` ranks run one target together (online); each keeps its own micro-batch.
- ``sp`` ranks share one sample and split its sequence (USP attention, offline).

The device and the mesh are resolved once (``parallel.dist.init_distributed``) and passed
on; no module calls ``.cuda()`` or keeps process groups in globals.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum

import torch

from eagleforge.errors import ConfigError
from eagleforge.precision import flush_subnormals


class DeviceKind(str, Enum):
    auto = "auto"  # cuda when available, else cpu
    cpu = "cpu"
    cuda = "cuda"


@dataclass
class ParallelConfig:
    """The `parallel` config section."""

    # Device to train on.
    device: DeviceKind = DeviceKind.auto
    # CPU threads per process for intra-op parallelism (0 = torch's default).
    num_threads: int = 0
    # Data-parallel degree; -1 = whatever the world size leaves (world / (tp x sp)).
    dp: int = -1
    # Target tensor-parallel degree (online, hf backend): tp ranks run one target together.
    tp: int = 1
    # Sequence parallelism of the draft (draft.attention=usp, offline): heads are split over
    # sp_ulysses ranks (all-to-all) and the sequence over sp_ring ranks (ring attention).
    sp_ulysses: int = 1
    sp_ring: int = 1
    # The draft is sharded over every rank with FSDP2 (parameters, gradients, optimizer state).
    # Free the gathered parameters after forward (less memory, one more all-gather).
    reshard_after_forward: bool = True
    # CUDA only: keep bf16 parameter copies for compute, reduce gradients in fp32.
    mixed_precision: bool = True
    # Process-group timeout in seconds (a rank that hangs longer fails the job).
    timeout_s: int = 1800

    def __post_init__(self) -> None:
        if self.num_threads < 0:
            raise ConfigError(f"parallel.num_threads must be >= 0, got {self.num_threads}.")
        if self.dp == 0 or self.dp < -1:
            raise ConfigError(f"parallel.dp must be >= 1 or -1 (auto), got {self.dp}.")
        for name in ("tp", "sp_ulysses", "sp_ring", "timeout_s"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name} must be >= 1, got {getattr(self, name)}.")
        if self.tp > 1 and self.sp > 1:
            raise ConfigError(
                f"parallel.tp={self.tp} with parallel.sp_ulysses x sp_ring={self.sp}: target "
                "tensor parallelism (online) and sequence parallelism (offline) do not combine; "
                "set one of them to 1."
            )
        world = os.environ.get("WORLD_SIZE")
        if world is not None:  # launched: the sizes must fit now, not after loading a model
            self.dims(int(world))

    @property
    def sp(self) -> int:
        return self.sp_ulysses * self.sp_ring

    def dims(self, world_size: int) -> ParallelDims:
        """The parallel dimensions for ``world_size`` processes; ConfigError if they do not fit."""
        inner = self.tp * self.sp
        dp = self.dp if self.dp != -1 else world_size // inner
        if dp < 1 or dp * inner != world_size:
            raise ConfigError(
                f"parallel.dp={self.dp} x tp={self.tp} x sp_ulysses={self.sp_ulysses} x "
                f"sp_ring={self.sp_ring} must equal the world size {world_size} (processes "
                "started by torchrun/SLURM); change those fields or the process count."
            )
        return ParallelDims(dp, self.tp, self.sp_ring, self.sp_ulysses)


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the mesh axes; their product is the world size."""

    dp: int = 1
    tp: int = 1
    ring: int = 1
    ulysses: int = 1

    NAMES = ("dp", "ring", "ulysses", "tp")

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.dp, self.ring, self.ulysses, self.tp)

    @property
    def world_size(self) -> int:
        return self.dp * self.ring * self.ulysses * self.tp

    @property
    def sp(self) -> int:
        return self.ring * self.ulysses

    @property
    def data_shards(self) -> int:
        """Ranks that read different samples: every rank but the sp ranks of one sample."""
        return self.dp * self.tp


def resolve_device(cfg: ParallelConfig, local_rank: int = 0) -> torch.device:
    if cfg.device == DeviceKind.cuda and not torch.cuda.is_available():
        raise ConfigError(
            "parallel.device=cuda but CUDA is not available; use parallel.device=cpu or auto."
        )
    cpu = cfg.device == DeviceKind.cpu or (
        cfg.device == DeviceKind.auto and not torch.cuda.is_available()
    )
    if cpu:  # before the thread count: the threads it starts take the setting
        flush_subnormals()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    if cpu:
        return torch.device("cpu")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        torch.cuda.set_device(local_rank)
    return torch.device("cuda", torch.cuda.current_device())
