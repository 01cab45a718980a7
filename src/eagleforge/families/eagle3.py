"""EAGLE-3 (and 3.1): one decoder layer over three target layers' states, trained with the
unrolled training-time test against the target's distribution (``draft/model.py``,
``draft/ttt.py``; docs/training.md)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from eagleforge.batch import TTTBatch
from eagleforge.checkpoint import load_draft_weights
from eagleforge.draft.attention import AttentionBackend
from eagleforge.draft.config import DraftConfig, DraftFamily, DraftInit, LossPositions
from eagleforge.draft.loss import LossConfig
from eagleforge.draft.model import DraftArchitecture, Eagle3Draft
from eagleforge.draft.ttt import TTTModule, step_weights
from eagleforge.errors import ConfigError
from eagleforge.families.base import DraftInputs, MakeBatch, init_from, num_target_layers
from eagleforge.formats.config import DraftFormat
from eagleforge.parallel.usp import SequenceParallel, USPBackend, check_heads, shard_sequence
from eagleforge.speculative.config import DecodeSettings
from eagleforge.speculative.decoder import SpeculativeDecoder
from eagleforge.targets.base import TargetBackend
from eagleforge.targets.hf import HFTarget
from eagleforge.targets.teacher import teacher_batch

log = logging.getLogger(__name__)

# the draft.* settings an EAGLE-3 draft reads
EAGLE3_FIELDS = (
    "draft.draft_vocab_size", "draft.ttt_length", "draft.step_weight_decay",
    "draft.loss_positions", "draft.attention",
    "draft.compile", "draft.intermediate_size", "draft.init_std", "draft.init",
    "draft.recompute_mlp", "draft.fc_norm", "draft.norm_before_fc", "draft.norm_output",
    "draft.norm_before_residual",
)  # fmt: skip


class Eagle3Family:
    name = DraftFamily.eagle3
    title = "EAGLE-3"
    llamacpp_type: str | None = "draft-eagle3"
    positions = "TTT position"
    reads: tuple[str, ...] = EAGLE3_FIELDS
    reads_loss = True
    docs = "docs/training.md"
    model_defaults: tuple[str, ...] = ()  # its fields are flat under draft.*, a model file's own

    def describe(self, draft: DraftConfig, loss: LossConfig) -> str:
        return f"TTT {draft.ttt_length}, loss {loss.kind.value}"

    draft_class: type[Eagle3Draft] = Eagle3Draft

    def architecture(self, cfg: DraftConfig, inputs: DraftInputs) -> DraftArchitecture:
        target = inputs.target
        return DraftArchitecture.from_target(target.config, cfg, target.aux_layer_ids)

    def unroll_length(self, cfg: DraftConfig) -> int:
        """The steps of the unrolled test: the positions a batch is trained at."""
        return cfg.ttt_length

    def build(self, cfg: DraftConfig, inputs: DraftInputs) -> Eagle3Draft:
        """Its vocabulary map from the training data's supervised tokens (cached); the
        target's embedding, frozen; ``draft.init`` or ``model.draft_init``'s weights."""
        target = inputs.target
        arch = self.architecture(cfg, inputs)
        vocab = inputs.vocab_map(arch.vocab_size, arch.draft_vocab_size)
        draft = self.draft_class(arch, recompute_mlp=cfg.recompute_mlp)
        draft.init_weights(cfg.init_std, torch.Generator().manual_seed(inputs.seed))
        draft.load_embedding(target.input_embedding().detach().cpu())
        draft.set_vocab_map(vocab.d2t_W, vocab.t2d_V)
        if inputs.draft_init:  # every trainable weight comes from there: draft.init is moot
            init_from(draft, self.name, inputs.draft_init, num_target_layers(target.config))
        elif cfg.init != DraftInit.random:
            norm = target.final_norm_weight()
            if norm is None:
                raise ConfigError(
                    f"draft.init={cfg.init.value}: target={inputs.target_name} does not expose "
                    "the target's final norm; use draft.init=random."
                )
            start = (
                draft.init_logit_lens
                if cfg.init == DraftInit.logit_lens
                else draft.init_target_head
            )
            start(norm.detach().cpu(), target.lm_head_weight().detach())
        return draft.to(inputs.device)

    def load(
        self,
        arch: Any,
        tensors: dict[str, torch.Tensor],
        target: HFTarget,
        path: Path,
        device: torch.device,
    ) -> Eagle3Draft:
        draft = self.draft_class(arch)
        load_draft_weights(draft, tensors, path)
        draft.load_embedding(target.input_embedding().detach().float().cpu())
        return draft.to(device).eval()

    def training_module(
        self,
        draft: Any,
        cfg: DraftConfig,
        loss: LossConfig,
        device: torch.device,
        sp: SequenceParallel,
    ) -> TTTModule:
        """The unrolled TTT with the configured attention backend (sequence-parallel attention
        over the sp ranks under usp) and loss kernel, both resolved for ``device`` and logged."""
        attention = cfg.attention_for(device)
        loss = dataclasses.replace(loss, kernel=loss.kernel_for(device))
        log.info("TTT attention %s, loss %s by the %s kernel", attention.value, loss.kind.value,
                 loss.kernel.value)  # fmt: skip
        ttt_attention: AttentionBackend | USPBackend = attention
        if attention == AttentionBackend.usp:
            check_heads(
                draft.arch.num_attention_heads, draft.arch.num_key_value_heads, sp.ulysses_size
            )
            ttt_attention = USPBackend(sp, self.unroll_length(cfg))
        return self.module(draft, cfg, ttt_attention, loss)

    def module(
        self,
        draft: Any,
        cfg: DraftConfig,
        attention: AttentionBackend | USPBackend,
        loss: LossConfig,
    ) -> TTTModule:
        return TTTModule(draft, cfg.ttt_length, attention, cfg.compile, loss=loss)

    def batches(
        self,
        draft: Any,
        cfg: DraftConfig,
        target: TargetBackend,
        sp: SequenceParallel,
        seed: int,
        teacher_chunk_size: int | None,
    ) -> MakeBatch:
        """The target's teacher over the draft's own vocabulary (with model.draft_init, the
        initial draft's map, not this data's); this rank's sequence chunk under usp."""
        draft_ids_W = draft.draft_to_target_ids(
            torch.arange(len(draft.d2t), device=draft.d2t.device)
        )
        t2d_V = draft.t2d
        length = self.unroll_length(cfg)

        def make(batch: dict[str, torch.Tensor], train: bool) -> TTTBatch:
            ttt_batch = teacher_batch(
                target,
                batch,
                draft_ids_W,
                t2d_V,
                teacher_chunk_size,
                count_after_supervised=cfg.loss_positions == LossPositions.fed,
            )
            return shard_sequence(ttt_batch, sp, length) if sp.size > 1 else ttt_batch

        return make

    def loss_weights(self, cfg: DraftConfig, device: torch.device) -> torch.Tensor:
        return step_weights(cfg.ttt_length, cfg.step_weight_decay, device)

    def decoder(
        self, target: HFTarget, draft: Any, settings: DecodeSettings, eos_ids: set[int]
    ) -> SpeculativeDecoder:
        return SpeculativeDecoder(target, draft, settings, eos_ids)

    def proposals(self, arch: Any, num_draft_tokens: int) -> int:
        return num_draft_tokens

    def vllm_method(self, arch: Any, num_draft_tokens: int) -> dict[str, Any]:
        return {"method": "eagle3", "num_speculative_tokens": num_draft_tokens}

    def serve_hint(self, out: Path, fmt: DraftFormat, arch: Any) -> str:
        if fmt == DraftFormat.sglang:
            return (
                "python -m sglang.launch_server --model-path <target> --speculative-algorithm "
                f"EAGLE3 --speculative-draft-model-path {out} --speculative-num-steps 3 "
                "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
            )
        if fmt == DraftFormat.gguf:
            return (
                f"llama-server -m <target.gguf> -md {out}/draft.gguf --spec-type draft-eagle3 "
                "--spec-draft-n-max 3"
            )
        return (
            "vllm serve <target> --speculative-config "
            f'\'{{"method": "eagle3", "model": "{out}", "num_speculative_tokens": 3}}\''
        )
