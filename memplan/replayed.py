"""The caching allocator's excess replayed into an estimate: the flat slack of
``overheads.overhead_terms`` replaced by what the allocator replay (``memplan.alloctrace``)
holds beyond the tensors, under the job's ``alloc_conf``."""

from __future__ import annotations

from dataclasses import replace

from .allocator import AllocConf, parse_alloc_conf
from .alloctrace import replay_later, reserved
from .breakdown import Component, Estimate, Term
from .overheads import fixed_terms, reserved_bytes
from .specs import Job

EXPANDABLE = AllocConf(expandable_segments=True)


def expandable_excess(est: Estimate) -> int:
    """The replay's excess of ``est``'s job under ``expandable_segments:True``."""
    return reserved(est.job, EXPANDABLE).excess_bytes


def most_fragmented(estimates: list[Estimate] | tuple[Estimate, ...]) -> Estimate:
    """The estimate whose allocator holds most beyond its tensors (the first of equals)."""
    return max(estimates, key=lambda e: reserved_bytes(e) - e.allocated_bytes)


def expandable_ahead(estimates: list[Estimate] | tuple[Estimate, ...]) -> None:
    """The what-if a table prints (``decide.whatifs.fragmentation``: ``expandable_excess`` of the
    most fragmented row) begun in a forked worker, while the recommendation is searched
    (``alloctrace.replay_later``)."""
    worst = most_fragmented(estimates)
    if reserved_bytes(worst) > worst.allocated_bytes:
        replay_later(worst.job, EXPANDABLE)


def _replayed_term(job: Job, conf: AllocConf, stage: int | None) -> Term:
    excess = reserved(job, conf, stage).excess_bytes
    return Term(
        Component.BUFFERS,
        "caching-allocator excess (replayed)",
        f"allocator replay, {conf.text}",
        excess,
        "allocator.excess",
    )


def with_replayed_allocator(est: Estimate) -> Estimate:
    """``est`` with the flat slack replaced by the replay's excess under the job's
    ``alloc_conf`` (a ``PYTORCH_CUDA_ALLOC_CONF`` string); CPU jobs are returned as they are.
    Under a pipeline every stage is replayed, and the worst is the one with the most ``total``."""
    job = est.job
    if job.train.device == "cpu":
        return est
    conf = parse_alloc_conf(job.cluster.alloc_conf)
    stages = getattr(est, "stages", ())
    if len(stages) <= 1:
        overhead = (*fixed_terms(job), _replayed_term(job, conf, None))
        if not stages:
            return replace(est, overhead=overhead)
        # a layout without a pipeline: its one stage is the estimate, replayed alike
        return replace(est, overhead=overhead, stages=(replace(stages[0], overhead=overhead),))  # type: ignore[call-arg]
    replayed = tuple(
        replace(s, overhead=(*fixed_terms(job), _replayed_term(job, conf, i))) for i, s in enumerate(stages)
    )
    worst = max(range(len(replayed)), key=lambda i: replayed[i].total_bytes)
    w = replayed[worst]
    return replace(  # type: ignore[call-arg]  # a LayoutEstimate: it has stages
        est,
        peak=w.peak,
        moments=w.moments,
        overhead=w.overhead,
        host_bytes=w.host_bytes,
        notes=w.notes,
        stages=replayed,
        worst_stage=worst,
    )
