"""Edits of a target's weights on disk, as a user's tool would make them, and the bytes the
sampled fingerprint of eagleforge before the whole-file one read.

``scale_tensor(path, name, factor)`` multiplies one tensor of a safetensors file in place: the
header, the size and every other byte stay as they were. ``sampled_spans(path)`` are the byte
ranges the sampled fingerprint read (its header and 16 blocks of 64 KiB), so a test can show
that its edit lies outside them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from eagleforge.config import compose_config, to_typed
from eagleforge.targets.source import resolve_model_dir

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def tensor_span(path: Path, name: str) -> tuple[int, int, torch.dtype]:
    """The byte range [start, end) of tensor ``name``'s data in the safetensors file, and its
    dtype."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    begin, end = header[name]["data_offsets"]
    return 8 + header_len + begin, 8 + header_len + end, _DTYPES[header[name]["dtype"]]


def scale_tensor(path: Path, name: str, factor: float) -> None:
    """Multiply tensor ``name`` of the safetensors file by ``factor``, in place."""
    start, end, dtype = tensor_span(path, name)
    with open(path, "r+b") as f:
        f.seek(start)
        values = torch.frombuffer(bytearray(f.read(end - start)), dtype=dtype)
        f.seek(start)
        f.write((values * factor).to(dtype).view(torch.uint8).numpy().tobytes())


def sampled_spans(path: Path) -> list[tuple[int, int]]:
    """The byte ranges the sampled fingerprint read: the header, and 16 blocks of 64 KiB at
    every sixteenth of the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
    blocks = [(size * i // 16, size * i // 16 + (1 << 16)) for i in range(16)]
    return [(0, 8 + header_len), *blocks]


def overlaps(span: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    return any(start < span[1] and span[0] < end for start, end in spans)


def tiny_target_copy(destination: Path) -> Path:
    """A copy of the tiny random target (``+model=tiny``) at ``destination``, to edit: the
    cached one is shared by every test."""
    config = to_typed(compose_config(["+model=tiny", f"output_dir={destination}.run"]))
    shutil.copytree(resolve_model_dir(config.model, config.resolved_cache_dir()), destination)
    return destination
