"""Every model family under conf/model/ derives a buildable draft from its target's real config.

The configs are the published config.json files of each family, cut to the fields that shape
the draft (``tests/fixtures/model_configs/<entry>.json``); no weights are needed: the draft is
built on the meta device and only its shapes are checked.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig

from eagleforge.config import compose_config, group_choices, to_typed
from eagleforge.draft.model import DraftArchitecture, Eagle3Draft, rope_inv_freq
from eagleforge.targets.source import ModelSource, default_aux_layer_ids

pytestmark = pytest.mark.unit

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "model_configs"
FAMILIES = sorted(p.stem for p in CONFIGS.glob("*.json"))
# Every pretrained entry under conf/model/ has a vendored config (tiny and smollm2 are built here).
EXPECTED = {
    "deepseek_v3", "gemma3", "gpt_oss", "llama3", "llama3_70b", "llama4_scout", "mistral",
    "phi4", "qwen2_5", "qwen2_5_vl", "qwen3", "qwen3_moe",
}  # fmt: skip
# Layers, hidden size, vocab of each target's text model, as published.
SHAPES = {
    "deepseek_v3": (61, 7168, 129280),
    "gemma3": (62, 5376, 262208),
    "gpt_oss": (24, 2880, 201088),
    "llama3": (32, 4096, 128256),
    "llama3_70b": (80, 8192, 128256),
    "llama4_scout": (48, 5120, 202048),
    "mistral": (32, 4096, 32768),
    "phi4": (40, 5120, 100352),
    "qwen2_5": (28, 3584, 152064),
    "qwen2_5_vl": (28, 3584, 152064),
    "qwen3": (36, 4096, 151936),
    "qwen3_moe": (48, 2048, 151936),
}


def _target_config(name: str) -> Any:
    """The vendored config.json as transformers reads it (AutoConfig by model_type)."""
    fields = json.loads((CONFIGS / f"{name}.json").read_text())
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def _arch(name: str) -> DraftArchitecture:
    """The draft architecture as train.py derives it: the entry's draft section, aux ids from
    model.aux_layer_ids or the default rule on the text model's layer count."""
    typed = to_typed(compose_config([f"+model={name}", "data=chitchat", "output_dir=/tmp/unused"]))
    config = _target_config(name)
    num_layers = config.get_text_config().num_hidden_layers
    aux = typed.model.aux_layer_ids or default_aux_layer_ids(num_layers)
    return DraftArchitecture.from_target(config, typed.draft, aux)


def test_every_pretrained_entry_has_a_vendored_config() -> None:
    assert set(FAMILIES) == EXPECTED
    pretrained = {
        choice
        for choice in group_choices("model")
        if to_typed(
            compose_config([f"+model={choice}", "data=chitchat", "output_dir=/tmp/unused"])
        ).model.source
        == ModelSource.pretrained
    }
    assert pretrained == EXPECTED


@pytest.mark.parametrize("name", FAMILIES)
def test_entry_composes_to_its_hub_id(name: str) -> None:
    typed = to_typed(compose_config([f"+model={name}", "data=chitchat", "output_dir=/tmp/unused"]))
    assert typed.model.name == name
    assert typed.model.source == ModelSource.pretrained
    assert typed.model.path and "/" in typed.model.path  # an org/name hub id
    assert typed.model.aux_layer_ids is None  # every family uses the default rule
    vocab = SHAPES[name][2]
    assert 1 <= typed.draft.draft_vocab_size <= vocab


@pytest.mark.parametrize("name", FAMILIES)
def test_vendored_config_reads_as_published(name: str) -> None:
    text = _target_config(name).get_text_config()
    assert (text.num_hidden_layers, text.hidden_size, text.vocab_size) == SHAPES[name]


@pytest.mark.parametrize("name", FAMILIES)
def test_draft_builds_with_the_target_shapes(name: str) -> None:
    num_layers, hidden, vocab = SHAPES[name]
    arch = _arch(name)
    assert arch.aux_layer_ids == [1, num_layers // 2 - 1, num_layers - 4]
    assert all(0 <= i < num_layers for i in arch.aux_layer_ids)
    assert len(set(arch.aux_layer_ids)) == 3
    assert arch.num_attention_heads % arch.num_key_value_heads == 0
    assert arch.hidden_act == "silu"
    with torch.device("meta"):
        draft = Eagle3Draft(arch)
    assert tuple(draft.fc.weight.shape) == (arch.hidden_size, 3 * hidden)
    assert tuple(draft.lm_head.weight.shape) == (arch.draft_vocab_size, arch.hidden_size)
    assert tuple(draft.embed_tokens.weight.shape) == (vocab, arch.hidden_size)
    assert tuple(draft.t2d.shape) == (vocab,) and tuple(draft.d2t.shape) == (arch.draft_vocab_size,)
    attn = draft.midlayer.self_attn
    assert tuple(attn.q_proj.weight.shape) == (
        arch.num_attention_heads * arch.head_dim,
        2 * arch.hidden_size,
    )
    assert tuple(attn.k_proj.weight.shape) == (
        arch.num_key_value_heads * arch.head_dim,
        2 * arch.hidden_size,
    )
    # The RoPE frequencies (scaled as the target scales them) are real numbers on CPU.
    inv_freq = rope_inv_freq(arch)
    assert inv_freq.shape == (arch.head_dim // 2,) and torch.isfinite(inv_freq).all()
    assert (inv_freq > 0).all()


def test_family_specific_derivations() -> None:
    # Qwen3 MoE and gpt-oss: head_dim from the config, not hidden / heads.
    assert _arch("qwen3_moe").head_dim == 128
    gpt_oss = _arch("gpt_oss")
    assert (gpt_oss.num_attention_heads, gpt_oss.head_dim) == (64, 64)
    assert gpt_oss.rope_scaling is not None and gpt_oss.rope_scaling["rope_type"] == "yarn"
    # DeepSeek-V3's MLA: GQA with the value head size, 7168 / 128 = 56 heads, 8 KV heads.
    deepseek = _arch("deepseek_v3")
    assert (deepseek.num_attention_heads, deepseek.num_key_value_heads) == (56, 8)
    assert deepseek.head_dim == 128
    # Llama 4 Scout: the text part, and the dense MLP width rather than one expert's.
    scout = _arch("llama4_scout")
    assert scout.intermediate_size == 16384 and scout.target_model_type == "llama4_text"
    assert scout.rope_scaling is not None and scout.rope_scaling["rope_type"] == "llama3"
    # Gemma 3: the text part and the full-attention layers' RoPE (not the sliding ones').
    gemma = _arch("gemma3")
    assert gemma.rope_theta == 1_000_000.0 and gemma.target_model_type == "gemma3_text"
    assert gemma.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    # Llama 3.x: llama3 RoPE scaling kept.
    assert _arch("llama3_70b").rope_scaling is not None
    # Qwen2.5-VL: the language model's shapes, and its M-RoPE sections kept for the draft
    # (and its SGLang export), with plain RoPE frequencies.
    qwen_vl = _arch("qwen2_5_vl")
    assert qwen_vl.mrope_section == [16, 24, 24] and qwen_vl.rope_theta == 1_000_000.0
    assert qwen_vl.target_model_type == "qwen2_5_vl_text" and qwen_vl.head_dim == 128
