"""eagleforge's GGUF export against llama.cpp's own converter: a draft for the bundled SmolLM2
exported for vLLM and converted by llama.cpp's ``convert_hf_to_gguf.py`` (with the target's
directory for the tokenizer, as llama.cpp asks), and the same draft exported with
``export.format=gguf``, hold the same tensors -- name, type, shape and bytes -- and the same
metadata but for the name, the size label, the target GGUF's own tokenizer flags and
eagleforge's own keys. For an EAGLE-3 draft with ``norm_before_fc`` and for a DFlash draft."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig

from eagleforge.draft.config import DraftConfig
from eagleforge.draft.dflash import DFlashArchitecture, DFlashConfig, DFlashDraft
from eagleforge.draft.model import DraftArchitecture, Eagle3Draft
from eagleforge.export import export
from eagleforge.formats.config import ExportConfig
from eagleforge.formats.dflash import write_dflash
from eagleforge.formats.eagle3 import export_sglang
from eagleforge.formats.gguf import GGUF_FILE
from eagleforge.formats.kinds import DraftFormat
from eagleforge.targets.source import bundled_smollm2_gguf

pytestmark = pytest.mark.engine

# where the two files may differ: what names the file, what the target's GGUF says of its own
# tokenizer (the converter rebuilds it from tokenizer.json), and eagleforge's own keys
MAY_DIFFER = {
    "GGUF.kv_count",
    "general.name",
    "general.size_label",
    "tokenizer.ggml.add_space_prefix",
}


def _converted(source: Path, draft: Path, target_dir: Path, out: Path) -> Path:
    """``draft`` (a vLLM-layout directory) as llama.cpp's converter writes it, in fp32."""
    done = subprocess.run(
        [sys.executable, str(source / "convert_hf_to_gguf.py"), str(draft),
         "--target-model-dir", str(target_dir), "--outfile", str(out), "--outtype", "f32"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _ours(draft: Path, out: Path) -> Path:
    exported = export(
        ExportConfig(
            draft=str(draft),
            format=DraftFormat.gguf,
            output_dir=str(out),
            target_gguf=str(bundled_smollm2_gguf()),
        )
    )
    return exported / GGUF_FILE


def _differences(ours: Path, theirs: Path) -> list[str]:
    a, b = gguf.GGUFReader(str(ours)), gguf.GGUFReader(str(theirs))
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    found = [f"tensor {name}: only in one" for name in sorted(set(ta) ^ set(tb))]
    for name in sorted(set(ta) & set(tb)):
        x, y = ta[name], tb[name]
        if (x.tensor_type, list(x.shape)) != (y.tensor_type, list(y.shape)):
            found.append(f"tensor {name}: {x.tensor_type.name} {list(x.shape)} vs "
                         f"{y.tensor_type.name} {list(y.shape)}")  # fmt: skip
        elif not np.array_equal(np.asarray(x.data), np.asarray(y.data)):
            found.append(f"tensor {name}: other values")
    fa: dict[str, Any] = {n: f.contents() for n, f in a.fields.items()}
    fb: dict[str, Any] = {n: f.contents() for n, f in b.fields.items()}
    for key in sorted(set(fa) | set(fb)):
        if key in MAY_DIFFER or key.startswith("eagleforge."):
            continue
        if fa.get(key) != fb.get(key):
            found.append(f"field {key}: {str(fa.get(key))[:60]} vs {str(fb.get(key))[:60]}")
    return found


def _random_norms(draft: torch.nn.Module) -> None:
    """Norm gains away from ones, so that a misplaced norm shows."""
    with torch.no_grad():
        for param in draft.parameters():
            if param.dim() == 1:
                param.uniform_(0.5, 1.5)


def test_an_eagle3_gguf_is_what_llama_cpps_converter_writes(
    llamacpp_source: Path, smollm2_dir: Path, tmp_path: Path
) -> None:
    config = AutoConfig.from_pretrained(smollm2_dir)
    arch = DraftArchitecture.from_target(
        config, DraftConfig(draft_vocab_size=4096, norm_before_fc=True), [1, 14, 26]
    )
    draft = Eagle3Draft(arch)
    draft.init_weights(0.02, torch.Generator().manual_seed(0))
    _random_norms(draft)
    kept = torch.randperm(arch.vocab_size)[:4096].sort().values
    t2d = torch.zeros(arch.vocab_size, dtype=torch.bool)
    t2d[kept] = True
    draft.set_vocab_map(kept - torch.arange(4096), t2d)
    checkpoint = export_sglang(draft, tmp_path / "step_00000000")
    vllm = export(ExportConfig(draft=str(checkpoint), format=DraftFormat.vllm,
                               output_dir=str(tmp_path / "vllm")))  # fmt: skip
    theirs = _converted(llamacpp_source, vllm, smollm2_dir, tmp_path / "theirs.gguf")
    assert _differences(_ours(checkpoint, tmp_path / "ours"), theirs) == []
    names = {t.name for t in gguf.GGUFReader(str(theirs)).tensors}
    assert "enc.output_norm.weight" in names  # norm_before_fc, compared


def test_a_dflash_gguf_is_what_llama_cpps_converter_writes(
    llamacpp_source: Path, smollm2_dir: Path, tmp_path: Path
) -> None:
    config = AutoConfig.from_pretrained(smollm2_dir)
    arch = DFlashArchitecture.from_target(
        config, DFlashConfig(num_layers=2, block_size=8), [1, 14, 26], mask_token_id=16
    )
    draft = DFlashDraft(arch)
    draft.init_weights(0.02, torch.Generator().manual_seed(0))
    _random_norms(draft)
    vllm = write_dflash(arch, draft.state_dict(), tmp_path / "vllm")
    theirs = _converted(llamacpp_source, vllm, smollm2_dir, tmp_path / "theirs.gguf")
    assert _differences(_ours(vllm, tmp_path / "ours"), theirs) == []
    fields = gguf.GGUFReader(str(theirs)).fields
    assert fields["dflash.target_layers"].contents() == [2, 15, 27]  # both: the input of a layer
