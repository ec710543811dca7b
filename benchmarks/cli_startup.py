"""Wall time of the main job, `memplan estimate --params 13e9 --gpus 8 --gpu-mem 80`, as a
user sees it (a fresh process each time), and proof that it never imports torch.

    python benchmarks/cli_startup.py [runs]
"""
import statistics
import subprocess
import sys
import time

MAIN_JOB = ["estimate", "--params", "13e9", "--gpus", "8", "--gpu-mem", "80"]
CLI = [sys.executable, "-m", "memplan.cli"]


def wall_s(args) -> float:
    start = time.perf_counter()
    subprocess.run(CLI + args, check=True, capture_output=True)
    return time.perf_counter() - start


def imported_modules(args) -> set[str]:
    code = ("import sys; from memplan.cli import main\n"
            f"try:\n    main({args!r})\nexcept SystemExit:\n    pass\n"
            "print(' '.join(sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return set(out.split())


def main(runs: int = 10) -> None:
    times = sorted(wall_s(MAIN_JOB) for _ in range(runs))
    print(f"memplan {' '.join(MAIN_JOB)}: median {statistics.median(times):.3f} s, "
          f"min {times[0]:.3f} s, max {times[-1]:.3f} s over {runs} fresh processes")
    bare = sorted(wall_s(["--version"]) for _ in range(runs))
    print(f"memplan --version (interpreter + click start-up alone): median {statistics.median(bare):.3f} s")
    heavy = {"torch", "pandas", "matplotlib", "transformers"} & imported_modules(MAIN_JOB)
    print(f"heavy modules imported by the main job: {sorted(heavy) or 'none'}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
