"""A P-EAGLE draft eagleforge trained, served by the real vLLM on this CPU: vLLM serves it as
``eagle3`` with ``parallel_drafting`` (one draft forward proposes the chain from the mask
token's slots), greedy fp32 output equals the target's, vLLM accepts at every position what
our parallel decoder accepts, and the same draft told to tap the layers one above accepts
less -- the check that catches a layer-offset bug."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagleforge.config import compose_config
from eagleforge.formats.directory import read_architecture
from helpers.engine import edited_copy, evaluate_on_smollm2, shift_taps, the_targets_answers
from helpers.runs import tiny_run_overrides

pytestmark = [pytest.mark.engine, pytest.mark.slow]

AUX_LOGGED = "Using auxiliary layers from speculative config: "


def read_log(evaluation: Path) -> str:
    """The log of the engine that served the draft with chains of 3."""
    (log,) = (evaluation / "eval" / "vllm").glob("*-3-1-4.log")
    return log.read_text()


def test_a_trained_peagle_draft_is_served_by_vllm_as_our_decoder_drafts(
    engine_env: Path, smollm2_dir: Path, tmp_path: Path
) -> None:
    from eagleforge.train import run

    data = the_targets_answers(smollm2_dir, tmp_path / "answers.jsonl")
    result = run(compose_config(tiny_run_overrides(
        tmp_path, "+model=smollm2", "data=jsonl", f"data.path={data}", "data.max_length=256",
        "data.num_eval_samples=0", "data.packing=false", "draft=peagle",
        "draft.peagle.num_depths=3", "trainer.max_num_steps=120", "trainer.batch_size=6",
        "trainer.compute_dtype=float32", "optimizer.lr=5e-3", name="train",
    )))  # fmt: skip
    assert result.checkpoint is not None
    hf, vllm = evaluate_on_smollm2(result.checkpoint, tmp_path / "served", "[hf,vllm]")
    assert hf.greedy_matches_target is True and vllm.greedy_matches_target is True
    assert vllm.rounds > 0 and hf.acceptance_by_position[0] > 0.1, hf.acceptance_by_position
    assert hf.acceptance_by_position[1] > 0, "the mask slots must propose accepted tokens"
    # in fp32 the two engines draft the same chains from the same slots
    assert vllm.acceptance_by_position == pytest.approx(hf.acceptance_by_position, abs=0.03)
    # vLLM read parallel_drafting (its own echo of the arguments) and loaded mask_hidden for
    # it (it warns and skips the tensor when drafting sequentially)
    log = read_log(tmp_path / "served")
    assert "'parallel_drafting': True" in log and "not configured for parallel drafting" not in log
    taps = read_architecture(result.checkpoint).aux_layer_ids
    assert f"{AUX_LOGGED}{tuple(i + 1 for i in taps)}" in log  # vLLM numbers layers by input
    exported = tmp_path / "served" / "eval" / "vllm" / "drafts" / result.checkpoint.name
    assert json.loads((exported / "config.json").read_text())["mask_token_id"] == 16  # smollm2's

    # the negative control: the same weights told to tap the layers one above
    shifted = edited_copy(result.checkpoint, tmp_path / "shifted", shift_taps)
    (wrong,) = evaluate_on_smollm2(shifted, tmp_path / "wrong", "[vllm]", "eval.baseline=false")
    assert f"{AUX_LOGGED}{tuple(i + 2 for i in taps)}" in read_log(tmp_path / "wrong")
    assert wrong.tau < vllm.tau, (wrong.tau, vllm.tau)
