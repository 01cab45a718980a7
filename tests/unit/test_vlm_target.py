"""The HF backend with a vision-language target (tiny random Qwen2.5-VL): the vision tower's
features reach the aux states of the language model's layers, and the M-RoPE positions it
returns are the model's own (images: 3-D; text: three equal rows)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from eagleforge.targets.config import TargetConfig
from eagleforge.targets.hf import HFTarget
from eagleforge.targets.source import (
    ModelConfig,
    ModelSource,
    RandomModelConfig,
    load_processor,
    random_qwen2_5_vl_dir,
)

pytestmark = pytest.mark.unit


def test_vlm_forward_captures_language_layers_and_returns_mrope(cache_dir: Path) -> None:
    model_dir = random_qwen2_5_vl_dir(RandomModelConfig(), cache_dir)
    target = HFTarget.from_pretrained(model_dir, TargetConfig(), torch.float32, torch.device("cpu"))
    processor = load_processor(
        ModelConfig(name="tiny_vl", source=ModelSource.random_vl), model_dir, 3136, 12544
    )
    assert target.is_vlm and target.aux_layer_ids == [1, 2, 4]
    images = processor.image_processor(
        images=[Image.new("RGB", (112, 56), (10, 200, 30))], return_tensors="pt"
    )
    grid = images["image_grid_thw"]
    num_image_tokens = int(grid.prod()) // 4
    start, end, pad = (processor.tokenizer.convert_tokens_to_ids(t) for t in (
        "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"
    ))  # fmt: skip
    with_image = [5, 6, start, *[pad] * num_image_tokens, end, 7, 8]
    text_only = [5, 6, 7, 8, 9]
    length = len(with_image)
    input_ids = torch.zeros(2, length, dtype=torch.long)
    input_ids[0] = torch.tensor(with_image)
    input_ids[1, : len(text_only)] = torch.tensor(text_only)
    mask = torch.zeros(2, length, dtype=torch.bool)
    mask[0] = True
    mask[1, : len(text_only)] = True

    out = target.forward(input_ids, mask, pixel_values=images["pixel_values"], image_grid_thw=grid)
    positions_3BT = out.position_ids_3BT
    assert positions_3BT is not None and positions_3BT.shape == (3, 2, length)
    image_rows = positions_3BT[:, 0, 3 : 3 + num_image_tokens]
    assert not torch.equal(image_rows[1], image_rows[2])  # rows and columns of the image
    text_rows = positions_3BT[:, 1, : len(text_only)]
    assert all(torch.equal(row, torch.arange(len(text_only))) for row in text_rows)

    # The aux states are the language model's layer outputs of the full model's forward.
    reference = target.model(
        input_ids=input_ids,
        attention_mask=mask,
        pixel_values=images["pixel_values"],
        image_grid_thw=grid,
        mm_token_type_ids=(input_ids == pad).int(),
        output_hidden_states=True,
    )
    hidden = reference.hidden_states
    expected = torch.cat([hidden[i + 1] for i in target.aux_layer_ids], dim=-1)
    torch.testing.assert_close(out.aux_BTA[mask], expected[mask])
    # the draft and the teacher read the language model's embedding and lm_head
    embedding = target.model.get_input_embeddings().weight
    assert target.input_embedding() is embedding
    assert target.lm_head_weight().shape == embedding.shape


def test_vlm_target_refuses_packed_rows_and_is_never_auto_packed(cache_dir: Path) -> None:
    """A text-only run on a VLM target (data.is_vlm=false) must not pack: the target's M-RoPE
    positions would run straight across the documents."""
    from eagleforge.builder import resolve_packing
    from eagleforge.config import compose_config, to_typed
    from eagleforge.errors import ConfigError

    model_dir = random_qwen2_5_vl_dir(RandomModelConfig(), cache_dir)
    target = HFTarget.from_pretrained(model_dir, TargetConfig(), torch.float32, torch.device("cpu"))
    assert "M-RoPE" in (target.packing_blocker() or "")
    text_run = ["+model=tiny_vl", "data=chitchat", "data.is_vlm=false", "output_dir=x"]
    assert not resolve_packing(to_typed(compose_config(text_run)), target)
    with pytest.raises(ConfigError, match="data.packing=true: a vision-language target"):
        resolve_packing(to_typed(compose_config([*text_run, "data.packing=true"])), target)
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ConfigError, match="data.packing"):
        target.forward(ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([[0, 0, 1, 1]]))


def test_other_mrope_layouts_are_refused(cache_dir: Path) -> None:
    """Another M-RoPE model type is refused, not trained with rotations unlike its target's."""
    from eagleforge.errors import ConfigError

    model_dir = random_qwen2_5_vl_dir(RandomModelConfig(), cache_dir)
    target = HFTarget.from_pretrained(model_dir, TargetConfig(), torch.float32, torch.device("cpu"))
    target.model.config.model_type = "qwen3_vl"  # as a Qwen3-VL config says
    with pytest.raises(ConfigError, match="'qwen3_vl' is not supported"):
        HFTarget(target.model)
