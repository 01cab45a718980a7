"""The evaluation table says what is true about greedy outputs: ``equal``, or ``differs`` with
the dtype and whether that is expected (bf16, fp16) or a bug (fp32); in eagleforge's decoder,
in the vLLM judge and in the table across prompt sets."""

from __future__ import annotations

import pytest

from eagleforge.engine.client import SpecCounters
from eagleforge.speculative.config import DecodeSettings
from eagleforge.speculative.decoder import DecodeResult
from eagleforge.speculative.engine_judge import EnginePass, EngineRun, summarise_engine
from eagleforge.speculative.prompts import PromptItem, PromptSet
from eagleforge.speculative.report import Summary, TurnRecord, sets_table, summarise, table

pytestmark = pytest.mark.unit


def greedy_summary(equal: bool, dtype: str) -> Summary:
    """Two greedy turns decoded by a draft in ``dtype``; the second one's output differs from
    the target alone's unless ``equal``."""
    records = [
        TurnRecord(
            "p",
            turn,
            3,
            DecodeResult([5, 6, 7], 0.01, 2, accepted_lengths=[1, 0]),
            DecodeResult([5, 6, 7] if equal or turn == 0 else [5, 6, 8], 0.02, 3),
        )  # fmt: skip
        for turn in range(2)
    ]
    return summarise("step_00000150", records, 1, greedy=True, dtype=dtype)


def greedy_row(text: str) -> str:
    (row,) = [line for line in text.splitlines() if line.startswith("greedy output = target's")]
    return row.removeprefix("greedy output = target's").strip()


@pytest.mark.parametrize(
    ("equal", "dtype", "row", "cell"),
    [
        (True, "bfloat16", "equal", "equal"),
        (True, "float32", "equal", "equal"),
        (False, "bfloat16", "differs — bf16, as expected", "differs (bf16)"),
        (False, "float16", "differs — fp16, as expected", "differs (fp16)"),
        (False, "float32", "differs — float32, a bug: please report it", "differs (float32)"),
        (False, "", "differs", "differs"),
    ],
)
def test_the_greedy_row_says_what_is_true(equal: bool, dtype: str, row: str, cell: str) -> None:
    summary = greedy_summary(equal, dtype)
    assert greedy_row(table(summary)) == row
    assert "True" not in table(summary) and "False" not in table(summary)
    assert f"| {cell} " in sets_table([summary])


def test_a_sampled_run_is_not_checked() -> None:
    records = [TurnRecord("p", 0, 3, DecodeResult([5], 0.01, 1, accepted_lengths=[0]), None)]
    summary = summarise("d", records, 1, greedy=False, dtype="bfloat16")
    assert greedy_row(table(summary)) == "-"


def test_the_vllm_judge_names_its_dtype() -> None:
    prompts = PromptSet("set", "file", [PromptItem("0", "c", ["q"])])
    served = EnginePass({("0", 0): [1, 2, 3]}, {("0", 0): 5}, 3, 1.0)
    alone = EnginePass({("0", 0): [1, 2, 4]}, {("0", 0): 5}, 3, 2.0)
    summary = summarise_engine(
        "d", prompts, DecodeSettings(4, 3, 1, 3, 0.0),
        EngineRun(served, None, SpecCounters(1, 3, 1, [1.0])), EngineRun(alone, None, None),
        batch=1, dtype="bfloat16",
    )  # fmt: skip
    assert greedy_row(table(summary)) == "differs — bf16, as expected"
