"""The target's weights fingerprint: every byte counts, a cached digest costs no read, and the
cache is never trusted past a change of its file or of itself."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagleforge import fingerprint
from eagleforge.data.features import Manifest
from eagleforge.errors import ConfigError, DataError
from eagleforge.fingerprint import CACHE_SUBDIR, is_sampled_fingerprint, weights_fingerprint
from helpers.weights import overlaps, sampled_spans, scale_tensor, tensor_span

pytestmark = pytest.mark.unit


def sampled_fingerprint(model_dir: Path) -> str:
    """The fingerprint of eagleforge before the whole-file one, kept here to show what it
    missed: sha256 over each file's name, size, header and 16 blocks of 64 KiB."""
    digest = hashlib.sha256()
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            digest.update(f.read(int.from_bytes(f.read(8), "little")))
            for i in range(16):
                f.seek(size * i // 16)
                digest.update(f.read(1 << 16))
    return digest.hexdigest()[:32]


def write_target(model_dir: Path, layers: int = 256) -> Path:
    """An 8 MiB safetensors checkpoint of ``layers`` [64, 128] fp32 weights (the sampled
    fingerprint read 1/8 of it)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    tensors = {
        f"model.layers.{i}.mlp.down_proj.weight": torch.randn(64, 128, generator=generator)
        for i in range(layers)
    }
    save_file(tensors, str(model_dir / "model.safetensors"))
    return model_dir


@pytest.fixture
def settled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Files written by the test are cached at once (not after SETTLE_S)."""
    monkeypatch.setattr(fingerprint, "SETTLE_S", 0.0)


class CountingOpen:
    """``open`` for eagleforge.fingerprint that counts the weight files it reads."""

    def __init__(self) -> None:
        self.reads: list[str] = []

    def __call__(self, file, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.reads.append(Path(file).name)
        return open(file, *args, **kwargs)


def test_an_edit_the_sampled_fingerprint_missed_changes_it(tmp_path: Path) -> None:
    """Layer 3's down_proj x 1.5, in place: the header, the size and the 16 sampled blocks stay
    as they were, so the old fingerprint did not change; the whole-file one does."""
    target = write_target(tmp_path / "target")
    weights = target / "model.safetensors"
    name = "model.layers.3.mlp.down_proj.weight"
    start, end, _ = tensor_span(weights, name)
    assert not overlaps((start, end), sampled_spans(weights))
    before, before_sampled = (
        weights_fingerprint(target, tmp_path / "cache"),
        sampled_fingerprint(target),
    )
    scale_tensor(weights, name, 1.5)
    assert sampled_fingerprint(target) == before_sampled  # the bug
    after = weights_fingerprint(target, tmp_path / "cache")
    assert after != before and after.startswith("xxh3-128:") and len(after) == 9 + 32


def test_a_cached_digest_costs_a_stat_not_a_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, settled: None
) -> None:
    target = write_target(tmp_path / "target")
    counting = CountingOpen()
    monkeypatch.setattr(fingerprint, "open", counting, raising=False)
    first = weights_fingerprint(target, tmp_path / "cache")
    assert counting.reads == ["model.safetensors"]
    assert weights_fingerprint(target, tmp_path / "cache") == first
    assert counting.reads == ["model.safetensors"]  # the second run read nothing
    assert len(list((tmp_path / "cache" / CACHE_SUBDIR).glob("*.json"))) == 1


def test_a_copy_elsewhere_has_the_same_fingerprint(tmp_path: Path) -> None:
    target = write_target(tmp_path / "target")
    copy = tmp_path / "elsewhere" / "copy"
    copy.mkdir(parents=True)
    (copy / "model.safetensors").write_bytes((target / "model.safetensors").read_bytes())
    assert weights_fingerprint(copy, tmp_path / "cache") == weights_fingerprint(
        target, tmp_path / "cache"
    )


def test_a_touched_or_rewritten_file_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, settled: None
) -> None:
    """A new mtime is read again (same bytes: same fingerprint); so is a file rewritten in
    place with its size and mtime put back, as ``cp -p`` onto it does (its ctime moved)."""
    target = write_target(tmp_path / "target")
    weights = target / "model.safetensors"
    counting = CountingOpen()
    monkeypatch.setattr(fingerprint, "open", counting, raising=False)
    first = weights_fingerprint(target, tmp_path / "cache")
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert weights_fingerprint(target, tmp_path / "cache") == first
    assert len(counting.reads) == 2
    stat = weights.stat()
    scale_tensor(weights, "model.layers.3.mlp.down_proj.weight", 1.5)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights.stat().st_size == stat.st_size
    assert weights_fingerprint(target, tmp_path / "cache") != first
    assert len(counting.reads) == 3


def test_a_file_changed_just_now_is_not_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within SETTLE_S of its last change, a second write in the same timestamp tick could
    leave a file's identity unchanged: its digest is not kept."""
    target = write_target(tmp_path / "target")
    monkeypatch.setattr(fingerprint, "SETTLE_S", 3600.0)
    weights_fingerprint(target, tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob("*.json"))


