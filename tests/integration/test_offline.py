"""Offline mode: capture, resume of a capture, training from the store equal to online
training, and the store's fault cases (truncated or corrupted shard, another setup)."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagleforge.atomic import this_host
from eagleforge.config import compose_config, to_typed
from eagleforge.data.features import FeatureDataset
from eagleforge.errors import DataError
from eagleforge.prepare import run as prepare
from eagleforge.train import run as train
from helpers.processes import dead_pid
from helpers.runs import PADDED, tiny_run_overrides
from helpers.weights import scale_tensor, tiny_target_copy

pytestmark = pytest.mark.integration

DATA = ["data=chitchat", "data.max_num_samples=60", "data.num_eval_samples=6",
        "data.max_length=96"]  # fmt: skip


def _prepare(tmp_path: Path, store: Path, *extra: str) -> Path:
    overrides = ["+model=tiny", *DATA, f"prepare.output_dir={store}",
                 "prepare.samples_per_shard=10", f"output_dir={tmp_path / 'prep'}", *extra]  # fmt: skip
    return prepare(to_typed(compose_config(overrides)))


def _train(tmp_path: Path, name: str, *extra: str):  # type: ignore[no-untyped-def]
    overrides = tiny_run_overrides(tmp_path, *DATA, "trainer.max_num_steps=3",
                                   "data.max_tokens_per_batch=256", *extra, name=name)  # fmt: skip
    return train(compose_config(overrides))


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("offline")
    return _prepare(tmp, tmp / "features")


def test_capture_writes_shards_manifest_and_all_samples(store: Path) -> None:
    manifest = json.loads((store / "train" / "manifest.json").read_text())
    assert manifest["target"] == "tiny" and manifest["max_length"] == 96
    assert manifest["aux_layer_ids"] == [1, 2, 4] and manifest["dtype"] == "float32"
    train_set = FeatureDataset(store / "train", verify_checksums=True)
    assert len(train_set) == manifest["num_samples"] and manifest["num_shards"] == 3
    ids, mask, aux, final = train_set[4]
    assert aux.shape == (len(ids), 3 * 64) and final.shape == (len(ids), 64)
    assert len(mask) == len(ids) and aux.dtype == torch.float32
    assert len(FeatureDataset(store / "eval")) == 6


DFLASH = ("draft=dflash", "draft.dflash.num_layers=1", "draft.dflash.block_size=4",
          "draft.dflash.num_anchors=6", "draft.dflash.mask_token_id=16")  # fmt: skip
PEAGLE = ("draft=peagle", "draft.peagle.num_depths=3")


@pytest.mark.parametrize(
    ("packing", "draft"),
    [
        (True, ()),
        (False, ()),
        pytest.param(True, DFLASH, id="dflash"),
        pytest.param(True, PEAGLE, id="peagle"),
    ],
)
def test_offline_training_equals_online(
    tmp_path: Path, store: Path, packing: bool, draft: tuple[str, ...]
) -> None:
    """Same data, seed and steps: the same losses and the same trained weights (an EAGLE-3, a
    DFlash draft, which reads the store's aux states as its taps, and a P-EAGLE draft)."""
    flag = ("data.packing=true",) if packing else PADDED
    online = _train(tmp_path, "online", *flag, *draft)
    offline = _train(tmp_path, "offline", *flag, f"data.features={store}", *draft)
    torch.testing.assert_close(
        torch.tensor(offline.train_losses), torch.tensor(online.train_losses), rtol=1e-5, atol=1e-6
    )
    assert offline.final_eval["eval/loss"] == pytest.approx(
        online.final_eval["eval/loss"], rel=1e-5
    )
    a = load_file(str(online.checkpoint / "model.safetensors"))
    b = load_file(str(offline.checkpoint / "model.safetensors"))
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-6)


def test_rerun_completes_only_missing_shards(tmp_path: Path) -> None:
    store = _prepare(tmp_path, tmp_path / "features")
    train_dir = store / "train"
    kept = (train_dir / "shard_00000.safetensors").stat().st_mtime_ns
    (train_dir / "shard_00002.json").unlink()  # as if killed before the shard finished
    killed = f".tmp-shard_00002.safetensors.{dead_pid()}@{this_host()}"  # as atomic_file names it
    (train_dir / killed).write_bytes(b"partial")
    with pytest.raises(DataError, match=r"shard_00002.safetensors: not finished \(no shard_00002"):
        FeatureDataset(train_dir)
    _prepare(tmp_path, tmp_path / "features")
    assert (train_dir / "shard_00000.safetensors").stat().st_mtime_ns == kept
    assert not list(train_dir.glob(".*"))
    assert len(FeatureDataset(train_dir, verify_checksums=True)) == 23


