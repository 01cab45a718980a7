"""target=custom, our own decoder, against transformers on small random checkpoints of each
family it implements (Llama with llama3 RoPE, Mistral with a sliding window, Qwen2 with q/k/v
bias and sliding layers beside full ones, Qwen3 with q/k norms and an untied lm_head), saved
in several safetensors files, on padded and packed rows; and its refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagleforge.config import compose_config, to_typed
from eagleforge.errors import ConfigError
from eagleforge.targets.config import TargetBackendKind, TargetConfig
from eagleforge.targets.custom import CustomTarget
from eagleforge.targets.hf import HFTarget

pytestmark = pytest.mark.unit

SHAPE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _config(family: str) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if family == "llama":
        return LlamaConfig(
            **SHAPE,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if family == "mistral":  # a window shorter than the test rows, so it matters
        return MistralConfig(**SHAPE, sliding_window=5, tie_word_embeddings=False)
    if family == "qwen2":
        # sliding layers from layer 2 on beside full ones: one mask per layer kind
        return Qwen2Config(
            **SHAPE,
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=2,
        )
    return Qwen3Config(**SHAPE, head_dim=24, tie_word_embeddings=False)


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "qwen3"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(request.param))
    for name, param in model.named_parameters():  # random biases and norms, not 0 and 1
        if name.endswith("bias") or "norm" in name:
            param.data.normal_(0.5 if "norm" in name else 0.0, 0.2)
    out = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(out, max_shard_size="60KB")  # several files and an index
    return out


def _batches() -> list[tuple]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 300, (3, 12), generator=generator)
    lengths = torch.tensor([12, 9, 4])
    padded = torch.arange(12) < lengths.unsqueeze(1)
    documents = torch.tensor([[0] * 5 + [1] * 7])
    positions = torch.cat([torch.arange(5), torch.arange(7)]).unsqueeze(0)
    return [
        (ids, torch.ones_like(padded)),  # no mask: SDPA's causal kernel
        (ids, padded),
        (ids[:1], torch.ones_like(padded[:1]), documents, positions),  # packed
    ]


AUX = [3, 0, 2]  # distinct and out of order: the capture keeps this order


def _targets(checkpoint: Path) -> tuple[HFTarget, CustomTarget]:
    cpu = torch.device("cpu")
    hf = HFTarget.from_pretrained(checkpoint, TargetConfig(), torch.float32, cpu, AUX)
    return hf, CustomTarget.from_pretrained(checkpoint, torch.float32, cpu, AUX)


def test_custom_target_equals_transformers(checkpoint: Path) -> None:
    hf, custom = _targets(checkpoint)
    assert len(list(checkpoint.glob("*.safetensors"))) > 1
    assert custom.aux_layer_ids == hf.aux_layer_ids == AUX
    torch.testing.assert_close(custom.lm_head_weight(), hf.lm_head_weight(), rtol=0, atol=0)
    torch.testing.assert_close(custom.input_embedding(), hf.input_embedding(), rtol=0, atol=0)
    for batch in _batches():
        want, got = hf.forward(*batch), custom.forward(*batch)
        real = batch[1].unsqueeze(-1)  # padding positions are never used
        for name in ("aux_BTA", "final_hidden_BTH"):
            torch.testing.assert_close(
                getattr(got, name) * real, getattr(want, name) * real, msg=name
            )


def test_packed_rows_equal_their_documents_alone(checkpoint: Path) -> None:
    """Both backends on a packed row (documents of 5, 7 and 3 tokens; Mistral's and Qwen2's
    window is 5) against transformers on each document alone, where it builds its own
    causal and sliding-window masks: an independent reference for the packed masks."""
    hf, custom = _targets(checkpoint)
    lengths = [5, 7, 3]
    ids = torch.randint(0, 300, (1, sum(lengths)), generator=torch.Generator().manual_seed(2))
    documents = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)]).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    valid = torch.ones_like(ids, dtype=torch.bool)
    alone = [hf.forward(part, torch.ones_like(part, dtype=torch.bool)) for part in
             ids.split(lengths, dim=1)]  # fmt: skip
    for target in (hf, custom):
        packed = target.forward(ids, valid, documents, positions)
        for name in ("aux_BTA", "final_hidden_BTH"):
            want = torch.cat([getattr(out, name) for out in alone], dim=1)
            torch.testing.assert_close(getattr(packed, name), want, msg=name)


def test_target_custom_composes_and_packs() -> None:
    config = to_typed(compose_config(["+model=tiny", "target=custom", "output_dir=x"]))
    assert config.target.backend == TargetBackendKind.custom
    assert config.target.supports_packing()


def test_real_tau_probing_needs_the_transformers_target() -> None:
    overrides = ["+model=tiny", "target=custom", "output_dir=x"]
    with pytest.raises(ConfigError, match="eval_tau_every_n_steps .* target.backend=custom"):
        to_typed(compose_config([*overrides, "trainer.eval_tau_every_n_steps=5"]))


def test_unsupported_family_is_refused(tmp_path: Path) -> None:
    from transformers import GemmaConfig

    GemmaConfig(**SHAPE, head_dim=16).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="not 'gemma'; use target=hf"):
        CustomTarget.from_pretrained(tmp_path, torch.float32, torch.device("cpu"))


def test_missing_and_misshapen_tensors_name_the_checkpoint(
    checkpoint: Path, tmp_path: Path
) -> None:
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    for name in sorted(set(index["weight_map"].values())):
        tensors = load_file(checkpoint / name)
        tensors.pop("model.layers.3.mlp.up_proj.weight", None)
        save_file(tensors, tmp_path / name)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"lacks 1 tensors .*layers\.3\.mlp\.up_proj"):
        CustomTarget.from_pretrained(tmp_path, torch.float32, torch.device("cpu"))

    config = json.loads((checkpoint / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    with pytest.raises(ConfigError, match=r"gate_proj.weight has shape \(96, 64\) .* \(128, 64\)"):
        CustomTarget.from_pretrained(tmp_path, torch.float32, torch.device("cpu"))


def test_llama4_chunked_attention_packs_per_document(tmp_path: Path) -> None:
    """transformers' Llama 4 (chunked-attention layers beside full ones, found through its
    decoder although get_decoder() returns the whole model): a packed row equals its
    documents alone, with documents longer than the attention chunk."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    config = Llama4TextConfig(
        **{**SHAPE, "num_hidden_layers": 4}, head_dim=16, intermediate_size_mlp=96,
        num_local_experts=2, attention_chunk_size=4,
    )  # fmt: skip
    assert config.layer_types[0] == "chunked_attention"
    torch.manual_seed(0)
    Llama4ForCausalLM(config).save_pretrained(tmp_path)
    target = HFTarget.from_pretrained(
        tmp_path, TargetConfig(), torch.float32, torch.device("cpu"), [0, 2, 1]
    )
    assert target.packing_blocker() is None
    lengths = [6, 9]
    ids = torch.randint(0, 300, (1, sum(lengths)), generator=torch.Generator().manual_seed(3))
    documents = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)]).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    packed = target.forward(ids, torch.ones_like(ids, dtype=torch.bool), documents, positions)
    alone = [target.forward(p, torch.ones_like(p, dtype=torch.bool)) for p in ids.split(lengths, 1)]
    for name in ("aux_BTA", "final_hidden_BTH"):
        want = torch.cat([getattr(out, name) for out in alone], dim=1)
        torch.testing.assert_close(getattr(packed, name), want, msg=name)
