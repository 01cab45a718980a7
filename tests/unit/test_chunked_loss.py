"""The chunked lm_head + soft cross-entropy equals the plain autograd computation."""

from __future__ import annotations

import pytest
import torch

from eagleforge.batch import rows_per_chunk
from eagleforge.draft.loss import soft_cross_entropy

pytestmark = pytest.mark.unit


def _inputs(
    rows: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [rows, 16], weight [20, 16], a teacher table [rows + 5, 20] read through
    shuffled, repeating row indices, and a different scale per row."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, 16, generator=generator, dtype=torch.float64).requires_grad_()
    weight = torch.randn(20, 16, generator=generator, dtype=torch.float64).requires_grad_()
    teacher = torch.softmax(
        torch.randn(rows + 5, 20, generator=generator, dtype=torch.float64), dim=-1
    )
    teacher_rows = torch.randint(0, rows + 5, (rows,), generator=generator)
    scale = torch.rand(rows, generator=generator, dtype=torch.float64)
    return hidden, weight, teacher, teacher_rows, scale


def _plain(
    hidden: torch.Tensor, weight: torch.Tensor, probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = hidden @ weight.T
    return -(probs * torch.log_softmax(logits, dim=-1)).sum(-1), logits.argmax(dim=-1)


@pytest.mark.parametrize("chunk_size", [1, 7, 64])
def test_loss_argmax_and_gradients_match_plain(chunk_size: int) -> None:
    hidden, weight, teacher, rows, scale = _inputs(37)
    weighted, loss_n, argmax = soft_cross_entropy(hidden, weight, teacher, rows, scale, chunk_size)
    (weighted * 0.3).backward()
    grads = hidden.grad.clone(), weight.grad.clone()  # type: ignore[union-attr]
    hidden.grad = weight.grad = None
    plain_loss_n, plain_argmax = _plain(hidden, weight, teacher[rows])
    plain_weighted = (plain_loss_n * scale).sum()
    (plain_weighted * 0.3).backward()
    torch.testing.assert_close(weighted, plain_weighted, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss_n, plain_loss_n.detach(), rtol=1e-6, atol=1e-6)
    assert torch.equal(argmax, plain_argmax) and not loss_n.requires_grad
    torch.testing.assert_close(grads[0], hidden.grad, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(grads[1], weight.grad, rtol=1e-6, atol=1e-8)


def test_unnormalised_target_rows_get_the_exact_gradient() -> None:
    """Rows whose target mass is not 1 (e.g. all zero) still get d/dz = softmax*sum(p) - p."""
    hidden, weight, teacher, _, scale = _inputs(5, seed=1)
    teacher = teacher.clone()
    teacher[2] = 0.0
    teacher[3] *= 0.5
    rows = torch.arange(5)
    soft_cross_entropy(hidden, weight, teacher, rows, scale, 2)[0].backward()
    grad = hidden.grad.clone()  # type: ignore[union-attr]
    hidden.grad = None
    (_plain(hidden, weight, teacher[:5])[0] * scale).sum().backward()
    torch.testing.assert_close(grad, hidden.grad)


def test_no_grad_still_gives_values_and_empty_rows_give_zero() -> None:
    hidden, weight, teacher, rows, scale = _inputs(9, seed=2)
    with torch.no_grad():
        weighted, loss_n, argmax = soft_cross_entropy(hidden, weight, teacher, rows, scale, 4)
        plain_loss_n, plain_argmax = _plain(hidden, weight, teacher[rows])
    torch.testing.assert_close(loss_n, plain_loss_n)
    torch.testing.assert_close(weighted, (plain_loss_n * scale).sum())
    assert torch.equal(argmax, plain_argmax) and not weighted.requires_grad
    empty, empty_loss_n, empty_argmax = soft_cross_entropy(
        hidden[:0], weight, teacher, rows[:0], scale[:0], 4
    )
    empty.backward()
    assert float(empty.detach()) == 0.0 and empty_loss_n.numel() == empty_argmax.numel() == 0
    assert weight.grad is not None and float(weight.grad.abs().sum()) == 0.0


def test_backward_without_scales_says_what_is_missing() -> None:
    hidden, weight, teacher, rows, _ = _inputs(4, seed=3)
    weighted, _, _ = soft_cross_entropy(hidden, weight, teacher, rows)
    with pytest.raises(RuntimeError, match="give scale_n"):
        weighted.backward()


def test_chunks_are_sized_by_memory() -> None:
    assert rows_per_chunk(8000) == 1048
    assert rows_per_chunk(32000) == 262
    assert rows_per_chunk(10**9) == 16
    assert rows_per_chunk(8000, 16 * 2**20, 256) == 524
    assert rows_per_chunk(128256, 16 * 2**20, 256) == 256
