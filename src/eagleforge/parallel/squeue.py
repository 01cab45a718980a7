"""submitit's jobs followed through squeue, on a SLURM cluster that keeps no accounting, and a
job that ends without a result reported in one line wherever the jobs are followed.

The command that submitted a sweep waits for its jobs; while a job has written no result,
submitit asks ``sacct`` for its state, every few seconds at first, to notice a job that ended
without one (cancelled, killed, failed to start). Without accounting storage each of those
calls fails and prints "Slurm accounting storage is disabled", and such a job would be waited
for forever. ``follow_jobs_with_squeue`` (called by ``parallel.slurm.SlurmPreflight``) makes
this process ask ``squeue`` instead. squeue knows a job until ``MinJobAge`` (300 s by default)
after it ends, and then forgets it: a job this process waits for that squeue no longer lists
has ended too (``VANISHED``), where submitit would keep the last state it read and wait on.

A job that ends without a result (killed by SIGKILL or the out-of-memory killer, cancelled,
vanished) makes submitit raise ``UncompletedJobError``, whose message is the tail of the job's
log, and Hydra prints it with a traceback. ``report_jobs_without_result`` ends the command
instead with one line naming the job, its state and its log (``no_result_line``), status 1.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

from submitit.core.utils import UncompletedJobError
from submitit.slurm.slurm import SlurmInfoWatcher, SlurmJob

# squeue's states of a job that has ended.
ENDED = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)
# The states of a job still under way that submitit knows (it takes any other for an end).
UNDER_WAY = frozenset({"PENDING", "RUNNING", "REQUEUED", "COMPLETING"})
# The state given to a job squeue no longer lists: it ended at least MinJobAge ago.
VANISHED = "VANISHED"


class SqueueWatcher(SlurmInfoWatcher):
    """submitit's SLURM job-state watcher, reading squeue instead of sacct."""

    def __init__(self) -> None:
        # at least once a minute: a job's end is seen well before squeue forgets it
        super().__init__(delay_s=60)
        self._asked: set[str] = set()  # the jobs of the squeue call in flight

    def _make_command(self) -> list[str] | None:
        to_check = {job.split("_")[0] for job in self._registered - self._finished}
        if not to_check:
            return None
        self._asked = self._registered - self._finished
        # all of this user's jobs, not --jobs=: squeue fails ("Invalid job id specified") when
        # none of the ids it is given exists any more, and that failure would read as no news
        return [
            "squeue",
            "--noheader",
            "--states=all",
            "--format=%i|%T|%N",
            f"--user={os.getuid()}",
        ]

    def read_info(self, string: bytes | str) -> dict[str, dict[str, str]]:
        text = string.decode() if isinstance(string, bytes) else string
        rows = ["JobID|State|NodeList"]  # sacct's columns, which the parser reads
        for line in text.splitlines():
            job, _, rest = line.strip().partition("|")
            state, _, nodes = rest.partition("|")
            if not job:
                continue
            # CONFIGURING, SUSPENDED, REQUEUE_HOLD, ...: not over, whatever submitit knows
            if state not in ENDED and state not in UNDER_WAY:
                state = "RUNNING"
            rows.append(f"{job}|{state}|{nodes}")
        info = super().read_info("\n".join(rows))
        # squeue answered and does not list it: the job ended long enough ago to be forgotten
        for job in self._asked - info.keys():
            info[job] = {"JobID": job, "State": VANISHED, "NodeList": ""}
        return info


def follow_jobs_with_squeue() -> None:
    """Every SLURM job this process submits or waits for is followed through squeue."""
    SlurmJob.watcher = SqueueWatcher()


def no_result_line(job: SlurmJob[Any]) -> str:
    """One line for a job that ended without a result: its id, state and log."""
    state = job.watcher.get_state(job.job_id, mode="cache")
    how = "no longer in squeue" if state == VANISHED else f"state {state}"
    return (
        f"error: SLURM job {job.job_id} ended without a result ({how}): it was killed, "
        f"cancelled or failed outside Python (out of memory?); its log: {job.paths.stdout}"
    )


def report_jobs_without_result() -> None:
    """A SLURM job this process waits for that ends without a result ends the command with
    ``no_result_line`` and status 1, instead of submitit's error and Hydra's traceback. (A
    job array's jobs are built as ``SlurmJob`` itself, so the method is wrapped in place.)"""
    results = SlurmJob.results
    if getattr(results, "reports_no_result", False):
        return

    @functools.wraps(results)
    def reported(self: SlurmJob[Any]) -> list[Any]:
        try:
            return results(self)
        except UncompletedJobError:
            print(no_result_line(self), file=sys.stderr, flush=True)
            sys.exit(1)

    reported.reports_no_result = True  # type: ignore[attr-defined]
    SlurmJob.results = reported  # type: ignore[method-assign,assignment]
