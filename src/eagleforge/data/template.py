"""Rendering conversations with a chat template, and tokenizing with a token-exact loss mask.

A renderer turns messages into a ``Rendered`` (text + supervised character spans):

- ``TokenizerTemplate``: the tokenizer's own Jinja chat template (``data.template=auto``).
  A reply's span starts where the template's generation prompt ends (so a think block the
  model generates is supervised) and ends after the end-of-turn marker that follows it.
- a ``NamedTemplate`` (``data.template=<name>``, see ``named_templates.py``).
- ``PreformattedText`` (``data.preformatted=true``): text already templated; replies are found
  between the template's reply-start and end-of-turn markers.
- ``VisionTemplate`` (``data.is_vlm=true``): the processor's chat template of a vision-language
  target, images written as the template's placeholders; ``expand_images`` then widens each
  placeholder token to the number of tokens the vision tower fills in for that image.

Tokenization cuts the text at span edges and tokenizes each piece on its own, so the
supervised tokens decode to exactly the reply -- as at serving time, where the prompt is
tokenized and the reply generated token by token, no BPE merge crosses the boundary.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from eagleforge.data.conversations import Conversation, RowError, SkipReason
from eagleforge.data.named_templates import TEMPLATES
from eagleforge.data.rendered import Rendered
from eagleforge.errors import ConfigError, DataError

_PROBE = "EAGLEFORGE_PROBE_REPLY"
_PROBE_USER = "EAGLEFORGE_PROBE_USER"
# Private-use code points: never produced by real text, survive any Jinja filter but trim.
_SENTINEL = "\ue000{}\ue001"


def end_of_turn_marker(tokenizer: Any) -> str:
    """The marker the template puts right after an assistant reply, e.g. ``<|im_end|>``.

    Probed with the reply last and with a turn after it, so text that only closes the whole
    conversation (Phi-3's ``<|endoftext|>``) is not taken for the marker; leading whitespace
    (Llama 2's `` </s>``) is left out, as replies are matched up to the marker over whitespace.
    """
    user = {"role": "user", "content": _PROBE_USER}
    reply = {"role": "assistant", "content": _PROBE}
    tails = []
    for messages in ([user, reply], [user, reply, user]):
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
        at = rendered.index(_PROBE) + len(_PROBE)
        tails.append(rendered[at:])
    common = os.path.commonprefix(tails).strip()
    return common.split(maxsplit=1)[0] if common else ""


def generation_prompt(tokenizer: Any) -> str:
    """What ``add_generation_prompt`` adds after a user turn, e.g. ``<|im_start|>assistant\\n``."""
    user = [{"role": "user", "content": _PROBE_USER}]
    plain = tokenizer.apply_chat_template(user, tokenize=False)
    prompted = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    if prompted.startswith(plain):
        return str(prompted[len(plain) :])
    # The plain rendering closes the conversation (e.g. with eos): the header is what follows
    # the user turn's own end marker in the prompted rendering.
    after_user = prompted.rindex(_PROBE_USER) + len(_PROBE_USER)
    end = _extend_over_end_marker(prompted, after_user, end_of_turn_marker(tokenizer))
    return str(prompted[end:].lstrip())


def _extend_over_end_marker(text: str, end: int, eot_marker: str) -> int:
    """Move ``end`` past whitespace the template kept from the reply and the end-of-turn marker."""
    after = text[end:]
    gap = len(after) - len(after.lstrip())
    if eot_marker and after.startswith(eot_marker, gap):
        return end + gap + len(eot_marker)
    return end


class TokenizerTemplate:
    """The tokenizer's own chat template."""

    name = "auto"

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "the tokenizer has no chat template: set data.template to one of "
                f"{', '.join(sorted(TEMPLATES))}."
            )
        self.tokenizer = tokenizer
        self.eot_marker = end_of_turn_marker(tokenizer)
        self.header = generation_prompt(tokenizer)

    def _apply(self, messages: Conversation, where: str, **kwargs: Any) -> str:
        try:
            return str(self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs))
        except Exception as e:  # Jinja raises for conversations the template rejects
            raise DataError(f"{where}: the chat template rejects this conversation: {e}") from None

    def render(self, messages: Conversation, where: str) -> Rendered:
        text = self._apply(messages, where)
        fast = self._render_with_sentinels(messages, text, where)
        return fast if fast is not None else self._render_turn_by_turn(messages, text, where)

    def _render_with_sentinels(
        self, messages: Conversation, text: str, where: str
    ) -> Rendered | None:
        """One extra render with placeholder replies; None if the template transforms replies."""
        replies = [
            i for i, m in enumerate(messages) if m["role"] == "assistant" and m["content"].strip()
        ]
        marked = [
            {**m, "content": _SENTINEL.format(i)} if i in replies else m
            for i, m in enumerate(messages)
        ]
        skeleton = self._apply(marked, where)
        rebuilt, cursor = "", 0
        spans: list[tuple[int, int]] = []
        for i in replies:
            sentinel = _SENTINEL.format(i)
            at = skeleton.find(sentinel, cursor)
            if at < 0 or skeleton.count(sentinel) != 1:
                return None
            rebuilt += skeleton[cursor:at]
            # The reply starts after this turn's generation prompt (after the previous reply).
            header_at = (
                rebuilt.rfind(self.header, spans[-1][1] if spans else 0) if self.header else -1
            )
            start = header_at + len(self.header) if header_at >= 0 else len(rebuilt)
            rebuilt += messages[i]["content"]
            cursor = at + len(sentinel)
            spans.append((start, len(rebuilt)))
        rebuilt += skeleton[cursor:]
        if rebuilt != text:
            return None
        return Rendered(
            text, [(s, _extend_over_end_marker(text, e, self.eot_marker)) for s, e in spans]
        )

    def _render_turn_by_turn(self, messages: Conversation, text: str, where: str) -> Rendered:
        """Slow, general path: locate each reply after its own generation prompt."""
        spans: list[tuple[int, int]] = []
        cursor = 0  # everything before it belongs to earlier messages
        for index, message in enumerate(messages):
            content = message["content"].strip()
            if message["role"] != "assistant":
                found = text.find(content, cursor) if content else -1
                cursor = found + len(content) if found >= 0 else cursor
                continue
            if not content:
                continue
            prompt = self._apply(messages[:index], where, add_generation_prompt=True)
            start = len(prompt) if text.startswith(prompt) and len(prompt) >= cursor else None
            found = text.find(content, cursor if start is None else start)
            if found < 0:
                raise DataError(
                    f"{where}: assistant turn {index} does not appear verbatim in the rendered chat "
                    "template (the template rewrites it); use a named template (data.template=...)."
                )
            end = _extend_over_end_marker(text, found + len(content), self.eot_marker)
            spans.append((found if start is None else start, end))
            cursor = end
        return Rendered(text, spans)