def test_a_complete_store_is_left_as_it_is_without_loading_the_target(
    tmp_path: Path, store: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Re-running prepare on a finished store (a killed `make quality` goes on) neither
    starts the target -- a vLLM engine takes minutes -- nor touches a shard; a store of
    another setup is refused before the target loads too."""
    import eagleforge.prepare

    def no_target(*args: object, **kwargs: object) -> None:
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(eagleforge.prepare, "build_target", no_target)
    before = {p.name: p.stat().st_mtime_ns for p in (store / "train").iterdir()}
    assert _prepare(tmp_path, store) == store
    assert "complete (" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in (store / "train").iterdir()} == before
    with pytest.raises(
        DataError, match=r"max_length: store has 96, the run needs 64.*prepare.output_dir"
    ):
        _prepare(tmp_path, store, "data.max_length=64")


def test_truncated_and_corrupted_shards_are_named(tmp_path: Path) -> None:
    store = _prepare(tmp_path, tmp_path / "features")
    shard = store / "train" / "shard_00001.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"shard_00001.safetensors: truncated \("):
        FeatureDataset(store / "train")
    flipped = bytearray(data)
    flipped[len(data) - 100] ^= 0xFF
    shard.write_bytes(bytes(flipped))
    FeatureDataset(store / "train", verify_checksums=False)  # same size: only sha256 can tell
    with pytest.raises(DataError, match="shard_00001.safetensors: checksum mismatch"):
        FeatureDataset(store / "train")  # a small store is checksummed by default


def test_a_store_whose_eval_split_is_damaged_is_refused(tmp_path: Path, store: Path) -> None:
    """An eval/ directory without a readable manifest fails the run (it would train silently
    without eval), naming the file and both ways out."""
    copy = tmp_path / "features"
    shutil.copytree(store, copy)
    (copy / "eval" / "manifest.json").unlink()
    with pytest.raises(DataError, match=r"eval: no manifest.json.*delete .*eval to train without"):
        _train(tmp_path, "no-eval-manifest", f"data.features={copy}")
    (copy / "eval" / "manifest.json").write_text("{")
    with pytest.raises(DataError, match=r"eval/manifest.json: corrupt, not valid JSON"):
        _train(tmp_path, "corrupt-eval-manifest", f"data.features={copy}")


def test_a_store_prepared_without_eval_trains_and_says_so(
    tmp_path: Path, store: Path, caplog: pytest.LogCaptureFixture
) -> None:
    copy = tmp_path / "features"
    shutil.copytree(store / "train", copy / "train")  # as prepared with data.num_eval_samples=0
    with caplog.at_level(logging.INFO, logger="eagleforge"):
        result = _train(tmp_path, "no-eval", f"data.features={copy}")
    assert result.step == 3 and not result.final_eval
    said = [r.getMessage() for r in caplog.records if "no eval split" in r.getMessage()]
    assert said == [f"{copy}: no eval split in the store: training without eval"]


def test_store_of_another_setup_is_refused(tmp_path: Path, store: Path) -> None:
    with pytest.raises(DataError, match=r"max_length: store has 96, the run needs 64"):
        _train(tmp_path, "other", f"data.features={store}", "data.max_length=64")
    with pytest.raises(DataError, match="max_length"):  # capturing into it with other settings
        _prepare(tmp_path, store, "data.max_length=64")


def test_a_store_is_refused_once_its_target_is_edited_on_disk(tmp_path: Path) -> None:
    """Layer 3's down_proj x 1.5 in the target's safetensors after capture (an edit the sampled
    fingerprint of older eagleforge did not read): training from the store and capturing more
    into it are refused in one line naming weight_hash."""
    target = tiny_target_copy(tmp_path / "target")
    source = ("model.source=pretrained", f"model.path={target}")
    store = _prepare(tmp_path, tmp_path / "features", *source)
    scale_tensor(target / "model.safetensors", "model.layers.3.mlp.down_proj.weight", 1.5)
    with pytest.raises(DataError) as refused:
        _train(tmp_path, "edited", *source, f"data.features={store}")
    message = str(refused.value)
    assert "\n" not in message
    assert re.search(r"weight_hash: store has 'xxh3-128:\w{32}', the run needs 'xxh3-128:", message)
    with pytest.raises(DataError, match=r"weight_hash: store has"):
        _prepare(tmp_path, store, *source)


def test_fp8_store_is_a_quarter_of_fp32_and_trains(tmp_path: Path, store: Path) -> None:
    compact = _prepare(tmp_path, tmp_path / "fp8", "prepare.compress=fp8")
    lossless, small = FeatureDataset(store / "train"), FeatureDataset(compact / "train")
    tokens = lossless.num_tokens()

    def size(path: Path) -> int:
        return sum(p.stat().st_size for p in path.glob("shard_*.safetensors"))

    per_token = size(compact / "train") / tokens
    assert per_token < 4 * 64 + 4 * 4 + 5 + 8  # fp8 hidden states + scales + id/mask (+headers)
    assert size(store / "train") / size(compact / "train") > 3.5
    for index in (0, 7):
        _, _, aux, final = lossless[index]
        _, _, aux8, final8 = small[index]
        # e4m3 keeps 3 mantissa bits: relative error within 2^-4 of each token's largest value
        for exact, approx in ((aux, aux8), (final, final8)):
            bound = exact.abs().amax(-1, keepdim=True) / 16
            assert bool(((approx - exact).abs() <= bound).all())
    result = _train(tmp_path, "fp8-run", f"data.features={compact}")
    assert result.step == 3 and all(torch.isfinite(torch.tensor(result.train_losses)))


def test_an_fp8_store_of_a_bf16_capture_reads_back_in_bf16_and_trains(tmp_path: Path) -> None:
    """A bf16 target's fp8 store gives its states back in bf16, as its lossless store would:
    the teacher's matmul takes them with the bf16 lm_head (fp32 states failed there)."""
    bf16 = "model.dtype=bfloat16"
    compact = _prepare(tmp_path, tmp_path / "fp8", "prepare.compress=fp8", bf16)
    _, _, aux, final = FeatureDataset(compact / "train")[0]
    assert aux.dtype == final.dtype == torch.bfloat16
    result = _train(tmp_path, "fp8-bf16-run", f"data.features={compact}", bf16)
    assert result.step == 3 and all(torch.isfinite(torch.tensor(result.train_losses)))


def test_a_store_of_another_dtype_than_the_runs_is_refused_in_one_line(
    tmp_path: Path, store: Path
) -> None:
    """The teacher's lm_head takes the stored states in the dtype they were captured in: a run
    computing the target in another is refused before it loads anything heavy, naming both."""
    from eagleforge.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"^data.features={store} holds float32 states "
                       r"\(captured with model.dtype=float32\) and this run's "
                       r"model.dtype=bfloat16 computes in bfloat16: set model.dtype=float32"):  # fmt: skip
        _train(tmp_path, "bf16-run", f"data.features={store}", "model.dtype=bfloat16")


