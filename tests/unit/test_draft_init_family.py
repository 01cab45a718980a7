"""model.draft_init given the other family's draft (a DFlash draft to draft=eagle3, an EAGLE-3
draft to draft=dflash) is named as such, with the draft= that takes it, in one line: before the
target loads (preflight) and where the weights are read (families.init_from); a directory of
no draft at all is named by what it holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagleforge.config import compose_config, to_typed
from eagleforge.draft.config import DraftFamily
from eagleforge.draft.dflash import DFlashArchitecture, DFlashDraft
from eagleforge.errors import ConfigError
from eagleforge.families import init_from
from eagleforge.formats.dflash import write_dflash
from eagleforge.formats.directory import family_problem
from eagleforge.formats.eagle3 import export_sglang
from eagleforge.preflight import check_inputs
from helpers.drafts import tiny_draft

pytestmark = pytest.mark.unit


def tiny_dflash() -> DFlashDraft:
    arch = DFlashArchitecture(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=64, vocab_size=50, target_hidden_size=12,
        num_target_layers=6, aux_layer_ids=[1, 2, 3], block_size=4, mask_token_id=5,
    )  # fmt: skip
    return DFlashDraft(arch)


@pytest.fixture
def drafts(tmp_path: Path) -> dict[str, Path]:
    dflash = tiny_dflash()
    return {
        "eagle3": export_sglang(tiny_draft(), tmp_path / "eagle3"),
        "dflash": write_dflash(dflash.arch, dflash.state_dict(), tmp_path / "dflash"),
    }


def test_init_from_names_the_other_family(drafts: dict[str, Path]) -> None:
    with pytest.raises(ConfigError) as info:
        init_from(tiny_draft(), DraftFamily.eagle3, drafts["dflash"], 6)
    assert str(info.value) == (
        f"model.draft_init={drafts['dflash']}: a DFlash draft, this run trains draft=eagle3; "
        "use draft=dflash, or give an EAGLE-3 draft."
    )
    with pytest.raises(ConfigError) as info:
        init_from(tiny_dflash(), DraftFamily.dflash, drafts["eagle3"], 6)
    assert str(info.value) == (
        f"model.draft_init={drafts['eagle3']}: an EAGLE-3 draft, this run trains draft=dflash; "
        "use draft=eagle3, or give a DFlash draft."
    )
    init_from(tiny_draft(seed=3), DraftFamily.eagle3, drafts["eagle3"], 6)  # its own family loads


def test_preflight_names_the_other_family_before_the_target_loads(
    drafts: dict[str, Path],
) -> None:
    def typed(*overrides: str):  # type: ignore[no-untyped-def]
        return to_typed(
            compose_config(["+model=smollm2", "data=chitchat", "output_dir=.", *overrides])
        )

    with pytest.raises(
        ConfigError, match=r"a DFlash draft, this run trains draft=eagle3; use draft=dflash"
    ):
        check_inputs(typed(f"model.draft_init={drafts['dflash']}"))
    with pytest.raises(ConfigError, match=r"an EAGLE-3 draft, this run trains draft=dflash"):
        check_inputs(typed("draft=dflash", f"model.draft_init={drafts['eagle3']}"))
    check_inputs(typed("draft=dflash", f"model.draft_init={drafts['dflash']}"))


def test_a_directory_of_no_draft_is_refused_naming_what_it_holds(tmp_path: Path) -> None:
    """A target model's directory given as model.draft_init: one line naming its config.json
    and the drafts eagleforge reads, before the target loads and where the weights are read
    (it was once read as an EAGLE-3 draft and reported field by field)."""
    plain = tmp_path / "SmolLM2"
    plain.mkdir()
    (plain / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    )
    save_file({"model.norm.weight": torch.ones(16)}, str(plain / "model.safetensors"))
    reason = family_problem(plain, DraftFamily.eagle3)
    assert reason is not None and reason.startswith(
        "not a draft eagleforge reads: config.json with architectures ['LlamaForCausalLM'], "
        "model_type 'llama'; eagleforge reads EAGLE-3 (architectures LlamaForCausalLMEagle3"
    )
    assert family_problem(plain, DraftFamily.dflash) == reason
    with pytest.raises(ConfigError) as info:
        init_from(tiny_draft(), DraftFamily.eagle3, plain, 6)
    assert str(info.value) == f"model.draft_init={plain}: {reason}."
    config = to_typed(
        compose_config(["+model=smollm2", "data=chitchat", "output_dir=.",
                        f"model.draft_init={plain}"])
    )  # fmt: skip
    with pytest.raises(ConfigError) as info:
        check_inputs(config)
    assert str(info.value) == f"model.draft_init={plain}: {reason}."
