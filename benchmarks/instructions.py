"""The main job's work counted in instructions (valgrind's callgrind), which the machine's load
does not move: on this project's shared 2-core machine the same command's wall time moved by a
third within the hour, its instruction count not at all. Per checkout (each imported from its
tree, its bytecode compiled first): the bare interpreter, ``memplan --version`` (the imports),
the main job warm (its replays' answers read back) and cold (every replay made: in one process,
and as a first run makes them, with forked workers, counting the process the others wait for).

    python benchmarks/instructions.py TREE [TREE ...]
"""

import compileall
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from cli_startup import MAIN_JOB

CODE = "import sys; sys.argv = ['memplan', *sys.argv[1:]]; from memplan.cli import run; run()"


def instructions(argv: list[str], env: dict[str, str]) -> int:
    """The instructions the first process of ``argv`` ran, its forked workers' not counted
    (callgrind reports each process as it ends; the first started is the one that waits)."""
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *argv],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **env},
    ).stderr
    counts = {int(pid): int(n.replace(",", "")) for pid, n in re.findall(r"==(\d+)== Collected : ([\d,]+)", out)}
    return counts[min(counts)]


def main(trees: list[str]) -> None:
    for tree in trees:
        root = str(Path(tree).resolve())
        compileall.compile_dir(str(Path(root) / "memplan"), quiet=1)
        env = {"PYTHONPATH": root, "MEMPLAN_CACHE_DIR": "none"}
        memplan = [sys.executable, "-P", "-c", CODE]
        with tempfile.TemporaryDirectory() as folder:
            subprocess.run(
                [*memplan, *MAIN_JOB],
                check=True,
                capture_output=True,
                env={**os.environ, **env, "MEMPLAN_CACHE_DIR": folder},
            )
            counted = {
                "python -c pass": instructions([sys.executable, "-c", "pass"], env),
                "memplan --version": instructions([*memplan, "--version"], env),
                "main job, warm": instructions([*memplan, *MAIN_JOB], {**env, "MEMPLAN_CACHE_DIR": folder}),
                "main job, cold, one process": instructions(
                    [*memplan, *MAIN_JOB], {**env, "MEMPLAN_REPLAY_WORKERS": "1"}
                ),
                "main job, cold, as a first run": instructions([*memplan, *MAIN_JOB], env),
            }
        print(root)
        for name, n in counted.items():
            print(f"  {name}: {n / 1e6:,.0f} M instructions")


if __name__ == "__main__":
    main(sys.argv[1:])
