"""Rewriting a data set's assistant turns with the target: rows, chunks, backends, the job.

Each conversation keeps its user, system and tool turns; every assistant turn is generated
again by the target, conditioned on the *regenerated* history. The result is OpenAI-format
jsonl (``{"id", "messages"}``), which ``data=jsonl data.path=...`` trains on.

Rows are processed in chunks of ``regenerate.chunk_rows``. A finished chunk is written
atomically to ``<output>.chunks/``, named by the source rows it covers, and never redone: the
same command after a kill regenerates only the rows no chunk covers (whatever chunk_rows it
uses). The settings that define the data (source rows, model, sampling) are written there
before the first chunk; a resumed job with other settings is refused. When every row is done
the chunks are joined into ``output`` and the settings kept as ``<output>.settings.json``.
Requests that still fail after the retries are left out and recorded, with the reason, in
``<output>.failed.jsonl``.

With ``regenerate.magpie.num_prompts`` the target writes the first user turns too (Magpie, Xu
et al. 2024): each is sampled from the chat template's user header, the text up to where a
user's message would start, so the prompts come from the target's own idea of what users
ask. They are written to ``<output>.chunks/prompts.jsonl`` before any is answered (a resume
reuses them), then answered like rows read from ``data``; ``magpie.held_out`` more are written
unanswered beside the output (``regen.jsonl`` -> ``regen.heldout.jsonl``, ``eval.prompts``
rows): prompts for validating a draft that never saw them.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from eagleforge.atomic import atomic_file
from eagleforge.data.conversations import (
    Conversation,
    RowError,
    normalise_row,
    source_files,
)
from eagleforge.data.dataset import DataConfig, OnError, training_source
from eagleforge.errors import ConfigError

if TYPE_CHECKING:
    from eagleforge.config import EagleForgeConfig

log = logging.getLogger("eagleforge.regenerate")


class Backend(str, Enum):
    server = "server"  # any OpenAI-compatible chat endpoint (SGLang, vLLM, transformers serve)
    hf = "hf"  # the target in this process, batched generation with transformers


@dataclass
class MagpieConfig:
    """``regenerate.magpie``: the target writes the user turns too (hf backend)."""

    # Distinct first user turns to write and answer; 0 = off (the turns are read from `data`).
    num_prompts: int = 0
    # Further prompts, not answered, written beside the output (regen.jsonl ->
    # regen.heldout.jsonl) as eval.prompts rows: validation prompts no training row holds.
    held_out: int = 0
    # Sampling of the prompts (the answers follow regenerate.temperature / top_p).
    temperature: float = 1.0
    top_p: float = 0.95
    # Tokens per prompt at most; a prompt the target has not ended by then is dropped.
    max_new_tokens: int = 64

    def __post_init__(self) -> None:
        if self.num_prompts < 0 or self.held_out < 0 or self.max_new_tokens < 1:
            raise ConfigError(
                "regenerate.magpie.num_prompts and held_out must be >= 0 and max_new_tokens >= 1."
            )
        if self.temperature <= 0 or not 0 < self.top_p <= 1:
            raise ConfigError(
                f"regenerate.magpie.temperature must be > 0 (the prompts are sampled) and top_p "
                f"in (0, 1], got {self.temperature} and {self.top_p}."
            )


@dataclass
class RegenerateConfig:
    """The `regenerate` config section (python -m eagleforge.regenerate)."""

    # Output jsonl file (OpenAI messages format); chunks and failures are kept beside it.
    output: str | None = None
    # Where the target runs: server | hf.
    backend: Backend = Backend.server
    # server: base URLs of OpenAI-compatible endpoints (…/v1); conversations are spread over them.
    base_urls: list[str] = field(default_factory=lambda: ["http://127.0.0.1:30000/v1"])
    # server: the model name to request; null = the first model the endpoint lists.
    model: str | None = None
    # server: API key sent as a bearer token (null = none, or $OPENAI_API_KEY).
    api_key: str | None = None
    # server: conversations in flight at once (over all base URLs).
    concurrency: int = 16
    # server: attempts per request after the first, with exponential backoff (each retry
    # goes to the next base URL).
    max_retries: int = 3
    # server: seconds before the first retry (doubled each time).
    retry_backoff_s: float = 1.0
    # server: seconds to wait for one response.
    timeout_s: float = 600.0
    # hf: conversations generated together.
    batch_size: int = 8
    # Sampling temperature (0 = greedy, reproducible).
    temperature: float = 0.0
    # Nucleus sampling threshold (1 = off).
    top_p: float = 1.0
    # Tokens generated per assistant turn at most.
    max_new_tokens: int = 1024
    # Keep the model's reasoning (reasoning_content) in the regenerated turns, or drop it.
    keep_reasoning: bool = False
    # Regenerated versions of each conversation (> 1 needs temperature > 0).
    num_samples: int = 1
    # Conversations per chunk (the unit of atomic writes and of resume).
    chunk_rows: int = 256
    # Only the first N conversations (null = all).
    max_rows: int | None = None
    # Seed of the hf backend's sampling.
    seed: int = 0
    # Magpie: the target writes the first user turns as well (see MagpieConfig).
    magpie: MagpieConfig = field(default_factory=MagpieConfig)

    def __post_init__(self) -> None:
        for name in ("concurrency", "batch_size", "max_new_tokens", "num_samples", "chunk_rows"):
            if getattr(self, name) < 1:
                raise ConfigError(f"regenerate.{name} must be >= 1, got {getattr(self, name)}.")
        if self.max_retries < 0 or self.retry_backoff_s < 0 or self.timeout_s <= 0:
            raise ConfigError(
                "regenerate.max_retries and retry_backoff_s must be >= 0 and timeout_s > 0."
            )
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(
                f"regenerate.temperature must be >= 0 and top_p in (0, 1], got "
                f"{self.temperature} and {self.top_p}."
            )
        if self.num_samples > 1 and self.temperature == 0:
            raise ConfigError(
                f"regenerate.num_samples={self.num_samples} with temperature 0 gives identical "
                "copies; set regenerate.temperature > 0 (e.g. 0.7)."
            )
        if self.backend == Backend.server and not self.base_urls:
            raise ConfigError("regenerate.base_urls is empty; give the server's …/v1 URL.")
        if self.magpie.num_prompts and self.backend != Backend.hf:
            raise ConfigError(
                "regenerate.magpie.num_prompts samples prompts from the chat template's user "
                "header, which a chat endpoint does not expose; set regenerate.backend=hf."
            )


@dataclass
class Reply:
    """One generated assistant turn."""

    content: str
    reasoning: str | None = None


class RequestFailed(Exception):
    """A request that failed after every retry; the message says why."""


# A backend turns conversation histories into one reply each (or the reason it failed).
Generate = Callable[[list[Conversation]], list["Reply | RequestFailed"]]

THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)
# What a decoder writes for the bytes of a character that the max_new_tokens cut split.
PARTIAL_CHAR = "\ufffd"


def split_reasoning(text: str, reasoning: str | None) -> Reply:
    """A reply with inline ``<think>…</think>`` moved to ``reasoning``."""
    match = THINK.match(text)
    if match and reasoning is None:
        return Reply(text[match.end() :], match.group(1).strip())
    return Reply(text, reasoning)


def finish_reply(text: str, reasoning: str | None, *, cut: bool) -> Reply:
    """The one post-processing of every backend's reply. ``cut``: generation stopped at
    max_new_tokens, so trailing U+FFFD are the bytes of a split emoji or CJK character and are
    dropped (they would be trained on, and condition the next turn). Whitespace is kept as the
    target wrote it: the draft learns the target's tokens, and templates that trim, trim."""
    if cut:
        text = text.rstrip(PARTIAL_CHAR)
    return split_reasoning(text, reasoning)


