"""Vision-language data: image turns in every accepted form, rendering with the processor's
chat template, image tokens widened per image and never supervised, collation of batches with
varying image counts, the cache bypass, and one clear error per bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from eagleforge.config import compose_config, to_typed
from eagleforge.data.collate import Collator
from eagleforge.data.config import DataConfig
from eagleforge.data.conversations import DataFormat, read_conversations
from eagleforge.data.split import build_datasets
from eagleforge.errors import ConfigError, DataError
from eagleforge.targets.source import (
    ModelConfig,
    ModelSource,
    RandomModelConfig,
    VisionProcessor,
    load_processor,
    random_qwen2_5_vl_dir,
)

pytestmark = pytest.mark.unit

MIN_PIXELS, MAX_PIXELS = 3136, 12544  # 56 x 56 .. 112 x 112: 4 to 16 tokens per image


@pytest.fixture(scope="module")
def processor(cache_dir: Path) -> VisionProcessor:
    model_dir = random_qwen2_5_vl_dir(RandomModelConfig(), cache_dir)
    cfg = ModelConfig(name="tiny_vl", source=ModelSource.random_vl)
    return load_processor(cfg, model_dir, MIN_PIXELS, MAX_PIXELS)


def write_images(directory: Path) -> None:
    (directory / "img").mkdir(parents=True, exist_ok=True)
    for name, size in {"wide": (96, 48), "tall": (40, 80), "square": (56, 56)}.items():
        Image.new("RGB", size, (200, 30, 30)).save(directory / "img" / f"{name}.png")


def write_rows(path: Path, rows: list[Any]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


ROWS = [
    # per message
    {
        "messages": [
            {"role": "user", "content": "What is this?", "images": ["img/wide.png"]},
            {"role": "assistant", "content": "A wide red picture."},
        ]
    },
    # per row (LLaVA style), ShareGPT turns, two images
    {
        "conversations": [
            {"from": "human", "value": "Compare them."},
            {"from": "gpt", "value": "One is tall, one is square."},
        ],
        "images": ["img/tall.png", "img/square.png"],
    },
    # OpenAI content parts, and a text-only second exchange
    {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": "img/square.png"},
                    {"type": "text", "text": "Describe it."},
                ],
            },
            {"role": "assistant", "content": "A small square."},
            {"role": "user", "content": "Thanks."},
            {"role": "assistant", "content": "You are welcome."},
        ]
    },
    # no image at all
    {
        "messages": [
            {"role": "user", "content": "Just text."},
            {"role": "assistant", "content": "A text reply."},
        ]
    },
]


def vlm_config(path: str, **overrides: Any) -> DataConfig:
    fields = dict(
        name="vlm",
        path=path,
        is_vlm=True,
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        num_eval_samples=0,
        max_length=256,
    )
    fields.update(overrides)
    return DataConfig(**fields)  # type: ignore[arg-type]


def test_image_forms_resolve_relative_to_the_data_file(tmp_path: Path) -> None:
    write_images(tmp_path / "data")
    path = write_rows(tmp_path / "data" / "rows.jsonl", ROWS)
    conversations = [
        messages for _, messages in read_conversations(DataFormat.auto, path, images_allowed=True)
    ]
    img = (tmp_path / "data" / "img").resolve()
    assert conversations[0][0]["images"] == [str(img / "wide.png")]
    assert conversations[1][0]["images"] == [str(img / "tall.png"), str(img / "square.png")]
    assert conversations[2][0] == {
        "role": "user",
        "content": "Describe it.",
        "images": [str(img / "square.png")],
    }
    assert all("images" not in m for m in conversations[3])


def test_image_tokens_are_widened_and_never_supervised(
    tmp_path: Path, processor: VisionProcessor
) -> None:
    write_images(tmp_path)
    cfg = vlm_config(write_rows(tmp_path / "rows.jsonl", ROWS))
    data = build_datasets(cfg, processor.tokenizer, tmp_path / "cache", 0, processor)
    train = data.train
    assert train.images is not None and [len(i) for i in train.images] == [1, 2, 1, 0]
    image_id = processor.image_token_id
    vision_ids = set(processor.vision_token_ids())
    merge = processor.image_processor.merge_size
    for ids, mask, images in (train[i] for i in range(len(train))):
        expected = 0
        for path in images:
            grid = processor.image_processor(images=[Image.open(path)], return_tensors="pt")[
                "image_grid_thw"
            ]
            expected += int(grid.prod()) // merge**2
        assert sum(1 for t in ids if t == image_id) == expected
        assert not any(m for t, m in zip(ids, mask, strict=True) if t in vision_ids)
        supervised = processor.tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
        assert "<|image_pad|>" not in supervised and supervised.strip()
    replies = processor.tokenizer.decode([t for t, m in zip(*train[2][:2], strict=True) if m])
    assert replies == "A small square.<|im_end|>You are welcome.<|im_end|>"
    # the bypass: nothing written to the tokenized-data cache
    assert not (tmp_path / "cache" / "data").exists()


def test_large_and_exif_rotated_images_get_the_processors_token_count(
    tmp_path: Path, processor: VisionProcessor
) -> None:
    """A photo far above max_pixels is downscaled, and a JPEG stored sideways with an EXIF
    orientation is read upright (as transformers' load_image reads it): token counts and
    grids exactly as the image processor gives them for the upright images."""
    from PIL import ImageOps

    (tmp_path / "img").mkdir()
    Image.new("RGB", (3000, 2000), (20, 90, 160)).save(tmp_path / "img" / "big.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # stored 60 x 140, shown rotated: 140 x 60
    Image.new("RGB", (60, 140), (90, 20, 160)).save(tmp_path / "img" / "side.jpg", exif=exif)
    rows = [
        {"messages": [{"role": "user", "content": "Look.", "images": [f"img/{name}"]},
                      {"role": "assistant", "content": "Seen."}]}
        for name in ("big.png", "side.jpg")
    ]  # fmt: skip
    cfg = vlm_config(write_rows(tmp_path / "rows.jsonl", rows))
    train = build_datasets(cfg, processor.tokenizer, tmp_path / "cache", 0, processor).train
    collate = Collator(0, processor.image_processor, processor.image_token_id)
    grids = []
    for index, name in enumerate(("big.png", "side.jpg")):
        with Image.open(tmp_path / "img" / name) as image:
            upright = ImageOps.exif_transpose(image).convert("RGB")
        grid = processor.image_processor(images=[upright], return_tensors="pt")["image_grid_thw"]
        grids.append(grid[0].tolist())
        ids = train[index][0]
        assert sum(1 for t in ids if t == processor.image_token_id) == int(grid.prod()) // 4
        # the collator reads it upright too: the grid (and so the M-RoPE rows) agree
        assert collate([train[index]])["image_grid_thw"].tolist() == grid.tolist()
    assert grids[0][1] * grids[0][2] * 14 * 14 <= MAX_PIXELS  # downscaled
    assert grids[1][1] < grids[1][2]  # wider than tall once upright


def test_collator_batches_varying_image_counts(tmp_path: Path, processor: VisionProcessor) -> None:
    write_images(tmp_path)
    cfg = vlm_config(write_rows(tmp_path / "rows.jsonl", ROWS))
    train = build_datasets(cfg, processor.tokenizer, tmp_path / "cache", 0, processor).train
    collate = Collator(0, processor.image_processor, processor.image_token_id)
    batch = collate([train[1], train[3], train[0]])  # 2, 0 and 1 images
    grid = batch["image_grid_thw"]
    assert grid.shape == (3, 3) and int(grid.prod(-1).sum()) == batch["pixel_values"].shape[0]
    assert batch["input_ids"].shape == batch["loss_mask"].shape
    assert int((batch["input_ids"] == processor.image_token_id).sum()) == int(
        (grid.prod(-1) // 4).sum()
    )
    assert "pixel_values" not in collate([train[3]])  # a batch without images
    # an image that changed size since preprocessing is caught
    Image.new("RGB", (112, 112)).save(tmp_path / "img" / "wide.png")
    with pytest.raises(DataError, match=r"images \[.*wide.png'\] need \d+ image tokens"):
        collate([train[0]])


def test_missing_image_names_file_and_line(tmp_path: Path, processor: VisionProcessor) -> None:
    write_images(tmp_path)
    rows = [
        ROWS[3],
        {
            "messages": [
                {**ROWS[0]["messages"][0], "images": ["img/nope.png"]},
                ROWS[0]["messages"][1],
            ]
        },
    ]
    path = write_rows(tmp_path / "rows.jsonl", rows)
    with pytest.raises(DataError, match=r"rows.jsonl:2: image .*nope.png does not exist"):
        build_datasets(vlm_config(path), processor.tokenizer, tmp_path / "c", 0, processor)


def test_unreadable_image_names_file_and_line(tmp_path: Path, processor: VisionProcessor) -> None:
    write_images(tmp_path)
    (tmp_path / "img" / "broken.png").write_bytes(b"not an image at all")
    rows = [
        {
            "messages": [
                {**ROWS[0]["messages"][0], "images": ["img/broken.png"]},
                ROWS[0]["messages"][1],
            ]
        }
    ]
    path = write_rows(tmp_path / "rows.jsonl", rows)
    with pytest.raises(DataError, match=r"rows.jsonl:1: image .*broken.png cannot be read"):
        build_datasets(vlm_config(path), processor.tokenizer, tmp_path / "c", 0, processor)


def test_image_in_a_text_run_names_file_and_line(tmp_path: Path, smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    write_images(tmp_path)
    path = write_rows(tmp_path / "rows.jsonl", [ROWS[3], ROWS[1]])
    cfg = DataConfig(name="text", path=path, num_eval_samples=0)
    with pytest.raises(DataError, match=r"rows.jsonl:2: turn 0 has images but data.is_vlm=false"):
        build_datasets(cfg, smollm2_tokenizer, tmp_path / "c", 0)


def test_vlm_data_without_a_processor_is_refused(tmp_path: Path, smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    cfg = vlm_config(write_rows(tmp_path / "rows.jsonl", [ROWS[3]]))
    with pytest.raises(ConfigError, match="data.is_vlm=true"):
        build_datasets(cfg, smollm2_tokenizer, tmp_path / "c", 0)


def test_images_never_cut_by_truncation(tmp_path: Path, processor: VisionProcessor) -> None:
    write_images(tmp_path)
    path = write_rows(tmp_path / "rows.jsonl", [ROWS[0]])
    cfg = vlm_config(path, max_length=8)
    with pytest.raises(DataError, match="images end at token"):
        build_datasets(cfg, processor.tokenizer, tmp_path / "c", 0, processor)


BASE = ["+model=tiny_vl", "data=vlm", "data.path=/tmp/unused.jsonl", "output_dir=/tmp/unused"]


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("data.packing=true", "data.packing"),
        ("data.template=chatml", "data.template"),
        ("data.preformatted=true", "data.preformatted"),
        ("parallel.tp=2", "parallel.tp=2"),
        ("target=custom", "target.backend=custom"),
        ("data.min_pixels=0", "data.min_pixels"),
    ],
)
def test_unsupported_vlm_options_are_refused_at_compose_time(override: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        to_typed(compose_config([*BASE, override]))


def test_vlm_sequence_parallelism_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline VLM stores are fine, but sp would cut the 1-D positions only."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    offline = [*BASE, "data.features=/tmp/features"]
    to_typed(compose_config([*offline, "data.packing=true"]))  # packed offline rows: fine
    usp = ["parallel.sp_ulysses=2", "parallel.dp=1", "draft.attention=usp"]
    with pytest.raises(ConfigError, match=r"parallel\.sp_ulysses x sp_ring = 2"):
        to_typed(compose_config([*offline, *usp]))


def test_vlm_entries_compose() -> None:
    for model in ("qwen2_5_vl", "tiny_vl"):
        typed = to_typed(compose_config([f"+model={model}", "data=chitchat", "output_dir=/x"]))
        assert typed.data.is_vlm
    typed = to_typed(compose_config(BASE))
    assert (typed.data.min_pixels, typed.data.max_pixels) == (50176, 802816)
    assert not to_typed(
        compose_config(["+model=tiny", "data=chitchat", "output_dir=/x"])
    ).data.is_vlm


def test_collator_without_images_is_unchanged() -> None:
    batch = Collator(0)([([1, 2, 3], [0, 1, 1]), ([4], [1])])
    assert set(batch) == {"input_ids", "attention_mask", "loss_mask"}
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]
    assert torch.equal(batch["loss_mask"][1], torch.tensor([True, False, False]))
