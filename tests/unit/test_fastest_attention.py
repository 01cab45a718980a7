"""draft.attention=auto on a CPU takes the faster of sdpa and eager for each kind of call,
measured once per machine and read back after; both give the reference's result."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from eagleforge.draft import attention
from eagleforge.draft.attention import (
    AUTO_ENV,
    FastestAttention,
    eager_ttt_attention,
    time_ttt_attention,
)

pytestmark = pytest.mark.unit


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[tuple]:  # type: ignore[type-arg]
    """A machine with a cache of its own whose eager is faster than sdpa causal at T <= 64
    and slower otherwise; each measurement is listed."""
    monkeypatch.setenv("EAGLEFORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(AUTO_ENV, raising=False)
    calls: list[tuple] = []  # type: ignore[type-arg]

    def fake(dtype, heads, kv_heads, head_dim, seq, masked):  # type: ignore[no-untyped-def]
        calls.append((seq, masked))
        eager_wins = masked or seq <= 64
        return {"sdpa": 0.02, "eager": 0.01 if eager_wins else 0.05}

    monkeypatch.setattr(attention, "time_ttt_attention", fake)
    return calls


def _call(auto: FastestAttention, seq: int, *, packed: bool = False, padded_left: bool = False):  # type: ignore[no-untyped-def]
    generator = torch.Generator().manual_seed(seq)
    q = torch.randn(2, 4, seq, 8, generator=generator)
    keys = [torch.randn(2, 2, seq, 8, generator=generator) for _ in range(2)]
    values = [torch.randn(2, 2, seq, 8, generator=generator) for _ in range(2)]
    valid = torch.ones(2, seq, dtype=torch.bool)
    valid[1, -3:] = False  # right padding: no mask needed
    if padded_left:
        valid[0, :2] = False
    documents = (torch.arange(seq) >= seq // 3).long().expand(2, seq) if packed else None
    out = auto(q, keys, values, valid, documents)
    reference = eager_ttt_attention(q, keys, values, valid, documents)
    kept = valid.unsqueeze(-1)
    torch.testing.assert_close(out * kept, reference * kept)


def test_each_kind_of_call_takes_the_faster_backend_measured_once(
    measured, caplog, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    auto = FastestAttention()
    with caplog.at_level(logging.INFO, logger="eagleforge.draft.attention"):
        _call(auto, 40)
        _call(auto, 40)
        _call(auto, 50)  # the same power-of-two bucket
        _call(auto, 100)
        _call(auto, 100, packed=True)
        _call(auto, 100, padded_left=True)  # the same kind as packed: a mask
    assert measured == [(64, False), (128, False), (128, True)]
    assert [v.value for v in auto.chosen.values()] == ["eager", "sdpa", "eager"]
    said = [r.getMessage() for r in caplog.records]
    assert said[1].startswith("TTT attention auto at T<=128 (causal, float32): sdpa (sdpa 20.0 ms")
    # another process on this machine reads the cache instead of measuring
    _call(FastestAttention(), 100)
    assert len(measured) == 3
    assert len(json.loads((tmp_path / "kernels.json").read_text())) == 3


def test_a_pinned_backend_is_not_measured(measured, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv(AUTO_ENV, "eager")
    auto = FastestAttention()
    _call(auto, 100)
    assert measured == [] and [v.value for v in auto.chosen.values()] == ["eager"]


@pytest.mark.parametrize("mode", ["train", "no_grad", "inference"])
def test_the_real_timing_covers_both_backends_whatever_the_callers_mode(mode: str) -> None:
    """The first call of a run may be its evaluation at step 0, under no_grad."""
    context = {"train": torch.enable_grad, "no_grad": torch.no_grad,
               "inference": torch.inference_mode}[mode]  # fmt: skip
    with context():
        times = time_ttt_attention(torch.float32, 4, 2, 8, 32, masked=True)
    assert set(times) == {"sdpa", "eager"} and all(0 < t < 10 for t in times.values())
