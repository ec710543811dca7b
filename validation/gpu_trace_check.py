"""Full-size jobs on a GPU beside their trace and memplan's estimate: is ``--mode trace`` (fake
tensors, CPU kernels) what one rank of the job allocates and reserves on CUDA?

    python -m validation.gpu_trace_check --gpu OUT.jsonl --budget-s 450   # on a lent device
    python -m validation.gpu_trace_check --trace                           # here: the traces
    python -m validation.gpu_trace_check --report GPU.jsonl                # the table (Markdown)
    python -m validation.gpu_trace_check --snapshot CASE --snapshot-dir DIR   # one case's allocator events

Each GPU run is ``--mode emulate`` on CUDA: rank 0 of the job's world on a fake process group,
with real tensors and CUDA's kernels (``calibrate.launch.emulate``; under ``--tp`` torchtitan's
plan over a dp × tp mesh, ``calibrate.tensor_parallel``), two steps, the second measured, as
the trace. Cases run in the order of what each teaches, within the budget; a case whose trace
``validation.trace_matrix`` already holds is not traced again.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

from calibrate import records
from calibrate.runs import Run, plan, sweep
from memplan.overheads import reserved_bytes
from memplan.totals import final
from validation import trace_matrix

TRACES = (trace_matrix.OUT, Path(__file__).resolve().parent / "records" / "trace_gpu_check.jsonl")
"""Where the traces are read from, the later record of a job winning; the second is written by
``--trace``. The first traces of the GPU cases, on one stream, are ``trace_gpu_check.one-stream.jsonl``."""
GPU_DIR = Path(__file__).resolve().parent / "records" / "gpu" / "h100-torch2.11.0-cu130"
GPU_RECORDS = [GPU_DIR / f"{name}.jsonl" for name in ("gpu_trace_check", "rerun", "run3", "run4")]
"""The H100 records: the first call's; the rerun of TP alone once the harness wrapped it as
torchtitan does (FSDP2 over a dp mesh of one); per-op SAC under TP 2; the 70B-405B ranks. The
later record of a case wins."""
H200_DIR = GPU_DIR.parent / "h200-torch2.11.0-cu130"
H200_RECORDS = [H200_DIR / "gpu_trace_check.jsonl"]
"""The H200 records (one call): the Qwen3-32B rank, the 8B without AC, and the two 8B jobs the
H100 could not hold whole (2 x 8k op SAC ran out of memory, 32k hit its limit)."""
GIB = 2**30
TIMEOUT_S = 180.0
_COMMON = trace_matrix._COMMON | {"device": "cuda"}
_BY_NAME = {case.name: case.flags for case in trace_matrix.CASES}
_SMALL_TP = {"arch": "llama", "layers": 2, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "vocab": 128256}

CASES: tuple[tuple[str, dict], ...] = (
    # the allocator at full size, no TP: allocated and reserved against the trace's replay
    ("llama-3.1-8b fsdp8 16k full-ac", _BY_NAME["llama-3.1-8b fsdp8 16k full-ac"]),
    # TP on CUDA: the trace's DTensor plan against the real one
    ("llama-3.1-8b fsdp4 x tp2 sp, 2x8k full-ac", _BY_NAME["llama-3.1-8b fsdp4 x tp2 sp, 2x8k full-ac"]),
    # where memplan is 18-23 % under the trace: two 8B blocks under TP 8, 8k tokens
    (
        "llama 2L h4096 tp8 sp, 8k full-ac",
        _SMALL_TP | {"gpus": 8, "tp": 8, "seq_len": 8192, "micro_batch": 1, "ac": "full"},
    ),
    # per-op SAC: CUDA's sdpa saves its output and logsumexp where the CPU flash kernel recomputes
    ("llama-2-7b fsdp8 4x4k op-sac (vocab 32k)", _BY_NAME["llama-2-7b fsdp8 4x4k op-sac (vocab 32k)"]),
    (
        "llama 2L h4096 fsdp8 x tp8 sp, 2x8k op-sac",
        _SMALL_TP | {"gpus": 64, "tp": 8, "seq_len": 8192, "micro_batch": 2, "ac": "op"},
    ),
    # per-op SAC under TP at full size (validation/opsac_tp.py fixed the model on two-block cases)
    (
        "llama-3.1-8b fsdp4 x tp2 sp, 2x8k op-sac",
        _BY_NAME["llama-3.1-8b fsdp4 x tp2 sp, 2x8k full-ac"] | {"ac": "op"},
    ),
    # beyond one GPU's memory when built whole: the rank's shards alone (meta-device build)
    ("llama-3.1-70b fsdp32 8k full-ac", _BY_NAME["llama-3.1-70b fsdp32 8k full-ac"]),
    ("llama-3.1-70b fsdp8 x tp4 sp, 8k full-ac", _BY_NAME["llama-3.1-70b fsdp8 x tp4 sp, 8k full-ac"]),
    (
        "qwen2.5-72b fsdp16 x tp8 sp, 2x8k full-ac (vocab 152k)",
        _BY_NAME["qwen2.5-72b fsdp16 x tp8 sp, 2x8k full-ac (vocab 152k)"],
    ),
    ("llama-3.1-405b fsdp64 x tp8 sp, 8k full-ac", _BY_NAME["llama-3.1-405b fsdp64 x tp8 sp, 8k full-ac"]),
    # issue 28's own full-size example (its table said 102 GiB, its recommendation 44), and the
    # 8B without AC: never run on a GPU before the H200 call (traced and committed first)
    (
        "published: qwen3-32b fsdp4 x tp8 sp, 16x4096 full-ac",
        _BY_NAME["published: qwen3-32b fsdp4 x tp8 sp, 16x4096 full-ac"],
    ),
    ("llama-3.1-8b fsdp8 8k no-ac", _BY_NAME["llama-3.1-8b fsdp8 8k no-ac"]),
    # near the H100's 79.6 GiB: the published 32k job last
    ("llama-3.1-8b fsdp8 2x8k op-sac", _BY_NAME["llama-3.1-8b fsdp8 2x8k op-sac"]),
    ("published: llama-3.1-8b fsdp8 32k full-ac", _BY_NAME["published: llama-3.1-8b fsdp8 32k full-ac"]),
)


def _run(flags: dict, mode: str) -> Run:
    (run,) = plan([_COMMON | flags], mode=mode, steps=2, warmup=1)[0]
    return run


def run_gpu(out: Path, budget_s: float, only: str = "") -> None:
    """Each case (whose name matches ``only``) on this machine's GPU, its record appended as it
    ends; none starts past the budget."""
    start = time.perf_counter()
    for name, flags in CASES:
        if not re.search(only, name):
            continue
        if time.perf_counter() - start > budget_s - TIMEOUT_S / 2:
            print(f"{name}: not started (budget)", flush=True)
            continue
        sweep(
            [_run(flags, "emulate")],
            out=out,
            timeout_s=TIMEOUT_S,
            resume=True,
            on_end=lambda run, rec, name=name: print(name, rec and rec["status"], rec and rec["wall_s"], flush=True),
        )


def _events_from_setup(snapshot: dict, device: int) -> list:
    """The run's allocator events from the model's release after setup on (the first
    ``segment_free``: ``calibrate.measure``'s ``empty_cache`` once the model is sharded; all of
    them where the model was built on the meta device), with
    the storages live there allocated afresh (``calibrate.trace.after_setup``): the events the
    trace's replay is compared with."""
    from calibrate import alloctrace
    from calibrate.trace import after_setup

    entries = snapshot["device_traces"][device]
    # none where the model was built on the meta device: nothing whole was ever cached
    first_release = next((i for i, e in enumerate(entries) if e["action"] == "segment_free"), 0)
    before = alloctrace.from_snapshot({"device_traces": {device: entries[:first_release]}}, device)
    events = alloctrace.from_snapshot(snapshot, device)
    return after_setup(events, len(before))


