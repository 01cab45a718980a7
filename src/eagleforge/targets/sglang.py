"""SGLang target backend (``target=sglang``): SGLang's ModelRunner in this process, with the
EAGLE-3 aux-hidden-state capture SGLang itself uses for speculative decoding.

    python -m eagleforge.train +model=llama3 target=sglang parallel.device=cuda
    python -m eagleforge.prepare +model=llama3 target=sglang prepare.output_dir=/data/features

What this module owns:

- the ``target.sglang`` options turned into SGLang ``ServerArgs`` (``server_args_kwargs``);
- SGLang's process groups on the run's tp ranks (``plan_ranks``, ``_start_model_runner``);
- eagleforge's right-padded [B, T] rows turned into one SGLang prefill request per row (its real
  tokens only, ``rows_to_sequences``) and SGLang's flat per-token results put back into the
  [B, T, ...] layout, zeros in the padding (``sequences_to_rows``);
- the whole input embedding and lm_head, gathered once when SGLang shards them over TP.

Written against sglang 0.5.23 (pinned in pyproject's ``sglang`` extra): ModelRunner,
ScheduleBatch, ForwardBatch, the runtime-context ``publish`` and the capture-only aux mode
(``enable_return_aux_hidden_states``) are SGLang internals that move between its releases.
sglang is imported inside functions only, so this module imports (and its pure functions run)
without it.

Shape suffixes: B batch, T sequence, N real tokens of a batch (all rows, flat), H target
hidden, A = 3H (the three aux states), V target vocab, X any trailing width.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from eagleforge.errors import ConfigError
from eagleforge.targets import SGLangConfig, TargetConfig, TargetOutput, forward_over_group
from eagleforge.targets.source import ModelConfig, default_aux_layer_ids

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'eagleforge[sglang]'"
# The release the in-process calls below were written and checked against.
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


# --- layer ids --------------------------------------------------------------------------------


def sglang_aux_layer_ids(aux_layer_ids: list[int], num_layers: int) -> list[int]:
    """The ids to hand SGLang's EAGLE-3 capture (``return_aux_hidden_state_layer_ids``, which
    reaches the model's ``set_eagle3_layers_to_capture``) for our output-of-layer ids.

    SGLang's Llama/Qwen models add one to each id and snapshot the residual stream *entering*
    that decoder layer, i.e. the output of layer ``id``: the same 0-based output-of-layer
    numbering as ours (and as the exported draft's ``eagle_aux_hidden_state_layer_ids``), so
    the numbers pass unchanged. The last layer's output enters no further layer, so SGLang
    cannot capture it: ConfigError for that id. A repeated id is captured once (SGLang tests
    "is this layer captured", and refuses repeats), so it is a ConfigError too.
    """
    if len(set(aux_layer_ids)) != len(aux_layer_ids):
        raise ConfigError(
            f"model.aux_layer_ids {list(aux_layer_ids)} repeats a layer, which SGLang captures "
            f"once; set three distinct ids (a {num_layers}-layer target's default repeats one "
            "when it has fewer than 7 layers)."
        )
    bad = [i for i in aux_layer_ids if not 0 <= i < num_layers - 1]
    if bad:
        raise ConfigError(
            f"model.aux_layer_ids {list(aux_layer_ids)} has {bad}, but target=sglang captures "
            f"the outputs of layers 0..{num_layers - 2} only (SGLang snapshots a layer's output "
            f"as the next layer's input, and the last of the {num_layers} layers has none); "
            "choose other ids or use target=hf."
        )
    return list(aux_layer_ids)


def sglang_snapshot_layers(sglang_ids: list[int]) -> list[int]:
    """The decoder layers whose *input* SGLang copies for these capture ids (its
    ``layers_to_capture``): one higher, as its ``set_eagle3_layers_to_capture`` computes."""
    return [i + 1 for i in sglang_ids]


def aux_in_our_order(aux_NA: torch.Tensor, aux_layer_ids: list[int]) -> torch.Tensor:
    """SGLang concatenates the captured states in layer order (it collects them as its layer
    loop passes); ours follow ``aux_layer_ids`` as given (like the hf backend and the exported
    draft's fc input). Reorder the [.., 3H] blocks when the ids are not ascending."""
    ranked = sorted(aux_layer_ids)
    order = [ranked.index(i) for i in aux_layer_ids]
    if order == list(range(len(order))):
        return aux_NA
    blocks = aux_NA.chunk(len(order), dim=-1)
    return torch.cat([blocks[j] for j in order], dim=-1)


# --- padded rows <-> SGLang's flat token layout -------------------------------------------------


@dataclass(frozen=True)
class RowLayout:
    """How a right-padded [B, T] batch maps onto SGLang's flat layout: the requests are the
    rows with at least one real token, in row order, their tokens back to back."""

    lengths: list[int]  # real tokens of each row (0: a row of padding only, sent nowhere)
    seq_len: int  # T

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


def rows_to_sequences(
    input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor
) -> tuple[list[list[int]], RowLayout]:
    """One token-id list per row that has real tokens (SGLang's requests, in row order) and
    the layout to put the results back. The rows must be right-padded: mask ones, then zeros."""
    batch, seq = input_ids_BT.shape
    mask_BT = attention_mask_BT.bool()
    lengths_B = mask_BT.sum(dim=1)
    prefix_BT = torch.arange(seq, device=mask_BT.device) < lengths_B.unsqueeze(1)
    if not torch.equal(mask_BT, prefix_BT):
        raise ValueError(
            "target=sglang takes right-padded rows (attention_mask: ones, then zeros); this "
            "batch has padding before or between real tokens."
        )
    lengths: list[int] = lengths_B.tolist()
    ids_BT = input_ids_BT.cpu()  # one transfer for the whole batch
    sequences = [ids_BT[row, :n].tolist() for row, n in enumerate(lengths) if n > 0]
    return sequences, RowLayout(lengths, seq)


def sequences_to_rows(flat_NX: torch.Tensor, layout: RowLayout) -> torch.Tensor:
    """SGLang's per-token results [N, X] (requests back to back, row order) as [B, T, X],
    zeros at the padding positions."""
    if flat_NX.shape[0] != layout.num_tokens:
        raise RuntimeError(
            f"SGLang returned {flat_NX.shape[0]} token rows for a batch of {layout.num_tokens} "
            "real tokens."
        )
    lengths_B = torch.tensor(layout.lengths, device=flat_NX.device)
    real_BT = torch.arange(layout.seq_len, device=flat_NX.device) < lengths_B.unsqueeze(1)
    out_BTX = flat_NX.new_zeros(len(layout.lengths), layout.seq_len, *flat_NX.shape[1:])
    # boolean-mask assignment walks the mask row by row, left to right: SGLang's order
    out_BTX[real_BT] = flat_NX
    return out_BTX


def vocab_matrix_from_shards(shards: list[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """The whole [V, H] matrix from the row shards of an SGLang vocab-parallel layer, in tp-rank
    order: each rank holds one contiguous block of the padded vocabulary, and the padding rows
    (up to a multiple of 64 x tp) come last."""
    full_VH = torch.cat(shards, dim=0) if len(shards) > 1 else shards[0]
    if full_VH.shape[0] < vocab_size:
        raise RuntimeError(
            f"SGLang's vocab shards hold {full_VH.shape[0]} rows, fewer than the target's "
            f"vocab_size {vocab_size}."
        )
    return full_VH[:vocab_size]


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- SGLang itself (CUDA) ------------------------------------------------------------------------


class _NoPrefixCache:
    """Stands in for SGLang's prefix (radix) cache, which its scheduler owns: nothing is cached
    between forwards, and the pools are cleared after each, so there is nothing to evict or
    hand on. The attributes and methods are what ScheduleBatch asks of its tree cache when it
    allocates a prefill (the same stand-in SGLang's own one-batch benchmark uses)."""

    def __init__(self, page_size: int, device: Any, token_to_kv_pool_allocator: Any) -> None:
        self.page_size = page_size
        self.device = device
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator

    def supports_swa(self) -> bool:
        return False

    def supports_mamba(self) -> bool:
        return False

    def supports_prefix_sharing(self) -> bool:
        return True  # plain token allocation; nothing is shared since nothing is inserted

    def evict(self, params: Any) -> None:
        return None

    def maybe_hand_to_session(self, req: Any) -> None:
        return None


def _start_model_runner(
    kwargs: dict[str, Any], cfg: SGLangConfig, ranks: SGLangRanks, device: torch.device
) -> Any:
    """SGLang's ModelRunner for this process, loaded, with its KV pool, attention backends and
    (if asked) CUDA graphs: the steps SGLang's scheduler takes before serving, minus the
    scheduler. Every tp rank must call this at the same time (it builds process groups)."""
    from sglang.srt.configs.model_config import ModelConfig as SGLangModelConfig
    from sglang.srt.distributed import bootstrap
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.layers.quantization.fp4_utils import initialize_fp4_gemm_config
    from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config
    from sglang.srt.layers.quantization.unquant import initialize_bf16_gemm_config
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.runtime_context import SpawnRanks, get_model, publish, spawn_world_rank
    from sglang.srt.server_args import ServerArgs

    try:
        server_args = ServerArgs(**kwargs)
        server_args.resolve_once()  # SGLang's own option checks and derived settings
    except (ValueError, TypeError, AssertionError) as e:
        raise ConfigError(
            f"target.sglang: SGLang rejected the options ({e}); change target.sglang (or "
            "target.sglang.extra)."
        ) from None
    os.environ.update(nccl_environment(cfg))
    gpu_id = device.index if device.index is not None else torch.cuda.current_device()
    # The process-wide config SGLang's layers read (its "scheduler" role is the one that runs
    # the target model); pp_rank 0: no pipeline parallelism.
    world_rank = spawn_world_rank(server_args, tp_rank=ranks.tp_rank, pp_rank=0)
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=world_rank, gpu_id=gpu_id))
    for init in (
        initialize_moe_config,
        initialize_fp8_gemm_config,
        initialize_bf16_gemm_config,
        initialize_fp4_gemm_config,
    ):
        init()
    model_config = SGLangModelConfig.from_server_args(server_args)
    # With an adopted world SGLang skips init_process_group and the port goes unused; else it
    # starts a one-process world on it.
    port = _free_port()
    bootstrap.init_parallel_runtime(server_args=server_args, device="cuda", dist_port=port)
    bootstrap.init_layer_runtime(model_config=model_config)
    runner = ModelRunner(
        model_config=model_config,
        mem_fraction_static=cfg.mem_fraction_static,
        gpu_id=gpu_id,
        nccl_port=port,
        server_args=server_args,
    )
    overlap = bool(getattr(get_model(), "is_startup_weight_load_overlap", False))
    if overlap:
        runner.start_startup_weight_load()
    runner.alloc_memory_pool()
    runner.init_attention_backends()
    runner.init_cuda_graphs()
    if overlap:
        runner.finalize_startup_weight_load()
    return runner


def _prefill(runner: Any, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One SGLang prefill of ``sequences`` (a request each): the concatenated aux states
    [N, A] and the post-norm final hidden states [N, H] of every token, requests back to back.
    The request slots and KV tokens are freed before returning."""
    from array import array

    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.cuda_graph_config import cuda_graph_fully_disabled
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
    from sglang.srt.runtime_context import get_schedule
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.utils import require_mlp_sync, require_mlp_tp_gather

    params = SamplingParams(temperature=0, max_new_tokens=1)
    reqs = []
    for i, ids in enumerate(sequences):
        req = Req(
            rid=f"eagleforge-{i}",
            origin_input_text="",
            origin_input_ids=array("q", ids),
            sampling_params=params,
        )
        # the whole row is this prefill (no cached prefix), and no prompt logprobs are wanted
        req.full_untruncated_fill_ids = req.origin_input_ids
        req.logprob_start_len = -1
        req.extend_end = len(ids)
        reqs.append(req)
    cache = _NoPrefixCache(
        get_schedule().page_size, runner.device, runner.token_to_kv_pool_allocator
    )
    batch = ScheduleBatch.init_new(
        reqs=reqs,
        req_to_token_pool=runner.req_to_token_pool,
        token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
        tree_cache=cache,
        model_config=runner.model_config,
        enable_overlap=False,
        spec_algorithm=SpeculativeAlgorithm.NONE,
    )
    try:
        batch.prepare_for_extend()
        if require_mlp_sync():  # dp_attention: the tp ranks agree on the MLP batch
            from sglang.srt.managers.scheduler_components.dp_attn import (
                prepare_mlp_sync_batch_raw,
            )

            prepare_mlp_sync_batch_raw(
                batch,
                model_runner=runner,
                get_idle_batch=None,
                disable_cuda_graph=cuda_graph_fully_disabled(),
                require_mlp_tp_gather=require_mlp_tp_gather(),
                disable_overlap_schedule=True,
                offload_tags=set(),
            )
        if batch.input_ids is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
            # the scheduler's overlap path moves the ids to the GPU later; there is no later here
            batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True)
            batch.prefill_input_ids_cpu = None
        forward_batch = ForwardBatch.init_new(
            batch,
            runner,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            return_hidden_states_before_norm=False,
        )
        out = runner.forward(forward_batch).logits_output
        aux_NA, final_NH = out.hidden_states, out.last_hidden_states
        if aux_NA is None or final_NH is None:
            raise RuntimeError(
                "SGLang returned no aux or last hidden states; this sglang release does not "
                f"keep them in capture-only mode (written against {TESTED_SGLANG_VERSION})."
            )
        if getattr(out, "hidden_states_token_indices", None) is not None:
            raise RuntimeError("SGLang captured a subset of the tokens; every token is needed.")
        # a CUDA-graph replay reuses its output buffers: copy before the next forward
        return aux_NA.clone(), final_NH.clone()
    finally:
        # nothing outlives a forward: every request slot and KV token is free again
        runner.req_to_token_pool.clear()
        runner.token_to_kv_pool_allocator.clear()


def _vocab_layer_matrix(layer: Any, vocab_size: int) -> torch.Tensor:
    """The whole [V, H] weight of an SGLang vocab-parallel layer (embedding or lm_head),
    all-gathered over its TP group when sharded."""
    shard_VH = layer.weight.detach()
    if int(getattr(layer, "tp_size", 1)) == 1:
        return vocab_matrix_from_shards([shard_VH], vocab_size)
    from sglang.srt.distributed.parallel_state import get_tp_group
    from sglang.srt.runtime_context import get_parallel

    group = get_parallel().attn_tp_group if layer.use_attn_tp_group else get_tp_group()
    shards = [torch.empty_like(shard_VH) for _ in range(group.world_size)]
    torch.distributed.all_gather(shards, shard_VH.contiguous(), group=group.device_group)
    return vocab_matrix_from_shards(shards, vocab_size).contiguous()


class SGLangTarget:
    """A frozen target run by SGLang's ModelRunner in this process, with EAGLE-3 aux capture.
    With a tp mesh (more than one rank) every forward runs on the tp group's micro-batches
    together (a collective: every tp rank calls it in step), like ``HFTarget``."""

    def __init__(
        self,
        runner: Any,  # sglang ModelRunner, loaded, with aux capture set up
        config: Any,  # the target's transformers config
        aux_layer_ids: list[int],
        tp_mesh: DeviceMesh | None = None,
    ) -> None:
        self.runner = runner
        self.config = config
        self.aux_layer_ids = list(aux_layer_ids)
        self.tp_mesh = tp_mesh if tp_mesh is not None and tp_mesh.size() > 1 else None
        text = config.get_text_config()
        vocab_size = int(text.vocab_size)
        model = runner.model
        embedding = (
            model.get_input_embeddings()
            if hasattr(model, "get_input_embeddings")
            else model.model.embed_tokens
        )
        head = getattr(model, "lm_head", None)
        if head is None:
            raise ConfigError(
                f"SGLang's {type(model).__name__} has no lm_head; target=sglang needs a causal "
                "LM (the teacher is computed through its lm_head)."
            )
        # The teacher and the draft need whole matrices: gathered once here, on every tp rank.
        self._embedding_VH = _vocab_layer_matrix(embedding, vocab_size)
        self._lm_head_VH = (
            self._embedding_VH if head is embedding else _vocab_layer_matrix(head, vocab_size)
        )

    @classmethod
    def from_config(
        cls,
        model_cfg: ModelConfig,
        target_cfg: TargetConfig,
        model_dir: str | Path,
        device: torch.device,
        aux_layer_ids: list[int] | None = None,
        tp_mesh: DeviceMesh | None = None,
    ) -> SGLangTarget:
        """The target as the run's `model` and `target` sections describe it; ``aux_layer_ids``
        overrides model.aux_layer_ids; ``tp_mesh`` is the run mesh's "tp" axis (None: no TP).
        Every tp rank must call this together."""
        if device.type != "cuda":
            raise ConfigError(
                f"target.backend=sglang runs on CUDA only, but the run's device is {device}; "
                "set parallel.device=cuda (on a GPU machine) or use target=hf."
            )
        sglang = import_sglang()
        from sglang.srt.server_args import ServerArgs
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(
            model_dir, trust_remote_code=model_cfg.trust_remote_code, revision=model_cfg.revision
        )
        num_layers = int(config.get_text_config().num_hidden_layers)
        ours = list(aux_layer_ids or model_cfg.aux_layer_ids or default_aux_layer_ids(num_layers))
        theirs = sglang_aux_layer_ids(ours, num_layers)
        dist = torch.distributed
        initialized = dist.is_available() and dist.is_initialized()
        ranks = plan_ranks(
            tp_mesh.mesh.flatten().tolist() if tp_mesh is not None else None,
            initialized,
            dist.get_world_size() if initialized else 1,
            dist.get_rank() if initialized else 0,
        )
        kwargs = server_args_kwargs(
            target_cfg.sglang,
            model_dir,
            model_cfg.dtype.torch_dtype(device),
            ranks.tp_size,
            theirs,
            trust_remote_code=model_cfg.trust_remote_code,
            revision=model_cfg.revision,
            known_fields=server_args_fields(ServerArgs),
        )
        log.info(
            "sglang %s target: tp %d, aux layers %s (SGLang snapshots the inputs of layers %s)",
            getattr(sglang, "__version__", "?"),
            ranks.tp_size,
            ours,
            sglang_snapshot_layers(theirs),
        )
        runner = _start_model_runner(kwargs, target_cfg.sglang, ranks, device)
        return cls(runner, config, ours, tp_mesh)

    @torch.no_grad()
    def forward(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor,
        document_ids_BT: torch.Tensor | None = None,
        position_ids_BT: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Aux and final hidden states of right-padded rows (zeros at padding). Packed rows
        are not supported. With a tp mesh every tp rank must call this (with its own
        micro-batch) in step."""
        if document_ids_BT is not None:
            raise ConfigError(
                "target=sglang does not run packed rows (document_ids); set data.packing=false "
                "(TargetConfig.supports_packing is false for sglang)."
            )
        if position_ids_BT is not None:
            seq = input_ids_BT.shape[1]
            plain_BT = torch.arange(seq, device=position_ids_BT.device).expand_as(position_ids_BT)
            real_BT = attention_mask_BT.bool().to(position_ids_BT.device)
            if not torch.equal(position_ids_BT[real_BT], plain_BT[real_BT]):
                raise ConfigError(
                    "target=sglang numbers each row's tokens 0..n-1 itself; it cannot take "
                    "other position ids (packed or offset rows)."
                )
        # SGLang's tp ranks compute the same tokens together: one batch for the group.
        batch = (input_ids_BT, attention_mask_BT, None, None)
        return forward_over_group(self.tp_mesh, self._forward, *batch)

    def _forward(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor,
        _document_ids_BT: None = None,  # checked in forward: never packed
        _position_ids_BT: torch.Tensor | None = None,  # checked in forward: 0..n-1 per row
    ) -> TargetOutput:
        sequences, layout = rows_to_sequences(input_ids_BT, attention_mask_BT)
        self._check_fits(layout)
        hidden = self._lm_head_VH.shape[1]
        if not sequences:  # padding only: nothing for SGLang to do
            empty_NH = self._lm_head_VH.new_zeros(0, hidden)
            return TargetOutput(
                sequences_to_rows(empty_NH.repeat(1, 3), layout),
                sequences_to_rows(empty_NH, layout),
            )
        aux_NA, final_NH = _prefill(self.runner, sequences)
        aux_NA = aux_in_our_order(aux_NA, self.aux_layer_ids)
        return TargetOutput(
            aux_BTA=sequences_to_rows(aux_NA, layout),
            final_hidden_BTH=sequences_to_rows(final_NH, layout),
        )

    def _check_fits(self, layout: RowLayout) -> None:
        """A forward holds every token of the batch in SGLang's KV pool at once."""
        capacity = int(getattr(self.runner, "max_total_num_tokens", 0) or 0)
        if capacity and layout.num_tokens > capacity:
            raise ConfigError(
                f"a batch of {layout.num_tokens} tokens does not fit SGLang's KV pool of "
                f"{capacity} tokens; raise target.sglang.mem_fraction_static or "
                "target.sglang.max_total_tokens, or lower the batch size."
            )
        context = getattr(getattr(self.runner, "model_config", None), "context_len", None)
        if isinstance(context, int) and max(layout.lengths, default=0) > context:
            raise ConfigError(
                f"a sequence of {max(layout.lengths)} tokens is longer than SGLang's context "
                f"length {context}; raise target.sglang.context_length or lower data.max_length."
            )
        slots = getattr(getattr(self.runner, "req_to_token_pool", None), "size", None)
        rows = sum(1 for n in layout.lengths if n > 0)
        if isinstance(slots, int) and rows > slots:
            raise ConfigError(
                f"a batch of {rows} sequences exceeds SGLang's {slots} request slots; raise "
                "target.sglang.max_running_requests or lower the batch size."
            )

    def packing_blocker(self) -> str | None:
        return "target=sglang runs each row as one SGLang sequence"

    def input_embedding(self) -> torch.Tensor:
        return self._embedding_VH

    def lm_head_weight(self) -> torch.Tensor:
        return self._lm_head_VH
