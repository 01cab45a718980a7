"""A Hydra sweep of `eagleforge.train -m` as one table and one figure: each job's swept
settings, its state, its final eval (loss, acc_i, τ_sim), its real τ and its learning curve.

    python -m eagleforge.sweep_report outputs/multirun/2026-12-02_19-00-00 --plot curves.png

Prints a Markdown table (the docs' sweep tables are these) and, with ``--json``, one JSON
line per job. Every job of the sweep is listed -- those it never started too (read from its
``multirun.yaml``) -- named by the settings that differ between jobs, with its state: done,
stopped by a signal at step N of M, running, failed or killed, or not run.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from eagleforge.locking import RUN_DIR_LOCK


@dataclass
class Job:
    """One job directory of a multirun: what it set and what it measured."""

    path: Path  # its directory; one the sweep never started has none yet
    overrides: list[str]
    summary: dict[str, Any] | None  # summary.json; None while running or after a kill
    label: str = ""
    swept: dict[str, str] = field(default_factory=dict)
    started: bool = True  # False: the sweep stopped before this job began

    @property
    def max_num_steps(self) -> int | None:
        """The steps the job was to train: its summary's, else its config's (null there when
        it trains by epochs)."""
        recorded = (self.summary or {}).get("max_num_steps")
        if recorded is not None:
            return int(recorded)
        config = self.path / ".hydra" / "config.yaml"
        if not config.is_file():
            return None
        trainer = (yaml.safe_load(config.read_text()) or {}).get("trainer") or {}
        steps = trainer.get("max_num_steps")
        return steps if isinstance(steps, int) else None

    @property
    def state(self) -> str:
        """done, stopped by SIGTERM at step 8 of 351, running, failed or killed, not run."""
        if not self.started:
            return "not run"
        if _running(self.path):  # a resumed job too, whose summary is its stop's
            return "running"
        total = self.max_num_steps
        of = f" of {total}" if total is not None else ""
        if self.summary is not None:
            step, stopped_by = self.summary.get("step"), self.summary.get("stopped_by")
            if stopped_by:
                return f"stopped by {stopped_by} at step {step}{of}"
            if total is not None and step is not None and step < total:
                return f"stopped at step {step}{of}"  # a summary from before stopped_by
            return "done"
        steps = [
            int(p.name[5:]) for p in self.path.glob("checkpoints/step_*") if p.name[5:].isdigit()
        ]
        saved = f"last checkpoint at step {max(steps)}{of}" if steps else "no checkpoint"
        return f"failed or killed ({saved}; see its train.log)"

    @property
    def final_eval(self) -> dict[str, float]:
        return (self.summary or {}).get("final_eval") or {}

    @property
    def tau_sim_by_step(self) -> list[tuple[int, float]]:
        history = (self.summary or {}).get("eval_by_step") or {}
        return sorted(
            (int(step), metrics["eval/tau_sim"])
            for step, metrics in history.items()
            if "eval/tau_sim" in metrics
        )

    @property
    def tau_by_step(self) -> list[tuple[int, float]]:
        return sorted(
            (int(k), v) for k, v in ((self.summary or {}).get("tau_by_step") or {}).items()
        )


def _running(job_dir: Path) -> bool:
    """A live process holds the job's run-directory lock (eagleforge.locking)."""
    try:
        fd = os.open(job_dir / RUN_DIR_LOCK, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False  # a filesystem without flock: nothing to tell
    finally:
        os.close(fd)  # drops the lock, if taken
    return False


def planned_jobs(sweep_dir: Path) -> list[list[str]] | None:
    """The overrides of every job the sweep was to run, in job order, as Hydra's basic sweeper
    expands the command line (``a=1,2 b=x,y``: four jobs) recorded in ``multirun.yaml``; None
    when there is none, or another sweeper chose the jobs."""
    path = sweep_dir / "multirun.yaml"
    if not path.is_file():
        return None
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    hydra_cfg = (yaml.safe_load(path.read_text()) or {}).get("hydra") or {}
    sweeper = hydra_cfg.get("sweeper") or {}
    if not str(sweeper.get("_target_", "")).endswith("BasicSweeper"):
        return None
    params = sweeper.get("params") or {}
    task = (hydra_cfg.get("overrides") or {}).get("task") or []
    arguments = [f"{k}={v}" for k, v in params.items()] + [str(t) for t in task]
    try:
        batches = BasicSweeper.split_arguments(
            OverridesParser.create().parse_overrides(arguments), None
        )
    except Exception:  # a sweep of config files (glob) needs Hydra's config loader
        return None
    return [list(job) for batch in batches for job in batch]


def read_jobs(sweep_dir: Path) -> list[Job]:
    """The jobs of a multirun directory in job order -- those the sweep never started too --
    each labelled by the settings that differ between jobs."""
    jobs = []
    for path in sorted(
        (p for p in sweep_dir.iterdir() if (p / ".hydra" / "overrides.yaml").is_file()),
        key=_job_order,
    ):
        overrides = yaml.safe_load((path / ".hydra" / "overrides.yaml").read_text()) or []
        summary_path = path / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
        jobs.append(Job(path, [str(o) for o in overrides], summary))
    seen = {tuple(job.overrides) for job in jobs}
    for number, planned in enumerate(planned_jobs(sweep_dir) or []):
        if tuple(planned) not in seen:
            jobs.append(Job(sweep_dir / str(number), planned, None, started=False))
    jobs.sort(key=lambda job: _job_order(job.path))
    if not jobs:
        raise SystemExit(
            f"{sweep_dir}: no job directories (with .hydra/overrides.yaml); give the directory "
            "a `python -m eagleforge.train -m ...` sweep wrote (hydra.sweep.dir)."
        )
    settings = [dict(o.split("=", 1) for o in job.overrides if "=" in o) for job in jobs]
    keys = sorted({k for s in settings for k in s})
    varying = [k for k in keys if len({s.get(k) for s in settings}) > 1]
    for job, setting in zip(jobs, settings, strict=True):
        job.swept = {k: setting.get(k, "(default)") for k in varying}
        job.label = " ".join(f"{k}={v}" for k, v in job.swept.items()) or job.path.name
    return jobs


def _job_order(path: Path) -> tuple[bool, int, str]:
    """Job directories by job number (10 after 9), others after them by name."""
    return (not path.name.isdigit(), int(path.name) if path.name.isdigit() else 0, path.name)


def _fmt(value: float | None, digits: int = 3) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def rows(jobs: list[Job]) -> list[dict[str, Any]]:
    """One row per job: its settings and measurements (None where not measured)."""
    out = []
    for job in jobs:
        final = job.final_eval
        accs = sorted(
            (int(k.rsplit("_", 1)[1]), v) for k, v in final.items() if k.startswith("eval/acc_")
        )
        taus = job.tau_by_step
        out.append(
            {
                "job": job.path.name,
                "settings": job.swept,
                "overrides": job.overrides,
                "state": job.state,
                "done": job.state == "done",
                "step": (job.summary or {}).get("step"),
                "max_num_steps": job.max_num_steps,
                "eval_loss": final.get("eval/loss"),
                "eval_acc": [v for _, v in accs],
                "eval_tau_sim": final.get("eval/tau_sim"),
                "eval_tau_sim_by_step": job.tau_sim_by_step,
                "real_tau_last": taus[-1][1] if taus else None,
                "real_tau_best": max((t for _, t in taus), default=None),
            }
        )
    return out


def markdown(table: list[dict[str, Any]]) -> str:
    lines = [
        "| run | state | steps | eval loss | eval acc_i | eval τ_sim by eval | eval τ_sim | real τ (last / best) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in table:
        label = " ".join(f"{k}={v}" for k, v in row["settings"].items()) or row["job"]
        if row["step"] is None:  # no summary: nothing measured to show
            lines.append(f"| {label} | {row['state']} | | | | | | |")
            continue
        curve = ", ".join(_fmt(t, 2) for _, t in row["eval_tau_sim_by_step"])
        real = (
            f"{_fmt(row['real_tau_last'])} / {_fmt(row['real_tau_best'])}"
            if row["real_tau_last"] is not None
            else ""
        )
        lines.append(
            f"| {label} | {row['state']} | {row['step']} | {_fmt(row['eval_loss'])} | "
            f"{' / '.join(_fmt(a) for a in row['eval_acc'])} | {curve} | "
            f"{_fmt(row['eval_tau_sim'])} | {real} |"
        )
    return "\n".join(lines)


def plot(jobs: list[Job], path: Path, title: str) -> Path:
    """eval τ_sim against the step, one line per job, its real-τ measurements as crosses in
    the same colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for job in jobs:
        curve = job.tau_sim_by_step
        if not curve:
            continue
        (line,) = ax.plot([s for s, _ in curve], [t for _, t in curve], marker="o", label=job.label)
        real = job.tau_by_step
        if real:
            ax.plot([s for s, _ in real], [t for _, t in real], "x", color=line.get_color(), ms=9)
    ax.set_xlabel("training step")
    ax.set_ylabel("τ (lines: eval τ_sim; crosses: real τ)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eagleforge.sweep_report", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("sweep_dir", type=Path, help="the multirun directory of the sweep")
    parser.add_argument("--plot", type=Path, help="write the learning curves to this PNG")
    parser.add_argument("--json", action="store_true", help="also print one JSON line per job")
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        parser.error(f"{args.sweep_dir}: no such directory")
    jobs = read_jobs(args.sweep_dir)
    table = rows(jobs)
    print(markdown(table))
    if args.json:
        for row in table:
            print(json.dumps(row))
    if args.plot:
        print(f"learning curves: {plot(jobs, args.plot, str(args.sweep_dir))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