def stem(name: str) -> str:
    """A case's name as a file name."""
    return "".join(c if c.isalnum() or c in "-." else "_" for c in name)


def _save_raw(snap: dict, device: int, path: Path) -> None:
    """The allocator's own record, stack frames left out: every trace entry (``action``,
    ``addr``, ``size``, ``stream``; the ``segment_alloc`` / ``segment_free`` entries are the
    cudaMalloc and cudaFree calls the replay's segments are compared with) and the segments
    held at the end, one JSON document, gzipped."""
    import gzip
    import json

    keep = ("action", "addr", "size", "stream")
    raw = {
        "device_traces": [[e.get(k) for k in keep] for e in snap["device_traces"][device]],
        "segments": [
            {
                "address": s["address"],
                "total_size": s["total_size"],
                "stream": s["stream"],
                "blocks": [[b["size"], b["state"]] for b in s["blocks"]],
            }
            for s in snap["segments"]
            if s["device"] == device
        ],
    }
    with gzip.open(path, "wt") as f:
        json.dump(raw, f)


def snapshot(name: str, directory: Path, raw: bool = False) -> None:
    """One case on this GPU with the allocator's history recorded: its outcome, and its events
    from setup on saved to DIR/NAME.trace.jsonl.gz (``calibrate.alloctrace`` form); with
    ``raw``, the allocator's whole record too (DIR/NAME.raw.json.gz, ``_save_raw``)."""
    import torch

    from calibrate import alloctrace, runner
    from memplan.allocator import replay

    run = _run(dict(CASES)[name], "emulate")
    torch.cuda.memory._record_memory_history(max_entries=4_000_000, context=None, stacks="python")
    outcome = runner.execute(run)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    device = torch.cuda.current_device()
    events = _events_from_setup(snap, device)
    directory.mkdir(parents=True, exist_ok=True)
    alloctrace.save(events, directory / f"{stem(name)}.trace.jsonl.gz")
    if raw:
        _save_raw(snap, device, directory / f"{stem(name)}.raw.json.gz")
    measured = (outcome["measurement"] or {}).get("peak_reserved_bytes")
    print(f"{name}: {outcome['status']}, reserved {measured}, replayed {replay(events).peak_reserved_bytes}")


