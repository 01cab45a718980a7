"""What every backend does to a generated reply: a reply cut at max_new_tokens in the middle of
a multi-byte character (emoji, CJK) loses the partial character instead of carrying U+FFFD into
the data and into the next turn's prompt, and the hf and server backends give the same text
for the same tokens. The hf backend runs the real SmolLM2 tokenizer with a scripted model; the
server backend gets scripted HTTP replies."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from eagleforge.regeneration.backends import HFBackend, ServerBackend, finish_reply
from eagleforge.regeneration.config import RegenerateConfig
from eagleforge.regeneration.rows import Row, regenerate_rows

pytestmark = pytest.mark.unit

# Two assistant turns: the first is cut in the middle of a character, the second finishes.
CONVERSATION = [
    {"role": "user", "content": "Say hi in two languages."},
    {"role": "assistant", "content": "human reply 1"},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "human reply 2"},
]
FIRST = " Hi 😀 你好 🎉🎉 and more"  # leading space: no backend strips it
SECOND = "Done.\n"  # trailing newline: kept too


def cut_inside_a_character(tokenizer: Any, text: str) -> int:
    """The largest token count whose decode of ``text``'s tokens ends in a partial character."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    for n in reversed(range(1, len(ids))):
        if tokenizer.decode(ids[:n]).endswith("\ufffd"):
            return n
    raise AssertionError(f"no token boundary of {text!r} splits a character")


class ScriptedModel:
    """``generate`` that answers each call with the next scripted text (as tokens, cut at
    max_new_tokens, then eos and padding), recording the prompts it was given."""

    def __init__(self, tokenizer: Any, texts: list[str]) -> None:
        self.tokenizer, self.texts, self.prompts = tokenizer, list(texts), []

    def generate(
        self, input_ids: torch.Tensor, max_new_tokens: int, pad_token_id: int, **_: Any
    ) -> torch.Tensor:
        self.prompts += self.tokenizer.batch_decode(input_ids, skip_special_tokens=False)
        rows = []
        for _ in range(input_ids.shape[0]):
            ids = self.tokenizer(self.texts.pop(0), add_special_tokens=False)["input_ids"]
            rows.append((ids + [self.tokenizer.eos_token_id])[:max_new_tokens])
        width = max(len(r) for r in rows)
        new = torch.tensor([r + [pad_token_id] * (width - len(r)) for r in rows])
        return torch.cat([input_ids, new], dim=1)


def hf_backend(
    tokenizer: Any, cfg: RegenerateConfig, texts: list[str], monkeypatch: pytest.MonkeyPatch
) -> HFBackend:
    monkeypatch.setattr(tokenizer, "padding_side", "left")  # as regenerate.hf_backend sets it
    return HFBackend(cfg, ScriptedModel(tokenizer, texts), tokenizer, torch.device("cpu"), "m")


def server_backend(
    tokenizer: Any, cfg: RegenerateConfig, texts: list[str], monkeypatch: pytest.MonkeyPatch
) -> tuple[ServerBackend, list[dict[str, Any]]]:
    """A server backend whose endpoint answers like vLLM/SGLang: the decoded text of the cut
    tokens, with finish_reason "length" when the cut came first."""
    bodies: list[dict[str, Any]] = []

    def request(self: ServerBackend, url: str, body: dict[str, Any] | None) -> dict[str, Any]:
        assert body is not None
        bodies.append(body)
        ids = tokenizer(texts.pop(0), add_special_tokens=False)["input_ids"]
        cut = len(ids) >= body["max_tokens"]
        text = tokenizer.decode(ids[: body["max_tokens"]])
        return {
            "choices": [
                {"message": {"content": text}, "finish_reason": "length" if cut else "stop"}
            ]
        }

    monkeypatch.setattr(ServerBackend, "_request", request)
    return ServerBackend(RegenerateConfig(**{**cfg.__dict__, "model": "m"})), bodies


