"""export.format=gguf: an EAGLE-3 or DFlash draft as llama.cpp's GGUF -- read back bit for bit,
laid out as llama.cpp reads it (RoPE row order, absolute d2t, its tensor names, the target's
tokenizer, a DFlash draft's block size and mask token), and refused where llama.cpp would run
it otherwise than it was trained. The comparison with llama.cpp's own converter is in
tests/engine/test_llamacpp_converter.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from eagleforge.errors import ConfigError
from eagleforge.export import check_main, export
from eagleforge.formats.config import ExportConfig, ExportDType
from eagleforge.formats.dflash import write_dflash
from eagleforge.formats.directory import check_draft, load_checked_draft, read_draft
from eagleforge.formats.eagle3 import export_sglang
from eagleforge.formats.gguf import GGUF_FILE, float32_rounded
from eagleforge.formats.kinds import DraftFormat
from helpers.drafts import tiny_dflash, tiny_draft, tiny_target_gguf

pytestmark = pytest.mark.unit


def _export(tmp_path: Path, name: str = "out", **switches: bool) -> tuple[Path, Path]:
    """(the GGUF export of a tiny draft with ``switches``, the source directory)."""
    source = export_sglang(tiny_draft(seed=4, **switches), tmp_path / f"src-{name}")
    target = tiny_target_gguf(tmp_path / "target.gguf")
    out = export(
        ExportConfig(
            draft=str(source),
            format=DraftFormat.gguf,
            output_dir=str(tmp_path / name),
            target_gguf=str(target),
        )
    )
    return out, source


def _fields(path: Path) -> dict[str, object]:
    reader = gguf.GGUFReader(str(path))
    return {name: field.contents() for name, field in reader.fields.items()}


def _tensor(path: Path, name: str) -> torch.Tensor:
    reader = gguf.GGUFReader(str(path))
    found = next(t for t in reader.tensors if t.name == name)
    return torch.from_numpy(found.data.copy()).reshape([int(n) for n in reversed(found.shape)])


@pytest.mark.parametrize("switches", [{}, {"norm_before_fc": True}, {"norm_before_residual": True}])
def test_a_gguf_export_reads_back_bit_identical(tmp_path: Path, switches: dict[str, bool]) -> None:
    out, source = _export(tmp_path, **switches)
    assert sorted(p.name for p in out.iterdir()) == [GGUF_FILE]
    _, arch, tensors = read_draft(source)
    fmt, read_arch, read_tensors = read_draft(out)
    assert fmt == DraftFormat.gguf and read_arch == float32_rounded(arch)
    expected = {k: v for k, v in tensors.items() if not k.startswith("embed_tokens")}
    assert read_tensors.keys() == expected.keys()
    assert all(torch.equal(read_tensors[k], expected[k]) for k in expected)
    # the file itself, or its directory; and as eval.draft loads it
    assert check_draft(out, target_num_layers=5) == [] == check_draft(out / GGUF_FILE)
    loaded_arch, loaded = load_checked_draft(out / GGUF_FILE, target_num_layers=5)
    assert loaded_arch == read_arch and torch.equal(loaded["fc.weight"], expected["fc.weight"])


def test_the_layout_is_llama_cpps(tmp_path: Path) -> None:
    """What llama.cpp's eagle3 loader reads: its names, the taps numbered by layer input, the
    draft vocabulary as absolute target ids, q and k rows in interleaved RoPE pairs, norms in
    fp32, and the target's tokenizer as it is."""
    out, source = _export(tmp_path, norm_before_fc=True)
    file = out / GGUF_FILE
    fields = _fields(file)
    assert fields["general.architecture"] == "eagle3"
    assert fields["eagle3.target_layers"] == [2, 3, 4]  # eagleforge's [1, 2, 3] + 1
    assert fields["eagle3.target_hidden_size"] == 12 and fields["eagle3.norm_before_fc"] is True
    target = _fields(tmp_path / "target.gguf")
    assert {k: v for k, v in fields.items() if k.startswith("tokenizer.")} == {
        k: v for k, v in target.items() if k.startswith("tokenizer.")
    }
    _, _, tensors = read_draft(source)
    d2t = _tensor(file, "d2t")
    assert torch.equal(d2t, tensors["d2t"] + torch.arange(20))
    assert torch.equal(tensors["t2d"].nonzero().flatten(), d2t)
    # head h's rows j and j + D/2 (Hugging Face's halves) become rows 2j and 2j + 1
    hf_q, q = tensors["midlayer.self_attn.q_proj.weight"], _tensor(file, "blk.0.attn_q.weight")
    half = 8 // 2
    for head in range(2):
        for j in range(half):
            assert torch.equal(q[head * 8 + 2 * j], hf_q[head * 8 + j])
            assert torch.equal(q[head * 8 + 2 * j + 1], hf_q[head * 8 + half + j])
    assert torch.equal(_tensor(file, "enc.output_norm.weight"), tensors["input_norm.weight"])
    names = {t.name for t in gguf.GGUFReader(str(file)).tensors}
    assert "token_embd.weight" not in names and "t2d" not in names  # llama.cpp shares the target's


