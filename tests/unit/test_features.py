"""Feature store pieces: fp8 quantization bounds, non-finite samples, manifests, weight hash."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from eagleforge.data.features import (
    FeatureDataset,
    Manifest,
    dequantize_fp8,
    quantize_fp8,
    weight_hash,
)
from eagleforge.data.preprocess import TokenizedDataset
from eagleforge.errors import DataError
from eagleforge.prepare import capture_split
from eagleforge.targets.base import TargetOutput

pytestmark = pytest.mark.unit


def test_fp8_keeps_each_tokens_layers_within_a_sixteenth_of_their_maximum() -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3 * 32, generator=generator)
    x[0] *= 300.0  # an outlier token
    x[:, 32:64] *= 0.01  # a quiet layer
    q, scale = quantize_fp8(x, 3)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (50, 3)
    back = dequantize_fp8(q, scale)
    groups = x.unflatten(1, (3, -1))
    bound = (groups.abs().amax(-1, keepdim=True) / 16).expand_as(groups).flatten(1)
    assert bool(((back - x).abs() <= bound).all())
    # the quiet layer keeps its own precision, not the loud layers' (nor the outlier token's)
    assert float((back[1:, 32:64] - x[1:, 32:64]).abs().max()) < 0.01 * 5 / 16


class NaNTarget:
    """Hidden states of ones, but NaN for sequences starting with token 7."""

    forward_in_engine = False

    def lm_head_weight(self) -> torch.Tensor:  # where capture puts the inputs
        return torch.zeros(10, 2)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> TargetOutput:
        aux = torch.ones(*ids.shape, 6)
        aux[ids[:, 0] == 7] = float("nan")
        return TargetOutput(aux_BTA=aux, final_hidden_BTH=torch.ones(*ids.shape, 2))


def _manifest(num_samples: int) -> Manifest:
    return Manifest(
        target="t", weight_hash="h", vocab_size=10, hidden_size=2, aux_layer_ids=[0, 1, 1],
        template="auto", max_length=8, data_key="k", dtype="float32", samples_per_shard=2,
        num_samples=num_samples, num_shards=-(-num_samples // 2),
    )  # fmt: skip


def test_non_finite_samples_are_left_out_and_recorded(tmp_path: Path) -> None:
    data = TokenizedDataset([[1, 2, 3], [7, 2], [4, 5, 6, 1]], [[0, 1, 1], [1, 1], [0, 0, 1, 1]])
    counts = capture_split(tmp_path, data, _manifest(3), NaNTarget(), batch_size=2)  # type: ignore[arg-type]
    assert counts == {"shards": 2, "samples": 2, "tokens": 7, "nonfinite": 1}
    assert json.loads((tmp_path / "shard_00000.json").read_text())["nonfinite_samples"] == [1]
    store = FeatureDataset(tmp_path, verify_checksums=True)
    assert [store[i][0] for i in range(len(store))] == [[1, 2, 3], [4, 5, 6, 1]]
    assert store[1][1] == [0, 0, 1, 1] and store[1][2].shape == (4, 6)


class EngineTarget(NaNTarget):
    """A target whose forward runs in an engine: ``prepare`` sends the next batch ahead."""

    forward_in_engine = True

    def __init__(self, fail_on: int | None = None) -> None:
        self.started: list[int] = []  # the first token of each batch, as it was sent
        self.fail_on = fail_on

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> TargetOutput:
        self.started.append(int(ids[0, 0]))
        if ids[0, 0] == self.fail_on:
            raise RuntimeError("the engine stopped")
        return super().forward(ids, mask)


def _capture_five(store: Path, target: NaNTarget) -> dict[str, int]:
    """Five samples, two a shard and two a batch: the shards start with tokens 1, 4 and 2."""
    data = TokenizedDataset(
        [[1, 2, 3], [7, 2], [4, 5, 6, 1], [6, 1], [2, 2]],
        [[0, 1, 1], [1, 1], [0, 0, 1, 1], [0, 1], [1, 1]],
    )
    return capture_split(store, data, _manifest(5), target, batch_size=2)  # type: ignore[arg-type]


def test_an_engine_target_gets_the_next_batch_while_a_shard_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next shard's batch is in the engine before the shard before it is written, and the
    store is the one a batch-by-batch capture writes."""
    import eagleforge.prepare as prepare

    target = EngineTarget()
    sent_ahead: list[bool] = []
    write = prepare.write_shard

    def write_after_the_next_batch_is_sent(store, shard, *args):  # type: ignore[no-untyped-def]
        for _ in range(500):  # up to 5 s for the next shard's batch to be sent
            if len(target.started) > shard + 1 or shard == 2:
                break
            time.sleep(0.01)
        sent_ahead.append(len(target.started) > shard + 1)
        return write(store, shard, *args)

    monkeypatch.setattr(prepare, "write_shard", write_after_the_next_batch_is_sent)
    counts = _capture_five(tmp_path / "ahead", target)
    monkeypatch.setattr(prepare, "write_shard", write)
    assert sent_ahead == [True, True, False] and target.started == [1, 4, 2]
    alone = _capture_five(tmp_path / "alone", NaNTarget())
    assert counts == alone == {"shards": 3, "samples": 4, "tokens": 11, "nonfinite": 1}
    for name in ("shard_00000.json", "shard_00001.json", "shard_00002.json"):
        assert (tmp_path / "ahead" / name).read_text() == (tmp_path / "alone" / name).read_text()


