"""P-EAGLE: an EAGLE-3 draft that proposes all k tokens in one forward (vLLM's
``parallel_drafting``; docs/peagle.md).

At serving time the draft's forward holds the newly accepted tokens with the target's states,
then the bonus token (depth 0, as EAGLE-3's first step), then k-1 placeholder slots: the mask
token's embedding with the learned features ``mask_hidden`` [1, 1, 3 x target hidden] (through
the same norms and ``fc`` as the target's states), at the positions that follow. Each slot
attends causally: to the context and to the slots before it. Training is EAGLE-3's unrolled
test with its later steps reading those placeholders (``ttt_forward``'s ``later_inputs``):
depth d at position t attends to step 0's keys up to t and to its own chain's depths up to
d, at RoPE position t + d, and is taught the target's distribution there, exactly the view
vLLM's slot d has. Every position trains every depth (the published trainers sample a
shrinking subset per depth, r^d with a floor; the same expected weights are used here as
loss weights, ``depth_weights``, normalised over the step as one mean).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from eagleforge.draft.attention import AttentionBackend
from eagleforge.draft.loss import LossConfig
from eagleforge.draft.model import DraftArchitecture, Eagle3Draft
from eagleforge.draft.ttt import LaterInputs, TTTModule, UnrollAttention
from eagleforge.errors import ConfigError


@dataclass
class PEagleConfig:
    """``draft.peagle``: the parallel depths of a P-EAGLE draft (``draft.family=peagle``); the
    draft's layer and vocabulary are EAGLE-3's ``draft.*`` fields."""

    # Depths trained k: the draft proposes up to k tokens per round (vLLM's
    # num_speculative_tokens at most k). The published recipes train 8; draft=peagle takes a
    # model file's model.draft_defaults.peagle.num_depths instead, where it gives one (what
    # fits a small target).
    num_depths: int = 8
    # Loss weight of depth d: max(depth_decay ** d, min_depth_weight) -- the share of
    # positions the published trainers keep at depth d (0.7 and 0.2 there).
    depth_decay: float = 0.7
    min_depth_weight: float = 0.2
    # The placeholder token of the slots to propose; null = model.mask_token_id, else the
    # tokenizer's mask token.
    mask_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.num_depths < 1:
            raise ConfigError(f"draft.peagle.num_depths must be >= 1, got {self.num_depths}.")
        if not 0.0 < self.depth_decay <= 1.0:
            raise ConfigError(
                f"draft.peagle.depth_decay must be in (0, 1], got {self.depth_decay}."
            )
        if not 0.0 <= self.min_depth_weight <= 1.0:
            raise ConfigError(
                f"draft.peagle.min_depth_weight must be in [0, 1], got {self.min_depth_weight}."
            )


def depth_weights(cfg: PEagleConfig, device: torch.device | None = None) -> torch.Tensor:
    """max(decay ** d, floor) for d = 0 .. k-1 (depth 0: 1)."""
    decay = cfg.depth_decay ** torch.arange(cfg.num_depths, dtype=torch.float32, device=device)
    return decay.clamp(min=cfg.min_depth_weight)


def depth_loss_scales(global_counts_k: torch.Tensor, weights_k: torch.Tensor) -> torch.Tensor:
    """scale_d = w_d / Σ_j w_j N_j: one weighted mean over every supervised element of the
    step (the published trainers' mean over the sampled elements, in expectation)."""
    total = (weights_k * global_counts_k.to(weights_k.dtype)).sum().clamp(min=1e-12)
    return weights_k / total


class PEagleDraft(Eagle3Draft):
    """An EAGLE-3 draft with the placeholder features of its parallel slots."""

    def __init__(self, arch: DraftArchitecture, recompute_mlp: bool = False) -> None:
        if arch.mask_token_id is None:
            raise ValueError("a P-EAGLE draft's architecture names its mask token")
        super().__init__(arch, recompute_mlp)
        self.mask_hidden = nn.Parameter(torch.zeros(1, 1, 3 * arch.target_hidden_size))

    def init_weights(self, std: float, generator: torch.Generator | None = None) -> None:
        """EAGLE-3's init; ``mask_hidden`` normal(0, 1), as the target's states are scaled."""
        super().init_weights(std, generator)
        with torch.no_grad():
            values = torch.randn(self.mask_hidden.shape, generator=generator)
            self.mask_hidden.copy_(values.to(self.mask_hidden.dtype))

    def placeholders(self, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The token ids [B, T] and hidden states [B, T, H] of the slots to propose."""
        assert self.arch.mask_token_id is not None
        hidden_H = self.fuse(self.mask_hidden)[0, 0]
        ids = torch.full(
            (batch, length), self.arch.mask_token_id, dtype=torch.long, device=hidden_H.device
        )
        return ids, hidden_H.expand(batch, length, -1)


class ParallelModule(TTTModule):
    """The unrolled test whose later steps read the placeholders (see the module docstring)."""

    draft: PEagleDraft

    def __init__(
        self,
        draft: PEagleDraft,
        num_depths: int,
        attention: AttentionBackend | UnrollAttention,
        compile: bool = False,
        loss: LossConfig | None = None,
    ) -> None:
        super().__init__(draft, num_depths, attention, compile, loss)

    def later_inputs(self) -> LaterInputs:
        return self.draft.placeholders

    @staticmethod
    def loss_scales(global_counts_k: torch.Tensor, weights_k: torch.Tensor) -> torch.Tensor:
        return depth_loss_scales(global_counts_k, weights_k)
