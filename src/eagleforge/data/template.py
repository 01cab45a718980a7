"""Chat template rendering and the token-level loss mask.

The conversation is rendered with the tokenizer's own chat template. Each assistant turn's
supervised span is its content plus the template's end-of-turn marker (e.g. ``<|im_end|>``).
The text is cut at span edges and each piece is tokenized on its own, so the supervised
tokens decode to exactly that span -- as at serving time, where the prompt is tokenized
and the reply is generated token by token, no BPE merge crosses the boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagleforge.data.conversations import Conversation
from eagleforge.errors import DataError

_PROBE = "EAGLEFORGE_PROBE_REPLY"


def end_of_turn_marker(tokenizer) -> str:  # type: ignore[no-untyped-def]
    """The text the template puts right after an assistant reply (whitespace excluded)."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}],
        tokenize=False,
    )
    tail = rendered[rendered.rindex(_PROBE) + len(_PROBE) :]
    return tail.rstrip()


@dataclass
class Rendered:
    """A conversation as text plus the [start, end) character spans to supervise."""

    text: str
    spans: list[tuple[int, int]]

    def segments(self) -> list[tuple[str, bool]]:
        """The text cut at span edges: (piece, supervised) in order."""
        pieces, cursor = [], 0
        for start, end in self.spans:
            if start > cursor:
                pieces.append((self.text[cursor:start], False))
            pieces.append((self.text[start:end], True))
            cursor = end
        if cursor < len(self.text):
            pieces.append((self.text[cursor:], False))
        return pieces


def render(
    messages: Conversation,
    tokenizer,  # type: ignore[no-untyped-def]
    eot_marker: str,
    train_only_last_turn: bool,
    where: str,
) -> Rendered:
    """Render with the chat template and locate every supervised assistant span.

    A reply starts where the template's generation prompt for the conversation so far ends
    (what the model would generate from there), and ends after the end-of-turn marker that
    follows its content. Templates whose earlier turns render differently once later turns
    exist (e.g. reasoning dropped from history) fall back to searching for the reply after
    the preceding messages' content.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans: list[tuple[int, int]] = []
    cursor = 0  # everything before it belongs to earlier messages
    for index, message in enumerate(messages):
        content = message["content"].strip()
        if message["role"] != "assistant":
            found = text.find(content, cursor) if content else -1
            cursor = found + len(content) if found >= 0 else cursor
            continue
        if not content:  # nothing to learn from an empty reply
            continue
        prompt = tokenizer.apply_chat_template(
            messages[:index], tokenize=False, add_generation_prompt=True
        )
        start = len(prompt) if text.startswith(prompt) and len(prompt) >= cursor else None
        found = text.find(content, cursor if start is None else start)
        if found < 0:
            raise DataError(
                f"{where}: assistant turn {index} does not appear verbatim in the rendered chat "
                "template; the template rewrites it (set data.train_only_last_turn or fix the data)."
            )
        end = found + len(content)
        after = text[end:]
        gap = len(after) - len(after.lstrip())  # whitespace the template kept from the reply
        if eot_marker and after.startswith(eot_marker, gap):
            end += gap + len(eot_marker)
        spans.append((found if start is None else start, end))
        cursor = end
    if train_only_last_turn:
        spans = spans[-1:]
    return Rendered(text, spans)


def tokenize_rendered(
    batch: list[Rendered], tokenizer, max_length: int
) -> list[tuple[list[int], list[int]]]:  # type: ignore[no-untyped-def]
    """Token ids and 0/1 loss mask per conversation, truncated to ``max_length`` tokens."""
    flat: list[str] = []
    owners: list[tuple[int, bool]] = []
    for index, rendered in enumerate(batch):
        for piece, supervised in rendered.segments():
            flat.append(piece)
            owners.append((index, supervised))
    encoded = tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else []
    out: list[tuple[list[int], list[int]]] = [([], []) for _ in batch]
    for (index, supervised), ids in zip(owners, encoded, strict=True):
        out[index][0].extend(ids)
        out[index][1].extend([int(supervised)] * len(ids))
    return [(ids[:max_length], mask[:max_length]) for ids, mask in out]
