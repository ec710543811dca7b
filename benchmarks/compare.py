"""Two checkouts of memplan timed side by side on one command, their fresh processes interleaved
(old, new, old, new, ...) so that the machine's drift within the minutes falls on both alike;
each checkout's bytecode compiled first. Prints each one's median and least wall time and
whether their outputs are the same.

    python benchmarks/compare.py OLD_TREE NEW_TREE [runs] [-- memplan arguments]

e.g. ``git worktree add /tmp/old HEAD~2`` then ``python benchmarks/compare.py /tmp/old .``
(the main job by default).
"""

import compileall
import os
import statistics
import sys
from pathlib import Path

from fresh import reference_line, run

MAIN_JOB = ["estimate", "--params", "13e9", "--gpus", "8", "--gpu-mem", "80"]
CODE = "import sys; sys.argv = ['memplan', *sys.argv[1:]]; from memplan.cli import run; run()"


def main(old: str, new: str, runs: int, args: list[str]) -> None:
    trees = [str(Path(t).resolve()) for t in (old, new)]
    for tree in trees:
        compileall.compile_dir(str(Path(tree) / "memplan"), quiet=1)
    walls: dict[str, list[float]] = {t: [] for t in trees}
    outputs: dict[str, str] = {}
    print(reference_line())
    for _ in range(runs):
        for tree in trees:
            os.environ["PYTHONPATH"] = tree  # the checkout imported, ahead of any installed copy
            wall, _, outputs[tree] = run([sys.executable, "-P", "-c", CODE, *args])  # -P: not the cwd first
            walls[tree].append(wall)
    print(reference_line())
    print(f"$ memplan {' '.join(args)}   ({runs} fresh processes each, interleaved)")
    for tree in trees:
        print(f"{tree}: median {statistics.median(walls[tree]):.3f} s wall (min {min(walls[tree]):.3f})")
    print("outputs: the same" if outputs[trees[0]] == outputs[trees[1]] else "outputs: DIFFERENT")


if __name__ == "__main__":
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else MAIN_JOB
    head = argv[: argv.index("--")] if "--" in argv else argv
    main(head[0], head[1], int(head[2]) if len(head) > 2 else 20, extra)
