"""Cluster mode: the same runs as ``local``, launched by torchrun on every node of a Slurm
allocation, each rank 0 appending its record to a shared directory. A dry run: it writes
the run requests and the batch script and prints the torchrun commands; nothing starts.

    DIR/runs.jsonl        one run request a line (python -m calibrate --runs ... --index I)
    DIR/calibrate.sbatch  runs them in turn: timeout ─ srun ─ torchrun ─ python -m calibrate
    DIR/records.jsonl     where the records land (``memplan calibrate report DIR/records.jsonl``)

Known limitations: all runs of one script share the allocation, so they must have the same
world size; a rank that hangs in NCCL holds the run until ``--timeout`` kills it.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from pathlib import Path

from memplan.errors import MemplanError

from . import records
from .records import Run

RUNS_FILE, SCRIPT_FILE, RECORDS_FILE = "runs.jsonl", "calibrate.sbatch", "records.jsonl"
DEFAULT_PORT = 29500
"""torchrun's own default rendezvous port."""
KILL_AFTER_S = 30
"""After the timeout's SIGTERM, how long srun gets to stop its tasks before SIGKILL."""


@dataclass(frozen=True, kw_only=True)
class ClusterPlan:
    out_dir: Path
    runs: tuple[Run, ...]
    num_nodes: int
    gpus_per_node: int
    timeout_s: int
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
    )


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


def sbatch_script(plan: ClusterPlan) -> str:
    """A Slurm batch script that runs every run in turn and records each, whatever happens."""
    num_runs = len(plan.runs)
    # every run may use its whole timeout plus the kill grace; one more grace for start-up
    wall_s = num_runs * (plan.timeout_s + KILL_AFTER_S) + KILL_AFTER_S
    launch = torchrun_args(plan, '"$i"', rdzv_endpoint='"$MASTER_ADDR:$MASTER_PORT"', rdzv_id='"$SLURM_JOB_ID-$i"')
    runs, out = shlex.quote(str(plan.runs_path)), shlex.quote(str(plan.records_path))
    listing = "\n".join(f"#   {i}: {r.describe()}" for i, r in enumerate(plan.runs))
    return f"""#!/bin/bash
#SBATCH --job-name=memplan-calibrate
#SBATCH --nodes={plan.num_nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={plan.gpus_per_node}
#SBATCH --time={_slurm_time(wall_s)}
#SBATCH --output={shlex.quote(str(plan.out_dir / "slurm-%j.out"))}
# memplan calibrate, cluster mode: {num_runs} run(s) on {plan.num_nodes} node(s) × {plan.gpus_per_node} GPU(s);
# each run's rank 0 appends a record to {plan.records_path}
{listing}
set -u
PYTHON="${{PYTHON:-python}}"
export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
export MASTER_PORT="${{MASTER_PORT:-{DEFAULT_PORT}}}"
for i in $(seq 0 {num_runs - 1}); do
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
    plan.out_dir.mkdir(parents=True, exist_ok=True)
    records.write_runs(plan.runs_path, list(plan.runs))
    plan.script_path.write_text(sbatch_script(plan), encoding="utf-8")
