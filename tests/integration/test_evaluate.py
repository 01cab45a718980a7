"""Speculative decoding end to end: lossless against the target's own decoding (greedy on
SmolLM2, in distribution on a small-vocabulary model), and the evaluate entry point with its
files and MLflow logging."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from eagleforge.config import compose_config
from eagleforge.speculative.config import DecodeSettings
from eagleforge.speculative.decoder import SpeculativeDecoder
from eagleforge.speculative.prompts import load_prompts
from eagleforge.targets.config import TargetConfig
from eagleforge.targets.hf import HFTarget
from helpers.drafts import random_draft
from helpers.runs import tiny_run_overrides
from helpers.targets import assert_samples_follow_the_target, small_vocab_target

pytestmark = pytest.mark.integration


# The tree on SmolLM2 is slow only: the tree stays lossless in the default run on the tiny VLM
# (test_evaluate_vlm.py) and sampled here on the small-vocabulary target.
@pytest.mark.parametrize(("topk", "total"), [(1, 4), pytest.param(3, 8, marks=pytest.mark.slow)])
def test_greedy_output_equals_the_targets_on_smollm2(
    smollm2_dir: Path, smollm2_tokenizer, topk: int, total: int
) -> None:  # type: ignore[no-untyped-def]
    """Random drafts propose garbage; the output must still be the target's greedy decoding."""
    target = HFTarget.from_pretrained(
        smollm2_dir, TargetConfig(), torch.float32, torch.device("cpu")
    )
    draft = random_draft(target, 4096, 0.02, seed=topk)
    settings = DecodeSettings(24, 4, topk, total, temperature=0.0)
    decoder = SpeculativeDecoder(target, draft, settings, {smollm2_tokenizer.eos_token_id})
    for item in load_prompts("mtbench", multi_turn=False, limit=2):
        text = smollm2_tokenizer.apply_chat_template(
            [{"role": "user", "content": item.turns[0]}], add_generation_prompt=True, tokenize=False
        )
        ids = smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]
        speculative = decoder.generate(ids, torch.Generator().manual_seed(0))
        plain = decoder.generate_target_only(ids, torch.Generator().manual_seed(0))
        assert speculative.output_ids == plain.output_ids
        assert decoder.generate_hf(ids).output_ids == plain.output_ids  # transformers' generate
        assert len(plain.output_ids) == 24 or plain.output_ids[-1] == smollm2_tokenizer.eos_token_id
        assert speculative.target_forwards == 1 + len(speculative.accepted_lengths)
        parts = speculative.seconds_by_part  # the round timed by part, within the whole
        assert set(parts) == {"prefill", "draft", "verify", "commit"}
        assert 0 < sum(parts.values()) <= speculative.seconds
        assert speculative.draft_steps == 4 * len(speculative.accepted_lengths)


# The chain is slow only: its acceptance rule keeps the target's distribution in
# tests/unit/test_speculative_sampling.py, and the tree here samples through the whole decoder.
@pytest.mark.parametrize(("topk", "total"), [pytest.param(1, 2, marks=pytest.mark.slow), (2, 4)])
def test_sampled_output_follows_the_targets_distribution(topk: int, total: int) -> None:
    """Chain (sampled drafts) and tree (top-k drafts) at temperature 0.8 with a draft that
    disagrees with the target: each generated position's marginal matches the target's
    (chi-square over 8 tokens, 7 degrees of freedom; 35 is p < 1e-5)."""
    target = small_vocab_target()
    draft = random_draft(target, 6, 0.6, seed=7)
    prompt, temperature, runs = [1, 5, 2], 0.8, 1500
    decoder = SpeculativeDecoder(
        target, draft, DecodeSettings(3, 2, topk, total, temperature), set()
    )
    assert_samples_follow_the_target(decoder, target, prompt, temperature, runs)


