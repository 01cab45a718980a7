"""Prompt sets for the evaluator: the bundled MT-bench-style set or any jsonl file.

A jsonl line may be ``{"turns": ["first user message", "second", ...]}`` (optionally with
``id`` and ``category``), ``{"prompt": "..."}``, or a training-style conversation (ShareGPT
``conversations`` or OpenAI ``messages``), whose user turns are the prompts.

With images (``data.is_vlm``, a vision-language target) user turns carry images exactly as in
training data (docs/vlm.md): per turn, as OpenAI content parts, or per row (the first user
turn's; also beside ``turns`` / ``prompt``); relative paths start at the file's directory.
``PromptRenderer`` renders them with the processor's chat template and widens each image
placeholder to the image's token count, as training does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagleforge.data.conversations import (
    ROLE_ALIASES,
    Conversation,
    DataFormat,
    RowError,
    normalise_row,
    read_rows,
)
from eagleforge.data.dataset import Collator, vision_settings
from eagleforge.data.template import ProcessorChat, expand_images
from eagleforge.errors import DataError
from eagleforge.speculative.decode import PromptImages

if TYPE_CHECKING:
    from eagleforge.target.source import VisionProcessor

BUNDLED = {"mtbench": Path(__file__).parent / "prompts" / "mtbench_style.jsonl"}


@dataclass
class PromptItem:
    id: str
    category: str
    turns: list[str]  # user messages; turn i follows the model's answer to turn i-1
    # absolute image paths of each turn (vision-language prompts); empty for text prompts
    images: list[list[str]] = field(default_factory=list)
    where: str = ""  # file:line of the row, for errors

    def message(self, turn: int) -> dict[str, Any]:
        """User turn ``turn`` as a chat message (with its images, if any)."""
        images = self.images[turn] if turn < len(self.images) else []
        message: dict[str, Any] = {"role": "user", "content": self.turns[turn]}
        if images:
            message["images"] = images
        return message


def load_prompts(
    source: str, multi_turn: bool, limit: int | None = None, images_allowed: bool = False
) -> list[PromptItem]:
    """Prompts from a bundled set name or a jsonl path; only the first turn unless
    ``multi_turn``; ``images_allowed`` (``data.is_vlm``) reads user turns' images as training
    does. Raises DataError naming the file and line of a bad row."""
    path = BUNDLED.get(source, Path(source))
    if not path.is_file():
        raise DataError(
            f"eval.prompts={source}: no such file; give a jsonl path or one of: "
            f"{', '.join(sorted(BUNDLED))}."
        )
    items: list[PromptItem] = []
    for where, row in read_rows(DataFormat.auto, [path]):
        if isinstance(row, RowError):
            raise DataError(str(row))
        images: list[list[str]] = []
        if images_allowed:
            turns, images = _user_turns_with_images(row, where)
        else:
            turns = _user_turns(row, where)
        if not turns:
            raise DataError(f"{where}: no user message to use as a prompt.")
        count = len(turns) if multi_turn else 1
        items.append(
            PromptItem(
                id=str(row.get("id", row.get("question_id", len(items)))),
                category=str(row.get("category", "")),
                turns=turns[:count],
                images=images[:count],
                where=where,
            )
        )
        if limit is not None and len(items) == limit:
            break
    if not items:
        raise DataError(
            f"{path}: holds no prompts; give one JSON object per line with 'turns', 'prompt', "
            "'conversations' or 'messages', or use eval.prompts=mtbench."
        )
    return items


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of a conversation ending with a user turn, with the generation prompt."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class PromptRenderer:
    """Token ids of a conversation ending with a user turn, with the generation prompt, and
    its images: the tokenizer's chat template for a text target; for a vision-language target
    (``processor``) the processor's, each image placeholder widened to the image's token count
    and the images run through the image processor -- the training data path's own steps."""

    def __init__(
        self,
        tokenizer: Any,
        processor: VisionProcessor | None = None,
        min_pixels: int = 0,
        max_pixels: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.processor = processor
        if processor is not None:
            self.tokenizer = processor.tokenizer
            self.chat = ProcessorChat(processor.tokenizer, processor.chat_template)
            self.vision = vision_settings(processor, min_pixels, max_pixels)
            self.collator = Collator(
                pad_token_id=0,  # one prompt: never padded
                image_processor=processor.image_processor,
                image_token_id=processor.image_token_id,
            )

    def __call__(self, messages: Conversation, where: str) -> tuple[list[int], PromptImages | None]:
        if self.processor is None:
            return render_prompt(self.tokenizer, messages), None
        text = self.chat.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        paths = [path for m in messages for path in m.get("images", [])]
        no_loss = [0] * len(ids)  # a prompt is never supervised; expand_images wants a mask
        try:
            ids, no_loss, _ = expand_images(ids, no_loss, paths, self.vision, where)
        except RowError as e:
            raise DataError(str(e)) from None
        if not paths:
            return ids, None
        # the collator loads the images upright and checks their token counts, as in training
        batch = self.collator([(ids, no_loss, paths)])
        return ids, PromptImages(batch["pixel_values"], batch["image_grid_thw"])


def _user_turns_with_images(row: object, where: str) -> tuple[list[str], list[list[str]]]:
    """User turns and their images, read by the training data path (``turns`` / ``prompt``
    rows become user messages, a row-level image list going to the first)."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}.")
    if "turns" in row or "prompt" in row:
        texts = _user_turns(row, where)
        row = {
            "messages": [{"role": "user", "content": text} for text in texts],
            **{key: row[key] for key in ("images", "image") if key in row},
        }
    try:
        messages = normalise_row(row, DataFormat.auto, where, True, require_reply=False)
    except RowError as e:
        raise DataError(str(e)) from None
    users = [m for m in messages if m["role"] == "user"]
    return [m["content"] for m in users], [list(m.get("images", [])) for m in users]


def _user_turns(row: object, where: str) -> list[str]:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}.")
    if "turns" in row or "prompt" in row:
        turns = row.get("turns", [row.get("prompt")])
        if not isinstance(turns, list) or not all(isinstance(t, str) and t for t in turns):
            raise DataError(f"{where}: 'turns' must be a list of non-empty strings.")
        return turns
    for key, role_key, content_key in (
        ("conversations", "from", "value"),
        ("messages", "role", "content"),
    ):
        if isinstance(row.get(key), list):
            return [
                turn[content_key]
                for turn in row[key]
                if isinstance(turn, dict)
                and ROLE_ALIASES.get(str(turn.get(role_key)).lower()) == "user"
                and isinstance(turn.get(content_key), str)
                and turn[content_key].strip()
            ]
    raise DataError(f"{where}: expected a 'turns', 'prompt', 'conversations' or 'messages' field.")
