"""``--mode trace`` of issue 26's speed target: Llama-3.1-8B, FSDP over 8 ranks, seq 8192,
local batch 2, per-op SAC (torchtitan's units), two steps: CPU seconds of this process (the
trace runs in it) and wall seconds, per phase (torch import, trace, replay). CPU time moves
far less than wall on a loaded machine; the target (60 s) is wall on an idle one.

    python benchmarks/trace_8b.py [model]      # model: a preset, default llama-3.1-8b
"""

import sys
import time


def main(model: str = "llama-3.1-8b") -> None:
    cpu0, wall0 = time.process_time(), time.perf_counter()
    import torch  # noqa: F401

    from calibrate import measure, trace
    from memplan.allocator import replay
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
    on_cpu = trace._on_cpu(job)
    with trace.fake_world(8) as recorder:
        m = measure.run(on_cpu, steps=2, warmup=1, emulated=True)
    cpu2, wall2 = time.process_time(), time.perf_counter()
    result = replay(recorder.events)
    cpu3, wall3 = time.process_time(), time.perf_counter()
    print(
        f"{model} fsdp 8 × 2×8192 op-SAC: allocated {m.peak_allocated_bytes / 2**30:.2f} GiB, "
        f"reserved {result.peak_reserved_bytes / 2**30:.2f} GiB, {len(recorder.events):,} events"
    )
    for phase, cpu, wall in (
        ("import", cpu1 - cpu0, wall1 - wall0),
        ("trace (2 steps)", cpu2 - cpu1, wall2 - wall1),
        ("replay", cpu3 - cpu2, wall3 - wall2),
        ("total", cpu3 - cpu0, wall3 - wall0),
    ):
        print(f"  {phase:16s} {cpu:7.1f} s CPU  {wall:7.1f} s wall")


if __name__ == "__main__":
    main(*sys.argv[1:])
