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
EAGLE-3 (``decoder.py``, whose result type, stopping rules and sampling this shares).
"""

from __future__ import annotations

import time

import torch

from eagleforge.draft.dflash import DFlashDraft
from eagleforge.speculative.config import DecodeSettings
from eagleforge.speculative.decoder import DecodeResult, SpeculativeDecoder, _lap
from eagleforge.speculative.runners import PromptImages, RopePositions, TargetRunner
from eagleforge.speculative.sampling import accept_sampled, sample_index
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
    """Decodes one prompt at a time with a DFlash draft (see the module docstring); the
    target-alone and transformers baselines are ``SpeculativeDecoder``'s."""

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
        self.rope = RopePositions()
        self.settings, self.eos_ids = settings, eos_ids
        self.num_proposals = min(draft.arch.block_size - 1, settings.num_draft_tokens)

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[int],
        generator: torch.Generator,
        images: PromptImages | None = None,
    ) -> DecodeResult:
        start = time.perf_counter()
        parts = dict.fromkeys(("prefill", "draft", "verify", "commit"), 0.0)
        device = self.target.device
        self.target.reset()
        self.context.reset()
        prompt = torch.tensor(prompt_ids, device=device)
        logits, aux = self.target.forward(
            prompt, torch.arange(len(prompt_ids), device=device), None
        )
        token = self._pick(logits[-1], generator)
        self.context.extend(aux, torch.arange(len(prompt_ids), device=device))
        output, accepted_lengths = [token], []
        clock = _lap(parts, "prefill", start)
        while not self._done(output):
            length = len(prompt_ids) + len(output) - 1  # L: position of the latest token
            proposals, draft_probs = self._propose(token, length, generator)
            clock = _lap(parts, "draft", clock)
            verified = torch.tensor([token, *proposals], device=device)
            logits, aux = self.target.forward(
                verified, torch.arange(length, length + len(verified), device=device), None
            )
            clock = _lap(parts, "verify", clock)
            accepted, bonus = self._accept_chain(logits, proposals, draft_probs, generator)
            accepted_lengths.append(accepted)
            self.target.keep(length, list(range(accepted + 1)))
            self.context.extend(
                aux[: accepted + 1], torch.arange(length, length + accepted + 1, device=device)
            )
            new_tokens = [*proposals[:accepted], bonus]
            output.extend(new_tokens)
            token = bonus
            clock = _lap(parts, "commit", clock)
        return DecodeResult(
            output_ids=self._trim(output),
            seconds=time.perf_counter() - start,
            target_forwards=self.target.forwards,
            accepted_lengths=accepted_lengths,
            seconds_by_part=parts,
            draft_steps=len(accepted_lengths),  # one draft forward per round
        )

    def _propose(
        self, token: int, length: int, generator: torch.Generator
    ) -> tuple[list[int], torch.Tensor | None]:
        """The verified proposals, and their draft distributions [n, V] when sampling."""
        logits = self.context.propose(token, length, self.num_proposals)
        if self.settings.temperature == 0:
            return logits.argmax(-1).tolist(), None
        probs = torch.softmax(logits / self.settings.temperature, dim=-1)
        return [sample_index(p, generator) for p in probs], probs

    def _accept_chain(
        self,
        logits_MV: torch.Tensor,
        proposals: list[int],
        draft_probs: torch.Tensor | None,
        generator: torch.Generator,
    ) -> tuple[int, int]:
        """How many proposals the target accepts, and its own token after them."""
        for i, proposal in enumerate(proposals):
            if draft_probs is None:
                best = int(logits_MV[i].argmax())
                if best != proposal:
                    return i, best
                continue
            p = self._target_probs(logits_MV[i])
            accepted, bonus = accept_sampled(p, draft_probs[i].to(p.dtype), proposal, generator)
            if not accepted:
                return i, bonus
        return len(proposals), self._pick(logits_MV[len(proposals)], generator)


def decoder_for(
    target: HFTarget,
    draft: object,
    settings: DecodeSettings,
    eos_ids: set[int],
) -> SpeculativeDecoder:
    """Our decoder for a draft of either family."""
    if isinstance(draft, DFlashDraft):
        return BlockDecoder(target, draft, settings, eos_ids)
    return SpeculativeDecoder(target, draft, settings, eos_ids)  # type: ignore[arg-type]
