"""conf/hydra/launcher/: the SLURM launcher writes one task per GPU and asks for the requeue
signal, its CPU shape (slurm_cpu) one task of one core and no GPU; every launcher file composes
with the installed hydra-submitit-launcher."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig

from eagleforge.config import conf_dir, register_configs

pytestmark = pytest.mark.unit

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")


@pytest.fixture(autouse=True)
def _no_hydra_config_left() -> Iterator[None]:
    """The launchers resolve ${hydra:...} through HydraConfig: unset it after each test, so
    that no later test believes it runs inside a Hydra job."""
    yield
    HydraConfig.instance().cfg = None  # type: ignore[assignment]


def launcher_config(name: str, *overrides: str) -> DictConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=["+model=tiny", "data=chitchat", f"hydra/launcher={name}", *overrides],
            return_hydra_config=True,
        )
    HydraConfig.instance().set_config(cfg)
    return cfg


def sbatch_script(cfg: DictConfig, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """The sbatch script and executor hydra-submitit-launcher builds from ``cfg`` for one job
    (submission itself is stubbed out; submitit only needs an `srun` on PATH)."""
    import submitit

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{Path('/usr/bin')}:{Path('/bin')}")
    built: dict[str, Any] = {}

    def no_submission(self: Any, fn: Any, *iterables: Any) -> list[Any]:
        built["executor"] = self._executor
        return []

    monkeypatch.setattr(submitit.AutoExecutor, "map_array", no_submission)
    launcher = instantiate(cfg.hydra.launcher)
    launcher.setup(hydra_context=None, task_function=None, config=cfg)
    launcher.launch([["optimizer.lr=1e-4"]], initial_job_idx=0)
    executor = built["executor"]
    return executor._make_submission_file_text(
        "python -u -m submitit.core._submit x", "x"
    ), executor


def test_slurm_launcher_runs_one_task_per_gpu_and_requeues(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cfg = launcher_config(
        "slurm",
        "hydra.launcher.partition=gpu",
        "hydra.launcher.account=proj",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )
    script, executor = sbatch_script(cfg, monkeypatch, tmp_path)
    for line in (
        "#SBATCH --nodes=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --cpus-per-task=8",
        "#SBATCH --mem=480GB",
        "#SBATCH --time=1440",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj",
        "#SBATCH --signal=USR2@300",
        "export OMP_NUM_THREADS=8",
    ):
        assert line in script.splitlines(), (line, script)
    assert executor.max_num_timeout == 20
    assert str(tmp_path / "sweep" / ".submitit") in str(executor.folder)
    assert [p for p in tmp_path.rglob("*") if "%" in p.name] == []


def test_tasks_follow_gpus_per_node(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cfg = launcher_config(
        "slurm",
        "hydra.launcher.gpus_per_node=4",
        "hydra.launcher.nodes=2",
        f"hydra.sweep.dir={tmp_path}",
    )
    script, _ = sbatch_script(cfg, monkeypatch, tmp_path)
    assert "#SBATCH --ntasks-per-node=4" in script and "#SBATCH --nodes=2" in script


def test_local_launcher_composes() -> None:
    launcher = launcher_config("local").hydra.launcher
    assert launcher._target_.endswith("LocalLauncher")
    assert (launcher.tasks_per_node, launcher.gpus_per_node, launcher.timeout_min) == (1, 0, 60)


def test_local_launcher_keeps_submitit_files_in_the_sweep_dir(tmp_path: Path) -> None:
    """submitit's local controller creates its folder before substituting the job id, so a
    `%j` in it would leave an empty literal `%j` directory behind."""
    import submitit

    launcher = launcher_config("local", f"hydra.sweep.dir={tmp_path / 'sweep'}").hydra.launcher
    executor = submitit.AutoExecutor(folder=launcher.submitit_folder, cluster="local")
    executor.update_parameters(timeout_min=1)
    job = executor.submit(sum, [1, 2])
    assert job.result() == 3
    assert [p for p in tmp_path.rglob("*") if "%" in p.name] == []
    assert (tmp_path / "sweep" / ".submitit" / f"{job.job_id}_0_log.out").is_file()


def test_slurm_cpu_launcher_asks_for_one_core_and_no_gpu(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """hydra/launcher=slurm_cpu: what `make slurm`'s cluster (and any CPU partition) can run,
    with slurm.yaml's requeue settings."""
    cfg = launcher_config("slurm_cpu", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.gpus_per_node, launcher.tasks_per_node, launcher.cpus_per_task) == (0, 1, 1)
    assert (launcher.mem_gb, launcher.timeout_min, launcher.partition) == (4, 60, None)
    assert (launcher.signal_delay_s, launcher.max_num_timeout) == (300, 20)
    script, executor = sbatch_script(cfg, monkeypatch, tmp_path)
    lines = script.splitlines()
    for line in (
        "#SBATCH --gpus-per-node=0",  # accepted where no node has GPUs (make slurm's)
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=1",
        "#SBATCH --mem=4GB",
        "#SBATCH --time=60",
        "#SBATCH --signal=USR2@300",
        "export OMP_NUM_THREADS=1",
    ):
        assert line in lines, (line, script)
    assert "--gres" not in script
    assert "#SBATCH --partition" not in script  # the cluster's default partition
    assert executor.max_num_timeout == 20
