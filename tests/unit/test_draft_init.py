"""draft.init=logit_lens: the untrained draft predicts what the target makes of its last aux
layer. Where that layer is the target's last, that is the target's own next-token logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagleforge.draft.config import DraftConfig
from eagleforge.draft.model import DraftArchitecture, Eagle3Draft
from eagleforge.speculative.runners import DraftRunner
from eagleforge.targets.head import HeadOnlyTarget
from helpers.targets import small_vocab_target

pytestmark = pytest.mark.unit


def test_a_logit_lens_draft_predicts_the_targets_logits(tmp_path: Path) -> None:
    target = small_vocab_target(vocab=8)
    with torch.no_grad():  # a final norm gain that is not all ones, so it must be read
        target.decoder.norm.weight.uniform_(0.5, 2.0)
    assert target.aux_layer_ids[-1] == len(target.layers) - 1  # 4 layers: the last is aux
    arch = DraftArchitecture.from_target(
        target.config, DraftConfig(draft_vocab_size=6), target.aux_layer_ids
    )
    draft = Eagle3Draft(arch)
    draft.init_weights(0.02, torch.Generator().manual_seed(0))
    draft.load_embedding(target.input_embedding().detach())
    kept = torch.tensor([0, 2, 3, 5, 6, 7])  # the draft vocabulary skips ids 1 and 4
    t2d = torch.zeros(8, dtype=torch.bool)
    t2d[kept] = True
    draft.set_vocab_map(kept - torch.arange(6), t2d)
    draft.init_logit_lens(target.final_norm_weight(), target.lm_head_weight().detach())
    draft.eval()

    ids = torch.tensor([[3, 1, 4, 1, 5, 2, 6, 5, 3]])
    with torch.no_grad():
        out = target.forward(ids, torch.ones_like(ids))
        target_logits = target.model(ids).logits[0]
        hidden = DraftRunner(draft).extend(ids[0, 1:], out.aux_BTA[0, :-1], torch.arange(8))
        draft_logits = draft.lm_head(draft.norm(hidden))
    torch.testing.assert_close(draft_logits, target_logits[:-1, kept], rtol=1e-5, atol=1e-5)

    # offline, the head-only target reads the same gain from the safetensors files
    target.model.save_pretrained(tmp_path)
    head = HeadOnlyTarget(tmp_path, torch.float32, torch.device("cpu"))
    torch.testing.assert_close(head.final_norm_weight(), target.final_norm_weight())


def test_a_target_head_draft_starts_with_the_targets_norm_and_rows_the_rest_random() -> None:
    """draft.init=target_head (vLLM speculators' start): norm and lm_head are the target's
    final norm and its rows of the draft vocabulary; fc and the layer keep their random init."""
    target = small_vocab_target(vocab=8)
    with torch.no_grad():
        target.decoder.norm.weight.uniform_(0.5, 2.0)
    arch = DraftArchitecture.from_target(
        target.config, DraftConfig(draft_vocab_size=6), target.aux_layer_ids
    )
    draft = Eagle3Draft(arch)
    draft.init_weights(0.02, torch.Generator().manual_seed(0))
    random_fc = draft.fc.weight.detach().clone()
    random_o = draft.midlayer.self_attn.o_proj.weight.detach().clone()
    kept = torch.tensor([0, 2, 3, 5, 6, 7])
    t2d = torch.zeros(8, dtype=torch.bool)
    t2d[kept] = True
    draft.set_vocab_map(kept - torch.arange(6), t2d)
    draft.init_target_head(target.final_norm_weight(), target.lm_head_weight().detach())
    torch.testing.assert_close(draft.norm.weight, target.final_norm_weight().float())
    torch.testing.assert_close(draft.lm_head.weight, target.lm_head_weight()[kept].float())
    assert torch.equal(draft.fc.weight, random_fc)
    assert torch.equal(draft.midlayer.self_attn.o_proj.weight, random_o)
