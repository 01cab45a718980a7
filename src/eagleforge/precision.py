"""What ``auto`` precision means on the machine a command runs on, and why.

bfloat16 on CUDA, and on a CPU that computes it natively (bf16 matrix units: avx512_bf16,
AMX); float32 on every other CPU (AVX2 only: most laptops), where bf16 runs tens of times
slower than fp32. The CPU's answer is measured, not assumed: one small matrix product timed in
both dtypes, once per machine, and cached under eagleforge's cache directory keyed by the CPU,
torch's version and the ISA caps in the environment (``ATEN_CPU_CAPABILITY``,
``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``: how ``make test CPU=avx2`` reproduces an
AVX2-only CPU on an AVX-512 one), so that a capped run measures the CPU it gets::

    python -m eagleforge.precision      # this machine's bf16 / fp32 ratio and what auto picks

``EAGLEFORGE_CPU_BF16=0`` (or ``1``) tells auto that this CPU lacks (or has) native bf16 without
asking the measurement: the test suite sets 0, so that its runs compute alike on every CPU.

Every setting that takes ``auto`` (model.dtype, trainer.compute_dtype, and through model.dtype
the regenerate and evaluate decoders and the engines eagleforge starts) resolves here: the
command says what it chose and why in one line, and a bf16 asked for on a CPU without it runs
as asked after one warning line with the measured ratio.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from eagleforge.atomic import atomic_file
from eagleforge.files import resolve_cache_dir

log = logging.getLogger(__name__)

# auto picks bf16 on a CPU only where it runs at least this much faster than fp32: where the
# two are even, fp32 is exact (lossless speculative decoding) and costs nothing
BF16_MIN_SPEEDUP = 1.15
# bf16 asked for where it runs this many times slower than fp32 gets a warning
BF16_SLOW = 1.5
# the environment variables that cap what the CPU kernels use (an AVX2-only CPU reproduced on an
# AVX-512 one): part of the cache key
ISA_ENV = (
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
)
# the test suite's guard (tests/conftest.py): where a process records the bf16 it computes on
# a CPU without native bf16
GUARD_ENV = "EAGLEFORGE_BF16_GUARD"
# 0 / 1: what auto takes this CPU to have, instead of the measurement
PIN_ENV = "EAGLEFORGE_CPU_BF16"
CACHE_FILE = "precision.json"
CACHE_VERSION = 1


@dataclass(frozen=True)
class CpuBf16:
    """How this CPU computes bf16: ``slowdown`` is a bf16 matrix product's time over fp32's."""

    slowdown: float
    # the CPU's own flags (cpuinfo): avx512_bf16 or AMX
    units: str

    @property
    def fast(self) -> bool:
        """Measured: bf16 runs clearly faster than fp32 here."""
        return self.slowdown * BF16_MIN_SPEEDUP <= 1.0

    @property
    def native(self) -> bool:
        """What auto takes: $EAGLEFORGE_CPU_BF16 where set, else the measurement."""
        pinned = os.environ.get(PIN_ENV, "").strip()
        return pinned == "1" if pinned in ("0", "1") else self.fast

    def describe(self) -> str:
        if self.slowdown >= 1.0:
            said = f"bf16 runs {self.slowdown:.1f}x slower than fp32 on this CPU ({self.units})"
        else:
            said = f"bf16 runs {1 / self.slowdown:.1f}x faster than fp32 on this CPU ({self.units})"
        if self.native != self.fast:
            said += f", taken as {'native' if self.native else 'not native'} ({PIN_ENV})"
        return said


@dataclass(frozen=True)
class Precision:
    """A setting's dtype on this machine, and the one line that says why."""

    setting: str
    asked: str
    dtype: torch.dtype
    why: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def record(self) -> dict[str, str]:
        return {"asked": self.asked, "dtype": self.name, "why": self.why}


