"""FSDP2 on 2 GPUs with nccl (the CPU/gloo twin is tests/dist/test_fsdp_training.py): in fp32
parameters the same loss trace and weights as one GPU with the same global batch; with bf16 mixed
precision (the default) a run that trains and resumes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.ranks import run_ranks
from helpers.runs import FSDP_RUN, tiny_run_overrides, train_on_rank, weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


def cuda(tmp_path: Path, name: str, *extra: str) -> list[str]:
    return tiny_run_overrides(tmp_path, *FSDP_RUN, "parallel.device=cuda", *extra, name=name)


def test_two_gpus_fp32_train_like_one_gpu(tmp_path: Path) -> None:
    common = ("data.packing=true", "trainer.max_num_steps=3", "parallel.mixed_precision=false")
    one = train_on_rank(0, cuda(tmp_path, "one", *common, "trainer.grad_accum_steps=2"))
    (losses, _, checkpoint), _ = run_ranks(train_on_rank, 2, cuda(tmp_path, "two", *common))
    # both compute under bf16 autocast, in other orders: compare to bf16 precision; the
    # weights within a fraction of one Adam step (lr 1e-3)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(one[0]), rtol=2e-2, atol=1e-2)
    ours, reference = weights(checkpoint), weights(one[2])
    for name, tensor in reference.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=5e-4)


def test_two_gpus_mixed_precision_train_and_resume(tmp_path: Path) -> None:
    args = cuda(tmp_path, "run", "trainer.save_every_n_steps=2", "trainer.max_num_steps=4")
    losses, _, _ = run_ranks(train_on_rank, 2, args)[0]
    assert all(torch.isfinite(torch.tensor(losses)))
    more = [a.replace("max_num_steps=4", "max_num_steps=6") for a in args]
    resumed, _, checkpoint = run_ranks(train_on_rank, 2, more)[0]
    assert len(resumed) == 2 and Path(checkpoint).name == "step_00000006"
