"""What a sweep shows while it runs and when it ends (torch-free).

On a terminal: a tqdm bar (count, elapsed, ETA: the mean time of the runs done so far times
the runs still planned) with a line above it per run as it ends; elsewhere (a log, a Slurm
output file) the same lines, plain, each with its count and ETA, and no bar. ``quiet``: none
of it. The summary table is the caller's to print (``summary_table``).

Example usage::

    with SweepProgress(runs, quiet=False) as progress:
        sweep(runs, out=out, timeout_s=600, on_start=progress.start, on_end=progress.end)
    print(summary_table(progress.ended))
"""

from __future__ import annotations

import sys
import time
from collections import Counter

from .records import STATUSES, Run


def _mib(num_bytes: int | None) -> str:
    return "?" if num_bytes is None else f"{num_bytes / 2**20:,.2f} MiB"


def cause(record: dict) -> str:
    """A record's error, first line."""
    return (record.get("error") or "").strip().split("\n")[0] or "no reason recorded"


def run_line(run: Run, record: dict) -> str:
    """One ended run: its config, measured peak, estimate, error and wall time (or its cause)."""
    wall = f"{record['wall_s']:.1f} s"
    if record["status"] != "ok":
        return f"{record['status']:<7} {run.describe()}: {cause(record)} ({wall})"
    peak = (record.get("measurement") or {}).get("peak_allocated_bytes")
    estimated = (record.get("estimate") or {}).get("allocated_bytes")
    error = f"{100 * (estimated - peak) / peak:+.2f} %" if peak and estimated is not None else "?"
    return f"{'ok':<7} {run.describe()}: peak {_mib(peak)}, estimate {_mib(estimated)}, error {error} ({wall})"


def _clock(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{s:02d}"


class SweepProgress:
    """The bar and the per-run lines of one sweep; ``ended`` keeps (run, record) of each run
    it ran (None for one skipped as already recorded)."""

    def __init__(self, runs: list[Run], *, quiet: bool = False, stream=None):
        self.total = len(runs)
        self.quiet = quiet
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.ended: list[tuple[Run, dict | None]] = []
        self._start_s = time.perf_counter()
        self._bar = None

    def __enter__(self) -> SweepProgress:
        if self.tty and not self.quiet:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, unit="run", file=self.stream, dynamic_ncols=True, leave=False)
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.close()

    def _eta(self) -> str:
        done = len(self.ended)
        elapsed = time.perf_counter() - self._start_s
        left = (self.total - done) * elapsed / done if done else 0.0
        return f"elapsed {_clock(elapsed)}, eta {_clock(left)}"

    def start(self, run: Run) -> None:
        if self._bar is not None:
            self._bar.set_description_str(run.describe())

    def end(self, run: Run, record: dict | None) -> None:
        self.ended.append((run, record))
        if self.quiet:
            return
        count = f"[{len(self.ended)}/{self.total}]"
        line = f"{count} {run_line(run, record)}" if record else f"{count} recorded before, skipped: {run.describe()}"
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
            self._bar.update(1)
        else:
            print(f"{line}; {self._eta()}", file=self.stream, flush=True)


def summary_table(ended: list[tuple[Run, dict | None]]) -> str:
    """Counts by status, then each run that did not end ok with the first line of its cause."""
    from tabulate import tabulate

    records = [r for _, r in ended if r is not None]
    counts = Counter(r["status"] for r in records)
    table = tabulate(
        [[s, counts[s]] for s in STATUSES if counts[s] or s in ("ok", "oom", "timeout", "failed")],
        headers=["status", "runs"],
        tablefmt="github",
    )
    failures = [(run, r) for run, r in ended if r is not None and r["status"] != "ok"]
    if not failures:
        return table
    causes = tabulate(
        [[r["status"], run.describe(), cause(r)] for run, r in failures],
        headers=["status", "run", "cause (first line)"],
        tablefmt="github",
    )
    return f"{table}\n\n{causes}"
