"""A vision-language target end to end: a tiny random Qwen2.5-VL (built offline) trains a
draft on conversations with generated images; the target's M-RoPE positions reach the draft
and the export carries the M-RoPE sections."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagleforge.config import compose_config
from eagleforge.draft.model import Eagle3Draft
from eagleforge.speculative.decoder import DecodeResult, SpeculativeDecoder
from eagleforge.train import run
from helpers.vlm import tiny_vl_run_overrides, write_data

pytestmark = pytest.mark.integration


def test_tiny_qwen2_5_vl_trains_with_mrope_positions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = write_data(tmp_path / "data")
    seen: list[torch.Tensor] = []
    rope = Eagle3Draft.rope

    def spy(self: Eagle3Draft, positions: torch.Tensor, dtype: torch.dtype):  # type: ignore[no-untyped-def]
        seen.append(positions.detach().clone())
        return rope(self, positions, dtype)

    monkeypatch.setattr(Eagle3Draft, "rope", spy)
    overrides = tiny_vl_run_overrides(
        data,
        tmp_path,
        "trainer.max_num_steps=3",
        "trainer.eval_every_n_steps=3",
        "optimizer.lr=1e-3",
    )
    result = run(compose_config(overrides))
    assert result.step == 3 and all(torch.isfinite(torch.tensor(result.train_losses)))
    assert "eval/acc_0" in result.final_eval
    # The draft rotated by the target's 3-D positions: somewhere an image makes the
    # height and width components differ, which text positions never do.
    three_d = [p for p in seen if p.dim() == 3]
    assert three_d and all(p.shape[0] == 3 for p in three_d)
    assert any(not torch.equal(p[1], p[2]) for p in three_d)
    config = json.loads((result.checkpoint / "config.json").read_text())
    assert config["rope_scaling"]["mrope_section"] == [2, 3, 3]


def test_tiny_qwen2_5_vl_measures_real_tau_while_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """trainer.eval_tau_every_n_steps with a vision-language target: the probe decodes prompts
    with their images (the data file's user turns) at the target's M-RoPE positions."""
    data = write_data(tmp_path / "data")
    decoded: list[tuple[object, DecodeResult]] = []  # (images, result) of each probe decoding
    generate = SpeculativeDecoder.generate

    def spy(self: SpeculativeDecoder, prompt_ids: list[int], generator, images=None):  # type: ignore[no-untyped-def]
        result = generate(self, prompt_ids, generator, images)
        decoded.append((images, result))
        return result

    monkeypatch.setattr(SpeculativeDecoder, "generate", spy)
    overrides = tiny_vl_run_overrides(
        data, tmp_path, "trainer.max_num_steps=2", "trainer.eval_tau_every_n_steps=2",
        "trainer.eval_tau_prompts=2", f"eval.prompts={data}", "eval.max_new_tokens=8",
    )  # fmt: skip
    config = compose_config(overrides)
    result = run(config)
    # the first two prompts of the data file, both with images, decoded once at step 2; τ is
    # what those decodings accepted (1 + accepted drafts per round)
    assert len(decoded) == 2 and all(images is not None for images, _ in decoded)
    accepted = [a for _, decoding in decoded for a in decoding.accepted_lengths]
    assert accepted and all(0 <= a <= config.eval.num_draft_tokens for a in accepted)
    assert result.tau_by_step == {2: pytest.approx(1 + sum(accepted) / len(accepted))}
    assert result.best_checkpoint is not None and result.best_checkpoint.name == "best"
