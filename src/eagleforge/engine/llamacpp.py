"""llama.cpp's ``llama-server`` as an engine eagleforge starts and talks to: the target GGUF
alone or with a GGUF draft, token-id prompts through its native ``/completion`` endpoint, and
its speculative-decoding counters from ``/metrics`` (``llamacpp:spec_decode_*_total``, the
names vLLM gives them, per draft position too).

    with LlamaServer(cfg, target_gguf, log_path, draft=..., spec_type="draft-eagle3",
                     num_draft_tokens=3) as server:
        client = server.client()

The server is ``llamacpp.server``, else ``$EAGLEFORGE_LLAMA_SERVER``, else the one ``make
llamacpp`` built into eagleforge's cache (``engine/llamacpp_build.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagleforge.engine.client import SERVED_NAME, Completion, EngineClient, EngineRequestError
from eagleforge.engine.config import LlamaCppConfig
from eagleforge.engine.llamacpp_build import SERVER_ENV, find_server
from eagleforge.engine.server import EngineError, EngineProcess

# llama-server's stop_type -> the OpenAI finish_reason vLLM gives
_FINISH = {"eos": "stop", "word": "stop", "limit": "length"}


def llama_server(cfg: LlamaCppConfig) -> Path:
    """The ``llama-server`` to run; EngineError naming what to do when there is none."""
    if cfg.server:
        path = Path(cfg.server).expanduser()
        if path.is_file():
            return path
        raise EngineError(
            f"llamacpp.server={cfg.server}: no such file; build one with `make llamacpp`."
        )
    found = find_server()
    if found is None:
        raise EngineError(
            f"no llama-server: build it with `make llamacpp` (once per machine, into eagleforge's "
            f"cache), or set llamacpp.server or ${SERVER_ENV} to one."
        )
    return found


def command_threads() -> int:
    """The threads this command computes with (parallel.num_threads, else OMP_NUM_THREADS,
    else the cores): llama-server's default where llamacpp.threads is unset. ggml's threads
    spin while they wait, so more of them than the cores left free slows it down: SmolLM2's
    128 tokens beside one busy core took 3.8 s on both cores' threads, 1.6 s on one."""
    import torch

    return torch.get_num_threads()


def server_command(
    cfg: LlamaCppConfig,
    server: Path,
    target: Path,
    port: int,
    draft: Path | None = None,
    spec_type: str | None = None,
    num_draft_tokens: int = 0,
    seed: int = 0,
) -> list[str]:
    """``llama-server``'s command line: the target GGUF on 127.0.0.1:``port``, ``parallel``
    slots of ``max_model_len`` tokens each, its Prometheus metrics on; with ``draft``, the
    draft GGUF as ``spec_type`` drafting chains of ``num_draft_tokens``."""
    command = [str(server), "-m", str(target), "--host", "127.0.0.1", "--port", str(port)]
    command += ["--parallel", str(cfg.parallel), "-c", str(cfg.max_model_len * cfg.parallel)]
    command += ["--metrics", "--seed", str(seed), "--alias", SERVED_NAME]
    command += ["-t", str(cfg.threads or command_threads())]
    if draft is not None:
        if spec_type is None or num_draft_tokens < 1:
            raise ValueError("a draft needs its spec_type and num_draft_tokens >= 1")
        command += ["-md", str(draft), "--spec-type", spec_type]
        command += ["--spec-draft-n-max", str(num_draft_tokens)]
        command += ["--spec-draft-p-min", f"{cfg.draft_p_min:g}"]
    return command + list(cfg.extra_args)


class LlamaServer(EngineProcess):
    """One ``llama-server`` process (see the module docstring)."""

    def __init__(
        self,
        cfg: LlamaCppConfig,
        target: str | Path,
        log_path: str | Path,
        draft: str | Path | None = None,
        spec_type: str | None = None,
        num_draft_tokens: int = 0,
        name: str = "llama.cpp",
        seed: int = 0,
    ) -> None:
        super().__init__(log_path, name, cfg.startup_timeout_s, "llamacpp.startup_timeout_s")
        self.cfg = cfg
        self.command = server_command(
            cfg, llama_server(cfg), Path(target), self.port,
            Path(draft) if draft is not None else None, spec_type, num_draft_tokens, seed,
        )  # fmt: skip

    def client(self) -> LlamaCppClient:
        return LlamaCppClient(self.url, self.cfg.request_timeout_s, self.describe)


class LlamaCppClient(EngineClient):
    """``llama-server``'s native API: ``/completion`` of a token-id prompt with the new ids
    back (``return_tokens``), its prompt cache off so that every pass is timed whole."""

    metric_prefix = "llamacpp"

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
        """One completion. llama-server stops at its GGUF's end-of-generation tokens and has
        no stop ids: ``extra["stop_token_ids"]`` cuts the ids after the first of them, so the
        output is what an engine that stops there returns. Sampling is only temperature and
        ``top_p`` (llama.cpp's top-k 40 and min-p 0.05 defaults off)."""
        options = dict(extra or {})
        stop_ids = {int(i) for i in options.pop("stop_token_ids", [])}
        body: dict[str, Any] = {
            "prompt": prompt_ids,
            "n_predict": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": 0,
            "min_p": 0.0,
            "cache_prompt": False,
            "return_tokens": True,
            "stream": False,
            **options,
        }
        if seed is not None:
            body["seed"] = seed
        response, seconds = self._post("completion", body)
        try:
            ids = [int(i) for i in response["tokens"]]
        except (KeyError, TypeError, ValueError) as e:
            raise EngineRequestError(
                f"unexpected completion from {self._where()} ({type(e).__name__}: {e}); is it "
                "llama.cpp's llama-server?"
            ) from None
        finish = _FINISH.get(str(response.get("stop_type")))
        for i, token in enumerate(ids):
            if token in stop_ids:
                ids, finish = ids[: i + 1], "stop"
                break
        return Completion(ids, finish, seconds)
