"""M-RoPE in the draft (vision-language targets): [3, B, T] positions rotate as the target's
rotary embedding does, three equal rows are plain RoPE, and the TTT's "pos_t + i" rule holds
for every component."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from eagleforge.draft.model import Eagle3Draft
from eagleforge.draft.ttt import ttt_forward
from helpers.drafts import random_batch, tiny_arch, tiny_draft

pytestmark = pytest.mark.unit

SECTION = [1, 1, 2]  # head_dim 8: 4 frequencies over (time, height, width)


def mrope_draft(seed: int = 0) -> Eagle3Draft:
    """tiny_draft's weights in a draft whose architecture has M-RoPE sections."""
    text = tiny_draft(seed)
    arch = dataclasses.replace(
        tiny_arch(), rope_scaling={"rope_type": "default", "mrope_section": SECTION}
    )
    draft = Eagle3Draft(arch)
    draft.load_state_dict(text.state_dict())
    return draft


def image_positions_3BT(batch: int, seq: int) -> torch.Tensor:
    """Text, then a 2 x 2 image at 3..6 (height/width rows differ), then text, as
    Qwen2.5-VL's get_rope_index lays them out."""
    rows = torch.arange(seq).repeat(3, 1)
    rows[:, 3:7] = torch.tensor([[3, 3, 3, 3], [3, 3, 4, 4], [3, 4, 3, 4]])
    rows[:, 7:] = torch.arange(5, 5 + seq - 7)
    return rows.unsqueeze(1).expand(3, batch, seq).clone()


def test_equal_rows_are_plain_rope() -> None:
    draft = mrope_draft()
    positions_BT = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]])
    cos, sin = draft.rope(positions_BT.expand(3, -1, -1), torch.float32)
    plain_cos, plain_sin = tiny_draft().rope(positions_BT, torch.float32)
    torch.testing.assert_close(cos, plain_cos)
    torch.testing.assert_close(sin, plain_sin)


def test_rope_matches_the_targets_rotary_embedding() -> None:
    from transformers import Qwen2_5_VLTextConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

    arch = mrope_draft().arch
    config = Qwen2_5_VLTextConfig(
        hidden_size=arch.num_attention_heads * arch.head_dim,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        rope_parameters={
            "rope_type": "default",
            "mrope_section": SECTION,
            "rope_theta": arch.rope_theta,
        },
    )
    positions_3BT = image_positions_3BT(2, 10)
    cos_ref, sin_ref = Qwen2_5_VLRotaryEmbedding(config)(torch.zeros(1), positions_3BT)
    cos, sin = mrope_draft().rope(positions_3BT, torch.float32)
    torch.testing.assert_close(cos, cos_ref)
    torch.testing.assert_close(sin, sin_ref)
    # an image makes the rotation differ from text positions
    text_cos, _ = mrope_draft().rope(torch.arange(10).expand(2, -1), torch.float32)
    assert not torch.allclose(cos, text_cos)


def test_3d_positions_without_sections_are_refused() -> None:
    with pytest.raises(ValueError, match="mrope_section"):
        tiny_draft().rope(torch.zeros(3, 1, 4, dtype=torch.long), torch.float32)


def _recorded_positions(draft: Eagle3Draft, batch, ttt_length: int):  # type: ignore[no-untyped-def]
    seen: list[torch.Tensor] = []
    rope = draft.rope

    def spy(positions: torch.Tensor, dtype: torch.dtype):  # type: ignore[no-untyped-def]
        seen.append(positions.clone())
        return rope(positions, dtype)

    draft.rope = spy  # type: ignore[method-assign]
    stats = ttt_forward(draft, batch, ttt_length)
    return seen, stats


def test_ttt_step_i_rotates_every_component_by_pos_plus_i() -> None:
    draft = mrope_draft()
    batch = random_batch(draft.arch, seed=3, padded_row=1, real_length=12)
    positions_3BT = image_positions_3BT(2, 12)
    batch.position_ids_3BT = positions_3BT
    seen, _ = _recorded_positions(draft, batch, ttt_length=3)
    assert len(seen) == 3
    for step, positions in enumerate(seen):
        assert torch.equal(positions, positions_3BT + step)


def test_text_positions_as_three_rows_train_exactly_as_before() -> None:
    """A text-only batch through the M-RoPE path (equal rows) gives the text path's stats."""
    draft = mrope_draft()
    batch = random_batch(draft.arch, seed=4, padded_row=0, real_length=9)
    _, plain = _recorded_positions(draft, batch, ttt_length=3)
    batch.position_ids_3BT = torch.arange(12).expand(3, 2, 12)
    _, mrope = _recorded_positions(mrope_draft(), batch, ttt_length=3)
    torch.testing.assert_close(mrope.loss_sum_k, plain.loss_sum_k)
    assert torch.equal(mrope.num_correct_k, plain.num_correct_k)
