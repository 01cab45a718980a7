"""An EAGLE-3 draft and a DFlash draft eagleforge trained, each served by llama.cpp's
llama-server on this CPU beside the bundled SmolLM2's own GGUF (Q4_1): exported as a GGUF
through the judge, greedy output equal to llama.cpp's target alone, drafted tokens accepted by
llama.cpp's own counters, and the same weights exported with their taps shifted by one layer
accepted less -- the check that catches a layer-numbering bug between our taps and
llama.cpp's."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagleforge.config import compose_config
from eagleforge.formats.gguf import read_gguf
from helpers.engine import (
    edited_copy,
    evaluate_on_smollm2,
    shift_dflash_taps,
    shift_taps,
)
from helpers.runs import tiny_run_overrides

pytestmark = pytest.mark.engine


def test_a_trained_draft_is_served_by_llamacpp_losslessly_and_accepted(
    llama_server: Path, answers_store: list[str], tmp_path: Path
) -> None:
    from eagleforge.train import run

    result = run(compose_config(tiny_run_overrides(
        tmp_path, *answers_store, "draft.ttt_length=3",
        "draft.norm_before_fc=true", "trainer.max_num_steps=160", "trainer.batch_size=6",
        "trainer.compute_dtype=bfloat16", "optimizer.lr=5e-3", name="train",
    )))  # fmt: skip
    assert result.checkpoint is not None
    (served,) = evaluate_on_smollm2(result.checkpoint, tmp_path / "served", "[llamacpp]")
    assert served.engine == "llamacpp" and served.dtype == "q4_1"
    assert served.greedy_matches_target is True
    assert served.rounds > 0 and served.acceptance_by_position[0] > 0.1, served
    exported = tmp_path / "served" / "eval" / "llamacpp" / "drafts" / result.checkpoint.name
    arch, _ = read_gguf(exported / "draft.gguf")
    assert arch.aux_layer_ids == [1, 14, 26]  # llama.cpp's [2, 15, 27]: the input of a layer
    log = next((tmp_path / "served" / "eval" / "llamacpp").glob("*-3-1-4.log")).read_text()
    assert "--spec-type draft-eagle3" in log

    # the negative control: the same weights told to tap the layers one above
    shifted = edited_copy(result.checkpoint, tmp_path / "shifted", shift_taps)
    (wrong,) = evaluate_on_smollm2(shifted, tmp_path / "wrong", "[llamacpp]", "eval.baseline=false")
    assert wrong.tau < served.tau, (wrong.tau, served.tau)


def test_a_trained_dflash_draft_is_served_by_llamacpp_losslessly_and_accepted(
    llama_server: Path, answers_store: list[str], tmp_path: Path
) -> None:
    from eagleforge.train import run

    result = run(compose_config(tiny_run_overrides(
        tmp_path, *answers_store, "draft=dflash",
        "draft.dflash.num_layers=1", "draft.dflash.block_size=4", "draft.dflash.num_anchors=16",
        "draft.dflash.mask_token_id=16", "trainer.max_num_steps=160", "trainer.batch_size=6",
        "trainer.compute_dtype=bfloat16", "optimizer.lr=5e-3", name="train",
    )))  # fmt: skip
    assert result.checkpoint is not None
    (served,) = evaluate_on_smollm2(result.checkpoint, tmp_path / "served", "[llamacpp]")
    assert served.greedy_matches_target is True
    assert served.rounds > 0 and served.acceptance_by_position[0] > 0.1, served
    exported = tmp_path / "served" / "eval" / "llamacpp" / "drafts" / result.checkpoint.name
    arch, _ = read_gguf(exported / "draft.gguf")
    assert arch.aux_layer_ids == [1, 14, 26] and arch.block_size == 4  # type: ignore[union-attr]
    log = next((tmp_path / "served" / "eval" / "llamacpp").glob("*-3-1-4.log")).read_text()
    assert "--spec-type draft-dflash" in log and "block_size=4, mask_token_id=16" in log

    # the negative control: the same weights told to tap the layers one above
    shifted = edited_copy(result.checkpoint, tmp_path / "shifted", shift_dflash_taps)
    (wrong,) = evaluate_on_smollm2(shifted, tmp_path / "wrong", "[llamacpp]", "eval.baseline=false")
    assert wrong.tau < served.tau, (wrong.tau, served.tau)
