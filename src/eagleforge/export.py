"""Export a trained draft for a serving engine, or check draft directories from any tool.

    python -m eagleforge.export export.draft=RUN/checkpoints/step_N export.format=vllm \
        export.output_dir=DIR
    python -m eagleforge.export --check DIR [DIR ...] [--target-layers N]

The export is written under a temporary name, read back and compared with what was meant to
be written (tensors bit for bit, the architecture field by field), checked, and only then
renamed into place.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import hydra
import torch
from huggingface_hub import try_to_load_from_cache
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from eagleforge.atomic import atomic_directory
from eagleforge.config import check_cli_overrides, conf_dir, register_configs
from eagleforge.draft.family import AnyArchitecture
from eagleforge.errors import ConfigError, exit_on_user_error
from eagleforge.families import family_of
from eagleforge.files import resolve_cache_dir, unwritable_reason
from eagleforge.formats.config import ExportConfig, ExportDType
from eagleforge.formats.directory import (
    check_draft,
    layout_for,
    read_architecture,
    read_draft,
    write_draft,
)
from eagleforge.formats.gguf import float32_rounded
from eagleforge.formats.kinds import DraftFormat, Verifier
from eagleforge.targets.source import (
    ModelConfig,
    ModelSource,
    bundled_smollm2_gguf,
    resolve_model_dir,
)

log = logging.getLogger(__name__)


def _verifier(cfg: ExportConfig, draft_dir: Path) -> Verifier:
    """The target a speculators draft names, where ``speculators`` and vLLM can load it:
    ``export.verifier``, else the target of the draft's training config.yaml, else the
    verifier a speculators draft already names; its architectures as given, else from its
    config.json."""
    if cfg.verifier:
        name_or_path, revision = _local_or_hub(cfg.verifier), None
    elif (draft_dir / "config.yaml").is_file():
        name_or_path, revision = _trained_target(draft_dir / "config.yaml")
    else:
        draft_config = json.loads((draft_dir / "config.json").read_text())
        named = (draft_config.get("speculators_config") or {}).get("verifier") or {}
        if not named.get("name_or_path"):
            raise ConfigError(
                f"{draft_dir} does not say which target it was trained for (no config.yaml or "
                "verifier); set export.verifier to the target's hub id or path (vLLM serves it "
                "from there)."
            )
        architectures = cfg.verifier_architectures or list(named.get("architectures") or [])
        return Verifier(named["name_or_path"], architectures)
    architectures = cfg.verifier_architectures or _architectures(name_or_path, revision)
    return Verifier(name_or_path, architectures)


def _local_or_hub(name_or_path: str) -> str:
    """A model directory here as an absolute path (the engine may run elsewhere); anything
    else (a hub id) as it is."""
    local = Path(name_or_path).expanduser()
    return str(local.resolve()) if local.is_dir() else name_or_path


def _trained_target(config_path: Path) -> tuple[str, str | None]:
    """(hub id or directory, revision) of the target in a checkpoint's training config:
    ``model.path`` (absolute when it is a directory here), or for a bundled or random target
    the directory eagleforge builds it in (built again if missing, as training would)."""
    training = OmegaConf.load(config_path)
    try:
        model = OmegaConf.to_object(
            OmegaConf.merge(
                OmegaConf.structured(ModelConfig), OmegaConf.select(training, "model") or {}
            )
        )
    except (OmegaConfBaseException, ConfigError) as e:
        raise ConfigError(
            f"{config_path}: its model section does not read ({e}); set export.verifier to "
            "the target's hub id or path."
        ) from None
    assert isinstance(model, ModelConfig)
    # as training resolved it: a directory here (absolute: the engine may run elsewhere) or
    # a hub id
    target = resolve_model_dir(model, resolve_cache_dir(OmegaConf.select(training, "cache_dir")))
    return (str(target.resolve()) if isinstance(target, Path) else target), model.revision


def _target_gguf(cfg: ExportConfig, draft_dir: Path) -> Path:
    """The GGUF file of the target a GGUF draft is served beside: ``export.target_gguf``, else
    the bundled SmolLM2's when the draft's training config.yaml names it."""
    if cfg.target_gguf:
        path = Path(cfg.target_gguf).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"export.target_gguf={cfg.target_gguf}: no such file; give the target's GGUF "
                "file (the one llama-server -m loads)."
            )
        return path
    config_path = draft_dir / "config.yaml"
    trained = OmegaConf.load(config_path) if config_path.is_file() else None
    source = OmegaConf.select(trained, "model.source") if trained is not None else None
    if source == ModelSource.bundled_smollm2.value:
        return bundled_smollm2_gguf()
    raise ConfigError(
        "export.format=gguf needs export.target_gguf: the target's GGUF file, which llama.cpp "
        "serves the draft beside (only a draft of the bundled SmolLM2 finds its own)."
    )


def _architectures(name_or_path: str, revision: str | None) -> list[str]:
    """The ``architectures`` of a model's config.json: in its directory, or for a hub id in
    the local Hugging Face cache (nothing is downloaded); [] when neither has it."""
    config_path: str | Path | None = Path(name_or_path) / "config.json"
    if not Path(name_or_path).is_dir():
        try:
            config_path = try_to_load_from_cache(name_or_path, "config.json", revision=revision)
        except ValueError:  # not a hub id either
            config_path = None
    if not isinstance(config_path, (str, Path)) or not Path(config_path).is_file():
        log.warning(
            "no config.json found for the verifier %s (not a directory here, not in the "
            "Hugging Face cache): the export names no verifier architectures; set "
            "export.verifier_architectures=[...] to name them.",
            name_or_path,
        )
        return []
    return list(json.loads(Path(config_path).read_text()).get("architectures") or [])


def export(cfg: ExportConfig) -> Path:
    """Write ``cfg.draft`` in ``cfg.format`` to the output dir, verified; returns the dir."""
    if not cfg.draft:
        raise ConfigError("export.draft is not set: give a checkpoint or draft directory.")
    source = Path(cfg.draft)
    problems = check_draft(source)
    if problems:
        raise ConfigError(f"{source}: cannot export it: {'; '.join(problems)}.")
    _, arch, tensors = read_draft(source)
    # a format the draft's family has no layout in is refused before that format's own
    # settings (export.target_gguf, export.verifier) are asked for
    layout_for(arch, cfg.format)
    if cfg.dtype != ExportDType.keep:
        dtype = getattr(torch, cfg.dtype.value)
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    out = Path(cfg.output_dir or f"{source}-{cfg.format.value}")
    if out.exists():
        raise ConfigError(f"export.output_dir={out} exists; remove it or choose another directory.")
    reason = unwritable_reason(out)
    if reason:
        where = f"export.output_dir={out}" if cfg.output_dir else f"{out} (beside the draft)"
        raise ConfigError(
            f"{where}: cannot write there ({reason}); set export.output_dir to a writable "
            "directory."
        )
    verifier = _verifier(cfg, source) if cfg.format == DraftFormat.speculators else None
    target_gguf = _target_gguf(cfg, source) if cfg.format == DraftFormat.gguf else None
    with atomic_directory(out) as tmp:
        write_draft(arch, tensors, tmp, cfg.format, verifier, cfg.speculative_tokens, target_gguf)
        _verify(tmp, cfg.format, arch, tensors)
    return out


def _verify(
    path: Path, fmt: DraftFormat, arch: AnyArchitecture, tensors: dict[str, torch.Tensor]
) -> None:
    """Read an export back: its format, architecture and every tensor as intended."""
    read_fmt, read_arch, read_tensors = read_draft(path)
    expected = {k: v for k, v in tensors.items() if not k.startswith("embed_tokens")}
    wrong = [
        k
        for k in expected
        if k not in read_tensors or not torch.equal(read_tensors[k], expected[k])
    ]
    problems = check_draft(path)
    if fmt == DraftFormat.gguf:  # GGUF keeps eps and the RoPE base as float32
        arch = float32_rounded(arch)
    if (
        read_fmt != layout_for(arch, fmt).writes[fmt]  # a family may have one layout for all
        or read_arch != arch
        or wrong
        or set(read_tensors) != set(expected)
        or problems
    ):
        raise ConfigError(
            f"{path}: the export does not read back as written (format {read_fmt.value}, "
            f"tensors differing: {wrong}, problems: {problems}); please report this."
        )


def check_main(argv: list[str]) -> int:
    """``--check DIR ...``: every problem of every draft directory; status 1 if any."""
    parser = argparse.ArgumentParser(prog="python -m eagleforge.export --check")
    parser.add_argument("--check", nargs="+", metavar="DIR", required=True)
    parser.add_argument(
        "--target-layers", type=int, default=None, help="the target's layer count (range check)"
    )
    args = parser.parse_args(argv)
    status = 0
    for directory in args.check:
        problems = check_draft(directory, args.target_layers)
        if problems:
            status = 1
            print(f"{directory}: {len(problems)} problem(s)")
            for problem in problems:
                print(f"  - {problem}")
        else:
            layout = read_draft(directory)[0].value
            family = family_of(read_architecture(directory))
            print(f"{directory}: ok ({family.title}, {layout} format)")
    return status


@hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="no_run_dir")
@exit_on_user_error
def _hydra_main(cfg: DictConfig) -> None:
    typed = OmegaConf.to_object(cfg.export)
    assert isinstance(typed, ExportConfig)
    out = export(typed)
    print(f"exported {typed.draft} as {typed.format.value} to {out} (read back and checked)")
    arch = read_architecture(out)
    print(f"serve it: {family_of(arch).serve_hint(out, typed.format, arch)}")


def main() -> None:
    if "--check" in sys.argv[1:]:
        sys.exit(check_main(sys.argv[1:]))
    register_configs()
    check_cli_overrides()
    _hydra_main()


if __name__ == "__main__":
    main()
