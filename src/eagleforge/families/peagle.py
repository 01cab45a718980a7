"""P-EAGLE: an EAGLE-3 draft that proposes all k tokens of a round in one forward, from
placeholder slots (``draft/peagle.py``, ``speculative/parallel_decoder.py``; vLLM serves it
as ``eagle3`` with ``parallel_drafting``; docs/peagle.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eagleforge.draft.attention import AttentionBackend
from eagleforge.draft.config import DraftConfig, DraftFamily
from eagleforge.draft.dflash import mask_token_for
from eagleforge.draft.loss import LossConfig
from eagleforge.draft.model import DraftArchitecture, Eagle3Draft
from eagleforge.draft.peagle import ParallelModule, PEagleDraft, depth_weights
from eagleforge.draft.ttt import TTTModule
from eagleforge.errors import ConfigError
from eagleforge.families.base import DraftInputs
from eagleforge.families.eagle3 import EAGLE3_FIELDS, Eagle3Family
from eagleforge.formats.config import DraftFormat
from eagleforge.parallel.usp import USPBackend
from eagleforge.speculative.config import DecodeSettings
from eagleforge.speculative.decoder import SpeculativeDecoder
from eagleforge.speculative.parallel_decoder import ParallelDecoder
from eagleforge.targets.hf import HFTarget

# EAGLE-3's layer fields but its unroll and its carried state, which parallel drafting has not
NOT_READ = ("draft.ttt_length", "draft.step_weight_decay", "draft.norm_output")


class PEagleFamily(Eagle3Family):
    name = DraftFamily.peagle
    title = "P-EAGLE"
    llamacpp_type: str | None = None
    positions = "depth (acc_0: the bonus slot)"
    reads: tuple[str, ...] = (
        *(f for f in EAGLE3_FIELDS if f not in NOT_READ),
        "draft.peagle",
    )
    docs = "docs/peagle.md"
    # the published 8 depths are sized for 8B targets on GPUs; a small target's file gives fewer
    model_defaults: tuple[str, ...] = ("num_depths",)
    draft_class: type[Eagle3Draft] = PEagleDraft

    def describe(self, draft: DraftConfig, loss: LossConfig) -> str:
        return f"P-EAGLE {draft.peagle.num_depths} depths, loss {loss.kind.value}"

    def architecture(self, cfg: DraftConfig, inputs: DraftInputs) -> DraftArchitecture:
        configured = cfg.peagle.mask_token_id
        if configured is None:
            configured = inputs.mask_token_id
        mask = mask_token_for(configured, inputs.tokenizer, "draft.peagle.mask_token_id")
        target = inputs.target
        vocab = target.config.get_text_config().vocab_size
        if not 0 <= mask < vocab:
            raise ConfigError(
                f"draft.peagle.mask_token_id={mask} is not a row of the target's embedding "
                f"(0..{vocab - 1}); choose an unused special token."
            )
        return DraftArchitecture.from_target(target.config, cfg, target.aux_layer_ids, mask)

    def unroll_length(self, cfg: DraftConfig) -> int:
        return cfg.peagle.num_depths

    def module(
        self,
        draft: Any,
        cfg: DraftConfig,
        attention: AttentionBackend | USPBackend,
        loss: LossConfig,
    ) -> TTTModule:
        return ParallelModule(draft, cfg.peagle.num_depths, attention, cfg.compile, loss)

    def loss_weights(self, cfg: DraftConfig, device: torch.device) -> torch.Tensor:
        return depth_weights(cfg.peagle, device)

    def decoder(
        self, target: HFTarget, draft: Any, settings: DecodeSettings, eos_ids: set[int]
    ) -> SpeculativeDecoder:
        return ParallelDecoder(target, draft, settings, eos_ids)

    def vllm_method(self, arch: Any, num_draft_tokens: int) -> dict[str, Any]:
        return {
            "method": "eagle3",
            "num_speculative_tokens": num_draft_tokens,
            "parallel_drafting": True,
        }

    def serve_hint(self, out: Path, fmt: DraftFormat, arch: Any) -> str:
        return (
            "vllm serve <target> --speculative-config "
            f'\'{{"method": "eagle3", "model": "{out}", "num_speculative_tokens": 3, '
            '"parallel_drafting": true}\''
        )
