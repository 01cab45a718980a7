"""DFlash: a few Qwen3-style layers that propose a block per forward, the target's tapped
states injected as keys and values, trained with slot-weighted cross-entropy against the
target's tokens (``draft/dflash.py``; docs/dflash.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eagleforge.batch import BlockBatch
from eagleforge.checkpoint import load_draft_weights
from eagleforge.draft.config import DraftConfig, DraftFamily
from eagleforge.draft.dflash import (
    BlockModule,
    DFlashArchitecture,
    DFlashDraft,
    anchor_candidates,
    block_weights,
    check_block_fits,
    mask_token_for,
    select_anchors,
)
from eagleforge.draft.loss import LossConfig
from eagleforge.errors import ConfigError
from eagleforge.families.base import DraftInputs, MakeBatch, init_from
from eagleforge.formats.config import DraftFormat
from eagleforge.parallel.usp import SequenceParallel
from eagleforge.speculative.block_decoder import BlockDecoder
from eagleforge.speculative.config import DecodeSettings
from eagleforge.speculative.decoder import SpeculativeDecoder
from eagleforge.targets.base import TargetBackend
from eagleforge.targets.hf import HFTarget
from eagleforge.targets.teacher import block_batch


class DFlashFamily:
    name = DraftFamily.dflash
    title = "DFlash"
    llamacpp_type: str | None = "draft-dflash"
    positions = "block slot (acc_0: slot 1)"
    # its own section, the shared init std, and the vocabulary every model file sets (a DFlash
    # draft's config.json records its true vocabulary: the target's)
    reads: tuple[str, ...] = ("draft.dflash", "draft.init_std", "draft.draft_vocab_size")
    reads_loss = False  # slot-weighted cross-entropy against the target's tokens
    docs = "docs/dflash.md"
    # the published shape (5 layers, blocks of 16, 512 anchors) costs a 135M target on a
    # CPU minutes a step and GBs of logits
    model_defaults: tuple[str, ...] = ("num_layers", "block_size", "num_anchors")

    def describe(self, draft: DraftConfig, loss: LossConfig) -> str:
        cfg = draft.dflash
        return f"DFlash {cfg.num_layers} layers, block {cfg.block_size}, cross-entropy"

    def build(self, cfg: DraftConfig, inputs: DraftInputs) -> DFlashDraft:
        """Tapping the run's aux layers, reading the target's embedding and lm_head."""
        target, dflash = inputs.target, cfg.dflash
        configured = (
            dflash.mask_token_id if dflash.mask_token_id is not None else inputs.mask_token_id
        )
        mask = mask_token_for(configured, inputs.tokenizer)
        arch = DFlashArchitecture.from_target(target.config, dflash, target.aux_layer_ids, mask)
        check_block_fits(arch, inputs.max_length)
        draft = DFlashDraft(arch)
        draft.init_weights(cfg.init_std, torch.Generator().manual_seed(inputs.seed))
        if inputs.draft_init:
            init_from(draft, self.name, inputs.draft_init, arch.num_target_layers)
        draft.to(inputs.device)
        draft.set_target_weights(target.input_embedding(), target.lm_head_weight())
        return draft

    def load(
        self,
        arch: Any,
        tensors: dict[str, torch.Tensor],
        target: HFTarget,
        path: Path,
        device: torch.device,
    ) -> DFlashDraft:
        draft = DFlashDraft(arch)
        load_draft_weights(draft, tensors, path)
        draft.to(device)
        draft.set_target_weights(target.input_embedding(), target.lm_head_weight())
        return draft.eval()

    def training_module(
        self,
        draft: Any,
        cfg: DraftConfig,
        loss: LossConfig,
        device: torch.device,
        sp: SequenceParallel,
    ) -> BlockModule:
        if sp.size > 1:
            raise ConfigError(
                "draft.family=dflash does not train sequence-parallel; set parallel.sp_ulysses "
                "and parallel.sp_ring to 1."
            )
        return BlockModule(draft)

    def batches(
        self,
        draft: Any,
        cfg: DraftConfig,
        target: TargetBackend,
        sp: SequenceParallel,
        seed: int,
        teacher_chunk_size: int | None,
    ) -> MakeBatch:
        """Anchors drawn with the run's RNG in training (its state is in every checkpoint, so
        a resumed run draws the same), and the same ones at every evaluation (a generator
        seeded from the run's seed and the batch's tokens)."""
        num_anchors = cfg.dflash.num_anchors

        def make(batch: dict[str, torch.Tensor], train: bool) -> BlockBatch:
            out = block_batch(target, batch)
            generator = None
            if not train:
                generator = torch.Generator().manual_seed(
                    seed * 1_000_003 + int(out.input_ids_BT.sum())
                )
            out.anchors_BN = select_anchors(anchor_candidates(out), num_anchors, generator)
            return out

        return make

    def loss_weights(self, cfg: DraftConfig, device: torch.device) -> torch.Tensor:
        return block_weights(cfg.dflash.block_size, cfg.dflash.gamma, device)

    def decoder(
        self, target: HFTarget, draft: Any, settings: DecodeSettings, eos_ids: set[int]
    ) -> SpeculativeDecoder:
        return BlockDecoder(target, draft, settings, eos_ids)

    def proposals(self, arch: Any, num_draft_tokens: int) -> int:
        """A block is its token and the masks: at most B-1 proposals (as our decoder
        drafts)."""
        return min(num_draft_tokens, arch.block_size - 1)

    def vllm_method(self, arch: Any, num_draft_tokens: int) -> dict[str, Any]:
        return {
            "method": "dflash",
            "num_speculative_tokens": self.proposals(arch, num_draft_tokens),
        }

    def serve_hint(self, out: Path, fmt: DraftFormat, arch: Any) -> str:
        """vLLM serves it with B-1 speculative tokens (SGLang: B draft tokens,
        --speculative-algorithm DFLASH; llama.cpp: --spec-draft-n-max B-1)."""
        if fmt == DraftFormat.gguf:
            return (
                f"llama-server -m <target.gguf> -md {out}/draft.gguf --spec-type draft-dflash "
                f"--spec-draft-n-max {arch.block_size - 1}"
            )
        return (
            "vllm serve <target> --speculative-config "
            f'\'{{"method": "dflash", "model": "{out}", '
            f'"num_speculative_tokens": {arch.block_size - 1}}}\''
        )
