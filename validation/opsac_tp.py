"""torchtitan's per-op SAC under tensor parallel, traced (``--mode trace``: FSDP2 × TP with
torchtitan's plan, fake tensors, CPU kernels) beside memplan's estimate of the traced job:
``validation/records/opsac_tp_cpu.jsonl`` and ``.md``. On an H100 the trace of such a job was
within 1.9 % of the GPU while memplan was 17.6 % over (``gpu_trace_check_h100.md``).

    python -m validation.opsac_tp            # trace the cases not yet recorded, then the table
    python -m validation.opsac_tp --report   # the table from the records
"""

from __future__ import annotations

import argparse
from pathlib import Path

from calibrate import records
from calibrate.runs import Run, plan, sweep
from memplan.memory import estimate
from validation.trace_matrix import traced_loop

OUT = Path(__file__).resolve().parent / "records" / "opsac_tp_cpu.jsonl"
GIB = 2**30
_COMMON = {
    "precision": "mixed-bf16",
    "strategy": "fsdp-full-shard",
    "recipe": "torchtitan",
    "device": "cuda",
    "ac": "op",
}
_8B_BLOCKS = {"arch": "llama", "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "vocab": 128256}
_SMALL = {"arch": "llama", "hidden": 2048, "heads": 16, "kv_heads": 8, "ffn": 5632, "vocab": 32000}

CASES: tuple[tuple[str, dict], ...] = (
    (
        "8B blocks x2, fsdp8 x tp8 sp, 2x8k",
        _8B_BLOCKS | {"layers": 2, "gpus": 64, "tp": 8, "seq_len": 8192, "micro_batch": 2},
    ),
    (
        "8B blocks x2, fsdp2 x tp2 sp, 1x8k",
        _8B_BLOCKS | {"layers": 2, "gpus": 4, "tp": 2, "seq_len": 8192, "micro_batch": 1},
    ),
    (
        "8B blocks x4, tp4 sp alone, 1x4k",
        _8B_BLOCKS | {"layers": 4, "gpus": 4, "tp": 4, "seq_len": 4096, "micro_batch": 1},
    ),
    (
        "8B blocks x2, fsdp4 x tp2 no sp, 1x4k",
        _8B_BLOCKS | {"layers": 2, "gpus": 8, "tp": 2, "sp": False, "seq_len": 4096, "micro_batch": 1},
    ),
    ("h2048 x6, fsdp2 x tp4 sp, 4x2k", _SMALL | {"layers": 6, "gpus": 8, "tp": 4, "seq_len": 2048, "micro_batch": 4}),
    ("h2048 x6, fsdp8 x tp2 sp, 2x4k", _SMALL | {"layers": 6, "gpus": 16, "tp": 2, "seq_len": 4096, "micro_batch": 2}),
    ("h2048 x6, tp8 sp alone, 1x8k", _SMALL | {"layers": 6, "gpus": 8, "tp": 8, "seq_len": 8192, "micro_batch": 1}),
    (
        "h2048 x6, fsdp4 x tp4 no sp, 2x2k",
        _SMALL | {"layers": 6, "gpus": 16, "tp": 4, "sp": False, "seq_len": 2048, "micro_batch": 2},
    ),
    # added after the change (not held out): eager attention, whose scores (bmm) per-op SAC saves
    (
        "h2048 x6, fsdp4 x tp2 sp, eager, 1x2k",
        _SMALL | {"layers": 6, "gpus": 8, "tp": 2, "seq_len": 2048, "micro_batch": 1, "attention": "eager"},
    ),
)


def _run(flags: dict) -> Run:
    (run,) = plan([_COMMON | flags], mode="trace", steps=2, warmup=1)[0]
    return run


def measure(out: Path = OUT) -> None:
    sweep(
        [_run(flags) for _, flags in CASES],
        out=out,
        timeout_s=1800.0,
        resume=True,
        on_end=lambda run, rec: print(run.describe(), rec and rec["status"], flush=True),
    )


def report(out: Path = OUT) -> str:
    """Per case: the trace's peak against memplan's estimate of the traced job (CPU kernels)."""
    held = {records.record_key(r): r for r in records.read([out])}
    lines = ["| case | trace alloc GiB | estimate alloc GiB | error | phase (trace / est) |", "|---|---|---|---|---|"]
    for name, flags in CASES:
        record = held.get(_run(flags).key)
        if record is None or record["status"] != "ok":
            lines.append(f"| {name} | {record['status'] if record else 'not run'} | | | |")
            continue
        m = record["measurement"]
        est = estimate(traced_loop(records.job_from_spec(record["spec"])))
        traced, estimated = m["peak_allocated_bytes"] / GIB, est.allocated_bytes / GIB
        lines.append(
            f"| {name} | {traced:.3f} | {estimated:.3f} | {100 * (estimated - traced) / traced:+.1f} % "
            f"| {m['phase']} / {est.phase} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", action="store_true", help="Only the table from the records.")
    args = parser.parse_args(argv)
    if not args.report:
        measure()
    print(report(), end="")


if __name__ == "__main__":
    main()
