"""The engine tier: the real vLLM engine (its own environment, `make vllm`) over the bundled
SmolLM2. Skipped where no engine environment exists, except where the Makefile says one must
(EAGLEFORGE_REQUIRE_ENGINE=1: `make test` on a machine vLLM builds for), where that fails."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from eagleforge.engine.server import EngineError, engine_python
from helpers.engine import ENGINE


@pytest.fixture(scope="session")
def engine_env() -> Path:
    try:
        return engine_python(ENGINE)
    except EngineError as e:
        if os.environ.get("EAGLEFORGE_REQUIRE_ENGINE") == "1":
            pytest.fail(f"the engine tier must run here: {e}")
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untrained draft for SmolLM2 as training writes its checkpoints (SGLang layout, the
    ids vLLM reads beside them): its proposals are almost all rejected, which is what a
    lossless check wants."""
    from eagleforge.formats.eagle3 import export_sglang
    from eagleforge.targets.config import TargetConfig
    from eagleforge.targets.hf import HFTarget
    from helpers.drafts import random_draft

    target = HFTarget.from_pretrained(
        smollm2_dir, TargetConfig(), torch.float32, torch.device("cpu")
    )
    draft = random_draft(target, 4096, 0.02, seed=0)
    return export_sglang(draft, tmp_path_factory.mktemp("draft") / "step_00000000")
