"""The engine tier: the real vLLM engine (its own environment, `make vllm`) and llama.cpp's
llama-server (`make llamacpp`) over the bundled SmolLM2. Each is skipped where it is not
built, except where the Makefile says it must be (EAGLEFORGE_REQUIRE_ENGINE=1: `make test` on a
machine vLLM builds for; EAGLEFORGE_REQUIRE_LLAMACPP=1: one with CMake and a C++ compiler),
where that fails."""

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
def llama_server() -> Path:
    """``make llamacpp``'s llama-server (tests/conftest.py points $EAGLEFORGE_LLAMA_SERVER at
    the machine's build)."""
    from eagleforge.engine.llamacpp_build import find_server

    server = find_server()
    if server is None:
        why = "no llama-server: `make llamacpp` builds it"
        if os.environ.get("EAGLEFORGE_REQUIRE_LLAMACPP") == "1":
            pytest.fail(f"the llama.cpp tier must run here: {why}")
        pytest.skip(why)
    return server


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


@pytest.fixture(scope="session")
def llamacpp_source(llama_server: Path) -> Path:
    """The llama.cpp source tree ``make llamacpp`` built the server from (its
    ``convert_hf_to_gguf.py`` and ``gguf-py``), beside the server in the machine's cache."""
    source = llama_server.parent.parent / "src" / "llama.cpp"
    if not (source / "convert_hf_to_gguf.py").is_file():
        why = f"no llama.cpp source beside {llama_server}: `make llamacpp` keeps it there"
        if os.environ.get("EAGLEFORGE_REQUIRE_LLAMACPP") == "1":
            pytest.fail(f"the llama.cpp tier must run here: {why}")
        pytest.skip(why)
    return source


@pytest.fixture(scope="session")
def answers_store(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The target's own answers to the prompts it is served on (``the_targets_answers``) with
    their hidden states captured once: the data overrides of a run that trains on them offline
    (the same draft as online, a third of the time)."""
    from helpers.engine import the_targets_answers
    from helpers.runs import prepare_store, tiny_run_overrides

    root = tmp_path_factory.mktemp("answers")
    data = the_targets_answers(smollm2_dir, root / "answers.jsonl")
    overrides = ["+model=smollm2", "data=jsonl", f"data.path={data}", "data.max_length=256",
                 "data.num_eval_samples=0", "data.packing=false"]  # fmt: skip
    store = prepare_store(root, *tiny_run_overrides(root, *overrides, name=None))
    return [*overrides, f"data.features={store}"]
