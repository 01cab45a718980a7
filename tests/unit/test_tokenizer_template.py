"""``TokenizerTemplate`` (``data.template=auto``): the tokenizer's own chat template. The fast path
(one render with sentinel replies) and the slow path (turn by turn) must find the same spans; the
slow path must still work when the template trims or rewrites replies; templates that reject a
conversation give a DataError naming the row."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from eagleforge.data.named_templates import TEMPLATES
from eagleforge.data.rendered import Rendered
from eagleforge.data.template import (
    TokenizerTemplate,
    end_of_turn_marker,
    generation_prompt,
    make_renderer,
    tokenize_rendered,
)
from eagleforge.errors import ConfigError, DataError
from helpers.masks import supervised_text

pytestmark = pytest.mark.unit

HEADER = "<|im_start|>assistant\n"
EOT = "<|im_end|>"

CONVERSATIONS = {
    "system": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ],
    "no-system": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ],
    "multi-turn": [
        {"role": "system", "content": "You answer questions about the weather."},
        {"role": "user", "content": "Is it raining in Paris?"},
        {"role": "assistant", "content": "Yes, light rain since this morning."},
        {"role": "user", "content": "Should I take an umbrella?"},
        {"role": "assistant", "content": "An umbrella would be wise.\nMaybe boots too."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome!"},
    ],
    "whitespace": [
        {"role": "user", "content": "Indent it"},
        {"role": "assistant", "content": "   indented"},
        {"role": "user", "content": "Now end with newlines"},
        {"role": "assistant", "content": "done\n\n"},
        {"role": "user", "content": "Both"},
        {"role": "assistant", "content": "\n  both \n"},
    ],
    "reply-in-user-turn": [
        {"role": "user", "content": "Reply with just: Sure"},
        {"role": "assistant", "content": "Sure"},
        {"role": "user", "content": "Again: Sure"},
        {"role": "assistant", "content": "Sure"},
    ],
    "reply-in-system": [
        {"role": "system", "content": "Always answer OK."},
        {"role": "user", "content": "Ready?"},
        {"role": "assistant", "content": "OK"},
    ],
    "empty-reply-between": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "  "},
        {"role": "user", "content": "Hello?"},
        {"role": "assistant", "content": "Here."},
    ],
    "reasoning-field": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
    ],
}

# The supervised text of each conversation with SmolLM2's ChatML template: everything after the
# generation prompt through <|im_end|>.
EXPECTED_SPANS = {
    "system": ["Hello!<|im_end|>"],
    "no-system": ["Hello!<|im_end|>"],
    "multi-turn": [
        "Yes, light rain since this morning.<|im_end|>",
        "An umbrella would be wise.\nMaybe boots too.<|im_end|>",
        "You're welcome!<|im_end|>",
    ],
    "whitespace": ["   indented<|im_end|>", "done\n\n<|im_end|>", "\n  both \n<|im_end|>"],
    "reply-in-user-turn": ["Sure<|im_end|>", "Sure<|im_end|>"],
    "reply-in-system": ["OK<|im_end|>"],
    "empty-reply-between": ["Here.<|im_end|>"],
    "reasoning-field": ["4<|im_end|>"],
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_fast_and_slow_paths_agree(smollm2_tokenizer, name: str) -> None:  # type: ignore[no-untyped-def]
    """The sentinel path succeeds and gives the same Rendered as the turn-by-turn path; both
    give the expected supervised text, each span starting right after a generation prompt."""
    messages = CONVERSATIONS[name]
    template = TokenizerTemplate(smollm2_tokenizer)
    text = template._apply(messages, "w")
    assert text == smollm2_tokenizer.apply_chat_template(messages, tokenize=False)
    fast = template._render_with_sentinels(messages, text, "w")
    slow = template._render_turn_by_turn(messages, text, "w")
    assert fast is not None
    assert fast == slow
    assert template.render(messages, "w") == fast
    assert supervised_text(fast) == EXPECTED_SPANS[name]
    assert all(text[:start].endswith(HEADER) for start, _ in fast.spans)


def test_render_does_not_mutate_messages(smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The sentinel render works on copies: the caller's messages are unchanged."""
    messages = copy.deepcopy(CONVERSATIONS["multi-turn"])
    TokenizerTemplate(smollm2_tokenizer).render(messages, "w")
    assert messages == CONVERSATIONS["multi-turn"]


