"""The engines that judge a draft by serving it (``eval.engine=vllm``, ``eval.engine=llamacpp``):
the ``Judge`` protocol and its one registry. A judge serves the target alone and with each
draft, exported to the engine's own format first, and ``speculative/engine_judge.py`` reads
the engine's own counters around the same prompts; ``evaluate`` reaches an engine only
through ``build_judge``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from eagleforge.config import EagleForgeConfig
from eagleforge.engine.llamacpp import LlamaServer, llama_server
from eagleforge.engine.server import EngineProcess, VLLMServer, engine_python
from eagleforge.errors import ConfigError
from eagleforge.families import family_of
from eagleforge.formats.config import ExportConfig, ExportDType
from eagleforge.formats.directory import read_architecture
from eagleforge.formats.gguf import gguf_path, gguf_weight_type
from eagleforge.formats.kinds import DraftFormat
from eagleforge.parallel import resolve_device
from eagleforge.speculative.config import DecodeSettings
from eagleforge.speculative.engine_judge import speculative_config, unsupported_setting
from eagleforge.targets.source import ModelSource, bundled_smollm2_gguf, resolve_model_dir


class Judge(Protocol):
    """One serving engine as the judge of drafts."""

    name: str  # eval.engine's value, and the engine column of the tables
    title: str  # in server names and messages: "vLLM"
    draft_format: DraftFormat  # what its drafts are exported to before it serves them
    dtype: str  # what the target computes in: float32 | bfloat16 | float16 | q4_1 ...

    def runnable(self, settings: list[DecodeSettings]) -> list[DecodeSettings]:
        """The settings this engine decodes; each one it cannot is named on the console."""
        ...

    def export_config(self, draft: Path, out: Path) -> ExportConfig:
        """The export of ``draft`` into ``out`` in this engine's format."""
        ...

    def server(
        self,
        log_path: Path,
        name: str,
        draft: Path | None = None,
        setting: DecodeSettings | None = None,
    ) -> EngineProcess:
        """The engine serving the target alone, or with the exported ``draft`` decoding
        ``setting``'s chains (not started: ``with`` starts and stops it)."""
        ...


def chains_only(engine: str, settings: list[DecodeSettings]) -> list[DecodeSettings]:
    """The chains of ``settings`` (engines on a CPU draft no trees); each tree named."""
    runnable = []
    for setting in settings:
        why = unsupported_setting(setting)
        if why:
            print(f"eval.engine={engine}: skipping {why}.", flush=True)
        else:
            runnable.append(setting)
    if not runnable:
        raise ConfigError(
            f"eval.engine={engine}: none of the decoding settings is a chain (steps/1/steps+1); "
            "add one, e.g. eval.sweep=[3/1/4], or use eval.engine=hf for trees."
        )
    return runnable


def text_prompts_only(engine: str, config: EagleForgeConfig) -> None:
    """Engines decode text prompts: a vision-language target is refused, naming eval.engine=hf."""
    if config.data.is_vlm:
        raise ConfigError(
            f"eval.engine={engine} decodes text prompts; a vision-language target "
            "(data.is_vlm) is evaluated with eval.engine=hf."
        )


class VLLMJudge:
    """vLLM serving the target's HF directory, the draft in vLLM's format."""

    name, title, draft_format = "vllm", "vLLM", DraftFormat.vllm

    def __init__(self, config: EagleForgeConfig) -> None:
        if config.vllm.url:
            raise ConfigError(
                "eval.engine=vllm starts its own engines (the target alone, then one per draft "
                "and chain length), so it cannot use vllm.url; unset vllm.url."
            )
        engine_python(config.vllm)  # a missing engine costs a line, before any model loads
        text_prompts_only(self.name, config)
        model_dtype = config.model.dtype.torch_dtype(resolve_device(config.parallel))
        self.dtype = config.vllm.dtype_for(str(model_dtype).removeprefix("torch."))
        # every pass is timed on its own prompts: a prefix cache would skip the second's prefill
        extra = [*config.vllm.extra_args, "--no-enable-prefix-caching"]
        self.cfg = replace(config.vllm, extra_args=extra)
        self.model, self.cache_dir, self.seed = (
            config.model,
            config.resolved_cache_dir(),
            config.seed,
        )

    def runnable(self, settings: list[DecodeSettings]) -> list[DecodeSettings]:
        return chains_only(self.name, settings)

    def export_config(self, draft: Path, out: Path) -> ExportConfig:
        return ExportConfig(draft=str(draft), format=self.draft_format, output_dir=str(out))

    def server(
        self,
        log_path: Path,
        name: str,
        draft: Path | None = None,
        setting: DecodeSettings | None = None,
    ) -> EngineProcess:
        speculative = None
        if draft is not None and setting is not None:
            arch = read_architecture(draft)
            method = family_of(arch).vllm_method(arch, setting.num_draft_tokens)
            speculative = speculative_config(draft, method)
        # the target's directory (a bundled one converted once): only when a server starts
        model_dir = resolve_model_dir(self.model, self.cache_dir)
        return VLLMServer(
            self.cfg, model_dir, log_path, self.dtype, speculative=speculative,
            name=name, seed=self.seed,
        )  # fmt: skip


