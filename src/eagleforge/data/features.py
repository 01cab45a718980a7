"""The offline feature store: the target's hidden states captured once, read memory-mapped.

Layout of a store directory (one per data split: ``train/``, ``eval/``)::

    manifest.json             what was captured: target identity and weight hash, aux layer
                              ids, template, max length, dtypes, planned shards and samples,
                              and the sha256 of those fields (an edited manifest is refused)
    shard_00000.safetensors   the shard's samples back to back: input_ids int32 [N],
                              loss_mask uint8 [N], aux [N, 3·Ht], final [N, Ht],
                              offsets int64 [n+1], sample_index int64 [n], and for a
                              vision-language target mrope_positions int32 [3, N]
    shard_00000.json          written after its shard: samples, tokens, bytes, sha256 and the
                              samples left out for non-finite values -- a shard counts as
                              complete only when this exists and the sizes agree

Shards are written under a temporary name and renamed when complete, so a killed capture
leaves whole shards only; re-running it skips them. Everything is safetensors or JSON:
nothing is unpickled. Readers open shards with ``safe_open`` (memory-mapped) and read one
sample's rows on demand. Opening a store checks that its manifest and shards agree (shard
count, samples per shard, the tensors' names, dtypes and widths) and names the first
disagreement.
"""

from __future__ import annotations

import hashlib
import json
import logging
import typing
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, asdict, dataclass, fields
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagleforge.atomic import atomic_file
from eagleforge.data.sources import file_digest
from eagleforge.errors import ConfigError, DataError
from eagleforge.files import resolve_cache_dir, save_safetensors
from eagleforge.fingerprint import SAMPLED_TEXT, is_sampled_fingerprint, weights_fingerprint

log = logging.getLogger(__name__)

FORMAT = "eagleforge-features"
# 2: the manifest carries the sha256 of its fields; version-1 manifests (none) still read
VERSION = 2
READABLE_VERSIONS = (1, 2)


class Compression(str, Enum):
    none = "none"
    fp8 = "fp8"


