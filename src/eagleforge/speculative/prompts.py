"""Prompt sets for the evaluator: named benchmarks, the bundled MT-bench-style set, or any
jsonl file.

``eval.prompts`` names one set or a list of them. A name is a benchmark of the registry
(``mtbench``, ``humaneval``, ``gsm8k``, ``math500``: read from the Hugging Face hub with
``datasets`` and formatted as SpecForge's benchmark scripts do), ``mtbench_style`` (the bundled
file), ``NAME:PATH`` (benchmark NAME read from a local copy of its rows: .jsonl, .json,
.parquet or a ``save_to_disk`` directory), or a jsonl path. ``mtbench`` is the real MT-bench
when the hub (or its local cache) has it and the bundled set otherwise; every other named set
fails with one line naming the set and how to point at a local copy (docs/evaluation.md).

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

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagleforge.data import corpora
from eagleforge.data.collate import Collator
from eagleforge.data.conversations import (
    ROLE_ALIASES,
    Conversation,
    DataFormat,
    RawRow,
    RowError,
    normalise_row,
    read_rows,
)
from eagleforge.data.corpora import offline as hub_offline
from eagleforge.data.preprocess import vision_settings
from eagleforge.data.template import ProcessorChat, expand_images
from eagleforge.errors import DataError
from eagleforge.speculative.runners import PromptImages

if TYPE_CHECKING:
    from eagleforge.targets.source import VisionProcessor

log = logging.getLogger("eagleforge.evaluate")

BUNDLED = {"mtbench_style": Path(__file__).parent / "prompts" / "mtbench_style.jsonl"}


@dataclass
class PromptItem:
    id: str
    category: str
    turns: list[str]  # user messages; turn i follows the model's answer to turn i-1
    # absolute image paths of each turn (vision-language prompts); empty for text prompts
    images: list[list[str]] = field(default_factory=list)
    where: str = ""  # file:line of the row, for errors
    # messages before the first turn, the same for every turn: a benchmark's system prompt or
    # few-shot examples (user / assistant pairs); empty for prompts read from a jsonl file
    context: list[dict[str, Any]] = field(default_factory=list)

    def message(self, turn: int) -> dict[str, Any]:
        """User turn ``turn`` as a chat message (with its images, if any)."""
        images = self.images[turn] if turn < len(self.images) else []
        message: dict[str, Any] = {"role": "user", "content": self.turns[turn]}
        if images:
            message["images"] = images
        return message


@dataclass
class PromptSet:
    """The prompts of one ``eval.prompts`` entry."""

    name: str  # the set's label: the benchmark's name, or the file's stem
    source: str  # where its rows came from: a hub id, a local file, the bundled file
    items: list[PromptItem]


@dataclass(frozen=True)
class Benchmark:
    """A named prompt set on the Hugging Face hub and how its rows become prompts."""

    name: str
    hub_id: str
    config: str | None  # the dataset's config (subset); None: its default
    split: str
    revision: str | None  # a branch, tag or commit of the dataset repo; None: main
    fields: tuple[str, ...]  # the row fields the converter reads, for error messages
    # (benchmark, rows) -> prompts, every turn; DataError naming the row when one is not shaped
    # like the hub's
    convert: Callable[[Benchmark, list[RawRow]], list[PromptItem]]
    # read instead when the hub and its local cache do not have the set (mtbench only)
    fallback: str | None = None


def _text(bench: Benchmark, where: str, row: Any, key: str) -> str:
    value = row.get(key) if isinstance(row, dict) else None
    if not isinstance(value, str) or not value.strip():
        shape = ", ".join(f"'{f}'" for f in bench.fields)
        raise DataError(
            f"{where}: a {bench.name} row needs a non-empty string '{key}' ({bench.hub_id} rows "
            f"have {shape}); point eval.prompts={bench.name}:PATH at a copy of {bench.hub_id}."
        )
    return value


# The system prompt SpecForge's MT-bench benchmark (benchmarks/benchmarker/mtbench.py, after
# sglang's benchmark/mtbench) and EAGLE's gen_ea_answer_llama3chat.py put before each
# question: Llama-2-chat's default.
MTBENCH_SYSTEM_PROMPT = (
    "You are a helpful, respectful and honest assistant. Always answer as helpfully as "
    "possible, while being safe.  Your answers should not include any harmful, unethical, "
    "racist, sexist, toxic, dangerous, or illegal content. Please ensure that your responses "
    "are socially unbiased and positive in nature.\n\nIf a question does not make any sense, "
    "or is not factually coherent, explain why instead of answering something not correct. If "
    "you don't know the answer to a question, please don't share false information."
)


def _mtbench(bench: Benchmark, rows: list[RawRow]) -> list[PromptItem]:
    """HuggingFaceH4/mt_bench_prompts rows (``prompt``: the two turns, ``prompt_id``,
    ``category``, ``reference``) or lmsys FastChat's question.jsonl (``question_id``,
    ``category``, ``turns``): both turns, after the system prompt, as SpecForge's benchmark
    (sgl-project/SpecForge benchmarks/benchmarker/mtbench.py) asks them."""
    items = []
    for index, (where, row) in enumerate(rows):
        key = "turns" if isinstance(row, dict) and "turns" in row else "prompt"
        turns = row.get(key) if isinstance(row, dict) else None
        if not isinstance(turns, list) or not turns:
            raise DataError(
                f"{where}: an mtbench row needs '{key}', a list of user turns "
                f"({bench.hub_id} rows have 'prompt', 'prompt_id', 'category', 'reference'; "
                "FastChat's question.jsonl has 'question_id', 'category', 'turns')."
            )
        texts = [_text(bench, f"{where} {key}[{i}]", {key: t}, key) for i, t in enumerate(turns)]
        ident = row.get("prompt_id", row.get("question_id", index))
        context = [{"role": "system", "content": MTBENCH_SYSTEM_PROMPT}]
        category = str(row.get("category", ""))
        items.append(PromptItem(str(ident), category, texts, where=where, context=context))
    return items


def _humaneval(bench: Benchmark, rows: list[RawRow]) -> list[PromptItem]:
    """openai/openai_humaneval rows (``task_id``, ``prompt``, ``canonical_solution``, ``test``,
    ``entry_point``): the raw ``prompt`` (signature and docstring) as the user's message, as
    SpecForge's benchmarks/run_humaneval.py and benchmarker/humaneval.py send it."""
    return [
        PromptItem(
            str(row.get("task_id", index)),
            "coding",
            [_text(bench, where, row, "prompt")],
            where=where,
        )
        for index, (where, row) in enumerate(rows)
    ]


