"""eagleforge's own target model (``target=custom``): Llama, Mistral, Qwen2 and Qwen3 decoders,
tensor-parallel over the "tp" axis of the run's mesh.

Unlike the transformers backend it needs nothing from transformers but the config and the
RoPE tables: the decoder is a plain module tree built on the meta device, split by
``parallel.tp.parallelize_decoder`` (q/k/v and gate/up by output rows, o_proj and down_proj by
input columns, Megatron style), and filled from the checkpoint's safetensors one file at a
time, each rank reading only its own slice of every tensor (``safe_open(...).get_slice``), so
no rank ever holds more than its shard. Embedding, norms and lm_head stay whole on every rank:
the teacher and the draft need them whole anyway.

Attention is SDPA with an explicit boolean mask (padding, packed documents, sliding windows),
or its causal kernel when a batch needs no mask.

Shape suffixes: B batch, T sequence, H hidden, N heads, K key/value heads, D head dim
(N and K are this rank's under TP).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from eagleforge.errors import ConfigError
from eagleforge.layers import RMSNorm, rotate_half
from eagleforge.targets.base import TargetOutput, forward_over_group, refuse_images
from eagleforge.targets.masks import LayerAttention, attention_masks, layer_attention
from eagleforge.targets.source import checked_aux_layer_ids


@dataclass(frozen=True)
class Family:
    """What sets a supported decoder family apart from plain Llama."""

    qkv_bias: bool  # q/k/v projections always have a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm of queries and keys before RoPE (Qwen3)


FAMILIES = {
    "llama": Family(qkv_bias=False, qk_norm=False),
    "mistral": Family(qkv_bias=False, qk_norm=False),
    "qwen2": Family(qkv_bias=True, qk_norm=False),
    "qwen3": Family(qkv_bias=False, qk_norm=True),
}


def family_of(text: Any) -> Family:
    family = FAMILIES.get(text.model_type)
    if family is None:
        raise ConfigError(
            f"target=custom implements model types {sorted(FAMILIES)}, not "
            f"'{text.model_type}'; use target=hf for this model."
        )
    other = {a.kind for a in layer_attention(text)} - {"full_attention", "sliding_attention"}
    if other:
        raise ConfigError(
            f"target=custom implements full and sliding-window attention, not the "
            f"{sorted(other)} layers of this '{text.model_type}'; use target=hf."
        )
    if getattr(text, "hidden_act", "silu") != "silu":
        raise ConfigError(
            f"target=custom implements SiLU-gated MLPs, not hidden_act='{text.hidden_act}'; "
            "use target=hf for this model."
        )
    return family


class Attention(nn.Module):
    def __init__(self, text: Any, family: Family) -> None:
        super().__init__()
        hidden, heads = text.hidden_size, text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        self.head_dim = getattr(text, "head_dim", None) or hidden // heads
        bias = family.qkv_bias or bool(getattr(text, "attention_bias", False))
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        o_bias = bool(getattr(text, "attention_bias", False)) and not family.qkv_bias
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, text.rms_norm_eps) if family.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, text.rms_norm_eps) if family.qk_norm else None

    def _heads(self, x_BTX: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        # -1: under TP the projections hold this rank's heads only
        x_BTND = x_BTX.unflatten(-1, (-1, self.head_dim))
        return (x_BTND if norm is None else norm(x_BTND)).transpose(1, 2)

    def forward(
        self,
        x_BTH: torch.Tensor,
        cos_BTD: torch.Tensor,
        sin_BTD: torch.Tensor,
        mask_B1TT: torch.Tensor | None,
    ) -> torch.Tensor:
        q_BNTD = self._heads(self.q_proj(x_BTH), self.q_norm)
        k_BKTD = self._heads(self.k_proj(x_BTH), self.k_norm)
        v_BKTD = self._heads(self.v_proj(x_BTH), None)
        cos, sin = cos_BTD.unsqueeze(1), sin_BTD.unsqueeze(1)
        q_BNTD = q_BNTD * cos + rotate_half(q_BNTD) * sin
        k_BKTD = k_BKTD * cos + rotate_half(k_BKTD) * sin
        if mask_B1TT is None:  # causal kernels (flash on CUDA) take grouped heads as they are
            out_BNTD = F.scaled_dot_product_attention(
                q_BNTD, k_BKTD, v_BKTD, is_causal=True, enable_gqa=True
            )
        else:
            # with a mask SDPA's GQA path falls back to the math kernel on CUDA; repeated
            # key/value heads keep the memory-efficient kernel (and are no slower on CPU)
            groups = q_BNTD.shape[1] // k_BKTD.shape[1]
            out_BNTD = F.scaled_dot_product_attention(
                q_BNTD,
                k_BKTD.repeat_interleave(groups, dim=1),
                v_BKTD.repeat_interleave(groups, dim=1),
                attn_mask=mask_B1TT,
            )
        return self.o_proj(out_BNTD.transpose(1, 2).flatten(2))  # type: ignore[no-any-return]


class MLP(nn.Module):
    def __init__(self, text: Any) -> None:
        super().__init__()
        hidden, width = text.hidden_size, text.intermediate_size
        bias = bool(getattr(text, "mlp_bias", False))
        self.gate_proj = nn.Linear(hidden, width, bias=bias)
        self.up_proj = nn.Linear(hidden, width, bias=bias)
        self.down_proj = nn.Linear(width, hidden, bias=bias)

    def forward(self, x_BTH: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x_BTH)) * self.up_proj(x_BTH))  # type: ignore[no-any-return]


class DecoderLayer(nn.Module):
    def __init__(self, text: Any, family: Family, attention: LayerAttention) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(text.hidden_size, text.rms_norm_eps)
        self.self_attn = Attention(text, family)
        self.post_attention_layernorm = RMSNorm(text.hidden_size, text.rms_norm_eps)
        self.mlp = MLP(text)
        self.attention = attention

    def forward(
        self,
        h_BTH: torch.Tensor,
        cos_BTD: torch.Tensor,
        sin_BTD: torch.Tensor,
        masks: dict[LayerAttention, torch.Tensor | None],
    ) -> torch.Tensor:
        mask = masks[self.attention]
        h_BTH = h_BTH + self.self_attn(self.input_layernorm(h_BTH), cos_BTD, sin_BTD, mask)
        return h_BTH + self.mlp(self.post_attention_layernorm(h_BTH))  # type: ignore[no-any-return]


class Decoder(nn.Module):
    """The decoder stack; parameter names are the checkpoints' without the "model." prefix."""

    def __init__(self, text: Any) -> None:
        super().__init__()
        family = family_of(text)
        self.attention = layer_attention(text)
        self.embed_tokens = nn.Embedding(text.vocab_size, text.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(text, family, a) for a in self.attention)
        self.norm = RMSNorm(text.hidden_size, text.rms_norm_eps)

    def forward(
        self,
        input_ids_BT: torch.Tensor,
        cos_BTD: torch.Tensor,
        sin_BTD: torch.Tensor,
        masks: dict[LayerAttention, torch.Tensor | None],
        capture: list[int],
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The outputs of the layers in ``capture`` and the final normed hidden state."""
        h_BTH = self.embed_tokens(input_ids_BT)
        captured = {}
        for index, layer in enumerate(self.layers):
            h_BTH = layer(h_BTH, cos_BTD, sin_BTD, masks)
            if index in capture:
                captured[index] = h_BTH
        return [captured[i] for i in capture], self.norm(h_BTH)


class Rotary:
    """cos/sin tables [B, T, D] from the target config's RoPE settings (any rope_type
    transformers knows), with its attention scaling folded in as transformers does."""

    def __init__(self, text: Any, device: torch.device) -> None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        rope = dict(getattr(text, "rope_parameters", None) or {})
        rope_type = str(rope.get("rope_type", rope.get("type", "default")))
        if rope_type == "default":
            theta = float(rope.get("rope_theta", getattr(text, "rope_theta", 10000.0)))
            head_dim = getattr(text, "head_dim", None) or (
                text.hidden_size // text.num_attention_heads
            )
            exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
            self.inv_freq, self.scaling = 1.0 / (theta**exponents), 1.0
        else:
            self.inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[rope_type](text, None)
        self.inv_freq = self.inv_freq.float().to(device)

    def __call__(
        self, position_ids_BT: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs_BTF = position_ids_BT.float().unsqueeze(-1) * self.inv_freq
        angles_BTD = torch.cat((freqs_BTF, freqs_BTF), dim=-1)
        return (
            (angles_BTD.cos() * self.scaling).to(dtype),
            (angles_BTD.sin() * self.scaling).to(dtype),
        )


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"{model_dir}: no *.safetensors files; target=custom reads safetensors checkpoints "
            "only (use target=hf for .bin checkpoints)."
        )
    return files


def _local_slice(param: torch.Tensor) -> tuple[int, slice] | None:
    """(dim, rows) of the whole tensor that this rank's DTensor shard holds; None if whole."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return None
    (placement,) = param.placements
    if not isinstance(placement, Shard):
        return None
    size = param.shape[placement.dim] // param.device_mesh.size()
    start = param.device_mesh.get_local_rank() * size
    return placement.dim, slice(start, start + size)


