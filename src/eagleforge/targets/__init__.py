"""Target backends: the frozen LLM whose hidden states feed the draft and whose distribution it learns.

A backend turns a batch of token ids into the three aux hidden states and the final (normed)
hidden state; the teacher is then computed through the target's lm_head (``teacher.py``).

- ``hf`` (``hf.py``): transformers in-process, any decoder-only model, TP via transformers' plan.
- ``sglang`` (``sglang.py``): SGLang's model runner in-process with its EAGLE-3 aux capture
  (CUDA, the ``eagleforge[sglang]`` extra).
- ``custom`` (``custom.py``): our own Llama/Qwen implementation, tensor-parallel over the
  mesh's tp axis, loading safetensors shard by shard.

``build_target`` picks one from the ``target`` config section.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from eagleforge.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from eagleforge.targets.source import ModelConfig


class TargetBackendKind(str, Enum):
    hf = "hf"  # transformers, in-process
    sglang = "sglang"  # SGLang's model runner, in-process (CUDA)
    custom = "custom"  # eagleforge's own tensor-parallel Llama / Qwen


@dataclass
class SGLangConfig:
    """The `target.sglang` section: options of the SGLang backend (target=sglang, ``sglang.py``).
    Its tensor-parallel size is `parallel.tp`; anything else SGLang's ServerArgs takes goes in
    `extra`. Every forward here is a prefill of whole sequences (no decoding, no prefix cache)."""

    # SGLang attention backend (flashinfer | fa3 | triton | torch_native | ...).
    attention_backend: str = "flashinfer"
    # Share of GPU memory SGLang reserves for weights and KV cache (0..1); the draft and its
    # optimizer live in the rest.
    mem_fraction_static: float = 0.4
    # Longest sequence SGLang plans for, tokens; null = the target's own context length.
    context_length: int | None = None
    # Capture CUDA graphs of the target forward (SGLang's prefill graphs: every forward here is
    # a prefill, so decode graphs are never captured).
    cuda_graph: bool = False
    # Piecewise prefill graphs, split around attention so that batches of any shape replay
    # them (SGLang's "breakable" prefill backend); implies cuda_graph.
    piecewise_cuda_graph: bool = False
    # Longest sequence, tokens, a prefill CUDA graph replays for; longer batches run eagerly.
    piecewise_cuda_graph_max_tokens: int = 4096
    # torch.compile the target forward inside SGLang.
    torch_compile: bool = False
    # NVLink SHARP all-reduce (NVLS) for the target's TP collectives.
    nccl_nvls: bool = False
    # NCCL symmetric-memory collectives for the target's TP collectives.
    symm_mem: bool = False
    # Data-parallel attention inside the tp group (MoE / MLA targets; set extra.dp_size too).
    dp_attention: bool = False
    # Data-parallel lm_head with dp_attention.
    dp_lm_head: bool = False
    # Expert-parallel size for MoE targets (1 = no expert parallelism; divides parallel.tp).
    ep_size: int = 1
    # Most sequences in one forward (SGLang's request slots); null = SGLang's default.
    max_running_requests: int | None = None
    # KV-cache pool size in tokens, which bounds the tokens of one forward; null = what
    # mem_fraction_static leaves after the weights.
    max_total_tokens: int | None = None
    # Further sglang ServerArgs fields, passed as given (e.g. {kv_cache_dtype: fp8_e5m2}).
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ConfigError(
                f"target.sglang.mem_fraction_static={self.mem_fraction_static} must lie in "
                "(0, 1): the share of GPU memory SGLang keeps for weights and KV cache."
            )
        if not self.attention_backend:
            raise ConfigError(
                "target.sglang.attention_backend is empty; name an SGLang attention backend "
                "(flashinfer, fa3, triton, torch_native, ...)."
            )
        if self.ep_size < 1:
            raise ConfigError(f"target.sglang.ep_size={self.ep_size} must be at least 1.")
        for name in (
            "context_length",
            "max_running_requests",
            "max_total_tokens",
            "piecewise_cuda_graph_max_tokens",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"target.sglang.{name}={value} must be at least 1.")
        if self.dp_lm_head and not self.dp_attention:
            raise ConfigError(
                "target.sglang.dp_lm_head=true needs target.sglang.dp_attention=true; set both "
                "or neither."
            )


@dataclass
class TargetConfig:
    """The `target` config section: how the frozen target runs."""

    # Backend that runs the target forward.
    backend: TargetBackendKind = TargetBackendKind.hf
    # transformers attention implementation of the target (sdpa | eager | flash_attention_2).
    attn_implementation: str = "sdpa"
    # Positions per chunk when computing the teacher through the lm_head (bounds the [chunk, V]
    # fp32 logits); null = as many as fit in 32 MiB (262 for a 32k vocab, 65 for 128k).
    teacher_chunk_size: int | None = None
    # Options of the SGLang backend (target=sglang).
    sglang: SGLangConfig = field(default_factory=SGLangConfig)

    def supports_packing(self) -> bool:
        """Packed rows need a block-diagonal mask, which these attention implementations take."""
        if self.backend == TargetBackendKind.custom:
            return True  # its SDPA always takes an explicit mask
        return self.backend == TargetBackendKind.hf and self.attn_implementation in (
            "sdpa",
            "eager",
        )


@dataclass
class TargetOutput:
    """One target forward. Shape suffixes: B batch, T sequence, H target hidden."""

    aux_BTA: torch.Tensor  # concat of the three aux layer outputs, [B, T, 3H]
    final_hidden_BTH: torch.Tensor  # after the final norm, input of the lm_head
    # A vision-language target's M-RoPE positions [3, B, T] (time, height, width), which
    # the draft rotates by too; None for text-only targets.
    position_ids_3BT: torch.Tensor | None = None


class TargetBackend(Protocol):
    aux_layer_ids: list[int]  # output-of-layer ids of the captured aux states
    config: Any  # the target's transformers config (PretrainedConfig)

    def forward(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor,
        document_ids_BT: torch.Tensor | None = None,
        position_ids_BT: torch.Tensor | None = None,
    ) -> TargetOutput: ...

    def input_embedding(self) -> torch.Tensor: ...

    def lm_head_weight(self) -> torch.Tensor: ...

    def packing_blocker(self) -> str | None:
        """Why this target cannot run packed rows (several documents per row), or None."""
        ...


def forward_over_group(
    tp_mesh: DeviceMesh | None,
    forward: Callable[..., TargetOutput],
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    document_ids_BT: torch.Tensor | None,
    position_ids_BT: torch.Tensor | None,
) -> TargetOutput:
    """``forward`` on this rank's batch, or, with a tp mesh, once on the tp group's batches
    together (a collective: every tp rank calls it in step), each rank keeping its own rows."""
    batch = (input_ids_BT, attention_mask_BT, document_ids_BT, position_ids_BT)
    if tp_mesh is None:
        return forward(*batch)
    from eagleforge.parallel.tp import gather_group_batch

    group = gather_group_batch(tp_mesh, *batch)
    out = forward(
        group.input_ids_BT, group.attention_mask_BT, group.document_ids_BT, group.position_ids_BT
    )
    return TargetOutput(group.own(out.aux_BTA), group.own(out.final_hidden_BTH))


def build_target(
    model_cfg: ModelConfig,
    target_cfg: TargetConfig,
    model_dir: str | Path,
    device: torch.device,
    aux_layer_ids: list[int] | None = None,
    tp_mesh: DeviceMesh | None = None,
) -> Any:  # a TargetBackend
    """The backend `target.backend` names, loaded from ``model_dir``; ``tp_mesh`` is the run
    mesh's "tp" axis (None: no tensor parallelism); ``aux_layer_ids`` overrides
    model.aux_layer_ids."""
    if target_cfg.backend == TargetBackendKind.sglang:
        from eagleforge.targets.sglang import SGLangTarget

        return SGLangTarget.from_config(
            model_cfg, target_cfg, model_dir, device, aux_layer_ids, tp_mesh
        )
    if target_cfg.backend == TargetBackendKind.custom:
        from eagleforge.targets.custom import CustomTarget

        return CustomTarget.from_config(
            model_cfg, target_cfg, model_dir, device, aux_layer_ids, tp_mesh
        )
    from eagleforge.targets.hf import HFTarget

    return HFTarget.from_config(model_cfg, target_cfg, model_dir, device, aux_layer_ids, tp_mesh)
