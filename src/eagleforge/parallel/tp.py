"""Target tensor parallelism (``parallel.tp``): tp ranks hold one target and run it together.

With target=hf the target is sharded by transformers' own tensor-parallel plan
(``base_model_tp_plan``, DTensor), with target=custom by ``parallelize_decoder``; both over the
"tp" axis of the run's mesh, and each rank reads only its shards from disk.
Every rank keeps its own micro-batch: before a forward the tp group gathers its micro-batches
into one batch (``gather_group_batch``), runs the target once on it, and each rank keeps the
rows it brought (``GroupBatch.own``).

Shape suffixes: B batch, T sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from eagleforge.errors import ConfigError


def tp_axis(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The "tp" axis of the run's mesh, or None when there is no target TP (one rank per
    target): the form ``build_target(..., tp_mesh=...)`` takes."""
    if mesh is None or mesh["tp"].size() == 1:
        return None
    return mesh["tp"]


def check_heads_fit(text: Any, tp: int) -> None:
    """ConfigError unless ``tp`` ranks can split the attention heads, key/value heads and MLP
    width of a decoder with this (text) config."""
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    if heads % tp or kv_heads % tp:
        fits = [n for n in range(1, heads + 1) if math.gcd(heads, kv_heads) % n == 0]
        raise ConfigError(
            f"parallel.tp={tp} must divide the target's {heads} attention heads and "
            f"{kv_heads} key/value heads; use one of {fits}."
        )
    width = int(getattr(text, "intermediate_size", 0) or 0)
    if width % tp:
        raise ConfigError(
            f"parallel.tp={tp} must divide the target's MLP width {width}; choose another tp."
        )


def check_tp_fits(config: Any, tp: int) -> None:
    """ConfigError unless transformers can split a target with this config over ``tp`` ranks."""
    text = config.get_text_config()
    check_heads_fit(text, tp)
    plan = getattr(text, "base_model_tp_plan", None) or getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise ConfigError(
            f"parallel.tp={tp}: transformers has no tensor-parallel plan for model type "
            f"'{text.model_type}' (its config's base_model_tp_plan is empty); use parallel.tp=1."
        )


def parallelize_decoder(decoder: torch.nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split each layer of eagleforge's own decoder (``target.custom.Decoder``) over ``tp_mesh``:
    q/k/v and gate/up by output rows, o_proj and down_proj by input columns with their
    partial sums all-reduced. Embedding and norms stay whole."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in decoder.layers:  # type: ignore[union-attr]
        parallelize_module(layer, tp_mesh, plan)  # type: ignore[arg-type]


class _TPAxis:
    """Stands in for transformers' mesh manager: every mesh it asks for is the run's tp axis
    (its other axes, pp and fsdp, have size 1 here)."""

    def __init__(self, tp_mesh: DeviceMesh) -> None:
        self.tp_mesh = tp_mesh

    def get_mesh(self, dims: str | tuple[str, ...]) -> DeviceMesh:
        if "tp" not in ((dims,) if isinstance(dims, str) else dims):
            raise RuntimeError(f"transformers asked for mesh axes {dims}; only 'tp' is set up")
        return self.tp_mesh


def load_tensor_parallel(
    model_dir: str | Path, tp_mesh: DeviceMesh, device: torch.device, **kwargs: Any
) -> Any:
    """``AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)`` sharded over ``tp_mesh``
    by the model's tensor-parallel plan; each rank reads only its own shards."""
    from transformers import AutoModelForCausalLM, PreTrainedModel

    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        raise ConfigError(
            "parallel.tp > 1 needs transformers' DistributedConfig (tested with 5.24); "
            "upgrade transformers or use parallel.tp=1."
        ) from None
    if not hasattr(PreTrainedModel, "prepare_distribute_model"):
        raise ConfigError(
            "parallel.tp > 1: this transformers version loads tensor-parallel models differently "
            "(tested with 5.24); upgrade transformers or use parallel.tp=1."
        )

    # transformers builds its own mesh over the whole world (pp x dp x fsdp x tp, with the
    # target FSDP-sharded over dp) and ignores a mesh passed in; here the other ranks are
    # the draft's data-parallel ranks, so it gets the run's tp axis instead.
    def prepare(
        cls: type, distributed_config: Any, device_map: Any = None
    ) -> tuple[Any, torch.device, _TPAxis]:
        return distributed_config, device, _TPAxis(tp_mesh)

    with mock.patch.object(PreTrainedModel, "prepare_distribute_model", classmethod(prepare)):
        return AutoModelForCausalLM.from_pretrained(
            model_dir, distributed_config=DistributedConfig(tp_size=tp_mesh.size()), **kwargs
        )


def full_weight(weight: torch.Tensor) -> torch.Tensor:
    """A plain tensor with the whole weight (all-gathered over the tp group if sharded)."""
    from torch.distributed.tensor import DTensor

    if isinstance(weight, DTensor):
        with torch.no_grad():
            return weight.full_tensor()
    return weight


@dataclass
class GroupBatch:
    """The micro-batches of a tp group as one right-padded batch, and this rank's rows in it."""

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    document_ids_BT: torch.Tensor | None  # set if any rank's rows are packed
    position_ids_BT: torch.Tensor | None  # set if any rank passed position ids
    rows: slice  # this rank's rows
    seq_len: int  # this rank's T

    def own(self, x_BT: torch.Tensor) -> torch.Tensor:
        """This rank's part of a [B, T, ...] result of the group batch, in its own shape."""
        return x_BT[self.rows, : self.seq_len].contiguous()


def gather_group_batch(
    tp_mesh: DeviceMesh,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    document_ids_BT: torch.Tensor | None = None,
    position_ids_BT: torch.Tensor | None = None,
) -> GroupBatch:
    """Concatenate the micro-batches of the tp group, rank order, padded on the right to the
    longest (two all-gathers: the shapes, then the tokens). Every tp rank must call this.

    Rows without document ids count as one document and rows without position ids get
    0..T-1, which is what the target does with them alone.
    """
    group, rank = tp_mesh.get_group(), tp_mesh.get_local_rank()
    device = input_ids_BT.device
    batch, seq = input_ids_BT.shape
    shape = torch.tensor(
        [batch, seq, document_ids_BT is not None, position_ids_BT is not None], device=device
    )
    shapes = [torch.empty_like(shape) for _ in range(tp_mesh.size())]
    dist.all_gather(shapes, shape, group=group)
    sizes: list[list[int]] = torch.stack(shapes).tolist()
    max_batch, max_seq = max(s[0] for s in sizes), max(s[1] for s in sizes)

    # one int64 tensor [B, T, 4] of ids, mask, document ids, positions: one collective
    fields = torch.zeros(max_batch, max_seq, 4, dtype=torch.long, device=device)
    fields[:batch, :seq, 0] = input_ids_BT
    fields[:batch, :seq, 1] = attention_mask_BT.long()
    if document_ids_BT is not None:
        fields[:batch, :seq, 2] = document_ids_BT
    fields[:batch, :seq, 3] = (
        position_ids_BT
        if position_ids_BT is not None
        else torch.arange(seq, device=device).expand(batch, seq)
    )
    gathered = [torch.empty_like(fields) for _ in sizes]
    dist.all_gather(gathered, fields, group=group)
    group_BTF = torch.cat([g[: s[0]] for g, s in zip(gathered, sizes, strict=True)])

    start = sum(s[0] for s in sizes[:rank])
    return GroupBatch(
        input_ids_BT=group_BTF[..., 0].to(input_ids_BT.dtype),
        attention_mask_BT=group_BTF[..., 1].to(attention_mask_BT.dtype),
        document_ids_BT=group_BTF[..., 2] if any(s[2] for s in sizes) else None,
        position_ids_BT=group_BTF[..., 3] if any(s[3] for s in sizes) else None,
        rows=slice(start, start + batch),
        seq_len=seq,
    )
