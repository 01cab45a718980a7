"""The draft-directory validator names every way a draft from any tool can be broken."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagleforge.errors import CheckpointError, ConfigError
from eagleforge.formats.directory import (
    LAYOUTS,
    check_draft,
    load_checked_draft,
    read_architecture,
    read_draft,
)
from eagleforge.formats.eagle3 import export_sglang
from helpers.drafts import tiny_draft

pytestmark = pytest.mark.unit


def _draft_dir(tmp_path: Path) -> Path:
    return export_sglang(tiny_draft(seed=1), tmp_path / "draft")


def _edit_config(path: Path, change: Callable[[dict], None]) -> None:  # type: ignore[type-arg]
    config = json.loads((path / "config.json").read_text())
    change(config)
    (path / "config.json").write_text(json.dumps(config))


def _edit_tensors(path: Path, change: Callable[[dict], None]) -> None:  # type: ignore[type-arg]
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_an_exported_draft_has_no_problems(tmp_path: Path) -> None:
    assert check_draft(_draft_dir(tmp_path), target_num_layers=4) == []


def test_a_checkpoint_names_its_layers_for_both_engines(tmp_path: Path) -> None:
    """SGLang reads eagle_config's output-of-layer ids; vLLM reads the top-level ones first,
    as inputs of layers: the same layers, one higher."""
    config = json.loads((_draft_dir(tmp_path) / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]


@pytest.mark.parametrize(
    ("break_it", "message"),
    [
        (lambda p: _edit_tensors(p, lambda t: t.pop("lm_head.weight")), "no lm_head.weight"),
        (lambda p: _edit_tensors(p, lambda t: t.pop("d2t")), "no d2t/t2d vocab map"),
        (
            lambda p: _edit_tensors(p, lambda t: t.__setitem__("d2t", torch.zeros_like(t["d2t"]))),
            "d2t and t2d disagree",
        ),
        (
            lambda p: _edit_config(
                p, lambda c: c.__setitem__("architectures", ["LlamaForCausalLM"])
            ),
            "architectures is ['LlamaForCausalLM']",
        ),
        (
            lambda p: _edit_config(p, lambda c: c.__setitem__("tie_word_embeddings", True)),
            "tie_word_embeddings is true",
        ),
        (
            lambda p: _edit_config(
                p,
                lambda c: c["eagle_config"].__setitem__(
                    "eagle_aux_hidden_state_layer_ids", [1, 2, 9]
                ),
            ),
            "aux layer ids [1, 2, 9] (sglang numbering) are outside the target's 0..3",
        ),
        (
            lambda p: _edit_tensors(p, lambda t: t.__setitem__("fc.weight", t["fc.weight"].half())),
            "weights mix dtypes",
        ),
        (lambda p: (p / "model.safetensors").unlink(), "no model.safetensors"),
        (
            # what vLLM reads first must name eagle_config's layers in its own numbering
            lambda p: _edit_config(
                p, lambda c: c.__setitem__("eagle_aux_hidden_state_layer_ids", [1, 2, 3])
            ),
            "vLLM would tap other layers than SGLang; expected [2, 3, 4]",
        ),
    ],
)
def test_each_problem_is_named(tmp_path: Path, break_it, message: str) -> None:  # type: ignore[no-untyped-def]
    path = _draft_dir(tmp_path)
    break_it(path)
    problems = check_draft(path, target_num_layers=4)
    assert any(message in p for p in problems), problems


@pytest.mark.parametrize(
    "header", [struct.pack("<Q", 10**12) + b"{}", struct.pack("<Q", 40) + b'{"w": {"dtype"']
)
def test_a_damaged_draft_from_another_tool_is_one_problem(tmp_path: Path, header: bytes) -> None:
    """No checksums.json (another trainer's draft): safetensors' own error on a header with an
    absurd length or a torn JSON becomes one line naming the file, in export --check,
    evaluate's loader and read_draft."""
    export_sglang(tiny_draft(), tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(header)
    (problem,) = check_draft(tmp_path)
    assert problem.startswith(f"{weights}: unreadable (not a safetensors file: its header")
    with pytest.raises(ConfigError) as refused:
        load_checked_draft(tmp_path, 6)
    assert "\n" not in str(refused.value) and "SafetensorError" not in str(refused.value)
    with pytest.raises(CheckpointError, match="model.safetensors: unreadable"):
        read_draft(tmp_path)


def test_a_path_that_is_no_directory_is_named_as_such(tmp_path: Path) -> None:
    """export --check, export and evaluate's loader on a mistyped path: "no such directory",
    not a missing config.json; a file given for a draft: "not a directory"."""
    missing, file = tmp_path / "nope", tmp_path / "draft.safetensors"
    file.write_bytes(b"")
    assert check_draft(missing) == [f"{missing}: no such directory"]
    (problem,) = check_draft(file)
    assert problem.startswith(f"{file}: not a directory (a draft is a directory with config.json")
    with pytest.raises(ConfigError, match=r"nope: no such directory\.$"):
        load_checked_draft(missing, 6)


# config.json of what is no draft eagleforge reads -> how the refusal names it
NOT_DRAFTS = {
    "a target model": (
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16},
        "config.json with architectures ['LlamaForCausalLM'], model_type 'llama'",
    ),
    "a made-up architecture": (
        {"architectures": ["MedusaHeadForCausalLM"], "model_type": "medusa"},
        "config.json with architectures ['MedusaHeadForCausalLM'], model_type 'medusa'",
    ),
    "a speculators type not written here": (
        {"architectures": ["Eagle3Speculator"], "speculators_model_type": "peagle"},
        "config.json with architectures ['Eagle3Speculator'], model_type None, "
        "speculators_model_type 'peagle'",
    ),
    "no config.json": (None, "no config.json and no .gguf file"),
}


@pytest.mark.parametrize(("config", "named"), NOT_DRAFTS.values(), ids=list(NOT_DRAFTS))
def test_a_directory_no_layout_recognises_is_refused_in_one_line(
    tmp_path: Path,
    config: dict | None,  # type: ignore[type-arg]
    named: str,
) -> None:
    """Not read as an EAGLE-3 draft for want of another: read, check and load each name what
    the directory holds and what eagleforge reads, in one line."""
    path = tmp_path / "model"
    path.mkdir()
    save_file({"model.norm.weight": torch.ones(16)}, str(path / "model.safetensors"))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    refusal = f"{path}: not a draft eagleforge reads: {named}; eagleforge reads "
    (problem,) = check_draft(path, target_num_layers=4)
    assert problem.startswith(refusal) and "\n" not in problem
    assert all(layout.signature in problem for layout in LAYOUTS)
    for read in (read_draft, read_architecture):
        with pytest.raises(CheckpointError) as refused:
            read(path)
        assert str(refused.value) == problem
    with pytest.raises(ConfigError) as refused:
        load_checked_draft(path, 6)
    assert str(refused.value) == f"{problem}."


def test_a_directory_two_layouts_would_read_is_refused_not_guessed(tmp_path: Path) -> None:
    path = _draft_dir(tmp_path)
    _edit_config(path, lambda c: c.__setitem__("dflash_config", {"block_size": 4}))
    (problem,) = check_draft(path)
    assert problem.startswith(f"{path}: config.json with architectures ['LlamaForCausalLMEagle3']")
    assert "reads as EAGLE-3 (" in problem and "and as DFlash (" in problem


def test_a_draft_whose_config_lacks_a_field_reads_as_one_line(tmp_path: Path) -> None:
    """evaluate reads a draft's taps before checking it: a missing field is named, not a
    KeyError's traceback."""
    path = _draft_dir(tmp_path)
    _edit_config(path, lambda c: c.pop("intermediate_size"))
    for read in (read_draft, read_architecture):
        with pytest.raises(CheckpointError) as refused:
            read(path)
        assert str(refused.value) == (
            f"{path}: config.json of an EAGLE-3 draft that does not read (no "
            f"'intermediate_size'); python -m eagleforge.export --check {path} lists its problems"
        )
    assert check_draft(path) == ["config.json has no integer 'intermediate_size'"]
