"""A DFlash draft eagleforge trained, served by the real vLLM on this CPU: its checkpoint loads
as it is (``method: dflash``), greedy fp32 output equals the target's, vLLM accepts drafted
tokens at the rate our block decoder does, and the same draft with its tapped layers shifted by
one accepts less -- the check that catches a layer-offset bug."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from eagleforge.config import compose_config
from helpers.engine import ENGINE_OVERRIDES
from helpers.runs import tiny_run_overrides

pytestmark = [pytest.mark.engine, pytest.mark.slow]

PROMPTS = "mtbench_style"
NUM_PROMPTS = 6


def evaluate(draft: Path, out: Path, engines: str, *extra: str) -> list:  # type: ignore[type-arg]
    from eagleforge.evaluate import run

    return run(compose_config([
        "+model=smollm2", "model.dtype=float32", f"eval.draft={draft}", f"eval.engine={engines}",
        f"eval.prompts={PROMPTS}", f"eval.max_prompts={NUM_PROMPTS}", "eval.max_new_tokens=48",
        "eval.num_draft_tokens=3", "eval.engine_batch=1", "tracker=console",
        f"output_root={out}", f"output_dir={out / 'eval'}", *ENGINE_OVERRIDES, *extra,
    ]))  # fmt: skip


def the_targets_answers(smollm2_dir: Path, path: Path) -> Path:
    """The target's own greedy answers (fp32, 64 tokens) to the first prompts it will be
    served on, as chat data: what a draft that has learned its target proposes, learned in a
    minute instead of the hours real data needs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagleforge.speculative.prompts import load_prompts

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    rows = []
    for prompt in load_prompts(PROMPTS, multi_turn=False, limit=NUM_PROMPTS):
        messages = [{"role": "user", "content": prompt.turns[0]}]
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=64, do_sample=False)
        answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        rows.append({"messages": [*messages, {"role": "assistant", "content": answer}]})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


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
    hf, vllm = evaluate(result.checkpoint, tmp_path / "served", "[hf,vllm]")
    assert hf.greedy_matches_target is True and vllm.greedy_matches_target is True
    assert vllm.rounds > 0 and hf.acceptance_by_position[0] > 0.1, hf.acceptance_by_position
    # in fp32 the two engines draft the same blocks (measured on the SmolLM2 draft of
    # docs/dflash.md: the same tau to 3 decimals)
    assert vllm.acceptance_by_position == pytest.approx(hf.acceptance_by_position, abs=0.03)
    log = (tmp_path / "served" / "eval" / "vllm").glob("*-3-1-4.log")
    assert any("dflash" in path.read_text().lower() for path in log)

    # the negative control: the same weights told to tap the layers one above
    shifted = tmp_path / "shifted" / result.checkpoint.name
    shutil.copytree(result.checkpoint, shifted)
    (shifted / "checksums.json").unlink(missing_ok=True)
    config = json.loads((shifted / "config.json").read_text())
    taps = config["dflash_config"]["target_layer_ids"]
    config["dflash_config"]["target_layer_ids"] = [i + 1 for i in taps]
    (shifted / "config.json").write_text(json.dumps(config))
    (wrong,) = evaluate(shifted, tmp_path / "wrong", "[vllm]", "eval.baseline=false")
    # adjacent layers' states are alike, so the drop can be small, but it is always there
    # (docs/dflash.md: tau 1.222 -> 1.205)
    assert wrong.tau < vllm.tau, (wrong.tau, vllm.tau)