def test_bf16_weights_keep_fp32_norms_and_read_back_as_exported(tmp_path: Path) -> None:
    source = export_sglang(tiny_draft(seed=5), tmp_path / "src")
    out = export(
        ExportConfig(
            draft=str(source),
            format=DraftFormat.gguf,
            output_dir=str(tmp_path / "bf16"),
            dtype=ExportDType.bfloat16,
            target_gguf=str(tiny_target_gguf(tmp_path / "target.gguf")),
        )
    )
    reader = gguf.GGUFReader(str(out / GGUF_FILE))
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["fc.weight"] == gguf.GGMLQuantizationType.BF16
    assert types["output_norm.weight"] == gguf.GGMLQuantizationType.F32
    _, _, tensors = read_draft(out)
    assert tensors["norm.weight"].dtype == torch.bfloat16 == tensors["fc.weight"].dtype


@pytest.mark.parametrize(
    ("switches", "named"),
    [
        ({"norm_output": True}, "draft.norm_output=true"),
        ({"fc_norm": True}, "draft.fc_norm=true"),
    ],
)
def test_what_llama_cpp_would_run_differently_is_refused(
    tmp_path: Path, switches: dict[str, bool], named: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        _export(tmp_path, **switches)
    message = str(refused.value)
    assert named in message and "\n" not in message
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


PEAGLE_REFUSAL = (
    "export.format=gguf: llama.cpp does not serve P-EAGLE drafts; export it as format=sglang "
    "or format=vllm (served by vLLM, with parallel_drafting)."
)


def test_a_parallel_drafting_draft_is_refused_before_its_target_gguf(tmp_path: Path) -> None:
    """No layout writes a P-EAGLE draft as GGUF (its family has no llamacpp_type): the export
    says so first, with the formats and engine that do serve it -- not after asking for
    export.target_gguf, which it never needs -- and writes nothing."""
    draft = tiny_draft(seed=6)
    draft.arch.mask_token_id = 3
    draft.register_buffer("mask_hidden", torch.zeros(1, 1, 36))
    source = export_sglang(draft, tmp_path / "src")  # no config.yaml: no target GGUF of its own
    with pytest.raises(ConfigError) as refused:
        export(ExportConfig(draft=str(source), format=DraftFormat.gguf,
                            output_dir=str(tmp_path / "out"),
                            target_gguf=str(tiny_target_gguf(tmp_path / "target.gguf"))))  # fmt: skip
    assert str(refused.value) == PEAGLE_REFUSAL
    done = subprocess.run(
        [sys.executable, "-m", "eagleforge.export", f"export.draft={source}",
         "export.format=gguf", f"export.output_dir={tmp_path / 'cli'}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and done.stderr == f"error: {PEAGLE_REFUSAL}\n", done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "target.gguf"]


def test_the_target_gguf_is_checked_and_required(tmp_path: Path) -> None:
    source = export_sglang(tiny_draft(seed=7), tmp_path / "src")
    base = {"draft": str(source), "format": DraftFormat.gguf}
    with pytest.raises(ConfigError, match="needs export.target_gguf"):
        export(ExportConfig(**base, output_dir=str(tmp_path / "a")))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="export.target_gguf=.*no such file"):
        export(ExportConfig(**base, output_dir=str(tmp_path / "b"), target_gguf="/nope.gguf"))
    wide = tiny_target_gguf(tmp_path / "wide.gguf", hidden_size=24)
    with pytest.raises(ConfigError, match="not the draft's target: its hidden size is 24"):
        export(ExportConfig(**base, output_dir=str(tmp_path / "c"), target_gguf=str(wide)))
    shallow = tiny_target_gguf(tmp_path / "shallow.gguf", layers=3)
    with pytest.raises(ConfigError, match="it has 3 layers"):
        export(ExportConfig(**base, output_dir=str(tmp_path / "d"), target_gguf=str(shallow)))
    text = tmp_path / "text.gguf"
    text.write_text("not gguf")
    with pytest.raises(ConfigError, match="not a readable GGUF file"):
        export(ExportConfig(**base, output_dir=str(tmp_path / "e"), target_gguf=str(text)))
    with pytest.raises(ConfigError, match="applies to export.format=gguf"):
        ExportConfig(draft=str(source), format=DraftFormat.vllm, target_gguf=str(wide))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["src", "wide.gguf", "shallow.gguf", "text.gguf"]
    )


def test_check_names_a_broken_gguf_draft(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, _ = _export(tmp_path)
    assert check_main(["--check", str(out)]) == 0
    assert "ok (EAGLE-3, gguf format)" in capsys.readouterr().out
    assert check_draft(out, target_num_layers=4) == [
        "eagle3.target_layers [2, 3, 4] (input of layer) are outside the target's 0..3"
    ]
    broken = tmp_path / "broken.gguf"
    broken.write_bytes((out / GGUF_FILE).read_bytes()[:200])
    assert check_main(["--check", str(broken)]) == 1
    assert "not a readable GGUF file" in capsys.readouterr().out
    other = tmp_path / "other.gguf"
    (problem,) = check_draft(tiny_target_gguf(other))
    assert problem.startswith(
        f"{other}: not a draft eagleforge reads: a GGUF file of general.architecture 'llama'; "
        "eagleforge reads EAGLE-3 (architectures"
    )
    assert "EAGLE-3 GGUF (general.architecture eagle3)" in problem and "\n" not in problem
    in_dir = tmp_path / "in-dir"
    in_dir.mkdir()
    (in_dir / GGUF_FILE).write_bytes(b"GGUF and then nothing")
    (problem,) = check_draft(in_dir)
    assert problem.startswith(f"{in_dir}: {GGUF_FILE}: not a readable GGUF file (")


def _export_dflash(
    tmp_path: Path, name: str = "dflash", dtype: ExportDType = ExportDType.keep, **fields: object
) -> tuple[Path, Path]:
    """(the GGUF export of a tiny DFlash draft, its vLLM-layout source directory)."""
    draft = tiny_dflash(seed=8, **fields)  # type: ignore[arg-type]
    source = write_dflash(draft.arch, draft.state_dict(), tmp_path / f"src-{name}")
    target = tiny_target_gguf(tmp_path / "target.gguf")
    out = export(
        ExportConfig(
            draft=str(source),
            format=DraftFormat.gguf,
            output_dir=str(tmp_path / name),
            dtype=dtype,
            target_gguf=str(target),
        )
    )
    return out, source


@pytest.mark.parametrize("dtype", [ExportDType.keep, ExportDType.bfloat16])
def test_a_dflash_gguf_export_reads_back_bit_identical(tmp_path: Path, dtype: ExportDType) -> None:
    out, source = _export_dflash(tmp_path, dtype=dtype)
    _, arch, tensors = read_draft(source)
    fmt, read_arch, read_tensors = read_draft(out)
    assert fmt == DraftFormat.gguf and read_arch == float32_rounded(arch)
    assert read_tensors.keys() == tensors.keys()
    wanted = torch.bfloat16 if dtype == ExportDType.bfloat16 else torch.float32
    assert all(torch.equal(read_tensors[k], tensors[k].to(wanted)) for k in tensors)
    assert check_draft(out, target_num_layers=5) == []


def test_the_dflash_layout_is_llama_cpps(tmp_path: Path) -> None:
    """What llama.cpp's dflash loader reads: the layers as blk.i with Qwen3's q/k norms, q and
    k rows as Hugging Face has them (llama.cpp ropes DFlash NeoX-style), the taps by layer
    input, the block size, the mask token in the tokenizer, nothing of the target's."""
    out, source = _export_dflash(tmp_path)
    file = out / GGUF_FILE
    fields = _fields(file)
    assert fields["general.architecture"] == "dflash"
    assert fields["dflash.target_layers"] == [2, 3, 4] and fields["dflash.block_size"] == 4
    assert fields["dflash.block_count"] == 1
    assert fields["tokenizer.ggml.mask_token_id"] == 5
    target = _fields(tmp_path / "target.gguf")
    assert {k: v for k, v in fields.items() if k.startswith("tokenizer.")} == {
        **{k: v for k, v in target.items() if k.startswith("tokenizer.")},
        "tokenizer.ggml.mask_token_id": 5,
    }
    _, _, tensors = read_draft(source)
    assert torch.equal(
        _tensor(file, "blk.0.attn_q.weight"), tensors["layers.0.self_attn.q_proj.weight"]
    )
    assert torch.equal(
        _tensor(file, "blk.0.attn_k_norm.weight"), tensors["layers.0.self_attn.k_norm.weight"]
    )
    assert torch.equal(_tensor(file, "enc.output_norm.weight"), tensors["hidden_norm.weight"])
    assert torch.equal(_tensor(file, "output_norm.weight"), tensors["norm.weight"])
    names = {t.name for t in gguf.GGUFReader(str(file)).tensors}
    assert not names & {"token_embd.weight", "output.weight", "d2t"}  # the target's are shared


def test_a_dflash_draft_llama_cpp_would_run_otherwise_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="attention biases: llama.cpp's dflash layer has none"):
        _export_dflash(tmp_path, attention_bias=True)
    shallow = tiny_target_gguf(tmp_path / "shallow.gguf", layers=3)
    draft = tiny_dflash()
    source = write_dflash(draft.arch, draft.state_dict(), tmp_path / "src")
    with pytest.raises(ConfigError, match="it has 3 layers"):
        export(ExportConfig(draft=str(source), format=DraftFormat.gguf,
                            output_dir=str(tmp_path / "out"), target_gguf=str(shallow)))  # fmt: skip
    assert not (tmp_path / "dflash").exists() and not (tmp_path / "out").exists()


def _rewritten(source: Path, path: Path, drop: str = "", tensors: dict | None = None) -> Path:  # type: ignore[type-arg]
    """A copy of a GGUF file without the field ``drop`` and with more ``tensors``."""
    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(path), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", drop):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data))
    for name, array in (tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_check_names_a_broken_dflash_gguf(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, _ = _export_dflash(tmp_path)
    assert check_main(["--check", str(out)]) == 0
    assert "ok (DFlash, gguf format)" in capsys.readouterr().out
    assert check_draft(out, target_num_layers=4) == [
        "dflash.target_layers [2, 3, 4] (input of layer) are outside the target's 0..3"
    ]
    unmasked = _rewritten(
        out / GGUF_FILE, tmp_path / "unmasked.gguf", drop="tokenizer.ggml.mask_token_id"
    )
    assert check_draft(unmasked) == ["no tokenizer.ggml.mask_token_id in the GGUF metadata"]
    headed = _rewritten(out / GGUF_FILE, tmp_path / "headed.gguf",
                        tensors={"output.weight": np.zeros((50, 12), dtype=np.float32)})  # fmt: skip
    (problem,) = check_draft(headed)
    assert problem.startswith("output.weight: its own lm_head, which eagleforge's DFlash drafts")
    with pytest.raises(ConfigError, match="not a usable GGUF draft: output.weight"):
        load_checked_draft(headed, target_num_layers=5)
