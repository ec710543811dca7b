"""Wall time of the layout search for Llama-3.1-405B on 512 H100s at seq 8192 as a user runs it
(a fresh process each time, `memplan recommend ...`: 64 nodes, so the layouts are searched by
default and weighed against data parallel's pick), with its CPU time (user +
system), which moves far less than the wall time on a loaded machine; then the pick.

    python benchmarks/layout_405b.py [runs]
"""

import sys

from fresh import quote, reference_line

ARGS = ["recommend", "--model", "llama-3.1-405b", "--gpus", "512", "--seq-len", "8192", "--gpu", "h100-sxm"]
CLI = [sys.executable, "-m", "memplan.cli", *ARGS]


def main(runs: int = 5) -> None:
    print(reference_line())
    line, out = quote(CLI, runs)
    print(f"$ memplan {' '.join(ARGS)}   ({runs} fresh processes)")
    print(f"cold (every replay made): {line}")
    print(f"warm (replays read back): {quote(CLI, runs, warm=True)[0]}")
    print(reference_line())
    print(out.rstrip())


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
