"""Target backends: the frozen LLM whose hidden states feed the draft and whose distribution it learns.

A backend turns a batch of token ids into the three aux hidden states and the final (normed)
hidden state; the teacher is then computed through the target's lm_head (``teacher.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import torch


class TargetBackendKind(str, Enum):
    hf = "hf"  # transformers, in-process


@dataclass
class TargetConfig:
    """The `target` config section: how the frozen target runs."""

    # Backend that runs the target forward.
    backend: TargetBackendKind = TargetBackendKind.hf
    # transformers attention implementation of the target (sdpa | eager | flash_attention_2).
    attn_implementation: str = "sdpa"
    # Positions per chunk when computing the teacher through the lm_head (bounds the [chunk, V]
    # fp32 logits); null = as many as fit in 32 MiB (262 for a 32k vocab, 65 for 128k).
    teacher_chunk_size: int | None = None

    def supports_packing(self) -> bool:
        """Packed rows need a block-diagonal mask, which these attention implementations take."""
        return self.backend == TargetBackendKind.hf and self.attn_implementation in (
            "sdpa",
            "eager",
        )


@dataclass
class TargetOutput:
    """One target forward. Shape suffixes: B batch, T sequence, H target hidden."""

    aux_BTA: torch.Tensor  # concat of the three aux layer outputs, [B, T, 3H]
    final_hidden_BTH: torch.Tensor  # after the final norm, input of the lm_head


class TargetBackend(Protocol):
    aux_layer_ids: list[int]

    def forward(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor,
        document_ids_BT: torch.Tensor | None = None,
        position_ids_BT: torch.Tensor | None = None,
    ) -> TargetOutput: ...

    def input_embedding(self) -> torch.Tensor: ...

    def lm_head_weight(self) -> torch.Tensor: ...
