"""Speculative decoding with a DFlash draft over an HF target, one prompt at a time: one draft
forward per round proposes a whole block.

State between rounds: the committed tokens x_0 … x_L, x_L the target's latest token (not yet
run through the target); the target's KV cache covers positions 0 … L-1, and so do the
draft's context keys and values (every layer's projection of the fused target states).

A round:
1. **Draft**: the block ``[x_L, MASK x n]`` at positions L … L+n, n = min(B-1,
   num_draft_tokens), attends to the context and to itself (``DFlashDraft.blocks``, as in
   training, where n = B-1; vLLM's query is the same block); slot k's distribution proposes
   the token at L+k -- its argmax, or a sample at the temperature.
2. **Verify** x_L and the proposals in one target forward; greedy accepts while the target's
   argmax equals the proposal; sampling accepts proposal d with probability min(1, p(d)/q(d))
   and otherwise draws from norm(max(p - q, 0)), so the output follows the target exactly.
   The round ends with one token of the target's (the bonus).
3. **Commit**: the target's cache keeps x_L and the accepted proposals; the draft's context
   grows by their target states.

τ counts the tokens a round commits (accepted proposals + the target's token), as for
EAGLE-3: ``decoder.py``'s round, result type, stopping rules and acceptance run both drafts.
"""

from __future__ import annotations

import torch

from eagleforge.draft.dflash import DFlashDraft
from eagleforge.speculative.config import DecodeSettings
from eagleforge.speculative.decoder import SpeculativeDecoder
from eagleforge.speculative.runners import PromptImages, RopePositions, TargetRunner
from eagleforge.speculative.sampling import sample_index
from eagleforge.speculative.tree import Node
from eagleforge.targets.hf import HFTarget

# Shape suffixes: L committed context, Q block slots, V target vocab, H hidden, A taps width.


class BlockContext:
    """The draft's context: every layer's keys and values of the committed positions."""

    def __init__(self, draft: DFlashDraft) -> None:
        self.draft = draft.eval()
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def length(self) -> int:
        return self.layers[0][0].shape[2] if self.layers else 0

    def reset(self) -> None:
        self.layers = []

    @torch.no_grad()
    def extend(self, aux_MA: torch.Tensor, positions_M: torch.Tensor) -> None:
        """Add committed positions by their target states."""
        new = self.draft.context_keys_values(self.draft.context(aux_MA[None]), positions_M[None])
        if not self.layers:
            self.layers = new
            return
        self.layers = [
            (torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2))
            for (k, v), (nk, nv) in zip(self.layers, new, strict=True)
        ]

    @torch.no_grad()
    def propose(self, token: int, position: int, num_proposals: int) -> torch.Tensor:
        """fp32 logits [num_proposals, V] of the block ``token`` and ``num_proposals`` mask
        tokens at ``position`` onwards, which sees the whole context and itself (vLLM's query:
        the bonus token and num_speculative_tokens masks)."""
        arch = self.draft.arch
        size = num_proposals + 1
        device = self.draft.fc.weight.device
        tokens = torch.full((1, size), arch.mask_token_id, dtype=torch.long, device=device)
        tokens[0, 0] = token
        positions = torch.arange(position, position + size, device=device)[None]
        mask = torch.ones(1, size, self.length + size, dtype=torch.bool, device=device)
        hidden = self.draft.blocks(self.layers, tokens, positions, mask)
        return self.draft.logits(hidden[0, 1:])


class BlockDecoder(SpeculativeDecoder):
    """Decodes one prompt at a time with a DFlash draft (see the module docstring). The round
    -- draft, verify, walk down the accepted proposals, commit -- and the target-alone and
    transformers baselines are ``SpeculativeDecoder``'s: the block's proposals are a chain of
    nodes, and what differs is the prefill, the drafting and the commit."""

    def __init__(
        self,
        target: HFTarget,
        draft: DFlashDraft,
        settings: DecodeSettings,
        eos_ids: set[int],
    ) -> None:
        # SpeculativeDecoder's target runner, stopping rules and baselines, not its EAGLE-3
        # draft runner (no super().__init__)
        self.target, self.context = TargetRunner(target), BlockContext(draft)
        self.rope = RopePositions()  # plain RoPE: DFlash refuses M-RoPE targets
        self.settings, self.eos_ids = settings, eos_ids
        self.num_proposals = min(draft.arch.block_size - 1, settings.num_draft_tokens)
        # no draft vocabulary: a proposal's id is its target id
        self.target_ids_W = torch.arange(draft.arch.vocab_size, device=self.target.device)

    @property
    def draft_passes_per_round(self) -> int:
        return 1  # one draft forward proposes the whole block

    def _prefill(
        self, prompt_ids: list[int], generator: torch.Generator, images: PromptImages | None
    ) -> tuple[int, torch.Tensor]:
        """The target over the prompt, the draft's context over its states: the target's
        first token x_L, twice (the next block starts from it)."""
        device = self.target.device
        self.target.reset()
        self.context.reset()
        positions = torch.arange(len(prompt_ids), device=device)
        logits, aux = self.target.forward(torch.tensor(prompt_ids, device=device), positions, None)
        self.context.extend(aux, positions)
        token = self._pick(logits[-1], generator)
        return token, torch.tensor(token)

    def _draft_tree(
        self, latest: torch.Tensor, length: int, generator: torch.Generator
    ) -> list[Node]:
        """The block ``[x_L, MASK x n]`` in one forward: slot k's argmax, or a sample at the
        temperature, proposes the token at L+k; a chain of n nodes."""
        logits = self.context.propose(int(latest), length, self.num_proposals)
        sampled = self.settings.temperature > 0
        log_q = torch.log_softmax(logits / self.settings.temperature if sampled else logits, -1)
        nodes: list[Node] = []
        for k, log_q_V in enumerate(log_q):
            probs = log_q_V.exp() if sampled else None
            token = sample_index(probs, generator) if probs is not None else int(log_q_V.argmax())
            score = float(log_q_V[token]) + (nodes[-1].score if nodes else 0.0)
            nodes.append(
                Node(token=token, parent=k - 1, depth=k + 1, score=score, draft_probs_W=probs)
            )
        return nodes

    def _commit(
        self, length: int, new_tokens: list[int], rows: list[int], aux: torch.Tensor
    ) -> torch.Tensor:
        """The target's cache keeps x_L and the accepted proposals (``rows`` of the
        verification); the draft's context grows by their states. Returns the bonus token."""
        device = self.target.device
        self.target.keep(length, rows)
        self.context.extend(aux[rows], torch.arange(length, length + len(rows), device=device))
        return torch.tensor(new_tokens[-1])
