"""``target=vllm``: vLLM engines as the target whose hidden states are captured.

vLLM serves the target with its ``extract_hidden_states`` speculative method and eagleforge's
capture connector (``engine/capture_connector.py``, CPU-safe): every prompt goes to an engine
as one request for a single token, and the connector writes the states of the prompt's tokens
to a file, which is read back, checked (its tokens, its layers) and deleted. vLLM collects a
layer's *input*, so eagleforge's output-of-layer aux ids a are vLLM's a + 1, and the last
layer's output is id N (before the final norm): the final state is that through the target's
final RMSNorm, computed here as transformers' Llama / Qwen / Mistral norm computes it.

The producers (``target.producers``) are engines eagleforge starts, or capture servers already
running at URLs (``python -m eagleforge.serve_target``), behind one ``ProducerPool``: a batch's
rows are in flight at once over all of them (the engines prefill them together), and training
takes single prompts' states as a stream (``submit``; ``data/stream.py``).

The embedding, lm_head and final norm come from the target's safetensors (``HeadOnlyTarget``).
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagleforge.engine.client import (
    SERVED_NAME,
    EngineRequestError,
    EngineUnreachable,
    VLLMClient,
)
from eagleforge.engine.config import VLLMConfig
from eagleforge.engine.server import EngineError, VLLMServer, refuse_cpu_engines_past_machine
from eagleforge.errors import ConfigError
from eagleforge.files import resolve_cache_dir
from eagleforge.fingerprint import weights_fingerprint
from eagleforge.targets.base import TargetOutput, refuse_images
from eagleforge.targets.config import ProducersConfig
from eagleforge.targets.head import HeadOnlyTarget
from eagleforge.targets.producers import ProducerDown, ProducerPool

CONNECTOR = "EagleforgeCaptureConnector"
CONNECTOR_MODULE = "eagleforge.engine.capture_connector"
# final norms computed as w * x / rms(x); families whose norm differs (Gemma's 1 + w) are refused
PLAIN_RMS_NORM = {"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "phi3"}


def capture_layer_ids(aux_layer_ids: list[int], num_layers: int) -> list[int]:
    """vLLM's ids of the states to capture: the aux layers' outputs (input of the next layer,
    a + 1) and the last layer's output (N), sorted and once each, as vLLM stores them."""
    return sorted({a + 1 for a in aux_layer_ids} | {num_layers})


def capture_config(layer_ids: list[int], files: str) -> dict[str, dict[str, Any]]:
    """The `vllm serve` settings of a capture engine: ``--speculative-config`` (vLLM's layer ids
    ``layer_ids``) and ``--kv-transfer-config`` (the connector writing into ``files``)."""
    return {
        "speculative": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}},
        },
        "kv_transfer": {
            "kv_connector": CONNECTOR,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": files},
        },
    }


