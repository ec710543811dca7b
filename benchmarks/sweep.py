"""Configurations per second of ``memplan.sweep`` on the grid of issue 11: 8 model sizes × 10 GPU
counts × 5 micro-batches × 4 sequence lengths, every strategy; cold (the estimate and replay
caches empty, as in a fresh process, the sweep's own per-group caches too) and warm (the same
grid again), and the scalar estimate for comparison. Every row's total includes the replayed
reserved (one replay per configuration), as ``memplan.estimate``'s; ``sizes`` takes the first few
model sizes only (a shorter run).

    python benchmarks/sweep.py [repeats] [sizes]
"""

import sys
import time

from memplan import alloctrace, grid, totals
from memplan.grid import sweep
from memplan.inputs import build_jobs
from memplan.memory import estimate

GRID = dict(
    params=[1e9, 3e9, 7e9, 13e9, 30e9, 70e9, 175e9, 405e9],
    gpus=[1, 2, 4, 8, 16, 24, 32, 64, 128, 256],
    micro_batch=[1, 2, 4, 8, 16],
    seq_len=[512, 2048, 4096, 8192],
    gpu="h100-sxm",
)


def rate(repeats: int, clear: bool) -> tuple[int, float, float]:
    """Rows and the best configurations per wall second and per CPU second of ``repeats`` sweeps
    of GRID (the CPU rate is the one a loaded machine leaves nearly alone)."""
    wall = cpu = 0.0
    for _ in range(repeats):
        if clear:
            for cached in (
                estimate,
                totals.final,
                totals.bound,
                alloctrace.reserved,
                alloctrace._excess,
                grid._group_excess,
                grid._moments,
                grid._cached_jobs,
            ):
                cached.cache_clear()
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        frame = sweep(**GRID)
        wall = max(wall, len(frame) / (time.perf_counter() - start_wall))
        cpu = max(cpu, len(frame) / (time.process_time() - start_cpu))
    return len(frame), wall, cpu


def main(repeats: int = 3) -> None:
    rows, cold, cold_cpu = rate(repeats, clear=True)
    _, warm, warm_cpu = rate(repeats, clear=False)
    print(
        f"sweep of {rows:,} configurations: {cold:,.0f} per second cold, {warm:,.0f} warm "
        f"(per CPU second: {cold_cpu:,.0f} cold, {warm_cpu:,.0f} warm; best of {repeats})"
    )
    _, jobs = build_jobs(params=7e9, gpus=8, gpu="h100-sxm")
    estimate.cache_clear()
    start = time.perf_counter()
    for b in range(1, 33):
        for job in jobs:
            estimate(job.with_(micro_batch=b))
    print(f"scalar estimate: {32 * len(jobs) / (time.perf_counter() - start):,.0f} per second")


if __name__ == "__main__":
    if len(sys.argv) > 2:
        GRID["params"] = GRID["params"][: int(sys.argv[2])]
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
