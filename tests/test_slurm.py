"""``memplan calibrate cluster --submit`` against a real Slurm (tests/slurm_cluster.py: munged,
slurmctld and two slurmd on this host): sweeps of 2 ranks, one per node (torchrun
``--nnodes 2``, gloo on CPU), followed to the end, with the four faults of issue 17: a rank
that dies, ``scancel`` mid-sweep, the time limit, a batch environment without torch. Each
time every finished run's record survives, every unfinished one is recorded with its
status and the Slurm job id, and ``--submit --resume`` completes the sweep.

A fault hits one run of a sweep through a ``torchrun`` earlier on the job's PATH that sets
``CALIBRATE_FAULT`` (calibrate.launch) for that run's index, then runs the real one. The
time-limit sweep runs beside the others (each job takes one CPU of each node).
"""

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
import slurm_cluster
from click.testing import CliRunner

from calibrate import records
from memplan.cli import main

# the time-limit sweep waits out Slurm's least limit, a minute: it starts with the first test
# (fixture time_limited) and its test, the last, collects it
pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("time_limited")]

# two nodes × one CPU rank: the multi-node path (torchrun --nnodes 2), the calibrate
# workloads at their smallest
TINY = [
    *("--arch", "llama", "--layers", "2", "--hidden", "64", "--heads", "4", "--ffn", "128", "--vocab", "256"),
    *("--seq-len", "32", "--micro-batch", "2", "--precision", "fp32", "--device", "cpu"),
    *("--nodes", "2", "--gpus-per-node", "1", "--steps", "2", "--warmup", "1", "--timeout", "120", "--poll", "0.5"),
]
STRATEGIES = ("ddp", "fsdp-full-shard", "fsdp-shard-grad-op")


@pytest.fixture(scope="session")
def slurm():
    reason = slurm_cluster.unavailable_reason()
    if reason:
        pytest.skip(reason)
    slurm_cluster.install()
    root = Path(tempfile.mkdtemp(prefix="memplan-slurm-"))
    with slurm_cluster.cluster(root) as env, pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        yield root
    shutil.rmtree(root, ignore_errors=True)


def cluster_args(tmp_path, num_runs: int, *extra) -> list[str]:
    """``calibrate cluster --submit`` of the first ``num_runs`` STRATEGIES into tmp_path/calib."""
    grid = tmp_path / "grid.yaml"
    grid.write_text(f"strategy: [{', '.join(STRATEGIES[:num_runs])}]\n")
    args = ["calibrate", "cluster", *TINY, "--grid", grid, "--out", tmp_path / "calib", "--submit", *extra]
    return list(map(str, args))


def submit(tmp_path, num_runs: int, *extra, **env):
    """Submit, follow and record (env: for sbatch, hence the job); the command's result."""
    env = {"MASTER_PORT": str(slurm_cluster.free_ports(1)[0])} | env
    result = CliRunner().invoke(main, cluster_args(tmp_path, num_runs, *extra), env=env)
    assert result.exit_code == 0, result.output
    return result


def faulty_torchrun(tmp_path, faults: dict[int, str]) -> str:
    """PATH with a ``torchrun`` first that sets CALIBRATE_FAULT=faults[i] for run i."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cases = "".join(f'  *" --index {i} "*) export CALIBRATE_FAULT={fault} ;;\n' for i, fault in faults.items())
    shim = bin_dir / "torchrun"
    shim.write_text(f'#!/bin/bash\ncase " $* " in\n{cases}esac\nexec {shutil.which("torchrun")} "$@"\n')
    shim.chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def history(tmp_path) -> list[list[tuple[str, str]]]:
    """(status, Slurm job id) of each record of each run, runs in runs.jsonl's order."""
    calib = tmp_path / "calib"
    num_runs = len((calib / "runs.jsonl").read_text().splitlines())
    keys = [records.read_run(calib / "runs.jsonl", i).key for i in range(num_runs)]
    recorded = records.read([calib / "records.jsonl"], warn=pytest.fail)
    return [[(r["status"], r["slurm_job_id"]) for r in recorded if records.record_key(r) == key] for key in keys]


