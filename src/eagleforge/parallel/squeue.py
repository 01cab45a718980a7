"""submitit's jobs followed through squeue, on a SLURM cluster that keeps no accounting.

The command that submitted a sweep waits for its jobs; while a job has written no result,
submitit asks ``sacct`` for its state, every few seconds at first, to notice a job that ended
without one (cancelled, killed, failed to start). Without accounting storage each of those
calls fails and prints "Slurm accounting storage is disabled", and such a job would be waited
for forever. ``follow_jobs_with_squeue`` (called by ``parallel.slurm.SlurmPreflight``) makes
this process ask ``squeue`` instead, which knows a job until ``MinJobAge`` (300 s by default)
after it ends.
"""

from __future__ import annotations

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


class SqueueWatcher(SlurmInfoWatcher):
    """submitit's SLURM job-state watcher, reading squeue instead of sacct."""

    def __init__(self) -> None:
        # at least once a minute: a job's end is seen well before squeue forgets it
        super().__init__(delay_s=60)

    def _make_command(self) -> list[str] | None:
        to_check = {job.split("_")[0] for job in self._registered - self._finished}
        if not to_check:
            return None
        return [
            "squeue",
            "--noheader",
            "--states=all",
            "--format=%i|%T|%N",
            f"--jobs={','.join(sorted(to_check))}",
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
        return super().read_info("\n".join(rows))


def follow_jobs_with_squeue() -> None:
    """Every SLURM job this process submits or waits for is followed through squeue."""
    SlurmJob.watcher = SqueueWatcher()
