"""P-EAGLE's pieces without a target: its depth weights and normalisation, its directory (the
mask token in config.json, mask_hidden among the weights, read back as written, checked, and
refused where vLLM would refuse it), and the family seam it came in through."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagleforge.draft.config import DraftFamily
from eagleforge.draft.peagle import PEagleConfig, PEagleDraft, depth_loss_scales, depth_weights
from eagleforge.errors import ConfigError
from eagleforge.families import FAMILIES, family_for, family_of
from eagleforge.formats.directory import check_draft, family_problem, read_draft, write_draft
from eagleforge.formats.kinds import DraftFormat
from helpers.drafts import tiny_arch, tiny_draft

pytestmark = pytest.mark.unit

SRC = Path(__file__).resolve().parents[2] / "src" / "eagleforge"


def tiny_peagle(seed: int = 0) -> PEagleDraft:
    arch = tiny_arch()
    arch.mask_token_id = 7
    draft = PEagleDraft(arch)
    draft.init_weights(0.3, torch.Generator().manual_seed(seed))
    draft.load_state_dict(tiny_draft(seed).state_dict(), strict=False)  # vocab map, embedding
    return draft


def test_depth_weights_are_the_published_sampling_rates_as_one_mean() -> None:
    weights = depth_weights(PEagleConfig(num_depths=6))
    torch.testing.assert_close(weights, torch.tensor([1.0, 0.7, 0.49, 0.343, 0.2401, 0.2]))
    counts = torch.tensor([10, 8, 6, 4, 2, 1])
    scales = depth_loss_scales(counts, weights)
    # Σ_d scale_d N_d = 1: the loss is a weighted mean over every supervised element
    assert float((scales * counts).sum()) == pytest.approx(1.0)
    with pytest.raises(ConfigError, match="draft.peagle.num_depths must be >= 1"):
        PEagleConfig(num_depths=0)


@pytest.mark.parametrize("fmt", [DraftFormat.sglang, DraftFormat.vllm])
def test_the_directory_names_its_mask_token_and_reads_back(
    tmp_path: Path, fmt: DraftFormat
) -> None:
    draft = tiny_peagle()
    out = write_draft(draft.arch, draft.trainable_state_dict(), tmp_path / "d", fmt)
    config = json.loads((out / "config.json").read_text())
    assert config["mask_token_id"] == 7  # where vLLM reads the placeholder token
    read_fmt, arch, tensors = read_draft(out)
    assert read_fmt == fmt and arch == draft.arch
    torch.testing.assert_close(tensors["mask_hidden"], draft.mask_hidden.detach())
    assert check_draft(out, 6) == []
    assert family_of(arch) is family_for(DraftFamily.peagle)
    assert family_problem(out, DraftFamily.eagle3) == (
        "a P-EAGLE draft, this run trains draft=eagle3; use draft=peagle, or give an EAGLE-3 draft"
    )


def test_a_directory_vllm_would_refuse_is_named(tmp_path: Path) -> None:
    draft = tiny_peagle()
    out = write_draft(draft.arch, draft.trainable_state_dict(), tmp_path / "d", DraftFormat.vllm)
    tensors = load_file(str(out / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "mask_hidden"}, out / "model.safetensors")
    assert check_draft(out, 6) == [
        "mask_token_id is set (parallel drafting) but there is no mask_hidden"
    ]
    plain = tiny_draft()
    sequential = write_draft(plain.arch, plain.trainable_state_dict(), tmp_path / "s",
                             DraftFormat.vllm)  # fmt: skip
    save_file({**load_file(str(sequential / "model.safetensors")), "mask_hidden": tensors["mask_hidden"]},
              sequential / "model.safetensors")  # fmt: skip
    assert check_draft(sequential, 6) == [
        "mask_hidden is in the weights but config.json has no mask_token_id"
    ]
    with pytest.raises(ConfigError, match="speculators format does not serve P-EAGLE drafts"):
        write_draft(draft.arch, draft.trainable_state_dict(), tmp_path / "x",
                    DraftFormat.speculators)  # fmt: skip


def test_vllm_serves_it_as_eagle3_with_parallel_drafting() -> None:
    family = family_for(DraftFamily.peagle)
    assert family.vllm_method(tiny_peagle().arch, 5) == {
        "method": "eagle3",
        "num_speculative_tokens": 5,
        "parallel_drafting": True,
    }
    assert '"parallel_drafting": true' in family.serve_hint(Path("d"), DraftFormat.vllm, None)


def test_every_family_is_in_the_registry_and_nothing_above_names_one() -> None:
    """The seam holds: a family is named only by its own modules (draft/, families/, its
    decoder), the registry and formats' own dispatch -- never by the builder, the entry
    points, the trainer or the judge."""
    assert set(FAMILIES) == set(DraftFamily)
    allowed = ("draft/", "families/", "formats/", "speculative/block_decoder.py",
               "speculative/parallel_decoder.py")  # fmt: skip
    pattern = re.compile(r"DraftFamily\.\w+|isinstance\([^)]*(DFlash|Eagle3|PEagle)\w*\)|is_dflash")
    found = [
        f"{path.relative_to(SRC)}:{n}"
        for path in SRC.rglob("*.py")
        if not str(path.relative_to(SRC)).startswith(allowed)
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []
