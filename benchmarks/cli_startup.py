"""Wall time of the main job, `memplan estimate --params 13e9 --gpus 8 --gpu-mem 80`, as a
user sees it (a fresh process each time), and proof that it never imports torch. Cold: its
first run, every allocator replay made; warm: a later run, which reads the replays' answers an
earlier one kept (memplan.replaycache). The CPU
time (user + system) of each process is quoted too: on a loaded machine it moves far less
than the wall time. The package's bytecode is compiled first, as an install leaves it
(`PYTHONDONTWRITEBYTECODE` would otherwise make every process compile every module: 0.06 s
more, measured here).

    python benchmarks/cli_startup.py [runs]
"""

import compileall
import subprocess
import sys
from pathlib import Path

from fresh import quote, reference_line

MAIN_JOB = ["estimate", "--params", "13e9", "--gpus", "8", "--gpu-mem", "80"]
CLI = [sys.executable, "-m", "memplan.cli"]


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
    print(reference_line())
    job = f"memplan {' '.join(MAIN_JOB)}"
    print(f"{job}, cold (every replay made): {quote(CLI + MAIN_JOB, runs)[0]} over {runs} fresh processes")
    print(f"{job}, warm (replays read back): {quote(CLI + MAIN_JOB, runs, warm=True)[0]}")
    print(f"memplan --version (interpreter + click start-up alone): {quote(CLI + ['--version'], runs)[0]}")
    print(reference_line())
    heavy = {"torch", "pandas", "matplotlib", "transformers"} & imported_modules(MAIN_JOB)
    print(f"heavy modules imported by the main job: {sorted(heavy) or 'none'}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
