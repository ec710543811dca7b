"""A sweep of calibration runs, driven by a parent that never imports torch.

Each run executes in a child process (``python -m calibrate``) that leads a process group
of its own, so that the parent can kill it, ranks included, when it hangs past the
timeout; an OOM, a dead rank or a configuration the harness cannot run comes back as an
outcome. The parent turns every outcome into a record and appends it before the next run.

Example usage::

    runs, skipped = plan([{"arch": "llama", "layers": 2, ..., "strategy": "all"}], mode="emulate")
    summary = sweep(runs, out="runs.jsonl", timeout_s=300, resume=True)
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from memplan.errors import MemplanError
from memplan.frameworks import runs_natively
from memplan.inputs import build_jobs
from memplan.request import SHAPES
from memplan.strategies import STRATEGIES

from . import records
from .records import STAND_IN, Run, UserModel

HARNESS_FRAMEWORKS = ("none", "ddp", "fsdp")
"""What calibrate.measure drives: DDP and FSDP2. DeepSpeed (zero1/2/3) is not installed
here; ``--strategy all`` leaves it out up front, a named zero* is recorded as failed."""
LOG_TAIL_LINES = 15
_PROJECT_ROOT = Path(__file__).resolve().parent.parent


def load_grid(path) -> dict[str, list]:
    """A sweep grid from YAML or JSON: flag name → list of values."""
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
        grid = yaml.safe_load(text)  # JSON is YAML
    except (OSError, yaml.YAMLError) as exc:
        raise MemplanError(f"grid file {str(path)!r} cannot be read: {str(exc).splitlines()[0]}") from None
    if not isinstance(grid, dict) or not grid:
        raise MemplanError(
            f"grid file {str(path)!r} must map flag names to lists of values, "
            "e.g. {strategy: [ddp, fsdp-full-shard], micro-batch: [1, 2]}"
        )
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise MemplanError(f"grid key {key!r} must map to a non-empty list, got {values!r}")
    return grid


def grid_points(grid: dict[str, list]) -> list[dict]:
    """The cartesian product of the grid's values, one dict of flags per point."""
    keys = list(grid)
    return [dict(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]


_MODEL_FLAGS = ("params", "model", "config", "arch", *SHAPES)
"""The flags that name the model (``memplan.request.ModelRequest``)."""


def user_model(
    flags: dict, *, mode: str, module: str | None, step: str | None = None, units: str | None = None
) -> tuple[UserModel | None, dict]:
    """The model built by its own code that the flags name, and the flags with the spec's model
    its stand-in: ``--module``, or under ``--mode trace`` a ``--config`` of a family memplan does
    not describe (transformers builds it); (None, the flags) for a model memplan describes."""
    from memplan.hfconfig import load_config, model_from_hf_config

    user = None
    if module is not None:
        if mode != "trace":
            raise MemplanError(f"--module {module} runs under --mode trace, not --mode {mode}")
        given = [k for k in _MODEL_FLAGS if flags.get(k) is not None]
        if given:
            raise MemplanError(f"--module {module} names the model; drop --{given[0].replace('_', '-')}")
        user = UserModel(factory=module, step=step, units=units, no_estimate=f"memplan does not describe {module}")
    elif mode == "trace" and flags.get("config") is not None:
        config, _ = load_config(flags["config"])
        try:
            model_from_hf_config(config)
        except MemplanError as exc:
            user = UserModel(config=config, step=step, units=units, no_estimate=str(exc))
    if user is None:
        if step is not None or units is not None:
            raise MemplanError(
                f"--{'step' if step is not None else 'units'} goes with --module (or, under --mode trace, a "
                "--config of a family memplan does not describe)"
            )
        return None, flags
    if step is not None and (flags.get("grad_accum") or 1) > 1:
        raise MemplanError(f"--step {step} runs a whole step; drop --grad-accum {flags['grad_accum']}")
    return user, flags | {"config": None, "model": STAND_IN}


def plan(
    flag_sets: list[dict],
    *,
    mode: str,
    steps: int = 3,
    warmup: int = 2,
    workload: str = "native",
    layers_scaled: bool = False,
    user: UserModel | None = None,
) -> tuple[list[Run], dict[str, list[str]]]:
    """The runs of a sweep (each distinct run once) and what ``--strategy all`` left out: the
    DeepSpeed strategies, and those without a native form of the precision, each list by reason."""
    runs: dict[str, Run] = {}
    skipped: dict[str, list[str]] = {}
    for flags in flag_sets:
        _, jobs = build_jobs(**flags)
        for job in jobs:
            strategy, precision = STRATEGIES[job.plan.strategy], job.train.precision
            if flags.get("strategy", "all") == "all":
                reason = None
                if strategy.framework not in HARNESS_FRAMEWORKS:
                    reason = "the harness drives DDP and FSDP2, not DeepSpeed"
                elif not runs_natively(strategy, precision):
                    reason = f"no native {precision} (torch has none)"
                if reason:
                    if strategy.id not in skipped.setdefault(reason, []):
                        skipped[reason].append(strategy.id)
                    continue
            run = Run(
                job=job,
                mode=mode,
                steps=steps,
                warmup=warmup,
                workload=workload,
                layers_scaled=layers_scaled,
                user=user,
            )
            runs.setdefault(run.key, run)
    return list(runs.values()), skipped


def _tail(path: Path) -> str:
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    return "\n".join(lines[-LOG_TAIL_LINES:])


def _child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PROJECT_ROOT), env.get("PYTHONPATH")]))
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def execute(run: Run, *, timeout_s: float, max_host_mem_bytes: int | None = None) -> dict:
    """Run one point in a child process group; its outcome, ``timeout`` if it outlived ``timeout_s``."""
    with tempfile.TemporaryDirectory(prefix="calibrate-") as tmp:
        runs_path = Path(tmp, "run.jsonl")
        records.write_runs(runs_path, [run])
        command = ["-m", "calibrate", "--runs", str(runs_path), "--index", "0", "--result"]
        extra = ["--max-host-mem", str(max_host_mem_bytes)] if max_host_mem_bytes else []
        return execute_child(command, extra, tmp=Path(tmp), timeout_s=timeout_s)


