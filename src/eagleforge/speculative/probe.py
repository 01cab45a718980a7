"""Real τ during training: a few prompts decoded speculatively with the live draft."""

from __future__ import annotations

from collections.abc import Callable

import torch

from eagleforge.draft.family import AnyDraft
from eagleforge.speculative.config import DecodeSettings, EvalConfig
from eagleforge.speculative.decoder import SpeculativeDecoder, eos_ids
from eagleforge.speculative.prompts import PromptRenderer, load_prompt_sets
from eagleforge.speculative.report import TurnRecord, summarise
from eagleforge.targets.hf import HFTarget


class TauProbe:
    """Measures τ of a draft on the first ``num_prompts`` prompts of each set of
    ``cfg.prompts`` (first turns, no baseline), pooled into one τ, with the decoding settings
    of ``cfg``; the same seeds every time, so successive measurements differ only by the
    draft. ``renderer`` renders them as ``eagleforge.evaluate`` does (a benchmark's system
    prompt or few-shot examples first; images, for a vision-language target); ``decoder`` is
    the draft family's."""

    def __init__(
        self,
        cfg: EvalConfig,
        num_prompts: int,
        target: HFTarget,
        renderer: PromptRenderer,
        seed: int,
        decoder: Callable[[HFTarget, AnyDraft, DecodeSettings, set[int]], SpeculativeDecoder],
    ) -> None:
        self.cfg, self.target, self.seed, self.decoder = cfg, target, seed, decoder
        self.eos_ids = eos_ids(renderer.tokenizer, target)
        vlm = renderer.processor is not None
        sets = load_prompt_sets(cfg.prompt_sets(), False, num_prompts, images_allowed=vlm)
        # rendered (and their images processed) once: the same inputs at every measurement
        self.prompts = [
            (item.id, *renderer([*item.context, item.message(0)], item.where))
            for prompt_set in sets
            for item in prompt_set.items
        ]

    def __call__(self, draft: AnyDraft) -> float:
        was_training = draft.training
        decoder = self.decoder(self.target, draft, self.cfg.settings(), self.eos_ids)
        device = self.target.model.device
        records = []
        for index, (prompt_id, ids, images) in enumerate(self.prompts):
            generator = torch.Generator(device).manual_seed(self.seed * 1009 + index)
            result = decoder.generate(ids, generator, images)
            records.append(TurnRecord(prompt_id, 0, len(ids), result, None))
        draft.train(was_training)
        return summarise("live", records, self.cfg.num_draft_tokens, greedy=False).tau
