"""Wall time of one calibration point on CPU: a real 2-process gloo job against one rank
emulated on the fake process group, for the same tiny model (DDP and FSDP full-shard).

Two views: end to end as ``memplan calibrate run`` pays it (a fresh child process that
imports torch, spawns the ranks, measures) and the measurement alone (launch.local /
launch.emulate called in this process, torch already imported).

    python benchmarks/calibration_point.py [repeats]
"""

import statistics
import sys
import time

from calibrate.records import Run
from memplan.specs import ClusterSpec, Job, ModelSpec, Plan, TrainSpec

TINY = ModelSpec(arch="llama", num_layers=2, hidden=64, num_heads=4, ffn_hidden=128, vocab_size=256)


def job(strategy: str) -> Job:
    return Job(
        model=TINY,
        train=TrainSpec(seq_len=32, micro_batch=2, precision="fp32", device="cpu"),
        cluster=ClusterSpec(gpus=2),
        plan=Plan(strategy=strategy),
    )


def timed(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main(repeats: int = 3) -> None:
    from calibrate import launch, runs

    print(
        f"one calibration point, {TINY.num_params:,}-parameter llama, seq 32 × micro-batch 2, fp32, "
        f"world size 2, 3 steps (2 warm-up); median of {repeats}"
    )
    for strategy in ("ddp", "fsdp-full-shard"):
        for mode in ("local", "emulate"):
            run = Run(job=job(strategy), mode=mode)
            end_to_end_s, outcome = timed(lambda run=run: runs.execute(run, timeout_s=300), repeats)
            if mode == "local":
                alone_s, m = timed(lambda run=run: launch.local(run.job, nprocs=2)[0], repeats)
            else:
                alone_s, m = timed(lambda run=run: launch.emulate(run.job, world_size=2), repeats)
            print(
                f"  {strategy:16s} {mode:8s} end to end {end_to_end_s:6.2f} s   measurement alone "
                f"{alone_s:6.2f} s   peak {m.peak_allocated_bytes:,} B ({outcome['status']}, "
                f"child's peak {outcome['measurement']['peak_allocated_bytes']:,} B)"
            )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
