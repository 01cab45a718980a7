"""A draft as the GGUF file llama.cpp serves beside a GGUF target:

    llama-server -m target.gguf -md DIR/draft.gguf --spec-type draft-eagle3   # or draft-dflash

Two layouts, each the one llama.cpp's own ``convert_hf_to_gguf.py`` writes (checked tensor by
tensor against it in tests/engine/test_llamacpp_converter.py). An EAGLE-3 draft (architecture
``eagle3``):

| eagleforge | GGUF |
|---|---|
| ``fc.weight`` | ``fc.weight`` |
| ``input_norm.weight`` (``norm_before_fc``) | ``enc.output_norm.weight`` |
| ``midlayer.input_layernorm`` / ``hidden_norm`` / ``post_attention_layernorm`` | ``blk.0.attn_norm`` / ``attn_norm_2`` / ``ffn_norm`` |
| ``midlayer.self_attn.{q,k,v,o}_proj`` | ``blk.0.attn_{q,k,v,output}`` (q and k in llama.cpp's RoPE row order) |
| ``midlayer.mlp.{gate,up,down}_proj`` | ``blk.0.ffn_{gate,up,down}`` |
| ``norm.weight`` / ``lm_head.weight`` | ``output_norm.weight`` / ``output.weight`` |
| ``d2t`` (offsets) | ``d2t`` (absolute target ids, I64); ``t2d`` is rebuilt from it |

A DFlash draft (architecture ``dflash``, llama.cpp's NeoX RoPE: the rows stay in Hugging
Face's order): ``fc.weight``, ``hidden_norm`` as ``enc.output_norm``, ``norm`` as
``output_norm``, layer i as ``blk.i.*`` (``attn_q_norm`` / ``attn_k_norm`` for the per-head
norms), no embedding and no ``output.weight`` (llama.cpp shares the target's, as vLLM does),
the block size as ``dflash.block_size`` and the mask token as ``tokenizer.ggml.mask_token_id``.

The aux layers are written in vLLM's numbering (the input of layer k), which is llama.cpp's:
it taps ``llama_set_embeddings_layer_inp`` of each. The tokenizer is copied from the target's
own GGUF, so that llama.cpp finds the two vocabularies identical.

llama.cpp (b11434) runs EAGLE-3 with ``norm_before_fc`` and ``norm_before_residual``, and the
Qwen3-style DFlash layers eagleforge trains; a draft trained with anything else would be
served differently from how it was trained, so ``gguf_refusals`` names it and the export
refuses.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagleforge.draft.dflash import DFlashArchitecture
from eagleforge.draft.family import AnyArchitecture
from eagleforge.draft.model import DraftArchitecture
from eagleforge.errors import CheckpointError, ConfigError
from eagleforge.files import unreadable_reason
from eagleforge.formats.kinds import GGUF_ARCHITECTURE, DraftFormat, Verifier
from eagleforge.formats.layout import DraftLayout, Found, unusable

GGUF_FILE = "draft.gguf"
DFLASH_GGUF_ARCHITECTURE = "dflash"  # general.architecture of llama.cpp's DFlash drafts
# llama.cpp numbers aux layers as vLLM does: the input of layer k (eagleforge's output of
# layer k-1)
LAYER_ID_OFFSET = DraftFormat.gguf.layer_id_offset
MASK_TOKEN_KEY = "tokenizer.ggml.mask_token_id"

# eagleforge's tensor names (the decoder layer under ``midlayer.``) -> GGUF names
_EAGLE3_TENSORS = {
    "fc.weight": "fc.weight",
    "input_norm.weight": "enc.output_norm.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}

# a DFlash draft's tensors outside its layers, and in each layer i (``layers.{i}.`` ->
# ``blk.{i}.``)
_DFLASH_TENSORS = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
}
_DFLASH_LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _dflash_names(num_layers: int) -> dict[str, str]:
    """A DFlash draft's eagleforge tensor names -> GGUF names."""
    names = dict(_DFLASH_TENSORS)
    for i in range(num_layers):
        names.update(
            {
                f"layers.{i}.{ours}": f"blk.{i}.{theirs}"
                for ours, theirs in _DFLASH_LAYER_TENSORS.items()
            }
        )
    return names


