"""Every file under conf/ composes into typed dataclasses, and bad configs fail with one clear error."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from eagleforge.config import (
    EagleForgeConfig,
    check_batch_shape,
    check_cli_overrides,
    compose_config,
    conf_dir,
    group_choices,
    to_typed,
)
from eagleforge.data.config import DataConfig
from eagleforge.data.split import build_datasets
from eagleforge.draft.config import DraftConfig, DraftFamily
from eagleforge.draft.dflash import DFlashConfig
from eagleforge.draft.model import DraftArchitecture
from eagleforge.errors import ConfigError
from eagleforge.families import family_for
from eagleforge.targets.source import checked_aux_layer_ids, default_aux_layer_ids
from eagleforge.trainer import TrainerConfig

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
BASE = ["+model=tiny", "data=chitchat", "output_dir=/tmp/unused"]
GROUPS = ["model", "data", "target", "parallel", "optimizer", "tracker", "loss", "experiment"]


def _overrides_for(group: str, choice: str) -> list[str]:
    """BASE with one group switched to ``choice`` (and a data file for file-based data configs)."""
    picks = {"model": "+model=tiny", "data": "data=chitchat"}
    picks[group] = f"+{group}={choice}" if group in ("model", "experiment") else f"{group}={choice}"
    extra = (
        [f"data.path={FIXTURES / 'sharegpt_small.jsonl'}"]
        if group == "data" and choice != "chitchat"
        else []
    )
    if (group, choice) == ("parallel", "usp"):  # sequence parallelism trains offline
        extra.append("data.features=/tmp/unused-features")
    return [*picks.values(), *extra, "output_dir=/tmp/unused"]


@pytest.mark.parametrize(
    ("group", "choice"), [(g, c) for g in GROUPS for c in group_choices(g)], ids=lambda x: str(x)
)
def test_every_conf_file_composes_and_types(group: str, choice: str) -> None:
    typed = to_typed(compose_config(_overrides_for(group, choice)))
    assert isinstance(typed, EagleForgeConfig)
    if group == "model":
        assert typed.model.name == choice


def test_conf_tree_has_every_group() -> None:
    for group in GROUPS:
        assert group_choices(group), f"conf/{group}/ is empty"
    assert {"tiny", "smollm2", "llama3", "qwen3"} <= set(group_choices("model"))
    assert {"chitchat", "sharegpt", "jsonl"} <= set(group_choices("data"))
    assert (conf_dir() / "config.yaml").is_file()


@pytest.mark.parametrize("data", ["sharegpt", "jsonl"])
def test_data_files_build_datasets(data: str, smollm2_tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fixture = "sharegpt_small.jsonl" if data == "sharegpt" else "openai_small.jsonl"
    typed = to_typed(
        compose_config(
            [
                "+model=tiny",
                f"data={data}",
                f"data.path={FIXTURES / fixture}",
                "data.num_eval_samples=1",
                "output_dir=/tmp/unused",
            ]
        )
    )
    data = build_datasets(typed.data, smollm2_tokenizer, tmp_path, seed=0)
    assert len(data.train) >= 3 and data.eval is not None and len(data.eval) == 1
    assert all(sum(mask) > 0 for _, mask in data.train)
    assert data.report.rows == data.report.kept == len(data.train) + 1


def test_missing_model_names_the_choices() -> None:
    with pytest.raises(ConfigError) as info:
        to_typed(compose_config(["data=chitchat", "output_dir=/tmp/unused"]))
    message = str(info.value)
    assert "+model=" in message
    for name in ("llama3", "qwen3", "smollm2", "tiny"):
        assert name in message


def test_missing_data_path_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"data\.path is required"):
        to_typed(
            compose_config(["+model=tiny", "data=jsonl", "output_dir=/tmp/unused"])
        ).data.sources()


def test_invariant_error_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.batch_size must be >= 1"):
        to_typed(compose_config([*BASE, "trainer.batch_size=0"]))
    with pytest.raises(ConfigError, match=r"draft\.ttt_length"):
        to_typed(compose_config([*BASE, "draft.ttt_length=0"]))


def test_enum_error_lists_allowed_values() -> None:
    with pytest.raises(ConfigCompositionException) as info:
        compose_config([*BASE, "optimizer.kind=sgd"])
    assert "adamw" in str(info.value.__cause__) and "optimizer.kind" in str(info.value.__cause__)


def test_unknown_field_is_rejected() -> None:
    with pytest.raises(ConfigCompositionException):
        compose_config([*BASE, "trainer.num_epoch=3"])


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["parallel.tp=2", "data.features=/tmp/f"], "parallel.tp=2 splits the target"),
        (["parallel.tp=2", "trainer.eval_tau_every_n_steps=5"], "trainer.eval_tau_every_n_steps"),
        (["parallel.sp_ring=2"], "needs draft.attention=usp and offline"),
        (["draft.attention=usp", "data.features=/tmp/f"], "draft.attention=usp needs parallel"),
    ],
)
def test_parallel_combinations_that_cannot_work_name_the_fields(
    overrides: list[str], named: str
) -> None:
    base = ["+model=tiny", "data=chitchat", "output_dir=/tmp/unused"]
    with pytest.raises(ConfigError, match=named):
        to_typed(compose_config([*base, *overrides]))


@pytest.mark.unit
@pytest.mark.parametrize("num_layers", range(3, 40))
def test_default_aux_layers_are_distinct_layers(num_layers: int) -> None:
    # EAGLE-3's [1, N//2-1, N-4] repeats a layer below 7 layers (6 layers: [1, 2, 2])
    ids = default_aux_layer_ids(num_layers)
    assert len(set(ids)) == 3 and all(0 <= i < num_layers for i in ids)
    assert ids == sorted(ids)
    if num_layers >= 7:
        assert ids == [1, num_layers // 2 - 1, num_layers - 4]
    assert checked_aux_layer_ids(None, num_layers) == ids


def tiny_target_config():  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=6, vocab_size=128)


@pytest.mark.unit
def test_repeated_or_too_few_aux_layers_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"model\.aux_layer_ids \[1, 2, 2\] repeats a layer"):
        checked_aux_layer_ids([1, 2, 2], 6)
    with pytest.raises(ConfigError, match="at least 3 layers"):
        default_aux_layer_ids(2)
    with pytest.raises(ConfigError, match="distinct layer ids"):
        to_typed(compose_config(["+model=tiny", "model.aux_layer_ids=[1,2,2]"]))
    # any number for DFlash; EAGLE-3's draft names the 3 it reads
    to_typed(compose_config(["+model=tiny", "model.aux_layer_ids=[1,2,3,4]", "output_dir=x"]))
    with pytest.raises(ConfigError, match="an EAGLE-3 draft reads 3 target layers"):
        DraftArchitecture.from_target(tiny_target_config(), DraftConfig(), [1, 2, 3, 4])


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (
            ["draft=dflash", "loss=lk_alpha", "draft.ttt_length=3", "draft.fc_norm=true",
             "draft.init=logit_lens"],
            "draft.ttt_length=3, draft.init=logit_lens, draft.fc_norm=True, loss.kind=lk_alpha: "
            "not read by draft=dflash",
        ),
        (["draft=dflash", "loss.kl_decay=3"], "loss.kl_decay=3.0: not read by draft=dflash"),
        (["draft.dflash.block_size=4"], "draft.dflash.block_size=4: not read by draft=eagle3"),
        (["draft.peagle.num_depths=4"], "draft.peagle.num_depths=4: not read by draft=eagle3"),
        (
            ["draft=peagle", "draft.ttt_length=3", "draft.norm_output=true",
             "draft.dflash.num_layers=2"],
            "draft.dflash.num_layers=2, draft.ttt_length=3, draft.norm_output=True: not read by "
            "draft=peagle (docs/peagle.md)",
        ),
        (["draft=dflash", "draft.peagle.num_depths=2"], "draft.peagle.num_depths=2: not read by"),
    ],
)  # fmt: skip
def test_settings_the_draft_family_never_reads_are_refused(
    overrides: list[str], named: str
) -> None:
    """Not trained plain cross-entropy (or EAGLE-3) while MLflow and the checkpoint record the
    other family's settings as if applied."""
    base = ["+model=tiny", "data=chitchat", "output_dir=/tmp/unused"]
    with pytest.raises(ConfigError, match=re.escape(named)) as error:
        to_typed(compose_config([*base, *overrides]))
    assert "\n" not in str(error.value)


def test_a_peagle_draft_takes_eagle3s_layer_fields_its_own_and_the_loss() -> None:
    base = ["+model=smollm2", "data=chitchat", "output_dir=/tmp/unused", "draft=peagle"]
    typed = to_typed(compose_config([*base, "draft.fc_norm=true", "draft.peagle.num_depths=5",
                                     "loss=lk_alpha"]))  # fmt: skip
    assert typed.draft.peagle.num_depths == 5 and typed.draft.fc_norm
    assert typed.model.mask_token_id == 16  # the model's file names its unused token


def test_a_dflash_draft_takes_its_own_and_the_shared_fields() -> None:
    base = ["+model=smollm2", "data=chitchat", "output_dir=/tmp/unused", "draft=dflash"]
    typed = to_typed(compose_config([*base, "draft.init_std=0.01", "draft.dflash.num_layers=2"]))
    assert typed.draft.dflash.num_layers == 2 and typed.draft.draft_vocab_size == 8192


def _dflash_shape(*overrides: str) -> tuple[int, int, int, dict[str, int]]:
    """(num_layers, block_size, num_anchors) as typed, and draft.dflash as config.yaml records
    it (the resolved container)."""
    cfg = compose_config(["data=chitchat", "output_dir=/tmp/unused", *overrides])
    d = to_typed(cfg).draft.dflash
    recorded = OmegaConf.to_container(cfg, resolve=True)["draft"]["dflash"]  # type: ignore[index]
    return d.num_layers, d.block_size, d.num_anchors, recorded


def test_a_dflash_draft_takes_the_shape_its_model_file_gives_and_records_it() -> None:
    """+model=smollm2 draft=dflash trains the shape that fits 2 CPU cores, not the 8-GPU
    recipe's; a command's field wins; a model file without one gets the published shape."""
    *shape, recorded = _dflash_shape("+model=smollm2", "draft=dflash")
    assert shape == [2, 8, 32]
    assert (recorded["num_layers"], recorded["block_size"], recorded["num_anchors"]) == (2, 8, 32)
    assert _dflash_shape("+model=smollm2", "draft=dflash", "draft.dflash.num_layers=3")[:3] == (
        3, 8, 32,
    )  # fmt: skip
    published = DFlashConfig()
    assert _dflash_shape("+model=llama3", "draft=dflash")[:3] == (
        published.num_layers, published.block_size, published.num_anchors,
    )  # fmt: skip
    # another family reads none of it
    to_typed(compose_config(["+model=smollm2", "data=chitchat", "output_dir=/tmp/unused"]))


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("+model.draft_defaults.dflash.num_layer=2",
         "model.draft_defaults.dflash.num_layer: draft=dflash takes num_layers, block_size, "
         "num_anchors from a model file"),
        ("+model.draft_defaults.eagle3.ttt_length=2",
         "model.draft_defaults.eagle3.ttt_length: draft=eagle3 takes no setting"),
        ("+model.draft_defaults.peagle.depth_decay=0.5",
         "model.draft_defaults.peagle.depth_decay: draft=peagle takes num_depths from a model file"),
        ("+model.draft_defaults.dflsh.num_layers=2",
         "model.draft_defaults.dflsh: not a draft family; the families are"),
    ],
)  # fmt: skip
def test_a_model_file_default_no_family_takes_is_refused(override: str, named: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)) as error:
        to_typed(compose_config(["+model=tiny", "data=chitchat", "output_dir=/tmp/u", override]))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("family", list(DraftFamily), ids=lambda f: f.value)
def test_each_family_file_reads_from_the_model_exactly_what_it_takes(family: DraftFamily) -> None:
    """conf/draft/<family>.yaml interpolates model.draft_defaults.<family>.<field> for each
    field the family's model_defaults names, falling back to the dataclass default (so the
    published shape is written once, in code, and the yaml agrees with it)."""
    text = (conf_dir() / "draft" / f"{family.value}.yaml").read_text()
    found = dict(re.findall(rf"\$\{{oc\.select:model\.draft_defaults\.{family.value}\.(\w+),"
                            r"([^}]+)\}", text))  # fmt: skip
    assert sorted(found) == sorted(family_for(family).model_defaults)
    if found:
        section = getattr(DraftConfig(), family.value)
        assert {k: str(getattr(section, k)) for k in found} == found


FITTED_MODELS = ("tiny", "smollm2")  # the bundled targets: their files fit every family


def _typed(*overrides: str) -> EagleForgeConfig:
    return to_typed(compose_config(["data=chitchat", "output_dir=/tmp/unused", *overrides]))


def test_a_packed_rows_budget_is_refused_where_batches_are_padded() -> None:
    """data.max_tokens_per_batch shapes packed rows only: a run that pads (SmolLM2's file, a
    command, or a target that cannot pack) refuses it in one line naming what pads."""
    with pytest.raises(ConfigError) as info:
        _typed("+model=smollm2", "data.max_tokens_per_batch=2048")
    assert str(info.value) == (
        "data.max_tokens_per_batch=2048 is read only when rows are packed, and this run pads "
        "batches of trainer.batch_size=8 (data.packing=false); remove it, or set data.packing=true."
    )
    packed = _typed("+model=smollm2", "data.packing=true", "data.max_tokens_per_batch=2048")
    assert packed.data.max_tokens_per_batch == 2048
    assert _typed("+model=smollm2", "data.max_tokens_per_batch=4096").data.packing is False
    online = _typed("+model=tiny", "data.max_tokens_per_batch=8192")  # the target decides
    check_batch_shape(online, packing=True)
    with pytest.raises(ConfigError, match=r"\(data\.packing=null does not pack with this target\)"):
        check_batch_shape(online, packing=False)


def test_smollm2_gives_every_family_a_batch_and_peagle_depths_that_fit() -> None:
    """+model=smollm2 draft=peagle trains 5 depths over padded batches of 8 conversations, not
    the 8-GPU recipe's 8 depths over 4,096-token packed rows; a command or an experiment wins."""
    for family in DraftFamily:
        typed = _typed("+model=smollm2", f"draft={family.value}")
        assert (typed.data.packing, typed.trainer.batch_size) == (False, 8)
    assert _typed("+model=smollm2", "draft=peagle").draft.peagle.num_depths == 5
    command = _typed("+model=smollm2", "draft=peagle", "draft.peagle.num_depths=3",
                     "data.packing=true", "trainer.batch_size=2")  # fmt: skip
    assert command.draft.peagle.num_depths == 3
    assert (command.data.packing, command.trainer.batch_size) == (True, 2)
    demo = _typed("+model=smollm2", "+experiment=cpu_demo")
    assert (demo.data.packing, demo.trainer.batch_size) == (False, 4)


@pytest.mark.parametrize("family", list(DraftFamily), ids=lambda f: f.value)
@pytest.mark.parametrize(
    "model", [m for m in group_choices("model") if m not in FITTED_MODELS]
)  # fmt: skip
def test_other_model_files_compose_the_published_recipe(model: str, family: DraftFamily) -> None:
    """The files of big targets (llama3, qwen3, ...) give no fitted shape or batch: their
    draft, data and trainer sections are the family's and the data file's defaults, the
    draft vocabulary (and a vision-language target's is_vlm) their own."""
    typed = _typed(f"+model={model}", f"draft={family.value}")
    published = DraftConfig(family=family, draft_vocab_size=typed.draft.draft_vocab_size)
    assert typed.draft == published
    assert typed.trainer == TrainerConfig()
    chitchat = OmegaConf.merge(
        OmegaConf.structured(DataConfig), OmegaConf.load(conf_dir() / "data" / "chitchat.yaml")
    )
    assert dataclasses.replace(typed.data, is_vlm=False) == OmegaConf.to_object(chitchat)


@pytest.mark.parametrize(
    "override", ["draft.family=peagle", "+draft.family=dflash", "draft.family=eagle3,peagle"]
)
def test_draft_family_without_its_group_is_refused_in_one_line(
    override: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """draft.family=peagle alone would train draft/eagle3.yaml's values under P-EAGLE's name
    (no model-fitted depths): refused, pointing at the group, by compose and by the CLI."""
    value = override.split("=", 1)[1]
    with pytest.raises(ConfigError) as error:
        compose_config(["+model=smollm2", "data=chitchat", override])
    message = str(error.value)
    assert message.startswith(f"{override}: ") and f"draft={value}" in message
    assert "remove draft.family" in message and "\n" not in message
    with pytest.raises(SystemExit) as exit_:
        check_cli_overrides(["+model=smollm2", "data=chitchat", override])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"error: {message}\n"
    check_cli_overrides(["+model=smollm2", f"draft={value}"])  # the group is the way


def test_no_conf_file_sets_the_draft_family_but_its_group() -> None:
    """Only conf/draft/<family>.yaml names a family: an experiment picks one with
    `override /draft: <family>`, which brings that family's defaults."""
    for path in sorted(conf_dir().rglob("*.yaml")):
        if path.parent.name == "draft":
            continue
        node = OmegaConf.load(path)
        assert OmegaConf.select(node, "draft.family") is None, path


def test_the_tau_probe_decodes_beside_a_vllm_target_but_not_in_other_backends() -> None:
    """target=vllm runs the engine in its own process, so rank 0 loads the transformers
    target for the probe (as offline): `make quality`'s vLLM recipe sets both. The in-process
    backends that cannot decode are still refused at compose time."""
    base = ["+model=tiny", "data=chitchat", "output_dir=/tmp/unused"]
    to_typed(compose_config([*base, "target=vllm", "trainer.eval_tau_every_n_steps=5"]))
    quality = to_typed(compose_config(
        ["+model=smollm2", "+experiment=smollm2_quality_vllm", "output_dir=/tmp/unused"]
    ))  # fmt: skip
    assert quality.target.backend.value == "vllm" and quality.trainer.eval_tau_every_n_steps
    with pytest.raises(ConfigError, match="trainer.eval_tau_every_n_steps"):
        to_typed(compose_config([*base, "target=custom", "trainer.eval_tau_every_n_steps=5"]))