def test_ranks_capture_disjoint_shards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun (RANK/WORLD_SIZE) each rank writes every WORLD_SIZE-th shard; together
    they complete the store."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    store = _prepare(tmp_path, tmp_path / "features")
    assert sorted(p.name for p in (store / "train").glob("shard_*.json")) == ["shard_00001.json"]
    monkeypatch.setenv("RANK", "0")
    _prepare(tmp_path, tmp_path / "features")
    assert len(FeatureDataset(store / "train", verify_checksums=True)) == 23


def test_refuses_to_start_without_disk_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    from eagleforge.errors import ConfigError

    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10, 9, 1))  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match=r"the store needs .* GiB but only .* are free"):
        _prepare(tmp_path, tmp_path / "features")
    assert not (tmp_path / "features" / "train").exists()


def test_offline_equals_online_on_smollm2(tmp_path: Path) -> None:
    """The real bundled target (tied embeddings: the lm_head is read as the embedding)."""
    data = ["+model=smollm2", "data=chitchat", "data.max_num_samples=30",
            "data.num_eval_samples=4", "data.max_length=80"]  # fmt: skip
    store = prepare(
        to_typed(
            compose_config(
                [
                    *data,
                    f"prepare.output_dir={tmp_path / 'features'}",
                    f"output_dir={tmp_path / 'prep'}",
                ]
            )
        )  # fmt: skip
    )
    runs = []
    for name, extra in (("online", []), ("offline", [f"data.features={store}"])):
        overrides = tiny_run_overrides(tmp_path, *data, "trainer.max_num_steps=2", "data.packing=true",
                                       "data.max_tokens_per_batch=320", *extra, name=name)  # fmt: skip
        runs.append(train(compose_config(overrides)))
    online, offline = runs
    torch.testing.assert_close(
        torch.tensor(offline.train_losses), torch.tensor(online.train_losses), rtol=1e-4, atol=1e-5
    )
    assert offline.final_eval["eval/acc_0"] == pytest.approx(online.final_eval["eval/acc_0"])


