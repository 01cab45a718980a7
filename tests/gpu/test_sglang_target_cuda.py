"""The SGLang backend on CUDA against the transformers backend: the same model and text give
the same aux and final hidden states, on one GPU (SmolLM2-135M, bf16) and with tp=2 (the tiny
Llama, whose 4 heads split over 2 ranks; SmolLM2's 9 do not); and a short
``prepare target=sglang`` capture that training can read.

SGLang keeps process-wide state (its runtime context and process groups are set up once per
process), so every SGLang target here lives in a process of its own, spawned by the dist
tier's rank helper; the transformers reference runs in the test process.

Tolerance. Both engines run in bf16 (8 significant bits: a rounding of 2^-9 relative per
operation) but round at different places: SGLang fuses qkv and gate/up into one matmul,
RMSNorm with the residual add, and runs FlashInfer (or its own) attention kernels; transformers
runs separate matmuls and SDPA. The differences compound through the layers, so a relative
error (Frobenius norm over the real tokens) of a few 1e-3 is normal; 3e-2 allows for that and
for SmolLM2's large outlier activations. A wrong layer (the off-by-one the two numbering
conventions invite) is caught independently: each captured state must be closer to
transformers' state of the same layer than to the layers either side of it.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from eagleforge.config import compose_config, to_typed
from eagleforge.parallel import ParallelConfig
from eagleforge.parallel.dist import init_distributed
from eagleforge.parallel.tp import tp_axis
from eagleforge.targets.config import TargetConfig
from eagleforge.targets.hf import HFTarget
from eagleforge.targets.registry import build_target
from eagleforge.targets.source import ModelConfig, resolve_model_dir
from helpers.ranks import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None,
        reason="needs sglang: pip install 'eagleforge[sglang]'",
    ),
]

RELATIVE_TOLERANCE = 3e-2
TEXTS = [
    "The capital of France is Paris, and its river is the Seine.",
    "def add(a, b):\n    return a + b\n",
    "Speculative decoding lets a small draft model propose tokens that a large model checks "
    "in one forward pass, so generation gets faster without changing its output.",
]
# small pools: the test needs a few hundred tokens, not the default share of an 80 GB GPU
SGLANG_OPTIONS = ["target.sglang.mem_fraction_static=0.2", "target.sglang.max_total_tokens=4096"]


def _configs(model: str, *extra: str) -> tuple[ModelConfig, TargetConfig]:
    overrides = [f"+model={model}", "data=chitchat", "output_dir=unused", "target=sglang"]
    typed = to_typed(compose_config([*overrides, "model.dtype=bfloat16", *SGLANG_OPTIONS, *extra]))
    return typed.model, typed.target


def _batch(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The texts as right-padded rows of different lengths (pad id 0, as the collator pads)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [tokenizer(text)["input_ids"] for text in TEXTS]
    seq = max(len(r) for r in rows)
    ids_BT = torch.zeros(len(rows), seq, dtype=torch.long)
    mask_BT = torch.zeros(len(rows), seq, dtype=torch.bool)
    for b, row in enumerate(rows):
        ids_BT[b, : len(row)] = torch.tensor(row)
        mask_BT[b, : len(row)] = True
    assert len({len(r) for r in rows}) == len(rows)  # every row has its own padding
    return ids_BT, mask_BT


def _sglang_rank(
    rank: int,
    tp: int,
    model_cfg: ModelConfig,
    target_cfg: TargetConfig,
    model_dir: Path,
    rows: list[slice],
    ids_BT: torch.Tensor,
    mask_BT: torch.Tensor,
) -> dict:
    """One SGLang process: builds the target (over a tp=``tp`` world when tp > 1) and runs its
    own rows of the batch; float32 numpy results for the test process."""
    if tp > 1:
        world = init_distributed(ParallelConfig(device="cuda", tp=tp))
        device, tp_mesh = world.device, tp_axis(world.mesh)
    else:
        device, tp_mesh = torch.device("cuda", 0), None
    target = build_target(model_cfg, target_cfg, model_dir, device, tp_mesh=tp_mesh)
    own = rows[rank]
    seq = int(mask_BT[own].sum(1).max())  # each rank's micro-batch has its own length
    out = target.forward(ids_BT[own, :seq].to(device), mask_BT[own, :seq].to(device))
    return {
        "aux": out.aux_BTA.float().cpu().numpy(),
        "final": out.final_hidden_BTH.float().cpu().numpy(),
        "lm_head": target.lm_head_weight().float().cpu().numpy(),
        "embedding": target.input_embedding().float().cpu().numpy(),
        "aux_layer_ids": list(target.aux_layer_ids),
        "dtype": str(out.aux_BTA.dtype),
    }


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


def _check_against_transformers(
    model_dir: Path,
    ids_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    got: dict,
    aux_layer_ids: list[int],
) -> None:
    device = torch.device("cuda", 0)
    reference = HFTarget.from_pretrained(
        model_dir, TargetConfig(), torch.bfloat16, device, aux_layer_ids=aux_layer_ids
    )
    # the same model's neighbouring layers, to tell a right layer from an off-by-one
    below = HFTarget(reference.model, [i - 1 for i in aux_layer_ids])
    above = HFTarget(reference.model, [i + 1 for i in aux_layer_ids])
    ids, mask = ids_BT.to(device), mask_BT.to(device)
    expected = reference.forward(ids, mask)
    neighbours = [below.forward(ids, mask).aux_BTA, above.forward(ids, mask).aux_BTA]
    real_BT = mask_BT
    aux_BTA = torch.from_numpy(got["aux"])
    final_BTH = torch.from_numpy(got["final"])
    assert got["dtype"] == "torch.bfloat16"
    assert got["aux_layer_ids"] == aux_layer_ids
    assert aux_BTA.shape == (*ids_BT.shape, expected.aux_BTA.shape[-1])
    # padding positions are zeros, not whatever SGLang's buffers held
    assert not aux_BTA[~real_BT].any() and not final_BTH[~real_BT].any()

    hidden = final_BTH.shape[-1]
    for k, layer in enumerate(aux_layer_ids):
        part = slice(k * hidden, (k + 1) * hidden)
        mine = aux_BTA[..., part][real_BT]
        same = _relative_error(mine, expected.aux_BTA[..., part].float().cpu()[real_BT])
        assert same < RELATIVE_TOLERANCE, f"aux layer {layer}: relative error {same:.4f}"
        for n in neighbours:
            other = _relative_error(mine, n[..., part].float().cpu()[real_BT])
            assert same < other, f"aux layer {layer} is closer to a neighbouring layer"
    expected_final = expected.final_hidden_BTH.float().cpu()[real_BT]
    error = _relative_error(final_BTH[real_BT], expected_final)
    assert error < RELATIVE_TOLERANCE, f"final hidden state: relative error {error:.4f}"

    lm_head = reference.lm_head_weight().float().cpu()
    assert torch.equal(torch.from_numpy(got["lm_head"]), lm_head)  # the same weights, unsharded
    assert torch.equal(
        torch.from_numpy(got["embedding"]), reference.input_embedding().float().cpu()
    )
    # the teacher's greedy token agrees where bf16 cannot flip a near tie
    agree = (final_BTH[real_BT] @ lm_head.T).argmax(-1) == (expected_final @ lm_head.T).argmax(-1)
    assert agree.float().mean() >= 0.9, f"greedy tokens agree at {agree.float().mean():.2%}"


def test_sglang_matches_transformers_on_smollm2(smollm2_dir: Path) -> None:
    model_cfg, target_cfg = _configs("smollm2")
    ids_BT, mask_BT = _batch(smollm2_dir)
    rows = [slice(0, len(TEXTS))]
    (got,) = run_ranks(
        _sglang_rank, 1, 1, model_cfg, target_cfg, smollm2_dir, rows, ids_BT, mask_BT
    )
    assert got["aux_layer_ids"] == [1, 14, 26]  # SmolLM2 has 30 layers: the EAGLE-3 default
    _check_against_transformers(smollm2_dir, ids_BT, mask_BT, got, [1, 14, 26])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_sglang_tp2_gives_each_rank_its_own_rows(cache_dir: Path) -> None:
    # the tiny Llama has 6 layers, whose default ids repeat a layer: three distinct ones;
    # head_dim 16 is below what FlashInfer takes, so torch_native attention
    model_cfg, target_cfg = _configs(
        "tiny", "model.aux_layer_ids=[1,2,3]", "target.sglang.attention_backend=torch_native"
    )
    model_dir = Path(resolve_model_dir(model_cfg, cache_dir))
    ids_BT, mask_BT = _batch(model_dir)
    rows = [slice(0, 2), slice(2, 3)]  # rank 0 brings two rows, rank 1 one (its own length)
    ranks = run_ranks(_sglang_rank, 2, 2, model_cfg, target_cfg, model_dir, rows, ids_BT, mask_BT)
    for rank, got in enumerate(ranks):
        own = rows[rank]
        seq = int(mask_BT[own].sum(1).max())
        trimmed_ids, trimmed_mask = ids_BT[own, :seq], mask_BT[own, :seq]
        assert got["aux"].shape[:2] == tuple(trimmed_ids.shape)  # its own rows, its own length
        _check_against_transformers(model_dir, trimmed_ids, trimmed_mask, got, [1, 2, 3])


def _prepare(store: Path, run_dir: Path) -> str:
    from eagleforge.prepare import run as prepare

    overrides = [
        "+model=smollm2", "data=chitchat", "data.max_num_samples=12", "data.num_eval_samples=0",
        "data.max_length=128", "target=sglang", *SGLANG_OPTIONS, "parallel.device=cuda",
        f"prepare.output_dir={store}", "prepare.samples_per_shard=4", "prepare.batch_size=3",
        f"output_dir={run_dir}",
    ]  # fmt: skip
    return str(prepare(to_typed(compose_config(overrides))))


def _prepare_rank(rank: int, store: Path, run_dir: Path) -> str:
    return _prepare(store, run_dir)


def test_prepare_with_sglang_writes_a_store_training_can_read(
    tmp_path: Path, smollm2_dir: Path
) -> None:
    from eagleforge.data.features import FeatureDataset

    store = tmp_path / "features"
    (written,) = run_ranks(_prepare_rank, 1, store, tmp_path / "prep")
    assert Path(written) == store
    manifest = json.loads((store / "train" / "manifest.json").read_text())
    assert manifest["aux_layer_ids"] == [1, 14, 26] and manifest["dtype"] == "bfloat16"
    assert manifest["hidden_size"] == 576
    assert manifest["num_shards"] == -(-manifest["num_samples"] // 4)
    train_set = FeatureDataset(store / "train", verify_checksums=True)
    assert len(train_set) == manifest["num_samples"] > 3  # more than one forward batch
    # a stored sample (not the first of its batch) is what transformers computes for its tokens
    ids, _, aux, final = train_set[min(4, len(train_set) - 1)]
    reference = HFTarget.from_pretrained(
        smollm2_dir, TargetConfig(), torch.bfloat16, torch.device("cuda", 0)
    )
    ids_BT = torch.tensor([ids], device="cuda")
    expected = reference.forward(ids_BT, torch.ones_like(ids_BT, dtype=torch.bool))
    assert aux.shape == (len(ids), 3 * 576) and final.shape == (len(ids), 576)
    aux_error = _relative_error(aux.float(), expected.aux_BTA[0].float().cpu())
    final_error = _relative_error(final.float(), expected.final_hidden_BTH[0].float().cpu())
    assert aux_error < RELATIVE_TOLERANCE and final_error < RELATIVE_TOLERANCE
    assert np.isfinite(aux.float().numpy()).all()
