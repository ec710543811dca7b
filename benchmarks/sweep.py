"""Configurations per second of ``memplan.sweep`` on the grid of issue 11: 8 model sizes × 10 GPU
counts × 5 micro-batches × 4 sequence lengths, every strategy; cold (the estimate cache empty,
as in a fresh process) and warm (the same grid again), and the scalar estimate for comparison.

    python benchmarks/sweep.py [repeats]
"""
import sys
import time

from memplan.grid import sweep
from memplan.inputs import build_jobs
from memplan.memory import estimate

GRID = dict(params=[1e9, 3e9, 7e9, 13e9, 30e9, 70e9, 175e9, 405e9], gpus=[1, 2, 4, 8, 16, 24, 32, 64, 128, 256],
            micro_batch=[1, 2, 4, 8, 16], seq_len=[512, 2048, 4096, 8192], gpu="h100-sxm")


def rate(repeats: int, clear: bool) -> tuple[int, float]:
    """Rows and the best configurations/s of ``repeats`` sweeps of GRID."""
    best = 0.0
    for _ in range(repeats):
        if clear:
            estimate.cache_clear()
        start = time.perf_counter()
        frame = sweep(**GRID)
        best = max(best, len(frame) / (time.perf_counter() - start))
    return len(frame), best


def main(repeats: int = 3) -> None:
    rows, cold = rate(repeats, clear=True)
    _, warm = rate(repeats, clear=False)
    print(f"sweep of {rows:,} configurations: {cold:,.0f} per second cold, {warm:,.0f} warm "
          f"(best of {repeats})")
    _, jobs = build_jobs(params=7e9, gpus=8, gpu="h100-sxm")
    estimate.cache_clear()
    start = time.perf_counter()
    for b in range(1, 33):
        for job in jobs:
            estimate(job.with_(micro_batch=b))
    print(f"scalar estimate: {32 * len(jobs) / (time.perf_counter() - start):,.0f} per second")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