def test_an_engine_that_fails_ahead_stops_the_capture_after_the_shards_before_it(
    tmp_path: Path,
) -> None:
    with pytest.raises(RuntimeError, match="the engine stopped"):
        _capture_five(tmp_path, EngineTarget(fail_on=2))
    written = [p.name for p in sorted(tmp_path.glob("shard_*.json"))]
    assert written == ["shard_00000.json", "shard_00001.json"]


def test_a_directory_without_manifest_is_named(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no manifest.json; not a feature store"):
        FeatureDataset(tmp_path)


def test_weight_hash_follows_the_weights(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(64, 64)}, str(tmp_path / "model.safetensors"))
    before = weight_hash(tmp_path)
    assert weight_hash(tmp_path) == before
    save_file({"w": torch.ones(64, 64)}, str(tmp_path / "model.safetensors"))
    assert weight_hash(tmp_path) != before


def _small_store(tmp_path: Path) -> Path:
    data = TokenizedDataset([[1, 2, 3], [4, 5], [6, 1]], [[0, 1, 1], [1, 1], [0, 1]])
    capture_split(tmp_path, data, _manifest(3), NaNTarget(), batch_size=2)  # type: ignore[arg-type]
    return tmp_path


def _drop_key(path: Path, key: str) -> None:
    record = json.loads(path.read_text())
    del record[key]
    path.write_text(json.dumps(record))


@pytest.mark.parametrize(
    ("name", "damage", "problem"),
    [
        ("manifest.json", lambda p: p.write_text('{"target": "t",'), "not valid JSON"),
        ("manifest.json", lambda p: _drop_key(p, "num_shards"), "no num_shards"),
        ("manifest.json", lambda p: p.write_text("[1, 2]"), "not a JSON object"),
        ("shard_00001.json", lambda p: p.write_text("{"), "not valid JSON"),
        ("shard_00001.json", lambda p: _drop_key(p, "bytes"), "no bytes"),
        ("shard_00000.json", lambda p: _drop_key(p, "sha256"), "no sha256"),
    ],
)
def test_a_corrupt_manifest_or_sidecar_is_named_with_the_fix(
    tmp_path: Path, name: str, damage, problem: str
) -> None:  # type: ignore[no-untyped-def]
    """One DataError naming the damaged file, what is wrong with it and what to do."""
    store = _small_store(tmp_path)
    damage(store / name)
    with pytest.raises(DataError) as caught:
        FeatureDataset(store, verify_checksums=True)
    message = str(caught.value)
    assert str(store / name) in message and problem in message
    assert "eagleforge.prepare" in message and "delete" in message


def test_prepare_recaptures_a_shard_whose_sidecar_is_corrupt(tmp_path: Path) -> None:
    store = _small_store(tmp_path)
    (store / "shard_00001.json").write_text("{")
    counts = capture_split(
        store,
        TokenizedDataset([[1, 2, 3], [4, 5], [6, 1]], [[0, 1, 1], [1, 1], [0, 1]]),
        _manifest(3),
        NaNTarget(),
        batch_size=2,
    )  # type: ignore[arg-type]
    assert counts["shards"] == 1
    assert len(FeatureDataset(store, verify_checksums=True)) == 3
