"""Run a function on N gloo ranks spawned by the test (CPU, one thread each).

``run_ranks(fn, n, *args)`` starts n processes with torchrun's environment variables set
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so code under test joins the group
exactly as under torchrun; ``fn(rank, *args)`` runs in each and its return values come back
in rank order. A failure in any rank fails the test with that rank's traceback.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, n: int, port: int, fn: Callable[..., Any], args: tuple, results: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(n),
        LOCAL_WORLD_SIZE=str(n),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch

    torch.set_num_threads(1)
    try:
        results[rank] = ("ok", fn(rank, *args))
    except BaseException:  # report it to the parent, with the traceback
        results[rank] = ("error", traceback.format_exc())
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], n: int, *args: Any) -> list[Any]:
    """fn must be a module-level function (it is pickled into the spawned processes)."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        mp.start_processes(
            _entry, args=(n, free_port(), fn, args, results), nprocs=n, start_method="spawn"
        )
        out = dict(results)
    errors = [f"rank {r}:\n{out[r][1]}" for r in sorted(out) if out[r][0] == "error"]
    if errors or len(out) != n:
        raise AssertionError("\n".join(errors) or f"only ranks {sorted(out)} reported")
    return [out[r][1] for r in range(n)]
