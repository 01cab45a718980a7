"""The backends that write the replies: an OpenAI-compatible server, the target in process,
or the vLLM engine eagleforge runs.

Each is a ``Generate`` (``eagleforge.regeneration.rows``): histories in, one reply each out,
every reply through the same post-processing (``finish_reply``).
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from eagleforge.data.conversations import Conversation
from eagleforge.engine.client import (
    Completion,
    EngineRequestError,
    VLLMClient,
    http_error_summary,
)
from eagleforge.engine.server import EngineError
from eagleforge.errors import ConfigError
from eagleforge.regeneration.config import MagpieConfig, RegenerateConfig
from eagleforge.regeneration.rows import Reply, RequestFailed

if TYPE_CHECKING:
    from eagleforge.targets.source import ModelConfig

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
                reason = http_error_summary(e, url)
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
        self.stop_ids = stop_ids_of(tokenizer, eos)

    @torch.no_grad()
    def __call__(self, histories: list[Conversation]) -> list[Reply | RequestFailed]:
        rendered = [
            self.tokenizer.apply_chat_template(h, tokenize=False, add_generation_prompt=True)
            for h in histories
        ]
        ids = self.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        # batches of similar lengths: one long prompt pads its whole batch (64 chitchat turns
        # padded to 329 tokens answer at 125 tokens/s, 64 of one length at 472)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        replies: dict[int, Reply | RequestFailed] = {}
        for start in range(0, len(order), self.cfg.batch_size):
            batch = order[start : start + self.cfg.batch_size]
            inputs = self.tokenizer.pad(
                {"input_ids": [ids[i] for i in batch]}, return_tensors="pt"
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
            for i, row in zip(batch, new_tokens, strict=True):
                replies[i] = self._reply(row)
        return [replies[i] for i in range(len(ids))]

    def _reply(self, ids: list[int]) -> Reply:
        """One row of new tokens as a reply: a row that ends in an ordinary token was cut at
        max_new_tokens (an ended one ends in eos, then padding)."""
        cut = bool(ids) and ids[-1] not in self.stop_ids
        return reply_from_ids(self.tokenizer, ids, cut)

    def sample_rows(self, prompt_ids: list[int], cfg: MagpieConfig) -> list[list[int]]:
        """``batch_size`` sampled continuations of ``prompt_ids`` (Magpie's prompts)."""
        from eagleforge.regeneration.magpie import sample_continuations

        ids = torch.tensor([prompt_ids], device=self.device).expand(self.cfg.batch_size, -1)
        return list(sample_continuations(self.model, ids, cfg, self.stop_ids).tolist())


def reply_from_ids(tokenizer: Any, ids: list[int], cut: bool) -> Reply:
    """New tokens as a reply. When the max_new_tokens cut (``cut``) split a character, the
    tokens that carry its first bytes are dropped too, so the reply is a whole-token prefix of
    what the target generated."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    while cut and ids and text.endswith(PARTIAL_CHAR):
        ids = ids[:-1]
        text = tokenizer.decode(ids, skip_special_tokens=True)
    return finish_reply(text, None, cut=cut)


def stop_ids_of(tokenizer: Any, generation_eos: Any) -> set[int]:
    """The ids after which a reply has ended: the tokenizer's special ids and the generation
    config's eos."""
    eos = generation_eos if isinstance(generation_eos, list) else [generation_eos]
    return set(tokenizer.all_special_ids) | {int(i) for i in eos if i is not None}


class VLLMBackend:
    """Token-id completions from a vLLM server: the conversations rendered with the target's
    own chat template here (exactly as training renders them), ``concurrency`` requests in
    flight, which the engine batches continuously. Sampling is seeded by the engine
    (``--seed``), not per request: vLLM's CPU build dies on a seeded request whose prefill is
    split ("CPU Generator does not use offset"). ``engine_alive`` (an engine eagleforge
    started) turns a failure of a stopped engine into an EngineError that ends the job, so no
    row is recorded as failed for it and a rerun answers them."""

    def __init__(
        self, cfg: RegenerateConfig, client: VLLMClient, tokenizer: Any, stop_ids: set[int],
        name: str, served: str, engine_alive: Callable[[], bool] | None = None,
    ) -> None:  # fmt: skip
        self.cfg, self.client, self.tokenizer, self.served = cfg, client, tokenizer, served
        self.stop_ids, self.engine_alive = stop_ids, engine_alive
        self.model_name = name  # recorded with the output (see run_settings)
        self.pool = ThreadPoolExecutor(cfg.concurrency)

    def _complete(
        self, ids: list[int], temperature: float, top_p: float, max_tokens: int, top_k: int = 0
    ) -> Completion | RequestFailed:
        extra: dict[str, Any] = {"stop_token_ids": sorted(self.stop_ids)}
        if top_k:
            extra["top_k"] = top_k
        try:
            return self.client.complete(
                ids, max_tokens, temperature, top_p, model=self.served, extra=extra
            )
        except EngineRequestError as e:
            if self.engine_alive is not None and not self.engine_alive():
                raise EngineError(f"the vLLM engine stopped: {e}") from None
            return RequestFailed(str(e))

    def __call__(self, histories: list[Conversation]) -> list[Reply | RequestFailed]:
        prompts = [
            list(
                self.tokenizer.apply_chat_template(
                    h, tokenize=True, add_generation_prompt=True, return_dict=False
                )
            )
            for h in histories
        ]
        cfg = self.cfg
        done = self.pool.map(
            lambda ids: self._complete(ids, cfg.temperature, cfg.top_p, cfg.max_new_tokens),
            prompts,
        )
        return [d if isinstance(d, RequestFailed) else self._reply(d) for d in done]

    def _reply(self, done: Completion) -> Reply:
        ids = [i for i in done.token_ids if i not in self.stop_ids]  # the stop token ends it
        return reply_from_ids(self.tokenizer, ids, cut=done.finish_reason == "length")

    def sample_rows(self, prompt_ids: list[int], cfg: MagpieConfig) -> list[list[int]]:
        """``concurrency`` sampled continuations of ``prompt_ids`` (Magpie's prompts); a
        request that failed gives an empty row (not ended: dropped)."""
        done = self.pool.map(
            lambda _: self._complete(
                prompt_ids, cfg.temperature, cfg.top_p, cfg.max_new_tokens, cfg.top_k
            ),
            range(self.cfg.concurrency),
        )
        return [[] if isinstance(d, RequestFailed) else list(d.token_ids) for d in done]


def hf_model_name(model: ModelConfig) -> str:
    """The target of the hf backend as recorded with the output: its path or hub id (at a
    revision), or its source for the bundled and random models."""
    name = model.path or model.source.value
    return f"{name}@{model.revision}" if model.revision else name