# ---------------------------------------------------------------------------------------------
# Input rows and output chunks


@dataclass
class Row:
    index: int  # position in the source (after data.max_num_samples / regenerate.max_rows)
    id: str
    messages: Conversation


def read_input(data: DataConfig, limit: int | None) -> tuple[list[Row], list[dict[str, Any]]]:
    """The conversations to regenerate and the rows that could not be read (data.on_error)."""
    source = training_source(data)  # files, a hub data set or a mixture
    rows: list[Row] = []
    bad: list[dict[str, Any]] = []
    for where, raw in source.rows():
        if limit is not None and len(rows) + len(bad) >= limit:
            break
        try:
            if isinstance(raw, RowError):
                raise raw
            messages = normalise_row(raw, source.fmt, where)
        except RowError as e:
            if data.on_error == OnError["raise"]:
                raise ConfigError(
                    f"{e} (or set data.on_error=skip to leave such rows out)"
                ) from None
            bad.append({"where": where, "reason": str(e)})
            continue
        row_id = raw.get("id") if isinstance(raw.get("id"), str) else where
        rows.append(Row(len(rows), row_id, messages))
    return rows, bad


# A chunk file is named by the source rows it covers, [start, end): resume needs no chunk size.
CHUNK_NAME = re.compile(r"^(\d+)-(\d+)\.jsonl$")
OLD_CHUNK_NAME = re.compile(r"^\d{6}\.jsonl$")  # numbered chunks, before settings were kept