# float8 e4m3: 3 mantissa bits, largest finite value 448
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_fp8(x_TD: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, D] -> fp8 [T, D] and fp32 scales [T, groups]: each token's ``groups`` equal slices
    (the captured layers) scaled so that their largest magnitude maps to 448."""
    x = x_TD.float().unflatten(1, (groups, -1))
    scale = (x.abs().amax(-1) / FP8_MAX).clamp(min=1e-12)
    return (x / scale.unsqueeze(-1)).to(FP8).flatten(1), scale


def dequantize_fp8(q_TD: torch.Tensor, scale_TG: torch.Tensor) -> torch.Tensor:
    groups = scale_TG.shape[1]
    return (q_TD.float().unflatten(1, (groups, -1)) * scale_TG.unsqueeze(-1)).flatten(1)


@dataclass
class PrepareConfig:
    """The `prepare` config section: ``python -m eagleforge.prepare``."""

    # Where to write the store (train/ and eval/ inside); required.
    output_dir: str | None = None
    # Samples per shard (the unit of atomic writing and of resuming).
    samples_per_shard: int = 256
    # Samples per target forward while capturing.
    batch_size: int = 8
    # none: hidden states as the target computed them (fp32 on CPU, bf16 on CUDA);
    # fp8: float8 e4m3 with one fp32 scale per token and captured layer (see docs/offline.md).
    compress: Compression = Compression.none

    def __post_init__(self) -> None:
        for name in ("samples_per_shard", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"prepare.{name} must be >= 1, got {getattr(self, name)}.")


@dataclass
class Manifest:
    """What a store holds; compared field by field with the run that reads it."""

    target: str  # model name
    weight_hash: str  # see ``weight_hash``
    vocab_size: int
    hidden_size: int
    aux_layer_ids: list[int]
    template: str
    max_length: int
    data_key: str  # the tokenized data's cache key (rows, template, tokenizer, split)
    dtype: str  # of aux and final as captured
    samples_per_shard: int
    num_samples: int
    num_shards: int
    compress: str = Compression.none.value  # "fp8": aux/final stored as float8 + scales
    # samples carry the target's M-RoPE positions [3, T] (a vision-language target)
    mrope: bool = False
    # the data as configured when captured (DataConfig.describe), for messages
    data_source: str = ""
    # the backend that captured it (target.backend: hf, vllm, ...), for the record; stores of
    # every backend read alike ("" before this field existed)
    captured_by: str = ""
    format: str = FORMAT
    version: int = VERSION

    def write(self, store: Path) -> None:
        fields_ = asdict(self)
        _write_json(store / "manifest.json", {**fields_, "sha256": _fields_digest(fields_)})

    @classmethod
    def read(cls, store: Path) -> Manifest:
        path = store / "manifest.json"
        if not path.is_file():
            raise DataError(
                f"{store}: no manifest.json; not a feature store (run eagleforge.prepare)."
            )
        fix = (
            "delete it and re-run the same eagleforge.prepare command (it writes the manifest "
            "again and keeps the complete shards)"
        )
        data = _read_record(path, fix)
        if data.get("format") != FORMAT or data.get("version") not in READABLE_VERSIONS:
            raise DataError(
                f"{path}: not an {FORMAT} v{VERSION} manifest; capture the store again with "
                "eagleforge.prepare into an empty prepare.output_dir, or point data.features "
                "elsewhere."
            )
        digest = data.pop("sha256", None)
        hints = typing.get_type_hints(cls)
        _check_fields(
            path,
            data,
            {f.name: hints[f.name] for f in fields(cls) if f.default is MISSING},
            {f.name: hints[f.name] for f in fields(cls) if f.default is not MISSING},
            fix,
        )
        if digest is None and data["version"] >= 2:
            raise DataError(f"{path}: corrupt, no sha256; {fix}.")
        if digest is not None and digest != _fields_digest(data):
            raise DataError(
                f"{path}: edited after capture (its fields do not match their sha256): a store "
                "is what eagleforge.prepare wrote; capture it again into an empty "
                "prepare.output_dir (or delete manifest.json and re-run the same prepare "
                "command)."
            )
        return cls(**data)

    def check_matches(
        self, expected: Mapping[str, Any], store: Path, field: str = "data.features"
    ) -> None:
        """DataError naming every field of ``expected`` on which the store differs; ``field``
        is the setting that points at the store. A store whose weight_hash is an older
        eagleforge's sampled fingerprint cannot be compared: refused as such."""
        if "weight_hash" in expected and is_sampled_fingerprint(self.weight_hash):
            raise DataError(
                f"{store / 'manifest.json'} records the target's weights (weight_hash) "
                f"{SAMPLED_TEXT}; capture the store again with eagleforge.prepare into an empty "
                f"prepare.output_dir, or point {field} elsewhere."
            )
        diffs = [
            f"{name}: store has {getattr(self, name)!r}, the run needs {value!r}"
            for name, value in expected.items()
            if getattr(self, name) != value
        ]
        if diffs:
            raise DataError(
                f"{store} was captured for another setup ({'; '.join(diffs)}); capture it "
                f"again with eagleforge.prepare for this run, or point {field} elsewhere."
            )


def _fields_digest(fields_: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields_, sort_keys=True).encode()).hexdigest()


def data_entry(data_key: str) -> str:
    """The part of a store's ``data_key`` that identifies its rows and their tokenization
    (``preprocess.cache_entry_name``), without the hold-out split and the split name."""
    return data_key.split("/", 1)[0].split("-holdout", 1)[0]


def expected_manifest(
    model_name: str,
    model_dir: Path,
    text_config: Any,
    aux_layer_ids: list[int],
    template: str,
    max_length: int,
    mrope: bool,
    cache_dir: str | Path | None = None,
    revision: str | None = None,
) -> dict[str, Any]:
    """The manifest fields a store must have for a run on this target (its transformers text
    config and aux layers) and data: target, weights (``weight_hash``), layers, template,
    length."""
    return {
        "target": model_name,
        "weight_hash": weight_hash(model_dir, cache_dir, revision),
        "vocab_size": int(text_config.vocab_size),
        "hidden_size": int(text_config.hidden_size),
        "aux_layer_ids": list(aux_layer_ids),
        "template": template,
        "max_length": max_length,
        "mrope": mrope,
    }


def weight_hash(
    model_dir: str | Path, cache_dir: str | Path | None = None, revision: str | None = None
) -> str:
    """Identity of the target's weights: a hash of every byte of its weight files, read once
    and then cached by file identity in ``cache_dir`` (default: ``resolve_cache_dir``'s);
    ``eagleforge.fingerprint`` says what it covers."""
    cache = Path(cache_dir) if cache_dir else resolve_cache_dir(None)
    return weights_fingerprint(model_dir, cache, revision)


def _read_record(path: Path, fix: str) -> dict[str, Any]:
    """The JSON object in ``path``; DataError naming the file, what is wrong and ``fix``."""
    try:
        data = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: corrupt, not valid JSON ({e}); {fix}.") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: corrupt, not a JSON object; {fix}.")
    return data


