"""A DFlash draft eagleforge trained, served by the real vLLM on this CPU: its checkpoint loads
as it is (``method: dflash``), greedy fp32 output equals the target's, vLLM accepts drafted
tokens at the rate our block decoder does, and the same draft with its tapped layers shifted by
one accepts less -- the check that catches a layer-offset bug."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagleforge.config import compose_config
from helpers.engine import edited_copy, evaluate_on_smollm2, shift_dflash_taps, the_targets_answers
from helpers.runs import tiny_run_overrides

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def test_a_trained_dflash_draft_is_served_by_vllm_as_our_decoder_drafts(
    engine_env: Path, smollm2_dir: Path, tmp_path: Path
) -> None:
    from eagleforge.train import run

    data = the_targets_answers(smollm2_dir, tmp_path / "answers.jsonl")
    result = run(compose_config(tiny_run_overrides(
        tmp_path, "+model=smollm2", "data=jsonl", f"data.path={data}", "data.max_length=256",
        "data.num_eval_samples=0", "data.packing=false", "draft=dflash",
        "draft.dflash.num_layers=1", "draft.dflash.block_size=4", "draft.dflash.num_anchors=16",
        "draft.dflash.mask_token_id=16", "trainer.max_num_steps=160", "trainer.batch_size=6",
        "trainer.compute_dtype=bfloat16", "optimizer.lr=5e-3", name="train",
    )))  # fmt: skip
    assert result.checkpoint is not None
    hf, vllm = evaluate_on_smollm2(result.checkpoint, tmp_path / "served", "[hf,vllm]")
    assert hf.greedy_matches_target is True and vllm.greedy_matches_target is True
    assert vllm.rounds > 0 and hf.acceptance_by_position[0] > 0.1, hf.acceptance_by_position
    # in fp32 the two engines draft the same blocks (measured on the SmolLM2 draft of
    # docs/dflash.md: the same tau to 3 decimals)
    assert vllm.acceptance_by_position == pytest.approx(hf.acceptance_by_position, abs=0.03)
    log = (tmp_path / "served" / "eval" / "vllm").glob("*-3-1-4.log")
    assert any("dflash" in path.read_text().lower() for path in log)

    # the negative control: the same weights told to tap the layers one above
    shifted = edited_copy(result.checkpoint, tmp_path / "shifted", shift_dflash_taps)
    (wrong,) = evaluate_on_smollm2(shifted, tmp_path / "wrong", "[vllm]", "eval.baseline=false")
    # adjacent layers' states are alike, so the drop can be small, but it is always there
    # (docs/dflash.md: tau 1.222 -> 1.205)
    assert wrong.tau < vllm.tau, (wrong.tau, vllm.tau)
