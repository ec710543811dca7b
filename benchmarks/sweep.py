"""Configurations per second of ``memplan.sweep`` (the vectorized grid), and of the scalar
estimate for comparison.

    python benchmarks/sweep.py
"""
import time

from memplan.grid import sweep
from memplan.inputs import build_jobs
from memplan.memory import estimate

GRID = dict(params=[1e9, 7e9, 13e9, 70e9], gpus=[8, 16, 64, 256], precision=["mixed-bf16", "bf16", "fp32"],
            ac=["none", "selective", "full"], micro_batch=list(range(1, 65)),
            seq_len=[512, 1024, 2048, 4096, 8192, 16384, 32768], gpu="h100-sxm")


def main() -> None:
    start = time.perf_counter()
    frame = sweep(**GRID)
    elapsed = time.perf_counter() - start
    print(f"sweep: {len(frame):,} configurations in {elapsed:.2f} s = {len(frame) / elapsed:,.0f} per second "
          f"({frame.fits.sum():,} fit)")
    _, jobs = build_jobs(params=7e9, gpus=8, gpu="h100-sxm")
    estimate.cache_clear()
    start = time.perf_counter()
    for b in range(1, 33):
        for job in jobs:
            estimate(job.with_(micro_batch=b))
    scalar = time.perf_counter() - start
    print(f"scalar estimate: {32 * len(jobs) / scalar:,.0f} per second")


if __name__ == "__main__":
    main()
