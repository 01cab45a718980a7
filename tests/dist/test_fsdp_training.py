"""FSDP2 data parallelism on 2 gloo ranks: the same training as one process with the same
global batch, exact resume across a restart, and resume on another world size; Muon's steps on
sharded matrices."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from eagleforge.draft.model import Eagle3Draft

from eagleforge.draft.attention import AttentionBackend
from eagleforge.draft.ttt import TTTModule
from eagleforge.muon import MuonConfig
from eagleforge.optim import OptimizerConfig, OptimizerKind, build_optimizer
from eagleforge.parallel import DeviceKind, ParallelConfig
from eagleforge.parallel.dist import distributed
from eagleforge.parallel.fsdp import full_draft_state, shard_draft
from helpers.drafts import tiny_arch
from helpers.processes import descendants
from helpers.ranks import run_ranks
from helpers.runs import (
    FSDP_RUN,
    PADDED,
    assert_close_weights,
    start_from,
    tiny_run_overrides,
    train_on_rank,
    weights,
)

pytestmark = pytest.mark.dist


def overrides(tmp_path: Path, name: str, *extra: str) -> list[str]:
    return tiny_run_overrides(tmp_path, *FSDP_RUN, *extra, name=name)


@pytest.mark.parametrize(
    ("packing", "layout"),
    [
        ("true", "parallel.dp=2"),
        ("false", "parallel.dp=2"),
        ("true", "parallel.tp=2"),
        ("false", "parallel.tp=2 target=custom"),
    ],
)
def test_two_ranks_train_like_one_process_with_the_same_global_batch(
    tmp_path: Path, packing: str, layout: str
) -> None:
    """dp=2, or tp=2 (one target split over both ranks, each rank its own micro-batch; with
    target=custom against the one-process transformers target)."""
    # 3 steps stay inside the first epoch (at its end a rank short of a batch gets a filler,
    # while one process would start the next epoch)
    common = (*(PADDED if packing == "false" else ("data.packing=true",)), "trainer.max_num_steps=3")
    one = train_on_rank(0, overrides(tmp_path, "one", *common, "trainer.grad_accum_steps=2"))
    ranks = run_ranks(train_on_rank, 2, overrides(tmp_path, "two", *common, *layout.split()))
    (losses_0, eval_0, checkpoint), (losses_1, _, _) = ranks
    assert losses_0 == losses_1  # every rank logs the global loss
    torch.testing.assert_close(torch.tensor(losses_0), torch.tensor(one[0]), rtol=1e-4, atol=1e-5)
    assert eval_0["eval/num_counted_0"] == one[1]["eval/num_counted_0"]
    torch.testing.assert_close(eval_0["eval/loss"], one[1]["eval/loss"], rtol=1e-4, atol=1e-5)
    assert_close_weights(weights(checkpoint), weights(one[2]))


def test_two_rank_resume_is_bit_identical_and_reshards(tmp_path: Path) -> None:
    args = ("trainer.save_every_n_steps=2", *PADDED)
    full = run_ranks(train_on_rank, 2, overrides(tmp_path, "full", *args))[0]
    step_2 = tmp_path / "full" / "checkpoints" / "step_00000002"
    start_from(step_2, tmp_path / "resumed")
    resumed = run_ranks(train_on_rank, 2, overrides(tmp_path, "resumed", *args))[0]
    assert resumed[0] == full[0][2:]  # steps 3..4, bit for bit
    final_full, final_resumed = weights(full[2]), weights(resumed[2])
    assert all(torch.equal(final_full[k], final_resumed[k]) for k in final_full)

    # the 2-rank checkpoint continues in one process (another data order: finishes, differs)
    start_from(step_2, tmp_path / "alone")
    alone = train_on_rank(0, overrides(tmp_path, "alone", *args))
    assert len(alone[0]) == 2 and all(torch.isfinite(torch.tensor(alone[0])))
    assert weights(alone[2]).keys() == final_full.keys()


def muon_steps(rank: int, num_steps: int) -> dict[str, torch.Tensor]:
    """``num_steps`` optimizer=muon steps (lm_head in Muon too) of a tiny draft whose matrices
    split unevenly over 2 ranks (21 and 33 rows), on seeded whole gradients, the same on every
    rank; the draft sharded by FSDP2 over every rank (under ``run_ranks``) or plain (in one
    process). Its whole trained weights."""
    arch = replace(tiny_arch(), draft_vocab_size=21, intermediate_size=33)
    torch.manual_seed(0)  # the frozen embedding's random init
    draft = Eagle3Draft(arch)
    draft.init_weights(0.3, torch.Generator().manual_seed(0))
    cfg = OptimizerConfig(kind=OptimizerKind.muon, lr=1e-2, muon=MuonConfig(lm_head=True))
    with distributed(ParallelConfig(device=DeviceKind.cpu)) as world:
        module = shard_draft(TTTModule(draft, 2, AttentionBackend.eager), world, ParallelConfig())
        optimizer, scheduler = build_optimizer(cfg, module, total_steps=num_steps)
        for step in range(num_steps):
            generator = torch.Generator().manual_seed(step)
            for param in module.parameters():
                if param.requires_grad:
                    whole = torch.randn(param.shape, generator=generator)
                    param.grad = (
                        distribute_tensor(whole, param.device_mesh, param.placements)
                        if isinstance(param, DTensor)
                        else whole
                    )
            optimizer.step()
            scheduler.step()
        return full_draft_state(module)


def test_muon_sharded_over_two_ranks_steps_like_one_process() -> None:
    """FSDP2 shards each matrix by rows; Muon's sharded path gathers each whole update, runs
    torch's Newton-Schulz and keeps its rows: on the same gradients, 2 ranks and one process
    (torch's own Muon) end in the same weights, bit for bit. (In training the gradients of 2
    ranks and of one process differ in rounding, and Muon's bf16 Newton-Schulz can turn a
    one-ulp input difference into a visible one in a near-rank-1 gradient's update: end to end,
    see the next test.)"""
    one = muon_steps(0, 4)
    two = run_ranks(muon_steps, 2, 4)[0]
    assert two.keys() == one.keys()
    for name in one:
        assert torch.equal(two[name], one[name]), name


# Slow (test-all): 17 s. make test keeps Muon's sharded step bitwise against one process
# (above) and its exact resume in one process (tests/integration/test_resume.py).
@pytest.mark.slow
def test_muon_on_two_ranks_trains_and_resumes_exactly(tmp_path: Path) -> None:
    """optimizer=muon end to end on 2 ranks: the first loss is one process's (same global
    batch), training moves the weights, a 2-rank resume from step 2 is bit-identical (Muon's
    sharded momentum buffers go through the full-state checkpoint), and one process continues
    from the same checkpoint."""
    # 3 steps: inside the first epoch (see above)
    args = ("optimizer=muon", *PADDED, "trainer.max_num_steps=3",
            "trainer.save_every_n_steps=2")  # fmt: skip
    one = train_on_rank(0, overrides(tmp_path, "one", *args, "trainer.grad_accum_steps=2",
                                     "trainer.max_num_steps=1"))  # fmt: skip
    full = run_ranks(train_on_rank, 2, overrides(tmp_path, "full", *args))[0]
    torch.testing.assert_close(full[0][0], one[0][0], rtol=1e-4, atol=1e-5)
    step_2 = tmp_path / "full" / "checkpoints" / "step_00000002"
    assert not torch.equal(weights(full[2])["fc.weight"], weights(step_2)["fc.weight"])

    start_from(step_2, tmp_path / "resumed")
    resumed = run_ranks(train_on_rank, 2, overrides(tmp_path, "resumed", *args))[0]
    assert resumed[0] == full[0][2:]  # step 3, bit for bit
    final_full, final_resumed = weights(full[2]), weights(resumed[2])
    assert all(torch.equal(final_full[k], final_resumed[k]) for k in final_full)

    # the 2-rank checkpoint (whole momentum buffers) continues in one process
    start_from(step_2, tmp_path / "alone")
    alone = train_on_rank(0, overrides(tmp_path, "alone", *args))
    assert len(alone[0]) == 1 and all(torch.isfinite(torch.tensor(alone[0])))


# Slow: a SIGKILL mid-save is cleaned up and resumed exactly in one process by default
# (tests/integration/test_resume.py), and two ranks resume exactly above.
@pytest.mark.slow
def test_two_ranks_killed_with_sigkill_resume_bit_identical(tmp_path: Path) -> None:
    """torchrun's whole process group SIGKILLed once step 2 is saved; the same 2-rank
    command then ends exactly as the run that never stopped."""
    args = ("trainer.save_every_n_steps=1", "trainer.max_num_steps=5", *PADDED)
    full = run_ranks(train_on_rank, 2, overrides(tmp_path, "full", *args))[0]
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.Popen(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "eagleforge.train",
         *overrides(tmp_path, "killed", *args)],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    checkpoints = tmp_path / "killed" / "checkpoints"
    while not (checkpoints / "step_00000002").exists() and proc.poll() is None:
        time.sleep(0.01)
    for pid in [proc.pid, *descendants(proc.pid)]:  # torchrun's workers run in other groups
        os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=60)
    saved = int(sorted(checkpoints.glob("step_*"))[-1].name.removeprefix("step_"))
    assert 2 <= saved < 5
    resumed = run_ranks(train_on_rank, 2, overrides(tmp_path, "killed", *args))[0]
    assert resumed[0] == full[0][saved:]
    final_full, final_resumed = weights(full[2]), weights(resumed[2])
    assert all(torch.equal(final_full[k], final_resumed[k]) for k in final_full)


# Slow (test-all): make test resumes a DFlash run bit for bit in one process
# (tests/integration/test_family_contract.py); here the anchors' per-rank RNG goes through FSDP2.
@pytest.mark.slow
def test_dflash_on_two_ranks_trains_and_resumes_exactly(tmp_path: Path) -> None:
    """draft=dflash sharded over 2 ranks: training moves the weights, every rank logs the same
    global loss, and a 2-rank resume from step 2 is bit-identical (each rank's anchor RNG is in
    the checkpoint)."""
    args = ("draft=dflash", "draft.dflash.num_layers=1", "draft.dflash.block_size=4",
            "draft.dflash.num_anchors=6", "draft.dflash.mask_token_id=16", *PADDED,
            "trainer.save_every_n_steps=2", "draft.ttt_length=7")  # fmt: skip
    full_0, full_1 = run_ranks(train_on_rank, 2, overrides(tmp_path, "full", *args))
    assert full_0[0] == full_1[0]  # the global loss on both ranks
    step_2 = tmp_path / "full" / "checkpoints" / "step_00000002"
    assert not torch.equal(weights(full_0[2])["fc.weight"], weights(step_2)["fc.weight"])
    start_from(step_2, tmp_path / "resumed")
    resumed = run_ranks(train_on_rank, 2, overrides(tmp_path, "resumed", *args))[0]
    assert resumed[0] == full_0[0][2:]  # steps 3..4, bit for bit
    final_full, final_resumed = weights(full_0[2]), weights(resumed[2])
    assert all(torch.equal(final_full[k], final_resumed[k]) for k in final_full)


@pytest.mark.slow
def test_peagle_on_two_ranks_trains_and_resumes_exactly(tmp_path: Path) -> None:
    """draft=peagle sharded over 2 ranks: its placeholder features (a parameter of the draft
    itself, outside its layers) train through FSDP2, every rank logs the same global loss, and
    a 2-rank resume from step 2 is bit-identical."""
    # FSDP_RUN's EAGLE-3 unroll back to its default: P-EAGLE refuses a setting it never reads
    args = ("draft=peagle", "draft.peagle.num_depths=3", "draft.ttt_length=7",
            "trainer.save_every_n_steps=2")  # fmt: skip
    full_0, full_1 = run_ranks(train_on_rank, 2, overrides(tmp_path, "full", *args))
    assert full_0[0] == full_1[0]
    step_2 = tmp_path / "full" / "checkpoints" / "step_00000002"
    assert not torch.equal(weights(full_0[2])["mask_hidden"], weights(step_2)["mask_hidden"])
    start_from(step_2, tmp_path / "resumed")
    resumed = run_ranks(train_on_rank, 2, overrides(tmp_path, "resumed", *args))[0]
    assert resumed[0] == full_0[0][2:]
    final_full, final_resumed = weights(full_0[2]), weights(resumed[2])
    assert all(torch.equal(final_full[k], final_resumed[k]) for k in final_full)
