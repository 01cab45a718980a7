"""data.packing with the HF target: packed rows give the same loss as padded batches, and a
packed training run works end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagleforge.config import compose_config, to_typed
from eagleforge.data.loader import make_loader, pack_indices
from eagleforge.data.preprocess import TokenizedDataset
from eagleforge.draft.attention import AttentionBackend
from eagleforge.draft.config import DraftConfig
from eagleforge.draft.model import DraftArchitecture, Eagle3Draft
from eagleforge.draft.ttt import count_positions, ttt_forward
from eagleforge.targets.config import TargetConfig
from eagleforge.targets.hf import HFTarget
from eagleforge.targets.source import resolve_model_dir
from eagleforge.targets.teacher import teacher_batch
from eagleforge.train import run
from helpers.runs import tiny_run_overrides

pytestmark = pytest.mark.integration


def test_pack_indices_keeps_order_and_budget() -> None:
    lengths = [5, 3, 4, 6, 2, 7]
    rows = pack_indices(lengths, [0, 1, 2, 3, 4, 5], max_tokens=9)
    assert rows == [[0, 1], [2], [3, 4], [5]]
    assert sorted(i for row in rows for i in row) == list(range(6))
    assert all(sum(lengths[i] for i in row) <= 9 for row in rows)


def test_packed_and_padded_batches_give_the_same_loss(cache_dir: Path) -> None:
    config = to_typed(compose_config(["+model=tiny", "data=chitchat", "output_dir=unused"]))
    target = HFTarget.from_pretrained(
        resolve_model_dir(config.model, cache_dir),
        TargetConfig(),
        torch.float32,
        torch.device("cpu"),
    )
    generator = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    samples = [
        (torch.randint(0, vocab, (n,), generator=generator).tolist(), [0] * 3 + [1] * (n - 3))
        for n in (9, 14, 6)
    ]
    dataset = TokenizedDataset([s[0] for s in samples], [s[1] for s in samples])
    arch = DraftArchitecture.from_target(
        target.config, DraftConfig(draft_vocab_size=vocab), target.aux_layer_ids
    )
    draft = Eagle3Draft(arch)
    draft.init_weights(0.05, torch.Generator().manual_seed(1))
    draft_ids, t2d = torch.arange(vocab), torch.ones(vocab, dtype=torch.bool)
    stats = {}
    for packing in (False, True):
        (batch,) = list(
            make_loader(dataset, packing, max_tokens_per_batch=64, batch_size=3, pad_token_id=0)
        )
        ttt_batch = teacher_batch(target, batch, draft_ids, t2d, chunk_size=16)
        with torch.no_grad():
            stats[packing] = (
                ttt_forward(draft, ttt_batch, 3, attention=AttentionBackend.sdpa),
                count_positions(ttt_batch, 3),
            )
    (padded, padded_counts), (packed, packed_counts) = stats[False], stats[True]
    assert torch.equal(padded_counts, packed_counts) and int(packed_counts[0]) > 0
    assert torch.equal(padded.num_correct_k, packed.num_correct_k)
    torch.testing.assert_close(packed.loss_sum_k, padded.loss_sum_k, rtol=1e-4, atol=1e-4)


def test_packed_training_run(tmp_path: Path) -> None:
    result = run(compose_config(tiny_run_overrides(
        tmp_path, "data.packing=true", "data.max_tokens_per_batch=256", "trainer.max_num_steps=3",
        "draft.ttt_length=3",
    )))  # fmt: skip
    assert result.step == 3 and all(torch.isfinite(torch.tensor(result.train_losses)))
    assert result.final_eval["eval/num_counted_0"] > 0
