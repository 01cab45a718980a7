"""launchers/slurm.sbatch submitted to a stand-in for sbatch, with stand-ins for srun and
scontrol: SLURM's checks before the job starts pass, its tasks form one 2-rank gloo world, and
SIGUSR1 before the time limit saves, exits 138 and requeues."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.processes import descendants
from helpers.runs import TINY_RUN, with_extras

pytestmark = pytest.mark.dist
REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "launchers" / "slurm.sbatch"
JOB_ID = "4242"

# sbatch as far as the start of a job goes: the options of the #SBATCH lines (up to the first
# command, as SLURM reads them) and those before the script (which win); the job's --output
# and --error files open in its working directory before the script runs, and SLURM fails
# the job when their directory does not exist (it creates none). Then the script runs here,
# in the foreground, with the job's SLURM_* variables, its output copied to the --output file
# and to stdout, and sbatch exits with the job's status.
FAKE_SBATCH = f"""#!{sys.executable}
import os, subprocess, sys
from pathlib import Path

args, options = sys.argv[1:], {{}}


def take(option):
    if not option.startswith("--"):
        sys.exit(f"fake sbatch: write options as --name[=value], got {{option!r}}")
    name, _, value = option[2:].partition("=")
    options[name] = value


script = next(a for a in args if not a.startswith("-"))
script_args = args[args.index(script) + 1 :]
for line in Path(script).read_text().splitlines()[1:]:
    if line.startswith("#SBATCH"):
        take(line.split(None, 1)[1])
    elif line.strip() and not line.startswith("#"):
        break
for option in args[: args.index(script)]:
    take(option)
job_id, name = os.environ.get("FAKE_SLURM_JOB_ID", "{JOB_ID}"), options.get("job-name", "sbatch")
workdir = Path(options.get("chdir", os.getcwd()))
files = {{}}
for key, default in (("output", "slurm-%j.out"), ("error", None)):
    pattern = options.get(key, default)
    if pattern is None:
        continue
    path = workdir / pattern.replace("%x", name).replace("%j", job_id)
    if not path.parent.is_dir():
        sys.exit(f"fake sbatch: job {{job_id}} fails: the directory of --{{key}}={{pattern}} "
                 f"({{path.parent}}) does not exist, and SLURM does not create it")
    files[key] = path
nodes = int(options.get("nodes", "1"))
env = dict(os.environ, SLURM_JOB_ID=job_id, SLURM_JOB_NAME=name, SLURM_SUBMIT_DIR=os.getcwd(),
           SLURM_JOB_NODELIST="localhost", SLURM_JOB_NUM_NODES=str(nodes),
           SLURM_NTASKS=str(nodes * int(options.get("ntasks-per-node", "1"))),
           SLURM_CPUS_PER_TASK=options.get("cpus-per-task", "1"))
mode = "a" if options.get("open-mode") == "append" else "w"
with open(files["output"], mode) as log:
    errors = open(files["error"], mode) if "error" in files else subprocess.STDOUT
    job = subprocess.Popen(["bash", script, *script_args], cwd=workdir, env=env,
                           stdout=subprocess.PIPE, stderr=errors, text=True)
    for line in job.stdout:
        log.write(line)
        log.flush()
        sys.stdout.write(line)
        sys.stdout.flush()
sys.exit(job.wait())
"""
# srun: start SLURM_NTASKS copies of the command with their SLURM ids; exit with the highest
# status. scontrol: the node list is this host; a requeue is written down.
FAKE_SRUN = """#!/bin/bash
shift  # --kill-on-bad-exit=0
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
    SLURM_PROCID=$i SLURM_LOCALID=$i "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid"; s=$?; (( s > status )) && status=$s; done
exit $status
"""
FAKE_SCONTROL = """#!/bin/bash
if [ "$1" = show ]; then echo 127.0.0.1; else echo "$@" >> "$REQUEUED"; fi
"""


def fake_slurm(tmp_path: Path) -> dict[str, str]:
    """The environment of a login node whose sbatch, srun and scontrol are the stand-ins."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("sbatch", FAKE_SBATCH), ("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return dict(
        env, PATH=f"{bin_dir}:{os.environ['PATH']}", RUN_DIR=str(tmp_path / "run"),
        REQUEUED=str(tmp_path / "requeued"), PYTHON=sys.executable,
    )  # fmt: skip


def start(tmp_path: Path, *overrides: str) -> subprocess.Popen[str]:
    """``sbatch`` the script from tmp_path (a submit dir with nothing in it) for 2 CPU tasks."""
    args = with_extras(TINY_RUN, "data.max_num_samples=30", "data.num_eval_samples=4",
                       "data.max_length=64", "parallel.device=cpu",
                       "trainer.log_every_n_steps=1", *overrides)  # fmt: skip
    return subprocess.Popen(
        ["sbatch", "--ntasks-per-node=2", "--cpus-per-task=1", str(SCRIPT), *args],
        cwd=tmp_path, env=fake_slurm(tmp_path), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def test_the_stand_in_fails_a_job_whose_log_directory_is_missing(tmp_path: Path) -> None:
    done = subprocess.run(
        ["sbatch", "--output=logs/%x-%j.log", str(SCRIPT), "+model=tiny"],
        cwd=tmp_path, env=fake_slurm(tmp_path), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1 and "the directory of --output=logs/%x-%j.log" in done.stderr
    assert not (tmp_path / "run").exists()


def test_tasks_form_one_world_and_finish(tmp_path: Path) -> None:
    proc = start(tmp_path, "trainer.max_num_steps=2")
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, output[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "step_00000002").is_dir()
    assert output.count("Trained 2 steps.") == 1 and not (tmp_path / "requeued").exists()
    # the job's log, in the submit dir
    assert "Trained 2 steps." in (tmp_path / f"eagleforge-{JOB_ID}.log").read_text()


def test_the_time_limit_signal_saves_and_requeues(tmp_path: Path) -> None:
    proc = start(tmp_path, "trainer.max_num_steps=500")
    assert proc.stdout is not None
    for line in proc.stdout:
        if "step 2 train:" in line:
            break
    for pid in descendants(proc.pid):  # SLURM signals every task
        if "eagleforge.train" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
            os.kill(pid, signal.SIGUSR1)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 138, output[-3000:]
    assert (tmp_path / "requeued").read_text().split() == ["requeue", JOB_ID]
    (checkpoint,) = (tmp_path / "run" / "checkpoints").glob("step_*")
    assert 2 <= int(checkpoint.name.removeprefix("step_")) < 500
