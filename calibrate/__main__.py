"""``python -m calibrate``: run one calibration point; the entry point of every mode.

    python -m calibrate --runs RUNS.jsonl --index I --out RECORDS.jsonl     # append a record
    python -m calibrate --runs RUNS.jsonl --index I --result RESULT.json    # hand the outcome back

Under torchrun (RANK and WORLD_SIZE in the environment) every rank initialises the
process group from the environment and trains; rank 0 appends the record. Otherwise the
run's own mode decides: ``local`` spawns its ranks here, ``emulate`` is one rank on the
fake process group. ``memplan calibrate run`` starts this module once per run, in a
process group of its own that it kills on ``--timeout``.

``--record-exit-code RC`` is the cluster script's fallback: when torchrun fails before
rank 0 has recorded the run, it records the run as ``timeout`` (RC 124 or 137, from
``timeout``) or ``failed``. It imports no torch.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import click

from memplan.errors import MemplanError

from . import records

TIMEOUT_EXIT_CODES = (124, 137)
"""GNU timeout's exit status, and 128 + SIGKILL when it had to kill."""
SLURM_JOB_ENV = "SLURM_JOB_ID"
"""Set by Slurm in a job's every process: the record names the job that made it."""


def _recorded_since(out, run: records.Run, since_epoch_s: float) -> bool:
    if not Path(out).exists():
        return False
    return any(
        records.record_key(r) == run.key
        and "finished_at" in r
        and datetime.datetime.fromisoformat(r["finished_at"]).timestamp() >= since_epoch_s
        for r in records.read([out])
    )


def _record_exit(run: records.Run, out, exit_code: int, since_epoch_s: float) -> None:
    if _recorded_since(out, run, since_epoch_s):
        return
    status = "timeout" if exit_code in TIMEOUT_EXIT_CODES else "failed"
    error = f"torchrun exited with code {exit_code} before rank 0 recorded the run"
    wall_s = time.time() - since_epoch_s
    records.append(
        out,
        records.make_record(
            run, status=status, measurement=None, error=error, wall_s=wall_s, slurm_job_id=os.environ.get(SLURM_JOB_ENV)
        ),
    )


def _write_result(path, outcome: dict) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(outcome), encoding="utf-8")
    os.replace(tmp, path)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--runs",
    "runs_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Run requests, one JSON object a line (written by memplan calibrate).",
)
@click.option("--index", type=int, required=True, help="Which line of --runs to run (from 0).")
@click.option("--out", type=click.Path(dir_okay=False), help="Append the record to this .jsonl file.")
@click.option("--result", type=click.Path(dir_okay=False), help="Write the bare outcome here instead.")
@click.option("--resume", is_flag=True, help="Do nothing when --out already records this run.")
@click.option(
    "--max-host-mem",
    "max_host_mem_bytes",
    type=int,
    help="Bytes of address space each process may map beyond torch's own (RLIMIT_AS).",
)
@click.option("--record-exit-code", type=int, help="Record a torchrun that exited with this code (fallback).")
@click.option(
    "--since",
    "since_epoch_s",
    type=float,
    default=0.0,
    help="With --record-exit-code: when the attempt started (seconds since the epoch).",
)
def main(runs_path, index, out, result, resume, max_host_mem_bytes, record_exit_code, since_epoch_s):
    """Run one calibration point and record it."""
    if (out is None) == (result is None):
        raise click.UsageError("give exactly one of --out FILE.jsonl or --result FILE.json")
    try:
        run = records.read_run(runs_path, index)
    except MemplanError as exc:
        raise click.ClickException(str(exc)) from None
    if record_exit_code is not None:
        _record_exit(run, out, record_exit_code, since_epoch_s)
        return
    if resume and out and run.key in records.recorded_keys(out):
        click.echo(f"already recorded in {out}: {run.describe()}", err=True)
        return
    from . import runner

    start_s = time.perf_counter()
    under_torchrun = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    if under_torchrun:
        outcome = runner.execute_torchrun(run)
        if int(os.environ["RANK"]) != 0:
            sys.exit(0 if outcome["status"] == "ok" else 1)
    else:
        outcome = runner.execute(run, max_host_mem_bytes=max_host_mem_bytes)
    if result:
        _write_result(result, outcome)
    else:
        wall_s = time.perf_counter() - start_s
        records.append(
            out, records.make_record(run, **outcome, wall_s=wall_s, slurm_job_id=os.environ.get(SLURM_JOB_ENV))
        )
    if outcome["status"] != "ok":
        click.echo(f"{run.describe()}: {outcome['status']}: {outcome['error'].splitlines()[0]}", err=True)


if __name__ == "__main__":
    main()
