"""Train a draft (any family: ``draft=eagle3|dflash|peagle``) for a frozen target LLM.

    python -m eagleforge.train +model=smollm2 data=chitchat [key=value ...]
    python -m eagleforge.train -m +model=tiny data=chitchat optimizer.lr=1e-4,3e-4   # sweep
    python -m eagleforge.train +model=qwen2_5_vl data=vlm data.path=/data/vlm.jsonl  # images

The components are built from the typed config (``builder.py``) and handed to the
``Trainer`` (``trainer.py``), which runs the loop.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import signal
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from eagleforge.atomic import atomic_file
from eagleforge.builder import build
from eagleforge.config import (
    EagleForgeConfig,
    check_cli_overrides,
    conf_dir,
    register_configs,
    to_typed,
)
from eagleforge.errors import (
    EagleForgeError,
    InterruptedAtTheEnd,
    ResumeRefused,
    stopped_in_one_line,
)
from eagleforge.families import Family, family_for
from eagleforge.locking import RUN_DIR_LOCK, exclusive, restore_run_records
from eagleforge.parallel.dist import World, distributed
from eagleforge.parallel.launch import is_main_process
from eagleforge.preflight import check_inputs, check_outputs
from eagleforge.profiling import StepProfiler
from eagleforge.progress import quiet_library_bars
from eagleforge.speculative.report import plot_learning_curve
from eagleforge.sweep_report import planned_jobs
from eagleforge.targets.base import release
from eagleforge.tracking import (
    MLflowTracker,
    Tracker,
    record_failure,
    record_stop,
)
from eagleforge.trainer import StopSignals, Trainer, TrainResult

log = logging.getLogger("eagleforge.train")


def run(cfg: DictConfig) -> TrainResult:
    """Build everything from a composed config and train; returns the trainer's result.

    Under torchrun/SLURM every rank runs this; the process group lives as long as the run.
    """
    config: EagleForgeConfig = to_typed(cfg)
    is_main = is_main_process()
    check_inputs(config, tracking=is_main)
    outputs = {"output_dir": config.output_dir}
    check_outputs(config, outputs, output_root=is_main, tracking=is_main)
    output_dir = Path(config.output_dir)
    with (
        exclusive(output_dir / RUN_DIR_LOCK, output=output_dir, field="output_dir")
        if is_main
        else nullcontext(),
        distributed(config.parallel) as world,
    ):
        if not world.is_main:  # one rank reports
            logging.getLogger("eagleforge").setLevel(logging.WARNING)
        return _run(cfg, config, world)


def _run(cfg: DictConfig, config: EagleForgeConfig, world: World) -> TrainResult:
    # a stop while the run is set up (engines starting: minutes) ends it in one line, its
    # engines stopped and their directories removed; the trainer takes stops from its first step
    with stopped_in_one_line(
        lambda how: (
            f"{how} while the run was being set up, before its first step: run the "
            "same command again to go on"
        )
    ):
        parts = build(cfg, config, world)
    trainer = Trainer(config.trainer, parts)
    tracker, output_dir = parts.tracker, parts.output_dir
    first_step = trainer.step
    try:
        result = trainer.train()
    finally:
        records = parts.batches.producer_records()
        release(parts.batches)  # target=vllm: its engines stop with the run, not the process
        if records is not None:
            name = f"producers_rank{world.rank}.json" if world.rank else "producers.json"
            fed = record_producers(output_dir / name, records, first_step, trainer.step)
            if world.is_main:
                tracker.log_artifact(fed)
                print(f"fed by: {describe_producers(records)} ({fed})", flush=True)
    if trainer.profiler is not None:
        report_profile(trainer.profiler, world, tracker)
    if world.is_main:
        summary = write_summary(result, output_dir / "summary.json", trainer.max_num_steps)
        tracker.log_artifact(summary)
        family = family_for(config.draft.family)
        if result.eval_by_step or result.tau_by_step:  # the learning curve
            curve = plot_learning_curve(
                result.eval_by_step,
                result.tau_by_step,
                run_title(config, output_dir),
                output_dir / "tau_by_step.png",
                family.positions,
            )
            tracker.log_artifact(curve)
        print_summary(result, tracker, family)
    tracker.close()
    return result


def record_producers(
    path: Path, records: list[dict[str, Any]], first_step: int, last_step: int
) -> Path:
    """``producers.json`` (rank r > 0: ``producers_rank<r>.json``): for each part of the run (a resumed run adds one), the
    steps it trained and what each producer of the target's states gave it."""
    parts = json.loads(path.read_text()) if path.is_file() else []
    parts.append({"first_step": first_step, "last_step": last_step, "producers": records})
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(parts, indent=2) + "\n")
    return path


