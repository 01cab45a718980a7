"""What a job launcher tells the run: torch.distributed's environment inside a submitit job.

torchrun exports ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``
itself. A SLURM job started by hydra-submitit-launcher (``-m hydra/launcher=slurm``) runs one
task per GPU instead and only has submitit's and SLURM's variables; ``export_submitit_env``
turns those into torchrun's, so that ``parallel.dist.init_distributed`` and the config checks
read one convention. submitit is imported only inside a submitit job.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

TORCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def in_submitit_job() -> bool:
    """True inside a job that submitit started (local or SLURM executor)."""
    return bool(os.environ.get("SUBMITIT_EXECUTOR"))


def export_submitit_env() -> dict[str, str]:
    """Inside a submitit job with several tasks, export torchrun's variables for this task and
    return them; elsewhere (one task, torchrun, no launcher) change nothing and return {}.

    Idempotent; variables torchrun already set win (``srun torchrun`` inside a submitit job).
    """
    if not in_submitit_job() or "RANK" in os.environ:
        return {}
    from submitit import JobEnvironment
    from submitit.helpers import TorchDistributedEnvironment

    if JobEnvironment().num_tasks < 2:
        return {}
    # CUDA_VISIBLE_DEVICES is left alone: each task picks cuda:LOCAL_RANK itself
    # (parallel.resolve_device), as under torchrun.
    env = TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    exported = {name: os.environ[name] for name in TORCH_ENV}
    log.debug(
        "submitit task %d/%d: rendezvous at %s:%d",
        env.rank,
        env.world_size,
        env.master_addr,
        env.master_port,
    )
    return exported


def is_main_process() -> bool:
    """Rank 0 of the launcher's processes (torchrun's or submitit's); True in a one-process run."""
    export_submitit_env()
    return int(os.environ.get("RANK", "0")) == 0
