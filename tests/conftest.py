"""Shared fixtures. Tests run offline and build models and tokenized data into a cache dir
(``$EAGLEFORGE_CACHE_DIR``, default ``<repo>/.cache/eagleforge``), reused across runs; the
llama-server ``make llamacpp`` built is found in the machine's cache."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
if not os.environ.get("EAGLEFORGE_LLAMA_SERVER"):
    # `make llamacpp` builds llama-server once per machine into the machine's cache, which the
    # tests' own cache (below) does not hold: the tests run that one
    from eagleforge.engine.llamacpp_build import find_server

    _machine_cache = os.environ.get("EAGLEFORGE_CACHE_DIR") or Path.home() / ".cache" / "eagleforge"
    _server = find_server(_machine_cache)
    if _server is not None:
        os.environ["EAGLEFORGE_LLAMA_SERVER"] = str(_server)
os.environ.setdefault("EAGLEFORGE_CACHE_DIR", str(REPO / ".cache" / "eagleforge"))
# auto precision computes alike on every CPU kind in the tests: fp32 (eagleforge/precision.py);
# a test of auto itself sets its own
os.environ.setdefault("EAGLEFORGE_CPU_BF16", "0")
# and draft.attention=auto takes sdpa rather than the faster one measured on this CPU
os.environ.setdefault("EAGLEFORGE_ATTENTION_AUTO", "sdpa")
# The bf16 guard: a test that computes in bf16 on a CPU without native bf16 (where it runs ~25x
# slower than fp32) for longer than this fails, naming itself; its processes say so through
# eagleforge.precision's notes in GUARD_DIR.
BF16_GUARD_S = float(os.environ.get("EAGLEFORGE_BF16_GUARD_S", "10"))
GUARD_DIR = Path(tempfile.gettempdir()) / f"eagleforge-bf16-guard-{os.getpid()}"
os.environ["EAGLEFORGE_BF16_GUARD"] = str(GUARD_DIR)
SETUP_S = pytest.StashKey[float]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    shutil.rmtree(GUARD_DIR, ignore_errors=True)  # this test's notes alone
    yield
    shutil.rmtree(GUARD_DIR, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    outcome = yield
    report = outcome.get_result()
    if report.when == "setup":
        item.stash[SETUP_S] = report.duration
    if report.when != "call" or not report.passed or not GUARD_DIR.is_dir():
        return
    spent = item.stash.get(SETUP_S, 0.0) + report.duration
    settings = sorted({note.name.split("-", 1)[-1] for note in GUARD_DIR.iterdir()})
    if settings and spent > BF16_GUARD_S:
        from eagleforge.precision import cpu_bf16

        report.outcome = "failed"
        report.longrepr = (
            f"bf16 guard: {item.nodeid} computed in bf16 ({', '.join(settings)}) for "
            f"{spent:.0f} s on a CPU without native bf16 ({cpu_bf16().describe()}); over "
            f"{BF16_GUARD_S:.0f} s: train what only needs a trained draft in auto precision, "
            "and keep bf16 semantics at a size that fits"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


# The tiers whose tests share what is costly to start -- an engine's server, a draft trained
# for it, the SLURM cluster -- through module and session fixtures.
SHARING_TIERS = ("tests/engine/", "tests/slurm/")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With ``--dist loadgroup`` (``make test``), each module of the sharing tiers is one unit
    of work: its tests run on one worker, which starts its fixtures once, and, units being
    handed out largest first, they start first -- their waits on engines and slurmctld overlap
    the other tiers' work on the other worker. (A module-wide ``xdist_group`` mark would say
    the same, but pytest-xdist 3.8 cannot put its group into pytest 9.2's node ids.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class SharedFixtureScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module.startswith(SHARING_TIERS) else super()._split_scope(nodeid)

    return SharedFixtureScheduling(config, log)


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    path = Path(os.environ["EAGLEFORGE_CACHE_DIR"])
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def smollm2_dir(cache_dir: Path) -> Path:
    """The bundled SmolLM2-135M-Instruct as an HF directory (converted once, ~20 s)."""
    from eagleforge.targets.source import bundled_smollm2_dir

    return bundled_smollm2_dir(cache_dir)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(autouse=True)
def _no_tracker_between_tests() -> Iterator[None]:
    """``MLflowTracker.last`` (the run record_failure and record_stop mark) is the process's:
    forget it after every test, so that no test marks another test's run -- under
    pytest-xdist a worker runs tests in any order."""
    yield
    tracking = sys.modules.get("eagleforge.tracking")
    if tracking is not None:
        tracking.MLflowTracker.last = None


@pytest.fixture(autouse=True)
def _no_mlflow_uri_between_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    """mlflow.set_tracking_uri exports MLFLOW_TRACKING_URI: undo it after every test, so that
    no test logs into another test's store."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "unset")
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
