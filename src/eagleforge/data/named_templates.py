"""Named chat templates, for tokenizers without one (``data.template=<name>``).

Each template renders a conversation as pieces of text that are either prompt (unsupervised)
or reply (supervised), so the loss mask is exact by construction: a reply is everything the
model generates after the template's generation prompt, up to and including its end-of-turn
marker. Reasoning (``reasoning_content``) follows each template's own rule:

| template | reasoning rule |
|---|---|
| llama3, chatml, qwen2.5, deepseek-v3, phi3, phi4, gemma, mistral, kimi-k2 | dropped |
| qwen3 (thinking) | ``<think>\\n…\\n</think>\\n\\n`` before the reply, supervised, in turns after the last user message (always on the final reply, empty without reasoning); dropped from earlier turns |
| qwen3-instruct | never rendered; turns after the last user message get the empty block ``<think>\\n\\n</think>\\n\\n`` as part of the prompt (as with ``enable_thinking=False``) |
| deepseek-r1-distill | after the last user message the prompt ends with ``<think>\\n`` and the supervised reply is ``…\\n</think>\\n\\n<answer>``; dropped from history |
| gpt-oss (harmony) | an ``analysis`` channel message before the ``final`` one, supervised, only after the last user message |
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from eagleforge.data.conversations import Conversation, Message
from eagleforge.data.rendered import Rendered
from eagleforge.errors import DataError


class Reasoning(str, Enum):
    drop = "drop"
    think_last = "think_last"  # <think> block before replies after the last user turn
    think_last_prompted = "think_last_prompted"  # the same, with "<think>\n" in the prompt
    empty_think_last = "empty_think_last"  # empty <think> block in the prompt of those turns
    harmony = "harmony"  # gpt-oss analysis channel


@dataclass(frozen=True)
class NamedTemplate:
    """Formats of one chat template; ``{content}`` marks where a message's text goes."""

    name: str
    user: str
    assistant_header: str  # the generation prompt that precedes every reply (unsupervised)
    end_of_turn: str  # closes every reply (supervised)
    system: str = ""  # "" = the template has no system block: merged into a user turn
    tool: str = ""  # "" = tool results are rendered as user turns
    bos: str = ""
    after_turn: str = ""  # unsupervised text after the end-of-turn marker
    default_system: str | None = None
    system_into_last_user: bool = False  # mistral; otherwise merged into the first user turn
    reasoning: Reasoning = Reasoning.drop
    last_end_of_turn: str | None = None  # the final reply's marker, when it differs (harmony)
    preamble: str = ""  # fixed prompt text after bos (harmony's system message)
    reply_prefix: str = ""  # generated text before every reply (mistral's space)
    strip: bool = False  # the template trims message content (Llama 3, Gemma, Mistral)

    def render(self, messages: Conversation, where: str = "<conversation>") -> Rendered:
        pieces: list[tuple[str, bool]] = [(self.bos + self.preamble, False)]
        system, turns = _split_system(messages, self.default_system)
        user_ids = [i for i, m in enumerate(turns) if m["role"] == "user"]
        last_user = user_ids[-1] if user_ids else -1
        merge_into = (
            (user_ids[-1] if self.system_into_last_user else user_ids[0]) if user_ids else -1
        )
        if system is not None and self.system:
            pieces.append((self.system.format(content=system), False))
        for index, message in enumerate(turns):
            role, content = message["role"], message["content"]
            content = content.strip() if self.strip else content
            if message.get("tool_calls"):
                raise DataError(
                    f"{where}: turn {index} has tool calls, which the named template "
                    f"'{self.name}' does not render; use the tokenizer's own template (data.template=auto)."
                )
            if role == "assistant":
                pieces.extend(
                    self._reply(message, content, index > last_user, index == len(turns) - 1)
                )
                continue
            if role == "system":  # a system message later in the conversation
                pieces.append(((self.system or self.user).format(content=content), False))
                continue
            if role == "user" and index == merge_into and system is not None and not self.system:
                content = f"{system}\n\n{content}"
            form = self.tool if role == "tool" and self.tool else self.user
            pieces.append((form.format(content=content), False))
        return Rendered.from_pieces(pieces)

    def _reply(
        self, message: Message, content: str, after_last_user: bool, is_last: bool
    ) -> list[tuple[str, bool]]:
        header, reply = self.assistant_header, self.reply_prefix + content
        reasoning = (message.get("reasoning_content") or "").strip()
        end = self.last_end_of_turn if is_last and self.last_end_of_turn else self.end_of_turn
        if self.reasoning == Reasoning.think_last and after_last_user and (reasoning or is_last):
            # Qwen3 gives the final reply a think block even when it is empty.
            reply = f"<think>\n{reasoning}\n</think>\n\n{content}"
        elif self.reasoning == Reasoning.think_last_prompted and after_last_user:
            # DeepSeek-R1's generation prompt already opens the think block.
            header += "<think>\n"
            reply = f"{reasoning}\n</think>\n\n{content}"
        elif self.reasoning == Reasoning.empty_think_last and after_last_user:
            header += "<think>\n\n</think>\n\n"
        elif self.reasoning == Reasoning.harmony:
            reply = f"<|channel|>final<|message|>{content}"
            if after_last_user and reasoning:
                reply = f"<|channel|>analysis<|message|>{reasoning}<|end|>{header}{reply}"
        return [(header, False), (reply + end, True), (self.after_turn, False)]

    def preformatted_markers(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(reply start markers, reply end markers) for finding replies in templated text."""
        starts: tuple[str, ...] = (self.assistant_header,)
        if self.reasoning == Reasoning.think_last_prompted:
            starts = (self.assistant_header + "<think>\n", self.assistant_header)
        ends: tuple[str, ...] = (self.end_of_turn,)
        if self.last_end_of_turn:
            ends = (self.end_of_turn, self.last_end_of_turn)
        return starts, ends


def _split_system(messages: Conversation, default: str | None) -> tuple[str | None, Conversation]:
    if messages and messages[0]["role"] == "system":
        return messages[0]["content"].strip(), list(messages[1:])
    return default, list(messages)


_CHATML: dict[str, Any] = dict(
    system="<|im_start|>system\n{content}<|im_end|>\n",
    user="<|im_start|>user\n{content}<|im_end|>\n",
    tool="<|im_start|>user\n<tool_response>\n{content}\n</tool_response><|im_end|>\n",
    assistant_header="<|im_start|>assistant\n",
    end_of_turn="<|im_end|>",
    after_turn="\n",
)
_DEEPSEEK: dict[str, Any] = dict(
    bos="<｜begin▁of▁sentence｜>",
    system="{content}",
    user="<｜User｜>{content}",
    tool="<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{content}<｜tool▁output▁end｜><｜tool▁outputs▁end｜>",
    assistant_header="<｜Assistant｜>",
    end_of_turn="<｜end▁of▁sentence｜>",
)
_HARMONY_SYSTEM = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\n\nReasoning: medium\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
)

TEMPLATES: dict[str, NamedTemplate] = {
    t.name: t
    for t in [
        NamedTemplate(
            name="llama3",
            bos="<|begin_of_text|>",
            system="<|start_header_id|>system<|end_header_id|>\n\n{content}<|eot_id|>",
            user="<|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|>",
            tool="<|start_header_id|>ipython<|end_header_id|>\n\n{content}<|eot_id|>",
            assistant_header="<|start_header_id|>assistant<|end_header_id|>\n\n",
            end_of_turn="<|eot_id|>",
            strip=True,
        ),
        NamedTemplate(name="chatml", **_CHATML),
        NamedTemplate(
            name="qwen2.5",
            default_system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
            **_CHATML,
        ),
        NamedTemplate(name="qwen3", reasoning=Reasoning.think_last, **_CHATML),
        NamedTemplate(name="qwen3-instruct", reasoning=Reasoning.empty_think_last, **_CHATML),
        NamedTemplate(
            name="deepseek-r1-distill", reasoning=Reasoning.think_last_prompted, **_DEEPSEEK
        ),
        NamedTemplate(name="deepseek-v3", **_DEEPSEEK),
        NamedTemplate(
            name="phi3",
            system="<|system|>\n{content}<|end|>\n",
            user="<|user|>\n{content}<|end|>\n",
            assistant_header="<|assistant|>\n",
            end_of_turn="<|end|>",
            after_turn="\n",
        ),
        NamedTemplate(
            name="phi4",
            system="<|im_start|>system<|im_sep|>{content}<|im_end|>",
            user="<|im_start|>user<|im_sep|>{content}<|im_end|>",
            assistant_header="<|im_start|>assistant<|im_sep|>",
            end_of_turn="<|im_end|>",
        ),
        NamedTemplate(
            name="gemma",
            bos="<bos>",
            user="<start_of_turn>user\n{content}<end_of_turn>\n",
            assistant_header="<start_of_turn>model\n",
            end_of_turn="<end_of_turn>",
            after_turn="\n",
            strip=True,
        ),
        NamedTemplate(
            name="mistral",
            bos="<s>",
            user="[INST] {content}[/INST]",
            assistant_header="",
            # SentencePiece reads a reply as " <reply>": the space is generated, so supervised.
            reply_prefix=" ",
            end_of_turn="</s>",
            system_into_last_user=True,
            strip=True,
        ),
        NamedTemplate(
            name="gpt-oss",
            preamble=_HARMONY_SYSTEM,
            system="<|start|>developer<|message|># Instructions\n\n{content}<|end|>",
            user="<|start|>user<|message|>{content}<|end|>",
            tool="<|start|>functions<|message|>{content}<|end|>",
            assistant_header="<|start|>assistant",
            end_of_turn="<|end|>",
            last_end_of_turn="<|return|>",
            reasoning=Reasoning.harmony,
        ),
        NamedTemplate(
            name="kimi-k2",
            system="<|im_system|>system<|im_middle|>{content}<|im_end|>",
            user="<|im_user|>user<|im_middle|>{content}<|im_end|>",
            tool="<|im_system|>tool<|im_middle|>{content}<|im_end|>",
            assistant_header="<|im_assistant|>assistant<|im_middle|>",
            end_of_turn="<|im_end|>",
            default_system="You are Kimi, an AI assistant created by Moonshot AI.",
        ),
    ]
}
