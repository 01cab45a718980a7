"""flex TTT attention: forward equals eager on CPU (its backward is CUDA-only: tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from eagleforge.draft.attention import (
    AttentionBackend,
    FlexUnroll,
    eager_ttt_attention,
    flex_ttt_attention,
)
from eagleforge.draft.config import DraftConfig
from eagleforge.draft.ttt import ttt_forward
from eagleforge.errors import ConfigError
from helpers.drafts import random_batch, tiny_draft

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
    assert DraftConfig().attention_for(cpu) == AttentionBackend.auto  # measured per call kind
    assert DraftConfig().attention_for(cuda) == AttentionBackend.sdpa
    assert DraftConfig(attention=AttentionBackend.flex).attention_for(cuda) == AttentionBackend.flex
    with pytest.raises(ConfigError, match="draft.attention=flex trains on CUDA only"):
        DraftConfig(attention=AttentionBackend.flex).attention_for(cpu)
    assert DraftConfig(attention=AttentionBackend.sdpa).attention_for(cuda) == AttentionBackend.sdpa
    with pytest.raises(ConfigError, match="draft.attention=flash runs on CUDA only"):
        DraftConfig(attention=AttentionBackend.flash).attention_for(cpu)


@pytest.mark.parametrize("seq", [1, 10, 150])
@pytest.mark.parametrize("packed", [False, True])
def test_an_unroll_lays_keys_over_every_steps_slots_and_matches_eager(
    seq: int, packed: bool
) -> None:
    """Each step of a FlexUnroll sees only the steps so far, though its keys fill the slots of
    all steps (the later ones zero): equal to eager at every step, for one row, a row over a
    block of 128 and packed documents."""
    generator = torch.Generator().manual_seed(seq)
    batch, heads, kv_heads, dim, steps = 2, 4, 2, 8, 3
    valid = torch.ones(batch, seq, dtype=torch.bool)
    valid[1, max(1, seq * 2 // 3) :] = False
    documents = (torch.arange(seq) * 3 // max(seq, 1)).expand(batch, seq) if packed else None
    unroll = FlexUnroll(steps)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for _ in range(steps):
        q = torch.randn(batch, heads, seq, dim, generator=generator)
        keys.append(torch.randn(batch, kv_heads, seq, dim, generator=generator))
        values.append(torch.randn(batch, kv_heads, seq, dim, generator=generator))
        torch.testing.assert_close(
            unroll(q, keys, values, valid, documents),
            eager_ttt_attention(q, keys, values, valid, documents),
        )
    with pytest.raises(ValueError, match="step 4 of an unroll of 3 steps"):
        unroll(q, [*keys, keys[0]], [*values, values[0]], valid, documents)


def test_one_compiled_kernel_serves_every_step_and_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The TTT unroll with flex calls its kernel at one shape: compiled (here by a counting
    backend) once for all the steps of two batches -- not once per step of growing keys."""
    import torch.nn.attention.flex_attention as flex_module
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(flex_module.flex_attention, backend=counter, dynamic=False)
    monkeypatch.setattr(flex_module, "flex_attention", compiled)
    draft = tiny_draft()
    for seed in (0, 1):
        batch = random_batch(draft.arch, seed=seed, padded_row=1, real_length=9)
        with torch.no_grad():
            ttt_forward(draft, batch, 4, attention=AttentionBackend.flex)
    assert counter.frame_count == 1