def test_generation_prompt_and_end_marker(smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """SmolLM2: the generation prompt is "<|im_start|>assistant\\n", the end marker "<|im_end|>"."""
    assert generation_prompt(smollm2_tokenizer) == HEADER
    assert end_of_turn_marker(smollm2_tokenizer) == EOT
    template = TokenizerTemplate(smollm2_tokenizer)
    assert (template.header, template.eot_marker) == (HEADER, EOT)
    preformatted = make_renderer("auto", smollm2_tokenizer, preformatted=True)
    assert (preformatted.reply_starts, preformatted.reply_ends) == ((HEADER,), (EOT,))


class FakeChatML:
    """A ChatML tokenizer stand-in whose template transforms assistant replies like real ones do:
    ``trim`` strips them (Llama 3's ``| trim``), ``think`` puts the reasoning in a think block
    before the reply, ``echo`` repeats the last reply in a closing system note, ``upper``
    rewrites replies beyond recognition."""

    chat_template = "fake"

    def __init__(
        self, trim: bool = False, think: bool = False, echo: bool = False, upper: bool = False
    ) -> None:
        self.trim, self.think, self.echo, self.upper = trim, think, echo, upper

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tokenize: bool = False,
        add_generation_prompt: bool = False,
    ) -> str:
        assert tokenize is False
        out = ""
        for message in messages:
            content = message["content"]
            if message["role"] == "assistant":
                if self.trim:
                    content = content.strip()
                if self.upper:
                    content = content.upper()
                if self.think and message.get("reasoning_content"):
                    content = f"<think>\n{message['reasoning_content']}\n</think>\n\n{content}"
            out += f"<|im_start|>{message['role']}\n{content}<|im_end|>\n"
        if self.echo and messages and messages[-1]["role"] == "assistant":
            out += f"<|im_start|>system\nlast reply: {messages[-1]['content']}<|im_end|>\n"
        if add_generation_prompt:
            out += HEADER
        return out


TRANSFORMED = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "  Hello!  "},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4\n", "reasoning_content": "Add them."},
]


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"trim": True}, ["Hello!<|im_end|>", "4<|im_end|>"]),
        (
            {"trim": True, "think": True},
            ["Hello!<|im_end|>", "<think>\nAdd them.\n</think>\n\n4<|im_end|>"],
        ),
        ({"echo": True}, ["  Hello!  <|im_end|>", "4\n<|im_end|>"]),
    ],
    ids=["trim", "trim+think", "echo"],
)
def test_transforming_template_uses_slow_path(options: dict, expected: list[str]) -> None:
    """A template that trims replies (or shows one twice) defeats the sentinel path (None);
    the turn-by-turn path still finds each reply after its own generation prompt."""
    tokenizer = FakeChatML(**options)
    template = TokenizerTemplate(tokenizer)
    text = template._apply(TRANSFORMED, "w")
    assert template._render_with_sentinels(TRANSFORMED, text, "w") is None
    rendered = template.render(TRANSFORMED, "w")
    assert rendered == template._render_turn_by_turn(TRANSFORMED, text, "w")
    assert rendered.text == text
    assert supervised_text(rendered) == expected
    assert all(text[:start].endswith(HEADER) for start, _ in rendered.spans)


def test_think_block_without_trim_uses_fast_path() -> None:
    """A think block the template adds around an untouched reply is supervised on the fast path
    (the span starts at the generation prompt, not at the reply)."""
    template = TokenizerTemplate(FakeChatML(think=True))
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
    ]
    text = template._apply(messages, "w")
    fast = template._render_with_sentinels(messages, text, "w")
    assert fast is not None
    assert fast == template._render_turn_by_turn(messages, text, "w")
    assert supervised_text(fast) == ["<think>\nAdd them.\n</think>\n\n4<|im_end|>"]


