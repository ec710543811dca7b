"""The caching allocator's excess replayed into an estimate: the flat slack of
``overheads.overhead_terms`` replaced by what the allocator replay (``memplan.alloctrace``)
holds beyond the tensors, under the job's ``alloc_conf``."""

from __future__ import annotations

from dataclasses import replace

from .allocator import AllocConf, parse_alloc_conf
from .alloctrace import reserved
from .breakdown import Component, Estimate, Term
from .overheads import fixed_terms
from .specs import Job


def expandable_excess(est: Estimate) -> int:
    """The replay's excess of ``est``'s job under ``expandable_segments:True``."""
    return reserved(est.job, AllocConf(expandable_segments=True)).excess_bytes


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
