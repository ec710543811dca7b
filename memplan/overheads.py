"""Bytes outside the allocator's tensors: what ``total`` adds to ``allocated``.

Defaults until calibration replaces them (tables/overheads.csv, with their sources). CPU jobs
have none of these.
"""

from __future__ import annotations

from . import catalog
from .breakdown import Component, Moment, Term
from .specs import Job

MIB = 2**20


def _mib(key: str) -> int:
    """A byte count of tables/overheads.csv (where its source is given)."""
    return int(catalog.overheads()[key]) * MIB


def fixed_terms(job: Job) -> list[Term]:
    """The overheads that do not follow the allocated bytes; none on CPU."""
    if job.train.device == "cpu":
        return []
    B = Component.BUFFERS
    terms = [Term(B, "CUDA context + cuBLAS", "documented default", _mib("cuda_context_mib"))]
    if job.cluster.gpus > 1:
        terms.append(Term(B, "NCCL buffers", "documented default", _mib("nccl_mib")))
    return terms


def slack_fraction(job: Job) -> float:
    """The caching allocator's slack as a fraction of allocated bytes; none on CPU."""
    return 0.0 if job.train.device == "cpu" else catalog.overheads()["allocator_slack_fraction"]


def overhead_terms(job: Job, peak: Moment) -> list[Term]:
    terms, fraction = fixed_terms(job), slack_fraction(job)
    if fraction:
        terms.append(
            Term(
                Component.BUFFERS,
                "caching-allocator slack",
                f"{fraction:.0%} of allocated",
                int(peak.allocated_bytes * fraction),
            )
        )
    return terms