def read_capture(path: str, ids: list[int], layer_ids: list[int], where: str) -> torch.Tensor:
    """[T, L, H] of the prompt ``ids`` from the connector's file at ``path`` (deleted after),
    checked: its tokens are the prompt's and its layers ``layer_ids``. ``where`` names the
    producer in errors."""
    if not os.path.exists(path + ".lock"):
        raise ConfigError(
            f"{where} wrote the states to {path}, which this machine cannot read; start the "
            "server with its files on a filesystem both machines mount at the same path "
            "(serve_target.files_dir)."
        )
    with open(path + ".lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)  # the connector holds LOCK_EX while it writes
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            hidden_TLH, token_ids = f.get_tensor("hidden_states"), f.get_tensor("token_ids")
    for name in (path, path + ".lock"):
        os.unlink(name)
    held = json.loads(metadata.get("layer_ids", "null"))
    if held != layer_ids:
        raise ConfigError(
            f"{where} captures vLLM layers {held}, and this run needs {layer_ids} "
            "(model.aux_layer_ids + 1, and the last layer); start it for this run's layers "
            "(python -m eagleforge.serve_target with the run's model settings)."
        )
    if token_ids.tolist() != ids:
        raise EngineError(
            f"the capture file {path} of {where} holds other tokens than the prompt's"
        )
    return hidden_TLH


def request_capture(
    client: VLLMClient, ids: list[int], model: str, alive: Callable[[], bool]
) -> str | None:
    """Ask the capture server behind ``client`` for the prompt ``ids``: the path of its states'
    file (None where the answer names none). ProducerDown where the server does not answer,
    or answers an error while its process is not ``alive`` or its /health fails; any other
    error answer is the prompt's own."""
    try:
        done = client.complete(ids, max_tokens=1, model=model, extra={"kv_transfer_params": {}})
    except EngineUnreachable as e:
        raise ProducerDown(str(e)) from None
    except EngineRequestError as e:
        if not alive() or not client.healthy():
            raise ProducerDown(str(e)) from None
        raise
    path = (done.kv_transfer_params or {}).get("hidden_states_path")
    return str(path) if path else None


class StartedEngine:
    """A capture engine eagleforge runs as its own process (``server``, launched); started
    again (``make``) when it dies."""

    def __init__(self, index: int, server: VLLMServer, make: Callable[[], VLLMServer],
                 layer_ids: list[int]) -> None:  # fmt: skip
        self.name = f"engine {index}"
        self.server, self._make, self.layer_ids = server, make, layer_ids
        self.client = server.client()
        self._lock, self._closed = threading.Lock(), False

    def capture(self, ids: list[int]) -> torch.Tensor:
        path = request_capture(self.client, ids, SERVED_NAME, self.server.alive)
        if not path:
            raise EngineError(
                f"{self.name} returned no hidden_states_path for a {len(ids)}-token prompt; its "
                f"log: {self.server.log_path}"
            )
        return read_capture(path, ids, self.layer_ids, self.name)

    def recover(self, deadline: float) -> None:
        if self.server.alive() and self.client.healthy():
            return  # a connection lost, not the engine
        self.server.stop(grace_s=5.0)
        if time.monotonic() >= deadline:
            raise ProducerDown("no time left to start it again")
        with self._lock:
            if self._closed:
                raise ProducerDown("the run is ending")
            # launched from the pool's worker, which outlives it; in self.server at once, so
            # that close() stops it even while it starts
            self.server = self._make().launch()
        # its start counts against the time it has to come back
        left = (deadline - time.monotonic(), "the time left of target.producers.recover_timeout_s")
        try:
            self.server.wait_ready(within=left)
        except EngineError as e:
            raise ProducerDown(f"starting it again failed: {e}") from None
        self.client = self.server.client()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.server.stop()


# HTTP statuses of a server that has no completions endpoint at all (not a vLLM server)
NOT_SERVED = (404, 405, 501)


class ServerAtURL:
    """A capture server already running (``target.producers.urls``); waited for when it stops."""

    def __init__(self, setting: str, url: str, timeout_s: float, layer_ids: list[int]) -> None:
        self.name, self.setting, self.layer_ids = url, setting, layer_ids
        self.client = VLLMClient(url, timeout_s)
        if not self.client.healthy():
            raise ConfigError(
                f"{setting}={url} does not answer /health; start the capture server there "
                "(python -m eagleforge.serve_target) or remove it from target.producers.urls."
            )
        served = self.client.served_model()
        self.model, self.root = str(served.get("id")), str(served.get("root") or served.get("id"))

    def check_weights(self, model_dir: Path, cache_dir: Path) -> None:
        """ConfigError unless the server loaded the weights of ``model_dir``: the path it serves
        must be one this machine reads, and, where it is not ``model_dir`` itself, hold the same
        weights (fingerprints cached in ``cache_dir``)."""
        root = Path(self.root)
        if not root.is_dir():
            raise ConfigError(
                f"{self.setting}={self.name} serves {self.root}, which this machine cannot read, "
                f"so its weights cannot be checked against model.path={model_dir}; serve the "
                "target from a path both machines read (a shared filesystem)."
            )
        if root.resolve() != model_dir.resolve():
            theirs, fingerprint = (weights_fingerprint(d, cache_dir) for d in (root, model_dir))
            if theirs != fingerprint:
                raise ConfigError(
                    f"{self.setting}={self.name} serves {root} ({theirs}), other weights than "
                    f"model.path={model_dir} ({fingerprint}); point it at the run's target or "
                    "remove it."
                )

    def capture(self, ids: list[int]) -> torch.Tensor:
        try:
            path = request_capture(self.client, ids, self.model, lambda: True)
        except EngineRequestError as e:
            if e.status not in NOT_SERVED:
                raise
            raise ConfigError(
                f"{self.setting}={self.name} answers /health but not completions (HTTP "
                f"{e.status}): it is not a capture server; start one there (python -m "
                "eagleforge.serve_target) or remove it from target.producers.urls."
            ) from None
        if not path:
            raise ConfigError(
                f"{self.setting}={self.name} returned no hidden_states_path: it is not a capture "
                "server (start it with python -m eagleforge.serve_target)."
            )
        return read_capture(path, ids, self.layer_ids, f"{self.setting}={self.name}")

    def recover(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.client.healthy():
                return
            time.sleep(2.0)
        raise ProducerDown("its /health did not answer again")

    def close(self) -> None:
        pass  # the server is not ours to stop


class VLLMTarget(HeadOnlyTarget):
    """The target served by vLLM engines for capture (see the module docstring)."""

    forward_in_engine = True

    def __init__(
        self,
        model_dir: Path,
        dtype: torch.dtype,
        device: torch.device,
        engine: VLLMConfig,
        log_path: Path,
        aux_layer_ids: list[int] | None = None,
        producers: ProducersConfig | None = None,
    ) -> None:
        if engine.url:
            raise ConfigError(
                f"vllm.url={engine.url}: target=vllm needs capture servers (eagleforge's "
                "connector), not a plain vLLM server; give running ones in "
                "target.producers.urls, or unset vllm.url and eagleforge starts them."
            )
        super().__init__(model_dir, dtype, device, aux_layer_ids)
        text = self.config.get_text_config()
        if text.model_type not in PLAIN_RMS_NORM:
            raise ConfigError(
                f"target.backend=vllm recomputes the final norm as Llama's RMSNorm, which "
                f"model_type {text.model_type} does not use; use target=hf for this model."
            )
        self.num_layers, self.eps = int(text.num_hidden_layers), float(text.rms_norm_eps)
        self.hidden_size = int(text.hidden_size)
        self.layer_ids = capture_layer_ids(self.aux_layer_ids, self.num_layers)
        self._aux_rows = [self.layer_ids.index(a + 1) for a in self.aux_layer_ids]
        self._last_row = self.layer_ids.index(self.num_layers)
        norm = self.final_norm_weight()
        if norm is None:
            raise ConfigError(f"{model_dir}: no '*.norm.weight' in its safetensors files.")
        self._norm_H = norm.to(dtype).cpu()  # transformers: weight * normed.to(dtype)
        cfg = producers or ProducersConfig()
        if cfg.urls:
            sources: list[Any] = self._servers_at(cfg, engine, model_dir)
        else:
            sources = self._start_engines(cfg.engines, engine, model_dir, dtype, log_path)
        self.pool = ProducerPool(
            sources, cfg.requests_per_producer, cfg.recover_timeout_s, convert=self._states
        )

    def _servers_at(
        self, cfg: ProducersConfig, engine: VLLMConfig, model_dir: Path
    ) -> list[ServerAtURL]:
        servers = [
            ServerAtURL(
                f"target.producers.urls[{i}]", url, engine.request_timeout_s, self.layer_ids
            )
            for i, url in enumerate(cfg.urls)
        ]
        for server in servers:
            server.check_weights(model_dir, resolve_cache_dir(None))
            server.capture([0, 1])  # its layers, and files this machine reads
        return servers

    def _start_engines(
        self, count: int, engine: VLLMConfig, model_dir: Path, dtype: torch.dtype, log_path: Path
    ) -> list[StartedEngine]:
        """``count`` engines, started at once (each logs beside ``log_path``: vllm.log,
        vllm-1.log, ...), each writing into a directory of its own; no more than this
        machine fits."""
        refuse_cpu_engines_past_machine(count, engine, model_dir, "target.producers.engines")
        self._files = [Path(tempfile.mkdtemp(prefix="eagleforge-capture-")) for _ in range(count)]

        def make(index: int) -> VLLMServer:
            settings = capture_config(self.layer_ids, str(self._files[index]))
            suffix = f"-{index}" if index else ""
            return VLLMServer(
                engine, model_dir, log_path.with_name(f"{log_path.stem}{suffix}{log_path.suffix}"),
                str(dtype).removeprefix("torch."), settings["speculative"],
                settings["kv_transfer"], name=f"vLLM (capture, engine {index})",
            )  # fmt: skip

        # launched here, one after another (this thread outlives them), and all start at once
        servers: list[VLLMServer] = []
        try:
            for index in range(count):
                servers.append(make(index).launch())
            for server in servers:
                server.wait_ready()
        except BaseException:
            for server in servers:
                server.stop()
            self._remove_files()
            raise
        return [
            StartedEngine(i, server, functools.partial(make, i), self.layer_ids)
            for i, server in enumerate(servers)
        ]

    def _remove_files(self) -> None:
        for files in getattr(self, "_files", []):
            shutil.rmtree(files, ignore_errors=True)

    def close(self) -> None:
        """Stop the engines and remove what they wrote."""
        self.pool.close()
        self._remove_files()

    def producer_records(self) -> list[dict[str, Any]]:
        """What each producer did so far (``ProducerRecord``)."""
        return self.pool.records()

    def packing_blocker(self) -> str | None:
        return None  # rows are captured sample by sample; packed ones are refused in forward

    def _states(self, hidden_TLH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """aux [T, 3H] and final [T, H] (through the final norm) of one prompt's capture."""
        aux_TA = hidden_TLH[:, self._aux_rows].flatten(1).to(self._dtype)
        return aux_TA, self._final_norm(hidden_TLH[:, self._last_row]).to(self._dtype)

    def submit(self, ids: list[int]) -> Future[tuple[torch.Tensor, torch.Tensor]]:
        """The future of one prompt's aux [T, 3H] and final [T, H] states (training's stream)."""
        return self.pool.submit(ids)

    def forward(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor,
        document_ids_BT: torch.Tensor | None = None,
        position_ids_BT: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
    ) -> TargetOutput:
        refuse_images("vllm", pixel_values, image_grid_thw)
        if document_ids_BT is not None:
            raise ConfigError(
                "target.backend=vllm captures one conversation per request, not packed rows; "
                "training packs the captured samples itself (data.packing=true)."
            )
        rows = [
            ids[mask.bool()].tolist()
            for ids, mask in zip(input_ids_BT.cpu(), attention_mask_BT.cpu(), strict=True)
        ]
        # every row in flight at once, over every producer: the engines prefill them together
        captured = [self.submit(row) for row in rows]
        batch, seq = input_ids_BT.shape
        aux_BTA = torch.zeros(batch, seq, len(self._aux_rows) * self.hidden_size, dtype=self._dtype)
        final_BTH = torch.zeros(batch, seq, self.hidden_size, dtype=self._dtype)
        for b, future in enumerate(captured):
            where = attention_mask_BT[b].cpu().bool()
            aux_BTA[b, where], final_BTH[b, where] = future.result()
        return TargetOutput(aux_BTA.to(self._device), final_BTH.to(self._device))

    def _final_norm(self, hidden_TH: torch.Tensor) -> torch.Tensor:
        """transformers' LlamaRMSNorm: in fp32, cast back before the weight."""
        x = hidden_TH.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self._norm_H * x.to(hidden_TH.dtype)
