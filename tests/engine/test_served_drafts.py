"""The served half of every draft family's contract: a draft of each family eagleforge
trained, served by each engine that serves that family (``eagleforge.judges.JUDGES``: the real
vLLM and llama.cpp's llama-server on this CPU, beside the bundled SmolLM2) -- exported through
the judge, greedy output equal to the engine's target alone, drafted tokens accepted by the
engine's own counters (in vLLM at every position as our decoder accepts them, both in fp32),
the engine's log showing it read the draft as the family, and the same weights told to tap the
layers one above accepting less: the check that catches a layer-numbering bug between our taps
and the engine's.

Parametrised over the family and judge registries; each family's draft trains once (offline,
from one shared capture of the target's own answers) and is judged by every engine that serves
it. What a family or judge needs beyond its registry line is in ``helpers.families``."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagleforge.config import compose_config
from eagleforge.draft.config import DraftFamily
from eagleforge.families import FAMILIES, family_for
from eagleforge.formats.directory import read_architecture
from eagleforge.formats.gguf import read_gguf
from helpers.engine import edited_copy, evaluate_on_smollm2
from helpers.families import CASES, SERVES, serves
from helpers.runs import tiny_run_overrides

pytestmark = pytest.mark.engine

# the fixture that makes each judge's engine available (tests/engine/conftest.py)
ENGINE_FIXTURE = {"vllm": "engine_env", "llamacpp": "llama_server"}
# what the target computes in, in each engine: vLLM serves the HF directory in fp32 (so its
# acceptance can be compared with our decoder's), llama.cpp the bundled Q4_1 GGUF
ENGINE_DTYPE = {"vllm": "float32", "llamacpp": "q4_1"}


def pairs() -> list:  # type: ignore[type-arg]
    """Every (family, judge) the judge serves; slow where the family's case says so."""
    return [
        pytest.param(
            family.value,
            judge,
            id=f"{family.value}-{judge}",
            marks=[pytest.mark.slow] if judge in CASES[family].slow_in else [],
        )  # fmt: skip
        for family in FAMILIES
        for judge in SERVES
        if serves(judge, family_for(family))
    ]


@pytest.fixture(scope="module")
def trained(answers_store: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict:  # type: ignore[type-arg]
    """Each family's served draft, trained on first use and shared by its judges."""
    return {}


def trained_draft(family: DraftFamily, store: list[str], cache: dict, root: Path) -> Path:  # type: ignore[type-arg]
    if family not in cache:
        from eagleforge.train import run

        result = run(compose_config(tiny_run_overrides(
            root / family.value, *store, *CASES[family].served, "trainer.batch_size=6",
            "optimizer.lr=5e-3", name="train",
        )))  # fmt: skip
        assert result.checkpoint is not None
        cache[family] = result.checkpoint
    return cache[family]


@pytest.mark.parametrize(("name", "judge"), pairs())
def test_a_trained_draft_is_served_losslessly_and_accepted(
    request: pytest.FixtureRequest,
    answers_store: list[str],
    trained: dict,  # type: ignore[type-arg]
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
    name: str,
    judge: str,
) -> None:
    request.getfixturevalue(ENGINE_FIXTURE[judge])
    family = DraftFamily(name)
    case = CASES[family]
    checkpoint = trained_draft(family, answers_store, trained, tmp_path_factory.getbasetemp())
    taps = read_architecture(checkpoint).aux_layer_ids
    assert taps == [1, 14, 26]  # SmolLM2's default taps

    engines = "[hf,vllm]" if judge == "vllm" else f"[{judge}]"
    *ours, served = evaluate_on_smollm2(checkpoint, tmp_path / "served", engines)
    assert served.engine == judge and served.dtype == ENGINE_DTYPE[judge]
    assert served.greedy_matches_target is True
    assert served.rounds > 0 and served.acceptance_by_position[0] > 0.1, served
    if ours:  # the same draft in the same precision: the engine drafts what our decoder does
        (hf,) = ours
        assert hf.greedy_matches_target is True
        assert served.acceptance_by_position == pytest.approx(hf.acceptance_by_position, abs=0.03)
        assert all(rate > 0 for rate in hf.acceptance_by_position[:2]), hf.acceptance_by_position
    logs = tmp_path / "served" / "eval" / judge
    if judge == "vllm":  # exported as it trained: taps, mask token, shape
        exported = logs / "drafts" / checkpoint.name
        assert read_architecture(exported) == read_architecture(checkpoint)
    log = next(logs.glob("*-3-1-4.log")).read_text()
    case.log_check(judge, log, taps)
    if judge == "llamacpp":
        arch, _ = read_gguf(logs / "drafts" / checkpoint.name / "draft.gguf")
        assert arch.aux_layer_ids == taps  # llama.cpp's [2, 15, 27]: the input of a layer
        assert f"--spec-type {family_for(family).llamacpp_type}" in log

    # the negative control: the same weights told to tap the layers one above
    shifted = edited_copy(checkpoint, tmp_path / "shifted", case.shift_taps)
    (wrong,) = evaluate_on_smollm2(shifted, tmp_path / "wrong", f"[{judge}]", "eval.baseline=false")
    case.log_check(judge, next((tmp_path / "wrong" / "eval" / judge).glob("*-3-1-4.log")).read_text(),
                   [i + 1 for i in taps])  # fmt: skip
    assert wrong.tau < served.tau, (wrong.tau, served.tau)
