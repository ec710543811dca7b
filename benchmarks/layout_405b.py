"""Wall time of the layout search for Llama-3.1-405B on 512 H100s at seq 8192 as a user runs it
(a fresh process each time, `memplan recommend ...`: 64 nodes, so the layouts are searched by
default and weighed against data parallel's pick), with its CPU time (user +
system), which moves far less than the wall time on a loaded machine; then the pick.

    python benchmarks/layout_405b.py [runs]
"""

import resource
import statistics
import subprocess
import sys
import time

ARGS = ["recommend", "--model", "llama-3.1-405b", "--gpus", "512", "--seq-len", "8192", "--gpu", "h100-sxm"]
CLI = [sys.executable, "-m", "memplan.cli", *ARGS]


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_run() -> tuple[float, float, str]:
    """Wall and CPU seconds of one fresh process, and what it printed."""
    cpu, start = _children_cpu_s(), time.perf_counter()
    out = subprocess.run(CLI, check=True, capture_output=True, text=True).stdout
    return time.perf_counter() - start, _children_cpu_s() - cpu, out


def main(runs: int = 5) -> None:
    results = [one_run() for _ in range(runs)]
    wall = [r[0] for r in results]
    cpu = [r[1] for r in results]
    print(f"$ memplan {' '.join(ARGS)}   ({runs} fresh processes)")
    print(
        f"median {statistics.median(wall):.3f} s wall (min {min(wall):.3f}, max {max(wall):.3f}), "
        f"median {statistics.median(cpu):.3f} s CPU"
    )
    print(results[-1][2].rstrip())


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