def execute_child(args: list[str], extra: list[str], *, tmp: Path, timeout_s: float, env: dict | None = None) -> dict:
    """``python ARGS RESULT EXTRA`` in a process group of its own, killed with its children
    after ``timeout_s``: the outcome it wrote to RESULT, or ``timeout`` / ``failed`` with the
    tail of its log."""
    result, log = tmp / "result.json", tmp / "log.txt"
    command = [sys.executable, *args, str(result), *extra]
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(
            command,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**_child_env(), **(env or {})},
            start_new_session=True,
        )
        try:
            exit_code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {
                "status": "timeout",
                "measurement": None,
                "error": f"no result after {timeout_s:g} s; the run's processes were killed",
            }
        finally:
            if proc.poll() is None:
                _kill_group(proc)
    if result.exists():
        return json.loads(result.read_text(encoding="utf-8"))
    tail = _tail(log)
    return {
        "status": "failed",
        "measurement": None,
        "error": f"{_cause(tail)} (the run's process exited with code {exit_code} without a result)\n{tail}",
    }


def _cause(log_tail: str) -> str:
    """The line of a dead run's log that says why: its last exception line, else its last line."""
    lines = [line.strip() for line in log_tail.splitlines() if line.strip()]
    raised = [line for line in lines if not line.startswith(("File ", "^", "~")) and "Error" in line.split(":")[0]]
    return (raised or lines or ["no output"])[-1]


EXIT_SOME_FAILED = 3
"""``memplan calibrate run``'s exit code when some planned runs did not end ok (the others did)."""
EXIT_ALL_FAILED = 4
"""... and when none did. 0: every planned run is ok; 2: refused before the first run."""


@dataclass
class SweepSummary:
    num_planned: int
    num_skipped_recorded: int = 0
    statuses: Counter = field(default_factory=Counter)
    """The status of each run this sweep ran."""
    recorded_statuses: Counter = field(default_factory=Counter)
    """The recorded status of each run it skipped (--resume)."""

    def line(self, out) -> str:
        done = ", ".join(f"{n} {s}" for s, n in sorted(self.statuses.items())) or "none run"
        skipped = f"; {self.num_skipped_recorded} already recorded, skipped" if self.num_skipped_recorded else ""
        return f"{sum(self.statuses.values())} of {self.num_planned} runs recorded in {out}: {done}{skipped}"

    @property
    def exit_code(self) -> int:
        """0 when every planned run is ok (now or as recorded), else EXIT_SOME_FAILED or EXIT_ALL_FAILED."""
        ok = self.statuses["ok"] + self.recorded_statuses["ok"]
        if ok == self.num_planned:
            return 0
        return EXIT_ALL_FAILED if ok == 0 else EXIT_SOME_FAILED


def sweep(
    runs: list[Run],
    *,
    out,
    timeout_s: float,
    resume: bool = False,
    max_host_mem_bytes: int | None = None,
    on_start=lambda run: None,
    on_end=lambda run, record: None,
) -> SweepSummary:
    """Execute every run in turn, appending its record to ``out`` as it ends."""
    summary = SweepSummary(num_planned=len(runs))
    done = {records.record_key(r): r for r in records.read([out])} if resume and Path(out).exists() else {}
    for run in runs:
        on_start(run)
        if run.key in done:
            summary.num_skipped_recorded += 1
            summary.recorded_statuses[done[run.key]["status"]] += 1
            on_end(run, None)
            continue
        start_s = time.perf_counter()
        outcome = execute(run, timeout_s=timeout_s, max_host_mem_bytes=max_host_mem_bytes)
        record = records.make_record(run, **outcome, wall_s=time.perf_counter() - start_s)
        records.append(out, record)
        summary.statuses[record["status"]] += 1
        on_end(run, record)
    return summary
