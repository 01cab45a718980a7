"""The target boundary: what a backend returns (``TargetOutput``), what every backend offers
(``TargetBackend``, all that training, ``prepare``, ``evaluate`` and the teacher call on one),
and the forward of a tensor-parallel group that the backends share (``forward_over_group``).

Shape suffixes: B batch, T sequence, H target hidden, A = 3H (the three aux states), V target
vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from eagleforge.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class TargetOutput:
    """One target forward. Shape suffixes: B batch, T sequence, H target hidden."""

    aux_BTA: torch.Tensor  # concat of the three aux layer outputs, [B, T, 3H]
    final_hidden_BTH: torch.Tensor  # after the final norm, input of the lm_head
    # A vision-language target's M-RoPE positions [3, B, T] (time, height, width), which
    # the draft rotates by too; None for text-only targets.
    position_ids_3BT: torch.Tensor | None = None


class TargetBackend(Protocol):
    """A frozen target as the trainer, ``prepare``, ``evaluate`` and the teacher use it
    (``HFTarget``, ``CustomTarget``, ``SGLangTarget``, and ``HeadOnlyTarget`` offline)."""

    aux_layer_ids: list[int]  # output-of-layer ids of the captured aux states
    config: Any  # the target's transformers config (PretrainedConfig)
    # forward waits on an engine in another process: ``prepare`` sends the next batch while
    # it stores this one's states (in this process, the two would share its cores and memory)
    forward_in_engine: bool

    def forward(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor,
        document_ids_BT: torch.Tensor | None = None,
        position_ids_BT: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Aux and final hidden states of a right-padded batch; packed rows carry
        ``document_ids_BT`` (and per-document ``position_ids_BT``). The images of a
        vision-language batch (``batch.IMAGE_KEYS``) come as keywords; a backend without a
        vision tower refuses them."""
        ...

    def input_embedding(self) -> torch.Tensor:
        """The whole input embedding [V, H] (gathered when the target is sharded)."""
        ...

    def lm_head_weight(self) -> torch.Tensor:
        """The whole lm_head [V, H] the teacher is computed through (the embedding if tied)."""
        ...

    def final_norm_weight(self) -> torch.Tensor | None:
        """The gain [H] of the RMSNorm before the lm_head; None where the backend cannot
        reach it (``draft.init=logit_lens`` starts the draft from it)."""
        ...

    def packing_blocker(self) -> str | None:
        """Why this target cannot run packed rows (several documents per row), or None."""
        ...


def release(target: object) -> None:
    """Call ``close()`` where it exists: what a backend, or what holds one, runs outside this
    process (target=vllm: its engine) stops."""
    close = getattr(target, "close", None)
    if close is not None:
        close()


def refuse_images(
    backend: str, pixel_values: torch.Tensor | None, image_grid_thw: torch.Tensor | None
) -> None:
    """A text-only backend's answer to a vision-language batch: one ConfigError."""
    if pixel_values is not None or image_grid_thw is not None:
        raise ConfigError(
            f"target={backend} runs text-only targets; a vision-language batch "
            "(data.is_vlm=true) runs with target=hf."
        )


def forward_over_group(
    tp_mesh: DeviceMesh | None,
    forward: Callable[..., TargetOutput],
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    document_ids_BT: torch.Tensor | None,
    position_ids_BT: torch.Tensor | None,
) -> TargetOutput:
    """``forward`` on this rank's batch, or, with a tp mesh, once on the tp group's batches
    together (a collective: every tp rank calls it in step), each rank keeping its own rows."""
    batch = (input_ids_BT, attention_mask_BT, document_ids_BT, position_ids_BT)
    if tp_mesh is None:
        return forward(*batch)
    from eagleforge.parallel.tp import gather_group_batch

    group = gather_group_batch(tp_mesh, *batch)
    out = forward(
        group.input_ids_BT, group.attention_mask_BT, group.document_ids_BT, group.position_ids_BT
    )
    return TargetOutput(group.own(out.aux_BTA), group.own(out.final_hidden_BTH))
