"""The draft's parameters are exactly SGLang's LlamaForCausalLMEagle3 checkpoint set (DESIGN.md,
"Draft model" and "Export"), the SGLang export round-trips, and the architecture is derived
from a transformers config."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from eagleforge.draft.config import DraftConfig
from eagleforge.draft.model import DraftArchitecture, Eagle3Draft
from eagleforge.errors import ConfigError
from eagleforge.formats.directory import load_draft_dir
from eagleforge.formats.eagle3 import export_sglang

pytestmark = pytest.mark.unit

# Every dimension distinct, so a transposed or mis-sized weight cannot pass by accident:
# H=16, heads=4, kv heads=2, head_dim=6 (heads*hd=24, kv*hd=12), Ht=10 (3Ht=30), I=40, V=50, W=20.
ARCH = DraftArchitecture(
    hidden_size=16,
    intermediate_size=40,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=6,
    rms_norm_eps=1e-5,
    rope_theta=50000.0,
    max_position_embeddings=128,
    vocab_size=50,
    draft_vocab_size=20,
    target_hidden_size=10,
    aux_layer_ids=[1, 4, 7],
)

EXPECTED = {
    "fc.weight": ([16, 30], torch.float32),
    "midlayer.input_layernorm.weight": ([16], torch.float32),
    "midlayer.hidden_norm.weight": ([16], torch.float32),
    "midlayer.post_attention_layernorm.weight": ([16], torch.float32),
    "midlayer.self_attn.q_proj.weight": ([24, 32], torch.float32),
    "midlayer.self_attn.k_proj.weight": ([12, 32], torch.float32),
    "midlayer.self_attn.v_proj.weight": ([12, 32], torch.float32),
    "midlayer.self_attn.o_proj.weight": ([16, 24], torch.float32),
    "midlayer.mlp.gate_proj.weight": ([40, 16], torch.float32),
    "midlayer.mlp.up_proj.weight": ([40, 16], torch.float32),
    "midlayer.mlp.down_proj.weight": ([16, 40], torch.float32),
    "norm.weight": ([16], torch.float32),
    "lm_head.weight": ([20, 16], torch.float32),
    "d2t": ([20], torch.int64),
    "t2d": ([50], torch.bool),
}


def built_draft() -> Eagle3Draft:
    generator = torch.Generator().manual_seed(0)
    draft = Eagle3Draft(ARCH)
    draft.init_weights(0.02, generator)
    kept = torch.tensor([0, 1, 2, 3, 5, 8, 13, 21, 22, 23, 24, 30, 31, 32, 40, 41, 42, 47, 48, 49])
    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[kept] = True
    draft.set_vocab_map(kept - torch.arange(20), t2d)
    return draft


def test_trainable_state_dict_is_the_sglang_set() -> None:
    """Names, shapes and dtypes of trainable_state_dict() equal the SGLang set, nothing more."""
    state = built_draft().trainable_state_dict()
    got = {name: (list(t.shape), t.dtype) for name, t in state.items()}
    assert got == EXPECTED


def test_embedding_is_frozen_and_not_exported() -> None:
    """embed_tokens [V, H] exists in the module but is frozen and absent from the trainable set;
    every other parameter trains."""
    draft = built_draft()
    assert tuple(draft.embed_tokens.weight.shape) == (50, 16)
    assert not draft.embed_tokens.weight.requires_grad
    trainable = {name for name, p in draft.named_parameters() if p.requires_grad}
    assert trainable == {name for name, (_, dtype) in EXPECTED.items() if dtype == torch.float32}


def test_export_sglang_round_trip(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """export_sglang writes the SGLang config and tensors (no embedding); load_draft_dir reads them
    back equal, with the same architecture."""
    draft = built_draft()
    out = export_sglang(draft, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1
    assert config["tie_word_embeddings"] is False
    assert config["vocab_size"] == 50
    assert config["draft_vocab_size"] == 20
    assert config["target_hidden_size"] == 10
    assert config["hidden_size"] == 16
    assert config["intermediate_size"] == 40
    assert config["num_attention_heads"] == 4
    assert config["num_key_value_heads"] == 2
    assert config["head_dim"] == 6
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 4, 7]

    tensors = load_file(str(out / "model.safetensors"))
    assert not any("embed_tokens" in name for name in tensors)
    assert set(tensors) == set(EXPECTED)

    arch, loaded = load_draft_dir(out)
    assert arch.to_dict() == ARCH.to_dict()
    expected = draft.trainable_state_dict()
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert torch.equal(loaded[name], tensor), name


def test_exported_weights_load_into_a_fresh_draft(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A fresh Eagle3Draft built from the loaded architecture accepts the tensors strictly
    (except the embedding) and reproduces d2t/t2d."""
    draft = built_draft()
    arch, tensors = load_draft_dir(export_sglang(draft, tmp_path))
    fresh = Eagle3Draft(arch)
    missing, unexpected = fresh.load_state_dict(tensors, strict=False)
    assert missing == ["embed_tokens.weight"]
    assert unexpected == []
    assert torch.equal(fresh.d2t, draft.d2t)
    assert torch.equal(
        fresh.draft_to_target_ids(torch.arange(20)), torch.nonzero(draft.t2d).squeeze(1)
    )