class PreformattedText:
    """Rows whose ``text`` already has the chat template applied.

    A reply starts after a reply-start marker (the generation prompt; the longest one where
    several match) and ends after the nearest end marker -- continued while another assistant
    message follows right away, as harmony's final message follows its analysis message.
    """

    name = "preformatted"

    def __init__(
        self, reply_starts: tuple[str, ...], reply_ends: tuple[str, ...], template: str = "auto"
    ) -> None:
        if not all(reply_starts) or not all(reply_ends):
            raise ConfigError(
                f"data.preformatted=true: template '{template}' has no marker where replies start; "
                "pass conversations (data.preformatted=false) instead."
            )
        self.reply_starts = tuple(sorted(reply_starts, key=len, reverse=True))
        self.reply_ends = reply_ends

    def _next_start(self, text: str, cursor: int) -> tuple[int, str] | None:
        found = [(at, -len(m), m) for m in self.reply_starts if (at := text.find(m, cursor)) >= 0]
        if not found:
            return None
        at, _, marker = min(found)
        return at, marker

    def _reply_end(self, text: str, start: int) -> int:
        while True:
            found = [(at, m) for m in self.reply_ends if (at := text.find(m, start)) >= 0]
            if not found:
                return len(text)
            at, marker = min(found)
            end = at + len(marker)
            following = self._next_start(text, end)
            if following is None or following[0] != end:
                return end
            start = end + len(following[1])

    def render(self, text: str, where: str) -> Rendered:
        spans, cursor = [], 0
        while (found := self._next_start(text, cursor)) is not None:
            start = found[0] + len(found[1])
            end = self._reply_end(text, start)
            if end > start:
                spans.append((start, end))
            cursor = end
        if not spans:
            raise RowError(
                SkipReason.no_assistant_turn,
                where,
                f"no assistant reply found (looked for {' or '.join(map(repr, self.reply_starts))}).",
            )
        return Rendered(text, spans)


class ProcessorChat:
    """The tokenizer seen through the processor's chat template: messages with ``images``
    become content parts (images first, then the text), as multimodal templates expect."""

    def __init__(self, tokenizer: Any, chat_template: str) -> None:
        self.tokenizer, self.chat_template = tokenizer, chat_template

    def apply_chat_template(self, messages: Conversation, **kwargs: Any) -> Any:
        parted = [
            {
                **{k: v for k, v in m.items() if k != "images"},
                "content": [{"type": "image"} for _ in m["images"]]
                + ([{"type": "text", "text": m["content"]}] if m["content"] else []),
            }
            if m.get("images")
            else m
            for m in messages
        ]
        return self.tokenizer.apply_chat_template(
            parted, chat_template=self.chat_template, **kwargs
        )