class LlamaCppJudge:
    """llama.cpp's llama-server serving the target's GGUF file, the draft as a GGUF."""

    name, title, draft_format = "llamacpp", "llama.cpp", DraftFormat.gguf

    def __init__(self, config: EagleForgeConfig) -> None:
        cfg = config.llamacpp
        llama_server(cfg)  # a missing server costs a line, before any model loads
        text_prompts_only(self.name, config)
        if cfg.target_gguf:
            self.target = Path(cfg.target_gguf).expanduser()
            if not self.target.is_file():
                raise ConfigError(
                    f"llamacpp.target_gguf={cfg.target_gguf}: no such file; give the target's "
                    "GGUF file (the one llama-server -m loads)."
                )
        elif config.model.source == ModelSource.bundled_smollm2:
            self.target = bundled_smollm2_gguf()
        else:
            raise ConfigError(
                "eval.engine=llamacpp needs the target as a GGUF file: set llamacpp.target_gguf "
                "(llama.cpp's convert_hf_to_gguf.py writes one; only model=smollm2 finds its own)."
            )
        if config.eval.engine_batch > cfg.parallel:
            raise ConfigError(
                f"eval.engine_batch={config.eval.engine_batch} requests at once need as many "
                f"llama-server slots: set llamacpp.parallel >= {config.eval.engine_batch} "
                f"(it is {cfg.parallel})."
            )
        self.cfg, self.seed = cfg, config.seed
        self.dtype = gguf_weight_type(self.target)

    def runnable(self, settings: list[DecodeSettings]) -> list[DecodeSettings]:
        return chains_only(self.name, settings)

    def export_config(self, draft: Path, out: Path) -> ExportConfig:
        return ExportConfig(
            draft=str(draft), format=self.draft_format, output_dir=str(out),
            dtype=ExportDType(self.cfg.draft_dtype), target_gguf=str(self.target),
        )  # fmt: skip

    def server(
        self,
        log_path: Path,
        name: str,
        draft: Path | None = None,
        setting: DecodeSettings | None = None,
    ) -> EngineProcess:
        if draft is None or setting is None:
            return LlamaServer(self.cfg, self.target, log_path, name=name, seed=self.seed)
        arch = read_architecture(draft)
        family = family_of(arch)
        if family.llamacpp_type is None:
            raise ConfigError(
                f"eval.engine=llamacpp: llama.cpp serves no {family.title} draft; judge it with "
                "eval.engine=vllm or hf."
            )
        return LlamaServer(
            self.cfg, self.target, log_path, draft=gguf_path(draft),
            spec_type=family.llamacpp_type,
            num_draft_tokens=family.proposals(arch, setting.num_draft_tokens),
            name=name, seed=self.seed,
        )  # fmt: skip


JUDGES: dict[str, Callable[[EagleForgeConfig], Judge]] = {
    "vllm": VLLMJudge,
    "llamacpp": LlamaCppJudge,
}


def build_judge(name: str, config: EagleForgeConfig) -> Judge:
    """The judge ``eval.engine`` names (every name but ``hf``, eagleforge's own decoder): its
    engine found and its settings checked, nothing loaded."""
    return JUDGES[name](config)