def test_evaluate_entry_point_writes_and_logs(
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Train two checkpoints briefly, evaluate the directory: a table per draft, files, and
    MLflow metrics and plots; greedy outputs equal the target's; the progress of each draft,
    in plain lines since stderr is not a terminal here (no bar)."""
    import logging

    import mlflow

    from eagleforge import progress as progress_lines
    from eagleforge.evaluate import run as evaluate
    from eagleforge.train import run as train

    train(
        compose_config(
            tiny_run_overrides(
                tmp_path,
                "+model=smollm2",
                "data.num_eval_samples=4",
                "data.packing=true",  # SmolLM2's file pads batches of 8
                "data.max_tokens_per_batch=384",
                "trainer.save_every_n_steps=2",
                "trainer.eval_every_n_steps=0",
                "optimizer.lr=2e-3",
                name="train",
            )
        )
    )
    capfd.readouterr()  # training's output
    monkeypatch.setattr(progress_lines, "LINE_EVERY_S", 0.0)  # a line at every prompt
    caplog.set_level(logging.INFO, "eagleforge.progress")
    summaries = evaluate(
        compose_config(
            [
                "+model=smollm2",
                f"eval.draft={tmp_path / 'train'}",
                "eval.max_prompts=2",
                "eval.max_new_tokens=16",
                "eval.num_draft_tokens=3",
                "tracker=mlflow",
                "tracker.experiment=eval-test",
                f"output_root={tmp_path}",
                f"output_dir={tmp_path / 'eval'}",
            ]  # fmt: skip
        )
    )
    assert [Path(s.draft).name for s in summaries] == ["step_00000002", "step_00000004"]
    assert "evaluate step_" not in capfd.readouterr().err  # no bar drawn into a capture
    progress = "\n".join(r.getMessage() for r in caplog.records if r.name == "eagleforge.progress")
    for step in ("step_00000002", "step_00000004"):
        assert re.search(rf"evaluate {step}: 2/2 prompt \(100%\) .*tok_s=\d", progress), progress
    for summary in summaries:
        assert summary.greedy_matches_target is True
        assert summary.tau >= 1.0 and len(summary.acceptance_by_position) == 3
        assert summary.speedup is not None and summary.num_turns == 2
    out = tmp_path / "eval" / "eval" / "step_00000004"
    assert json.loads((out / "summary.json").read_text())["num_turns"] == 2
    rows = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["output_ids"] == r["baseline_output_ids"] for r in rows)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    client = mlflow.MlflowClient()
    experiment = client.get_experiment_by_name("eval-test")
    assert experiment is not None
    (run_,) = client.search_runs([experiment.experiment_id])
    taus = client.get_metric_history(run_.info.run_id, "eval/tau")
    assert sorted(m.step for m in taus) == [2, 4]
    artifacts = {a.path for a in client.list_artifacts(run_.info.run_id)}
    assert {"step_00000002", "step_00000004", "tau_by_step.png"} <= artifacts
    per_draft = {a.path for a in client.list_artifacts(run_.info.run_id, "step_00000004")}
    assert {f"step_00000004/{name}" for name in ("acceptance.png", "summary.json")} <= per_draft


def test_training_measures_real_tau_and_keeps_the_best_checkpoint(tmp_path: Path) -> None:
    from eagleforge.formats.directory import load_draft_dir
    from eagleforge.train import run as train

    result = train(
        compose_config(
            tiny_run_overrides(
                tmp_path,
                "+model=smollm2",
                "data.max_num_samples=60",
                "data.num_eval_samples=4",
                "data.packing=true",  # SmolLM2's file pads batches of 8
                "data.max_tokens_per_batch=384",
                "trainer.max_num_steps=3",
                "trainer.eval_tau_every_n_steps=2",
                "trainer.eval_tau_prompts=1",
                "eval.max_new_tokens=8",
                name="train",
            )
        )
    )
    assert sorted(result.tau_by_step) == [2, 3]  # every 2 steps and at the end
    assert all(tau >= 1.0 for tau in result.tau_by_step.values())
    assert result.best_checkpoint == tmp_path / "train" / "checkpoints" / "best"
    load_draft_dir(result.best_checkpoint)  # a complete draft directory
    summary = json.loads((tmp_path / "train" / "summary.json").read_text())
    assert summary["tau_by_step"] == {str(k): v for k, v in result.tau_by_step.items()}
    assert (tmp_path / "train" / "tau_by_step.png").stat().st_size > 0  # the learning curve
