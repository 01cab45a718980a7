"""Talking to a vLLM server: completions of token-id prompts (one, or many at once), and the
engine's own speculative-decoding counters from its Prometheus ``/metrics``."""

from __future__ import annotations

import http.client
import json
import logging
import re
import time
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from eagleforge.errors import EagleForgeError

log = logging.getLogger(__name__)

# the name eagleforge serves its target under (--served-model-name)
SERVED_NAME = "target"


def http_error_summary(error: urllib.error.HTTPError, url: str) -> str:
    """One line for an HTTP error answer: the status, the URL and a short reason -- the
    server's own error message when its body is OpenAI-style JSON, else the status phrase.
    The body itself (a proxy's or web server's HTML page, often) goes to the debug log."""
    body = error.read().decode(errors="replace")
    log.debug("HTTP %d from %s; the response body:\n%s", error.code, url, body)
    try:
        answer = json.loads(body)
    except ValueError:
        answer = None
    reason: Any = error.reason
    if isinstance(answer, dict):
        detail = answer.get("error", answer.get("message", answer.get("detail")))
        if isinstance(detail, dict):
            detail = detail.get("message")
        reason = detail if isinstance(detail, str) and detail.strip() else reason
    short = " ".join(str(reason or "").split())
    short = short if len(short) <= 200 else short[:199] + "…"
    return f"HTTP {error.code} from {url}" + (f": {short}" if short else "")


class EngineRequestError(EagleForgeError):
    """A request to the engine failed; the message names the URL (and the engine's log), and
    ``status`` the HTTP status of its answer, where it answered."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class EngineUnreachable(EngineRequestError):
    """No answer at all: the connection was refused, reset or timed out (no HTTP status)."""


@dataclass
class Completion:
    token_ids: list[int]
    finish_reason: str | None
    seconds: float  # wall time of this request alone
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters (``vllm:spec_decode_*_total``)."""

    drafts: float = 0.0  # verification rounds that carried drafts
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    accepted_per_position: list[float] = field(default_factory=list)

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        mine = self.accepted_per_position + [0.0] * (width - len(self.accepted_per_position))
        theirs = other.accepted_per_position + [0.0] * (width - len(other.accepted_per_position))
        return SpecCounters(
            self.drafts - other.drafts,
            self.draft_tokens - other.draft_tokens,
            self.accepted_tokens - other.accepted_tokens,
            [a - b for a, b in zip(mine, theirs, strict=True)],
        )

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification round, the target's own one included (vLLM's τ)."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """P(draft j accepted | drafts before it were), as eagleforge's decoder reports it."""
        reached = [self.drafts, *self.accepted_per_position]
        return [
            reached[j + 1] / reached[j] if reached[j] else 0.0
            for j in range(len(self.accepted_per_position))
        ]


def parse_spec_counters(text: str, prefix: str = "vllm") -> SpecCounters:
    """The counters of a Prometheus text page (engines summed): ``<prefix>:spec_decode_*_total``,
    the names vLLM gives them and llama.cpp's ``llama-server`` too (prefix ``llamacpp``)."""
    metric = re.compile(
        rf"^{re.escape(prefix)}:spec_decode_(\w+?)_total(?:\{{([^}}]*)\}})?\s+([0-9.eE+-]+)$"
    )
    counters = SpecCounters()
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        match = metric.match(line.strip())
        if not match:
            continue
        name, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
        if name == "num_drafts":
            counters.drafts += value
        elif name == "num_draft_tokens":
            counters.draft_tokens += value
        elif name == "num_accepted_tokens":
            counters.accepted_tokens += value
        elif name == "num_accepted_tokens_per_pos":
            position = re.search(r'position="(\d+)"', labels)
            if position:
                index = int(position.group(1))
                per_pos[index] = per_pos.get(index, 0.0) + value
    counters.accepted_per_position = [per_pos.get(i, 0.0) for i in range(len(per_pos))]
    return counters


