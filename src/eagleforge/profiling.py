"""The `profile` config section: torch.profiler traces of a few training steps.

With ``profile.enabled``, optimizer steps ``start_step`` … ``start_step + num_steps - 1`` run
under torch.profiler (CPU, and CUDA when training on a GPU). Each rank writes a Chrome trace
(``<output_dir>/profile/trace_rank<r>.json``, open it in Perfetto or chrome://tracing);
rank 0 logs the traces as MLflow artifacts and prints a short table of the top operators.
"""

from __future__ import annotations

import logging
import resource
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from eagleforge.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class ProfileConfig:
    """The `profile` config section."""

    # Profile a few optimizer steps with torch.profiler.
    enabled: bool = False
    # The first profiled step (1-based optimizer step; leave a few steps for warm-up).
    start_step: int = 3
    # Steps profiled.
    num_steps: int = 2
    # Record input shapes of each operator (bigger traces; groups the table by shape).
    record_shapes: bool = False
    # Record allocations (memory timeline in the trace).
    profile_memory: bool = False
    # Operators in the table printed at the end.
    top_ops: int = 15

    def __post_init__(self) -> None:
        for name in ("start_step", "num_steps", "top_ops"):
            if getattr(self, name) < 1:
                raise ConfigError(f"profile.{name} must be >= 1, got {getattr(self, name)}.")


class StepProfiler:
    """torch.profiler over the configured optimizer steps; ``step()`` after each one."""

    def __init__(
        self, cfg: ProfileConfig, out_dir: Path, rank: int, device: torch.device, first_step: int
    ) -> None:
        self.cfg, self.rank = cfg, rank
        self.trace = out_dir / f"trace_rank{rank}.json"
        self.table = ""
        wait = cfg.start_step - 1 - first_step  # steps already done count (resumed runs)
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.sort_key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        self.active = wait >= 0
        if not self.active:
            log.warning(
                "profile.start_step=%d is already past (the run resumes at step %d): not profiling",
                cfg.start_step,
                first_step,
            )
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.profiler: Any = profile(
            activities=activities,
            # the step before the window warms the profiler up, when there is one
            schedule=schedule(
                wait=max(wait - 1, 0), warmup=min(wait, 1), active=cfg.num_steps, repeat=1
            ),
            on_trace_ready=self._ready,
            record_shapes=cfg.record_shapes,
            profile_memory=cfg.profile_memory,
        )
        self.profiler.start()

    def _ready(self, prof: Any) -> None:
        prof.export_chrome_trace(str(self.trace))
        self.table = prof.key_averages(group_by_input_shape=self.cfg.record_shapes).table(
            sort_by=self.sort_key, row_limit=self.cfg.top_ops
        )
        log.info("profile of rank %d written to %s", self.rank, self.trace)

    def step(self) -> None:
        if self.active:
            self.profiler.step()

    def stop(self) -> None:
        """End profiling (a run shorter than the profiled window still gets its trace)."""
        if self.active:
            self.profiler.stop()
            self.active = False


def peak_memory_mib(device: torch.device) -> float:
    """This process's peak memory so far, in MiB: the CUDA caching allocator's peak on a GPU
    (what torchtitan logs), the peak resident set on a CPU (target, draft and data together)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes there, KiB here
