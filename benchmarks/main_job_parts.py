"""Where the main job's time goes, `memplan estimate --params 13e9 --gpus 8 --gpu-mem 80`, in
fresh processes as a user runs it: the imports (and within them the creation of the package's
dataclasses, whose generated methods Python 3.11 compiles one ``exec`` each), the allocator
replays and the traces they replay, and the rest (the analytic estimates, the search, the rules,
the rendering). Cold: no replay's answer kept (every replay made); warm: the answers read back
from a folder an untimed first run filled (memplan.replaycache). Medians over the runs. Outside
the parts: the interpreter's own start and the modules the probe imports before its clock starts
(dataclasses, json and theirs), 0.05–0.08 s of benchmarks/cli_startup.py's wall time.

    python benchmarks/main_job_parts.py [runs]
"""

import json
import statistics
import sys
import tempfile

from fresh import reference_line, run

# one fresh process of the console script's own path (memplan.cli.run): the parts timed by
# wrapping the functions that do them (timers only), reported as the process ends
PROBE = r"""
import dataclasses, json, os, sys, time
spent = {"dataclasses_s": 0.0, "replays_s": 0.0, "traces_s": 0.0}

def timed(part, function):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[part] += time.perf_counter() - start
    return wrapper

def report_then_exit(code, exit=os._exit):
    spent.update(imports_s=imported - start, run_s=time.perf_counter() - imported)
    print(json.dumps(spent), flush=True)
    exit(code)

dataclasses._process_class = timed("dataclasses_s", dataclasses._process_class)
start = time.perf_counter()
import memplan.cli
from memplan import alloctrace, allocator, api, report
imported = time.perf_counter()
allocator.CachingAllocator.replay = timed("replays_s", allocator.CachingAllocator.replay)
alloctrace.shape_trace = timed("traces_s", alloctrace.shape_trace)
os._exit = report_then_exit  # the console script ends with it, its output flushed
sys.argv = ["memplan", "estimate", "--params", "13e9", "--gpus", "8", "--gpu-mem", "80"]
memplan.cli.run()
"""


def parts(runs: int, cache_dir: str) -> dict[str, float]:
    """The median of each part over ``runs`` fresh processes (``fresh.run``'s, ``cache_dir`` theirs)."""
    found = [json.loads(run([sys.executable, "-c", PROBE], cache_dir)[2].splitlines()[-1]) for _ in range(runs)]
    return {k: statistics.median(r[k] for r in found) for k in found[0]}


def line(name: str, p: dict[str, float]) -> str:
    rest = p["run_s"] - p["replays_s"] - p["traces_s"]
    return (
        f"{name}: imports {p['imports_s']:.3f} s (dataclasses {p['dataclasses_s']:.3f}), "
        f"replays {p['replays_s']:.3f} s, their traces {p['traces_s']:.3f} s, the rest {rest:.3f} s; "
        f"in all {p['imports_s'] + p['run_s']:.3f} s"
    )


def main(runs: int = 10) -> None:
    print(reference_line())
    print(line("cold", parts(runs, "none")))
    with tempfile.TemporaryDirectory() as folder:
        parts(1, folder)
        print(line("warm", parts(runs, folder)))
    print(reference_line())


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
