"""Enum config fields accept the spelling the docs use: OmegaConf checks them by member *name*,
so every member's name must equal its value."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from enum import Enum

import pytest
from omegaconf import OmegaConf

import eagleforge
from eagleforge.config import compose_config, to_typed
from eagleforge.data.config import OnError

pytestmark = pytest.mark.unit


# loaded by vLLM in its own environment (it imports vllm), never in eagleforge's
ENGINE_SIDE = {"eagleforge.engine.capture_connector"}


def _enums() -> list[type[Enum]]:
    found: dict[str, type[Enum]] = {}
    for info in pkgutil.walk_packages(eagleforge.__path__, "eagleforge."):
        if info.name in ENGINE_SIDE:
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, Enum)
                and value.__module__ == info.name
            ):
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return list(found.values())


def test_every_enum_member_is_named_by_its_value() -> None:
    enums = _enums()
    assert OnError in enums
    wrong = [f"{e.__name__}.{m.name}={m.value!r}" for e in enums for m in e if m.name != m.value]
    assert not wrong, f"members whose name (what OmegaConf accepts) differs from the value: {wrong}"


def test_on_error_raise_is_accepted_and_shown_as_documented() -> None:
    cfg = compose_config(["+model=tiny", "data=chitchat", "data.on_error=raise", "output_dir=x"])
    assert to_typed(cfg).data.on_error == OnError("raise")
    assert "on_error: raise\n" in OmegaConf.to_yaml(cfg)


def test_train_cfg_job_prints_on_error_raise() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "eagleforge.train", "+model=tiny", "data=chitchat",
         "data.on_error=raise", "--cfg", "job"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "  on_error: raise\n" in proc.stdout