def gguf_refusals(arch: DraftArchitecture | DFlashArchitecture) -> list[str]:
    """What in a draft llama.cpp would not run as it was trained (an empty list when it
    serves the draft faithfully), each naming the setting and what to do."""
    refusals = []
    if arch.attention_bias:
        refusals.append(f"attention biases: llama.cpp's {_architecture_name(arch)} layer has none")
    if arch.rope_scaling is not None:
        refusals.append(f"RoPE scaling {arch.rope_scaling}: the GGUF export writes plain RoPE only")
    if isinstance(arch, DFlashArchitecture):  # its layers are llama.cpp's (Qwen3's)
        return refusals
    if arch.norm_output:
        refusals.append(
            "draft.norm_output=true: llama.cpp feeds the state before the final norm to the "
            "next draft step, not the normed one this draft was trained on; train with "
            "draft.norm_output=false for llama.cpp, or serve this draft with vLLM or SGLang"
        )
    if arch.fc_norm:
        refusals.append(
            "draft.fc_norm=true: llama.cpp has no per-layer norm before fc (it would drop "
            "EAGLE-3.1's fc_norm); use draft.norm_before_fc for llama.cpp"
        )
    if arch.mask_token_id is not None:
        refusals.append(
            "a parallel-drafting (P-EAGLE) draft: llama.cpp drafts EAGLE-3 one token at a time"
        )
    if arch.hidden_act != "silu":
        refusals.append(f"hidden_act={arch.hidden_act}: llama.cpp's eagle3 layer uses silu")
    if len(arch.aux_layer_ids) != 3:
        refusals.append(f"{len(arch.aux_layer_ids)} aux layers: llama.cpp reads exactly 3")
    return refusals