def describe_producers(records: list[dict[str, Any]]) -> str:
    """One line: each producer's samples, and what stopped it on the way."""

    def one(record: dict[str, Any]) -> str:
        said = f"{record['name']} {record['samples']:,} samples"
        if record["recoveries"]:
            said += f", back {record['recoveries']}x after stopping"
        if record["handed_on"]:
            said += f", {record['handed_on']} handed on"
        return said + (", given up" if record["given_up"] else "")

    return "; ".join(one(record) for record in records)


def run_title(config: EagleForgeConfig, output_dir: Path) -> str:
    """A run in a line: its directory, target, data, draft (as its family describes it) and
    optimizer."""
    data = config.data.name + (f" ({config.data.path})" if config.data.path else "")
    draft = family_for(config.draft.family).describe(config.draft, config.loss)
    return (
        f"{output_dir.name}: {config.model.name} on {data}, {draft}, "
        f"{config.optimizer.kind.value} lr {config.optimizer.lr:g}"
    )


def report_profile(profiler: StepProfiler, world: World, tracker: Tracker) -> None:
    """Rank 0 logs every rank's trace and prints its own top-operators table."""
    world.barrier()  # every rank's trace is written
    if world.is_main and profiler.table:
        for trace in sorted(profiler.trace.parent.glob("trace_rank*.json")):
            tracker.log_artifact(trace)
        print(f"\nTop operators (rank 0, {profiler.sort_key}):\n{profiler.table}", flush=True)


def write_summary(result: TrainResult, path: Path, max_num_steps: int | None = None) -> Path:
    """``summary.json``: the run's end (paths as strings, or null): its step of
    ``max_num_steps``, and the signal that stopped it early (``stopped_by``, null when it
    ran to its end). Re-running a finished run keeps the summary that recorded its end; one
    killed before writing it gets one now."""
    if result.already_complete and path.is_file():
        try:
            if json.loads(path.read_text()).get("step") == result.step:
                return path
        except ValueError:
            pass  # unreadable: written anew
    stopped_by = result.preempted_by
    summary = {
        "step": result.step,
        "max_num_steps": max_num_steps,
        "stopped_by": signal.Signals(stopped_by).name if stopped_by is not None else None,
        "checkpoint": str(result.checkpoint) if result.checkpoint else None,
        "initial_eval": result.initial_eval,
        "final_eval": result.final_eval,
        "tau_by_step": result.tau_by_step,
        "eval_by_step": result.eval_by_step,
        "best_checkpoint": str(result.best_checkpoint) if result.best_checkpoint else None,
    }
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return path


def print_summary(result: TrainResult, tracker: object, family: Family) -> None:
    if result.already_complete:
        lines = [
            f"\nThe run is already complete (step {result.step}); nothing to do. Set "
            "trainer.max_num_steps higher to train on."
        ]
    else:
        lines = [f"\nTrained {result.step} steps."]
    final, initial = result.final_eval, result.initial_eval
    if final:
        accs = sorted(
            (int(k.rsplit("_", 1)[1]), v) for k, v in final.items() if k.startswith("eval/acc_")
        )
        lines.append(f"eval accuracy per {family.positions} (untrained -> trained):")
        for position, value in accs:
            before = initial.get(f"eval/acc_{position}")
            prefix = f"{before:.3f} -> " if before is not None else ""
            lines.append(f"  acc_{position}: {prefix}{value:.3f}")
        before_tau = f"{initial['eval/tau_sim']:.3f} -> " if "eval/tau_sim" in initial else ""
        lines.append(
            f"tau_sim (simulated acceptance length): {before_tau}{final['eval/tau_sim']:.3f}"
        )
    if result.tau_by_step:
        taus = ", ".join(f"step {k}: {v:.3f}" for k, v in result.tau_by_step.items())
        lines.append(f"real tau (speculative decoding): {taus}")
    if result.best_checkpoint is not None:
        lines.append(f"best-tau checkpoint: {result.best_checkpoint}")
    if result.checkpoint is not None:
        lines.append(f"checkpoint ({family.title} draft dir the engines load): {result.checkpoint}")
    if isinstance(tracker, MLflowTracker):
        uri = shlex.quote(tracker.tracking_uri)
        lines.append(f"browse the run: mlflow ui --backend-store-uri {uri}")
    print("\n".join(lines), flush=True)