def test_rewritten_reply_raises_data_error() -> None:
    """A template that rewrites a reply so it no longer appears verbatim gives a DataError naming
    the row and the turn, pointing at named templates."""
    template = TokenizerTemplate(FakeChatML(upper=True))
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
    with pytest.raises(DataError) as info:
        template.render(messages, "rows.jsonl:4")
    message = str(info.value)
    assert message.startswith("rows.jsonl:4: assistant turn 1 ")
    assert "data.template" in message


ALTERNATING = (
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _with_template(tokenizer, chat_template: str | None):  # type: ignore[no-untyped-def]
    clone = copy.deepcopy(tokenizer)
    clone.chat_template = chat_template
    return clone


def test_template_exception_becomes_data_error(smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """A Jinja raise_exception (roles must alternate) gives a DataError naming the row and quoting
    the template's message; a valid conversation still renders."""
    tokenizer = _with_template(smollm2_tokenizer, ALTERNATING)
    template = TokenizerTemplate(tokenizer)
    good = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert supervised_text(template.render(good, "w")) == ["Hello!<|im_end|>"]
    bad = [
        {"role": "user", "content": "Hi"},
        {"role": "user", "content": "Anyone?"},
        {"role": "assistant", "content": "Hello!"},
    ]
    with pytest.raises(DataError) as info:
        template.render(bad, "data/rows.jsonl:12")
    message = str(info.value)
    assert message.startswith("data/rows.jsonl:12: the chat template rejects this conversation")
    assert "roles must alternate" in message


@pytest.mark.parametrize("chat_template", [None, ""])
def test_tokenizer_without_chat_template(smollm2_tokenizer, chat_template) -> None:  # type: ignore[no-untyped-def]
    """No chat template: ConfigError listing every named template for data.template."""
    tokenizer = _with_template(smollm2_tokenizer, chat_template)
    with pytest.raises(ConfigError) as info:
        TokenizerTemplate(tokenizer)
    message = str(info.value)
    assert "data.template" in message
    assert ", ".join(sorted(TEMPLATES)) in message
    with pytest.raises(ConfigError):
        make_renderer("auto", tokenizer)
    assert make_renderer("chatml", tokenizer) is TEMPLATES["chatml"]


def test_unknown_template_name(smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """An unknown data.template is a ConfigError listing auto and the named templates."""
    with pytest.raises(ConfigError, match="auto or one of chatml"):
        make_renderer("vicuna", smollm2_tokenizer)


def test_tokenize_rendered_empty_and_unsupervised(smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """tokenize_rendered: an empty batch gives []; a Rendered with no spans is all zeros."""
    assert tokenize_rendered([], smollm2_tokenizer) == []
    [(ids, mask)] = tokenize_rendered(
        [Rendered("<|im_start|>user\nHi<|im_end|>\n", [])], smollm2_tokenizer
    )
    assert len(ids) == len(mask) > 0
    assert set(mask) == {0}


# Phi-3 / Phi-3.5's template: eos after the whole conversation unless add_generation_prompt.
PHI3_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ '<|endoftext|>' }}{% endif %}"
)
# Llama 2 chat's template (system handling left out): " " + reply + " " + eos.
LLAMA2_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<s>[INST] ' + message['content'].strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'].strip() + ' </s>' }}"
    "{% endif %}{% endfor %}"
)
TWO_TURNS = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]


def test_phi3_style_template_end_markers(smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Every reply, not only the last, is supervised through its own "<|end|>"."""
    template = TokenizerTemplate(_with_template(smollm2_tokenizer, PHI3_TEMPLATE))
    rendered = template.render(TWO_TURNS, "w")
    assert supervised_text(rendered) == ["Hello!<|end|>", "4<|end|>"]
    assert template.header == "<|assistant|>\n"


def test_llama2_style_template_supervises_eos(smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Each reply's span runs through the eos that closes it."""
    template = TokenizerTemplate(_with_template(smollm2_tokenizer, LLAMA2_TEMPLATE))
    rendered = template.render(TWO_TURNS, "w")
    assert [part.rstrip().endswith("</s>") for part in supervised_text(rendered)] == [True, True]
