"""draft.compile=true: the torch.compile'd draft step gives the same loss and gradients (CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from eagleforge.draft.model import AttentionBackend
from eagleforge.draft.ttt import (
    Teacher,
    TTTBatch,
    count_positions,
    step_weights,
    ttt_forward,
    weighted_loss,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from tiny_drafts import tiny_draft  # noqa: E402

pytestmark = pytest.mark.integration


def test_compiled_step_matches_eager_mode() -> None:
    generator = torch.Generator().manual_seed(0)
    draft = tiny_draft()
    arch = draft.arch
    batch, seq, steps = 2, 12, 2
    valid = torch.ones(batch, seq, dtype=torch.bool)
    valid[1, 9:] = False
    data = TTTBatch(
        input_ids_BT=torch.randint(0, arch.vocab_size, (batch, seq), generator=generator),
        valid_BT=valid,
        loss_mask_BT=torch.ones(batch, seq, dtype=torch.bool),
        aux_BTA=torch.randn(batch, seq, 3 * arch.target_hidden_size, generator=generator),
        teacher=Teacher(
            probs_BTW=torch.softmax(
                torch.randn(batch, seq, arch.draft_vocab_size, generator=generator), -1
            ),
            target_ids_BT=torch.randint(0, arch.vocab_size, (batch, seq), generator=generator),
            in_draft_BT=torch.ones(batch, seq, dtype=torch.bool),
        ),
    )
    results = []
    for compile_ in (False, True):
        draft.zero_grad(set_to_none=True)
        stats = ttt_forward(draft, data, steps, attention=AttentionBackend.sdpa, compile=compile_)
        weighted_loss(stats, count_positions(data, steps), step_weights(steps, 0.8)).backward()
        results.append(
            (
                stats.loss_sum_k.detach(),
                draft.fc.weight.grad.clone(),
                draft.lm_head.weight.grad.clone(),
            )
        )
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