def _check_fields(
    path: Path,
    data: dict[str, Any],
    required: Mapping[str, Any],
    optional: Mapping[str, Any],
    fix: str,
) -> None:
    """DataError naming every missing, unknown or mistyped key of the record ``data``
    (types are classes or ``list[...]``; a bool is no int)."""
    problems = [f"no {name}" for name in required if name not in data]
    problems += [f"unknown key {name}" for name in data if name not in {**required, **optional}]
    for name, hint in {**required, **optional}.items():
        if name not in data:
            continue
        expected, value = typing.get_origin(hint) or hint, data[name]
        if not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
            problems.append(f"{name} is {value!r}, not a {expected.__name__}")
    if problems:
        raise DataError(f"{path}: corrupt, {'; '.join(problems)}; {fix}.")


def _write_json(path: Path, data: Any) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2) + "\n")


def shard_name(index: int) -> str:
    return f"shard_{index:05d}"


# A shard's sidecar: what write_shard records.
SIDECAR_FIELDS = {
    "samples": int,
    "tokens": int,
    "bytes": int,
    "sha256": str,
    "nonfinite_samples": list[int],
}


def read_sidecar(store: Path, index: int) -> dict[str, Any]:
    """The shard's sidecar record; DataError naming it when it is corrupt."""
    path = store / f"{shard_name(index)}.json"
    fix = (
        f"delete it and {shard_name(index)}.safetensors, then re-run the same "
        "eagleforge.prepare command to capture that shard again"
    )
    record = _read_record(path, fix)
    _check_fields(path, record, SIDECAR_FIELDS, {}, fix)
    return record


def shard_problem(store: Path, index: int) -> str | None:
    """Why the shard is not complete (None: its sidecar is whole and its file has the
    recorded size)."""
    meta = store / f"{shard_name(index)}.json"
    data = store / f"{shard_name(index)}.safetensors"
    if not data.is_file():
        return "missing"
    if not meta.is_file():
        return f"not finished (no {meta.name})"
    size, recorded = data.stat().st_size, read_sidecar(store, index)["bytes"]
    if size != recorded:
        return f"truncated ({size} bytes, {meta.name} records {recorded})"
    return None


def shard_complete(store: Path, index: int) -> bool:
    """The shard's sidecar exists and is whole, and its file has the recorded size: a shard
    that is not complete (a corrupt sidecar included) is captured again by prepare."""
    try:
        return shard_problem(store, index) is None
    except DataError:
        return False


def write_shard(
    store: Path,
    index: int,
    samples: list[tuple[Any, ...]],
    nonfinite: list[int],
    compress: Compression = Compression.none,
) -> dict[str, Any]:
    """Write one shard atomically: samples are (sample index, ids [T], mask [T], aux [T, A],
    final [T, H]) and, for a vision-language target, M-RoPE positions [3, T]; returns its
    sidecar record."""
    name = shard_name(index)
    lengths = [len(sample[1]) for sample in samples]
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    aux, final = torch.cat([s[3] for s in samples]), torch.cat([s[4] for s in samples])
    tensors = {
        "input_ids": torch.cat([s[1] for s in samples]).to(torch.int32),
        "loss_mask": torch.cat([s[2] for s in samples]).to(torch.uint8),
        "offsets": offsets,
        "sample_index": torch.tensor([s[0] for s in samples], dtype=torch.int64),
    }
    if samples and len(samples[0]) == 6:
        tensors["mrope_positions"] = torch.cat([s[5] for s in samples], dim=1).to(torch.int32)
    if compress == Compression.fp8:
        tensors["aux"], tensors["aux_scale"] = quantize_fp8(aux, 3)
        tensors["final"], tensors["final_scale"] = quantize_fp8(final, 1)
    else:
        tensors["aux"], tensors["final"] = aux.contiguous(), final.contiguous()
    final_path = store / f"{name}.safetensors"
    with atomic_file(final_path) as tmp:
        save_safetensors(tensors, tmp)
        sha = file_digest(tmp)
    record = {
        "samples": len(samples),
        "tokens": int(offsets[-1]),
        "bytes": final_path.stat().st_size,
        "sha256": sha,
        "nonfinite_samples": nonfinite,
    }
    _write_json(store / f"{name}.json", record)
    return record


# The safetensors names of the dtypes a store's manifest records.
SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}

# Stores up to this size have every shard's sha256 checked when opened (by default).
AUTO_VERIFY_BYTES = 4 * 2**30


