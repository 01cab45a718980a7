"""flex TTT attention: forward equals eager on CPU (its backward is CUDA-only: tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from eagleforge.draft.attention import AttentionBackend, eager_ttt_attention, flex_ttt_attention
from eagleforge.draft.config import DraftConfig
from eagleforge.errors import ConfigError

pytestmark = [
    pytest.mark.unit,
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
]


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (2, 2)])
def test_flex_forward_matches_eager(steps: int, heads: int, kv_heads: int) -> None:
    generator = torch.Generator().manual_seed(steps + heads)
    batch, seq, dim = 2, 10, 8
    valid = torch.ones(batch, seq, dtype=torch.bool)
    valid[1, 6:] = False
    q = torch.randn(batch, heads, seq, dim, generator=generator)
    keys = [torch.randn(batch, kv_heads, seq, dim, generator=generator) for _ in range(steps)]
    values = [torch.randn(batch, kv_heads, seq, dim, generator=generator) for _ in range(steps)]
    torch.testing.assert_close(
        flex_ttt_attention(q, keys, values, valid), eager_ttt_attention(q, keys, values, valid)
    )


def test_backend_choice_per_device() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert DraftConfig().attention_for(cpu) == AttentionBackend.sdpa
    assert DraftConfig().attention_for(cuda) == AttentionBackend.eager
    assert DraftConfig(attention=AttentionBackend.flex).attention_for(cuda) == AttentionBackend.flex
    with pytest.raises(ConfigError, match="draft.attention=flex trains on CUDA only"):
        DraftConfig(attention=AttentionBackend.flex).attention_for(cpu)
    assert DraftConfig(attention=AttentionBackend.sdpa).attention_for(cuda) == AttentionBackend.sdpa
    with pytest.raises(ConfigError, match="draft.attention=flash runs on CUDA only"):
        DraftConfig(attention=AttentionBackend.flash).attention_for(cpu)