def run_traces() -> None:
    """The trace of each case not yet in ``TRACES[1]`` (traced with FSDP2's side streams; the
    report takes its records over ``trace_fullsize``'s, whose traces ran on one stream)."""
    held = {records.record_key(r) for r in records.read([TRACES[1]])} if TRACES[1].exists() else set()
    todo = [run for run in (_run(flags, "trace") for _, flags in CASES) if run.key not in held]
    sweep(
        todo,
        out=TRACES[1],
        timeout_s=trace_matrix.TIMEOUT_S,
        resume=True,
        on_end=lambda run, rec: print(run.describe(), rec and rec["status"], flush=True),
    )


def _pct(value: float, truth: float) -> str:
    return f"{100 * (value - truth) / truth:+.1f} %"


def report(gpu_records: list[Path]) -> str:
    """The table: per case run on the device, the latest GPU record of it (files in order, later
    lines winning)."""
    traces = {records.record_key(r): r for path in TRACES if path.exists() for r in records.read([path])}
    measured = {records.record_key(r): r for r in records.read(gpu_records)}
    lines = [
        "| case | GPU alloc GiB | trace alloc GiB | estimate alloc GiB | trace vs GPU | estimate vs GPU "
        "| GPU reserved GiB | trace reserved GiB | estimate reserved GiB | trace vs GPU | estimate vs GPU "
        "| GPU wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, flags in CASES:
        gpu = measured.get(_run(flags, "emulate").key)
        traced = traces.get(_run(flags, "trace").key)
        if gpu is None:  # not run on this device
            continue
        if gpu["status"] != "ok":
            status = gpu["status"] + ": " + (gpu["error"] or "").splitlines()[0][:90]
            lines.append(f"| {name} | {status} |" + " |" * 10)
            continue
        m = gpu["measurement"]
        est = final(records.job_from_spec(gpu["spec"]))  # what every command reports: the replayed reserved
        alloc, res = m["peak_allocated_bytes"] / GIB, m["peak_reserved_bytes"] / GIB
        est_alloc, est_res = est.allocated_bytes / GIB, reserved_bytes(est) / GIB
        if traced is not None and traced["status"] == "ok":
            t_alloc = traced["measurement"]["peak_allocated_bytes"] / GIB
            t_res = traced["measurement"]["peak_reserved_bytes"] / GIB
            trace_cols = (f"{t_alloc:.2f}", _pct(t_alloc, alloc), f"{t_res:.2f}", _pct(t_res, res))
        else:
            trace_cols = ("not traced", "", "", "")
        lines.append(
            f"| {name} | {alloc:.2f} | {trace_cols[0]} | {est_alloc:.2f} | {trace_cols[1]} | {_pct(est_alloc, alloc)} "
            f"| {res:.2f} | {trace_cols[2]} | {est_res:.2f} | {trace_cols[3]} | {_pct(est_res, res)} "
            f"| {gpu['wall_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", type=Path, help="Run the cases on this machine's GPU into this records file.")
    parser.add_argument("--budget-s", type=float, default=450.0)
    parser.add_argument("--only", default="", help="With --gpu: the cases whose name matches this regular expression.")
    parser.add_argument("--trace", action="store_true", help="Trace the cases not yet traced.")
    parser.add_argument("--report", type=Path, nargs="+", help="The table from these files of GPU records.")
    parser.add_argument("--snapshot", help="Run this case with the allocator's history (the events to --snapshot-dir).")
    parser.add_argument("--snapshot-dir", type=Path, default=Path("."))
    parser.add_argument("--raw", action="store_true", help="With --snapshot: the allocator's whole record too.")
    args = parser.parse_args(argv)
    if args.snapshot:
        snapshot(args.snapshot, args.snapshot_dir, args.raw)
    if args.gpu:
        run_gpu(args.gpu, args.budget_s, args.only)
    if args.trace:
        run_traces()
    if args.report:
        print(report(args.report), end="")


if __name__ == "__main__":
    main()