GSM8K_NUM_SHOTS = 5


def _gsm8k(bench: Benchmark, rows: list[RawRow]) -> list[PromptItem]:
    """openai/gsm8k rows (``question``, ``answer``): SpecForge's benchmarks/benchmarker/gsm8k.py
    form -- the first five rows as few-shot user/assistant turns before each question, and
    the questions from the sixth row on (the first five are never asked)."""
    if len(rows) <= GSM8K_NUM_SHOTS:
        raise DataError(
            f"{rows[0][0] if rows else bench.name}: gsm8k needs more than {GSM8K_NUM_SHOTS} "
            f"rows (the first {GSM8K_NUM_SHOTS} are the few-shot examples); give the whole "
            "test split."
        )
    shots: list[dict[str, Any]] = []
    for where, row in rows[:GSM8K_NUM_SHOTS]:
        shots.append({"role": "user", "content": _text(bench, where, row, "question")})
        shots.append({"role": "assistant", "content": _text(bench, where, row, "answer")})
    return [
        PromptItem(
            str(index),
            "math",
            [_text(bench, where, row, "question")],
            where=where,
            context=shots,
        )
        for index, (where, row) in enumerate(rows)
        if index >= GSM8K_NUM_SHOTS
    ]


def _math500(bench: Benchmark, rows: list[RawRow]) -> list[PromptItem]:
    """HuggingFaceH4/MATH-500 rows (``problem``, ``solution``, ``answer``, ``subject``,
    ``level``, ``unique_id``): the raw ``problem`` as the user's message, as SpecForge's
    benchmarks/run_math500.py and benchmarker/math500.py send it; ``subject`` is the category."""
    return [
        PromptItem(
            str(row.get("unique_id", index)),
            str(row.get("subject", "")),
            [_text(bench, where, row, "problem")],
            where=where,
        )
        for index, (where, row) in enumerate(rows)
    ]


