"""The bytes every command reports for a job: one function, ``final``.

``estimate``'s table, JSON and CSV, ``explain``, every option ``recommend`` weighs (the rejected
ones and the layout search included), ``min-gpus``, ``--micro-batch max``, ``sweep`` and the
Python API all read ``final(job)``: the analytic peak (``memory.estimate``) with the caching
allocator's replayed excess (``overheads.with_replayed_allocator``), under the job's
``alloc_conf``.

A replay costs milliseconds to tens of milliseconds, so the searches bound, then confirm:
``bound`` is the analytic peak with the overheads outside the allocator only (the replay's
excess is never negative, so its total is at most ``final``'s); where the bound does not fit,
nothing is replayed; where it does, ``final`` decides. Replays are cached per job.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from .allocator import parse_alloc_conf
from .alloctrace import reserved
from .breakdown import Estimate
from .memory import estimate
from .overheads import fixed_terms
from .replayed import with_replayed_allocator
from .specs import Job


@lru_cache(maxsize=8192)
def final(job: Job) -> Estimate:
    """The estimate every command reports for ``job``: its total includes the replayed reserved."""
    return with_replayed_allocator(estimate(job))


@lru_cache(maxsize=8192)
def bound(job: Job) -> Estimate:
    """``job``'s estimate without the allocator's excess: a lower bound of ``final``'s total
    (the same moments and phase, the same fixed overheads, no cached-but-free bytes)."""
    est = estimate(job)
    return replace(est, overhead=tuple(fixed_terms(job)))


def fits(job: Job) -> bool:
    """``final(job).fits``, replaying only where the bound fits; under a pipeline stage by stage,
    the most allocated first, stopping at the first whose replayed total does not fit (the worst
    stage's total is the largest, so any stage over the usable memory decides)."""
    if not bound(job).fits:
        return False
    stages = getattr(estimate(job), "stages", ())
    if len(stages) > 1 and job.train.device != "cpu":
        conf = parse_alloc_conf(job.cluster.alloc_conf)
        fixed = sum(t.bytes for t in fixed_terms(job))
        for i in sorted(range(len(stages)), key=lambda i: -stages[i].allocated_bytes):
            if stages[i].allocated_bytes + fixed + reserved(job, conf, i).excess_bytes > job.cluster.usable_bytes:
                return False
    return final(job).fits


def headrooms(job: Job) -> tuple[int, ...]:
    """``final(job).moment_headrooms``; where the bound already does not fit, the bound's (all
    the searches need of them there is their sign and their slope)."""
    rooms = bound(job).moment_headrooms
    return rooms if min(rooms) < 0 else final(job).moment_headrooms
