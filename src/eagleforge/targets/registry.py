"""Which backend runs the target: ``build_target`` reads the run's `model` and `target` sections
once (``LoadSpec``) and hands them to the loader ``target.backend`` names (``LOADERS``).

``build_hf_target`` loads the transformers backend whatever ``target.backend`` says: decoding
(``evaluate``, the τ probe, regeneration) needs its KV cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh

from eagleforge.engine.config import VLLMConfig
from eagleforge.errors import ConfigError
from eagleforge.targets.base import TargetBackend
from eagleforge.targets.config import TargetBackendKind, TargetConfig
from eagleforge.targets.custom import CustomTarget, local_model_dir
from eagleforge.targets.hf import HFTarget
from eagleforge.targets.source import ModelConfig


@dataclass(frozen=True)
class LoadSpec:
    """What every backend loads: the run's `model` section resolved for this process."""

    model_dir: str | Path  # a local directory or a hub id
    dtype: torch.dtype  # model.dtype on this device
    device: torch.device
    aux_layer_ids: list[int] | None  # None: the target's default aux layers
    trust_remote_code: bool
    revision: str | None
    tp_mesh: DeviceMesh | None  # the run mesh's "tp" axis; None: no tensor parallelism
    engine: VLLMConfig  # target=vllm: the engine to start (the run's `vllm` section)
    engine_log: Path  # target=vllm: its log file

    @classmethod
    def of(
        cls,
        model_cfg: ModelConfig,
        model_dir: str | Path,
        device: torch.device,
        aux_layer_ids: list[int] | None = None,
        tp_mesh: DeviceMesh | None = None,
        engine: VLLMConfig | None = None,
        engine_log: Path | None = None,
    ) -> LoadSpec:
        """``aux_layer_ids`` overrides model.aux_layer_ids (e.g. with the layers a trained
        draft reads)."""
        return cls(
            model_dir,
            model_cfg.dtype.torch_dtype(device),
            device,
            aux_layer_ids or model_cfg.aux_layer_ids,
            model_cfg.trust_remote_code,
            model_cfg.revision,
            tp_mesh,
            engine or VLLMConfig(),
            engine_log or Path("vllm-target.log"),
        )


def _load_hf(spec: LoadSpec, cfg: TargetConfig) -> HFTarget:
    return HFTarget.from_pretrained(
        spec.model_dir,
        cfg,
        spec.dtype,
        spec.device,
        aux_layer_ids=spec.aux_layer_ids,
        trust_remote_code=spec.trust_remote_code,
        revision=spec.revision,
        tp_mesh=spec.tp_mesh,
    )


def _load_custom(spec: LoadSpec, cfg: TargetConfig) -> CustomTarget:
    return CustomTarget.from_pretrained(
        local_model_dir(spec.model_dir, spec.revision),
        spec.dtype,
        spec.device,
        aux_layer_ids=spec.aux_layer_ids,
        tp_mesh=spec.tp_mesh,
    )


def _load_sglang(spec: LoadSpec, cfg: TargetConfig) -> TargetBackend:
    # imported here: the backend needs the sglang wheel, which pins its own CUDA torch
    from eagleforge.targets.sglang import SGLangTarget

    return SGLangTarget.from_pretrained(
        spec.model_dir,
        cfg.sglang,
        spec.dtype,
        spec.device,
        aux_layer_ids=spec.aux_layer_ids,
        trust_remote_code=spec.trust_remote_code,
        revision=spec.revision,
        tp_mesh=spec.tp_mesh,
    )


def _load_vllm(spec: LoadSpec, cfg: TargetConfig) -> TargetBackend:
    from eagleforge.targets.vllm import VLLMTarget

    if spec.tp_mesh is not None:
        raise ConfigError("target.backend=vllm runs the whole target in vLLM; set parallel.tp=1.")
    model_dir = local_model_dir(spec.model_dir, spec.revision)
    return VLLMTarget(
        model_dir, spec.dtype, spec.device, spec.engine, spec.engine_log, spec.aux_layer_ids,
        cfg.producers,
    )  # fmt: skip


LOADERS: dict[TargetBackendKind, Callable[[LoadSpec, TargetConfig], TargetBackend]] = {
    TargetBackendKind.hf: _load_hf,
    TargetBackendKind.sglang: _load_sglang,
    TargetBackendKind.custom: _load_custom,
    TargetBackendKind.vllm: _load_vllm,
}


def build_target(
    model_cfg: ModelConfig,
    target_cfg: TargetConfig,
    model_dir: str | Path,
    device: torch.device,
    aux_layer_ids: list[int] | None = None,
    tp_mesh: DeviceMesh | None = None,
    engine: VLLMConfig | None = None,
    engine_log: Path | None = None,
) -> TargetBackend:
    """The backend `target.backend` names, loaded from ``model_dir``; ``tp_mesh`` is the run
    mesh's "tp" axis (None: no tensor parallelism; every tp rank calls this together);
    ``aux_layer_ids`` overrides model.aux_layer_ids; ``engine`` and ``engine_log``: the vLLM
    engine target=vllm starts, and where it logs."""
    spec = LoadSpec.of(model_cfg, model_dir, device, aux_layer_ids, tp_mesh, engine, engine_log)
    return LOADERS[target_cfg.backend](spec, target_cfg)


def build_hf_target(
    model_cfg: ModelConfig,
    target_cfg: TargetConfig,
    model_dir: str | Path,
    device: torch.device,
    aux_layer_ids: list[int] | None = None,
    tp_mesh: DeviceMesh | None = None,
) -> HFTarget:
    """The transformers backend as the run's `model` and `target` sections describe it,
    whatever `target.backend` names (arguments as for ``build_target``)."""
    return _load_hf(LoadSpec.of(model_cfg, model_dir, device, aux_layer_ids, tp_mesh), target_cfg)
