"""The built wheel carries the Hydra config tree, and an installed package composes from it."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from eagleforge.config import group_choices

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


def test_wheel_composes_its_own_configs(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(REPO),
        ],
        check=True,
    )
    (wheel,) = (tmp_path / "dist").glob("eagleforge-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "eagleforge/conf/config.yaml" in names
    assert "eagleforge/conf/model/smollm2.yaml" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)

    probe = (
        "from eagleforge.config import compose_config, conf_dir, to_typed\n"
        "print(conf_dir())\n"
        "cfg = to_typed(compose_config(['+model=llama3', 'data=chitchat', 'output_dir=x']))\n"
        "print(cfg.model.path)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        check=True,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        cwd=tmp_path,
    ).stdout.split("\n")
    assert out[0] == str(site / "eagleforge" / "conf")
    assert out[1] == "meta-llama/Llama-3.1-8B-Instruct"


def test_cli_without_model_prints_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "eagleforge.train", "data=chitchat", f"output_root={tmp_path}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: No target model chosen: add +model=NAME to the command, one of: "
        f"{', '.join(group_choices('model'))}."
    ]
    assert "llama3, llama3_70b" in proc.stderr  # every conf/model entry, sorted