class FeatureDataset(torch.utils.data.Dataset):
    """Samples of a store: (input_ids, loss_mask, aux [T, A], final [T, H]) and, when the
    store has them (``manifest.mrope``), the target's M-RoPE positions [3, T]; read on demand
    from memory-mapped shards. Opening checks every shard's presence and size (and, with
    ``verify_checksums``, its sha256; None: when the store is at most
    ``AUTO_VERIFY_BYTES``, a few seconds of reading) and names the first bad one."""

    def __init__(self, store: str | Path, verify_checksums: bool | None = None) -> None:
        self.store = Path(store)
        self.manifest = Manifest.read(self.store)
        if verify_checksums is None:
            total = sum(p.stat().st_size for p in self.store.glob("shard_*.safetensors"))
            verify_checksums = total <= AUTO_VERIFY_BYTES
        self._handles: dict[int, Any] = {}
        self._index: list[tuple[int, int, int]] = []  # (shard, start, end)
        for shard in range(self.manifest.num_shards):
            path = self.store / f"{shard_name(shard)}.safetensors"
            problem = shard_problem(self.store, shard)
            if problem is not None:
                raise DataError(
                    f"{path}: {problem}; re-run the same eagleforge.prepare command to "
                    "complete the store."
                )
            if verify_checksums and file_digest(path) != read_sidecar(self.store, shard)["sha256"]:
                raise DataError(
                    f"{path}: checksum mismatch (corrupted); delete it and its .json, then "
                    "re-run eagleforge.prepare to capture it again."
                )
            try:
                handle = self._open(shard)
                offsets = handle.get_tensor("offsets").tolist()
            except Exception as e:  # safetensors raises its own error types on bad headers
                raise DataError(f"{path}: unreadable shard ({e}); capture it again.") from None
            disagreement = self._disagreement(shard, handle, len(offsets) - 1)
            if disagreement is not None:
                raise DataError(
                    f"{path}: does not agree with {self.store / 'manifest.json'} ({disagreement}); "
                    "the store was altered after capture: capture it again with eagleforge.prepare "
                    "into an empty prepare.output_dir."
                )
            self._index.extend((shard, offsets[i], offsets[i + 1]) for i in range(len(offsets) - 1))
        extra = sorted(
            p.name
            for p in self.store.glob("shard_*.safetensors")
            if p.stem[6:].isdigit() and int(p.stem[6:]) >= self.manifest.num_shards
        )
        if extra or self.manifest.num_shards != -(
            -self.manifest.num_samples // self.manifest.samples_per_shard
        ):
            found = f"; {', '.join(extra[:3])} lie beyond them" if extra else ""
            raise DataError(
                f"{self.store / 'manifest.json'}: num_shards={self.manifest.num_shards} does not "
                f"agree with num_samples={self.manifest.num_samples} in shards of "
                f"{self.manifest.samples_per_shard}{found}; the store was altered after capture: "
                "capture it again with eagleforge.prepare into an empty prepare.output_dir."
            )

    def _disagreement(self, shard: int, handle: Any, num_rows: int) -> str | None:
        """How shard ``shard`` (its open ``handle``, holding ``num_rows`` samples) differs
        from what the manifest says it holds; None when it agrees."""
        m = self.manifest
        sidecar = read_sidecar(self.store, shard)
        planned = min(m.samples_per_shard, m.num_samples - shard * m.samples_per_shard)
        held = sidecar["samples"] + len(sidecar["nonfinite_samples"])
        if num_rows != sidecar["samples"] or held != planned:
            return f"{num_rows} samples, {len(sidecar['nonfinite_samples'])} left out; the manifest plans {planned}"
        fp8 = m.compress == Compression.fp8.value
        expected = {"input_ids", "loss_mask", "offsets", "sample_index", "aux", "final"}
        expected |= {"aux_scale", "final_scale"} if fp8 else set()
        expected |= {"mrope_positions"} if m.mrope else set()
        keys = set(handle.keys())
        if keys != expected:
            return (
                f"tensors {sorted(keys ^ expected)} (compress={m.compress}, mrope={m.mrope}) differ"
            )
        dtype = "F8_E4M3" if fp8 else SAFETENSORS_DTYPES.get(m.dtype, m.dtype)
        widths = {"aux": len(m.aux_layer_ids) * m.hidden_size, "final": m.hidden_size}
        for name, width in widths.items():
            tensor = handle.get_slice(name)
            shape = tensor.get_shape()
            if tensor.get_dtype() != dtype or len(shape) != 2 or shape[1] != width:
                return (
                    f"{name} is {tensor.get_dtype()} {shape}, the manifest says {dtype} "
                    f"[*, {width}]"
                )
        return None

    def _open(self, shard: int) -> Any:
        if shard not in self._handles:
            path = self.store / f"{shard_name(shard)}.safetensors"
            self._handles[shard] = safe_open(str(path), framework="pt")
        return self._handles[shard]

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers reopen their own handles
        return {**self.__dict__, "_handles": {}}

    def __len__(self) -> int:
        return len(self._index)

    def lengths(self) -> list[int]:
        return [end - start for _, start, end in self._index]

    def num_tokens(self) -> int:
        return sum(self.lengths())

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        shard, start, end = self._index[index]
        handle = self._open(shard)
        aux, final = handle.get_slice("aux")[start:end], handle.get_slice("final")[start:end]
        if self.manifest.compress == Compression.fp8.value:
            # back in the dtype they were captured in, as a lossless store gives them (the
            # teacher's matmul takes them with the lm_head in that dtype)
            dtype = getattr(torch, self.manifest.dtype)
            aux = dequantize_fp8(aux, handle.get_slice("aux_scale")[start:end]).to(dtype)
            final = dequantize_fp8(final, handle.get_slice("final_scale")[start:end]).to(dtype)
        sample = (
            handle.get_slice("input_ids")[start:end].tolist(),
            handle.get_slice("loss_mask")[start:end].tolist(),
            aux,
            final,
        )
        if self.manifest.mrope:
            return (*sample, handle.get_slice("mrope_positions")[:, start:end].long())
        return sample

    @classmethod
    def eval_split(cls, store: Path, verify_checksums: bool | None = None) -> FeatureDataset | None:
        """The store's eval split; None, said once in the log, when the store has none
        (prepare writes ``eval/`` only when the data has a held-out split). An ``eval/`` that
        cannot be opened is an error: training on without eval would go unnoticed."""
        split = store / "eval"
        if not split.exists():
            log.info("%s: no eval split in the store: training without eval", store)
            return None
        if not (split / "manifest.json").is_file():
            raise DataError(
                f"{split}: no manifest.json, so the store's eval split is incomplete; re-run the "
                f"same eagleforge.prepare command to capture it again, or delete {split} to "
                "train without eval."
            )
        try:
            return cls(split, verify_checksums)
        except DataError as e:
            raise DataError(f"{e} (Or delete {split} to train without eval.)") from None

    def token_samples(self) -> Iterator[tuple[list[int], list[int]]]:
        """(input_ids, loss_mask) of every sample, read shard by shard only when iterated
        (ids and masks only: 5 bytes a token)."""
        for shard in range(self.manifest.num_shards):
            handle = self._open(shard)
            ids, mask = handle.get_tensor("input_ids"), handle.get_tensor("loss_mask")
            offsets = handle.get_tensor("offsets").tolist()
            for a, b in zip(offsets[:-1], offsets[1:], strict=True):
                yield ids[a:b].tolist(), mask[a:b].tolist()