def chunk_path(chunks_dir: Path, span: tuple[int, int], suffix: str = ".jsonl") -> Path:
    return chunks_dir / f"{span[0]:09d}-{span[1]:09d}{suffix}"


def finished_chunks(chunks_dir: Path, num_rows: int) -> list[tuple[int, int]]:
    """The source row spans [start, end) whose chunks are on disk, in order; ConfigError for a
    file that cannot be a chunk of this job."""
    spans = []
    for path in sorted(chunks_dir.glob("*.jsonl")):
        if OLD_CHUNK_NAME.match(path.name):
            raise ConfigError(
                f"{chunks_dir} holds chunks of an older eagleforge, which did not record the "
                "settings they were made with; finish the job with that version, or remove the "
                "directory to start over."
            )
        if (match := CHUNK_NAME.match(path.name)) is not None:
            spans.append((int(match.group(1)), int(match.group(2))))
    for (start, end), previous_end in zip(spans, [0] + [e for _, e in spans], strict=False):
        if not previous_end <= start < end <= num_rows:
            raise ConfigError(
                f"{chunk_path(chunks_dir, (start, end))} overlaps another chunk or lies past "
                f"the {num_rows} source conversations; remove {chunks_dir} to start over."
            )
    return spans


def unfinished_chunks(
    num_rows: int, done: list[tuple[int, int]], chunk_rows: int
) -> list[tuple[int, int]]:
    """The spans of at most ``chunk_rows`` rows that cover every row no finished chunk does."""
    todo, start = [], 0
    for done_start, done_end in [*done, (num_rows, num_rows)]:
        todo += [(i, min(i + chunk_rows, done_start)) for i in range(start, done_start, chunk_rows)]
        start = done_end
    return todo


def write_lines_atomically(path: Path, lines: list[str]) -> None:
    """``lines`` as the whole of ``path``, through a temporary file and a rename."""
    with atomic_file(path) as tmp:
        tmp.write_text("".join(line + "\n" for line in lines))


# ---------------------------------------------------------------------------------------------
# Regenerating one conversation, whatever the backend