def resume_command() -> str:
    """The command that continues this run where it stopped: the one that started it, with
    the run's directory named -- hydra.run.dir, or a sweep's hydra.sweep.dir (its finished
    jobs then do nothing, its stopped ones resume, those not run yet start) -- since by
    default every command makes a new directory. Spelled out where this process is the
    command typed (``python -m eagleforge.train``, ``eagleforge-train``); else (a submitit
    job, torchrun) as what to add to it."""
    if not HydraConfig.initialized():
        return "the same command"
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        key, directory = "hydra.sweep.dir", str(Path(hydra_cfg.sweep.dir).resolve())
    else:
        key, directory = "hydra.run.dir", str(hydra_cfg.runtime.output_dir)
    setting = hydra_override(key, directory)
    program = {"train.py": "python -m eagleforge.train", "eagleforge-train": "eagleforge-train"}
    typed = program.get(Path(sys.argv[0]).name)
    if typed is None or "TORCHELASTIC_RUN_ID" in os.environ:
        return f"the same command with {setting}"
    args = [arg for arg in sys.argv[1:] if arg.split("=", 1)[0] != key]
    return " ".join([typed, shlex.join([*args, setting])])


def hydra_override(key: str, value: str) -> str:
    """``key=value`` as Hydra reads it back to ``value``: quoted for Hydra where it would not
    (a comma makes a sweep, ``=`` and letters outside ASCII do not parse)."""
    plain = f"{key}={value}"
    try:
        if OverridesParser.create().parse_overrides([plain])[0].value() == value:
            return plain
    except OverrideParseException:
        pass
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'{key}="{escaped}"'


def stop_line(result: TrainResult) -> str:
    """What a run stopped by a signal prints once it saved: where, and what to run to go on."""
    name = signal.Signals(result.preempted_by or signal.SIGTERM).name
    where = f"stopped by {name} after step {result.step}"
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        where += f" in job {HydraConfig.get().job.num} of the sweep"
        return (
            f"{where}, checkpoint saved; to go on (this job from its checkpoint, the jobs not "
            f"run yet from the start, finished ones skipped), run: {resume_command()}"
        )
    return f"{where}, checkpoint saved; to go on from it, run: {resume_command()}"


# Exit status of a run stopped by a signal after saving: 128 + the signal, as if the signal
# had killed it, so that SLURM and submitit treat it as preempted and requeue it.
def _exit_status(result: TrainResult) -> int:
    return 128 + result.preempted_by if result.preempted_by is not None else 0


@hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    """One run, or one job of a sweep (-m). A failure is recorded in MLflow; a user error
    prints one line, its traceback going to the run's log file. In a sweep that line waits for
    the sweep's end (``SweepFailures``) and the job returns: Hydra's launchers would raise the
    first failed job's error with its traceback at the end, and sys.exit would stop the whole
    sweep here. A refused resume (``ResumeRefused``) leaves the run's record as it was: its
    ``.hydra/`` put back, no MLflow run marked failed."""
    is_main = is_main_process()  # exports a submitit job's RANK/WORLD_SIZE before typing
    try:
        result = run(cfg)
    except (Exception, KeyboardInterrupt) as e:
        if isinstance(e, ResumeRefused):  # nothing ran: the run's record stays as it was
            restore_run_records()
        else:
            record_failure(e, cfg, is_main=is_main)
        if isinstance(e, InterruptedAtTheEnd):  # the run had finished and saved
            print(
                "interrupted while the finished run's end was written to MLflow: training is "
                "complete and its last checkpoint saved; the MLflow run is marked KILLED",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(128 + signal.SIGINT)
        if isinstance(e, KeyboardInterrupt):  # Ctrl-C outside the loop, or a second one in it
            print(
                "interrupted: stopped without saving; to go on from the last checkpoint, run: "
                f"{resume_command()}",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(128 + signal.SIGINT)
        if not isinstance(e, EagleForgeError):
            raise
        log_to_file(e)
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            if is_main:
                record_job_failure(e)
            return
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    if result.preempted_by is not None:
        record_stop(result.preempted_by, cfg, is_main=is_main)
        if is_main:
            print(stop_line(result), file=sys.stderr, flush=True)
        # saved: now the launcher's own handler (submitit's requeues the job), then exit
        StopSignals.hand_on(result.preempted_by)
        sys.exit(_exit_status(result))


def log_to_file(error: BaseException) -> None:
    """``error`` with its traceback into the run's log file (Hydra's ``<run dir>/train.log``)
    only: the console gets its one line."""
    record = log.makeRecord(
        log.name,
        logging.ERROR,
        __file__,
        0,
        "ended by %s: %s",
        (type(error).__name__, error),
        (type(error), error, error.__traceback__),
    )
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


# Under a sweep's directory: one JSON file per job of the current command that a user error
# ended ({"job": n, "overrides": [...], "error": "..."}), named at the sweep's end.
FAILED_JOBS = ".failed_jobs"


def record_job_failure(error: EagleForgeError) -> None:
    """This sweep job's user error, for ``SweepFailures`` to name at the end (where the jobs
    run in other processes, under submitit, only the sweep's directory is shared). Where it
    cannot be written the line is printed now, into the job's own output."""
    hydra_cfg = HydraConfig.get()
    record = {
        "job": int(hydra_cfg.job.num),
        "overrides": [str(o) for o in hydra_cfg.overrides.task],
        "error": str(error),
    }
    path = Path(hydra_cfg.sweep.dir) / FAILED_JOBS / f"{record['job']}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as tmp:
            tmp.write_text(json.dumps(record) + "\n")
    except OSError as e:
        log.warning("could not record the failure in %s (%s)", path, e)
        print(f"error: {job_failure_line(record, None)}", file=sys.stderr, flush=True)


def job_failure_line(record: dict[str, Any], planned: list[list[str]] | None) -> str:
    """``job 0 (optimizer.lr=-1): <error>``: the job by its number and the settings that tell
    it from the sweep's other ``planned`` jobs (all its overrides where they are unknown)."""
    settings = [dict(o.split("=", 1) for o in job if "=" in o) for job in planned or []]
    varying = {k for s in settings for k in s if len({t.get(k) for t in settings}) > 1}
    overrides = record["overrides"]
    named = [o for o in overrides if o.split("=", 1)[0] in varying] or overrides
    return f"job {record['job']} ({' '.join(named)}): {record['error']}"


class SweepFailures(Callback):
    """Hydra callback (``hydra.callbacks.sweep_failures`` in ``conf/config.yaml``): a sweep in
    which user errors ended jobs ends, once every job has run, with one line per such job
    (``job_failure_line``, its traceback in the job's train.log) and exit status 1.

    Listed after ``run_dir_lock``: it clears the records of an earlier command only once this
    one holds the sweep directory, and at the end it runs first (Hydra ends callbacks in
    reverse); its exit skips the others' ends, and the lock goes with the process."""

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        shutil.rmtree(Path(config.hydra.sweep.dir) / FAILED_JOBS, ignore_errors=True)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        records = []
        for path in (sweep_dir / FAILED_JOBS).glob("*.json"):
            try:
                records.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue  # not one of these records: atomic_file leaves none torn
        if not records:
            return
        planned = planned_jobs(sweep_dir)
        for record in sorted(records, key=lambda r: int(r["job"])):
            print(f"error: {job_failure_line(record, planned)}", file=sys.stderr, flush=True)
        sys.exit(1)


def main() -> None:
    quiet_library_bars()
    register_configs()
    check_cli_overrides()
    _hydra_main()


if __name__ == "__main__":
    main()
