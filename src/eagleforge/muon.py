"""``optimizer=muon``: torch's Muon for the draft's weight matrices and torch's AdamW for the
rest (norms, vectors, vocabulary-indexed tables), as ONE ``torch.optim.Optimizer``; and its
config section ``optimizer.muon``. See docs/optimizers.md#muon.

One optimizer object, not two, so that everything written against one keeps working unchanged:
the LambdaLR schedule (one lambda over every group), ``state_dict``/``load_state_dict``,
torch.distributed.checkpoint's get/set_optimizer_state_dict (parameter states keyed by name) and
the trainer's ``optimizer.step()``. Each parameter group says which algorithm updates it
(``group["algorithm"]``); the state of every parameter lives in this optimizer's ``state``.

    python -m eagleforge.train +model=smollm2 data=chitchat optimizer=muon
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from eagleforge.errors import ConfigError

# The key in each parameter group that names its algorithm, and its two values.
ALGORITHM, MUON, ADAMW = "algorithm", "muon", "adamw"

# Module names whose 2-d weights stay with AdamW however they are shaped: the embedding is a
# lookup table (each row is updated alone, orthogonalising it as a whole has no meaning).
_NEVER_MUON = ("embed_tokens",)
_LM_HEAD = "lm_head"


class MuonLrAdjust(str, Enum):
    # torch.optim.Muon's adjust_lr_fn: how the group lr is scaled for an [A, B] matrix
    original = "original"  # lr * sqrt(max(1, A/B)) (Keller Jordan's Muon)
    # lr * 0.2 * sqrt(max(A, B)): an update RMS like AdamW's (Moonshot)
    match_rms_adamw = "match_rms_adamw"


@dataclass
class MuonConfig:
    """`optimizer.muon`: Muon's options, used only with ``kind: muon``. Defaults are those of
    vLLM's speculators (its default optimizer), which are torch.optim.Muon's except for the lr
    and its adjustment."""

    # The Muon group's peak lr as a multiple of optimizer.lr (the AdamW group's); the one
    # schedule scales both (speculators: muon_lr = 10 * lr).
    lr_ratio: float = 10.0
    # Decoupled weight decay of the Muon group (per step, times its scheduled lr, before the
    # shape adjustment); optimizer.weight_decay is the AdamW group's.
    weight_decay: float = 0.1
    # Momentum of the gradient average that is orthogonalised.
    momentum: float = 0.95
    # Orthogonalise the Nesterov look-ahead (gradient + momentum) instead of the momentum.
    nesterov: bool = True
    # Newton-Schulz iterations per step (torch's quintic iteration; 5 in torch and speculators).
    ns_steps: int = 5
    # How the lr is scaled by each matrix's shape: original or match_rms_adamw.
    adjust_lr_fn: MuonLrAdjust = MuonLrAdjust.match_rms_adamw
    # Update lm_head ([draft_vocab, hidden]) with Muon; false = AdamW at optimizer.lr, as
    # speculators and Keller Jordan's Muon do for output heads.
    lm_head: bool = False

    def __post_init__(self) -> None:
        if self.lr_ratio <= 0:
            raise ConfigError(f"optimizer.muon.lr_ratio must be > 0, got {self.lr_ratio}.")
        if self.weight_decay < 0:
            raise ConfigError(f"optimizer.muon.weight_decay must be >= 0, got {self.weight_decay}.")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"optimizer.muon.momentum must be in [0, 1), got {self.momentum}.")
        # torch's Newton-Schulz refuses 100 or more iterations
        if not 1 <= self.ns_steps <= 99:
            raise ConfigError(f"optimizer.muon.ns_steps must be in [1, 99], got {self.ns_steps}.")


def goes_to_muon(cfg: MuonConfig, name: str, param: torch.Tensor) -> bool:
    """Whether the trainable parameter ``name`` is updated by Muon: a 2-d matrix with both sides
    longer than 1 (a [1, N] "matrix" is a vector: nothing to orthogonalise), not the embedding,
    and not lm_head unless ``cfg.lm_head``. Names may carry a prefix (``draft.fc.weight``)."""
    modules = name.split(".")
    if param.ndim != 2 or min(param.shape) < 2 or any(m in modules for m in _NEVER_MUON):
        return False
    return cfg.lm_head or _LM_HEAD not in modules


def split_for_muon(
    cfg: MuonConfig, named_params: Sequence[tuple[str, torch.nn.Parameter]]
) -> tuple[dict[str, torch.nn.Parameter], dict[str, torch.nn.Parameter]]:
    """The trainable parameters by name: (Muon's, AdamW's), each in model order."""
    muon = {n: p for n, p in named_params if goes_to_muon(cfg, n, p)}
    adamw = {n: p for n, p in named_params if n not in muon}
    return muon, adamw


def _torch_muon() -> Any:
    muon = getattr(torch.optim, "Muon", None)
    if muon is None:
        raise ConfigError(
            f"optimizer.kind=muon needs torch.optim.Muon (torch 2.9 or newer; this is torch "
            f"{torch.__version__}); upgrade torch, or use optimizer=adamw."
        )
    return muon


class MuonWithAdamW(torch.optim.Optimizer):
    """torch.optim.Muon over ``muon_params`` and torch.optim.AdamW over ``adamw_params``, as one
    optimizer.

    The two torch optimizers built here only lend their ``step``: before each step they are
    pointed at this optimizer's groups of their algorithm and at its ``state``, which
    ``load_state_dict`` (and DCP's loading) replace with new objects. So the updates are torch's
    own, and state dicts, hooks and schedules see one ordinary optimizer.
    """

    def __init__(
        self,
        muon_params: list[torch.nn.Parameter],
        adamw_params: list[torch.nn.Parameter],
        *,
        muon: dict[str, Any],
        adamw: dict[str, Any],
    ) -> None:
        self._muon = _torch_muon()(muon_params, **muon) if muon_params else None
        self._adamw = torch.optim.AdamW(adamw_params, **adamw) if adamw_params else None
        groups: list[dict[str, Any]] = []
        for algorithm, inner in ((MUON, self._muon), (ADAMW, self._adamw)):
            if inner is not None:
                groups += [{**group, ALGORITHM: algorithm} for group in inner.param_groups]
        super().__init__(groups, defaults={})

    def _groups(self, algorithm: str) -> list[dict[str, Any]]:
        return [group for group in self.param_groups if group[ALGORITHM] == algorithm]

    # one signature for torch's two overloads (with and without a closure)
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._adamw is not None:
            self._adamw.param_groups, self._adamw.state = self._groups(ADAMW), self.state
            self._adamw.step()
        if self._muon is not None:
            plain: list[dict[str, Any]] = []
            sharded: list[dict[str, Any]] = []
            for group in self._groups(MUON):
                is_sharded = any(isinstance(p, DTensor) for p in group["params"])
                (sharded if is_sharded else plain).append(group)
            self._muon.param_groups, self._muon.state = plain, self.state
            self._muon.step()
            for group in sharded:
                self._sharded_muon_step(group)
        return loss

    def _sharded_muon_step(self, group: dict[str, Any]) -> None:
        """torch's ``_single_tensor_muon`` for FSDP2's sharded parameters (DTensors, each rank
        holding a block of rows). Orthogonalisation needs the whole matrix. torch's Muon given
        DTensors runs, but DTensor's operator dispatch splits its bf16 Newton-Schulz matmuls into
        partial products over the shards: on 2 gloo ranks (torch 2.13) its result for a random
        96x64 gradient was 2% (relative norm) away from one process's. Here the momentum update
        stays on the shard (it is elementwise), the whole update is gathered once, every rank
        runs torch's own Newton-Schulz on it -- one process's computation, bit for bit -- and
        keeps its own rows. Drafts have one layer: the gathers and the repeated iterations are
        small next to the target's forward."""
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

        lr, weight_decay, momentum = float(group["lr"]), group["weight_decay"], group["momentum"]
        for param in group["params"]:
            if param.grad is None:
                continue
            grad = param.grad
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            whole = update.full_tensor() if isinstance(update, DTensor) else update
            ortho = _zeropower_via_newtonschulz(
                whole, group["ns_coefficients"], group["ns_steps"], group["eps"]
            )
            if isinstance(param, DTensor):
                # every rank holds the same whole matrix: cut out this rank's block, no comms
                ortho = distribute_tensor(
                    ortho, param.device_mesh, param.placements, src_data_rank=None
                )
            adjusted_lr = _adjust_lr(lr, group["adjust_lr_fn"], param.shape)  # the whole shape
            param.mul_(1 - lr * weight_decay)
            param.add_(ortho, alpha=-adjusted_lr)


def make_muon(
    cfg: MuonConfig,
    named_params: Sequence[tuple[str, torch.nn.Parameter]],
    lr: float,
    adamw: dict[str, Any],
) -> MuonWithAdamW:
    """Muon (at ``lr * cfg.lr_ratio``) for the matrices ``split_for_muon`` picks, AdamW with
    ``adamw`` (lr, betas, eps, weight_decay) for the other trainable parameters."""
    muon_params, adamw_params = split_for_muon(cfg, named_params)
    return MuonWithAdamW(
        list(muon_params.values()),
        list(adamw_params.values()),
        muon={
            "lr": lr * cfg.lr_ratio,
            "weight_decay": cfg.weight_decay,
            "momentum": cfg.momentum,
            "nesterov": cfg.nesterov,
            "ns_steps": cfg.ns_steps,
            "adjust_lr_fn": cfg.adjust_lr_fn.value,
        },
        adamw=adamw,
    )
