"""auto precision follows the CPU it runs on: bf16 only where the CPU computes it natively,
measured once per machine and cached; asked-for bf16 on a CPU without it warns with the ratio
and runs as asked; what was chosen is said in one line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from eagleforge import precision
from eagleforge.precision import GUARD_ENV, PIN_ENV, choose, cpu_bf16

pytestmark = pytest.mark.unit
CPU = torch.device("cpu")


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    """A CPU whose bf16 runs ``ratio`` times fp32's (the measurement counted in ``calls``),
    with a cache of its own and nothing said yet."""
    monkeypatch.setenv("EAGLEFORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(PIN_ENV, raising=False)
    monkeypatch.setattr(precision, "_said", set())
    monkeypatch.setattr(precision, "SUBNORMALS_FLUSHED", False)  # said by its own test
    calls: list[float] = []

    def set_ratio(ratio: float) -> list[float]:
        def measure() -> float:
            calls.append(ratio)
            return ratio

        monkeypatch.setattr(precision, "measure_cpu_bf16", measure)
        (tmp_path / "cache" / "precision.json").unlink(missing_ok=True)  # another machine
        cpu_bf16.cache_clear()
        return calls

    yield set_ratio
    cpu_bf16.cache_clear()


def test_auto_is_fp32_where_bf16_is_slow_and_bf16_where_it_is_native(cpu, caplog) -> None:  # type: ignore[no-untyped-def]
    cpu(25.0)
    with caplog.at_level(logging.INFO, logger="eagleforge.precision"):
        slow = choose("model.dtype", "auto", CPU)
    assert slow.dtype == torch.float32 and "bf16 runs 25.0x slower than fp32" in slow.why
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("precision: model.dtype=auto -> float32 (bf16 runs 25.0x slower")
    cpu(0.5)
    fast = choose("trainer.compute_dtype", "auto", CPU)
    assert fast.dtype == torch.bfloat16 and "2.0x faster" in fast.why
    # even: fp32 is exact and costs nothing
    cpu(0.95)
    assert choose("model.dtype", "auto", CPU).dtype == torch.float32
    assert choose("model.dtype", "auto", torch.device("cuda")).dtype == torch.bfloat16


def test_pinned_cpu_kind_overrides_the_measurement(cpu, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    cpu(0.5)
    monkeypatch.setenv(PIN_ENV, "0")
    chosen = choose("model.dtype", "auto", CPU)
    assert chosen.dtype == torch.float32 and PIN_ENV in chosen.why
    monkeypatch.setenv(PIN_ENV, "1")
    cpu(25.0)
    assert choose("model.dtype", "auto", CPU).dtype == torch.bfloat16


def test_bf16_asked_on_a_slow_cpu_warns_once_with_the_ratio_and_runs(
    cpu, caplog, tmp_path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    cpu(31.4)
    monkeypatch.setenv(GUARD_ENV, str(tmp_path / "guard"))
    with caplog.at_level(logging.INFO, logger="eagleforge.precision"):
        first = choose("trainer.compute_dtype", "bfloat16", CPU)
        choose("trainer.compute_dtype", "bfloat16", CPU)
    assert first.dtype == torch.bfloat16 and first.why == "as asked"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "trainer.compute_dtype=bfloat16: bf16 runs 31.4x slower than fp32 on this CPU "
        f"({cpu_bf16().units}); trainer.compute_dtype=auto would compute in float32. "
        "Going on as asked."
    ]
    # the test suite's guard hears of it
    assert [p.name.split("-", 1)[1] for p in (tmp_path / "guard").iterdir()] == [
        "trainer.compute_dtype"
    ]


def test_measured_once_per_machine_and_again_under_an_isa_cap(cpu, monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    calls = cpu(0.4)
    assert cpu_bf16().slowdown == 0.4
    cpu_bf16.cache_clear()  # a new process: the cache file answers
    assert cpu_bf16().slowdown == 0.4 and calls == [0.4]
    (entry,) = json.loads((tmp_path / "cache" / "precision.json").read_text()).values()
    assert entry["slowdown"] == 0.4
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "SSE41")  # another CPU to the kernels
    monkeypatch.setattr(precision, "measure_cpu_bf16", lambda: calls.append(20.0) or 20.0)
    cpu_bf16.cache_clear()
    assert cpu_bf16().slowdown == 20.0 and calls == [0.4, 20.0]
    assert "ONEDNN_MAX_CPU_ISA=SSE41" in cpu_bf16().units


def test_the_measurement_tells_the_two_dtypes_apart() -> None:
    """The real probe: a positive ratio, in well under a second."""
    ratio = precision.measure_cpu_bf16()
    assert 0.01 < ratio < 1000


GUARDED = """
import time, torch
from eagleforge import precision

def _slow_cpu(monkeypatch):
    monkeypatch.setattr(precision, "measure_cpu_bf16", lambda: 30.0)
    monkeypatch.setenv("EAGLEFORGE_CACHE_DIR", "cache")
    precision.cpu_bf16.cache_clear()

def test_long_in_bf16(monkeypatch):
    _slow_cpu(monkeypatch)
    precision.choose("trainer.compute_dtype", "bfloat16", torch.device("cpu"))
    time.sleep(1.0)

def test_short_in_bf16(monkeypatch):
    _slow_cpu(monkeypatch)
    precision.choose("model.dtype", "bfloat16", torch.device("cpu"))

def test_long_in_fp32(monkeypatch):
    _slow_cpu(monkeypatch)
    precision.choose("model.dtype", "auto", torch.device("cpu"))
    time.sleep(1.0)
"""


def test_the_suite_guard_fails_a_test_long_in_bf16_on_a_cpu_without_it(tmp_path: Path) -> None:
    """tests/conftest.py's guard, run on a suite of three: the one that computes in bf16 on a
    slow-bf16 CPU for longer than the limit fails, naming itself; the others pass."""
    import os
    import shutil
    import subprocess
    import sys

    shutil.copy(Path(__file__).parents[1] / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_guarded.py").write_text(GUARDED)
    env = {**os.environ, "EAGLEFORGE_BF16_GUARD_S": "0.5"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
         "-o", "addopts=", "test_guarded.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed, 2 passed" in done.stdout
    assert (
        "bf16 guard: test_guarded.py::test_long_in_bf16 computed in bf16 (trainer.compute_dtype)"
        in done.stdout
    )


FLUSHED_ON_EVERY_THREAD = """
import torch
from eagleforge.parallel import ParallelConfig, resolve_device
from eagleforge.precision import choose
resolve_device(ParallelConfig(device="cpu", num_threads=2))
tiny = torch.full((1024, 512), 2.0**-130)  # subnormal; 512 of them sum to a normal 2**-121
small = torch.full((1024, 512), 2.0**-100)  # normal: its sums are exact
ones = torch.ones(512, 1024)  # a product large enough for both threads to take a share
print(int((tiny @ ones).count_nonzero()), bool(((small @ ones) == 2.0**-91).all()))
print(choose("trainer.compute_dtype", "float32", torch.device("cpu"), say=False).why)
"""


def test_subnormals_are_flushed_to_zero_on_every_cpu_thread_and_said() -> None:
    """A CPU command's threads (OpenMP's workers too: they take the setting from the thread
    that starts them) compute subnormal floats as zero -- x86 runs them ~200x slower, and
    softmax's gradients are full of them -- and leave every normal float as it was."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", FLUSHED_ON_EVERY_THREAD],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    counts, why = done.stdout.splitlines()
    assert counts == "0 True", done.stdout
    assert why == "as asked; subnormal floats flushed to zero"