BENCHMARKS = {
    bench.name: bench
    for bench in (
        Benchmark(
            "mtbench",
            "HuggingFaceH4/mt_bench_prompts",
            None,
            "train",
            None,
            ("prompt", "prompt_id", "category", "reference"),
            _mtbench,
            fallback="mtbench_style",
        ),
        Benchmark(
            "humaneval",
            "openai/openai_humaneval",
            None,
            "test",
            None,
            ("task_id", "prompt", "canonical_solution", "test", "entry_point"),
            _humaneval,
        ),
        Benchmark("gsm8k", "openai/gsm8k", "main", "test", None, ("question", "answer"), _gsm8k),
        Benchmark(
            "math500",
            "HuggingFaceH4/MATH-500",
            None,
            "test",
            None,
            ("problem", "solution", "answer", "subject", "level", "unique_id"),
            _math500,
        ),
    )
}

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class PromptSpec:
    """One ``eval.prompts`` entry, parsed: a benchmark (from the hub, or ``path`` when given),
    a bundled set, or a jsonl file (``path``)."""

    text: str
    bench: Benchmark | None = None
    bundled: Path | None = None
    path: Path | None = None

    @property
    def name(self) -> str:
        if self.bench is not None:
            return self.bench.name
        if self.bundled is not None:
            return self.text
        assert self.path is not None
        return self.path.stem


def parse_spec(text: str) -> PromptSpec:
    """``NAME``, ``NAME:PATH``, a bundled set's name or a jsonl path; DataError for a name
    that is none of these (nothing is read)."""
    name, colon, path = text.partition(":")
    if colon and name in BENCHMARKS:
        local = Path(path).expanduser()
        readable = local.is_file() and local.suffix in LOCAL_SUFFIXES
        if not readable and not (local / "dataset_info.json").is_file():
            raise DataError(
                f"eval.prompts={text}: {path} is not a .jsonl, .json or .parquet file nor a "
                f"save_to_disk directory; point it at a local copy of {BENCHMARKS[name].hub_id} "
                f"({BENCHMARKS[name].split} split)."
            )
        return PromptSpec(text, bench=BENCHMARKS[name], path=local)
    if text in BENCHMARKS:
        return PromptSpec(text, bench=BENCHMARKS[text])
    if text in BUNDLED:
        return PromptSpec(text, bundled=BUNDLED[text])
    if not Path(text).is_file():
        raise DataError(
            f"eval.prompts={text}: no such file; give a jsonl path, a benchmark "
            f"({', '.join(BENCHMARKS)}; NAME:PATH for a local copy) or one of: "
            f"{', '.join(sorted(BUNDLED))}."
        )
    return PromptSpec(text, path=Path(text))


def hub_cached(bench: Benchmark) -> bool:
    """Some of the benchmark is in the local caches: worth an offline load (the load itself
    says whether it is complete)."""
    return corpora.hub_cached(bench.hub_id)


def hub_unavailable(bench: Benchmark) -> bool:
    return hub_offline() and not hub_cached(bench)


def _unreachable_message(bench: Benchmark, reason: str) -> str:
    if hub_offline():
        return offline_message(bench)
    return (
        f"eval.prompts={bench.name}: could not load {bench.hub_id} from the Hugging Face hub "
        f"({reason}); give a local copy: "
        f"eval.prompts={bench.name}:/path/to/{bench.split}.parquet (or .jsonl)."
    )


def offline_message(bench: Benchmark) -> str:
    config = f", '{bench.config}'" if bench.config else ""
    return (
        f"eval.prompts={bench.name}: {bench.hub_id} is not in the local Hugging Face cache "
        "and the hub is offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE); download it where the "
        f"hub is reachable (datasets.load_dataset('{bench.hub_id}'{config}, "
        f"split='{bench.split}')), or give a local copy: "
        f"eval.prompts={bench.name}:/path/to/{bench.split}.parquet (or .jsonl)."
    )