class VisionTemplate(TokenizerTemplate):
    """The processor's chat template of a vision-language target; the rendered conversation
    lists its images in order."""

    name = "auto"

    def __init__(self, tokenizer: Any, chat_template: str) -> None:
        super().__init__(ProcessorChat(tokenizer, chat_template))

    def render(self, messages: Conversation, where: str) -> Rendered:
        rendered = super().render(messages, where)
        rendered.images = [path for m in messages for path in m.get("images", [])]
        return rendered


ORIENTATION_TAG = 0x0112  # EXIF "Orientation"


@dataclass
class VisionSettings:
    """What expanding image placeholders needs (picklable, for worker processes)."""

    image_token_id: int
    vision_token_ids: list[int]  # never supervised
    patch_size: int  # pixels per patch side
    merge_size: int  # patches per merged token side
    min_pixels: int
    max_pixels: int

    def image_grid(self, path: str, where: str) -> tuple[int, int, int]:
        """(t, h, w) patches of the image once resized as the image processor resizes it;
        only the file's header is read."""
        from PIL import Image, UnidentifiedImageError

        # the PIL backend's copy: the torchvision one's module needs torchvision to import
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        try:
            with Image.open(path) as image:
                width, height = image.size
                # EXIF orientations 5-8 are turned by 90 degrees when the image is read upright
                if image.getexif().get(ORIENTATION_TAG, 1) in (5, 6, 7, 8):
                    width, height = height, width
        except (OSError, UnidentifiedImageError) as e:
            raise RowError(
                SkipReason.image_error,
                where,
                f"image {path} cannot be read ({e}); replace the file or drop the row.",
            ) from None
        factor = self.patch_size * self.merge_size
        try:
            resized_h, resized_w = smart_resize(
                height, width, factor, self.min_pixels, self.max_pixels
            )
        except ValueError as e:  # extreme aspect ratios
            raise RowError(SkipReason.image_error, where, f"image {path}: {e}") from None
        return 1, resized_h // self.patch_size, resized_w // self.patch_size


def expand_images(
    ids: list[int], mask: list[int], images: list[str], vision: VisionSettings, where: str
) -> tuple[list[int], list[int], list[tuple[int, int, int]]]:
    """Each image placeholder token widened to the image's token count; every vision token
    unsupervised. Returns ids, mask and each image's (t, h, w) patch grid."""
    placeholders = sum(1 for i in ids if i == vision.image_token_id)
    if placeholders != len(images):
        raise RowError(
            SkipReason.template_error,
            where,
            f"the chat template wrote {placeholders} image placeholders for {len(images)} "
            "images; check the processor's chat template.",
        )
    grids = [vision.image_grid(path, where) for path in images]
    merged = vision.merge_size**2
    counts = iter([t * h * w // merged for t, h, w in grids])
    vision_ids = set(vision.vision_token_ids) | {vision.image_token_id}
    out_ids: list[int] = []
    out_mask: list[int] = []
    for token, supervised in zip(ids, mask, strict=True):
        repeat = next(counts) if token == vision.image_token_id else 1
        out_ids.extend([token] * repeat)
        out_mask.extend([0 if token in vision_ids else supervised] * repeat)
    return out_ids, out_mask, grids


def make_renderer(
    template: str,
    tokenizer: Any,
    preformatted: bool = False,
    processor_template: str | None = None,
) -> Any:
    """The renderer for ``data.template`` (``auto`` = the tokenizer's own); with
    ``processor_template`` (``data.is_vlm``) the processor's chat template, images placed."""
    if processor_template is not None:
        return VisionTemplate(tokenizer, processor_template)
    if template != "auto" and template not in TEMPLATES:
        raise ConfigError(
            f"data.template={template} is unknown; use auto or one of {', '.join(sorted(TEMPLATES))}."
        )
    if not preformatted:
        return TokenizerTemplate(tokenizer) if template == "auto" else TEMPLATES[template]
    if template != "auto":
        return PreformattedText(*TEMPLATES[template].preformatted_markers(), template)
    own = TokenizerTemplate(tokenizer)
    return PreformattedText((own.header,), (own.eot_marker,), "auto")


def tokenize_rendered(batch: list[Rendered], tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """Token ids and 0/1 loss mask per rendered conversation (one batched tokenizer call)."""
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
    return out
