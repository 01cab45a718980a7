"""Chat-template rendering and the token loss mask, with the real SmolLM2 tokenizer (ChatML):
each assistant turn's supervised tokens decode to exactly its content + "<|im_end|>", and
everything else (system, user, role headers) is unsupervised."""

from __future__ import annotations

import pytest

from eagleforge.data.template import TokenizerTemplate, end_of_turn_marker, tokenize_rendered
from helpers.masks import decode, supervised_runs

pytestmark = pytest.mark.unit

EOT = "<|im_end|>"

TWO_TURNS = [
    {"role": "system", "content": "You are a terse math tutor."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "Four, since two plus two is four."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "It is 6."},
]

THREE_TURNS = [
    {"role": "system", "content": "You answer questions about the weather."},
    {"role": "user", "content": "Is it raining in Paris?"},
    {"role": "assistant", "content": "Yes, light rain since this morning."},
    {"role": "user", "content": "Should I take an umbrella?"},
    {"role": "assistant", "content": "An umbrella would be wise today.\nMaybe boots too."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You're welcome, stay dry!"},
]

NO_SYSTEM = [
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi! How can I help you today?"},
]

# Pieces whose first characters could merge with the preceding "\n" or space in one BPE run.
BOUNDARY = [
    {"role": "user", "content": "Start with punctuation please"},
    {"role": "assistant", "content": "...well, 'quoted' words\n\nand a blank line."},
    {"role": "user", "content": "Numbers?"},
    {"role": "assistant", "content": "123 456"},
]


def _tokenize(messages, tokenizer, train_only_last_turn=False, max_length=4096):  # type: ignore[no-untyped-def]
    rendered = TokenizerTemplate(tokenizer).render(messages, "test")
    if train_only_last_turn:
        rendered = rendered.last_turn_only()
    ids, mask = tokenize_rendered([rendered], tokenizer)[0]
    return rendered, ids[:max_length], mask[:max_length]


def test_end_of_turn_marker_is_im_end(smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The ChatML template's end-of-turn marker is "<|im_end|>"."""
    assert end_of_turn_marker(smollm2_tokenizer) == EOT


@pytest.mark.parametrize(
    "messages",
    [TWO_TURNS, THREE_TURNS, NO_SYSTEM, BOUNDARY],
    ids=["two", "three", "nosys", "boundary"],
)
def test_each_assistant_turn_supervised_exactly(smollm2_tokenizer, messages) -> None:  # type: ignore[no-untyped-def]
    """One supervised run per assistant turn, decoding to content + "<|im_end|>"; all ids decode
    to the rendered text; the mask has one 0/1 per id."""
    rendered, ids, mask = _tokenize(messages, smollm2_tokenizer)
    assert rendered.text == smollm2_tokenizer.apply_chat_template(messages, tokenize=False)
    assert len(ids) == len(mask)
    assert set(mask) == {0, 1}
    assert decode(smollm2_tokenizer, ids) == rendered.text
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    assert [decode(smollm2_tokenizer, run) for run in supervised_runs(ids, mask)] == [
        r + EOT for r in replies
    ]


@pytest.mark.parametrize(
    "messages", [TWO_TURNS, THREE_TURNS, NO_SYSTEM], ids=["two", "three", "nosys"]
)
def test_prompt_parts_unsupervised(smollm2_tokenizer, messages) -> None:  # type: ignore[no-untyped-def]
    """System and user contents and the role headers all lie in unsupervised tokens; the
    sample starts unsupervised and the "\\n" after each "<|im_end|>" is unsupervised."""
    _, ids, mask = _tokenize(messages, smollm2_tokenizer)
    unsupervised = decode(smollm2_tokenizer, [t for t, m in zip(ids, mask, strict=True) if not m])
    supervised = decode(smollm2_tokenizer, [t for t, m in zip(ids, mask, strict=True) if m])
    for message in messages:
        if message["role"] != "assistant":
            assert message["content"] in unsupervised
            assert message["content"] not in supervised
    assert "<|im_start|>" not in supervised
    assert "assistant\n" not in supervised
    assert unsupervised.count("<|im_start|>assistant\n") == sum(
        m["role"] == "assistant" for m in messages
    )
    assert mask[0] == 0
    assert mask[-1] == 0  # the trailing "\n"
    if messages[0]["role"] != "system":  # the template's default system prompt
        assert "You are a helpful AI assistant" in unsupervised


def test_train_only_last_turn(smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """train_only_last_turn=True supervises the last assistant turn only, with the same ids."""
    _, ids_all, mask_all = _tokenize(THREE_TURNS, smollm2_tokenizer)
    _, ids, mask = _tokenize(THREE_TURNS, smollm2_tokenizer, train_only_last_turn=True)
    assert [decode(smollm2_tokenizer, run) for run in supervised_runs(ids, mask)] == [
        "You're welcome, stay dry!" + EOT
    ]
    assert ids == ids_all
    last_run_start = max(i for i in range(len(mask_all)) if mask_all[i] and not mask_all[i - 1])
    assert mask == [0] * last_run_start + mask_all[last_run_start:]


def test_max_length_truncates_tail(smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """max_length keeps the first max_length ids and mask values; a larger limit keeps all."""
    _, ids, mask = _tokenize(THREE_TURNS, smollm2_tokenizer)
    cut = len(ids) - 7
    _, short_ids, short_mask = _tokenize(THREE_TURNS, smollm2_tokenizer, max_length=cut)
    assert len(short_ids) == len(short_mask) == cut
    assert short_ids == ids[:cut]
    assert short_mask == mask[:cut]
    _, long_ids, long_mask = _tokenize(THREE_TURNS, smollm2_tokenizer, max_length=len(ids) + 50)
    assert (long_ids, long_mask) == (ids, mask)


def test_batch_tokenization_equals_single(smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """tokenize_rendered on several conversations at once gives each one's single result."""
    template = TokenizerTemplate(smollm2_tokenizer)
    convs = [TWO_TURNS, THREE_TURNS, NO_SYSTEM]
    batch = [template.render(c, f"c{i}") for i, c in enumerate(convs)]
    together = tokenize_rendered(batch, smollm2_tokenizer)
    alone = [tokenize_rendered([r], smollm2_tokenizer)[0] for r in batch]
    assert together == alone


def test_leading_whitespace_reply(smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """A reply with leading spaces: the supervised run is the whole reply as the model would
    generate it after the generation prompt (spaces included) + "<|im_end|>"."""
    messages = [
        {"role": "user", "content": "Say hello"},
        {"role": "assistant", "content": "  hello world"},
    ]
    rendered, ids, mask = _tokenize(messages, smollm2_tokenizer)
    assert decode(smollm2_tokenizer, ids) == rendered.text
    assert [decode(smollm2_tokenizer, run) for run in supervised_runs(ids, mask)] == [
        "  hello world" + EOT
    ]


def test_empty_reply_not_supervised(smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """An empty (or whitespace-only) assistant reply adds no supervised tokens."""
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "   "},
        {"role": "user", "content": "Still there?"},
        {"role": "assistant", "content": "Yes."},
    ]
    _, ids, mask = _tokenize(messages, smollm2_tokenizer)
    assert [decode(smollm2_tokenizer, run) for run in supervised_runs(ids, mask)] == ["Yes." + EOT]


def test_trailing_whitespace_reply_still_supervises_end_of_turn(smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """A reply ending in "\\n" is still supervised through its "<|im_end|>"."""
    messages = [
        {"role": "user", "content": "Give me a line"},
        {"role": "assistant", "content": "Here is a line.\n"},
    ]
    _, ids, mask = _tokenize(messages, smollm2_tokenizer)
    runs = [decode(smollm2_tokenizer, run) for run in supervised_runs(ids, mask)]
    assert len(runs) == 1
    assert runs[0].endswith(EOT)
    assert runs[0][: -len(EOT)].strip() == "Here is a line."


@pytest.mark.parametrize(
    "messages",
    [
        [
            {"role": "user", "content": "Reply with just: Sure"},
            {"role": "assistant", "content": "Sure"},
        ],
        # "Hugging Face" ends the template's default system prompt, right before <|im_end|>.
        [
            {"role": "user", "content": "Who trained you?"},
            {"role": "assistant", "content": "Hugging Face"},
        ],
    ],
    ids=["in-user-turn", "in-default-system-prompt"],
)
def test_reply_text_occurring_earlier_is_not_matched_there(smollm2_tokenizer, messages) -> None:  # type: ignore[no-untyped-def]
    """The supervised run is the assistant's own turn (after its header), never earlier text."""
    rendered, ids, mask = _tokenize(messages, smollm2_tokenizer)
    header = rendered.text.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")
    assert [start >= header for start, _ in rendered.spans] == [True]
    unsupervised = decode(smollm2_tokenizer, [t for t, m in zip(ids, mask, strict=True) if not m])
    assert messages[0]["content"] in unsupervised
