"""CPU time of the caching-allocator replays behind the main job's table
(`memplan estimate --params 13e9 --gpus 8 --gpu-mem 80`): per strategy, the synthesized trace
(events) and its replay, median over runs. CPU time, not wall: on a loaded machine it moves
far less.

    python benchmarks/allocator_replay.py [runs]
"""

import statistics
import sys
import time

from memplan.allocator import replay
from memplan.alloctrace import step_trace
from memplan.inputs import build_jobs
from memplan.memory import Step


def cpu_s(fn, *args) -> float:
    start = time.process_time()
    fn(*args)
    return time.process_time() - start


def main(runs: int = 5) -> None:
    _, jobs = build_jobs(params=13e9, gpus=8, gpu_mem=80)
    total_trace = total_replay = 0.0
    for job in jobs:
        step = Step(job)
        events = step_trace(step)
        trace_s = statistics.median(cpu_s(step_trace, step) for _ in range(runs))
        replay_s = statistics.median(cpu_s(replay, events) for _ in range(runs))
        total_trace, total_replay = total_trace + trace_s, total_replay + replay_s
        timing = f"trace {trace_s * 1e3:5.1f} ms  replay {replay_s * 1e3:5.1f} ms"
        print(f"{job.plan.strategy:<20} {len(events):>6} events  {timing}")
    timing = f"trace {total_trace * 1e3:5.1f} ms  replay {total_replay * 1e3:5.1f} ms"
    print(f"{'all rows':<20} {'':>13}  {timing} (CPU)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
