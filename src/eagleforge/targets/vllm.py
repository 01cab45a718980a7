"""``target=vllm``: the vLLM engine as the target whose hidden states are captured.

vLLM serves the target with its ``extract_hidden_states`` speculative method and eagleforge's
capture connector (``engine/capture_connector.py``, CPU-safe): every prompt of a batch goes to
it as one request for a single token, all of a batch's requests in flight at once (the engine
prefills them together: ``prepare.batch_size`` is how many it sees), and the connector writes
the states of the prompt's tokens to a file, which ``forward`` reads back and deletes. vLLM collects a layer's *input*,
so eagleforge's output-of-layer aux ids a are vLLM's a + 1, and the last layer's output is id N
(before the final norm): the final state is that through the target's final RMSNorm, computed
here as transformers' Llama / Qwen / Mistral norm computes it.

The embedding, lm_head and final norm come from the target's safetensors (``HeadOnlyTarget``).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagleforge.engine.config import VLLMConfig
from eagleforge.engine.server import EngineError, VLLMServer
from eagleforge.errors import ConfigError
from eagleforge.targets.base import TargetOutput, refuse_images
from eagleforge.targets.head import HeadOnlyTarget

CONNECTOR = "EagleforgeCaptureConnector"
CONNECTOR_MODULE = "eagleforge.engine.capture_connector"
# final norms computed as w * x / rms(x); families whose norm differs (Gemma's 1 + w) are refused
PLAIN_RMS_NORM = {"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "phi3"}


def capture_layer_ids(aux_layer_ids: list[int], num_layers: int) -> list[int]:
    """vLLM's ids of the states to capture: the aux layers' outputs (input of the next layer,
    a + 1) and the last layer's output (N), sorted and once each, as vLLM stores them."""
    return sorted({a + 1 for a in aux_layer_ids} | {num_layers})


class VLLMTarget(HeadOnlyTarget):
    """The target served by vLLM for capture (see the module docstring)."""

    forward_in_engine = True

    def __init__(
        self,
        model_dir: Path,
        dtype: torch.dtype,
        device: torch.device,
        engine: VLLMConfig,
        log_path: Path,
        aux_layer_ids: list[int] | None = None,
    ) -> None:
        super().__init__(model_dir, dtype, device, aux_layer_ids)
        text = self.config.get_text_config()
        if text.model_type not in PLAIN_RMS_NORM:
            raise ConfigError(
                f"target.backend=vllm recomputes the final norm as Llama's RMSNorm, which "
                f"model_type {text.model_type} does not use; use target=hf for this model."
            )
        self.num_layers, self.eps = int(text.num_hidden_layers), float(text.rms_norm_eps)
        self.layer_ids = capture_layer_ids(self.aux_layer_ids, self.num_layers)
        norm = self.final_norm_weight()
        if norm is None:
            raise ConfigError(f"{model_dir}: no '*.norm.weight' in its safetensors files.")
        self._norm_H = norm.to(dtype).cpu()  # transformers: weight * normed.to(dtype)
        self._files = Path(tempfile.mkdtemp(prefix="eagleforge-capture-"))
        self.server = VLLMServer(
            engine, model_dir, log_path, str(dtype).removeprefix("torch."),
            speculative={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {
                    "hf_config": {"eagle_aux_hidden_state_layer_ids": self.layer_ids}
                },
            },
            kv_transfer={
                "kv_connector": CONNECTOR,
                "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(self._files)},
            },
            name="vLLM (capture)",
        ).start()  # fmt: skip
        self.client = self.server.client()

    def close(self) -> None:
        """Stop the engine and remove what it wrote."""
        self.server.stop()
        for leftover in self._files.glob("*"):
            leftover.unlink()
        self._files.rmdir()

    def packing_blocker(self) -> str | None:
        return "target.backend=vllm sends each row to vLLM as one sequence"

    def _capture(self, ids: list[int]) -> torch.Tensor:
        """[T, len(layer_ids), H] of one prompt, read back from the connector's file."""
        done = self.client.complete(ids, max_tokens=1, extra={"kv_transfer_params": {}})
        path = (done.kv_transfer_params or {}).get("hidden_states_path")
        if not path:
            raise EngineError(
                f"the capture engine returned no hidden_states_path for a {len(ids)}-token "
                f"prompt; its log: {self.server.log_path}"
            )
        with open(path + ".lock") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)  # the connector holds LOCK_EX while it writes
            states = load_file(path)
        for name in (path, path + ".lock"):
            os.unlink(name)
        hidden_TLH = states["hidden_states"]
        if states["token_ids"].tolist() != ids:
            raise EngineError(f"the capture file {path} holds other tokens than the prompt's")
        return hidden_TLH

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
        rows = [
            ids[mask.bool()].tolist()
            for ids, mask in zip(input_ids_BT.cpu(), attention_mask_BT.cpu(), strict=True)
        ]
        # a thread per row: every row is in flight at once, and the engine prefills them together
        with ThreadPoolExecutor(len(rows)) as pool:
            captured = list(pool.map(self._capture, rows))
        batch, seq = input_ids_BT.shape
        hidden = self.config.get_text_config().hidden_size
        aux_rows = [self.layer_ids.index(a + 1) for a in self.aux_layer_ids]
        aux_BTA = torch.zeros(batch, seq, len(aux_rows) * hidden, dtype=self._dtype)
        final_BTH = torch.zeros(batch, seq, hidden, dtype=self._dtype)
        last = self.layer_ids.index(self.num_layers)
        for b, states_TLH in enumerate(captured):
            where = attention_mask_BT[b].cpu().bool()
            aux_BTA[b, where] = states_TLH[:, aux_rows].flatten(1).to(self._dtype)
            final_BTH[b, where] = self._final_norm(states_TLH[:, last]).to(self._dtype)
        device = self._device
        return TargetOutput(aux_BTA.to(device), final_BTH.to(device))

    def _final_norm(self, hidden_TH: torch.Tensor) -> torch.Tensor:
        """transformers' LlamaRMSNorm: in fp32, cast back before the weight."""
        x = hidden_TH.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self._norm_H * x.to(hidden_TH.dtype)
