"""Target tensor parallelism (parallel.tp=2) on gloo ranks: transformers (target=hf) or our own
decoder (target=custom) shards the tiny random Llama over the tp ranks, each rank brings its
own micro-batch (other sizes and lengths than its peer's, padded or packed), and gets back the
aux states, final hidden states and teacher of its own rows, as one process with the whole
transformers target computes them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.ranks import run_ranks

from eagleforge.config import compose_config, to_typed
from eagleforge.errors import ConfigError
from eagleforge.parallel import ParallelConfig
from eagleforge.parallel.dist import init_distributed
from eagleforge.parallel.tp import check_tp_fits, tp_axis
from eagleforge.targets.registry import build_target
from eagleforge.targets.config import TargetBackendKind, TargetConfig
from eagleforge.targets.hf import HFTarget
from eagleforge.targets.source import ModelConfig, resolve_model_dir
from eagleforge.targets.teacher import compute_teacher

pytestmark = pytest.mark.dist

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def _padded(lengths: list[int], seed: int) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 1000, (len(lengths), max(lengths)), generator=generator)
    mask = torch.arange(max(lengths)) < torch.tensor(lengths).unsqueeze(1)
    return ids.masked_fill(~mask, 2), mask, None, None


def _packed(lengths: list[int], seed: int) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 1000, (1, sum(lengths)), generator=generator)
    documents = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)]).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return ids, torch.ones_like(ids, dtype=torch.bool), documents, positions


# Micro-batches per data shard, in step: padded, packed, then padded beside packed.
BATCHES = {
    0: [_padded([7, 5], 0), _packed([4, 3], 1), _padded([6], 2)],
    1: [_padded([11], 3), _packed([5, 2, 6], 4), _packed([3, 8], 5)],
}
DRAFT_IDS = torch.arange(0, 49152, 24)


def _outputs(target: HFTarget, batch: Batch) -> list[np.ndarray]:
    out = target.forward(*batch)
    t2d = torch.zeros(target.lm_head_weight().shape[0], dtype=torch.bool)
    t2d[DRAFT_IDS] = True
    teacher = compute_teacher(out.final_hidden_BTH, target.lm_head_weight(), DRAFT_IDS, t2d)
    tensors = (out.aux_BTA, out.final_hidden_BTH, teacher.probs_BTW, teacher.target_ids_BT)
    return [t.numpy() for t in tensors]


def _tp_rank(
    rank: int, model_cfg: ModelConfig, model_dir: Path, dp: int, backend: TargetBackendKind
) -> tuple:
    world = init_distributed(ParallelConfig(device="cpu", dp=dp, tp=2))
    target = build_target(
        model_cfg,
        TargetConfig(backend=backend),
        model_dir,
        world.device,
        tp_mesh=tp_axis(world.mesh),
    )
    layers = target.decoder.layers if backend == TargetBackendKind.custom else target.layers
    q_proj = layers[0].self_attn.q_proj.weight
    shard = tuple(q_proj.to_local().shape) if hasattr(q_proj, "to_local") else None
    shard_of = world.data_rank % 2  # with dp=2 the second tp group repeats the first's batches
    return shard, shard_of, [_outputs(target, batch) for batch in BATCHES[shard_of]]


@pytest.fixture(scope="module")
def tiny(cache_dir: Path) -> tuple[ModelConfig, Path]:
    model = to_typed(compose_config(["+model=tiny", "output_dir=unused"])).model
    return model, Path(resolve_model_dir(model, cache_dir))


def _check_against_one_process(ranks: list[tuple], model_dir: Path) -> None:
    whole = HFTarget.from_pretrained(model_dir, TargetConfig(), torch.float32, torch.device("cpu"))
    for shard, shard_of, outputs in ranks:
        assert shard == (32, 64)  # q_proj [64, 64] split by output rows over 2 ranks
        for batch, got in zip(BATCHES[shard_of], outputs, strict=True):
            expected = _outputs(whole, batch)
            for name, g, e in zip(("aux", "final", "probs", "ids"), got, expected, strict=True):
                assert g.shape == e.shape, name
                np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("backend", [TargetBackendKind.hf, TargetBackendKind.custom])
def test_each_tp_rank_gets_its_own_rows(
    tiny: tuple[ModelConfig, Path], backend: TargetBackendKind
) -> None:
    model_cfg, model_dir = tiny
    ranks = run_ranks(_tp_rank, 2, model_cfg, model_dir, 1, backend)
    _check_against_one_process(ranks, model_dir)


# custom is slow only: its tp sharding runs by default in test_each_tp_rank_gets_its_own_rows,
# and the tp groups beside dp ranks with hf.
@pytest.mark.parametrize(
    "backend",
    [TargetBackendKind.hf, pytest.param(TargetBackendKind.custom, marks=pytest.mark.slow)],
)
def test_tp_groups_beside_data_parallel_ranks(
    tiny: tuple[ModelConfig, Path], backend: TargetBackendKind
) -> None:
    model_cfg, model_dir = tiny
    ranks = run_ranks(_tp_rank, 4, model_cfg, model_dir, 2, backend)
    assert [r[1] for r in ranks] == [0, 1, 0, 1]
    _check_against_one_process(ranks, model_dir)


def test_tp_must_divide_the_heads(tiny: tuple[ModelConfig, Path]) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny[1])  # 4 attention heads, 2 key/value heads
    check_tp_fits(config, 2)
    with pytest.raises(ConfigError, match=r"parallel.tp=4 must divide .* 2 key/value heads"):
        check_tp_fits(config, 4)
    config.base_model_tp_plan = None
    with pytest.raises(ConfigError, match="no tensor-parallel plan"):
        check_tp_fits(config, 2)
