"""Sampled verification: speculative rejection sampling of a draft's tokens against the
target's distribution p, so that every emitted token follows p exactly."""

from __future__ import annotations

import torch

# Shape suffix: V target vocab.


def accept_sampled(
    p_V: torch.Tensor, q_V: torch.Tensor, token: int, generator: torch.Generator
) -> tuple[bool, int]:
    """Speculative rejection sampling of ``token`` drawn from q: accept with min(1, p/q);
    otherwise (False, a token from norm(max(p - q, 0))). The emitted token follows p."""
    if _uniform(generator) * float(q_V[token]) < float(p_V[token]):
        return True, -1
    residual = (p_V - q_V).clamp_(min=0)
    return False, sample_index(residual if float(residual.sum()) > 0 else p_V, generator)


def accept_proposals(
    p_V: torch.Tensor, tokens: list[int], generator: torch.Generator
) -> tuple[int | None, int]:
    """Recursive rejection sampling of deterministic proposals (tree children, best first):
    accept each with probability r(t)/Σr on the residual r, which loses t's mass when t is
    rejected; if none is accepted, a token from the residual. The emitted token follows p."""
    residual = p_V.clone()
    for index, token in enumerate(tokens):
        if _uniform(generator) * float(residual.sum()) < float(residual[token]):
            return index, -1
        residual[token] = 0.0
    return None, sample_index(residual, generator)


def sample_index(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One index drawn with probability proportional to ``weights`` (need not sum to 1)."""
    weights = weights.float()
    return int(torch.multinomial(weights / weights.sum(), 1, generator=generator))


def _uniform(generator: torch.Generator) -> float:
    return float(torch.rand((), generator=generator, device=generator.device))
