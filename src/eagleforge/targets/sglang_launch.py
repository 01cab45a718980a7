"""Launch planning for the SGLang backend (``target=sglang``, ``sglang.py``): the
``target.sglang`` options turned into SGLang ``ServerArgs`` (``server_args_kwargs``), the NCCL
variables its collectives need, and where this process sits in SGLang's tensor-parallel
world (``plan_ranks``).

Pure functions: sglang is imported by ``import_sglang`` only, so this module imports (and its
functions run) without it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from eagleforge.errors import ConfigError
from eagleforge.targets.config import SGLangConfig

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'eagleforge[sglang]'"
# The release the in-process calls of sglang.py were written and checked against.
TESTED_SGLANG_VERSION = "0.5.23"

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

# ServerArgs fields this backend sets from other config fields; `extra` may not override them.
_SET_ELSEWHERE = {
    "model_path": "model.path",
    "tokenizer_path": "model.path",
    "trust_remote_code": "model.trust_remote_code",
    "revision": "model.revision",
    "dtype": "model.dtype",
    "tp_size": "parallel.tp",
    "pp_size": "parallel.tp (SGLang runs without pipeline parallelism here)",
    "attention_backend": "target.sglang.attention_backend",
    "mem_fraction_static": "target.sglang.mem_fraction_static",
    "context_length": "target.sglang.context_length",
    "max_running_requests": "target.sglang.max_running_requests",
    "max_total_tokens": "target.sglang.max_total_tokens",
    "disable_cuda_graph": "target.sglang.cuda_graph",
    "disable_prefill_cuda_graph": "target.sglang.cuda_graph",
    "disable_decode_cuda_graph": "target.sglang.cuda_graph",
    "cuda_graph_backend_prefill": "target.sglang.piecewise_cuda_graph",
    "cuda_graph_max_seq_len_prefill": "target.sglang.piecewise_cuda_graph_max_tokens",
    "enable_torch_compile": "target.sglang.torch_compile",
    "enable_nccl_nvls": "target.sglang.nccl_nvls",
    "enable_symm_mem": "target.sglang.symm_mem",
    "enable_dp_attention": "target.sglang.dp_attention",
    "enable_dp_lm_head": "target.sglang.dp_lm_head",
    "ep_size": "target.sglang.ep_size",
    "return_aux_hidden_state_layer_ids": "model.aux_layer_ids",
    "enable_return_aux_hidden_states": "the backend (aux capture is what it is for)",
    "speculative_algorithm": "the backend (EAGLE3 names the capture convention)",
    "skip_tokenizer_init": "the backend (it passes token ids)",
    "disable_radix_cache": "the backend (every forward is a fresh prefill)",
    "disable_overlap_schedule": "the backend (it runs no scheduler)",
}


def import_sglang() -> ModuleType:
    """The sglang package, or a ConfigError saying how to install it."""
    try:
        import sglang
    except ImportError as e:
        raise ConfigError(
            f"target.backend=sglang needs SGLang, which cannot be imported ({e}); install it "
            f"with {INSTALL_HINT} (CUDA only), or use target=hf."
        ) from None
    version = getattr(sglang, "__version__", "unknown")
    if version != TESTED_SGLANG_VERSION:
        log.warning(
            "sglang %s is installed; eagleforge's SGLang backend was written against %s and "
            "uses its internal ModelRunner API, which changes between releases.",
            version,
            TESTED_SGLANG_VERSION,
        )
    return sglang


# --- options and ranks --------------------------------------------------------------------------


def server_args_kwargs(
    cfg: SGLangConfig,
    model_dir: str | Path,
    dtype: torch.dtype,
    tp_size: int,
    aux_layer_ids: list[int],
    trust_remote_code: bool = False,
    revision: str | None = None,
    known_fields: set[str] | None = None,
) -> dict[str, Any]:
    """SGLang ``ServerArgs`` keyword arguments for the target; ``aux_layer_ids`` are SGLang's
    (``sglang_aux_layer_ids``). ``known_fields`` (ServerArgs' field names) checks ``cfg.extra``:
    unknown keys, and keys another config field sets, are a ConfigError naming the key."""
    if dtype not in _DTYPE_NAMES:
        raise ConfigError(
            f"model.dtype={dtype} is not one SGLang runs (bfloat16, float16, float32)."
        )
    graphs = cfg.cuda_graph or cfg.piecewise_cuda_graph
    kwargs: dict[str, Any] = {
        "model_path": str(model_dir),
        "tokenizer_path": str(model_dir),
        "skip_tokenizer_init": True,
        "trust_remote_code": trust_remote_code,
        "revision": revision,
        "dtype": _DTYPE_NAMES[dtype],
        "tp_size": tp_size,
        "pp_size": 1,
        "attention_backend": cfg.attention_backend,
        "mem_fraction_static": cfg.mem_fraction_static,
        "context_length": cfg.context_length,
        "max_running_requests": cfg.max_running_requests,
        "max_total_tokens": cfg.max_total_tokens,
        "enable_torch_compile": cfg.torch_compile,
        "enable_nccl_nvls": cfg.nccl_nvls,
        "enable_symm_mem": cfg.symm_mem,
        "enable_dp_attention": cfg.dp_attention,
        "enable_dp_lm_head": cfg.dp_lm_head,
        "ep_size": cfg.ep_size,
        # Nothing is shared between forwards: each is a fresh prefill, its KV freed after it.
        "disable_radix_cache": True,
        "disable_overlap_schedule": True,
        # SGLang's capture-only mode: EAGLE-3 aux capture on the target, no draft loaded, and
        # the post-norm last hidden state of every token kept beside the aux states.
        "enable_return_aux_hidden_states": True,
        "speculative_algorithm": "EAGLE3",
        "return_aux_hidden_state_layer_ids": list(aux_layer_ids),
        "log_level": "warning",
    }
    if graphs:
        # Every forward here is a prefill: decode graphs would only cost capture time and memory.
        kwargs["disable_decode_cuda_graph"] = True
        kwargs["cuda_graph_backend_prefill"] = "breakable" if cfg.piecewise_cuda_graph else "full"
        kwargs["cuda_graph_max_seq_len_prefill"] = cfg.piecewise_cuda_graph_max_tokens
    else:
        kwargs["disable_cuda_graph"] = True
    for key, value in cfg.extra.items():
        if key in _SET_ELSEWHERE:
            raise ConfigError(
                f"target.sglang.extra.{key} is set by {_SET_ELSEWHERE[key]}; remove it from "
                "extra (and set that field instead)."
            )
        if known_fields is not None and key not in known_fields:
            raise ConfigError(
                f"target.sglang.extra.{key} is not a field of sglang's ServerArgs; use the "
                "underscored name of a `python -m sglang.launch_server --help` option."
            )
        kwargs[key] = value
    return kwargs


def server_args_fields(server_args_cls: type) -> set[str]:
    """Field names of SGLang's ServerArgs (a msgspec Struct in 0.5.x, a dataclass before)."""
    names = getattr(server_args_cls, "__struct_fields__", None)
    if names is None:
        import dataclasses

        names = tuple(f.name for f in dataclasses.fields(server_args_cls))
    return set(names)


def nccl_environment(cfg: SGLangConfig) -> dict[str, str]:
    """NCCL variables the chosen collectives need, set before SGLang builds its communicators.
    (SGLang's own launcher sets them in a helper that also installs a process-killing SIGQUIT
    handler and forces the spawn start method, which is not for a library inside a trainer.)"""
    env: dict[str, str] = {}
    if cfg.nccl_nvls or cfg.symm_mem:
        env["NCCL_NVLS_ENABLE"] = "1"
    if cfg.symm_mem:
        env["NCCL_CUMEM_ENABLE"] = "1"
    return env


@dataclass(frozen=True)
class SGLangRanks:
    """Where this process sits in SGLang's topology."""

    tp_size: int  # SGLang's tensor-parallel size (= parallel.tp)
    tp_rank: int  # this process's rank in it (= its torch.distributed rank when adopted)
    adopt_world: bool  # SGLang builds its groups over the existing torch.distributed world


def plan_ranks(
    tp_ranks: list[int] | None, world_initialized: bool, world_size: int, rank: int
) -> SGLangRanks:
    """SGLang's TP group is the run's tp axis (``tp_ranks``: its global ranks, None for no
    TP). SGLang builds its process groups over the whole torch.distributed world and requires
    that world to be exactly its TP group, so an existing world must be the tp axis; without
    one (a single process), SGLang starts its own world of one."""
    if not world_initialized:
        if tp_ranks is not None and len(tp_ranks) > 1:
            raise ConfigError(
                f"parallel.tp={len(tp_ranks)} needs torch.distributed, which is not initialised; "
                "launch with torchrun (or SLURM)."
            )
        return SGLangRanks(tp_size=1, tp_rank=0, adopt_world=False)
    ranks = tp_ranks if tp_ranks is not None else [rank]
    if ranks != list(range(world_size)):
        raise ConfigError(
            f"target=sglang with parallel.tp={len(ranks)} on {world_size} processes: SGLang "
            "builds its process groups over the whole torch.distributed world, so the tp axis "
            f"must span all of it (parallel.tp={world_size}, no data parallelism); or capture "
            "features with `python -m eagleforge.prepare target=sglang` (each process its own "
            "target) and train offline, or use target=hf."
        )
    return SGLangRanks(tp_size=len(ranks), tp_rank=ranks.index(rank), adopt_world=True)
