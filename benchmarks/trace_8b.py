"""``--mode trace`` of issue 26's speed target: Llama-3.1-8B, FSDP over 8 ranks, seq 8192,
local batch 2, per-op SAC (torchtitan's units), two steps: CPU seconds of this process (the
trace runs in it) and wall seconds, per phase (torch import, then trace and replay). CPU time moves
far less than wall on a loaded machine; the target (60 s) is wall on an idle one.

    python benchmarks/trace_8b.py [model]      # model: a preset, default llama-3.1-8b
"""

import sys
import time


def main(model: str = "llama-3.1-8b") -> None:
    cpu0, wall0 = time.process_time(), time.perf_counter()
    import torch  # noqa: F401

    from calibrate import trace
    from memplan.inputs import build_jobs

    cpu1, wall1 = time.process_time(), time.perf_counter()
    _, (job,) = build_jobs(
        model=model,
        strategy="fsdp-full-shard",
        gpus=8,
        seq_len=8192,
        micro_batch=2,
        ac="op",
        precision="mixed-bf16",
        recipe="torchtitan",
    )
    m = trace.run(job, steps=2, warmup=1)
    cpu2, wall2 = time.process_time(), time.perf_counter()
    print(
        f"{model} fsdp 8 × 2×8192 op-SAC: allocated {m.peak_allocated_bytes / 2**30:.2f} GiB, "
        f"reserved {m.peak_reserved_bytes / 2**30:.2f} GiB (replayed)"
    )
    for phase, cpu, wall in (
        ("import", cpu1 - cpu0, wall1 - wall0),
        ("trace + replay", cpu2 - cpu1, wall2 - wall1),
        ("total", cpu2 - cpu0, wall2 - wall0),
    ):
        print(f"  {phase:16s} {cpu:7.1f} s CPU  {wall:7.1f} s wall")


if __name__ == "__main__":
    main(*sys.argv[1:])
