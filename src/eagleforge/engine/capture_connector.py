"""The hidden-state capture connector eagleforge hands vLLM (``extract_hidden_states``): vLLM's
``ExampleHiddenStatesConnector`` made to run on a CPU as well as on CUDA. Loaded by vLLM
itself, inside the engine's own environment (``make vllm`` installs eagleforge there), by
``kv_connector_module_path``; never imported by eagleforge.

What differs from the example connector (vLLM 0.32):

* On a KV cache that is not on CUDA (vLLM's CPU backend) the states are gathered with a plain
  synchronous copy: the example's pinned host buffer (``empty_like(..., pin_memory=True)``)
  raises without an accelerator, and the CPU worker's stand-in for ``torch.cuda.Event`` has no
  ``query``. A finished-event stand-in keeps the example's bookkeeping (``get_finished``, the
  per-file lock readers wait on) as it is. On CUDA the example's asynchronous path runs.
* Each file's safetensors metadata names the layer ids of its ``hidden_states`` rows (vLLM
  sorts and de-duplicates them) and the target's layer count.

Per request one ``{shared_storage_path}/{request id}.safetensors``: ``hidden_states`` [T, L, H]
in the model's dtype, ``token_ids`` int64 [T], and a ``.lock`` beside it.
"""

from __future__ import annotations

import fcntl
import json
import os
from functools import partial
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig


class _CompletedEvent:
    """A CUDA event whose work is done: what a synchronous copy leaves behind."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


_COMPLETED = _CompletedEvent()


class EagleforgeCaptureConnector(ExampleHiddenStatesConnector):
    """The example connector, CPU-safe (see the module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        hf_config = vllm_config.speculative_config.draft_model_config.hf_config
        ids = getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None) or []
        # vLLM collects aux layers as tuple(sorted(set(ids))): rows come in that order, and a
        # repeated id would leave fewer rows than the cache has heads.
        if len(set(ids)) != len(ids):
            raise ValueError(f"eagle_aux_hidden_state_layer_ids repeats a layer: {ids}")
        self._file_metadata = {
            "layer_ids": json.dumps(sorted(ids)),
            "num_hidden_layers": str(vllm_config.model_config.get_total_num_hidden_layers()),
        }

    def _write_tensors(  # instance method (the example's is static) to add the metadata
        self,
        tensors: dict[str, torch.Tensor],
        event,
        filename: str,
        lock_fd: int | None,
    ) -> None:
        try:
            event.synchronize()
            save_file(tensors, filename, metadata=self._file_metadata)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: readers waiting on LOCK_SH proceed

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        if self._kv_cache.device.type == "cuda":
            super()._submit_async_write(pending)
            return

        # Slots of the request's blocks, in order; the first len(token_ids) are its tokens.
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (block_ids[:, None] * self._block_size + offsets[None, :]).flatten()
        num_tokens = pending.token_ids.shape[0]
        # Advanced indexing copies, so the blocks may be freed as soon as this returns.
        hidden = (
            extract_from_kv_cache(
                self._kv_cache, slot_mapping.to(self._kv_cache.device), num_tokens
            )
            .to("cpu")
            .contiguous()
        )
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}

        assert pending.req_id not in self._req_futures, "duplicate hidden-states save"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(
                pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644
            )
            fcntl.flock(lock_fd, fcntl.LOCK_EX)

        future = self._executor.submit(
            self._write_tensors, tensors, _COMPLETED, pending.filename, lock_fd
        )
        self._req_copy_events[pending.req_id] = _COMPLETED  # get_finished: done at once
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
