"""transformers target backend: one forward gives the aux hidden states and the final hidden state.

The aux states are captured with forward hooks on the chosen decoder layers, and the forward
stops before the lm_head (the teacher is computed in chunks from the final hidden state).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eagleforge.draft.attention import ttt_attention_mask
from eagleforge.errors import ConfigError
from eagleforge.target import TargetConfig, TargetOutput
from eagleforge.target.source import ModelConfig, default_aux_layer_ids


def _decoder_layers(model: Any) -> torch.nn.ModuleList:
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ConfigError(
            f"cannot find decoder layers in {type(model).__name__}; use a decoder-only LLM."
        )
    return layers


class HFTarget:
    """A frozen ``AutoModelForCausalLM`` with aux-layer capture."""

    def __init__(
        self,
        model: Any,  # a transformers PreTrainedModel with a decoder
        aux_layer_ids: list[int] | None = None,
    ) -> None:
        self.model = model.eval().requires_grad_(False)
        self.config = model.config
        self.layers = _decoder_layers(model)
        num_layers = len(self.layers)
        self.aux_layer_ids = list(aux_layer_ids or default_aux_layer_ids(num_layers))
        bad = [i for i in self.aux_layer_ids if not 0 <= i < num_layers]
        if bad:
            raise ConfigError(
                f"model.aux_layer_ids {self.aux_layer_ids} has ids outside 0..{num_layers - 1} "
                f"(the target has {num_layers} layers)."
            )
        self._captured: dict[int, torch.Tensor] = {}
        for layer_id in self.aux_layer_ids:
            self.layers[layer_id].register_forward_hook(self._capture_hook(layer_id))

    @classmethod
    def from_config(
        cls,
        model_cfg: ModelConfig,
        target_cfg: TargetConfig,
        model_dir: str | Path,
        device: torch.device,
        aux_layer_ids: list[int] | None = None,
    ) -> HFTarget:
        """The target as the run's `model` and `target` sections describe it; ``aux_layer_ids``
        overrides model.aux_layer_ids (e.g. with the layers a trained draft reads)."""
        return cls.from_pretrained(
            model_dir,
            target_cfg,
            model_cfg.dtype.torch_dtype(device),
            device,
            aux_layer_ids=aux_layer_ids or model_cfg.aux_layer_ids,
            trust_remote_code=model_cfg.trust_remote_code,
            revision=model_cfg.revision,
        )

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        cfg: TargetConfig,
        dtype: torch.dtype,
        device: torch.device,
        aux_layer_ids: list[int] | None = None,
        trust_remote_code: bool = False,
        revision: str | None = None,
    ) -> HFTarget:
        from transformers import AutoModelForCausalLM

        model: Any = AutoModelForCausalLM.from_pretrained(
            model_dir,
            dtype=dtype,
            attn_implementation=cfg.attn_implementation,
            trust_remote_code=trust_remote_code,
            revision=revision,
        )
        return cls(model.to(device), aux_layer_ids)

    def _capture_hook(self, layer_id: int):  # type: ignore[no-untyped-def]
        def hook(_module, _inputs, output):  # type: ignore[no-untyped-def]
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    @torch.no_grad()
    def forward(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor,
        document_ids_BT: torch.Tensor | None = None,
        position_ids_BT: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Aux and final hidden states; packed rows (``document_ids_BT``) get a block-diagonal
        causal mask and per-document positions, so documents never see each other."""
        self._captured.clear()
        base = self.model.get_decoder()
        mask: torch.Tensor = attention_mask_BT
        if document_ids_BT is not None:
            # the TTT's step-0 mask: causal, within each document
            mask = ttt_attention_mask(attention_mask_BT, 1, document_ids_BT).unsqueeze(1)
        out = base(
            input_ids=input_ids_BT,
            attention_mask=mask,
            position_ids=position_ids_BT,
            use_cache=False,
        )
        return TargetOutput(aux_BTA=self.take_aux(), final_hidden_BTH=out.last_hidden_state)

    def take_aux(self) -> torch.Tensor:
        """The aux states [B, T, 3H] the hooks captured in the last forward of the model (also
        when it was called directly, e.g. with a KV cache), concatenated; clears them."""
        aux = torch.cat([self._captured[i] for i in self.aux_layer_ids], dim=-1)
        self._captured.clear()
        return aux

    def input_embedding(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight
