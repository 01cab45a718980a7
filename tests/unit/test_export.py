"""Export to SGLang, vLLM and speculators formats: bit-identical round trips, each format's
names and aux-layer numbering, and the --check validator on drafts from any tool."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagleforge.draft.config import DraftFamily
from eagleforge.draft.model import Eagle3Draft
from eagleforge.errors import ConfigError
from eagleforge.export import check_main, export
from eagleforge.families import FAMILIES, family_of
from eagleforge.formats.config import ExportConfig, ExportDType
from eagleforge.formats.directory import (
    LAYOUTS,
    check_draft,
    layouts_of,
    read_architecture,
    read_draft,
    write_draft,
)
from eagleforge.formats.eagle3 import export_sglang
from eagleforge.formats.gguf import float32_rounded, gguf_architecture
from eagleforge.formats.kinds import DraftFormat, Verifier
from eagleforge.formats.layout import DraftLayout, Found
from helpers.drafts import tiny_dflash, tiny_draft, tiny_target_gguf

pytestmark = pytest.mark.unit
FORMATS = list(DraftFormat)


def _tiny_peagle() -> Eagle3Draft:
    draft = tiny_draft(seed=3)
    draft.arch.mask_token_id = 7
    draft.register_buffer("mask_hidden", torch.randn(1, 1, 36))
    return draft


# a tiny draft of each family, for the round trip of every layout (the registry test below
# fails for a family that has none)
TINY_DRAFTS = {
    DraftFamily.eagle3: lambda: tiny_draft(seed=3),
    DraftFamily.peagle: _tiny_peagle,
    DraftFamily.dflash: lambda: tiny_dflash(seed=3),
}
WRITTEN = [(layout, fmt) for layout in LAYOUTS for fmt in layout.writes]


def test_every_family_has_its_layouts_and_a_gguf_one_where_llama_cpp_serves_it() -> None:
    assert {layout.family for layout in LAYOUTS} == set(DraftFamily) == set(TINY_DRAFTS)
    for family in FAMILIES.values():
        as_gguf = any(DraftFormat.gguf in layout.writes for layout in layouts_of(family.name))
        assert as_gguf == (family.llamacpp_type is not None), family.title


@pytest.mark.parametrize(
    ("layout", "fmt"),
    WRITTEN,
    ids=[f"{layout.family.value}-{fmt.value}" for layout, fmt in WRITTEN],
)
def test_every_layout_reads_back_what_it_writes_as_its_own_family(
    tmp_path: Path, layout: DraftLayout, fmt: DraftFormat
) -> None:
    """Each written draft is recognised by its layout alone (no two layouts claim one
    directory), and reads back as the same family, format, architecture and tensors."""
    draft = TINY_DRAFTS[layout.family]()
    tensors = {k: v for k, v in draft.state_dict().items() if not k.startswith("embed_tokens")}
    gguf = fmt == DraftFormat.gguf
    out = write_draft(
        draft.arch, tensors, tmp_path / "out", fmt, Verifier("/models/Tiny-8B"),
        target_gguf=tiny_target_gguf(tmp_path / "target.gguf") if gguf else None,
    )  # fmt: skip
    found = (
        Found(out, gguf=True, gguf_architecture=gguf_architecture(out))
        if gguf
        else Found(out, config=_config(out))
    )
    assert [other for other in LAYOUTS if other.recognises(found)] == [layout]
    read_fmt, arch, read_tensors = read_draft(out)
    assert read_fmt == layout.writes[fmt]
    assert arch == (float32_rounded(draft.arch) if gguf else draft.arch) == read_architecture(out)
    assert family_of(arch).name == layout.family
    assert read_tensors.keys() == tensors.keys()
    assert all(torch.equal(read_tensors[k], tensors[k]) for k in tensors)
    assert check_draft(out, target_num_layers=5) == []


def _plain_model(path: Path) -> Path:
    """A target model's directory: a plain LlamaForCausalLM config.json and weights."""
    path.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16}
    (path / "config.json").write_text(json.dumps(config))
    save_file({"model.norm.weight": torch.ones(16)}, str(path / "model.safetensors"))
    return path


def test_a_directory_no_layout_recognises_is_refused_by_export_and_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A target's own directory given as the draft (once read as an EAGLE-3 draft and
    reported field by field) is one line naming what it holds and what eagleforge reads."""
    plain = _plain_model(tmp_path / "SmolLM2")
    refusal = (
        f"{plain}: not a draft eagleforge reads: config.json with architectures "
        "['LlamaForCausalLM'], model_type 'llama'; eagleforge reads "
        + ", ".join(layout.signature for layout in LAYOUTS)
    )
    assert check_main(["--check", str(plain)]) == 1
    assert capsys.readouterr().out.splitlines() == [f"{plain}: 1 problem(s)", f"  - {refusal}"]
    with pytest.raises(ConfigError) as refused:
        export(ExportConfig(draft=str(plain), output_dir=str(tmp_path / "out")))
    assert str(refused.value) == f"{plain}: cannot export it: {refusal}."
    assert sorted(p.name for p in tmp_path.iterdir()) == ["SmolLM2"]


@pytest.fixture
def trained(tmp_path: Path) -> Path:
    """An SGLang-format draft with a training config.yaml beside it, like a checkpoint."""
    path = export_sglang(tiny_draft(seed=3), tmp_path / "step_00000010")
    (path / "config.yaml").write_text("model:\n  name: tiny\n  path: /models/Tiny-8B\n")
    return path


def _config(path: Path) -> dict:  # type: ignore[type-arg]
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_reads_back_bit_identical(
    trained: Path, tmp_path: Path, fmt: DraftFormat
) -> None:
    _, arch, tensors = read_draft(trained)
    target = str(tiny_target_gguf(tmp_path / "target.gguf")) if fmt == DraftFormat.gguf else None
    out = export(
        ExportConfig(
            draft=str(trained), format=fmt, output_dir=str(tmp_path / fmt.value), target_gguf=target
        )
    )
    read_fmt, read_arch, read_tensors = read_draft(out)
    assert read_fmt == fmt
    assert read_arch == (float32_rounded(arch) if fmt == DraftFormat.gguf else arch)
    assert read_tensors.keys() == tensors.keys()
    assert all(torch.equal(read_tensors[k], tensors[k]) for k in tensors)
    assert check_draft(out, target_num_layers=5) == []  # vLLM cannot read the last layer
    assert not list(tmp_path.glob(".*"))


def test_a_chain_of_exports_returns_to_the_same_bytes(trained: Path, tmp_path: Path) -> None:
    """sglang -> vllm -> speculators -> sglang: the same tensors and config."""
    current = trained
    for fmt in (DraftFormat.vllm, DraftFormat.speculators, DraftFormat.sglang):
        current = export(
            ExportConfig(
                draft=str(current),
                format=fmt,
                output_dir=str(tmp_path / f"to-{fmt.value}"),
                verifier="/models/Tiny-8B",  # a vLLM-format draft does not name its target
            )
        )
    original, final = (
        load_file(str(trained / "model.safetensors")),
        load_file(str(current / "model.safetensors")),
    )
    assert original.keys() == final.keys() and all(
        torch.equal(original[k], final[k]) for k in original
    )
    assert _config(current) == _config(trained)


def test_names_and_layer_numbering_of_each_format(trained: Path, tmp_path: Path) -> None:
    ours = _config(trained)["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    vllm = export(
        ExportConfig(draft=str(trained), format=DraftFormat.vllm, output_dir=str(tmp_path / "v"))
    )
    config = _config(vllm)
    assert config["architectures"] == ["Eagle3LlamaForCausalLM"] and "eagle_config" not in config
    assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in ours]  # input of layer
    assert config["norm_before_residual"] is False
    names = set(load_file(str(vllm / "model.safetensors")))
    assert "layers.0.self_attn.q_proj.weight" in names and not any(
        n.startswith("midlayer.") for n in names
    )
    assert {"d2t", "t2d", "lm_head.weight", "fc.weight", "norm.weight"} <= names

    spec = export(
        ExportConfig(draft=str(trained), format=DraftFormat.speculators, output_dir=str(tmp_path / "s"),
                     verifier_architectures=["LlamaForCausalLM"], speculative_tokens=5)
    )  # fmt: skip
    config = _config(spec)
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == [
        "Eagle3Speculator"
    ]
    assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in ours]
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    speculators = config["speculators_config"]
    assert speculators["verifier"] == {
        "name_or_path": "/models/Tiny-8B",
        "architectures": ["LlamaForCausalLM"],
    }
    assert speculators["proposal_methods"][0]["speculative_tokens"] == 5


def test_dtype_conversion_and_refusals(trained: Path, tmp_path: Path) -> None:
    out = export(
        ExportConfig(
            draft=str(trained), output_dir=str(tmp_path / "bf16"), dtype=ExportDType.bfloat16
        )
    )
    _, _, tensors = read_draft(out)
    assert tensors["fc.weight"].dtype == torch.bfloat16 and tensors["d2t"].dtype == torch.int64
    assert _config(out)["torch_dtype"] == "bfloat16" and check_draft(out) == []
    with pytest.raises(ConfigError, match="exists"):
        export(ExportConfig(draft=str(trained), output_dir=str(out)))
    with pytest.raises(ConfigError, match="export.draft is not set"):
        export(ExportConfig())
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps(_config(trained)))
    tensors = load_file(str(trained / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ConfigError, match="no lm_head.weight"):
        export(ExportConfig(draft=str(broken), output_dir=str(tmp_path / "never")))
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("fmt", [DraftFormat.vllm, DraftFormat.speculators])
def test_the_validator_names_problems_in_every_format(
    trained: Path, tmp_path: Path, fmt: DraftFormat, capsys: pytest.CaptureFixture[str]
) -> None:
    out = export(ExportConfig(draft=str(trained), format=fmt, output_dir=str(tmp_path / "x")))
    config = _config(out)
    config["architectures"] = ["LlamaForCausalLM"]
    config["eagle_aux_hidden_state_layer_ids"] = [2, 3, 9]
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(out / "model.safetensors"))
    del tensors["d2t"]
    save_file(tensors, str(out / "model.safetensors"))
    assert check_main(["--check", str(out), str(trained), "--target-layers", "4"]) == 1
    report = capsys.readouterr().out
    assert f"{out}: 3 problem(s)" in report and f"{trained}: ok (EAGLE-3, sglang format)" in report
    assert "architectures is ['LlamaForCausalLM']" in report and "no d2t/t2d" in report
    assert f"[2, 3, 9] ({fmt.value} numbering) are outside the target's 0..3" in report


def test_the_command_line(trained: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli"
    done = subprocess.run(
        [sys.executable, "-m", "eagleforge.export", f"export.draft={trained}",
         "export.format=vllm", f"export.output_dir={out}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "read back and checked" in done.stdout and "vllm serve" in done.stdout
    check = subprocess.run(
        [sys.executable, "-m", "eagleforge.export", "--check", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert check.returncode == 0 and "ok (EAGLE-3, vllm format)" in check.stdout


def test_speculators_export_needs_to_know_its_verifier(tmp_path: Path) -> None:
    bare = export_sglang(tiny_draft(seed=3), tmp_path / "bare")  # no training config.yaml
    with pytest.raises(ConfigError, match="set export.verifier"):
        export(ExportConfig(draft=str(bare), format=DraftFormat.speculators))
    out = export(
        ExportConfig(draft=str(bare), format=DraftFormat.speculators, verifier="org/target")
    )
    assert _config(out)["speculators_config"]["verifier"]["name_or_path"] == "org/target"


def _checkpoint_for(target_overrides: list[str], path: Path, seed: int = 0) -> Path:
    """A checkpoint-like draft directory for the target of these overrides: a draft shaped
    from the target's config.json, and the resolved training config.yaml beside it."""
    from omegaconf import OmegaConf
    from transformers import AutoConfig

    from eagleforge.config import compose_config, to_typed
    from eagleforge.draft.model import DraftArchitecture, Eagle3Draft
    from eagleforge.targets.source import resolve_model_dir

    cfg = compose_config([*target_overrides, "data=chitchat", f"output_dir={path.parent}"])
    config = to_typed(cfg)
    target = AutoConfig.from_pretrained(
        resolve_model_dir(config.model, config.resolved_cache_dir())
    )
    arch = DraftArchitecture.from_target(target, config.draft, [1, 2, 4])
    draft = Eagle3Draft(arch)
    generator = torch.Generator().manual_seed(seed)
    draft.init_weights(0.3, generator)
    kept = torch.arange(arch.draft_vocab_size) * (arch.vocab_size // arch.draft_vocab_size)
    t2d = torch.zeros(arch.vocab_size, dtype=torch.bool)
    t2d[kept] = True
    draft.set_vocab_map(kept - torch.arange(arch.draft_vocab_size), t2d)
    out = export_sglang(draft, path)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.to_container(cfg, resolve=True)))
    return out


def test_speculators_verifier_is_the_trained_target_with_its_architectures(
    tmp_path: Path, cache_dir: Path
) -> None:
    """A bundled or random target has no model.path: the verifier is the directory eagleforge
    built it in, and the architectures are read from its config.json."""
    from eagleforge.targets.source import RandomModelConfig, random_llama_dir

    checkpoint = _checkpoint_for(["+model=tiny"], tmp_path / "step_00000001")
    out = export(ExportConfig(draft=str(checkpoint), format=DraftFormat.speculators))
    verifier = _config(out)["speculators_config"]["verifier"]
    target = random_llama_dir(RandomModelConfig(), cache_dir)
    assert verifier == {"name_or_path": str(target), "architectures": ["LlamaForCausalLM"]}


def test_speculators_verifier_from_a_local_model_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "models" / "Tiny-8B"
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps({"architectures": ["TinyForCausalLM"]}))
    draft = export_sglang(tiny_draft(seed=3), tmp_path / "step_00000010")
    (draft / "config.yaml").write_text("model:\n  name: tiny8b\n  path: models/Tiny-8B\n")

    def verifier(out: str, **fields: str) -> dict:  # type: ignore[type-arg]
        config = ExportConfig(draft=str(draft), format=DraftFormat.speculators,
                              output_dir=str(tmp_path / out), **fields)  # fmt: skip
        return _config(export(config))["speculators_config"]["verifier"]  # type: ignore[no-any-return]

    # model.path as trained: elsewhere, a relative path that is not here is kept as written
    assert verifier("a") == {"name_or_path": "models/Tiny-8B", "architectures": []}
    monkeypatch.chdir(tmp_path)  # where training ran: the directory, made absolute
    assert verifier("b") == {"name_or_path": str(target), "architectures": ["TinyForCausalLM"]}
    assert verifier("c", verifier="models/Tiny-8B") == {
        "name_or_path": str(target),
        "architectures": ["TinyForCausalLM"],
    }