def test_hf_reply_cut_inside_a_character_has_no_replacement_char(
    smollm2_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = cut_inside_a_character(smollm2_tokenizer, FIRST)
    cfg = RegenerateConfig(max_new_tokens=n)
    backend = hf_backend(smollm2_tokenizer, cfg, [FIRST, SECOND], monkeypatch)
    out, _ = regenerate_rows([Row(0, "a", CONVERSATION)], backend, cfg)
    first = out[0]["messages"][1]["content"]
    assert "\ufffd" not in first and first and FIRST.startswith(first)
    # the second turn was generated on the clean first reply
    assert "\ufffd" not in backend.model.prompts[1] and first in backend.model.prompts[1]  # type: ignore[attr-defined]
    assert out[0]["messages"][3]["content"] == SECOND


def test_server_reply_cut_inside_a_character_has_no_replacement_char(
    smollm2_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = cut_inside_a_character(smollm2_tokenizer, FIRST)
    cfg = RegenerateConfig(max_new_tokens=n)
    backend, bodies = server_backend(smollm2_tokenizer, cfg, [FIRST, SECOND], monkeypatch)
    out, _ = regenerate_rows([Row(0, "a", CONVERSATION)], backend, cfg)
    first = out[0]["messages"][1]["content"]
    assert "\ufffd" not in first and first and FIRST.startswith(first)
    assert bodies[1]["messages"][1]["content"] == first  # the next turn saw the clean text


@pytest.mark.parametrize("cut", [True, False])
def test_hf_and_server_backends_give_the_same_rows(
    smollm2_tokenizer: Any, monkeypatch: pytest.MonkeyPatch, cut: bool
) -> None:
    n = cut_inside_a_character(smollm2_tokenizer, FIRST) if cut else 64
    cfg = RegenerateConfig(max_new_tokens=n)
    hf = hf_backend(smollm2_tokenizer, cfg, [FIRST, SECOND], monkeypatch)
    server, _ = server_backend(smollm2_tokenizer, cfg, [FIRST, SECOND], monkeypatch)
    rows = [Row(0, "a", CONVERSATION)]
    out, failures = regenerate_rows(rows, server, cfg)
    assert regenerate_rows(rows, hf, cfg) == (out, failures)
    if not cut:  # whole replies come back exactly as generated, whitespace included
        assert [m["content"] for m in out[0]["messages"][1::2]] == [FIRST, SECOND]


def test_finish_reply_trims_only_a_cut_reply() -> None:
    assert finish_reply("ok \ufffd", None, cut=True).content == "ok "
    assert finish_reply("ok \ufffd", None, cut=False).content == "ok \ufffd"
    reply = finish_reply("<think> plan </think>\n Answer", None, cut=False)
    assert (reply.content, reply.reasoning) == ("Answer", "plan")


class LengthModel:
    """``generate`` that answers each row with its prompt's token count, recording the rows'
    widths of every batch (the padded prompt length)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.widths = tokenizer, []

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **_: Any) -> Any:
        self.widths.append(int(input_ids.shape[1]))
        rows = [
            self.tokenizer(f"{int(m.sum())}", add_special_tokens=False)["input_ids"]
            + [self.tokenizer.eos_token_id]
            for m in attention_mask
        ]
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id
        return torch.cat([input_ids, torch.tensor([r + [pad] * (width - len(r)) for r in rows])], 1)


def test_hf_batches_similar_lengths_and_answers_in_order(
    smollm2_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(smollm2_tokenizer, "padding_side", "left")
    model = LengthModel(smollm2_tokenizer)
    backend = HFBackend(RegenerateConfig(batch_size=2), model, smollm2_tokenizer, torch.device("cpu"), "m")  # fmt: skip
    words = [40, 1, 41, 2]  # long, short, long, short
    histories = [[{"role": "user", "content": "word " * n}] for n in words]
    replies = backend(histories)
    lengths = [
        len(smollm2_tokenizer.apply_chat_template(h, tokenize=True, add_generation_prompt=True, return_dict=False))
        for h in histories
    ]  # fmt: skip
    assert [r.content for r in replies] == [str(n) for n in lengths]  # type: ignore[union-attr]
    # the two short prompts went together, then the two long ones
    assert model.widths == [max(lengths[1], lengths[3]), max(lengths[0], lengths[2])]
