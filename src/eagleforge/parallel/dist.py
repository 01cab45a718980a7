"""The process group and DeviceMesh of a run, built once from the launcher's environment.

torchrun (and SLURM through ``launchers/``) export ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``; without them the run is one process and ``World`` is
the trivial world (no process group, every collective a no-op).
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from eagleforge.parallel import ParallelConfig, ParallelDims, resolve_device
from eagleforge.parallel.launch import export_submitit_env

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class World:
    """This process's place in the run: device, rank, and the mesh over all ranks."""

    device: torch.device
    dims: ParallelDims
    rank: int = 0
    local_rank: int = 0
    mesh: DeviceMesh | None = None  # axes ParallelDims.NAMES; None in a one-process run

    @property
    def size(self) -> int:
        return self.dims.world_size

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def coordinate(self, axis: str) -> int:
        """This rank's index along a mesh axis (0 in a one-process run)."""
        return 0 if self.mesh is None else self.mesh.get_local_rank(axis)

    @property
    def data_rank(self) -> int:
        """Which data shard this rank reads (sp ranks of one sample read the same shard)."""
        return self.coordinate("dp") * self.dims.tp + self.coordinate("tp")

    def group(self, axis: str) -> dist.ProcessGroup | None:
        return None if self.mesh is None else self.mesh.get_group(axis)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over every rank; a new tensor on ``tensor``'s device (the input when alone)."""
        if self.mesh is None:
            return tensor
        on_device = tensor.to(self.device, copy=True)
        dist.all_reduce(on_device)
        return on_device.to(tensor.device)

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on some rank."""
        return bool(self.all_reduce_sum(torch.tensor([int(flag)])).item())

    def on_main(self, fn: Callable[[], T], elsewhere: Exception) -> T | None:
        """``fn()`` on rank 0 only (None elsewhere). If it raises, every rank raises -- rank 0
        its error, the others ``elsewhere`` -- instead of the others waiting in their next
        collective until the timeout."""
        result, error = None, None
        if self.is_main:
            try:
                result = fn()
            except Exception as e:
                error = e
        if self.any(error is not None):
            raise error or elsewhere
        return result

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        if self.mesh is None:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_float(self, value: float) -> float:
        """Rank 0's value on every rank."""
        if self.mesh is None:
            return value
        tensor = torch.tensor([value if self.is_main else 0.0], dtype=torch.float64)
        return float(self.all_reduce_sum(tensor).item())

    def barrier(self) -> None:
        if self.mesh is not None:
            dist.barrier()

    @contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (filling caches), the others after it, from the caches."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()


def init_distributed(cfg: ParallelConfig) -> World:
    """Join the launcher's process group (nccl on CUDA, gloo on CPU) and build the mesh."""
    export_submitit_env()  # a submitit task's rank and rendezvous, as torchrun would set them
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dims = cfg.dims(world_size)
    device = resolve_device(cfg, local_rank)
    if world_size == 1:
        return World(device, dims)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            timeout=datetime.timedelta(seconds=cfg.timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    mesh = init_device_mesh(device.type, dims.shape, mesh_dim_names=ParallelDims.NAMES)
    rank = dist.get_rank()
    log.info(
        "rank %d/%d on %s, mesh %s",
        rank,
        world_size,
        device,
        dict(zip(dims.NAMES, dims.shape, strict=True)),
    )
    return World(device, dims, rank, local_rank, mesh)


@contextmanager
def distributed(cfg: ParallelConfig) -> Iterator[World]:
    """``init_distributed`` for the length of a run; the process group is destroyed after."""
    world = init_distributed(cfg)
    try:
        yield world
        # Every rank through its last collective before any tears its group down: a rank that
        # finished first (rank 0 still writing the summary) and destroyed its gloo group while
        # the other's side was still open aborted now and then ("terminate called without an
        # active exception"). On an error no rank waits here: the error ends every rank.
        world.barrier()
    finally:
        if world.distributed and dist.is_initialized():
            dist.destroy_process_group()
