"""Bytes outside the allocator's tensors: what ``total`` adds to ``allocated``.

Defaults until calibration replaces them. CPU jobs have none of these.
"""
from __future__ import annotations

from .breakdown import Component, Moment, Term
from .specs import Job

MIB = 2**20
# NVML "used" minus the allocator's pool on the V100 of shared/published (1343 MiB);
# the CUDA context grows with the driver's kernel images, so this is the documented default.
CUDA_CONTEXT_BYTES = 1343 * MIB
# NCCL: NCCL_BUFFSIZE (4 MiB) per channel per peer ring/tree buffers, a few hundred MiB
# per communicator at 8 GPUs; 512 MiB default until calibrated.
NCCL_BYTES = 512 * MIB
# caching-allocator slack: reserved exceeds allocated by 5–20 % under FSDP (shared/published README)
ALLOCATOR_SLACK = 0.10


def fixed_terms(job: Job) -> list[Term]:
    """The overheads that do not follow the allocated bytes; none on CPU."""
    if job.train.device == "cpu":
        return []
    B = Component.BUFFERS
    terms = [Term(B, "CUDA context + cuBLAS", "documented default", CUDA_CONTEXT_BYTES)]
    if job.cluster.gpus > 1:
        terms.append(Term(B, "NCCL buffers", "documented default", NCCL_BYTES))
    return terms


def slack_fraction(job: Job) -> float:
    """The caching allocator's slack as a fraction of allocated bytes; none on CPU."""
    return 0.0 if job.train.device == "cpu" else ALLOCATOR_SLACK


def overhead_terms(job: Job, peak: Moment) -> list[Term]:
    terms, fraction = fixed_terms(job), slack_fraction(job)
    if fraction:
        terms.append(Term(Component.BUFFERS, "caching-allocator slack", f"{fraction:.0%} of allocated",
                          int(peak.allocated_bytes * fraction)))
    return terms
