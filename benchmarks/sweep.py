"""Configurations per second of ``memplan.sweep`` on the grid of issue 11: 8 model sizes × 10 GPU
counts × 5 micro-batches × 4 sequence lengths, every strategy; cold (the estimate and replay
caches empty, as in a fresh process, the sweep's own per-group caches too) and warm (the same
grid again), in one process and spread over the CPUs (``memplan.grid.default_processes``), and
the scalar estimate for comparison. Every row's total includes the replayed
reserved (one replay per configuration), as ``memplan.estimate``'s; ``sizes`` takes the first few
model sizes only (a shorter run). No replay's answer is read from or kept on disk
(``MEMPLAN_CACHE_DIR=none``, memplan.replaycache): cold is every replay made.

    python benchmarks/sweep.py [repeats] [sizes]
"""

import os
import resource
import sys
import time

from memplan import alloctrace, grid, totals
from memplan.grid import sweep
from memplan.inputs import build_jobs
from memplan.memory import estimate

os.environ["MEMPLAN_CACHE_DIR"] = "none"  # read at each replay, the sweep's workers' too

GRID = dict(
    params=[1e9, 3e9, 7e9, 13e9, 30e9, 70e9, 175e9, 405e9],
    gpus=[1, 2, 4, 8, 16, 24, 32, 64, 128, 256],
    micro_batch=[1, 2, 4, 8, 16],
    seq_len=[512, 2048, 4096, 8192],
    gpu="h100-sxm",
)


def _cpu_s() -> float:
    """CPU seconds of this process and of its finished workers (the sweep's replay processes)."""
    own, workers = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + workers.ru_utime + workers.ru_stime


def _clear() -> None:
    """Every cache a fresh process starts without."""
    for cached in (
        estimate,
        totals.final,
        totals.bound,
        alloctrace.reserved,
        grid._moments,
        grid._cached_jobs,
    ):
        cached.cache_clear()
    alloctrace.forget_answers()
    grid._REPLAYED.clear()


def rate(repeats: int, clear: bool, processes: int) -> tuple[int, float, float]:
    """Rows and the best configurations per wall second and per CPU second (the sweep's workers'
    included) of ``repeats`` sweeps of GRID."""
    wall = cpu = 0.0
    for _ in range(repeats):
        if clear:
            _clear()
        start_wall, start_cpu = time.perf_counter(), _cpu_s()
        frame = sweep(**GRID, processes=processes)
        wall = max(wall, len(frame) / (time.perf_counter() - start_wall))
        cpu = max(cpu, len(frame) / (_cpu_s() - start_cpu))
    return len(frame), wall, cpu


def main(repeats: int = 3) -> None:
    for processes in sorted({1, grid.default_processes()}):
        rows, cold, cold_cpu = rate(repeats, clear=True, processes=processes)
        _, warm, warm_cpu = rate(repeats, clear=False, processes=processes)
        print(
            f"sweep of {rows:,} configurations, {processes} process(es): {cold:,.0f} per second cold, "
            f"{warm:,.0f} warm (per CPU second: {cold_cpu:,.0f} cold, {warm_cpu:,.0f} warm; best of {repeats})"
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