class EngineClient(ABC):
    """Requests to one engine server over HTTP (``url`` without /v1). ``describe``, for a
    server eagleforge started, says in errors whether it still runs and where its log is. A
    subclass gives ``complete``; the speculative counters are read from ``/metrics`` under
    ``metric_prefix``."""

    metric_prefix = "vllm"

    def __init__(
        self, url: str, timeout_s: float, describe: Callable[[], str] | None = None
    ) -> None:
        self.url = url.rstrip("/").removesuffix("/v1")
        self.timeout_s = timeout_s
        self.describe = describe

    def _where(self) -> str:
        return f"{self.url} ({self.describe()})" if self.describe else self.url

    def _request(self, path: str, body: dict[str, Any] | None = None) -> bytes:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            f"{self.url}/{path}", data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return bytes(response.read())
        except urllib.error.HTTPError as e:
            summary = http_error_summary(e, f"{self._where()}/{path}")
            raise EngineRequestError(summary, status=e.code) from None
        # HTTPException: the answer broke off (IncompleteRead: the server died while answering)
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError,
                http.client.HTTPException) as e:  # fmt: skip
            raise EngineUnreachable(
                f"the engine at {self._where()} did not answer /{path}: {getattr(e, 'reason', e)}"
            ) from None

    def healthy(self, timeout_s: float = 5.0) -> bool:
        """Whether the server answers ``/health`` with 200 within ``timeout_s``."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=timeout_s) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def _post(self, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
        """The JSON answer to ``body`` posted to ``path``, and the request's wall time."""
        start = time.perf_counter()
        response = json.loads(self._request(path, body))
        return response, time.perf_counter() - start

    @abstractmethod
    def complete(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        model: str = SERVED_NAME,
        extra: dict[str, Any] | None = None,
    ) -> Completion:
        """One completion of a token-id prompt; the new token ids come back as ids (the stop
        token included, as eagleforge's decoder counts it)."""

    def complete_many(
        self, prompts: list[list[int]], concurrency: int, **kwargs: Any
    ) -> tuple[list[Completion], float]:
        """Every prompt, ``concurrency`` requests in flight at once (the engine batches them):
        the completions in prompt order and the wall time of them all."""
        start = time.perf_counter()
        with ThreadPoolExecutor(max(1, concurrency)) as pool:
            results = list(pool.map(lambda ids: self.complete(ids, **kwargs), prompts))
        return results, time.perf_counter() - start

    def spec_counters(self) -> SpecCounters:
        text = self._request("metrics").decode(errors="replace")
        return parse_spec_counters(text, self.metric_prefix)


class VLLMClient(EngineClient):
    """vLLM's OpenAI-compatible API: completions of token-id prompts, ids back."""

    def model(self) -> str:
        """The first model the server serves."""
        return str(self.served_model()["id"])

    def served_model(self) -> dict[str, Any]:
        """The first entry of ``/v1/models``: its ``id`` (the served name) and ``root`` (the
        path or hub id the server loaded)."""
        listing = json.loads(self._request("v1/models"))
        try:
            return dict(listing["data"][0])
        except (KeyError, IndexError, TypeError) as e:
            raise EngineRequestError(
                f"{self._where()}/v1/models lists no model ({type(e).__name__}: {e})"
            ) from None

    def complete(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        model: str = SERVED_NAME,
        extra: dict[str, Any] | None = None,
    ) -> Completion:
        """One completion of a token-id prompt; the new token ids come back as ids."""
        body: dict[str, Any] = {
            "model": model,
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "return_token_ids": True,
            **(extra or {}),
        }
        if seed is not None:
            body["seed"] = seed
        response, seconds = self._post("v1/completions", body)
        try:
            choice = response["choices"][0]
            ids = [int(i) for i in choice["token_ids"]]
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise EngineRequestError(
                f"unexpected completion from {self._where()} ({type(e).__name__}: {e}); is it "
                "vLLM >= 0.10 (return_token_ids)?"
            ) from None
        return Completion(
            ids, choice.get("finish_reason"), seconds, response.get("kv_transfer_params")
        )
