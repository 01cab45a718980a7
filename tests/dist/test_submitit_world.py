"""Two tasks of one job under submitit's local executor (as under SLURM, without torchrun)
join one gloo group through init_distributed."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers.ranks import free_port

pytestmark = pytest.mark.dist


def test_submitit_tasks_form_one_world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    submitit = pytest.importorskip("submitit")

    def task() -> tuple[int, int, float]:
        import torch

        from eagleforge.parallel import ParallelConfig
        from eagleforge.parallel.dist import distributed

        config = ParallelConfig(device="cpu", num_threads=1, timeout_s=60)
        with distributed(config) as world:
            total = world.all_reduce_sum(torch.tensor([world.rank + 1.0]))
            return world.rank, world.size, float(total)

    # submitit derives the port from the job id; a free one set here (the job inherits it)
    # keeps a busy machine's ephemeral ports out of the way.
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    executor = submitit.AutoExecutor(folder=tmp_path, cluster="local")
    executor.update_parameters(tasks_per_node=2, timeout_min=3)
    job = executor.submit(task)
    try:
        deadline = time.monotonic() + 150
        while not job.done() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert job.done(), "the two tasks did not finish"
        assert sorted(job.results(), key=lambda r: r[0]) == [(0, 2, 3.0), (1, 2, 3.0)]
    finally:
        if not job.done():
            job.cancel()
