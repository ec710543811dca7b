"""Bytes outside the allocator's tensors: what ``total`` adds to ``allocated``.

Defaults until calibration replaces them (tables/overheads.csv, with their sources). CPU jobs
have none of these.

``reserved`` is ``allocated`` plus what the caching allocator holds beyond the tensors. The
estimates a user reads (``memplan.estimate``) replay the step through the allocator
(``with_replayed_allocator``: ``total`` = reserved + CUDA context + communicators); the
searches, which weigh hundreds of candidates, charge the flat slack fraction instead
(``overhead_terms``), since one replay costs tens of milliseconds.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache

from . import catalog
from .breakdown import Component, Estimate, Moment, Term
from .parallel.tensor import async_tp_workspace
from .specs import Job

ALLOCATOR_KEYS = ("allocator.slack", "allocator.excess")
"""The overhead terms that are the caching allocator's (part of reserved)."""
CONTEXT_KEY, COMMUNICATOR_KEY = "cuda.context", "nccl.communicator"
"""The overhead terms outside the caching allocator: what a GPU calibration fits."""

MIB = 2**20


def _mib(key: str) -> int:
    """A byte count of tables/overheads.csv (where its source is given)."""
    return int(catalog.overheads()[key]) * MIB


@cache
def _contexts() -> tuple[tuple[str, int], ...]:
    """(GPU name prefix, context bytes) of tables/cuda_context.csv, read once."""
    return tuple((row["gpu_prefix"], int(row["context_mib"]) * MIB) for row in catalog.read_table("cuda_context.csv"))


def _context_bytes(job: Job) -> int:
    """The CUDA context of the job's GPU generation (tables/cuda_context.csv), else the default."""
    for prefix, nbytes in _contexts():
        if job.cluster.gpu_name.startswith(prefix):
            return nbytes
    return _mib("cuda_context_mib")


@cache
def _nccl_formula() -> str:
    """The NCCL term's formula: the default per communicator as channel-peer buffer sets."""
    table = {row["key"]: int(row["value"]) for row in catalog.read_table("nccl.csv")}
    per_set = table["ll_buffsize_bytes"] + table["ll128_buffsize_bytes"] + table["simple_buffsize_bytes"]
    sets = _mib("nccl_mib") / per_set
    return f"{sets:.0f} × (LL + LL128 + Simple) {per_set / MIB:.2f} MiB"


def fixed_terms(job: Job) -> list[Term]:
    """The overheads that do not follow the allocated bytes; none on CPU."""
    if job.train.device == "cpu":
        return []
    B = Component.BUFFERS
    terms = [Term(B, "CUDA context + cuBLAS", "documented default", _context_bytes(job), CONTEXT_KEY)]
    if job.cluster.gpus > 1:
        # one communicator: hybrid sharding's replicate group across nodes would be a second,
        # which would make memory grow with the GPU count (min_gpus bisects on the opposite)
        terms.append(Term(B, "NCCL buffers", _nccl_formula(), communicator_bytes(), COMMUNICATOR_KEY))
    if job.layout.async_tp:
        # on the rank's 1/cp of the sequence, as the rest of the layout's estimate
        local = replace(job.train, seq_len=job.train.seq_len // job.layout.cp)
        terms += async_tp_workspace(job.model, local, job.layout)
    return terms


def communicator_bytes() -> int:
    """One communicator's NCCL buffers (tables/overheads.csv, its default)."""
    return _mib("nccl_mib")


def communicators(job: Job) -> int:
    """The NCCL communicators ``fixed_terms`` charges ``job``."""
    return sum(t.key == COMMUNICATOR_KEY for t in fixed_terms(job))


def allocator_bytes(est: Estimate) -> int:
    """The overhead that is the caching allocator's: the replay's excess or the flat slack."""
    return sum(t.bytes for t in est.overhead if t.key in ALLOCATOR_KEYS)


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
                "allocator.slack",
            )
        )
    return terms


def reserved_bytes(est: Estimate) -> int:
    """What ``torch.cuda.max_memory_reserved`` would report: allocated plus the allocator's terms."""
    return est.allocated_bytes + allocator_bytes(est)