def test_custom_target_captures_the_same_store(tmp_path: Path, store: Path) -> None:
    """prepare with target=custom writes what the transformers target writes."""
    custom = _prepare(tmp_path, tmp_path / "custom", "target=custom")
    for name in ("train/shard_00000.safetensors", "eval/shard_00000.safetensors"):
        want, got = load_file(str(store / name)), load_file(str(custom / name))
        assert got.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)


def test_offline_training_measures_real_tau_as_online_does(tmp_path: Path, store: Path) -> None:
    """trainer.eval_tau_every_n_steps offline: rank 0 loads the target to decode with, and the
    τ it measures (and the best checkpoint it keeps) are online training's."""
    probe = ["trainer.eval_tau_every_n_steps=2", "trainer.eval_tau_prompts=2",
             "eval.prompts=mtbench_style", "eval.max_new_tokens=8", "data.packing=true"]  # fmt: skip
    online = _train(tmp_path, "online", *probe)
    offline = _train(tmp_path, "offline", f"data.features={store}", *probe)
    assert sorted(offline.tau_by_step) == [2, 3]
    assert offline.tau_by_step == pytest.approx(online.tau_by_step, abs=1e-6)
    assert offline.best_checkpoint == tmp_path / "offline" / "checkpoints" / "best"


def test_bf16_compute_on_cpu_trains_close_to_fp32(tmp_path: Path, store: Path) -> None:
    """trainer.compute_dtype=bfloat16 autocasts the draft on a CPU too: the losses differ from
    fp32's (it is on) by no more than bf16 rounding explains."""
    fp32 = _train(tmp_path, "fp32", f"data.features={store}")
    bf16 = _train(tmp_path, "bf16", f"data.features={store}", "trainer.compute_dtype=bfloat16")
    assert bf16.train_losses != fp32.train_losses
    assert bf16.train_losses == pytest.approx(fp32.train_losses, rel=2e-2)


def test_a_store_of_other_data_is_refused_before_anything_loads(
    tmp_path: Path, store: Path
) -> None:
    """data.path names one file, data.features a store captured from another: refused in one
    line naming both, not trained on the store's conversations under data.path's name."""
    other = tmp_path / "other.jsonl"
    turns = [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "Hello!"}]
    other.write_text(json.dumps({"conversations": turns}) + "\n")
    with pytest.raises(DataError) as error:
        _train(tmp_path, "other-data", "data=jsonl", f"data.path={other}", f"data.features={store}")
    message = str(error.value)
    assert f"data.features={store} holds other data (data=chitchat)" in message
    assert f"than the run's data=jsonl (data.path={other})" in message and "\n" not in message
    assert not (tmp_path / "other-data" / "checkpoints").exists()


def _edit_manifest(split: Path, *, checksum: bool, **fields: object) -> None:
    """Change manifest fields; with ``checksum``, as a deliberate edit that also recomputes
    the manifest's sha256 (the shards must then still contradict it)."""
    from eagleforge.data.features import Manifest

    path = split / "manifest.json"
    data = {**json.loads(path.read_text()), **fields}
    if checksum:
        data.pop("sha256")
        Manifest(**data).write(split)  # type: ignore[arg-type]
    else:
        path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("fields", "checksum", "said"),
    [
        ({"num_shards": 2}, False, r"manifest.json: edited after capture"),
        ({"compress": "fp8"}, False, r"manifest.json: edited after capture"),
        (
            {"num_shards": 2},
            True,
            r"num_shards=2 does not agree with num_samples=23 in shards of 10; "
            r"shard_00002.safetensors.* lie beyond them",
        ),
        (
            {"num_samples": 30},
            True,
            r"shard_00002.safetensors: does not agree .*\(3 samples, 0 left out; the manifest "
            r"plans 10\)",
        ),
        (
            {"compress": "fp8"},
            True,
            r"shard_00000.safetensors: does not agree with .*manifest.json \(tensors "
            r"\['aux_scale', 'final_scale'\] \(compress=fp8",
        ),
        ({"dtype": "bfloat16"}, True, r"aux is F32 \[.*\], the manifest says BF16"),
    ],
)
def test_a_manifest_that_disagrees_with_its_shards_is_one_line_at_open(
    tmp_path: Path, store: Path, fields: dict[str, object], checksum: bool, said: str
) -> None:
    copy = tmp_path / "features"
    shutil.copytree(store, copy)
    _edit_manifest(copy / "train", checksum=checksum, **fields)
    with pytest.raises(DataError, match=said) as error:
        FeatureDataset(copy / "train", verify_checksums=False)
    assert "\n" not in str(error.value)
