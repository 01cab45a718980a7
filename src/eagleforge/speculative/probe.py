"""Real τ during training: a few prompts decoded speculatively with the live draft."""

from __future__ import annotations

from typing import Any

import torch

from eagleforge.draft.model import Eagle3Draft
from eagleforge.speculative.decode import EvalConfig, SpeculativeDecoder, eos_ids
from eagleforge.speculative.prompts import load_prompts, render_prompt
from eagleforge.speculative.report import TurnRecord, summarise
from eagleforge.target.hf import HFTarget


class TauProbe:
    """Measures τ of a draft on the first ``num_prompts`` prompts of ``cfg.prompts`` (first
    turns, no baseline), with the decoding settings of ``cfg``; the same seeds every time, so
    successive measurements differ only by the draft."""

    def __init__(
        self, cfg: EvalConfig, num_prompts: int, target: HFTarget, tokenizer: Any, seed: int
    ) -> None:
        self.cfg, self.target, self.seed = cfg, target, seed
        self.eos_ids = eos_ids(tokenizer, target)
        self.prompts = [
            (item.id, render_prompt(tokenizer, [{"role": "user", "content": item.turns[0]}]))
            for item in load_prompts(cfg.prompts, multi_turn=False, limit=num_prompts)
        ]

    def __call__(self, draft: Eagle3Draft) -> float:
        was_training = draft.training
        decoder = SpeculativeDecoder(self.target, draft, self.cfg.settings(), self.eos_ids)
        device = self.target.model.device
        records = []
        for index, (prompt_id, ids) in enumerate(self.prompts):
            generator = torch.Generator(device).manual_seed(self.seed * 1009 + index)
            records.append(
                TurnRecord(prompt_id, 0, len(ids), decoder.generate(ids, generator), None)
            )
        draft.train(was_training)
        return summarise("live", records, self.cfg.num_draft_tokens, greedy=False).tau