@torch.no_grad()
def load_checkpoint(module: nn.Module, model_dir: Path, prefix: str = "model.") -> None:
    """Fill ``module``'s parameters from the safetensors files, one file at a time, reading
    only this rank's slice of each sharded tensor; a tensor the module lacks is skipped, a
    parameter the checkpoint lacks is an error."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    params = {prefix + name: p for name, p in module.named_parameters()}
    missing = set(params)
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                param = params.get(name)
                if param is None:
                    continue
                local = param.to_local() if isinstance(param, DTensor) else param
                where = _local_slice(param)
                if where is None:
                    tensor = f.get_tensor(name)
                else:
                    dim, rows = where
                    tensor = f.get_slice(name)[rows] if dim == 0 else f.get_slice(name)[:, rows]
                if tensor.shape != local.shape:
                    raise ConfigError(
                        f"{path}: tensor {name} has shape {tuple(tensor.shape)} where this "
                        f"rank expects {tuple(local.shape)}; is config.json from the same model?"
                    )
                local.copy_(tensor)
                missing.discard(name)
    if missing:
        raise ConfigError(
            f"{model_dir}: the checkpoint lacks {len(missing)} tensors target=custom needs, "
            f"e.g. {sorted(missing)[:3]}; is it a complete {sorted(FAMILIES)} checkpoint?"
        )


class CustomTarget:
    """Our own decoder as a frozen target: aux-layer capture without hooks, and tensor
    parallelism over ``tp_mesh`` (the forward is then a collective of the tp group)."""

    forward_in_engine = False

    def __init__(
        self,
        config: Any,  # transformers config of the target
        decoder: Decoder,
        lm_head_VH: torch.Tensor,
        device: torch.device,
        aux_layer_ids: list[int] | None = None,
        tp_mesh: DeviceMesh | None = None,
    ) -> None:
        self.config = config
        text = config.get_text_config()
        self.decoder = decoder.eval().requires_grad_(False)
        self.tp_mesh = tp_mesh if tp_mesh is not None and tp_mesh.size() > 1 else None
        self.aux_layer_ids = checked_aux_layer_ids(aux_layer_ids, len(decoder.layers))
        self._lm_head_VH = lm_head_VH
        self._rotary = Rotary(text, device)
        self._attention = set(decoder.attention)

    @classmethod
    def from_pretrained(
        cls,
        model_dir: Path,
        dtype: torch.dtype,
        device: torch.device,
        aux_layer_ids: list[int] | None = None,
        tp_mesh: DeviceMesh | None = None,
    ) -> CustomTarget:
        """Build on the meta device, split over ``tp_mesh``, then read this rank's weights."""
        from transformers import AutoConfig

        from eagleforge.parallel.tp import check_heads_fit, parallelize_decoder

        config = AutoConfig.from_pretrained(model_dir)
        text = config.get_text_config()
        with torch.device("meta"):
            decoder = Decoder(text).to(dtype)
        if tp_mesh is not None and tp_mesh.size() > 1:
            check_heads_fit(text, tp_mesh.size())
            parallelize_decoder(decoder, tp_mesh)
        decoder.to_empty(device=device)
        load_checkpoint(decoder, model_dir)
        embedding = decoder.embed_tokens.weight
        if getattr(text, "tie_word_embeddings", False):
            lm_head = embedding
        else:
            head = nn.Linear(text.hidden_size, text.vocab_size, bias=False, device="meta")
            head.to_empty(device=device).to(dtype)
            load_checkpoint(head, model_dir, prefix="lm_head.")
            lm_head = head.weight
        return cls(config, decoder, lm_head, device, aux_layer_ids, tp_mesh)

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
        """Aux and final hidden states (see ``TargetBackend``); with a tp mesh every tp rank
        must call this, with its own micro-batch, in step."""
        refuse_images("custom", pixel_values, image_grid_thw)
        batch = (input_ids_BT, attention_mask_BT, document_ids_BT, position_ids_BT)
        return forward_over_group(self.tp_mesh, self._forward, *batch)

    def _forward(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor,
        document_ids_BT: torch.Tensor | None,
        position_ids_BT: torch.Tensor | None,
    ) -> TargetOutput:
        if position_ids_BT is None:
            seq = input_ids_BT.shape[1]
            position_ids_BT = torch.arange(seq, device=input_ids_BT.device).expand_as(input_ids_BT)
        masks = attention_masks(
            attention_mask_BT, document_ids_BT, position_ids_BT, self._attention
        )
        cos_BTD, sin_BTD = self._rotary(position_ids_BT, self._lm_head_VH.dtype)
        aux, final_BTH = self.decoder(input_ids_BT, cos_BTD, sin_BTD, masks, self.aux_layer_ids)
        return TargetOutput(aux_BTA=torch.cat(aux, dim=-1), final_hidden_BTH=final_BTH)

    def packing_blocker(self) -> str | None:
        return None  # its masks cover every layer kind it implements

    def input_embedding(self) -> torch.Tensor:
        return self.decoder.embed_tokens.weight

    def lm_head_weight(self) -> torch.Tensor:
        return self._lm_head_VH

    def final_norm_weight(self) -> torch.Tensor | None:
        return self.decoder.norm.weight  # whole on every rank


def local_model_dir(model_dir: str | Path, revision: str | None) -> Path:
    """``model_dir`` itself, or a hub id's config and safetensors fetched into the HF cache."""
    if Path(model_dir).is_dir():
        return Path(model_dir)
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                str(model_dir), revision=revision, allow_patterns=["*.json", "*.safetensors"]
            )
        )
    except Exception as e:  # offline, gated, or no such repository
        raise ConfigError(
            f"model.path={model_dir}: not a local directory and not fetchable from the hub "
            f"({type(e).__name__}); download it and set model.path to the directory."
        ) from e