def regenerate_rows(
    rows: list[Row], generate: Generate, cfg: RegenerateConfig
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(output rows, failures) for ``rows``: every assistant turn replaced, in order, for
    ``num_samples`` samples of each conversation. ``generate`` is called once per assistant
    turn position with the histories of every conversation still going."""
    work = [(row, sample) for row in rows for sample in range(cfg.num_samples)]
    histories: list[Conversation] = [[] for _ in work]
    turn_of = [0 for _ in work]
    failed: dict[int, str] = {}
    live = list(range(len(work)))
    while live:
        # advance every live conversation to its next assistant turn (or to its end)
        waiting = []
        for i in live:
            messages = work[i][0].messages
            while turn_of[i] < len(messages) and messages[turn_of[i]]["role"] != "assistant":
                histories[i].append(dict(messages[turn_of[i]]))
                turn_of[i] += 1
            if turn_of[i] < len(messages):
                waiting.append(i)
        if not waiting:
            break
        replies = generate([histories[i] for i in waiting])
        live = []
        for i, reply in zip(waiting, replies, strict=True):
            if isinstance(reply, RequestFailed):
                failed[i] = str(reply)
                continue
            message: dict[str, Any] = {"role": "assistant", "content": reply.content}
            if cfg.keep_reasoning and reply.reasoning:
                message["reasoning_content"] = reply.reasoning
            histories[i].append(message)
            turn_of[i] += 1
            live.append(i)
    out, failures = [], []
    for i, (row, sample) in enumerate(work):
        row_id = row.id if cfg.num_samples == 1 else f"{row.id}#{sample}"
        if i in failed:
            failures.append({"index": row.index, "id": row_id, "reason": failed[i]})
        else:
            out.append({"id": row_id, "messages": histories[i]})
    return out, failures


# ---------------------------------------------------------------------------------------------
# Backends


class ServerBackend:
    """Chat completions from OpenAI-compatible endpoints: each conversation of a call in its
    own thread (``concurrency`` at once), spread over the base URLs, with retries."""

    def __init__(self, cfg: RegenerateConfig) -> None:
        self.cfg = cfg
        self.urls = [url.rstrip("/") for url in cfg.base_urls]
        self.api_key = cfg.api_key or os.environ.get("OPENAI_API_KEY")
        self.model = cfg.model or self._served_model()
        self.model_name = self.model  # recorded with the output (see run_settings)
        self.pool = ThreadPoolExecutor(cfg.concurrency)
        self.calls = 0

    def _request(self, url: str, body: dict[str, Any] | None) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(url, data=data, headers=headers)
        with urllib.request.urlopen(request, timeout=self.cfg.timeout_s) as response:
            return json.loads(response.read())

    def _with_retries(
        self, path: str, body: dict[str, Any] | None, first: int = 0
    ) -> dict[str, Any]:
        """POST ``body`` (GET without one) to ``path`` under base URL ``first``; each retry goes
        to the next base URL, so a server that is down costs one attempt, not a conversation."""
        delay, attempts = self.cfg.retry_backoff_s, self.cfg.max_retries + 1
        for attempt in range(attempts):
            url = f"{self.urls[(first + attempt) % len(self.urls)]}/{path}"
            try:
                return self._request(url, body)
            except urllib.error.HTTPError as e:
                reason = f"HTTP {e.code} from {url}: {e.read()[:300].decode(errors='replace')}"
                if 400 <= e.code < 500 and e.code not in (408, 429):
                    raise RequestFailed(reason) from None  # the request itself is wrong
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                reason = f"{url}: {getattr(e, 'reason', e)}"
            except json.JSONDecodeError as e:
                reason = f"{url}: not a JSON response ({e.msg})"
            if attempt + 1 < attempts:
                time.sleep(delay)
                delay *= 2
        raise RequestFailed(f"{reason} (after {attempts} attempts)")

    def _served_model(self) -> str:
        try:
            listing = self._with_retries("models", None)
            return str(listing["data"][0]["id"])
        except (RequestFailed, KeyError, IndexError, TypeError) as e:
            raise ConfigError(
                f"regenerate.base_urls[0]={self.urls[0]}: cannot list its models ({e}); start "
                "the server first, check the URL (it ends in /v1), or set regenerate.model."
            ) from None

    def _reply(self, index: int, history: Conversation) -> Reply | RequestFailed:
        body = {
            "model": self.model,
            "messages": history,
            "max_tokens": self.cfg.max_new_tokens,
            "temperature": self.cfg.temperature,
            "top_p": self.cfg.top_p,
        }
        try:
            response = self._with_retries("chat/completions", body, first=index)
            choice = response["choices"][0]
            message = choice["message"]
            return finish_reply(
                message.get("content") or "",
                message.get("reasoning_content"),
                cut=choice.get("finish_reason") == "length",
            )
        except RequestFailed as e:
            return e
        except (KeyError, IndexError, TypeError) as e:
            return RequestFailed(f"unexpected response shape ({type(e).__name__}: {e})")

    def __call__(self, histories: list[Conversation]) -> list[Reply | RequestFailed]:
        start = self.calls
        self.calls += len(histories)
        futures = [
            self.pool.submit(self._reply, start + i, history) for i, history in enumerate(histories)
        ]
        return [f.result() for f in futures]


class HFBackend:
    """Batched ``generate`` with the target in this process (left-padded prompts)."""

    def __init__(
        self, cfg: RegenerateConfig, model: Any, tokenizer: Any, device: torch.device, name: str
    ) -> None:
        self.cfg, self.model, self.tokenizer, self.device = cfg, model, tokenizer, device
        self.model_name = name  # recorded with the output (see run_settings)
        # a row that ends in none of these was cut at max_new_tokens
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.stop_ids = set(tokenizer.all_special_ids) | set(
            eos if isinstance(eos, list) else [] if eos is None else [eos]
        )

    @classmethod
    def from_config(cls, cfg: RegenerateConfig, config: EagleForgeConfig) -> HFBackend:
        from eagleforge.parallel import resolve_device
        from eagleforge.targets.hf import HFTarget
        from eagleforge.targets.source import load_tokenizer, resolve_model_dir

        device = resolve_device(config.parallel)
        model_dir = resolve_model_dir(config.model, config.resolved_cache_dir())
        tokenizer = load_tokenizer(config.model, model_dir)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        target = HFTarget.from_config(config.model, config.target, model_dir, device)
        torch.manual_seed(cfg.seed)  # generate() samples from the global generator
        return cls(cfg, target.model, tokenizer, device, hf_model_name(config))

    @torch.no_grad()
    def __call__(self, histories: list[Conversation]) -> list[Reply | RequestFailed]:
        replies: list[Reply | RequestFailed] = []
        for start in range(0, len(histories), self.cfg.batch_size):
            batch = histories[start : start + self.cfg.batch_size]
            prompts = [
                self.tokenizer.apply_chat_template(h, tokenize=False, add_generation_prompt=True)
                for h in batch
            ]
            inputs = self.tokenizer(
                prompts, return_tensors="pt", padding=True, add_special_tokens=False
            ).to(self.device)
            sampling = self.cfg.temperature > 0
            output = self.model.generate(
                **inputs,
                max_new_tokens=self.cfg.max_new_tokens,
                do_sample=sampling,
                temperature=self.cfg.temperature if sampling else None,
                top_p=self.cfg.top_p if sampling else None,
                top_k=None,
                pad_token_id=self.tokenizer.pad_token_id,
            )
            new_tokens = output[:, inputs["input_ids"].shape[1] :].tolist()
            replies += [self._reply(ids) for ids in new_tokens]
        return replies

    @torch.no_grad()
    def user_turns(self, count: int, cfg: MagpieConfig) -> list[str]:
        """``count`` distinct first user turns sampled from the chat template's user header
        (Magpie), in the order written; those the target does not end are dropped."""
        header = user_header(self.tokenizer)
        ids = self.tokenizer(header, return_tensors="pt", add_special_tokens=False).input_ids
        ids = ids.to(self.device).expand(self.cfg.batch_size, -1)
        prompts: dict[str, None] = {}  # insertion-ordered set
        tries, max_tries = 0, 4 * count + 4 * self.cfg.batch_size
        bar = tqdm(total=count, unit="prompt", desc="magpie prompts")
        while len(prompts) < count:
            if tries >= max_tries:
                raise ConfigError(
                    f"regenerate.magpie: the target wrote only {len(prompts)} distinct, ended "
                    f"prompts in {tries} tries; raise regenerate.magpie.max_new_tokens or "
                    "temperature, or ask for fewer."
                )
            output = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=cfg.max_new_tokens,
                do_sample=True,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                top_k=None,
                pad_token_id=self.tokenizer.pad_token_id,
            )
            tries += len(ids)
            for row in output[:, ids.shape[1] :].tolist():
                end = next((i for i, t in enumerate(row) if t in self.stop_ids), None)
                text = "" if end is None else self.tokenizer.decode(row[:end]).strip()
                if text and text not in prompts and len(prompts) < count:
                    prompts[text] = None
                    bar.update()
        bar.close()
        return list(prompts)

    def _reply(self, ids: list[int]) -> Reply:
        """One row of new tokens as a reply. A row that ends in an ordinary token was cut at
        max_new_tokens (an ended one ends in eos, then padding); when the cut split a
        character, the tokens that carry its first bytes are dropped too, so the reply is a
        whole-token prefix of what the target generated."""
        cut = bool(ids) and ids[-1] not in self.stop_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        while cut and ids and text.endswith(PARTIAL_CHAR):
            ids = ids[:-1]
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return finish_reply(text, None, cut=cut)


def user_header(tokenizer: Any) -> str:
    """The chat template's text before a first user message's content (with the template's
    default system prompt, if it has one): where the target, continuing, writes a prompt."""
    mark = "\x00magpie\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    if text.count(mark) != 1:
        raise ConfigError(
            "regenerate.magpie: the tokenizer's chat template does not render a user message "
            "verbatim, so its user header cannot be found; this model needs prompts from data."
        )
    return str(text[: text.index(mark)])


def hf_model_name(config: EagleForgeConfig) -> str:
    """The target of the hf backend as recorded with the output: its path or hub id (at a
    revision), or its source for the bundled and random models."""
    model = config.model
    name = model.path or model.source.value
    return f"{name}@{model.revision}" if model.revision else name


# ---------------------------------------------------------------------------------------------
# The job


@dataclass
class Summary:
    rows: int  # conversations regenerated by this call (resumed chunks not counted)
    written: int  # rows in the output
    failed: int  # conversations whose requests failed after every retry
    skipped: int  # source rows that could not be read (data.on_error=skip)
    seconds: float

    @property
    def rows_per_s(self) -> float:
        return self.rows / max(self.seconds, 1e-9)


# the turn regenerate_rows writes after each Magpie prompt (read, never changed)
ASSISTANT_TO_WRITE = {"role": "assistant", "content": ""}


def magpie_rows(
    path: Path, cfg: RegenerateConfig, backend: Callable[[], Generate]
) -> tuple[list[Row], list[str]]:
    """The rows to answer and the held-out prompts of a Magpie job: read from ``path`` when an
    earlier call wrote them, else written by the target and saved there first."""
    magpie = cfg.magpie
    wanted = magpie.num_prompts + magpie.held_out
    if path.exists():
        prompts = [json.loads(line) for line in path.read_text().splitlines()]
        if len(prompts) != wanted:
            raise ConfigError(
                f"regenerate.magpie asks for {magpie.num_prompts} + {magpie.held_out} held-out "
                f"prompts but {path} holds the {len(prompts)} an earlier call wrote: rerun with "
                f"those numbers to resume, or remove {path.parent} to start over."
            )
    else:
        generate = backend()
        assert isinstance(generate, HFBackend)  # RegenerateConfig requires backend=hf
        prompts = generate.user_turns(wanted, magpie)
        write_lines_atomically(path, [json.dumps(p) for p in prompts])
    rows = [
        Row(i, f"magpie-{i:06d}", [{"role": "user", "content": p}, ASSISTANT_TO_WRITE])
        for i, p in enumerate(prompts[: magpie.num_prompts])
    ]
    return rows, prompts[magpie.num_prompts :]


def run_settings(config: EagleForgeConfig, rows: list[Row]) -> dict[str, Any]:
    """What defines the output: the source conversations and how the target rewrites them.
    Kept beside the chunks; a resumed job must match it (``model`` is added once known)."""
    cfg, data = config.regenerate, config.data
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps([row.id, row.messages], sort_keys=True).encode() + b"\n")
    magpie = cfg.magpie.num_prompts > 0
    return {
        "source": {
            "format": "magpie" if magpie else data.format.value,
            "files": [] if magpie else [str(f) for f in source_files(data.format, data.sources())],
            "max_rows": cfg.max_rows if cfg.max_rows is not None else data.max_num_samples,
            "rows": len(rows),
            "sha256": digest.hexdigest(),
        },
        "magpie": dataclasses.asdict(cfg.magpie) if magpie else None,
        "backend": cfg.backend.value,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "max_new_tokens": cfg.max_new_tokens,
        "keep_reasoning": cfg.keep_reasoning,
        "num_samples": cfg.num_samples,
        # last: a change of sampling is named by its own field first
        "seed": cfg.seed if magpie or cfg.temperature > 0 else None,
    }


def check_same_settings(
    recorded: dict[str, Any], settings: dict[str, Any], chunks_dir: Path
) -> None:
    """ConfigError naming the first field of ``settings`` that differs from ``recorded``."""
    redo = (
        f"or choose another regenerate.output (resuming would make one data set of two), or "
        f"remove {chunks_dir} to start over."
    )
    for name, value in settings.items():
        old: Any = recorded.get(name)
        # a field missing from ``recorded`` is one an older eagleforge did not record
        if value is None or value == old or name not in recorded:
            continue
        if name == "source":  # the same conversations, wherever the files are now
            if (value["rows"], value["sha256"]) == (old["rows"], old["sha256"]):
                continue
            if value["max_rows"] != old["max_rows"]:
                raise ConfigError(
                    f"regenerate.max_rows={_show(value['max_rows'])} (or data.max_num_samples) "
                    f"but the chunks in {chunks_dir} were made from "
                    f"{'all' if old['max_rows'] is None else 'the first ' + str(old['max_rows'])} "
                    "conversations: rerun with that limit to resume, " + redo
                )
            raise ConfigError(
                f"data.path={','.join(value['files']) or value['format']} gives other "
                f"conversations than the {old['rows']} the chunks in {chunks_dir} were made "
                f"from (read from {','.join(old['files']) or old['format']}; ids are file:line "
                "where rows have none): rerun with that data to resume, " + redo
            )
        raise ConfigError(
            f"regenerate.{name}={_show(value)} but the chunks in {chunks_dir} were made with "
            f"regenerate.{name}={_show(old)}: rerun with that value to resume, " + redo
        )


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def run(config: EagleForgeConfig, generate: Generate | None = None) -> Summary:
    """Regenerate ``config.data`` into ``config.regenerate.output``, resuming finished chunks."""
    cfg = config.regenerate
    if not cfg.output:
        raise ConfigError("regenerate.output is not set: give the jsonl file to write.")
    output = Path(cfg.output)
    if output.exists():
        raise ConfigError(
            f"regenerate.output={output} exists (a finished job); remove it or choose another file."
        )
    chunks_dir = output.with_name(f"{output.name}.chunks")
    chunks_dir.mkdir(parents=True, exist_ok=True)

    @functools.cache
    def backend() -> Generate:  # loaded only when there is work for it
        if generate is not None:
            return generate
        if cfg.backend == Backend.server:
            return ServerBackend(cfg)
        return HFBackend.from_config(cfg, config)

    held_out: list[str] = []
    if cfg.magpie.num_prompts:
        rows, held_out = magpie_rows(chunks_dir / "prompts.jsonl", cfg, backend)
        bad_rows: list[dict[str, Any]] = []
    else:
        limit = cfg.max_rows if cfg.max_rows is not None else config.data.max_num_samples
        rows, bad_rows = read_input(config.data, limit)
    settings_path = chunks_dir / "settings.json"
    failures_path = output.with_name(f"{output.name}.failed.jsonl")
    done = finished_chunks(chunks_dir, len(rows))
    settings = run_settings(config, rows)
    if done and not settings_path.exists():
        raise ConfigError(
            f"{chunks_dir} holds chunks but not the settings.json they were made with; remove "
            "the directory to start over."
        )
    recorded = json.loads(settings_path.read_text()) if done else None
    if recorded is not None:
        check_same_settings(recorded, settings, chunks_dir)
    todo = unfinished_chunks(len(rows), done, cfg.chunk_rows)
    done_rows = sum(end - start for start, end in done)
    if done_rows:
        log.info("resuming: %d of %d conversations already done", done_rows, len(rows))
    start = time.perf_counter()
    if todo:
        generate = backend()
        model = getattr(generate, "model_name", None) or cfg.model
        if model is None and cfg.backend == Backend.hf:
            model = hf_model_name(config)
        if recorded is not None:
            check_same_settings(recorded, {"model": model}, chunks_dir)
        else:  # before the first chunk: every chunk on disk was made with these settings
            write_lines_atomically(settings_path, [json.dumps({**settings, "model": model})])
        bar = tqdm(total=len(rows), initial=done_rows, unit="conv", desc="regenerate")
        for span in todo:
            out, failures = regenerate_rows(rows[span[0] : span[1]], generate, cfg)
            # failures first: a chunk file is the mark that its failures are recorded too
            write_lines_atomically(
                chunk_path(chunks_dir, span, ".failed.jsonl"), [json.dumps(f) for f in failures]
            )
            write_lines_atomically(chunk_path(chunks_dir, span), [json.dumps(r) for r in out])
            bar.update(span[1] - span[0])
        bar.close()
    seconds = time.perf_counter() - start
    spans = finished_chunks(chunks_dir, len(rows))
    if unfinished_chunks(len(rows), spans, cfg.chunk_rows):  # a bug, never a silent loss
        raise RuntimeError(f"chunks {spans} in {chunks_dir} miss some of the {len(rows)} rows")
    written = _join(chunks_dir, spans, output)
    recorded_failures = _join_failures(chunks_dir, spans, bad_rows, failures_path)
    if cfg.magpie.held_out:
        write_lines_atomically(
            output.with_name(f"{output.stem}.heldout.jsonl"),
            [json.dumps({"id": f"heldout-{i:06d}", "turns": [p]}) for i, p in enumerate(held_out)],
        )
    (chunks_dir / "prompts.jsonl").unlink(missing_ok=True)  # now in the output
    if settings_path.exists():  # kept with the data it describes
        os.replace(settings_path, output.with_name(f"{output.name}.settings.json"))
    for tmp in chunks_dir.glob(".tmp-*"):  # a write a kill interrupted
        tmp.unlink()
    chunks_dir.rmdir()
    summary = Summary(
        len(rows) - done_rows, written, recorded_failures - len(bad_rows), len(bad_rows), seconds
    )
    log.info(
        "regenerated %d conversations (%.2f/s): %d rows written to %s; %d failed, %d source "
        "rows unreadable%s",
        summary.rows,
        summary.rows_per_s,
        written,
        output,
        summary.failed,
        summary.skipped,
        f" (see {failures_path})" if recorded_failures else "",
    )
    return summary


def _join(chunks_dir: Path, spans: list[tuple[int, int]], output: Path) -> int:
    """Every chunk, in order, into ``output`` (atomically); the chunks are then removed."""
    lines = []
    for span in spans:
        lines += chunk_path(chunks_dir, span).read_text().splitlines()
    write_lines_atomically(output, lines)
    for span in spans:
        chunk_path(chunks_dir, span).unlink()
    return len(lines)


def _join_failures(
    chunks_dir: Path, spans: list[tuple[int, int]], bad_rows: list[dict[str, Any]], path: Path
) -> int:
    lines = [json.dumps(row) for row in bad_rows]
    for span in spans:
        part = chunk_path(chunks_dir, span, ".failed.jsonl")
        lines += part.read_text().splitlines()
        part.unlink()
    if lines:
        write_lines_atomically(path, lines)
    return len(lines)
