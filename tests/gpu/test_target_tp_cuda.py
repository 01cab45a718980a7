"""Target tensor parallelism on 2 GPUs with nccl (the CPU/gloo twin is tests/dist/test_target_tp.py),
with transformers' plan (target=hf) and our own decoder (target=custom): each tp rank gets the
aux states, final hidden states and teacher of its own micro-batch, as one GPU with the whole
transformers target computes them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from eagleforge.config import compose_config, to_typed
from eagleforge.parallel import ParallelConfig
from eagleforge.parallel.dist import init_distributed
from eagleforge.parallel.tp import tp_axis
from eagleforge.targets.config import TargetBackendKind, TargetConfig
from eagleforge.targets.hf import HFTarget
from eagleforge.targets.registry import build_target
from eagleforge.targets.source import ModelConfig, resolve_model_dir
from eagleforge.targets.teacher import compute_teacher
from helpers.ranks import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]
DRAFT_IDS = torch.arange(0, 49152, 24)


def _batches(rank: int) -> list[Batch]:
    """A padded batch and a packed row, of other sizes on each rank."""
    generator = torch.Generator().manual_seed(rank)
    lengths = [[7, 5], [11]][rank]
    ids = torch.randint(3, 1000, (len(lengths), max(lengths)), generator=generator)
    mask = torch.arange(max(lengths)) < torch.tensor(lengths).unsqueeze(1)
    documents = [[4, 3], [5, 2, 6]][rank]
    packed = torch.randint(3, 1000, (1, sum(documents)), generator=generator)
    return [
        (ids.masked_fill(~mask, 2), mask, None, None),
        (
            packed,
            torch.ones_like(packed, dtype=torch.bool),
            torch.cat([torch.full((n,), d) for d, n in enumerate(documents)]).unsqueeze(0),
            torch.cat([torch.arange(n) for n in documents]).unsqueeze(0),
        ),
    ]


def _outputs(target: HFTarget, batch: Batch, device: torch.device) -> list[np.ndarray]:
    on_device = [None if t is None else t.to(device) for t in batch]
    out = target.forward(*on_device)  # type: ignore[arg-type]
    t2d = torch.zeros(target.lm_head_weight().shape[0], dtype=torch.bool, device=device)
    draft_ids = DRAFT_IDS.to(device)
    t2d[draft_ids] = True
    teacher = compute_teacher(out.final_hidden_BTH, target.lm_head_weight(), draft_ids, t2d)
    tensors = (out.aux_BTA, out.final_hidden_BTH, teacher.probs_BTW, teacher.target_ids_BT)
    return [t.cpu().numpy() for t in tensors]


def _tp_rank(
    rank: int, model_cfg: ModelConfig, model_dir: Path, backend: TargetBackendKind
) -> tuple:
    world = init_distributed(ParallelConfig(device="cuda", tp=2))
    target = build_target(
        model_cfg,
        TargetConfig(backend=backend),
        model_dir,
        world.device,
        tp_mesh=tp_axis(world.mesh),
    )
    layers = target.decoder.layers if backend == TargetBackendKind.custom else target.layers
    q_proj = layers[0].self_attn.q_proj.weight
    local = q_proj.to_local()
    assert local.device == world.device and torch.distributed.get_backend() == "nccl"
    return tuple(local.shape), [_outputs(target, b, world.device) for b in _batches(rank)]


@pytest.mark.parametrize("backend", [TargetBackendKind.hf, TargetBackendKind.custom])
def test_tp_on_two_gpus_gives_each_rank_its_own_rows(
    cache_dir: Path, backend: TargetBackendKind
) -> None:
    overrides = ["+model=tiny", "model.dtype=float32", "output_dir=unused"]
    model_cfg = to_typed(compose_config(overrides)).model
    model_dir = Path(resolve_model_dir(model_cfg, cache_dir))
    ranks = run_ranks(_tp_rank, 2, model_cfg, model_dir, backend)
    device = torch.device("cuda", 0)
    whole = HFTarget.from_pretrained(model_dir, TargetConfig(), torch.float32, device)
    for rank, (shard, outputs) in enumerate(ranks):
        assert shard == (32, 64)
        for batch, got in zip(_batches(rank), outputs, strict=True):
            expected = _outputs(whole, batch, device)
            for name, g, e in zip(("aux", "final", "probs", "ids"), got, expected, strict=True):
                np.testing.assert_allclose(g, e, rtol=1e-3, atol=1e-4, err_msg=name)
