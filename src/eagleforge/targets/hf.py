"""transformers target backend: one forward gives the aux hidden states and the final hidden state.

The aux states are captured with forward hooks on the chosen decoder layers, and the forward
stops before the lm_head (the teacher is computed in chunks from the final hidden state).

With a tp mesh (``parallel.tp`` > 1) the model is sharded over the tp ranks and every forward
runs on the tp group's micro-batches together; each rank gets back its own rows
(``eagleforge.parallel.tp``).

A vision-language target (a config with a ``vision_config``, e.g. Qwen2.5-VL) loads as an
image-text-to-text model: its vision tower encodes the batch's images into the image-token
positions, the aux states come from its language model's decoder layers, and the 3-D M-RoPE
positions it computes (``get_rope_index``) are returned for the draft. No tp for those.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from eagleforge.errors import ConfigError
from eagleforge.parallel.tp import check_tp_fits, full_weight, load_tensor_parallel
from eagleforge.targets.base import TargetOutput, forward_over_group
from eagleforge.targets.config import TargetConfig
from eagleforge.targets.masks import MASKABLE_KINDS, attention_masks, layer_attention
from eagleforge.targets.source import checked_aux_layer_ids

# Vision-language targets whose M-RoPE (contiguous time/height/width sections) the draft
# implements.
MROPE_MODEL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl"})


def kv_cache_argument(model: Any) -> str:
    """The forward keyword that takes a KV cache: transformers renamed ``past_key_values`` to
    ``cache`` during 5.x."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _decoder(model: Any) -> Any:
    """The model's decoder stack (embeddings, layers, final norm): ``get_decoder()``, or
    ``.model`` where ``get_decoder()`` returns the whole model (Llama 4 in transformers 5.24)."""
    candidates = (getattr(model, "get_decoder", lambda: None)(), getattr(model, "model", None))
    for base in candidates:
        if base is not None and base is not model and hasattr(base, "layers"):
            return base
    raise ConfigError(
        f"cannot find decoder layers in {type(model).__name__}; use a decoder-only LLM."
    )


