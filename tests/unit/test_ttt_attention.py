"""TTT attention (DESIGN.md, "Attention across TTT steps"): query (i, t) sees step-0 keys at
valid positions s <= t and the keys of steps 1..i at position t only."""

from __future__ import annotations

import math

import pytest
import torch

from eagleforge.draft.attention import eager_ttt_attention, ttt_attention_mask

pytestmark = pytest.mark.unit

# Row 0 has one padded position (t = 3); row 1 is fully valid.
VALID = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)

# [B, T, 3 * T]: step-0 block (causal & key valid) | step-1 block (identity) | step-2 block.
EXPECTED_MASK = [
    [
        [1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 1],
    ],
    [
        [1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0],
        [1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1],
    ],
]


def test_mask_three_steps_hand_written() -> None:
    """ttt_attention_mask(valid, 3) for T=4 equals the literal matrix above."""
    mask = ttt_attention_mask(VALID, 3)
    assert mask.dtype == torch.bool
    assert tuple(mask.shape) == (2, 4, 12)
    assert mask.int().tolist() == EXPECTED_MASK


def test_mask_one_step_is_causal_and_key_valid() -> None:
    """With a single step the mask is just the step-0 block."""
    mask = ttt_attention_mask(VALID, 1)
    assert mask.int().tolist() == [[row[:4] for row in rows] for rows in EXPECTED_MASK]


def test_mask_accepts_integer_valid() -> None:
    """A 0/1 integer attention mask gives the same boolean mask as a bool one."""
    assert torch.equal(ttt_attention_mask(VALID.long(), 3), ttt_attention_mask(VALID, 3))


def _loop_attention(q, keys, values, valid):  # type: ignore[no-untyped-def]
    """Per query: softmax over the allowed keys only, in float64."""
    batch, num_heads, seq, head_dim = q.shape
    num_kv = keys[0].shape[1]
    newest = len(keys) - 1
    out = torch.zeros(batch, seq, num_heads * head_dim, dtype=torch.float64)
    for b in range(batch):
        for n in range(num_heads):
            kv = n // (num_heads // num_kv)
            for t in range(seq):
                allowed = [(0, s) for s in range(t + 1) if valid[b, s]]
                allowed += [(j, t) for j in range(1, newest + 1)]
                query = q[b, n, t].double()
                scores = torch.stack(
                    [query @ keys[j][b, kv, s].double() / math.sqrt(head_dim) for j, s in allowed]
                )
                weights = torch.softmax(scores, dim=0)
                mixed = sum(
                    w * values[j][b, kv, s].double()
                    for w, (j, s) in zip(weights, allowed, strict=True)
                )
                out[b, t, n * head_dim : (n + 1) * head_dim] = mixed
    return out


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "num_steps"),
    [(2, 1, 1), (2, 1, 3), (4, 2, 3), (2, 2, 2)],
)
def test_eager_attention_equals_per_query_loop(
    num_heads: int, num_kv_heads: int, num_steps: int
) -> None:
    """eager_ttt_attention equals an explicit per-query softmax over the allowed keys (GQA: query
    head n reads kv head n // (N / K)); output layout [B, T, N*D]."""
    generator = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads + num_steps)
    batch, seq, head_dim = 2, 4, 8
    q = torch.randn(batch, num_heads, seq, head_dim, generator=generator)
    keys = [
        torch.randn(batch, num_kv_heads, seq, head_dim, generator=generator)
        for _ in range(num_steps)
    ]
    values = [
        torch.randn(batch, num_kv_heads, seq, head_dim, generator=generator)
        for _ in range(num_steps)
    ]
    got = eager_ttt_attention(q, keys, values, VALID)
    assert tuple(got.shape) == (batch, seq, num_heads * head_dim)
    expected = _loop_attention(q, keys, values, VALID)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


def test_eager_attention_ignores_masked_keys() -> None:
    """Changing a padded key/value or a future step-0 key leaves every query's output unchanged."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 4, 8, generator=generator)
    keys = [torch.randn(2, 1, 4, 8, generator=generator) for _ in range(3)]
    values = [torch.randn(2, 1, 4, 8, generator=generator) for _ in range(3)]
    reference = eager_ttt_attention(q, keys, values, VALID)

    keys2 = [k.clone() for k in keys]
    values2 = [v.clone() for v in values]
    keys2[0][0, :, 3] += 5.0  # padded step-0 key of row 0
    values2[0][0, :, 3] += 5.0
    torch.testing.assert_close(eager_ttt_attention(q, keys2, values2, VALID), reference)

    # Step-1 key at position 2 is visible only to query t = 2.
    values3 = [v.clone() for v in values]
    values3[1][:, :, 2] += 5.0
    changed = (eager_ttt_attention(q, keys, values3, VALID) - reference).abs().amax(dim=-1) > 1e-4
    assert changed.tolist() == [[False, False, True, False], [False, False, True, False]]
