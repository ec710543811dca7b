"""The Slurm commands that ``memplan calibrate cluster --submit`` calls: ``sbatch`` to submit,
``scontrol show job`` to follow. Torch-free; each call is one subprocess.

The job's state comes from ``scontrol``, which needs no accounting database: ``sacct``
answers only where ``slurmdbd`` runs ("Slurm accounting storage is disabled" otherwise),
and a cluster without one is what the tests bring up. slurmctld forgets a finished job
after ``MinJobAge`` (300 s by default), far longer than one poll.

Example usage::

    job_id = submit(Path("calib/calibrate.sbatch"))
    while not (state := job_state(job_id)).ended:
        time.sleep(5)
    status_of(state)        # "cancelled", "timeout" or "failed" for the runs it left

Known limitations: a job that Slurm has forgotten (polled after ``MinJobAge``) reads as
state ``UNKNOWN``, ended.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from memplan.errors import MemplanError

ENDED_STATES = (
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "TIMEOUT",
    "UNKNOWN",
)
"""Job states after which no process of the job runs (``man squeue``, JOB STATE CODES);
UNKNOWN is ours: a job slurmctld no longer holds."""
RUN_STATUS_OF_STATE = {"CANCELLED": "cancelled", "TIMEOUT": "timeout", "DEADLINE": "timeout"}
"""The status of a run the job left unfinished; any other end state leaves it ``failed``."""


@dataclass(frozen=True, kw_only=True)
class JobState:
    job_id: str
    state: str
    """JobState as scontrol prints it (RUNNING, COMPLETING, CANCELLED, ...)."""
    reason: str = "None"
    exit_code: str = "0:0"
    """The batch script's exit status and the signal that ended it."""

    @property
    def ended(self) -> bool:
        return self.state in ENDED_STATES

    def describe(self) -> str:
        why = "" if self.reason == "None" else f", reason {self.reason}"
        return f"Slurm job {self.job_id} {self.state}{why} (exit code {self.exit_code})"


def require(*commands: str) -> None:
    """Each Slurm client command on PATH, or a one-line error naming the first missing."""
    for command in commands:
        if shutil.which(command) is None:
            raise MemplanError(f"{command} is not on PATH: --submit needs the Slurm client commands (sbatch, scontrol)")


def _call(args: list[str], *, env=None) -> subprocess.CompletedProcess:
    require(args[0])
    return subprocess.run(args, capture_output=True, text=True, env=env)


def submit(script: Path, *, env=None) -> str:
    """``sbatch --parsable SCRIPT``: the job id (the script's #SBATCH lines, SBATCH_* in the
    environment and sbatch's defaults decide partition, time and nodes)."""
    proc = _call(["sbatch", "--parsable", str(script)], env=env)
    if proc.returncode != 0:
        raise MemplanError(f"sbatch refused {script}: {proc.stderr.strip() or f'exit code {proc.returncode}'}")
    # --parsable prints "jobid" or "jobid;cluster"
    return proc.stdout.strip().split(";")[0]


def _field(line: str, name: str, default: str) -> str:
    found = re.search(rf"(?:^| ){name}=(\S+)", line)
    return found.group(1) if found else default


def job_state(job_id: str) -> JobState:
    """The job's state now, from ``scontrol show job --oneliner``."""
    proc = _call(["scontrol", "show", "job", "--oneliner", job_id])
    if proc.returncode != 0:
        if "Invalid job id" in proc.stderr:
            return JobState(job_id=job_id, state="UNKNOWN", reason="slurmctld no longer holds the job")
        raise MemplanError(f"scontrol show job {job_id} failed: {proc.stderr.strip()}")
    line = proc.stdout.strip()
    return JobState(
        job_id=job_id,
        state=_field(line, "JobState", "UNKNOWN"),
        reason=_field(line, "Reason", "None"),
        exit_code=_field(line, "ExitCode", "0:0"),
    )


def status_of(state: JobState) -> str:
    """The record status of a run the ended job did not finish."""
    return RUN_STATUS_OF_STATE.get(state.state, "failed")