def _cpu_flags() -> tuple[str, str]:
    """The CPU's model name and flags, as /proc/cpuinfo gives them (empty elsewhere)."""
    model, flags = platform.processor(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("", platform.machine()):
                model = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = value.strip()
            if model and flags:
                break
    except OSError:
        pass
    return model, flags


def _units(flags: str) -> str:
    have = [f for f in ("avx512_bf16", "amx_bf16") if f in flags.split()]
    capped = [f"{k}={os.environ[k]}" for k in ISA_ENV if os.environ.get(k)]
    text = "+".join(have) if have else "no avx512_bf16 or AMX"
    return f"{text}, capped by {' '.join(capped)}" if capped else text


def machine_key() -> str:
    """This machine to its kernels: the CPU's name and flags, torch's version, the ISA caps."""
    model, flags = _cpu_flags()
    isa = "|".join(f"{k}={os.environ.get(k, '')}" for k in ISA_ENV)
    text = f"{CACHE_VERSION}|{model}|{flags}|{torch.__version__}|{isa}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def measured_once(file: str, key: str, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``measure()``'s answer for ``key`` on this machine: read from ``file`` in eagleforge's
    cache where measured before (by any process), else measured now and stored there. An
    unwritable cache measures again next time."""
    path = resolve_cache_dir(None) / file
    entry = f"{machine_key()}/{key}"
    try:
        cached = json.loads(path.read_text()).get(entry)
    except (OSError, ValueError, AttributeError):
        cached = None
    if isinstance(cached, dict):
        return cached
    found = measure()
    try:
        entries = json.loads(path.read_text()) if path.is_file() else {}
        entries = entries if isinstance(entries, dict) else {}
        entries[entry] = {**found, "cpu": _cpu_flags()[0], "torch": torch.__version__}
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as tmp:
            tmp.write_text(json.dumps(entries, indent=1) + "\n")
    except (OSError, ValueError):
        pass
    return found


def _time(fn: object, budget_s: float) -> float:
    """The best of a few timed calls of ``fn`` after one warm-up, stopping once ``budget_s``
    is spent (a slow bf16 needs one call to tell)."""
    assert callable(fn)
    started = time.perf_counter()
    fn()
    best = time.perf_counter() - started
    for _ in range(4):
        if time.perf_counter() - started > budget_s:
            break
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_cpu_bf16() -> float:
    """A Linear's two products, ``x @ w.T`` and ``x @ w`` (its forward and its input's
    gradient), at [64 x 512] x [512 x 512], in bf16 over fp32: best of a few, on one thread
    (a second one's start-up drowns a product this small). The untransposed one is what falls to a scalar loop on a CPU without bf16
    units (~100x); ~0.2 s where bf16 is slow, a few ms where it is native."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 512, generator=generator)
    w = torch.randn(512, 512, generator=generator)
    xb, wb = x.bfloat16(), w.bfloat16()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            fp32 = _time(lambda: (x @ w.T, x @ w), 0.05)
            bf16 = _time(lambda: (xb @ wb.T, xb @ wb), 0.05)
    finally:
        torch.set_num_threads(threads)
    return bf16 / max(fp32, 1e-9)


@lru_cache(maxsize=1)
def cpu_bf16() -> CpuBf16:
    """This CPU's bf16 against fp32: measured once per machine (and ISA caps), then read from
    the cache."""
    found = measured_once(CACHE_FILE, "bf16", lambda: {"slowdown": measure_cpu_bf16()})
    slowdown = found.get("slowdown")
    if not isinstance(slowdown, (int, float)):  # a damaged entry
        slowdown = measure_cpu_bf16()
    return CpuBf16(float(slowdown), _units(_cpu_flags()[1]))


def flush_subnormals() -> None:
    """Has this process's CPU threads flush subnormal floats (below 1.2e-38) to zero. An x86
    CPU computes them through microcode, ~200x slower than normal ones, and softmax makes them:
    attention's far-away probabilities, then their gradients, so that a trained draft's
    step ran 1.5x slower (docs/performance.md#cpu-kinds). No value above 1.2e-38 changes.
    Called before the first thread count is set: OpenMP's worker threads take the setting from
    the thread that starts them."""
    global SUBNORMALS_FLUSHED
    SUBNORMALS_FLUSHED = torch.set_flush_denormal(True)


# whether flush_subnormals took (the CPU supports it): said with the CPU's precision
SUBNORMALS_FLUSHED = False
_said: set[tuple[str, str, str]] = set()


def choose(setting: str, asked: str, device: torch.device, *, say: bool = True) -> Precision:
    """``asked`` (auto | float32 | bfloat16 | float16) for ``setting`` resolved on ``device``.
    Says so once per process (``say``; ``announce`` says several in one line): what auto chose
    and why, or a warning where bf16 is asked for on a CPU that runs it slowly."""
    cpu = cpu_bf16() if device.type == "cpu" else None
    if asked != "auto":
        dtype, why = getattr(torch, asked), "as asked"
    elif cpu is None:
        dtype, why = torch.bfloat16, f"auto on {device.type}"
    else:
        dtype, why = (torch.bfloat16 if cpu.native else torch.float32), cpu.describe()
    if cpu is not None and SUBNORMALS_FLUSHED:
        why += "; subnormal floats flushed to zero"
    chosen = Precision(setting, asked, dtype, why)
    if cpu is not None and dtype == torch.bfloat16 and not cpu.fast:
        _guard(chosen)
        if (setting, asked, device.type) not in _said and cpu.slowdown >= BF16_SLOW:
            _said.add((setting, asked, device.type))
            log.warning(
                "%s=%s: %s; %s=auto would compute in float32. Going on as asked.",
                setting, asked, cpu.describe(), setting,
            )  # fmt: skip
    if say:
        announce(chosen, device=device)
    return chosen


def announce(*chosen: Precision, device: torch.device) -> None:
    """One line for the settings not said yet in this process: what each computes in, why."""
    new = [c for c in chosen if (c.setting, c.asked, device.type) not in _said]
    if not new:
        return
    _said.update((c.setting, c.asked, device.type) for c in new)
    settings = ", ".join(f"{c.setting}={c.asked} -> {c.name}" for c in new)
    reasons = sorted({c.why for c in new}, key=[c.why for c in new].index)
    log.info("precision: %s (%s)", settings, "; ".join(reasons))


def _guard(chosen: Precision) -> None:
    """Under the test suite's guard, note that this process computes in bf16 on a CPU without
    native bf16 (tests/conftest.py fails a test that does so for more than a few seconds)."""
    where = os.environ.get(GUARD_ENV)
    if not where:
        return
    try:
        Path(where).mkdir(parents=True, exist_ok=True)
        note = Path(where) / f"{os.getpid()}-{chosen.setting}"
        note.write_text(json.dumps({"setting": chosen.setting, "since": time.time()}) + "\n")
    except OSError:
        pass


def main() -> int:
    cpu = cpu_bf16()
    print(f"{cpu.describe()}: auto computes in {'bfloat16' if cpu.native else 'float32'}")
    if torch.cuda.is_available():
        print("CUDA: auto computes in bfloat16")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