@pytest.mark.parametrize(
    "damage",
    ["truncated", "not json", "digest edited", "other algorithm", "a list"],
)
def test_a_damaged_cache_entry_is_read_over_never_trusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, settled: None, damage: str
) -> None:
    target = write_target(tmp_path / "target")
    first = weights_fingerprint(target, tmp_path / "cache")
    (entry,) = (tmp_path / "cache" / CACHE_SUBDIR).glob("*.json")
    text = entry.read_text()
    record = json.loads(text)
    if damage == "truncated":
        entry.write_text(text[: len(text) // 2])
    elif damage == "not json":
        entry.write_bytes(b"\x00\xff" * 10)
    elif damage == "digest edited":  # a flipped byte: the entry's own sha256 no longer agrees
        record["fields"]["digest"] = "0" * 32
        entry.write_text(json.dumps(record))
    elif damage == "other algorithm":
        record["fields"]["algorithm"] = "md5"
        record["sha256"] = fingerprint._entry_checksum(record["fields"])
        entry.write_text(json.dumps(record))
    else:
        entry.write_text("[1, 2]")
    counting = CountingOpen()
    monkeypatch.setattr(fingerprint, "open", counting, raising=False)
    assert weights_fingerprint(target, tmp_path / "cache") == first
    assert counting.reads == ["model.safetensors"]
    assert json.loads(entry.read_text()) == json.loads(text)  # cached again, whole


def test_an_unwritable_cache_is_one_warning_and_the_fingerprint_still_comes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, settled: None
) -> None:
    target = write_target(tmp_path / "target")
    expected = weights_fingerprint(target, tmp_path / "cache")
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory would be")
    with caplog.at_level(logging.INFO, logger="eagleforge.fingerprint"):
        assert weights_fingerprint(target, blocked) == expected
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "each run reads them again" in warnings[0]
    timing = [r.getMessage() for r in caplog.records if "GB/s" in r.getMessage()]
    assert len(timing) == 1 and "read 0.01 GB from 1/1 files" in timing[0]


def test_sharded_weights_are_the_indexed_files_and_the_index(tmp_path: Path, settled: None) -> None:
    target = tmp_path / "sharded"
    target.mkdir()
    save_file({"a": torch.zeros(4)}, str(target / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.ones(4)}, str(target / "model-00002-of-00002.safetensors"))
    save_file({"c": torch.ones(4)}, str(target / "consolidated.safetensors"))  # not loaded
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors",
                            "b": "model-00002-of-00002.safetensors"}}  # fmt: skip
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    root, files = fingerprint.weight_files(target)
    assert [p.name for p in files] == [
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    first = weights_fingerprint(target, tmp_path / "cache")
    save_file({"c": torch.zeros(4)}, str(target / "consolidated.safetensors"))
    assert weights_fingerprint(target, tmp_path / "cache") == first
    save_file({"b": torch.zeros(4)}, str(target / "model-00002-of-00002.safetensors"))
    assert weights_fingerprint(target, tmp_path / "cache") != first
    (target / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"lists model-00002-of-00002.safetensors, not in"):
        weights_fingerprint(target, tmp_path / "cache")
    (target / "model.safetensors.index.json").write_text("{")
    with pytest.raises(ConfigError, match=r"model.safetensors.index.json: not a weights index"):
        weights_fingerprint(target, tmp_path / "cache")


def test_a_directory_without_weights_is_refused_not_hashed_as_nothing(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"no weight files \(\*.safetensors, \*.bin\)"):
        weights_fingerprint(tmp_path, tmp_path / "cache")


def test_a_hub_id_is_fingerprinted_by_its_files_in_the_hugging_face_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Offline, from the Hugging Face cache's snapshot: the same fingerprint as a downloaded
    copy of the same files; a hub id that is not there is one line naming model.path."""
    from huggingface_hub import constants

    hub = tmp_path / "hub"
    commit = "a" * 40
    snapshot = hub / "models--org--tiny" / "snapshots" / commit
    write_target(snapshot)
    (hub / "models--org--tiny" / "refs").mkdir()
    (hub / "models--org--tiny" / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    local = write_target(tmp_path / "local")
    assert weights_fingerprint("org/tiny", tmp_path / "cache") == weights_fingerprint(
        local, tmp_path / "cache"
    )
    with pytest.raises(
        ConfigError,
        match=r"^model.path=org/other: no model.safetensors .* in the Hugging Face cache \(HF_HUB_OFF",
    ):
        weights_fingerprint("org/other", tmp_path / "cache")


def test_the_sampled_fingerprint_of_an_older_eagleforge_is_recognised(tmp_path: Path) -> None:
    target = write_target(tmp_path / "target")
    assert is_sampled_fingerprint(sampled_fingerprint(target))
    assert not is_sampled_fingerprint(weights_fingerprint(target, tmp_path / "cache"))
    assert not is_sampled_fingerprint("h") and not is_sampled_fingerprint(None)


def test_a_store_of_a_sampled_fingerprint_is_refused_as_such(tmp_path: Path) -> None:
    """Not compared (it cannot match, and "another setup" would be wrong): one line naming the
    field and what to do."""
    manifest = Manifest(
        target="t", weight_hash="0123456789abcdef0123456789abcdef", vocab_size=10,
        hidden_size=2, aux_layer_ids=[0, 1, 1], template="auto", max_length=8, data_key="k",
        dtype="float32", samples_per_shard=2, num_samples=2, num_shards=1,
    )  # fmt: skip
    with pytest.raises(DataError) as refused:
        manifest.check_matches({"weight_hash": "xxh3-128:" + "0" * 32}, tmp_path)
    message = str(refused.value)
    assert "\n" not in message and "(weight_hash) by the sampled fingerprint" in message
    assert "capture the store again with eagleforge.prepare" in message
    manifest.check_matches({"template": "auto"}, tmp_path)  # the data check does not ask it
