"""Speculative decoding with a parallel-drafting draft (P-EAGLE): one draft forward per round
proposes the whole chain, as vLLM's ``parallel_drafting`` runs it.

The forward holds the round's newly accepted tokens with the target's states (committed to the
draft's cache, as EAGLE-3's commit does), then n-1 placeholder slots (the mask token with the
draft's ``mask_hidden`` features) at the positions that follow, causally masked. The output
at the last accepted token proposes depth 1 (EAGLE-3's first step); the output at slot i
proposes depth i+1. The slots' keys are never committed: the next round's forward starts at
its first new token and overwrites them. Verification, acceptance and the baselines are
``SpeculativeDecoder``'s (a chain; trees are refused, as vLLM drafts chains here).
"""

from __future__ import annotations

import torch

from eagleforge.draft.peagle import PEagleDraft
from eagleforge.errors import ConfigError
from eagleforge.speculative.config import DecodeSettings
from eagleforge.speculative.decoder import SpeculativeDecoder
from eagleforge.speculative.tree import Node
from eagleforge.targets.hf import HFTarget


class ParallelDecoder(SpeculativeDecoder):
    """Decodes one prompt at a time with a draft that has ``placeholders`` (see above)."""

    def __init__(
        self,
        target: HFTarget,
        draft: PEagleDraft,
        settings: DecodeSettings,
        eos_ids: set[int],
    ) -> None:
        if settings.topk > 1:
            raise ConfigError(
                f"eval setting {settings.label}: a parallel-drafting draft proposes one chain "
                "(a token per slot); use chains, e.g. eval.sweep=[3/1/4,5/1/6]."
            )
        if target.is_vlm:
            raise ConfigError(
                "a parallel-drafting draft decodes text targets (vLLM refuses M-RoPE drafts "
                "for parallel drafting); evaluate it on a text target."
            )
        super().__init__(target, draft, settings, eos_ids)
        self.parallel_draft = draft
        self.num_slots = settings.num_draft_tokens - 1
        self.proposing = torch.empty(0)  # [n, H]: outputs that propose depths 1 .. n

    @property
    def draft_passes_per_round(self) -> int:
        return 1

    def _extend_draft(
        self, tokens_M: torch.Tensor, aux_MA: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """One draft forward over the M committed pairs and the placeholder slots after them
        (causal); commits the M pairs' keys only. Its outputs from the last pair on propose
        depths 1 .. n; returns the first of them."""
        runner, draft = self.draft, self.parallel_draft
        ids, hidden = draft.placeholders(1, self.num_slots)
        tokens = torch.cat([tokens_M, ids[0].to(tokens_M.device)])
        hidden_MH = torch.cat([draft.fuse(aux_MA), hidden[0]])
        slots = positions[-1] + torch.arange(1, self.num_slots + 1, device=positions.device)
        count = len(tokens)
        causal = torch.ones(count, count, dtype=torch.bool, device=tokens.device).tril()
        out, k, v = runner.attend(tokens, hidden_MH, torch.cat([positions, slots]), None, causal)
        runner.commit(k[:, :, : len(tokens_M)], v[:, :, : len(tokens_M)])
        self.proposing = out[len(tokens_M) - 1 :]
        return self.proposing[0]

    def _draft_tree(
        self, root_hidden: torch.Tensor, length: int, generator: torch.Generator
    ) -> list[Node]:
        """The chain the last forward proposed: depth d from output d-1."""
        nodes: list[Node] = []
        for depth in range(1, self.settings.num_draft_tokens + 1):
            parent = len(nodes) - 1
            score = nodes[-1].score if nodes else 0.0
            hidden = self.proposing[depth - 1]
            nodes.extend(self._children(parent, score, hidden, depth, generator))
        return nodes
