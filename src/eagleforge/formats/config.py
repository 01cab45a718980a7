"""The ``export`` config section: which draft to write, in which format and dtype, and the
verifier a speculators draft names.

Read by ``eagleforge.export`` (``python -m eagleforge.export``); see docs/checkpoints.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from eagleforge.errors import ConfigError
from eagleforge.formats.kinds import DraftFormat


class ExportDType(str, Enum):
    keep = "keep"  # the draft's own dtype
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


@dataclass
class ExportConfig:
    """The `export` config section (python -m eagleforge.export)."""

    # The draft to export: a checkpoints/step_* directory or a draft directory in any format.
    draft: str | None = None
    # sglang | vllm | speculators | gguf (llama.cpp: <output_dir>/draft.gguf).
    format: DraftFormat = DraftFormat.sglang
    # Where to write it (must not exist yet); null = <draft>-<format> beside the draft.
    output_dir: str | None = None
    # Floating-point dtype of the exported weights.
    dtype: ExportDType = ExportDType.keep
    # speculators: the target's hub id or path; null = the target of the draft's training
    # config.yaml: model.path, or the cache directory of a bundled or random target.
    verifier: str | None = None
    # speculators: the target's architectures (e.g. [LlamaForCausalLM]); [] = those of its
    # config.json (its directory or the Hugging Face cache).
    verifier_architectures: list[str] = field(default_factory=list)
    # speculators: tokens the engine proposes per step by default.
    speculative_tokens: int = 3
    # gguf: the target's GGUF file, which llama.cpp serves the draft beside (the draft carries
    # its tokenizer); null = the bundled SmolLM2's, for a draft trained on it.
    target_gguf: str | None = None

    def __post_init__(self) -> None:
        if self.speculative_tokens < 1:
            raise ConfigError(
                f"export.speculative_tokens must be >= 1, got {self.speculative_tokens}."
            )
        if self.target_gguf and self.format != DraftFormat.gguf:
            raise ConfigError(
                f"export.target_gguf applies to export.format=gguf, not {self.format.value}; "
                "drop it."
            )
