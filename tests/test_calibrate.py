"""memplan calibrate: records of real runs (2 gloo processes, and one rank on the fake
process group), every failure recorded while the sweep goes on, --resume, corrupt record
files, the report, and the cluster dry run whose torchrun command really runs."""

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("torch")
from click.testing import CliRunner

from calibrate import preflight, records, runs
from calibrate.runs import EXIT_ALL_FAILED, EXIT_SOME_FAILED
from memplan.cli import main
from memplan.specs import ClusterSpec, Job, ModelSpec, Plan, TrainSpec

MODEL = ["--arch", "llama", "--layers", "2", "--hidden", "64", "--heads", "4", "--ffn", "128"]
TRAIN = ["--seq-len", "32", "--micro-batch", "2", "--precision", "fp32", "--device", "cpu", "--gpus", "2"]
TINY = [*MODEL, "--vocab", "256", *TRAIN]
TINY_JOB = Job(
    model=ModelSpec(arch="llama", num_layers=2, hidden=64, num_heads=4, ffn_hidden=128, vocab_size=256),
    train=TrainSpec(seq_len=32, micro_batch=2, precision="fp32", device="cpu"),
    cluster=ClusterSpec(gpus=2),
    plan=Plan(strategy="ddp"),
)
RUN_KEYS = {
    "schema",
    "id",
    "mode",
    "steps",
    "warmup",
    "workload",
    "spec",
    "world_size",
    "estimate",
    "status",
    "error",
    "measurement",
    "device",
    "torch_version",
    "host",
    "finished_at",
    "wall_s",
}
MEASUREMENT_KEYS = {
    "peak_allocated_bytes",
    "phase",
    "categories",
    "step_time_s",
    "tokens_per_s",
    "device",
    "world_size",
    "emulated",
    "torch_version",
    "peak_reserved_bytes",
    "device_used_bytes",
    "num_alloc_retries",
    "phase_peaks",
}


def calibrate(*args):
    return CliRunner().invoke(main, ["calibrate", *map(str, args)])


def read(path):
    return records.read([path], warn=pytest.fail)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """DDP and FSDP full-shard, world size 2: two real gloo processes, then emulated."""
    tmp = tmp_path_factory.mktemp("sweep")
    grid = tmp / "grid.yaml"
    grid.write_text("strategy: [ddp, fsdp-full-shard]\n")
    out = tmp / "runs.jsonl"
    for mode in ("local", "emulate"):
        result = calibrate("run", *TINY, "--grid", grid, "--mode", mode, "--out", out, "--timeout", 120)
        assert result.exit_code == 0, result.output
        assert "2 of 2 runs recorded" in result.stdout and "| ok       |      2 |" in result.stdout
        # one line per run as it ends (not a terminal: plain), from its record
        for i, record in enumerate(records.read([out])[-2:], start=1):
            run = records.Run.from_dict(record)
            peak, estimated = record["measurement"]["peak_allocated_bytes"], record["estimate"]["allocated_bytes"]
            assert (
                f"[{i}/2] ok      {run.describe()}: peak {peak / 2**20:,.2f} MiB, estimate {estimated / 2**20:,.2f} "
                f"MiB, error {100 * (estimated - peak) / peak:+.2f} % ({record['wall_s']:.1f} s); elapsed "
            ) in result.stderr
    return out, grid


@pytest.mark.slow
def test_records_of_real_and_emulated_runs(sweep):
    out, _ = sweep
    recs = read(out)
    assert [(r["mode"], r["spec"]["plan"]["strategy"]) for r in recs] == [
        ("local", "ddp"),
        ("local", "fsdp-full-shard"),
        ("emulate", "ddp"),
        ("emulate", "fsdp-full-shard"),
    ]
    for r in recs:
        assert set(r) >= RUN_KEYS, r
        assert r["status"] == "ok" and r["error"] is None
        m = r["measurement"]
        assert set(m) >= MEASUREMENT_KEYS
        assert m["peak_allocated_bytes"] > 0 and m["step_time_s"] > 0 and m["tokens_per_s"] > 0
        assert m["world_size"] == r["world_size"] == 2
        assert m["emulated"] == (r["mode"] == "emulate")
        assert m["device"] == r["device"] == "cpu"
        assert m["torch_version"] == r["torch_version"] and r["torch_version"]
        est = r["estimate"]
        assert est["allocated_bytes"] > 0 and est["phase"] in ("forward", "backward", "optimizer")
        assert sum(est["by_component"].values()) == est["allocated_bytes"] <= est["total_bytes"]
        job = records.job_from_spec(r["spec"])
        assert job.plan.strategy == r["spec"]["plan"]["strategy"] and job.model.vocab_size == 256
        assert records.spec_dict(job) == r["spec"]


@pytest.mark.slow
def test_emulated_rank_equals_real_rank_0(sweep):
    out, _ = sweep
    peak = {(r["mode"], r["spec"]["plan"]["strategy"]): r["measurement"]["peak_allocated_bytes"] for r in read(out)}
    # byte for byte: the fake process group holds what a real rank holds
    assert peak["emulate", "ddp"] == peak["local", "ddp"]
    # FSDP2 usually matches to the byte too; under CPU contention gloo's asynchronous
    # reduce-scatter can overlap the backward peak on a real rank (seen: +16,128 B, 0.8 %)
    assert (
        abs(peak["emulate", "fsdp-full-shard"] - peak["local", "fsdp-full-shard"])
        <= 0.01 * peak["emulate", "fsdp-full-shard"]
    )


@pytest.mark.slow
def test_resume_skips_recorded_runs_and_runs_the_rest(sweep, tmp_path):
    out, grid = sweep
    copy = tmp_path / "runs.jsonl"
    shutil.copy(out, copy)
    result = calibrate("run", *TINY, "--grid", grid, "--mode", "emulate", "--out", copy, "--resume")
    assert result.exit_code == 0, result.output
    assert "0 of 2 runs recorded" in result.stdout and "2 already recorded, skipped" in result.stdout
    assert len(read(copy)) == 4
    wider = tmp_path / "wider.yaml"
    wider.write_text("strategy: [ddp, fsdp-full-shard, fsdp-shard-grad-op]\n")
    result = calibrate("run", *TINY, "--grid", wider, "--mode", "emulate", "--out", copy, "--resume")
    assert result.exit_code == 0, result.output
    assert "1 of 3 runs recorded" in result.stdout
    recs = read(copy)
    assert len(recs) == 5 and recs[-1]["spec"]["plan"]["strategy"] == "fsdp-shard-grad-op"
    assert recs[-1]["status"] == "ok"


@pytest.mark.slow
def test_host_oom_is_recorded_and_the_sweep_goes_on(tmp_path):
    grid = tmp_path / "grid.json"
    # a 2 GB embedding, then the tiny model; the cap counts address space (thread stacks,
    # malloc arenas), so the tiny model needs a few hundred MiB of it
    grid.write_text(json.dumps({"vocab": [8_000_000, 256]}))
    out = tmp_path / "oom.jsonl"
    result = calibrate(
        "run",
        *MODEL,
        *TRAIN,
        "--strategy",
        "ddp",
        "--grid",
        grid,
        "--mode",
        "emulate",
        "--max-host-mem",
        "1GiB",
        "--out",
        out,
    )
    assert result.exit_code == EXIT_SOME_FAILED, result.output
    first, second = read(out)
    assert first["status"] == "oom" and first["measurement"] is None
    assert "can't allocate memory" in first["error"]  # the CPU allocator's words (alloc_cpu.cpp)
    assert first["estimate"]["allocated_bytes"] > 2**30
    assert second["status"] == "ok" and second["measurement"]["peak_allocated_bytes"] > 0
    assert "oom" in result.stderr


@pytest.mark.slow
def test_a_dead_rank_is_recorded_as_failed(tmp_path, monkeypatch):
    monkeypatch.setenv("CALIBRATE_FAULT", "exit:1")  # calibrate.launch.fault_if_asked: rank 1 exits
    out = tmp_path / "dead.jsonl"
    result = calibrate("run", *TINY, "--strategy", "ddp", "--mode", "local", "--timeout", 120, "--out", out)
    assert result.exit_code == EXIT_ALL_FAILED, result.output
    (rec,) = read(out)
    assert rec["status"] == "failed"
    assert rec["error"].startswith("rank 1 exited with code 3 without reporting")
    # the summary table gives the cause's first line; the progress its run line (not a terminal: plain)
    cause = rec["error"].splitlines()[0]
    assert f"| failed   | ddp fp32 llama 2L h64 b2×s32 local×2 | {cause}" in result.stdout
    assert f"[1/1] failed  ddp fp32 llama 2L h64 b2×s32 local×2: {cause} (" in result.stderr