def test_from_target_llama_config() -> None:
    """DraftArchitecture.from_target on a LlamaConfig (hidden 64, 4 heads, 2 kv heads, 6 layers,
    vocab 100) copies the target's shape and clips the draft vocab to V."""
    from transformers import LlamaConfig

    target = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=6,
        vocab_size=100,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
    )
    arch = DraftArchitecture.from_target(target, DraftConfig(draft_vocab_size=32), [1, 2, 4])
    assert arch.hidden_size == 64
    assert arch.target_hidden_size == 64
    assert arch.intermediate_size == 128
    assert arch.num_attention_heads == 4
    assert arch.num_key_value_heads == 2
    assert arch.head_dim == 16
    assert arch.vocab_size == 100
    assert arch.draft_vocab_size == 32
    assert arch.rms_norm_eps == pytest.approx(1e-5)
    assert arch.rope_theta == pytest.approx(10000.0)
    assert arch.rope_scaling is None
    assert arch.max_position_embeddings == 256
    assert arch.aux_layer_ids == [1, 2, 4]
    assert arch.hidden_act == "silu"
    assert arch.target_model_type == "llama"

    clipped = DraftArchitecture.from_target(target, DraftConfig(), [1, 2, 4])
    assert clipped.draft_vocab_size == 100
    wide = DraftArchitecture.from_target(target, DraftConfig(intermediate_size=96), [1, 2, 4])
    assert wide.intermediate_size == 96


def test_from_target_keeps_rope_scaling() -> None:
    """A target with non-default RoPE keeps its theta and scaling (without the theta key)."""
    from transformers import LlamaConfig

    target = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=6,
        vocab_size=100,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0},
    )
    arch = DraftArchitecture.from_target(target, DraftConfig(draft_vocab_size=32), [1, 2, 4])
    assert arch.rope_theta == pytest.approx(500000.0)
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    draft = Eagle3Draft(arch)
    plain = 1.0 / (500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    torch.testing.assert_close(draft.inv_freq.double(), plain / 2.0, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"draft_vocab_size": 0}, "draft.draft_vocab_size"),
        ({"ttt_length": 0}, "draft.ttt_length"),
        ({"step_weight_decay": 0.0}, "draft.step_weight_decay"),
        ({"step_weight_decay": 1.5}, "draft.step_weight_decay"),
    ],
)
def test_draft_config_rejects_bad_values(kwargs: dict, field: str) -> None:
    """DraftConfig names the offending field in its ConfigError."""
    with pytest.raises(ConfigError, match=field):
        DraftConfig(**kwargs)
