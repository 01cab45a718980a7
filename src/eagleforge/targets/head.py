"""The target without its layers: what offline training needs from it.

The teacher is the stored final hidden state through the target's lm_head, and the draft
copies the target's input embedding; both are read from the target's safetensors files
alone (an untied model's lm_head, or the embedding when they are tied), so offline training
never loads the full model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagleforge.errors import ConfigError
from eagleforge.targets.base import TargetOutput
from eagleforge.targets.source import checked_aux_layer_ids


def _find_tensor(model_dir: Path, suffix: str) -> torch.Tensor | None:
    """The first tensor whose name ends with ``suffix`` in the model's safetensors files."""
    index = model_dir / "model.safetensors.index.json"
    files = (
        sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
        if index.is_file()
        else sorted(model_dir.glob("*.safetensors"))
    )
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if name.endswith(suffix):
                    return f.get_tensor(name)
    return None


class HeadOnlyTarget:
    """Config, aux layer ids, input embedding and lm_head of a target, without its layers."""

    forward_in_engine = False

    def __init__(
        self,
        model_dir: Path,
        dtype: torch.dtype,
        device: torch.device,
        aux_layer_ids: list[int] | None = None,
    ) -> None:
        from transformers import AutoConfig

        self.config: Any = AutoConfig.from_pretrained(model_dir)
        text = self.config.get_text_config()
        self.aux_layer_ids = checked_aux_layer_ids(aux_layer_ids, text.num_hidden_layers)
        embedding = _find_tensor(model_dir, "embed_tokens.weight")
        if embedding is None:
            raise ConfigError(
                f"{model_dir}: no '*embed_tokens.weight' tensor in its safetensors files; "
                "offline training needs the target's weights as safetensors."
            )
        head = (
            None
            if getattr(text, "tie_word_embeddings", False)
            else _find_tensor(model_dir, "lm_head.weight")
        )
        self._model_dir, self._device, self._dtype = model_dir, device, dtype
        self._embedding = embedding.to(device=device, dtype=dtype)
        self._lm_head = self._embedding if head is None else head.to(device=device, dtype=dtype)

    def forward(self, *_: Any, **__: Any) -> TargetOutput:
        raise RuntimeError(
            "offline training reads the target's hidden states from the feature store; "
            "this batch has none (is data.features set for every loader?)"
        )

    def packing_blocker(self) -> str | None:
        return None  # stored features: the draft alone sees the packed rows

    def input_embedding(self) -> torch.Tensor:
        return self._embedding

    def lm_head_weight(self) -> torch.Tensor:
        return self._lm_head

    def final_norm_weight(self) -> torch.Tensor | None:
        # the decoder's final norm (`model.norm.weight`): layers' norms end in `layernorm.weight`
        norm = _find_tensor(self._model_dir, ".norm.weight")
        return None if norm is None else norm.to(device=self._device, dtype=self._dtype)
