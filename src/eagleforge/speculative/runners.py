"""The target and the draft as the decoder drives them: each with its KV cache, fed new
positions after the cached ones, and the map from token indices to rotary positions.

Positions: the decoder counts tokens by index (0 = the prompt's first); ``RopePositions`` turns
indices into what the target and the draft rotate by. A text target rotates by the index
itself. A vision-language target (Qwen2-VL family, M-RoPE) prefills the prompt with its images
at the target's own 3-D positions (``get_rope_index``), and every later token -- committed or
drafted -- sits at index + delta on all three components, delta being the prompt's largest
position + 1 - its length, as Qwen2.5-VL's own generation continues after an image.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from eagleforge.draft.model import Eagle3Draft
from eagleforge.errors import ConfigError
from eagleforge.layers import skinny_linears
from eagleforge.targets.hf import HFTarget, kv_cache_argument

# Shape suffixes: M new positions, S key positions, V target vocab, W draft vocab,
# H draft hidden, A aux width, K kv heads, D head dim. Positions are [M] (plain RoPE) or
# [3, M] (M-RoPE: time, height, width); the runners add the batch dimension the models take.


@dataclass
class PromptImages:
    """A vision-language prompt's images as the target's image processor gives them."""

    pixel_values: torch.Tensor  # [patches, C*t*p*p]: all images of the prompt, in order
    image_grid_thw: torch.Tensor  # [images, 3]: each image's (time, height, width) patches


@dataclass
class RopePositions:
    """Maps the decoder's token indices after the prompt to rotary positions: [M] (the index)
    for plain RoPE; [3, M] (index + ``delta`` on every component) for M-RoPE."""

    mrope: bool = False
    # M-RoPE: the prompt's largest position + 1 - its length (negative after an image, whose
    # tokens share positions); text after the prompt continues from there.
    delta: int = 0

    def __call__(self, index_M: torch.Tensor) -> torch.Tensor:
        positions_M = index_M + self.delta
        return positions_M.expand(3, -1) if self.mrope else positions_M


class TargetRunner:
    """The HF target with a KV cache and its aux-layer capture."""

    def __init__(self, target: HFTarget) -> None:
        self.target = target
        self.device = target.model.device
        skinny_linears(target.model)  # a round's few verified tokens at one token's cost
        self.cache: Any = None
        self.forwards = 0
        self.cache_argument = kv_cache_argument(target.model)

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.target.config)
        self.forwards = 0

    @property
    def length(self) -> int:
        return int(self.cache.get_seq_length())

    def prompt_positions(
        self, prompt_M: torch.Tensor, images: PromptImages | None
    ) -> tuple[torch.Tensor, RopePositions]:
        """The prompt's positions ([M], or [3, M] for an M-RoPE target) and the map of the
        indices after it."""
        if not self.target.is_vlm:
            if images is not None:
                raise ConfigError(
                    f"the prompt has images but the target {type(self.target.model).__name__} "
                    "has no vision tower; evaluate a vision-language model (data.is_vlm=true)."
                )
            rope = RopePositions()
            return rope(torch.arange(len(prompt_M), device=self.device)), rope
        grid = None if images is None else images.image_grid_thw.to(self.device)
        positions_3BT, deltas_B1 = self.target.rope_index(prompt_M[None], None, grid)
        return positions_3BT[:, 0], RopePositions(mrope=True, delta=int(deltas_B1[0, 0]))

    @torch.no_grad()
    def forward(
        self,
        tokens_M: torch.Tensor,
        positions: torch.Tensor,
        tree_mask_MM: torch.Tensor | None,
        images: PromptImages | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 logits [M, V] and aux features [M, A] of new tokens after the cached ones, at
        ``positions`` ([M] or [3, M]); ``tree_mask_MM`` (True = may attend) replaces the
        causal mask among the new tokens; ``images`` go with the prefill of their prompt."""
        mask = None
        if tree_mask_MM is not None:
            past = self.length
            prefix = torch.ones(len(tokens_M), past, dtype=torch.bool, device=self.device)
            mask = torch.cat([prefix, tree_mask_MM], dim=1)[None, None]
        vision: dict[str, torch.Tensor] = {}
        if images is not None:
            vision = {
                "pixel_values": images.pixel_values.to(self.device, self.target.model.dtype),
                "image_grid_thw": images.image_grid_thw.to(self.device),
            }
        out = self.target.model(
            input_ids=tokens_M[None],
            position_ids=positions[..., None, :],
            attention_mask=mask,
            use_cache=True,
            **{self.cache_argument: self.cache},
            **vision,
        )
        aux = self.target.take_aux()
        self.forwards += 1
        return out.logits[0].float(), aux[0]

    def keep(self, prefix: int, rows: list[int]) -> None:
        """Keep cache entries [0, prefix) and then the given rows of the block after them. Only
        those rows move (a tree's accepted path); the prefix is cut to, never copied."""
        end = prefix + len(rows)
        moved = rows != list(range(len(rows)))
        index = torch.tensor([prefix + r for r in rows], device=self.device)
        for layer in self.cache.layers:
            if moved:  # index_select copies the rows before they are written over
                layer.keys[..., prefix:end, :] = layer.keys.index_select(-2, index)
                layer.values[..., prefix:end, :] = layer.values.index_select(-2, index)
            layer.keys = layer.keys[..., :end, :]
            layer.values = layer.values[..., :end, :]


class DraftRunner:
    """The draft with its KV cache of committed positions (step-0 style: real features).

    The cache is a buffer that doubles when full, so committing tokens copies only them and a
    draft step reads the cache in place: no per-step work grows with the sequence but the
    attention itself."""

    def __init__(self, draft: Eagle3Draft) -> None:
        self.draft = skinny_linears(draft.eval())
        self.buffer_k: torch.Tensor | None = None  # [1, K, capacity, D]
        self.buffer_v: torch.Tensor | None = None
        self.cached = 0  # committed positions in the buffers

    def reset(self) -> None:
        self.buffer_k = self.buffer_v = None
        self.cached = 0

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self.buffer_k is None else self.buffer_k[:, :, : self.cached]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.buffer_v is None else self.buffer_v[:, :, : self.cached]

    def _write(self, k: torch.Tensor, v: torch.Tensor) -> int:
        """Write the keys and values of new positions after the cached ones (growing the
        buffer, doubling, when full) without committing them; returns their end."""
        count = k.shape[2]
        if self.buffer_k is None or self.buffer_v is None:
            shape = (*k.shape[:2], max(256, 2 * count), k.shape[3])
            self.buffer_k, self.buffer_v = k.new_empty(shape), v.new_empty(shape)
        end = self.cached + count
        if end > self.buffer_k.shape[2]:
            shape = (*self.buffer_k.shape[:2], max(256, 2 * end), self.buffer_k.shape[3])
            grown_k, grown_v = self.buffer_k.new_empty(shape), self.buffer_v.new_empty(shape)
            grown_k[:, :, : self.cached] = self.buffer_k[:, :, : self.cached]
            grown_v[:, :, : self.cached] = self.buffer_v[:, :, : self.cached]
            self.buffer_k, self.buffer_v = grown_k, grown_v
        self.buffer_k[:, :, self.cached : end] = k
        self.buffer_v[:, :, self.cached : end] = v
        return end

    def attend(
        self,
        tokens_M: torch.Tensor,
        hidden_MH: torch.Tensor,
        positions: torch.Tensor,
        extra: tuple[torch.Tensor, torch.Tensor] | None,
        mask_MS: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One draft-layer pass of M positions (``positions`` [M] or [3, M], as the target's)
        over the cache, the ``extra`` keys and their own keys, with ``mask_MS`` over (extra +
        own) keys; the cache is visible to all. Returns the pre-norm outputs [M, H] and the new
        keys and values."""
        q, k, v = self.draft.layer_qkv(tokens_M[None], hidden_MH[None], positions[..., None, :])
        new_k = k if extra is None else torch.cat([extra[0], k], dim=2)
        new_v = v if extra is None else torch.cat([extra[1], v], dim=2)
        if self.cached:  # the committed cache is visible to every query
            # with the drafted keys appended in the buffer's spare room: no copy of the cache
            end = self._write(new_k, new_v)
            assert self.buffer_k is not None and self.buffer_v is not None
            all_k, all_v = self.buffer_k[:, :, :end], self.buffer_v[:, :, :end]
        else:
            all_k, all_v = new_k, new_v
        mask = None  # a chain step sees everything: SDPA's unmasked kernel
        if not bool(mask_MS.all()):
            visible = torch.ones(len(tokens_M), self.cached, dtype=torch.bool, device=q.device)
            mask = torch.cat([visible, mask_MS], dim=1)[None, None]
        out = torch.nn.functional.scaled_dot_product_attention(
            q, all_k, all_v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
        )
        out_MX = out.transpose(1, 2).flatten(2)
        return self.draft.layer_output(hidden_MH[None], out_MX)[0], k, v

    @torch.no_grad()
    def extend(
        self, tokens_M: torch.Tensor, features_MA: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Feed committed positions (token x_{t+1}, features f_t); returns outputs [M, H]."""
        hidden = self.draft.fuse(features_MA)
        causal = torch.ones(len(tokens_M), len(tokens_M), dtype=torch.bool).tril()
        out, k, v = self.attend(tokens_M, hidden, positions, None, causal.to(tokens_M.device))
        self.commit(k, v)
        return out

    def commit(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep the keys and values of the next positions in the cache."""
        self.cached = self._write(k, v)

    def log_probs(self, hidden_MH: torch.Tensor, temperature: float) -> torch.Tensor:
        """Draft log-probabilities [M, W] (at ``temperature``; 1 when 0: greedy ranks)."""
        logits = self.draft.lm_head(self.draft.head_input(hidden_MH)).float()
        return torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