def job_ids(tmp_path) -> list[str]:
    """The Slurm jobs that recorded runs, in order."""
    return list(dict.fromkeys(job for run in history(tmp_path) for _, job in run))


def resume(tmp_path, num_runs: int, *, num_unsettled: int) -> str:
    """``--submit --resume``: only the runs without an ok record are submitted; its job id."""
    result = submit(tmp_path, num_runs, "--resume")
    assert f": {num_unsettled} run(s);" in result.stderr
    return job_ids(tmp_path)[-1]


def cancel_when(tmp_path, num_records: int) -> threading.Thread:
    """scancel the job once it has recorded ``num_records`` runs (and started the next)."""
    out = tmp_path / "calib" / "records.jsonl"

    def watch():
        while not out.exists() or len(out.read_text().splitlines()) < num_records:
            time.sleep(0.2)
        time.sleep(2)
        subprocess.run(["scancel", job_ids(tmp_path)[0]], check=True)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_rank_dies_then_the_job_is_cancelled_and_resume_completes_the_sweep(slurm, tmp_path):
    path = faulty_torchrun(tmp_path, {1: "exit:1", 2: "hang:0"})
    watcher = cancel_when(tmp_path, 2)
    result = submit(tmp_path, 3, PATH=path)
    watcher.join()
    (job,) = job_ids(tmp_path)
    assert f"Slurm job {job} CANCELLED" in result.stdout
    assert history(tmp_path) == [[("ok", job)], [("failed", job)], [("cancelled", job)]]
    second = resume(tmp_path, 3, num_unsettled=2)
    assert history(tmp_path) == [[("ok", job)], [("failed", job), ("ok", second)], [("cancelled", job), ("ok", second)]]


def test_a_batch_environment_without_torch_fails_every_run_and_resume_runs_them_on_two_nodes(slurm, tmp_path):
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", bare], check=True)
    # the script runs memplan's own interpreter unless PYTHON names another: here a bare one
    result = submit(tmp_path, 2, PYTHON=str(bare / "bin" / "python"))
    (job,) = job_ids(tmp_path)
    assert f"Slurm job {job} FAILED" in result.stdout
    assert history(tmp_path) == [[("failed", job)], [("failed", job)]]
    first = records.read([tmp_path / "calib" / "records.jsonl"])[0]
    assert "cannot import torch" in first["error"] and "No module named 'torch'" in first["error"]
    second = resume(tmp_path, 2, num_unsettled=2)
    ok = [r for r in records.read([tmp_path / "calib" / "records.jsonl"]) if r["status"] == "ok"]
    assert [(r["measurement"]["world_size"], r["measurement"]["emulated"]) for r in ok] == [(2, False)] * 2
    job = subprocess.run(["scontrol", "show", "job", "--oneliner", second], capture_output=True, text=True, check=True)
    assert " NumNodes=2 " in job.stdout and " NodeList=n[1-2] " in job.stdout
    again = submit(tmp_path, 2, "--resume")
    assert "nothing to submit" in again.stdout


@pytest.fixture(scope="module")
def time_limited(slurm, tmp_path_factory):
    """A sweep of two runs whose second hangs, submitted with a one-minute limit in a process
    of its own: SBATCH_TIMELIMIT overrides the script's --time (man sbatch, INPUT
    ENVIRONMENT VARIABLES)."""
    tmp_path = tmp_path_factory.mktemp("time_limited")
    env = os.environ | {
        "PATH": faulty_torchrun(tmp_path, {1: "hang:0"}),
        "SBATCH_TIMELIMIT": "1",
        "MASTER_PORT": str(slurm_cluster.free_ports(1)[0]),
    }
    command = [sys.executable, "-c", "from memplan.cli import main; main()", *cluster_args(tmp_path, 2)]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield tmp_path, proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def test_the_time_limit_ends_a_sweep_and_resume_completes_it(time_limited):
    tmp_path, proc = time_limited
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    (job,) = job_ids(tmp_path)
    assert f"Slurm job {job} TIMEOUT" in stdout
    assert history(tmp_path) == [[("ok", job)], [("timeout", job)]]
    second = resume(tmp_path, 2, num_unsettled=1)
    assert history(tmp_path) == [[("ok", job)], [("timeout", job), ("ok", second)]]
