"""Cluster mode: the same runs as ``local``, launched by torchrun on every node of a Slurm
allocation, each rank 0 appending its record to a shared directory. Without ``--submit`` a
dry run: it writes the run requests and the batch script and prints the torchrun commands.

    DIR/runs.jsonl        one run request a line (python -m calibrate --runs ... --index I)
    DIR/calibrate.sbatch  runs them in turn: timeout ─ srun ─ torchrun ─ python -m calibrate
    DIR/records.jsonl     where the records land (``memplan calibrate report DIR/records.jsonl``)
    DIR/slurm-JOBID.out   the job's output

With ``--submit`` (``follow``, ``record_unfinished``) the job is followed until it ends;
every run it did not record (cancelled, out of time, a script that could not start) is
then recorded with the status its end implies and the Slurm job id, so that
``--submit --resume`` submits exactly the runs without an ``ok`` or ``oom`` record.

Known limitations: all runs of one script share the allocation, so they must have the same
world size; a rank that hangs in NCCL holds the run until ``--timeout`` kills it; the
directory must be on a file system every node of the allocation shares.
"""

from __future__ import annotations

import dataclasses
import math
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from memplan.errors import MemplanError

from . import records, slurm
from .records import Run
from .runs import _tail

RUNS_FILE, SCRIPT_FILE, RECORDS_FILE = "runs.jsonl", "calibrate.sbatch", "records.jsonl"
DEFAULT_PORT = 29500
"""torchrun's own default rendezvous port."""
KILL_AFTER_S = 30
"""After the timeout's SIGTERM, how long srun gets to stop its tasks before SIGKILL."""
SETTLED_STATUSES = ("ok", "oom")
"""A record with one of these settles its run: a second try measures the same. timeout,
failed and cancelled may be the cluster's doing (a dead node, a short allocation), so
``--submit --resume`` submits those runs again."""


@dataclass(frozen=True, kw_only=True)
class ClusterPlan:
    out_dir: Path
    runs: tuple[Run, ...]
    num_nodes: int
    gpus_per_node: int
    timeout_s: int
    indices: tuple[int, ...]
    """The runs the script runs, by line of runs.jsonl (``cluster_plan``: all of them)."""
    resume: bool = False

    @property
    def runs_path(self) -> Path:
        return self.out_dir / RUNS_FILE

    @property
    def records_path(self) -> Path:
        return self.out_dir / RECORDS_FILE

    @property
    def script_path(self) -> Path:
        return self.out_dir / SCRIPT_FILE


def cluster_plan(runs: list[Run], *, out_dir, timeout_s: float, resume: bool = False) -> ClusterPlan:
    """Check that every run fits one allocation (same nodes × GPUs per node)."""
    if not runs:
        raise MemplanError("no runs to launch")
    shapes = {(r.job.cluster.num_nodes, r.job.cluster.gpus_per_node) for r in runs}
    if len(shapes) > 1:
        raise MemplanError(
            f"a cluster script runs on one allocation, but the runs ask for "
            f"{', '.join(f'{n}×{g}' for n, g in sorted(shapes))} nodes×GPUs; "
            "keep --gpus and --gpus-per-node out of the grid"
        )
    ((num_nodes, gpus_per_node),) = shapes
    return ClusterPlan(
        out_dir=Path(out_dir).resolve(),
        runs=tuple(runs),
        num_nodes=num_nodes,
        gpus_per_node=gpus_per_node,
        timeout_s=math.ceil(timeout_s),
        resume=resume,
        indices=tuple(range(len(runs))),
    )


def unsettled(plan: ClusterPlan) -> ClusterPlan:
    """The plan narrowed to its runs without a settling record (``--submit --resume``)."""
    settled = (
        {records.record_key(r) for r in records.read([plan.records_path]) if r["status"] in SETTLED_STATUSES}
        if plan.records_path.exists()
        else set()
    )
    return dataclasses.replace(plan, indices=tuple(i for i in plan.indices if plan.runs[i].key not in settled))


def torchrun_args(plan: ClusterPlan, index: int | str, *, rdzv_endpoint: str, rdzv_id: str) -> str:
    """``torchrun ... -m calibrate ...`` for one run (``index`` may be a shell variable)."""
    entry = [
        "-m",
        "calibrate",
        "--runs",
        shlex.quote(str(plan.runs_path)),
        "--index",
        str(index),
        "--out",
        shlex.quote(str(plan.records_path)),
    ] + (["--resume"] if plan.resume else [])
    return " ".join(
        [
            "torchrun",
            "--nnodes",
            str(plan.num_nodes),
            "--nproc-per-node",
            str(plan.gpus_per_node),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            rdzv_endpoint,
            "--rdzv-id",
            rdzv_id,
            *entry,
        ]
    )


def torchrun_commands(plan: ClusterPlan) -> list[str]:
    """One command per run, to start by hand on every node (MASTER_ADDR: the first node)."""
    endpoint = f'"${{MASTER_ADDR:-127.0.0.1}}:${{MASTER_PORT:-{DEFAULT_PORT}}}"'
    return [
        torchrun_args(plan, i, rdzv_endpoint=endpoint, rdzv_id=f"memplan-calibrate-{i}") for i in range(len(plan.runs))
    ]


def _slurm_time(seconds: int) -> str:
    return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _resources(plan: ClusterPlan) -> str:
    """GPUs per node for CUDA runs; for CPU runs (gloo) a CPU per rank, as GPUs Slurm may not have."""
    if any(run.job.train.device == "cuda" for run in plan.runs):
        return f"#SBATCH --gpus-per-node={plan.gpus_per_node}"
    return f"#SBATCH --cpus-per-task={plan.gpus_per_node}"