def check_store_data(
    store: Path, source_key: str, configured: str, expected: Mapping[str, Any]
) -> None:
    """DataError unless the store at ``store`` was captured from the configured data: the
    training rows and tokenization whose cache key (``preprocess.source_key``) is
    ``source_key``, described by ``configured``, with the manifest fields ``expected`` (the
    data's template and max length, named first). Reads the manifest only."""
    manifest = Manifest.read(store / "train")
    manifest.check_matches(expected, store / "train")
    if data_entry(manifest.data_key) != source_key:
        held = f" ({manifest.data_source})" if manifest.data_source else ""
        raise DataError(
            f"data.features={store} holds other data{held} than the run's {configured} (its "
            f"rows, template, tokenizer or tokenization settings differ); give the data config "
            "it was captured from, or capture this data with eagleforge.prepare."
        )


def open_store(
    store: Path, expected: dict[str, Any], verify_checksums: bool | None = None
) -> tuple[FeatureDataset, FeatureDataset | None]:
    """The train and eval splits of a feature store for a run, each checked against the
    manifest fields the run expects (``expected_manifest``): a store of another target, data
    or template is refused with what differs."""
    train = FeatureDataset(store / "train", verify_checksums)
    evaluation = FeatureDataset.eval_split(store, verify_checksums)
    for split in (train, evaluation):
        if split is not None:
            split.manifest.check_matches(expected, split.store)
    return train, evaluation
