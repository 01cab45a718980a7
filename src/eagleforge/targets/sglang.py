"""SGLang target backend (``target=sglang``): SGLang's ModelRunner in this process, with the
EAGLE-3 aux-hidden-state capture SGLang itself uses for speculative decoding.

    python -m eagleforge.train +model=llama3 target=sglang parallel.device=cuda
    python -m eagleforge.prepare +model=llama3 target=sglang prepare.output_dir=/data/features

What this module owns: SGLang's ModelRunner started on the run's tp ranks
(``_start_model_runner``), one prefill of a batch's rows (``_prefill``), and the backend around
them (``SGLangTarget``), with the whole input embedding and lm_head gathered once when SGLang
shards them over TP. The options and ranks it starts with are planned in ``sglang_launch.py``;
the translation between our padded rows and layer ids and SGLang's flat layout is in
``sglang_layout.py``.

Written against sglang 0.5.23 (pinned in pyproject's ``sglang`` extra): ModelRunner,
ScheduleBatch, ForwardBatch, the runtime-context ``publish`` and the capture-only aux mode
(``enable_return_aux_hidden_states``) are SGLang internals that move between its releases.
sglang is imported inside functions only, so this module imports without it.

Shape suffixes: B batch, T sequence, N real tokens of a batch (all rows, flat), H target
hidden, A = 3H (the three aux states), V target vocab.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from eagleforge.errors import ConfigError
from eagleforge.targets.base import TargetOutput, forward_over_group, refuse_images
from eagleforge.targets.config import SGLangConfig
from eagleforge.targets.sglang_launch import (
    TESTED_SGLANG_VERSION,
    SGLangRanks,
    import_sglang,
    nccl_environment,
    plan_ranks,
    server_args_fields,
    server_args_kwargs,
)
from eagleforge.targets.sglang_layout import (
    RowLayout,
    aux_in_our_order,
    rows_to_sequences,
    sequences_to_rows,
    sglang_aux_layer_ids,
    sglang_snapshot_layers,
    vocab_matrix_from_shards,
)
from eagleforge.targets.source import default_aux_layer_ids

log = logging.getLogger(__name__)


# --- SGLang itself (CUDA) ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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

    forward_in_engine = False

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
    def from_pretrained(
        cls,
        model_dir: str | Path,
        cfg: SGLangConfig,
        dtype: torch.dtype,
        device: torch.device,
        aux_layer_ids: list[int] | None = None,
        trust_remote_code: bool = False,
        revision: str | None = None,
        tp_mesh: DeviceMesh | None = None,
    ) -> SGLangTarget:
        """Start SGLang on ``model_dir`` with the ``target.sglang`` options; ``aux_layer_ids``
        None: the default layers; ``tp_mesh`` is the run mesh's "tp" axis (None: no TP).
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
            model_dir, trust_remote_code=trust_remote_code, revision=revision
        )
        num_layers = int(config.get_text_config().num_hidden_layers)
        ours = list(aux_layer_ids or default_aux_layer_ids(num_layers))
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
            cfg,
            model_dir,
            dtype,
            ranks.tp_size,
            theirs,
            trust_remote_code=trust_remote_code,
            revision=revision,
            known_fields=server_args_fields(ServerArgs),
        )
        log.info(
            "sglang %s target: tp %d, aux layers %s (SGLang snapshots the inputs of layers %s)",
            getattr(sglang, "__version__", "?"),
            ranks.tp_size,
            ours,
            sglang_snapshot_layers(theirs),
        )
        runner = _start_model_runner(kwargs, cfg, ranks, device)
        return cls(runner, config, ours, tp_mesh)

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
        """Aux and final hidden states of right-padded rows (zeros at padding). Packed rows
        and images are not supported. With a tp mesh every tp rank must call this (with its
        own micro-batch) in step."""
        refuse_images("sglang", pixel_values, image_grid_thw)
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

    def final_norm_weight(self) -> torch.Tensor | None:
        norm = getattr(getattr(self.runner.model, "model", None), "norm", None)
        return None if norm is None else norm.weight  # replicated over tp ranks
