"""Wall time of the main job, `memplan estimate --params 13e9 --gpus 8 --gpu-mem 80`, as a
user sees it (a fresh process each time), and proof that it never imports torch. The CPU
time (user + system) of each process is quoted too: on a loaded machine it moves far less
than the wall time. The package's bytecode is compiled first, as an install leaves it
(`PYTHONDONTWRITEBYTECODE` would otherwise make every process compile every module: 0.06 s
more, measured here).

    python benchmarks/cli_startup.py [runs]
"""

import compileall
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

MAIN_JOB = ["estimate", "--params", "13e9", "--gpus", "8", "--gpu-mem", "80"]
CLI = [sys.executable, "-m", "memplan.cli"]


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def times_s(args) -> tuple[float, float]:
    """Wall and CPU seconds of one fresh process running ``args``."""
    cpu, start = _children_cpu_s(), time.perf_counter()
    subprocess.run(CLI + args, check=True, capture_output=True)
    return time.perf_counter() - start, _children_cpu_s() - cpu


def _quote(args, runs: int) -> str:
    wall, cpu = zip(*(times_s(args) for _ in range(runs)))
    return (
        f"median {statistics.median(wall):.3f} s wall (min {min(wall):.3f}, max {max(wall):.3f}), "
        f"median {statistics.median(cpu):.3f} s CPU"
    )


def imported_modules(args) -> set[str]:
    code = (
        "import sys; from memplan.cli import main\n"
        f"try:\n    main({args!r})\nexcept SystemExit:\n    pass\n"
        "print(' '.join(sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return set(out.split())


def main(runs: int = 10) -> None:
    compileall.compile_dir(str(Path(__file__).resolve().parent.parent / "memplan"), quiet=1)
    print(f"memplan {' '.join(MAIN_JOB)}: {_quote(MAIN_JOB, runs)} over {runs} fresh processes")
    print(f"memplan --version (interpreter + click start-up alone): {_quote(['--version'], runs)}")
    heavy = {"torch", "pandas", "matplotlib", "transformers"} & imported_modules(MAIN_JOB)
    print(f"heavy modules imported by the main job: {sorted(heavy) or 'none'}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