@pytest.mark.slow
def test_a_tiny_timeout_is_recorded(tmp_path):
    out = tmp_path / "slow.jsonl"
    result = calibrate("run", *TINY, "--strategy", "ddp", "--mode", "emulate", "--timeout", 0.3, "--out", out)
    assert result.exit_code == EXIT_ALL_FAILED, result.output
    (rec,) = read(out)
    assert rec["wall_s"] < 10  # the run, killed at its timeout (the preflight's probe is before it)
    assert rec["status"] == "timeout" and "0.3 s" in rec["error"] and rec["measurement"] is None


def _processes_with(marker: str) -> set[int]:
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as environ:
                if marker.encode() in environ.read():
                    found.add(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.slow
def test_a_hung_rank_is_killed_with_every_process_of_its_run(tmp_path, monkeypatch):
    marker = f"calibrate-test-{os.getpid()}-{time.time_ns()}"
    monkeypatch.setenv("CALIBRATE_TEST_MARKER", marker)  # inherited by the run's child and its ranks
    monkeypatch.setenv("CALIBRATE_FAULT", "hang:1")  # rank 1 hangs: rank 0 waits in DDP's broadcast
    seen, stop = set(), threading.Event()

    def watch():
        while not stop.is_set():
            seen.update(_processes_with(marker))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    out = tmp_path / "hung.jsonl"
    try:
        result = calibrate("run", *TINY, "--strategy", "ddp", "--mode", "local", "--timeout", 10, "--out", out)
    finally:
        stop.set()
        watcher.join()
    assert result.exit_code == EXIT_ALL_FAILED, result.output
    (rec,) = read(out)
    assert rec["status"] == "timeout" and "10 s" in rec["error"]
    assert len(seen - {os.getpid()}) >= 3  # the run's process and its two ranks were there
    time.sleep(0.5)
    assert _processes_with(marker) - {os.getpid()} == set()  # and none of them is left


def _good_line(sweep_out):
    return sweep_out.read_text().splitlines()[0]


@pytest.mark.slow
def test_a_corrupt_line_is_warned_with_its_number_and_skipped(sweep, tmp_path):
    good = _good_line(sweep[0])
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join([good, "{not json", good[: len(good) // 2], "[1, 2]", good]) + "\n")
    warnings = []
    recs = records.read([path], warn=warnings.append)
    assert len(recs) == 2
    assert [w.split(": skipped")[0] for w in warnings] == [f"{path}:2", f"{path}:3", f"{path}:4"]
    result = calibrate("report", path, "--format", "json")
    assert result.exit_code == 0, result.output
    assert f"{path}:2" in result.stderr and f"{path}:4" in result.stderr
    assert json.loads(result.stdout)["summary"]["runs"] == 2


@pytest.mark.slow
def test_report_table_json_and_csv(sweep):
    out, _ = sweep
    ids = [r["id"] for r in read(out)]
    table = calibrate("report", out)
    assert table.exit_code == 0, table.output
    for needle in ("measured MiB", "estimated MiB", "error %", "measured phase", "estimated phase", *ids):
        assert needle in table.stdout
    assert "4 runs: 4 ok" in table.stdout and "median" in table.stdout
    data = json.loads(calibrate("report", out, "--format", "json").stdout)
    assert [r["id"] for r in data["runs"]] == ids
    row = data["runs"][0]
    assert row["error_pct"] == pytest.approx(
        100 * (row["estimated_bytes"] - row["measured_bytes"]) / row["measured_bytes"]
    )
    s = data["summary"]
    assert (s["runs"], s["ok"], s["not_ok"]) == (4, 4, 0)
    errors = sorted(abs(r["error_pct"]) for r in data["runs"])
    assert s["max_abs_error_pct"] == errors[-1] and s["median_abs_error_pct"] == (errors[1] + errors[2]) / 2
    csv_lines = calibrate("report", out, "--format", "csv").stdout.strip().splitlines()
    assert csv_lines[0].startswith("id,run,status,measured_bytes,estimated_bytes,error_pct")
    assert len(csv_lines) == 5 and csv_lines[1].startswith(ids[0])


def test_report_of_a_missing_file_is_one_line():
    result = calibrate("report", "no-such-file.jsonl")
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1 and "no-such-file.jsonl" in result.output


@pytest.mark.parametrize(
    "content,needle",
    [
        ("{frobnicate: [1, 2]}", "frobnicate"),
        ("{strategy: ddp}", "list"),
        ("{precision: [fp8]}", "fp8"),
        ("[1, 2]", "map flag names"),
    ],
)
def test_bad_grids_are_one_line_errors(tmp_path, content, needle):
    grid = tmp_path / "grid.yaml"
    grid.write_text(content)
    result = calibrate("run", *TINY, "--grid", grid, "--mode", "emulate", "--out", tmp_path / "x.jsonl")
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:") and needle in lines[0]
    assert not (tmp_path / "x.jsonl").exists()


def test_strategy_all_skips_deepspeed_up_front(tmp_path):
    result = calibrate("cluster", *TINY, "--strategy", "all", "--out", tmp_path)
    assert result.exit_code == 0, result.output
    assert "skipping zero1, zero2, zero3" in result.stderr
    strategies = [
        json.loads(line)["spec"]["plan"]["strategy"] for line in (tmp_path / "runs.jsonl").read_text().splitlines()
    ]
    assert strategies == ["ddp", "fsdp-no-shard", "fsdp-shard-grad-op", "fsdp-full-shard", "fsdp-hybrid-shard"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_cluster_dry_run_writes_a_slurm_script_and_its_torchrun_command_runs(tmp_path):
    result = calibrate(
        "run",
        *MODEL,
        "--vocab",
        256,
        *TRAIN[:-2],
        "--strategy",
        "ddp",
        "--mode",
        "cluster",
        "--nodes",
        1,
        "--gpus-per-node",
        2,
        "--timeout",
        120,
        "--out",
        tmp_path,
    )
    assert result.exit_code == 0, result.output
    script = tmp_path / "calibrate.sbatch"
    assert "#SBATCH --nodes=1" in script.read_text() and '--index "$i"' in script.read_text()
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    (command,) = [line for line in result.stdout.splitlines() if not line.startswith("#")]
    assert command.startswith("torchrun --nnodes 1 --nproc-per-node 2 ") and " -m calibrate " in command
    env = dict(os.environ, MASTER_PORT=str(_free_port()))
    proc = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rec,) = read(tmp_path / "records.jsonl")
    assert rec["status"] == "ok" and rec["mode"] == "cluster"
    assert rec["measurement"]["world_size"] == 2 and rec["measurement"]["emulated"] is False
    assert rec["measurement"]["peak_allocated_bytes"] > 0 and rec["estimate"]["allocated_bytes"] > 0


def test_cluster_fallback_records_a_torchrun_that_died(tmp_path):
    runs = tmp_path / "runs.jsonl"
    records.write_runs(runs, [records.Run(job=TINY_JOB, mode="cluster")])
    out = tmp_path / "records.jsonl"
    fallback = [
        sys.executable,
        "-m",
        "calibrate",
        "--runs",
        str(runs),
        "--index",
        "0",
        "--out",
        str(out),
        "--record-exit-code",
        "124",
        "--since",
        str(time.time() - 5),
    ]
    for _ in range(2):  # the second finds the run recorded and adds nothing
        subprocess.run(fallback, check=True, capture_output=True)
    (rec,) = read(out)
    assert rec["status"] == "timeout" and "code 124" in rec["error"] and rec["measurement"] is None


def test_calibrate_commands_import_no_torch():
    code = (
        "import sys, memplan.cli, calibrate.cli, calibrate.records, calibrate.report, calibrate.runs, "
        "calibrate.cluster; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_calibrate_command_has_help():
    for command in ("run", "cluster", "report"):
        result = calibrate(command, "--help")
        assert result.exit_code == 0 and "Usage" in result.output


def test_cluster_submit_needs_sbatch_on_path_and_a_positive_poll(tmp_path):
    args = ("cluster", *TINY, "--strategy", "ddp", "--out", tmp_path, "--submit")
    result = CliRunner().invoke(main, ["calibrate", *map(str, args)], env={"PATH": str(tmp_path)})
    assert result.exit_code == 2 and result.output.startswith("Error: sbatch is not on PATH")
    result = calibrate(*args, "--poll", 0)
    assert result.exit_code == 2 and "--poll must be a positive number of seconds, got 0" in result.output


def test_cluster_resume_submits_the_runs_without_an_ok_or_oom_record(tmp_path):
    from calibrate import cluster

    statuses = ("ok", "oom", "timeout", "failed", "cancelled")
    runs = [records.Run(job=TINY_JOB, mode="cluster", steps=steps) for steps in range(3, 3 + len(statuses) + 1)]
    plan = cluster.cluster_plan(runs, out_dir=tmp_path, timeout_s=60)
    for run, status in zip(runs, statuses):
        records.append(
            plan.records_path, records.make_record(run, status=status, measurement=None, error="x", wall_s=0)
        )
    # the last run has no record at all
    assert cluster.unsettled(plan).indices == tuple(
        i for i, s in enumerate(statuses + (None,)) if s not in ("ok", "oom")
    )


def test_a_cluster_script_asks_slurm_for_gpus_only_for_cuda_runs(tmp_path):
    from calibrate import cluster

    for device, line in (("cpu", "#SBATCH --cpus-per-task=2"), ("cuda", "#SBATCH --gpus-per-node=2")):
        train = dataclasses.replace(TINY_JOB.train, device=device)
        run = records.Run(job=dataclasses.replace(TINY_JOB, train=train), mode="cluster")
        script = cluster.sbatch_script(cluster.cluster_plan([run], out_dir=tmp_path, timeout_s=60))
        assert line in script.splitlines() and "--gpus-per-node" not in script.replace(line, "")


def test_a_cluster_script_runs_the_interpreter_that_runs_memplan_unless_python_is_set(tmp_path):
    import shlex

    from calibrate import cluster

    run = records.Run(job=TINY_JOB, mode="cluster")
    script = cluster.sbatch_script(cluster.cluster_plan([run], out_dir=tmp_path, timeout_s=60))
    assert f'PYTHON="${{PYTHON:-{shlex.quote(sys.executable)}}}"' in script.splitlines()


def test_cluster_out_that_is_a_file_is_one_line(tmp_path):
    existing = tmp_path / "existing"
    existing.write_text("")
    result = calibrate("cluster", *TINY, "--strategy", "ddp", "--out", existing)
    assert result.exit_code == 2
    assert result.output == f"Error: --out '{existing}' is a file; cluster mode writes into a directory\n"


def test_report_of_an_unreadable_file_is_one_line():
    result = calibrate("report", "/proc/self/mem")
    assert result.exit_code == 2
    assert result.output == "Error: record file '/proc/self/mem' cannot be read: Input/output error\n"


# -- preflight: what would fail every run is refused once, before the first ---------------------
CPU_ONLY = preflight.Machine(python=sys.executable, torch_version="2.13.0+cpu", deepspeed=True)
TWO_GPUS = dataclasses.replace(CPU_ONLY, torch_version="2.13.0+cu128", cuda_devices=2, cuda_name="NVIDIA H100")


def _refused(monkeypatch, machine, *args):
    """``calibrate run`` on ``machine`` (the probe's answer): its result, with no run started."""
    monkeypatch.setattr(preflight, "probe", lambda python=sys.executable: machine)
    monkeypatch.setattr(runs, "execute", lambda *a, **k: pytest.fail("a run started"))
    result = CliRunner().invoke(main, ["calibrate", "run", *map(str, args)])
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "Traceback" not in result.output
    return result.output


@pytest.mark.parametrize(
    ("machine", "args", "message"),
    [
        (
            dataclasses.replace(
                CPU_ONLY, torch_version=None, import_error="ModuleNotFoundError: No module named 'torch'"
            ),
            (),
            f"Error: torch cannot be imported by {sys.executable} (ModuleNotFoundError: No module named 'torch'); "
            'calibration runs need torch>=2.4: pip install ".[calibrate]" '
            "(the CPU build: see memplan calibrate --help)",
        ),
        (
            dataclasses.replace(CPU_ONLY, torch_version="2.1.2"),
            (),
            "Error: torch 2.1.2 is older than calibration needs (torch>=2.4, FSDP2 and the fake process group)",
        ),
        (
            CPU_ONLY,
            ("--device", "cuda"),
            "Error: ddp fp32 llama 2L h64 b2×s32 emulate×2: --device cuda, but torch 2.13.0+cpu sees no CUDA device "
            "here; leave --device out (it defaults to what this machine has) or pass --device cpu",
        ),
        (
            TWO_GPUS,
            ("--device", "cuda", "--gpus", 4, "--mode", "local"),
            "Error: ddp fp32 llama 2L h64 b2×s32 local×4: --mode local needs 4 CUDA devices, this machine has 2; "
            "--mode emulate runs one rank of it on a fake process group, --mode cluster on Slurm",
        ),
        (
            CPU_ONLY,
            ("--precision", "mixed-bf16"),
            "Error: ddp mixed-bf16 llama 2L h64 b2×s32 emulate×2: ddp has no native mixed-bf16 (it runs fp32, "
            "amp-bf16, amp-fp16, bf16); pass --precision one of those, or leave --strategy at all to skip it",
        ),
        (
            dataclasses.replace(CPU_ONLY, deepspeed=False),
            ("--strategy", "zero3"),
            "Error: zero3 fp32 llama 2L h64 b2×s32 emulate×2: zero3 runs under DeepSpeed, which `memplan calibrate "
            "run` does not drive (it drives DDP and FSDP2; python -m validation.dsmatrix measures ZeRO); DeepSpeed is "
            f"not installed for {sys.executable} either",
        ),
    ],
)
def test_preflight_refuses_in_one_line_before_any_run(monkeypatch, tmp_path, machine, args, message):
    base = [*MODEL, "--vocab", 256, "--seq-len", 32, "--micro-batch", 2, "--gpus", 2, "--mode", "emulate"]
    given = dict(zip(args[::2], args[1::2]))
    flags = {"--strategy": "ddp", "--precision": "fp32"} | given
    out = tmp_path / "runs.jsonl"
    output = _refused(monkeypatch, machine, *base, *[x for kv in flags.items() for x in kv], "--out", out)
    assert output.startswith(message), output
    assert not out.exists()


def test_strategy_all_skips_what_torch_runs_no_native_form_of(monkeypatch, tmp_path):
    monkeypatch.setattr(preflight, "probe", lambda python=sys.executable: CPU_ONLY)
    planned = []
    monkeypatch.setattr(runs, "execute", lambda run, **k: planned.append(run) or _OK)
    args = [*MODEL, "--vocab", 256, "--seq-len", 32, "--micro-batch", 2, "--gpus", 2, "--precision", "mixed-bf16"]
    result = calibrate("run", *args, "--mode", "emulate", "--out", tmp_path / "r.jsonl")
    assert result.exit_code == 0, result.output
    assert "skipping ddp: no native mixed-bf16 (torch has none) (--strategy all)" in result.stderr
    assert [r.job.plan.strategy for r in planned] == [
        "fsdp-no-shard",
        "fsdp-shard-grad-op",
        "fsdp-full-shard",
        "fsdp-hybrid-shard",
    ]


# -- what a sweep shows and its exit code: the child's outcomes as it reports them -------------
_MEASURED = {"peak_allocated_bytes": 3 * 2**20, "device": "cpu", "torch_version": "2.13.0+cpu"}
_OK = {"status": "ok", "measurement": _MEASURED, "error": None}
_FAILED = {"status": "failed", "measurement": None, "error": "RuntimeError: gloo died\nTraceback ..."}


def _sweep_of(monkeypatch, tmp_path, outcomes, *extra):
    """``calibrate run`` of DDP then FSDP full shard, whose runs end as ``outcomes`` say."""
    monkeypatch.setattr(preflight, "probe", lambda python=sys.executable: CPU_ONLY)
    left = list(outcomes)
    monkeypatch.setattr(runs, "execute", lambda run, **k: left.pop(0))
    grid = tmp_path / "grid.yaml"
    grid.write_text("strategy: [ddp, fsdp-full-shard]\n")
    out = tmp_path / "runs.jsonl"
    result = calibrate("run", *TINY, "--grid", grid, "--mode", "emulate", "--out", out, *extra)
    return result, out


@pytest.mark.parametrize(
    ("outcomes", "code"),
    [((_OK, _OK), 0), ((_OK, _FAILED), EXIT_SOME_FAILED), ((_FAILED, _FAILED), EXIT_ALL_FAILED)],
)
def test_the_exit_code_says_whether_every_some_or_no_run_was_ok(monkeypatch, tmp_path, outcomes, code):
    result, out = _sweep_of(monkeypatch, tmp_path, outcomes)
    assert result.exit_code == code, result.output
    assert [r["status"] for r in read(out)] == [o["status"] for o in outcomes]  # every run recorded
    lines = result.stderr.splitlines()[1:]
    assert [line[:13] for line in lines] == [f"[{i}/2] {o['status']:<7}" for i, o in enumerate(outcomes, start=1)]


def test_each_run_ends_in_a_line_and_the_sweep_in_a_summary_table(monkeypatch, tmp_path):
    result, out = _sweep_of(monkeypatch, tmp_path, (_OK, _FAILED))
    ok, failed = read(out)
    estimated = ok["estimate"]["allocated_bytes"]
    error_pct = 100 * (estimated - _MEASURED["peak_allocated_bytes"]) / _MEASURED["peak_allocated_bytes"]
    header, first, second = result.stderr.splitlines()
    assert header.startswith("calibrating 2 run(s), --mode emulate, on cpu (no CUDA device here), torch 2.13.0+cpu;")
    assert first.startswith(
        f"[1/2] ok      ddp fp32 llama 2L h64 b2×s32 emulate×2: peak 3.00 MiB, estimate {estimated / 2**20:,.2f} MiB, "
        f"error {error_pct:+.2f} % ({ok['wall_s']:.1f} s); elapsed 0:00:"
    )
    assert second.startswith(
        "[2/2] failed  fsdp-full-shard fp32 llama 2L h64 b2×s32 emulate×2: RuntimeError: gloo died "
        f"({failed['wall_s']:.1f} s)"
    )
    assert "| ok       |      1 |" in result.stdout and "| failed   |      1 |" in result.stdout
    assert "| failed   | fsdp-full-shard fp32 llama 2L h64 b2×s32 emulate×2 | RuntimeError: gloo died" in result.stdout


def test_quiet_shows_no_progress(monkeypatch, tmp_path):
    quiet, _ = _sweep_of(monkeypatch, tmp_path, (_OK, _OK), "--quiet")
    assert quiet.exit_code == 0 and quiet.stderr == "" and "2 of 2 runs recorded" in quiet.stdout


def test_resume_counts_the_recorded_runs_in_the_exit_code(monkeypatch, tmp_path):
    result, _ = _sweep_of(monkeypatch, tmp_path, (_FAILED, _OK))
    assert result.exit_code == EXIT_SOME_FAILED
    again, _ = _sweep_of(monkeypatch, tmp_path, (), "--resume")
    assert again.exit_code == EXIT_SOME_FAILED and "2 already recorded, skipped" in again.stdout


def test_the_device_defaults_to_what_this_machine_has_and_the_header_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(runs, "execute", lambda run, **k: _OK)
    found = preflight.probe()  # the real probe: this interpreter's torch and its CUDA devices
    device = preflight.default_device(found)
    args = [*MODEL, "--vocab", 256, "--seq-len", 32, "--micro-batch", 2, "--precision", "fp32", "--gpus", 2]
    result = calibrate("run", *args, "--strategy", "ddp", "--mode", "emulate", "--out", tmp_path / "r.jsonl")
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[0] == (
        f"calibrating 1 run(s), --mode emulate, on {found.describe(device)} (--device not given: what this machine "
        f"has); records to {tmp_path / 'r.jsonl'}"
    )
    assert [r["spec"]["train"]["device"] for r in read(tmp_path / "r.jsonl")] == [device]


def test_without_torch_calibrate_run_refuses_before_its_first_run(tmp_path):
    """In a venv that has everything memplan needs but torch, the installed CLI's first line."""
    import sysconfig
    from pathlib import Path

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        name = entry.name.lower()
        if not name.startswith(("torch", "functorch", "__editable__", "memplan", "_memplan")):
            (site / entry.name).symlink_to(entry)
    root = Path(__file__).resolve().parent.parent
    (site / "memplan-worktree.pth").write_text(f"{root}\n")
    out = tmp_path / "runs.jsonl"
    done = subprocess.run(
        [python, "-m", "memplan.cli", "calibrate", "run", *map(str, TINY), "--mode", "emulate", "--out", out],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        f"Error: torch cannot be imported by {python} (ModuleNotFoundError: No module named 'torch'); calibration "
        'runs need torch>=2.4: pip install ".[calibrate]" (the CPU build: see memplan calibrate --help)\n'
    )
    assert not out.exists()
