"""End-to-end training runs: the tiny random Llama (fast) and the real bundled SmolLM2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagleforge.checkpoint import TRAINING_STATE
from eagleforge.config import compose_config
from eagleforge.formats.directory import load_draft_dir
from eagleforge.train import run
from helpers.runs import tiny_run_overrides

SGLANG_TENSORS = {
    "fc.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
}


@pytest.mark.integration
def test_tiny_run_trains_checkpoints_and_logs_to_mlflow(tmp_path: Path) -> None:
    overrides = tiny_run_overrides(
        tmp_path,
        "data.max_tokens_per_batch=192",
        "trainer.grad_accum_steps=2",
        "trainer.log_every_n_steps=2",
        "trainer.eval_every_n_steps=2",
        "optimizer.lr=1e-3",
        "draft.ttt_length=3",
        "tracker=mlflow",
    )
    result = run(compose_config(overrides))

    assert result.step == 4 and len(result.train_losses) == 4
    assert all(torch.isfinite(torch.tensor(result.train_losses)))
    assert {"eval/acc_0", "eval/tau_sim", "eval/loss"} <= set(result.final_eval)

    checkpoint = result.checkpoint
    assert checkpoint is not None and checkpoint.name == "step_00000004"
    assert set(load_file(checkpoint / "model.safetensors")) == SGLANG_TENSORS
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    state = torch.load(checkpoint / TRAINING_STATE, weights_only=True)
    assert state["progress"]["step"] == 4 and "optimizer" in state and "rng" in state
    assert "model:" in (checkpoint / "config.yaml").read_text()
    # what auto resolved to on this machine, and why (the suite pins auto to fp32 on a CPU)
    precision = json.loads((checkpoint / "run.json").read_text())["precision"]
    assert (
        precision["model.dtype"]["asked"] == "auto"
        and "bf16 runs" in precision["model.dtype"]["why"]
    )
    assert (
        precision["model.dtype"]["dtype"]
        == precision["trainer.compute_dtype"]["dtype"]
        == "float32"
    )
    assert not list(checkpoint.parent.glob(".*"))
    load_draft_dir(checkpoint)

    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["eagleforge"], output_format="list")
    assert len(runs) == 1
    run_ = runs[0]
    assert run_.data.params["model.name"] == "tiny"
    assert run_.data.params["optimizer.lr"] == "0.001"
    assert run_.data.params["precision.trainer.compute_dtype"] == "float32"
    client = mlflow.MlflowClient()
    history = client.get_metric_history(run_.info.run_id, "train/loss")
    assert [m.step for m in history] == [2, 4]
    # the process's peak memory, which never goes down: more than the model's own 50 MiB
    peaks = [m.value for m in client.get_metric_history(run_.info.run_id, "train/peak_mem_mib")]
    assert len(peaks) == 2 and 50 < peaks[0] <= peaks[1]
    assert [m.step for m in client.get_metric_history(run_.info.run_id, "eval/acc_0")] == [0, 2, 4]
    kept = client.get_metric_history(run_.info.run_id, "data/kept")
    skipped = client.get_metric_history(run_.info.run_id, "data/skipped_no_assistant_turn")
    assert kept[0].value + skipped[0].value <= 80 and kept[0].value > 0 and skipped[0].value > 0
    artifacts = {a.path for a in client.list_artifacts(run_.info.run_id)}
    assert {"config.yaml", "summary.json"} <= artifacts


# Slow: SmolLM2 trains by default in test_evaluate.py and test_offline.py, a trained draft's
# proposals are accepted in test_evaluate_vlm.py, and the golden trace pins how a run learns;
# `make test-quality` measures SmolLM2's learning properly.
@pytest.mark.slow
@pytest.mark.integration
def test_smollm2_run_learns(tmp_path: Path) -> None:
    """A few steps on the real bundled model: eval acc_0 moves off the untrained 0."""
    overrides = tiny_run_overrides(
        tmp_path,
        "+model=smollm2",
        "data.max_num_samples=120",
        "data.num_eval_samples=8",
        "data.max_length=128",
        "data.packing=true",  # SmolLM2's file pads batches of 8; this run packs 512-token rows
        "data.max_tokens_per_batch=512",
        "trainer.max_num_steps=6",
        "optimizer.lr=2e-3",
        "optimizer.warmup_ratio=0",
    )
    result = run(compose_config(overrides))
    assert result.initial_eval["eval/acc_0"] < result.final_eval["eval/acc_0"]
    assert result.final_eval["eval/tau_sim"] > 1.0
    arch, tensors = load_draft_dir(result.checkpoint)
    assert arch.hidden_size == 576 and arch.vocab_size == 49152 and arch.draft_vocab_size == 8192
    assert arch.aux_layer_ids == [1, 14, 26]
    assert tensors["fc.weight"].shape == (576, 3 * 576)