def _architecture_name(arch: DraftArchitecture | DFlashArchitecture) -> str:
    return DFLASH_GGUF_ARCHITECTURE if isinstance(arch, DFlashArchitecture) else GGUF_ARCHITECTURE


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q or k projection from Hugging Face's RoPE order (two halves) to GGUF's
    (interleaved pairs), as llama.cpp's converter reorders them for a llama-style layer."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    rows = weight.shape[0]
    return (
        weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _array(tensor: torch.Tensor) -> tuple[np.ndarray, Any]:
    """(numpy array, raw GGML type or None) of a tensor; bf16 goes as its raw 16 bits."""
    import gguf

    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy(), gguf.GGMLQuantizationType.BF16
    if tensor.dtype == torch.int64:
        return tensor.numpy(), gguf.GGMLQuantizationType.I64
    return tensor.numpy(), None


def target_tokenizer_fields(target_gguf: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the target GGUF's hyperparameters by key suffix, its ``tokenizer.*`` fields as
    (value, type, sub_type)); ConfigError naming the file when it does not read."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(target_gguf))
    except Exception as e:  # gguf raises ValueError, OSError, struct errors
        raise ConfigError(
            f"export.target_gguf={target_gguf}: not a readable GGUF file ({unreadable_reason(e)})"
        ) from None
    arch = reader.fields["general.architecture"].contents()
    hparams = {
        name.removeprefix(f"{arch}."): field.contents()
        for name, field in reader.fields.items()
        if name.startswith(f"{arch}.")
    }
    tokenizer = {}
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            tokenizer[name] = (field.contents(), field.types[0], sub)
    if "vocab_size" not in hparams and "tokenizer.ggml.tokens" in tokenizer:
        hparams["vocab_size"] = len(tokenizer["tokenizer.ggml.tokens"][0])
    return hparams, tokenizer


def gguf_weight_type(path: Path) -> str:
    """What a GGUF model's weights are stored as, by its ``general.file_type``: ``float32``,
    ``bfloat16`` and ``float16`` as torch names them, a quantization by llama.cpp's name in
    lower case (``q4_1``); ConfigError naming the file when it does not read."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError, OSError, struct errors
        raise ConfigError(f"{path}: not a readable GGUF file ({unreadable_reason(e)})") from None
    field = reader.fields.get("general.file_type")
    if field is None:
        return "unknown"
    name = gguf.LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_").lower()
    return {"all_f32": "float32", "f16": "float16", "bf16": "bfloat16"}.get(name, name)


def target_mismatch(
    arch: DraftArchitecture | DFlashArchitecture, hparams: dict[str, Any]
) -> list[str]:
    """Where the target GGUF is not the target the draft was trained for."""
    problems = []
    if hparams.get("embedding_length") != arch.target_hidden_size:
        problems.append(
            f"its hidden size is {hparams.get('embedding_length')}, the draft reads "
            f"{arch.target_hidden_size}"
        )
    if hparams.get("vocab_size", arch.vocab_size) != arch.vocab_size:
        problems.append(
            f"its vocabulary has {hparams.get('vocab_size')} tokens, the draft's target "
            f"{arch.vocab_size}"
        )
    layers = hparams.get("block_count")
    if isinstance(layers, int) and max(arch.aux_layer_ids) + LAYER_ID_OFFSET >= layers:
        problems.append(
            f"it has {layers} layers, the draft reads the output of layer {max(arch.aux_layer_ids)}"
        )
    return problems


def write_gguf(
    arch: DraftArchitecture | DFlashArchitecture,
    tensors: dict[str, torch.Tensor],
    out_dir: str | Path,
    target_gguf: str | Path,
) -> Path:
    """Write ``out_dir/draft.gguf`` for llama.cpp from tensors with eagleforge's names, the
    tokenizer copied from ``target_gguf``; ConfigError where llama.cpp would not serve the
    draft as trained or the target GGUF is another model."""
    import gguf

    refusals = gguf_refusals(arch)
    if refusals:
        raise ConfigError(f"export.format=gguf: llama.cpp cannot serve this draft: {refusals[0]}.")
    hparams, tokenizer = target_tokenizer_fields(Path(target_gguf))
    mismatch = target_mismatch(arch, hparams)
    if mismatch:
        raise ConfigError(
            f"export.target_gguf={target_gguf} is not the draft's target: {mismatch[0]}."
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    logging.getLogger("gguf.gguf_writer").setLevel(logging.WARNING)  # it logs its temp path
    a = _architecture_name(arch)
    writer = gguf.GGUFWriter(str(out / GGUF_FILE), a)
    writer.add_type("model")
    writer.add_uint32(f"{a}.context_length", arch.max_position_embeddings)
    writer.add_uint32(f"{a}.embedding_length", arch.hidden_size)
    writer.add_uint32(f"{a}.feed_forward_length", arch.intermediate_size)
    writer.add_uint32(f"{a}.attention.head_count", arch.num_attention_heads)
    writer.add_uint32(f"{a}.attention.head_count_kv", arch.num_key_value_heads)
    writer.add_float32(f"{a}.rope.freq_base", arch.rope_theta)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", arch.rms_norm_eps)
    writer.add_uint32(f"{a}.attention.key_length", arch.head_dim)
    writer.add_uint32(f"{a}.attention.value_length", arch.head_dim)
    writer.add_key_value(
        f"{a}.target_layers",
        [i + LAYER_ID_OFFSET for i in arch.aux_layer_ids],
        gguf.GGUFValueType.ARRAY,
        gguf.GGUFValueType.INT32,
    )
    writer.add_string("eagleforge.target_model_type", arch.target_model_type)
    if isinstance(arch, DFlashArchitecture):
        writer.add_name("eagleforge DFlash draft")
        writer.add_uint32(f"{a}.block_count", arch.num_hidden_layers)
        writer.add_uint32(f"{a}.block_size", arch.block_size)
        writer.add_uint32("eagleforge.num_target_layers", arch.num_target_layers)
        # the draft's own mask token, whatever the target's tokenizer says
        tokenizer[MASK_TOKEN_KEY] = (arch.mask_token_id, gguf.GGUFValueType.UINT32, None)
        named = {
            theirs: tensors[ours] for ours, theirs in _dflash_names(arch.num_hidden_layers).items()
        }
    else:
        writer.add_name("eagleforge EAGLE-3 draft")
        writer.add_uint32(f"{a}.block_count", 1)
        writer.add_uint32(f"{a}.vocab_size", arch.vocab_size)
        writer.add_uint32(f"{a}.rope.dimension_count", arch.head_dim)
        writer.add_uint32(f"{a}.target_hidden_size", arch.target_hidden_size)
        writer.add_bool(f"{a}.norm_before_residual", arch.norm_before_residual)
        writer.add_bool(f"{a}.norm_before_fc", arch.norm_before_fc)
        named = _eagle3_gguf_tensors(arch, tensors)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, (value, vtype, sub) in tokenizer.items():
        writer.add_key_value(name, value, vtype, sub)
    floats = {v.dtype for v in named.values() if v.is_floating_point()}
    writer.add_file_type(
        {torch.float16: 1, torch.bfloat16: 32}.get(next(iter(floats)), 0) if floats else 0
    )
    for gguf_name, tensor in named.items():
        tensor = tensor.detach().contiguous().cpu()
        if tensor.dim() == 1 and tensor.is_floating_point():
            tensor = tensor.float()  # norms stay fp32, as llama.cpp's converter keeps them
        data, raw = _array(tensor.contiguous())
        writer.add_tensor(gguf_name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _eagle3_gguf_tensors(
    arch: DraftArchitecture, tensors: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """An EAGLE-3 draft's tensors by GGUF name: q and k rows in llama.cpp's RoPE order, d2t as
    absolute target ids."""
    named = {}
    for name, gguf_name in _EAGLE3_TENSORS.items():
        if name not in tensors:
            continue
        tensor = tensors[name]
        if name.endswith("q_proj.weight"):
            tensor = _permute(tensor, arch.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            tensor = _permute(tensor, arch.num_key_value_heads)
        named[gguf_name] = tensor
    named["d2t"] = tensors["d2t"].to(torch.int64) + torch.arange(len(tensors["d2t"]))
    return named


def gguf_path(path: str | Path) -> Path:
    """The GGUF file of a draft: ``path`` itself, or ``path/draft.gguf``."""
    path = Path(path)
    return path / GGUF_FILE if path.is_dir() else path


def holds_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a GGUF draft: a ``.gguf`` file, or a directory with draft.gguf."""
    path = Path(path)
    return path.suffix == ".gguf" or (path / GGUF_FILE).is_file()


def gguf_architecture(path: str | Path) -> str | None:
    """A GGUF file's ``general.architecture`` (None when it has none); CheckpointError naming
    the file when it does not read."""
    import gguf

    file = gguf_path(path)
    if not file.is_file():
        raise CheckpointError(f"{file}: no such file")
    try:
        field = gguf.GGUFReader(str(file)).fields.get("general.architecture")
    except Exception as e:  # gguf raises ValueError, OSError, struct errors
        raise CheckpointError(
            f"{file}: not a readable GGUF file ({unreadable_reason(e)})"
        ) from None
    return None if field is None else str(field.contents())


def read_gguf(
    path: str | Path,
) -> tuple[DraftArchitecture | DFlashArchitecture, dict[str, torch.Tensor]]:
    """A GGUF draft's architecture and tensors (eagleforge's names, Hugging Face row order; an
    EAGLE-3 draft's ``d2t`` as offsets and ``t2d`` rebuilt); CheckpointError naming what is
    wrong."""
    problems, arch, tensors = _inspect(gguf_path(path), None)
    if arch is None or problems:
        raise CheckpointError(f"{gguf_path(path)}: {'; '.join(problems)}")
    return arch, tensors


def check_gguf(path: str | Path, target_num_layers: int | None = None) -> list[str]:
    """Every problem that would make a GGUF draft load wrongly in llama.cpp or accept poorly."""
    return _inspect(gguf_path(path), target_num_layers)[0]


def float32_rounded(arch: AnyArchitecture) -> AnyArchitecture:
    """``arch`` with the fields GGUF stores as float32 rounded to float32, as a GGUF reads."""
    return replace(
        arch,
        rms_norm_eps=float(np.float32(arch.rms_norm_eps)),
        rope_theta=float(np.float32(arch.rope_theta)),
    )


@dataclass
class _File:
    """A GGUF draft as read: its metadata, its tensors as torch tensors (GGUF names, row-major
    shapes), and what did not read."""

    fields: dict[str, Any]
    raw: dict[str, torch.Tensor]
    problems: list[str]

    def hparam(self, key: str, default: Any = None) -> Any:
        return self.fields.get(f"{self.fields['general.architecture']}.{key}", default)


_NEEDED = (
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.layer_norm_rms_epsilon",
    "context_length",
)


def _inspect(
    file: Path, target_num_layers: int | None
) -> tuple[list[str], DraftArchitecture | DFlashArchitecture | None, dict[str, torch.Tensor]]:
    import gguf

    if not file.is_file():
        return [f"{file}: no such file"], None, {}
    try:
        reader = gguf.GGUFReader(str(file))
    except Exception as e:  # gguf raises ValueError, OSError, struct errors
        return [f"{file}: not a readable GGUF file ({unreadable_reason(e)})"], None, {}
    fields = {name: field.contents() for name, field in reader.fields.items()}
    found = fields.get("general.architecture")
    if found not in (GGUF_ARCHITECTURE, DFLASH_GGUF_ARCHITECTURE):
        return (
            [f"general.architecture is {found!r}, a draft is 'eagle3' (EAGLE-3) or 'dflash'"],
            None,
            {},
        )
    dflash = found == DFLASH_GGUF_ARCHITECTURE
    needed = (
        (*_NEEDED, "block_count", "block_size")
        if dflash
        else (*_NEEDED, "vocab_size", "target_hidden_size")
    )
    missing = [f"{found}.{key}" for key in needed if f"{found}.{key}" not in fields]
    if dflash and MASK_TOKEN_KEY not in fields:
        missing.append(MASK_TOKEN_KEY)
    if missing:
        return [f"no {', '.join(missing)} in the GGUF metadata"], None, {}
    problems: list[str] = []
    raw: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        data = np.array(t.data)
        if t.tensor_type == gguf.GGMLQuantizationType.BF16:
            tensor = torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
        elif t.tensor_type in (
            gguf.GGMLQuantizationType.F32,
            gguf.GGMLQuantizationType.F16,
            gguf.GGMLQuantizationType.I64,
        ):
            tensor = torch.from_numpy(data)
        else:
            problems.append(f"{t.name} is {t.tensor_type.name}: only F32, F16 and BF16 read back")
            continue
        raw[t.name] = tensor.reshape([int(n) for n in reversed(t.shape)])
    read = _File(fields, raw, problems)
    layer_ids = list(read.hparam("target_layers") or [])
    if dflash:
        _check_dflash_taps(read, layer_ids, target_num_layers)
        return _dflash_from(read, layer_ids)
    if len(layer_ids) != 3:
        problems.append(f"{found}.target_layers must list 3 target layers, got {layer_ids}")
    else:
        _check_range(read, layer_ids, target_num_layers)
    return _eagle3_from(read, layer_ids)


def _check_range(read: _File, layer_ids: list[int], target_num_layers: int | None) -> None:
    if target_num_layers is not None and not all(0 <= i < target_num_layers for i in layer_ids):
        read.problems.append(
            f"{read.fields['general.architecture']}.target_layers {layer_ids} (input of layer) "
            f"are outside the target's 0..{target_num_layers - 1}"
        )


def _check_dflash_taps(read: _File, layer_ids: list[int], target_num_layers: int | None) -> None:
    if not layer_ids:
        read.problems.append("dflash.target_layers is missing: llama.cpp refuses the draft")
        return
    _check_range(read, layer_ids, target_num_layers)


def _matching_dtype(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The norms, written in fp32 whatever the weights' dtype, read back in the matrices'."""
    matrices = {v.dtype for v in tensors.values() if v.dim() == 2}
    if len(matrices) != 1:
        return tensors
    dtype = next(iter(matrices))
    return {
        k: v.to(dtype) if v.dim() == 1 and v.is_floating_point() else v for k, v in tensors.items()
    }


def _eagle3_from(
    read: _File, layer_ids: list[int]
) -> tuple[list[str], DraftArchitecture, dict[str, torch.Tensor]]:
    """An EAGLE-3 GGUF's architecture and tensors, eagleforge's names."""
    a, problems, fields = GGUF_ARCHITECTURE, read.problems, read.fields
    from_gguf = {v: k for k, v in _EAGLE3_TENSORS.items()}
    heads, kv_heads = read.hparam("attention.head_count"), read.hparam("attention.head_count_kv")
    hidden = read.hparam("embedding_length")
    tensors: dict[str, torch.Tensor] = {}
    for gguf_name, tensor in read.raw.items():
        if gguf_name == "d2t":
            continue
        name = from_gguf.get(gguf_name)
        if name is None:
            problems.append(f"{gguf_name}: not a tensor of an EAGLE-3 draft")
            continue
        if name.endswith("q_proj.weight"):
            tensor = _unpermute(tensor, heads)
        elif name.endswith("k_proj.weight"):
            tensor = _unpermute(tensor, kv_heads)
        tensors[name] = tensor
    tensors = _matching_dtype(tensors)
    vocab = read.hparam("vocab_size")
    d2t = read.raw.get("d2t")
    head = tensors.get("lm_head.weight")
    if d2t is None or d2t.dtype != torch.int64 or d2t.dim() != 1:
        problems.append("no int64 d2t: llama.cpp would read draft ids as target ids")
        draft_vocab = head.shape[0] if head is not None else vocab
    else:
        draft_vocab = len(d2t)
        if bool(((d2t < 0) | (d2t >= vocab)).any()) or len(torch.unique(d2t)) != len(d2t):
            problems.append("d2t maps draft ids outside the target vocabulary, or twice")
        else:
            tensors["d2t"] = d2t - torch.arange(draft_vocab)
            t2d = torch.zeros(vocab, dtype=torch.bool)
            t2d[d2t] = True
            tensors["t2d"] = t2d
    if head is None:
        problems.append("no output.weight: llama.cpp would use the target's lm_head")
    elif tuple(head.shape) != (draft_vocab, hidden):
        problems.append(
            f"output.weight has shape {tuple(head.shape)}, expected ({draft_vocab}, {hidden})"
        )
    norm_before_fc = bool(read.hparam("norm_before_fc", False))
    if norm_before_fc != ("input_norm.weight" in tensors):
        problems.append(
            f"{a}.norm_before_fc is {str(norm_before_fc).lower()} but enc.output_norm.weight is "
            f"{'missing' if norm_before_fc else 'present'}"
        )
    arch = DraftArchitecture(
        hidden_size=hidden,
        intermediate_size=read.hparam("feed_forward_length"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=read.hparam("attention.key_length", hidden // heads),
        rms_norm_eps=float(read.hparam("attention.layer_norm_rms_epsilon")),
        rope_theta=float(read.hparam("rope.freq_base", 10000.0)),
        max_position_embeddings=read.hparam("context_length"),
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        target_hidden_size=read.hparam("target_hidden_size"),
        aux_layer_ids=[i - LAYER_ID_OFFSET for i in layer_ids],
        target_model_type=fields.get("eagleforge.target_model_type", "llama"),
        norm_before_fc=norm_before_fc,
        norm_before_residual=bool(read.hparam("norm_before_residual", False)),
    )
    return problems, arch, tensors


# what llama.cpp's DFlash loader also reads, which eagleforge's DFlash drafts never have
_DFLASH_EXTRAS = {
    "output.weight": "its own lm_head",
    "token_embd.weight": "its own embedding",
    "d2t": "a reduced draft vocabulary",
    "selector_hidden.weight": "DFlash2's selector",
    "markov_w1.weight": "DSpark's Markov head",
}


def _dflash_from(
    read: _File, layer_ids: list[int]
) -> tuple[list[str], DFlashArchitecture, dict[str, torch.Tensor]]:
    """A DFlash GGUF's architecture and tensors, eagleforge's names."""
    problems, fields = read.problems, read.fields
    layers = int(read.hparam("block_count"))
    hidden = read.hparam("embedding_length")
    from_gguf = {v: k for k, v in _dflash_names(layers).items()}
    tensors: dict[str, torch.Tensor] = {}
    for gguf_name, tensor in read.raw.items():
        name = from_gguf.get(gguf_name)
        if name is not None:
            tensors[name] = tensor
        elif gguf_name in _DFLASH_EXTRAS:
            problems.append(
                f"{gguf_name}: {_DFLASH_EXTRAS[gguf_name]}, which eagleforge's DFlash drafts do "
                "not have (llama.cpp serves it; eagleforge cannot read it back)"
            )
        else:
            problems.append(f"{gguf_name}: not a tensor of a DFlash draft")
    missing = [name for name in from_gguf if name not in read.raw]
    if missing:
        problems.append(f"missing {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    fc = read.raw.get("fc.weight")
    if fc is not None and layer_ids and tuple(fc.shape) != (hidden, len(layer_ids) * hidden):
        problems.append(
            f"fc.weight has shape {tuple(fc.shape)}, expected ({hidden}, "
            f"{len(layer_ids) * hidden}) for {len(layer_ids)} taps"
        )
    if read.hparam("attention.causal", False):
        problems.append(
            "dflash.attention.causal is true: eagleforge's DFlash blocks are bidirectional"
        )
    if read.hparam("attention.sliding_window"):
        problems.append("dflash.attention.sliding_window: eagleforge's DFlash layers attend fully")
    vocab = len(fields.get("tokenizer.ggml.tokens") or [])
    mask = int(fields[MASK_TOKEN_KEY])
    if not 0 <= mask < vocab:
        problems.append(f"{MASK_TOKEN_KEY}={mask} is outside the vocabulary (0..{vocab - 1})")
    block_size = int(read.hparam("block_size"))
    if block_size < 2:
        problems.append(f"dflash.block_size={block_size}: a block is a token and >= 1 proposal")
    arch = DFlashArchitecture(
        hidden_size=hidden,
        intermediate_size=read.hparam("feed_forward_length"),
        num_hidden_layers=layers,
        num_attention_heads=read.hparam("attention.head_count"),
        num_key_value_heads=read.hparam("attention.head_count_kv"),
        head_dim=read.hparam("attention.key_length", hidden // read.hparam("attention.head_count")),
        rms_norm_eps=float(read.hparam("attention.layer_norm_rms_epsilon")),
        rope_theta=float(read.hparam("rope.freq_base", 10000.0)),
        max_position_embeddings=read.hparam("context_length"),
        vocab_size=vocab,
        target_hidden_size=hidden,
        num_target_layers=int(
            fields.get("eagleforge.num_target_layers", max(layer_ids, default=0) + 1)
        ),
        aux_layer_ids=[i - LAYER_ID_OFFSET for i in layer_ids],
        block_size=block_size,
        mask_token_id=mask,
        target_model_type=fields.get("eagleforge.target_model_type", "llama"),
    )
    return problems, arch, _matching_dtype(tensors)


class GGUFLayout:
    """The drafts of another layout's family as llama.cpp's GGUF file (``architecture``: its
    ``general.architecture``), alone or as ``DIR/draft.gguf``."""

    def __init__(self, architecture: str, of: DraftLayout) -> None:
        self.architecture, self.of = architecture, of
        self.family, self.title = of.family, of.title
        self.signature = f"{of.title} GGUF (general.architecture {architecture})"
        self.served_by = "llama.cpp"
        self.writes = {DraftFormat.gguf: DraftFormat.gguf}

    def recognises(self, found: Found) -> bool:
        return found.gguf_architecture == self.architecture

    def owns(self, arch: object) -> bool:
        return self.of.owns(arch)

    def read(
        self, found: Found
    ) -> tuple[DraftFormat, DraftArchitecture | DFlashArchitecture, dict[str, torch.Tensor]]:
        return (DraftFormat.gguf, *read_gguf(found.path))

    def architecture_of(self, found: Found) -> DraftArchitecture | DFlashArchitecture:
        return read_gguf(found.path)[0]  # its metadata and tensors are one file

    def check(self, found: Found, target_num_layers: int | None) -> list[str]:
        return check_gguf(found.path, target_num_layers)

    def load_checked(
        self, found: Found, target_num_layers: int
    ) -> tuple[DraftArchitecture | DFlashArchitecture, dict[str, torch.Tensor]]:
        problems = check_gguf(found.path, target_num_layers)
        if problems:
            raise unusable(found.path, "GGUF", problems)
        return read_gguf(found.path)

    def write(
        self,
        arch: DraftArchitecture | DFlashArchitecture,
        tensors: dict[str, torch.Tensor],
        out_dir: Path,
        fmt: DraftFormat,
        verifier: Verifier | None,
        speculative_tokens: int,
        target_gguf: Path | None,
    ) -> Path:
        if target_gguf is None:
            raise ConfigError(
                "export.format=gguf needs export.target_gguf: the target's GGUF file, which "
                "llama.cpp serves the draft beside"
            )
        return write_gguf(arch, tensors, out_dir, target_gguf)
