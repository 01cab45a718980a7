"""The chunked lm_head + soft cross-entropy equals the plain autograd computation."""

from __future__ import annotations

import pytest
import torch

from eagleforge.draft.loss import chunked_soft_cross_entropy

pytestmark = pytest.mark.unit


def _inputs(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, 16, generator=generator, dtype=torch.float64).requires_grad_()
    weight = torch.randn(20, 16, generator=generator, dtype=torch.float64).requires_grad_()
    probs = torch.softmax(torch.randn(rows, 20, generator=generator, dtype=torch.float64), dim=-1)
    return hidden, weight, probs


def _plain(
    hidden: torch.Tensor, weight: torch.Tensor, probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = hidden @ weight.T
    return -(probs * torch.log_softmax(logits, dim=-1)).sum(), logits.argmax(dim=-1)


@pytest.mark.parametrize("chunk_size", [1, 7, 64])
def test_loss_argmax_and_gradients_match_plain(chunk_size: int) -> None:
    hidden, weight, probs = _inputs(37)
    loss, argmax = chunked_soft_cross_entropy(hidden, weight, probs, chunk_size)
    (loss * 0.3).backward()
    grads = hidden.grad.clone(), weight.grad.clone()  # type: ignore[union-attr]
    hidden.grad = weight.grad = None
    plain_loss, plain_argmax = _plain(hidden, weight, probs)
    (plain_loss * 0.3).backward()
    torch.testing.assert_close(loss.double(), plain_loss, rtol=1e-6, atol=1e-6)
    assert torch.equal(argmax, plain_argmax)
    torch.testing.assert_close(grads[0], hidden.grad, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(grads[1], weight.grad, rtol=1e-6, atol=1e-8)


def test_unnormalised_target_rows_get_the_exact_gradient() -> None:
    """Rows whose target mass is not 1 (e.g. all zero) still get d/dz = softmax*sum(p) - p."""
    hidden, weight, probs = _inputs(5, seed=1)
    probs = probs.clone()
    probs[2] = 0.0
    probs[3] *= 0.5
    loss, _ = chunked_soft_cross_entropy(hidden, weight, probs, 2)
    loss.backward()
    grad = hidden.grad.clone()  # type: ignore[union-attr]
    hidden.grad = None
    _plain(hidden, weight, probs)[0].backward()
    torch.testing.assert_close(grad, hidden.grad)


def test_no_grad_and_empty_rows() -> None:
    hidden, weight, probs = _inputs(9, seed=2)
    with torch.no_grad():
        loss, argmax = chunked_soft_cross_entropy(hidden, weight, probs, 4)
        plain_loss, plain_argmax = _plain(hidden, weight, probs)
    torch.testing.assert_close(loss.double(), plain_loss)
    assert torch.equal(argmax, plain_argmax) and not loss.requires_grad
    empty_loss, empty_argmax = chunked_soft_cross_entropy(hidden[:0], weight, probs[:0], 4)
    empty_loss.backward()
    assert float(empty_loss.detach()) == 0.0 and empty_argmax.numel() == 0
    assert weight.grad is not None and float(weight.grad.abs().sum()) == 0.0
