"""Regenerating one conversation, whatever the backend: turn order, conditioning on the
regenerated history, reasoning kept or dropped, several samples, failures."""

from __future__ import annotations

import pytest

from eagleforge.errors import ConfigError
from eagleforge.regeneration.backends import split_reasoning
from eagleforge.regeneration.config import RegenerateConfig
from eagleforge.regeneration.rows import Reply, RequestFailed, Row, regenerate_rows

pytestmark = pytest.mark.unit

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "human reply 1"},
    {"role": "user", "content": "More"},
    {"role": "assistant", "content": "human reply 2"},
]


def echo(histories: list[list[dict]]) -> list[Reply | RequestFailed]:  # type: ignore[type-arg]
    """Replies that say what they were conditioned on, with inline reasoning."""
    return [
        split_reasoning(
            f"<think>thought {len(h)}</think>reply after {[m['content'] for m in h]}", None
        )
        for h in histories
    ]


def test_turns_are_regenerated_in_order_on_the_new_history() -> None:
    out, failures = regenerate_rows([Row(0, "a", CONVERSATION)], echo, RegenerateConfig())
    messages = out[0]["messages"]
    assert [m["role"] for m in messages] == [m["role"] for m in CONVERSATION]
    assert messages[2]["content"] == "reply after ['Be brief.', 'Hi']"
    # the second reply saw the first *regenerated* reply, not the human one
    assert "human reply 1" not in messages[4]["content"]
    assert "reply after ['Be brief.', 'Hi']" in messages[4]["content"]
    assert "reasoning_content" not in messages[2] and failures == []


def test_reasoning_kept_and_samples_numbered() -> None:
    cfg = RegenerateConfig(keep_reasoning=True, num_samples=2, temperature=0.7)
    out, _ = regenerate_rows([Row(3, "a", CONVERSATION)], echo, cfg)
    assert [r["id"] for r in out] == ["a#0", "a#1"]
    assert out[0]["messages"][2]["reasoning_content"] == "thought 2"
    assert out[0]["messages"][2]["content"].startswith("reply after")


def test_a_failed_turn_leaves_its_conversation_out() -> None:
    def second_fails(histories: list[list[dict]]) -> list[Reply | RequestFailed]:  # type: ignore[type-arg]
        return [RequestFailed("HTTP 500") if len(h) > 2 else Reply("ok") for h in histories]

    rows = [Row(0, "a", CONVERSATION), Row(1, "b", CONVERSATION[:3])]
    out, failures = regenerate_rows(rows, second_fails, RegenerateConfig())
    assert [r["id"] for r in out] == ["b"]
    assert failures == [{"index": 0, "id": "a", "reason": "HTTP 500"}]


def test_identical_samples_are_refused() -> None:
    with pytest.raises(ConfigError, match="regenerate.temperature > 0"):
        RegenerateConfig(num_samples=3)


def test_max_turns_answers_the_first_turns_and_cuts_the_rest() -> None:
    out, _ = regenerate_rows([Row(0, "a", CONVERSATION)], echo, RegenerateConfig(max_turns=1))
    messages = out[0]["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    assert messages[2]["content"] == "reply after ['Be brief.', 'Hi']"
    with pytest.raises(ConfigError, match="regenerate.max_turns must be >= 0"):
        RegenerateConfig(max_turns=-1)