class HubUnreachable(Exception):
    """datasets could not load a benchmark; the message is the reason, in one line."""


def _hub_rows(bench: Benchmark) -> list[RawRow]:
    import datasets

    try:
        table = datasets.load_dataset(
            bench.hub_id, bench.config, split=bench.split, revision=bench.revision
        )
    # datasets raises many types here (ConnectionError, FileNotFoundError, its own
    # DatasetNotFoundError, huggingface_hub's offline and HTTP errors): all mean "not loadable"
    except Exception as e:
        first_line = (str(e).splitlines() or [""])[0]
        raise HubUnreachable(f"{type(e).__name__}: {first_line}") from None
    return [(f"{bench.hub_id}[{bench.split} row {i}]", row) for i, row in enumerate(table)]


def _local_rows(path: Path) -> list[RawRow]:
    rows = []
    for where, row in read_rows(DataFormat.auto, [path]):
        if isinstance(row, RowError):
            raise DataError(str(row))
        rows.append((where, row))
    return rows


def load_prompt_set(
    text: str, multi_turn: bool, limit: int | None = None, images_allowed: bool = False
) -> PromptSet:
    """The prompts of one ``eval.prompts`` entry; only the first turn of each unless
    ``multi_turn``, at most ``limit``; ``images_allowed`` (``data.is_vlm``) reads user turns'
    images of a jsonl file as training does. DataError naming the file and line of a bad row,
    or the set and how to use a local copy when the hub cannot give it."""
    spec = parse_spec(text)
    bench = spec.bench
    if bench is None:
        path = spec.bundled or spec.path
        assert path is not None
        items = _read_jsonl_prompts(path, multi_turn, limit, images_allowed)
        return PromptSet(spec.name, str(path), items)
    if spec.path is not None:
        rows, source = _local_rows(spec.path), str(spec.path)
    else:
        try:
            if hub_unavailable(bench):  # no network call would succeed: none is made
                raise HubUnreachable(f"the hub is offline and {bench.hub_id} is not cached")
            rows, source = _hub_rows(bench), bench.hub_id
        except HubUnreachable as e:
            if bench.fallback is None:
                raise DataError(_unreachable_message(bench, str(e))) from None
            # offline, the bundled set is the expected default; online, a surprise
            level = logging.INFO if hub_offline() else logging.WARNING
            log.log(
                level,
                "eval.prompts=%s: using the bundled %s set (%s)",
                bench.name,
                bench.fallback,
                e,
            )
            fallback = load_prompt_set(bench.fallback, multi_turn, limit, images_allowed)
            return PromptSet(bench.name, fallback.source, fallback.items)
    items = bench.convert(bench, rows)[:limit]
    for item in items:
        item.turns = item.turns if multi_turn else item.turns[:1]
    return PromptSet(bench.name, source, items)


def load_prompt_sets(
    texts: list[str], multi_turn: bool, limit: int | None = None, images_allowed: bool = False
) -> list[PromptSet]:
    """Every set of ``eval.prompts`` (see load_prompt_set); two sets with one label (files with
    one stem) are told apart by their position."""
    sets = [load_prompt_set(t, multi_turn, limit, images_allowed) for t in texts]
    names = [s.name for s in sets]
    for index, prompt_set in enumerate(sets):
        if names.count(prompt_set.name) > 1:
            prompt_set.name = f"{prompt_set.name}_{index}"
    return sets


def load_prompts(
    source: str, multi_turn: bool, limit: int | None = None, images_allowed: bool = False
) -> list[PromptItem]:
    """The prompts of one ``eval.prompts`` entry (see load_prompt_set)."""
    return load_prompt_set(source, multi_turn, limit, images_allowed).items


def _read_jsonl_prompts(
    path: Path, multi_turn: bool, limit: int | None, images_allowed: bool
) -> list[PromptItem]:
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
