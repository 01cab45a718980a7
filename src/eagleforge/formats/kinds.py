"""The draft formats (``DraftFormat``): the three directory layouts engines load, with their
architecture names, layer tensor prefixes and aux layer numbering (the table in
``eagleforge.formats``), and llama.cpp's GGUF file; the verifier a speculators draft names."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
VLLM_ARCHITECTURE = "Eagle3LlamaForCausalLM"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
GGUF_ARCHITECTURE = "eagle3"  # general.architecture of llama.cpp's EAGLE-3 drafts


class DraftFormat(str, Enum):
    sglang = "sglang"
    vllm = "vllm"
    speculators = "speculators"
    gguf = "gguf"  # llama.cpp: one GGUF file (formats/gguf.py)

    @property
    def architecture(self) -> str:
        return {
            "sglang": SGLANG_ARCHITECTURE,
            "vllm": VLLM_ARCHITECTURE,
            "speculators": SPECULATORS_ARCHITECTURE,
            "gguf": GGUF_ARCHITECTURE,
        }[self.value]

    @property
    def engine(self) -> str:
        """What loads a draft in this format, in messages."""
        return {
            "sglang": "SGLang",
            "vllm": "vLLM",
            "speculators": "vLLM's speculators format",
            "gguf": "llama.cpp",
        }[self.value]

    @property
    def is_directory(self) -> bool:
        """A config.json and model.safetensors (a GGUF draft is one file in its directory)."""
        return self != DraftFormat.gguf

    @property
    def layer_prefix(self) -> str:
        """Name prefix of the decoder layer's tensors (eagleforge's own is ``midlayer.``)."""
        return "midlayer." if self == DraftFormat.sglang else "layers.0."

    @property
    def layer_id_offset(self) -> int:
        """Added to eagleforge's (output-of-layer) aux layer ids in this format (llama.cpp
        numbers them as vLLM does)."""
        return 0 if self == DraftFormat.sglang else 1


def dtype_name(dtype: torch.dtype) -> str:
    """A config.json's ``torch_dtype`` for weights of ``dtype`` (float32 for others)."""
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(
        dtype, "float32"
    )


@dataclass
class Verifier:
    """The target a speculators-format draft names (``speculators_config.verifier``)."""

    name_or_path: str
    architectures: list[str] = field(default_factory=list)
