"""draft.compile=true: the torch.compile'd draft step gives the same loss and gradients (CPU)."""

from __future__ import annotations

import pytest
import torch

from eagleforge.draft.attention import AttentionBackend
from eagleforge.draft.ttt import (
    count_positions,
    loss_scales,
    step_weights,
    ttt_forward,
)
from helpers.drafts import random_batch, tiny_draft

pytestmark = pytest.mark.integration


def test_compiled_step_matches_eager_mode() -> None:
    draft = tiny_draft()
    steps = 2
    data = random_batch(draft.arch, seed=0, padded_row=1, real_length=9)
    results = []
    for compile_ in (False, True):
        draft.zero_grad(set_to_none=True)
        scale_k = loss_scales(count_positions(data, steps), step_weights(steps, 0.8))
        stats = ttt_forward(
            draft, data, steps, scale_k, attention=AttentionBackend.sdpa, compile=compile_
        )
        stats.loss.backward()
        results.append(
            (
                stats.loss_sum_k.detach(),
                draft.fc.weight.grad.clone(),
                draft.lm_head.weight.grad.clone(),
            )
        )
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_the_layer_compiles_once_for_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regional compilation: the layer's two regions compile once each (here by a counting
    backend), and every TTT step of every batch of that length reuses them."""
    from torch._dynamo.testing import CompileCounterWithBackend

    import eagleforge.draft.ttt as ttt

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    regions = (
        torch.compile(ttt._layer_qkv, backend=counter),
        torch.compile(ttt._layer_output, backend=counter),
    )
    monkeypatch.setattr(ttt, "compiled_layer", lambda: regions)
    draft = tiny_draft()
    steps = 4
    for seed in (0, 1):
        data = random_batch(draft.arch, seed=seed, padded_row=1, real_length=9)
        draft.zero_grad(set_to_none=True)
        scale_k = loss_scales(count_positions(data, steps), step_weights(steps, 0.8))
        stats = ttt_forward(
            draft, data, steps, scale_k, attention=AttentionBackend.sdpa, compile=True
        )
        stats.loss.backward()
    assert counter.frame_count == 2
