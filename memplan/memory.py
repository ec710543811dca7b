"""The peak per-GPU bytes of one job: the largest of its step's moments (``memplan.step``), or
under a layout the worst rank's (``memplan.parallel``), with the flat overheads beside it; the
entry point every command's estimate starts from."""

from __future__ import annotations

from functools import lru_cache

from . import moe
from .breakdown import Component, Estimate
from .finetune import COMPARED
from .notes import finetune_notes, loop_notes
from .overheads import overhead_terms
from .parallel.step import estimate_layout
from .precision import Policy
from .quantities import G, O, P
from .specs import Job
from .step import Step

__all__ = ["Step", "estimate", "model_states", "modes_compared", "step_of"]  # Step: where its users import it from


def model_states(job: Job, policy: Policy | None = None) -> dict[Component, int]:
    """Parameters, gradients and optimizer states per GPU, optionally under a policy
    other than the six named ones (to redo a document's arithmetic on its own terms)."""
    step = Step(job, policy)
    out = dict.fromkeys((P, G, O), 0)
    for t in step.param_terms() + step.grad_terms() + step.optimizer_terms():
        out[t.component] += t.bytes
    return out


@lru_cache(maxsize=4096)
def step_of(job: Job) -> Step:
    """The data-parallel step of ``job``, built once: its estimate and the allocator's trace of
    it (``alloctrace``) read the same groups of terms."""
    return Step(job)


@lru_cache(maxsize=4096)
def estimate(job: Job) -> Estimate:
    """Peak per-GPU memory of one configuration: the largest of the step's moments."""
    if not job.layout.is_data_parallel:
        return estimate_layout(job)
    step = step_of(job)
    moments = step.moments()
    peak = max(moments, key=lambda m: m.allocated_bytes)
    host = sum(t.bytes for t in step.host_terms())
    return Estimate(
        job=job,
        peak=peak,
        moments=tuple(moments),
        overhead=tuple(overhead_terms(job, peak)),
        host_bytes=host,
        notes=loop_notes(job) + moe.ep_notes(job) + finetune_notes(job),
    )


def modes_compared(job) -> list[tuple[str, Estimate]]:
    """The job's estimate under each fine-tune mode that applies to its model (full; lora and
    qlora on llama-family blocks), the adapters as the job gives them (DoRA on lora alone): what
    ``recommend`` weighs on one GPU with each one's step time (throughput.flops_per_token,
    dequant_seconds)."""
    modes = COMPARED if job.model.arch == "llama" else COMPARED[:1]
    dora = job.train.dora
    return [(mode, estimate(job.with_(finetune=mode, dora=dora and mode == "lora"))) for mode in modes]
