"""Collators: a list of samples into one batch of tensors, padded (``Collator``) or packed
into one row (``PackedCollator``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from eagleforge.errors import DataError


@dataclass
class Collator:
    """Right-pads a list of samples into tensors: input_ids, attention_mask, loss_mask [B, T];
    samples from a feature store also carry aux [T, A] and final [T, H] hidden states, padded
    with zeros into aux_hidden [B, T, A] and final_hidden [B, T, H], and a vision-language
    store's M-RoPE positions [3, T] into mrope_position_ids [3, B, T].

    Vision-language samples (ids, mask, image paths) also give the images of the whole batch,
    in sample order, through ``image_processor``: pixel_values [patches, C*t*p*p] and
    image_grid_thw [images, 3] (absent when the batch has no image)."""

    pad_token_id: int
    image_processor: Any = None  # the target's, with data.min_pixels / max_pixels
    image_token_id: int | None = None

    def __call__(self, samples: list[tuple[Any, ...]]) -> dict[str, torch.Tensor]:
        length = max(len(sample[0]) for sample in samples)
        input_ids = torch.full((len(samples), length), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(samples), length), dtype=torch.bool)
        loss_mask = torch.zeros((len(samples), length), dtype=torch.bool)
        for row, (ids, mask, *_) in enumerate(samples):
            input_ids[row, : len(ids)] = torch.as_tensor(ids)
            attention[row, : len(ids)] = True
            loss_mask[row, : len(mask)] = torch.as_tensor(mask, dtype=torch.bool)
        batch = {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask}
        if len(samples[0]) == 3:
            batch.update(self._images([path for sample in samples for path in sample[2]]))
            self._check_image_tokens(batch, [sample[2] for sample in samples])
        if len(samples[0]) >= 4:
            for key, position in (("aux_hidden", 2), ("final_hidden", 3)):
                first = samples[0][position]
                out = first.new_zeros(len(samples), length, first.shape[-1])
                for row, sample in enumerate(samples):
                    out[row, : len(sample[position])] = sample[position]
                batch[key] = out
        if len(samples[0]) == 5:  # stored M-RoPE positions [3, T]; zeros at padding
            positions_3BT = torch.zeros(3, len(samples), length, dtype=torch.long)
            for row, sample in enumerate(samples):
                positions_3BT[:, row, : sample[4].shape[1]] = sample[4]
            batch["mrope_position_ids"] = positions_3BT
        return batch

    def _images(self, paths: list[str]) -> dict[str, torch.Tensor]:
        if not paths:
            return {}
        if self.image_processor is None or self.image_token_id is None:
            raise ValueError(
                "vision-language samples need Collator(image_processor=..., image_token_id=...)"
            )
        from PIL import Image, ImageOps

        images = []
        for path in paths:
            try:
                with Image.open(path) as image:
                    # upright, as transformers' load_image (and serving) reads it
                    images.append(ImageOps.exif_transpose(image).convert("RGB"))
            except OSError as e:
                raise DataError(
                    f"image {path} cannot be read ({e}); it was readable when the data was "
                    "preprocessed: restore the file."
                ) from None
        out = self.image_processor(images=images, return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    def _check_image_tokens(self, batch: dict[str, torch.Tensor], paths: list[list[str]]) -> None:
        """Each sample's images still need the image tokens written at preprocessing."""
        grid = batch.get("image_grid_thw")
        merged = int(getattr(self.image_processor, "merge_size", 1)) ** 2
        tokens = [] if grid is None else (grid.prod(-1) // merged).tolist()
        image_id = -1 if self.image_token_id is None else self.image_token_id
        found = batch["input_ids"].eq(image_id).sum(-1).tolist()
        start = 0
        for row, sample_paths in enumerate(paths):
            expected = sum(tokens[start : start + len(sample_paths)])
            start += len(sample_paths)
            if expected != found[row]:
                raise DataError(
                    f"images {sample_paths} need {expected} image tokens but their preprocessed "
                    f"sample holds {found[row]}: a file changed since preprocessing; rerun it."
                )


@dataclass
class PackedCollator:
    """Concatenates samples into one row [1, L] with document_ids and per-document
    position_ids (and the feature store's hidden states, when samples carry them)."""

    def __call__(self, samples: list[tuple[Any, ...]]) -> dict[str, torch.Tensor]:
        ids = [torch.as_tensor(sample[0]) for sample in samples]
        batch = {
            "input_ids": torch.cat(ids).unsqueeze(0),
            "attention_mask": torch.ones(1, sum(len(i) for i in ids), dtype=torch.bool),
            "loss_mask": torch.cat(
                [torch.as_tensor(sample[1], dtype=torch.bool) for sample in samples]
            ).unsqueeze(0),
            "document_ids": torch.cat(
                [torch.full((len(i),), n) for n, i in enumerate(ids)]
            ).unsqueeze(0),
            "position_ids": torch.cat([torch.arange(len(i)) for i in ids]).unsqueeze(0),
        }
        if len(samples[0]) >= 4:
            batch["aux_hidden"] = torch.cat([sample[2] for sample in samples]).unsqueeze(0)
            batch["final_hidden"] = torch.cat([sample[3] for sample in samples]).unsqueeze(0)
        if len(samples[0]) == 5:  # each document's own M-RoPE positions, back to back
            batch["mrope_position_ids"] = torch.cat([s[4] for s in samples], 1).unsqueeze(1)
        return batch
