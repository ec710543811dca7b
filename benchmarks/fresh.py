"""A command timed as a user runs it: fresh processes, each one's wall and CPU seconds (user +
system; on a loaded machine it moves far less than the wall time), and the machine's own speed
measured in the same minutes, so that figures taken on different days can be read side by side
(this project's shared 2-core machine ran the same pure-Python loop in 0.96–1.61 s within one
hour of 2026-11-27)."""

import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

REFERENCE_ADDITIONS = 10**7


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(argv: list[str], cache_dir: str = "none") -> tuple[float, float, str]:
    """Wall and CPU seconds of one fresh process running ``argv`` with ``cache_dir`` as its
    replay answers' folder (memplan.replaycache; "none": none kept), and what it printed."""
    env = {**os.environ, "MEMPLAN_CACHE_DIR": cache_dir}
    cpu, start = _children_cpu_s(), time.perf_counter()
    out = subprocess.run(argv, check=True, capture_output=True, text=True, env=env).stdout
    return time.perf_counter() - start, _children_cpu_s() - cpu, out


def quote(argv: list[str], runs: int, *, warm: bool = False) -> tuple[str, str]:
    """``runs`` fresh processes of ``argv``: their times as one line, and the last one's output.
    Cold (the default), each as a first run: every replay made; ``warm``, each as a later run:
    the replays' answers read from a folder an untimed first run filled."""
    if not warm:
        results = [run(argv) for _ in range(runs)]
    else:
        with tempfile.TemporaryDirectory() as folder:
            run(argv, folder)
            results = [run(argv, folder) for _ in range(runs)]
    wall, cpu = [r[0] for r in results], [r[1] for r in results]
    line = (
        f"median {statistics.median(wall):.3f} s wall (min {min(wall):.3f}, max {max(wall):.3f}), "
        f"median {statistics.median(cpu):.3f} s CPU"
    )
    return line, results[-1][2]


def reference_s(runs: int = 3) -> float:
    """The machine's speed: the median seconds of ``REFERENCE_ADDITIONS`` integer additions in a
    plain Python loop (a fresh interpreter each, as the command's)."""
    code = (
        "import time\nt = time.perf_counter()\ns = 0\n"
        f"for i in range({REFERENCE_ADDITIONS}):\n    s += i\n"
        "print(time.perf_counter() - t)"
    )
    return statistics.median(float(run([sys.executable, "-c", code])[2]) for _ in range(runs))


def reference_line() -> str:
    return f"machine: {REFERENCE_ADDITIONS:.0e} Python integer additions in {reference_s():.2f} s (median of 3)"