class HFTarget:
    """A frozen ``AutoModelForCausalLM`` with aux-layer capture; with ``tp_mesh`` (more than
    one rank) the forward runs on the tp group's micro-batches together (a collective)."""

    forward_in_engine = False

    def __init__(
        self,
        model: Any,  # a transformers PreTrainedModel with a decoder
        aux_layer_ids: list[int] | None = None,
        tp_mesh: DeviceMesh | None = None,
    ) -> None:
        self.model = model.eval().requires_grad_(False)
        self.tp_mesh = tp_mesh if tp_mesh is not None and tp_mesh.size() > 1 else None
        self.config = model.config
        # Qwen2-VL family: the inner model merges image features and computes M-RoPE positions.
        inner = getattr(model, "model", None)
        self.is_vlm = hasattr(inner, "get_rope_index") and hasattr(model.config, "vision_config")
        if self.is_vlm and model.config.model_type not in MROPE_MODEL_TYPES:
            # other M-RoPE layouts (Qwen3-VL's interleaved sections, GLM-4V's) would train a
            # draft that rotates unlike its target
            raise ConfigError(
                f"model.path: the vision-language target type '{model.config.model_type}' is "
                f"not supported (its M-RoPE layout); supported: {sorted(MROPE_MODEL_TYPES)}."
            )
        if self.is_vlm and self.tp_mesh is not None:
            raise ConfigError(
                "parallel.tp > 1 does not shard a vision-language target; set parallel.tp=1."
            )
        self.decoder = _decoder(model)
        self.layers = self.decoder.layers
        self.aux_layer_ids = checked_aux_layer_ids(aux_layer_ids, len(self.layers))
        # the attention kinds of the layers, for the masks of packed rows (a property of the config)
        self._layer_attention = set(layer_attention(self.config.get_text_config()))
        self._captured: dict[int, torch.Tensor] = {}
        for layer_id in self.aux_layer_ids:
            self.layers[layer_id].register_forward_hook(self._capture_hook(layer_id))
        # The teacher and the draft need whole matrices: gathered once here, on every tp rank.
        self._gathered: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.tp_mesh is not None:
            embedding = model.get_input_embeddings().weight
            head = model.get_output_embeddings().weight
            full = full_weight(embedding)
            self._gathered = (full, full if head is embedding else full_weight(head))

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
        tp_mesh: DeviceMesh | None = None,
    ) -> HFTarget:
        """Load with transformers; with ``tp_mesh`` (more than one rank) sharded over it."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        kwargs: dict[str, Any] = {
            "dtype": dtype,
            "attn_implementation": cfg.attn_implementation,
            "trust_remote_code": trust_remote_code,
            "revision": revision,
        }
        config = AutoConfig.from_pretrained(
            model_dir, trust_remote_code=trust_remote_code, revision=revision
        )
        if tp_mesh is None or tp_mesh.size() == 1:
            # a vision-language checkpoint (vision tower included) that no causal-LM class
            # loads, e.g. Qwen2.5-VL; Gemma 3 and Llama 4 keep loading as before
            auto = (
                AutoModelForImageTextToText
                if hasattr(config, "vision_config")
                and config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
                else AutoModelForCausalLM
            )
            model: Any = auto.from_pretrained(model_dir, **kwargs)
            return cls(model.to(device), aux_layer_ids)
        check_tp_fits(config, tp_mesh.size())
        model = load_tensor_parallel(model_dir, tp_mesh, device, **kwargs)
        return cls(model, aux_layer_ids, tp_mesh)

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
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Aux and final hidden states; packed rows (``document_ids_BT``) get a block-diagonal
        causal mask and per-document positions, so documents never see each other.

        A vision-language target also takes the batch's images (``pixel_values``, the
        processor's patches of all images in order, and ``image_grid_thw`` [images, 3]).

        With a tp mesh every tp rank must call this (with its own micro-batch) in step."""
        if self.is_vlm:
            if document_ids_BT is not None:
                raise ConfigError(
                    f"data.packing: {self.packing_blocker()}; set data.packing=false."
                )
            return self._forward_vlm(input_ids_BT, attention_mask_BT, pixel_values, image_grid_thw)
        if pixel_values is not None:
            raise ConfigError(
                f"the batch carries images but the target {type(self.model).__name__} has no "
                "vision tower; use a vision-language model (e.g. +model=qwen2_5_vl)."
            )
        batch = (input_ids_BT, attention_mask_BT, document_ids_BT, position_ids_BT)
        return forward_over_group(self.tp_mesh, self._forward, *batch)

    def _forward(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor,
        document_ids_BT: torch.Tensor | None,
        position_ids_BT: torch.Tensor | None,
    ) -> TargetOutput:
        self._captured.clear()
        mask: torch.Tensor | dict[str, torch.Tensor] = attention_mask_BT
        if document_ids_BT is not None:
            mask = self._packed_mask(attention_mask_BT, document_ids_BT, position_ids_BT)
        out = self.decoder(
            input_ids=input_ids_BT,
            attention_mask=mask,
            position_ids=position_ids_BT,
            use_cache=False,
        )
        return TargetOutput(aux_BTA=self.take_aux(), final_hidden_BTH=out.last_hidden_state)

    def packing_blocker(self) -> str | None:
        """Why this target cannot run packed rows (several documents per row), or None."""
        if self.is_vlm:
            return (
                "a vision-language target needs each conversation's own M-RoPE positions, "
                "which packed rows do not carry"
            )
        kinds = sorted({layer.kind for layer in self._layer_attention} - set(MASKABLE_KINDS))
        if kinds:
            model_type = self.config.get_text_config().model_type
            return f"the {kinds} layers of '{model_type}' cannot be masked per document"
        return None

    def _packed_mask(
        self,
        attention_mask_BT: torch.Tensor,
        document_ids_BT: torch.Tensor,
        position_ids_BT: torch.Tensor | None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The mask of packed rows: causal within each document (the TTT's step-0 mask), and
        within the window or chunk of sliding / chunked layers. transformers uses a 4-D mask
        as given, so these are applied here: one mask, or one per layer type for models that
        mix kinds of layers."""
        blocker = self.packing_blocker()
        if blocker is not None:
            raise ConfigError(f"data.packing: {blocker}; set data.packing=false.")
        if position_ids_BT is None:
            position_ids_BT = torch.arange(
                attention_mask_BT.shape[1], device=attention_mask_BT.device
            ).expand_as(attention_mask_BT)
        layers = self._layer_attention
        masks = attention_masks(attention_mask_BT, document_ids_BT, position_ids_BT, layers)
        # packed rows always need a mask: never None here
        if len(layers) == 1:
            return next(iter(masks.values()))  # type: ignore[return-value]
        return {layer.kind: masks[layer] for layer in layers}  # type: ignore[misc]

    def _forward_vlm(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor,
        pixel_values: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
    ) -> TargetOutput:
        self._captured.clear()
        positions_3BT, _ = self.rope_index(input_ids_BT, attention_mask_BT, image_grid_thw)
        out = self.model.model(
            input_ids=input_ids_BT,
            attention_mask=attention_mask_BT,
            position_ids=positions_3BT,
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
            use_cache=False,
        )
        return TargetOutput(
            aux_BTA=self.take_aux(),
            final_hidden_BTH=out.last_hidden_state,
            position_ids_3BT=positions_3BT,
        )

    def rope_index(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A vision-language target's M-RoPE positions [3, B, T] of the given tokens and, per
        row, the offset [B, 1] of text that follows them (their max position + 1 - length)."""
        # text 0, image 1: what get_rope_index groups positions by
        modality_BT = (input_ids_BT == self.config.image_token_id).int()
        positions_3BT, deltas_B1 = self.model.model.get_rope_index(
            input_ids_BT,
            modality_BT,
            image_grid_thw=image_grid_thw,
            attention_mask=attention_mask_BT,
        )
        return positions_3BT, deltas_B1

    def take_aux(self) -> torch.Tensor:
        """The aux states [B, T, 3H] the hooks captured in the last forward of the model (also
        when it was called directly, e.g. with a KV cache), concatenated; clears them."""
        aux = torch.cat([self._captured[i] for i in self.aux_layer_ids], dim=-1)
        self._captured.clear()
        return aux

    def input_embedding(self) -> torch.Tensor:
        if self._gathered is not None:
            return self._gathered[0]
        return self.model.get_input_embeddings().weight

    def lm_head_weight(self) -> torch.Tensor:
        if self._gathered is not None:
            return self._gathered[1]
        return self.model.get_output_embeddings().weight

    def final_norm_weight(self) -> torch.Tensor | None:
        norm = getattr(self.decoder, "norm", None)
        return None if norm is None else full_weight(norm.weight)
