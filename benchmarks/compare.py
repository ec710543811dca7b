"""Two checkouts of memplan timed side by side on one command, their fresh processes interleaved
(old, new, old, new, ...) so that the machine's drift within the minutes falls on both alike;
each checkout's bytecode compiled first. Prints each one's median and least wall time, the median
of the pairs' differences (new − old: on this project's shared machine it moves less than either
median, taken minutes apart) and whether their outputs are the same. Cold (each run a first run,
every replay made); ``--warm``: each checkout reads the replays' answers its own untimed first run
kept (memplan.replaycache).

    python benchmarks/compare.py OLD_TREE NEW_TREE [runs] [--warm] [-- memplan arguments]

e.g. ``git worktree add /tmp/old HEAD~2`` then ``python benchmarks/compare.py /tmp/old .``
(the main job by default).
"""

import compileall
import os
import statistics
import sys
import tempfile
from pathlib import Path

from fresh import reference_line, run

MAIN_JOB = ["estimate", "--params", "13e9", "--gpus", "8", "--gpu-mem", "80"]
CODE = "import sys; sys.argv = ['memplan', *sys.argv[1:]]; from memplan.cli import run; run()"


def main(old: str, new: str, runs: int, args: list[str], warm: bool = False) -> None:
    trees = [str(Path(t).resolve()) for t in (old, new)]
    for tree in trees:
        compileall.compile_dir(str(Path(tree) / "memplan"), quiet=1)
    walls: dict[str, list[float]] = {t: [] for t in trees}
    outputs: dict[str, str] = {}
    print(reference_line())
    with tempfile.TemporaryDirectory() as old_dir, tempfile.TemporaryDirectory() as new_dir:
        folders = dict(zip(trees, (old_dir, new_dir) if warm else ("none", "none")))
        for i in range(runs + warm):
            for tree in trees:
                os.environ["PYTHONPATH"] = tree  # the checkout imported, ahead of any installed copy
                # -P: not the cwd first
                wall, _, outputs[tree] = run([sys.executable, "-P", "-c", CODE, *args], folders[tree])
                if i >= warm:  # warm: the first run only fills the folder
                    walls[tree].append(wall)
    print(reference_line())
    print(f"$ memplan {' '.join(args)}   ({runs} fresh processes each, interleaved, {'warm' if warm else 'cold'})")
    for tree in trees:
        print(f"{tree}: median {statistics.median(walls[tree]):.3f} s wall (min {min(walls[tree]):.3f})")
    change = statistics.median(b - a for a, b in zip(walls[trees[0]], walls[trees[1]]))
    print(f"new − old, median of the {runs} pairs: {change:+.3f} s")
    print("outputs: the same" if outputs[trees[0]] == outputs[trees[1]] else "outputs: DIFFERENT")


if __name__ == "__main__":
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else MAIN_JOB
    given = argv[: argv.index("--")] if "--" in argv else argv
    head = [a for a in given if a != "--warm"]
    main(head[0], head[1], int(head[2]) if len(head) > 2 else 20, extra, "--warm" in given)