def test_speculators_loads_the_export_with_its_verifier(tmp_path: Path) -> None:
    """The speculators package's own loader reads the export and the target it names."""
    pytest.importorskip("speculators")
    from speculators import SpeculatorModel

    from eagleforge.config import compose_config, to_typed
    from eagleforge.targets.source import resolve_model_dir

    checkpoint = _checkpoint_for(["+model=tiny"], tmp_path / "step_00000001")
    out = export(ExportConfig(draft=str(checkpoint), format=DraftFormat.speculators))
    model = SpeculatorModel.from_pretrained(str(out))
    _, _, tensors = read_draft(checkpoint)
    assert torch.equal(model.fc.weight, tensors["fc.weight"])
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])
    assert torch.equal(model.layers[0].self_attn.q_proj.weight,
                       tensors["midlayer.self_attn.q_proj.weight"])  # fmt: skip
    assert torch.equal(model.d2t, tensors["d2t"]) and torch.equal(model.t2d, tensors["t2d"])
    # the embedding comes from the verifier, found by speculators' own loader. (Read through
    # load_model_layers: under transformers newer than speculators supports, from_pretrained
    # leaves the embedding uninitialised rather than NaN, so the model may skip loading it.)
    from speculators.utils.loading import load_model_layers

    verifier = model.config.speculators_config.verifier
    assert verifier.architectures == ["LlamaForCausalLM"]
    embedding = load_model_layers(["embed_tokens.weight"], verifier.name_or_path)
    config = to_typed(compose_config(["+model=tiny", "data=chitchat", "output_dir=/tmp/unused"]))
    target = load_file(
        str(
            Path(resolve_model_dir(config.model, config.resolved_cache_dir())) / "model.safetensors"
        )
    )
    assert torch.equal(embedding["embed_tokens.weight"], target["model.embed_tokens.weight"])