def sbatch_script(plan: ClusterPlan) -> str:
    """A Slurm batch script that runs the plan's runs in turn and records each, unless the job
    is cancelled or runs out of time (then ``record_unfinished`` does, from outside)."""
    # every run may use its whole timeout plus the kill grace; one more grace for start-up
    wall_s = len(plan.indices) * (plan.timeout_s + KILL_AFTER_S) + KILL_AFTER_S
    launch = torchrun_args(plan, '"$i"', rdzv_endpoint='"$MASTER_ADDR:$MASTER_PORT"', rdzv_id='"$SLURM_JOB_ID-$i"')
    runs, out = shlex.quote(str(plan.runs_path)), shlex.quote(str(plan.records_path))
    listing = "\n".join(f"#   {i}: {plan.runs[i].describe()}" for i in plan.indices)
    return f"""#!/bin/bash
#SBATCH --job-name=memplan-calibrate
#SBATCH --nodes={plan.num_nodes}
#SBATCH --ntasks-per-node=1
{_resources(plan)}
#SBATCH --time={_slurm_time(wall_s)}
#SBATCH --output={shlex.quote(str(plan.out_dir / "slurm-%j.out"))}
# memplan calibrate, cluster mode: {len(plan.indices)} run(s), {plan.num_nodes} node(s) × {plan.gpus_per_node} rank(s);
# each run's rank 0 appends a record to {plan.records_path}
{listing}
set -u
# scancel and the time limit send SIGTERM: stop without recording the run as failed
trap 'exit 143' TERM
# the interpreter that ran memplan (clusters share the filesystem); PYTHON overrides it
PYTHON="${{PYTHON:-{shlex.quote(sys.executable)}}}"
if ! "$PYTHON" -c "import torch"; then
  echo "memplan calibrate: $PYTHON cannot import torch; set PYTHON to an interpreter that can before sbatch" >&2
  exit 2
fi
first="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
# the address Slurm itself reaches the first node at (NodeAddr: the node's name unless set)
addr="$(scontrol show node "$first" | sed -n 's/.* NodeAddr=\\([^ ]*\\).*/\\1/p')"
export MASTER_ADDR="${{addr:-$first}}"
export MASTER_PORT="${{MASTER_PORT:-{DEFAULT_PORT}}}"
for i in {" ".join(map(str, plan.indices))}; do
  start=$(date +%s)
  timeout --kill-after={KILL_AFTER_S} {plan.timeout_s} \\
    srun --nodes={plan.num_nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 \\
    {launch}
  rc=$?
  if [ "$rc" -ne 0 ]; then
    # rank 0 may have died before recording: record the run from here (skipped if it did)
    "$PYTHON" -m calibrate --runs {runs} --index "$i" --out {out} --record-exit-code "$rc" --since "$start"
  fi
done
"""


def write(plan: ClusterPlan) -> None:
    if plan.out_dir.exists() and not plan.out_dir.is_dir():
        raise MemplanError(f"--out {str(plan.out_dir)!r} is a file; cluster mode writes into a directory")
    try:
        plan.out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MemplanError(f"--out {str(plan.out_dir)!r} cannot be made: {exc.strerror or exc}") from None
    records.write_runs(plan.runs_path, list(plan.runs))
    plan.script_path.write_text(sbatch_script(plan), encoding="utf-8")


@dataclass(frozen=True, kw_only=True)
class Progress:
    """Where a submitted job stands: its Slurm state and the runs it has recorded so far."""

    state: slurm.JobState
    num_recorded: int
    num_runs: int

    def line(self) -> str:
        return (
            f"Slurm job {self.state.job_id}: {self.state.state}, {self.num_recorded} of {self.num_runs} runs recorded"
        )


def job_records(plan: ClusterPlan, job_id: str) -> dict[str, dict]:
    """The records job ``job_id`` has appended, by run key (its last one per run)."""
    if not plan.records_path.exists():
        return {}
    return {records.record_key(r): r for r in records.read([plan.records_path]) if r.get("slurm_job_id") == job_id}


def follow(plan: ClusterPlan, job_id: str, *, poll_s: float, on_progress=lambda progress: None) -> slurm.JobState:
    """Poll the job every ``poll_s`` until it ends; its last state."""
    while True:
        state = slurm.job_state(job_id)
        on_progress(Progress(state=state, num_recorded=len(job_records(plan, job_id)), num_runs=len(plan.indices)))
        if state.ended:
            return state
        time.sleep(poll_s)


def record_unfinished(plan: ClusterPlan, state: slurm.JobState) -> list[dict]:
    """Record every run of the ended job that it did not record, with the status its end
    implies (``slurm.status_of``); the records appended."""
    recorded = job_records(plan, state.job_id)
    log = plan.out_dir / f"slurm-{state.job_id}.out"
    error = f"{state.describe()} before this run recorded itself; its output: {log}"
    if log.exists():
        error += f"\n{_tail(log)}"
    unfinished = [
        # wall_s 0: the run's own time is unknown from outside the job
        records.make_record(
            plan.runs[i],
            status=slurm.status_of(state),
            measurement=None,
            error=error,
            wall_s=0.0,
            slurm_job_id=state.job_id,
        )
        for i in plan.indices
        if plan.runs[i].key not in recorded
    ]
    for record in unfinished:
        records.append(plan.records_path, record)
    return unfinished
