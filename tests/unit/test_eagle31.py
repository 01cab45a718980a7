"""EAGLE-3.1 drafts (fc_norm, norm_before_fc, norm_output, norm_before_residual): the config's
rules, their tensors and switches in every export format, what `export --check` says about
them, and older drafts reading as EAGLE-3. (Their numerics: test_ttt_alignment's loop
reference and test_draft_inference's cached chain, run for every variant.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagleforge.draft.config import DraftConfig
from eagleforge.draft.model import Eagle3Draft
from eagleforge.errors import ConfigError
from eagleforge.formats.directory import check_draft, read_draft, write_draft
from eagleforge.formats.kinds import DraftFormat
from helpers.drafts import EAGLE31_VARIANTS, tiny_arch, tiny_draft

pytestmark = pytest.mark.unit
SWITCHES = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def test_the_two_norms_of_fc_input_exclude_each_other() -> None:
    with pytest.raises(ConfigError, match=r"draft.fc_norm and draft.norm_before_fc"):
        DraftConfig(fc_norm=True, norm_before_fc=True)


def test_norms_start_at_one_and_have_the_engines_names() -> None:
    draft = Eagle3Draft(tiny_arch(fc_norm=True))
    draft.init_weights(0.3, torch.Generator().manual_seed(0))
    names = draft.trainable_state_dict().keys()
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= names and "input_norm.weight" not in names
    assert all(bool((n.weight == 1).all()) for n in draft.fc_norm or [])
    wide = Eagle3Draft(tiny_arch(norm_before_fc=True))
    assert tuple(wide.trainable_state_dict()["input_norm.weight"].shape) == (3 * 12,)
    assert not any("fc_norm" in k for k in wide.trainable_state_dict())


@pytest.mark.parametrize("fmt", [f for f in DraftFormat if f.is_directory])
@pytest.mark.parametrize("variant", list(EAGLE31_VARIANTS))
def test_every_format_states_the_switches_and_reads_back(
    tmp_path: Path, fmt: DraftFormat, variant: str
) -> None:
    draft = tiny_draft(seed=2, **EAGLE31_VARIANTS[variant])
    out = write_draft(draft.arch, draft.state_dict(), tmp_path, fmt)
    config = json.loads((out / "config.json").read_text())
    # top level, where vLLM's and SGLang's llama_eagle3 (and vLLM's speculators reader) look
    assert {k: config[k] for k in SWITCHES} == {
        k: EAGLE31_VARIANTS[variant].get(k, False) for k in SWITCHES
    }
    read_fmt, arch, tensors = read_draft(out)
    assert read_fmt == fmt and arch == draft.arch
    own = draft.trainable_state_dict()
    assert tensors.keys() == own.keys()
    assert all(torch.equal(tensors[k], own[k]) for k in own)
    assert check_draft(out, target_num_layers=5) == []


def test_an_older_draft_is_eagle3_and_a_speculators_one_says_its_residual(tmp_path: Path) -> None:
    draft = tiny_draft(seed=1)
    for fmt in (f for f in DraftFormat if f.is_directory):
        out = write_draft(draft.arch, draft.state_dict(), tmp_path / fmt.value, fmt)
        config = json.loads((out / "config.json").read_text())
        for key in SWITCHES:
            del config[key]
        (out / "config.json").write_text(json.dumps(config))
        _, arch, _ = read_draft(out)
        # vLLM's speculators reader takes an unstated norm_before_residual as true
        assert arch.norm_before_residual == (fmt == DraftFormat.speculators)
        assert not (arch.fc_norm or arch.norm_before_fc or arch.norm_output)


def _write_then(tmp_path: Path, variant: str, edit_config=None, edit_tensors=None) -> Path:  # type: ignore[no-untyped-def]
    draft = tiny_draft(seed=3, **EAGLE31_VARIANTS[variant])
    out = write_draft(draft.arch, draft.state_dict(), tmp_path, DraftFormat.vllm)
    if edit_config is not None:
        config = json.loads((out / "config.json").read_text())
        edit_config(config)
        (out / "config.json").write_text(json.dumps(config))
    if edit_tensors is not None:
        tensors = load_file(str(out / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize(
    ("variant", "edit_config", "edit_tensors", "message"),
    [
        ("fc_norm", lambda c: c.update(norm_before_fc=True), None, "both true"),
        ("fc_norm", None, lambda t: t.pop("fc_norm.1.weight"), "no fc_norm.1.weight"),
        ("fc_norm", lambda c: c.update(fc_norm=False), None, "engines drop it"),
        ("norm_before_fc", lambda c: c.update(norm_before_fc=False), None, "engines drop it"),
        (
            "norm_before_fc",
            None,
            lambda t: t.update({"input_norm.weight": torch.ones(12)}),
            r"expected \(36,\)",
        ),
    ],
)
def test_check_names_a_switch_without_its_norm_and_a_norm_without_its_switch(  # type: ignore[no-untyped-def]
    tmp_path: Path, variant: str, edit_config, edit_tensors, message: str
) -> None:
    problems = check_draft(_write_then(tmp_path, variant, edit_config, edit_tensors))
    assert any(re.search(message, p) for p in problems), problems
