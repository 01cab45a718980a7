"""The draft's training module (``draft/ttt.py``'s ``TTTModule``), data-parallel over every
rank with FSDP2.

``TTTModule`` runs the whole unrolled TTT inside ``forward``, so FSDP2's hooks gather the
draft's parameters once around all k steps (the loss reads ``lm_head.weight`` directly, not
through a submodule call) and reduce-scatter the gradients after its backward. In a
one-process run the same module runs unwrapped.

State dicts go through ``torch.distributed.checkpoint.state_dict`` in their *full* form, keyed
by parameter name: the same files serve 1 process or N ranks, so a run resumes with another
world size by construction. Drafts are small (one layer), so gathering them is cheap.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from eagleforge.draft.family import TrainingModule
from eagleforge.parallel import ParallelConfig
from eagleforge.parallel.dist import World

# Names in this module's state dicts carry this prefix in front of the draft's own names.
PREFIX = "draft."


def shard_draft(module: TrainingModule, world: World, cfg: ParallelConfig) -> TrainingModule:
    """fully_shard the draft over every rank (a no-op in a one-process run).

    Gradients are summed, not averaged, over ranks: the loss is already normalised by the
    global count of counted positions. On CUDA with ``parallel.mixed_precision`` parameters
    are gathered in bf16 and gradients reduced in fp32.
    """
    if world.mesh is None:
        return module
    mixed = cfg.mixed_precision and world.device.type == "cuda"
    # Inputs are not cast: the draft casts the aux states itself, and the loss scales must
    # keep fp32 precision.
    policy = (
        MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
        if mixed
        else MixedPrecisionPolicy()
    )
    # one axis over every rank (DeviceMesh._flatten: private, but what torchtitan uses too)
    flat = world.mesh._flatten("draft_dp") if world.mesh.ndim > 1 else world.mesh
    fully_shard(
        module,
        mesh=flat,
        reshard_after_forward=cfg.reshard_after_forward,
        mp_policy=policy,
        # the frozen embedding (vocab x hidden) stays whole on each rank, as the target's does:
        # no all-gather of it in every forward and backward (a DFlash draft holds the target's
        # as buffers, which are never sharded)
        ignored_params={p for p in module.draft.parameters() if not p.requires_grad},
    )
    assert isinstance(module, FSDPModule)
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    return module


def set_gradient_sync(module: nn.Module, sync: bool) -> None:
    """Accumulating micro-batches: reduce gradients only in the step's last backward."""
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(sync)


def full_draft_state(module: TrainingModule) -> dict[str, torch.Tensor]:
    """Every tensor of the draft (frozen embedding and vocab map included), whole, on CPU,
    keyed by the draft's names -- on rank 0; other ranks get {}. A collective under FSDP:
    every rank must call it."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(module, options=options)
    return {
        k.removeprefix(PREFIX): v.detach().cpu()
        for k, v in state.items()
        if isinstance(v, torch.Tensor)
    }


def load_draft_state(module: TrainingModule, tensors: dict[str, torch.Tensor]) -> None:
    """Load whole tensors (the draft's names; the frozen embedding may be absent) on every rank."""
    set_model_state_dict(
        module,
        {f"{PREFIX}{k}": v for k, v in tensors.items()},
        options=StateDictOptions(full_state_dict=True, strict=False),
    )


def optimizer_state(module: TrainingModule, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's whole state keyed by parameter name, on CPU, on rank 0 ({} elsewhere; a
    collective under FSDP)."""
    return get_optimizer_state_dict(
        module, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def load_optimizer_state(
    module: TrainingModule, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    set_optimizer_state_dict(
        module, optimizer, state, options=StateDictOptions(full_state_dict=True)
    )
