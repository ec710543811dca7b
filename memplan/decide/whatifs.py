"""The what-ifs the reports print beside an answer, computed here as data: the allocator's
fragmentation and what ``expandable_segments:True`` would hold instead (a second replay), the
paged 8-bit states outside the allocator, the rows whose framework has no built-in form of the
precision, and, for a LoRA or QLoRA job on one GPU, the same option under each fine-tune mode
with its step time. ``memplan.report`` writes them out; it computes none of them."""

from __future__ import annotations

from dataclasses import dataclass

from ..breakdown import Estimate
from ..frameworks import runs_natively
from ..memory import modes_compared
from ..notes import paged_state_bytes
from ..overheads import reserved_bytes
from ..replayed import expandable_excess, most_fragmented
from ..specs import Job
from ..strategies import STRATEGIES
from ..throughput import link_for, step_time
from ..totals import final


@dataclass(frozen=True, kw_only=True)
class Fragmentation:
    """Where the caching allocator holds most beyond the tensors (reserved − allocated), and
    what it would hold there under ``expandable_segments:True``."""

    strategy: str
    excess_bytes: int
    expandable_excess_bytes: int


@dataclass(frozen=True, kw_only=True)
class PagedStates:
    """bitsandbytes' paged 8-bit states of one row: in CUDA unified memory, outside the table."""

    strategy: str
    paged_bytes: int


@dataclass(frozen=True, kw_only=True)
class ModeOutcome:
    """The option under one fine-tune mode: its memory and its predicted step time."""

    mode: str
    total_bytes: int
    usable_bytes: int
    headroom_bytes: int
    fits: bool
    step_s: float


@dataclass(frozen=True, kw_only=True)
class EstimateWhatIfs:
    """What ``estimate``'s table and ``explain`` print below the numbers."""

    fragmentation: Fragmentation | None
    """None where the allocator holds nothing beyond the tensors."""
    paged: tuple[PagedStates, ...]
    """Empty unless the optimizer is paged-adamw8bit on CUDA."""
    not_native: tuple[str, ...]
    """The strategies whose framework has no built-in form of the job's precision."""


def fragmentation(estimates: list[Estimate] | tuple[Estimate, ...]) -> Fragmentation | None:
    """The estimate with the largest allocator excess, replayed again with expandable segments."""
    worst = most_fragmented(estimates)
    excess = reserved_bytes(worst) - worst.allocated_bytes
    if not excess:
        return None
    return Fragmentation(
        strategy=worst.job.plan.strategy, excess_bytes=excess, expandable_excess_bytes=expandable_excess(worst)
    )


def paged_states(estimates: list[Estimate] | tuple[Estimate, ...]) -> tuple[PagedStates, ...]:
    job = estimates[0].job
    if job.train.optimizer != "paged-adamw8bit" or job.train.device != "cuda":
        return ()
    return tuple(PagedStates(strategy=e.job.plan.strategy, paged_bytes=paged_state_bytes(e.job)) for e in estimates)


def not_native(estimates: list[Estimate] | tuple[Estimate, ...]) -> tuple[str, ...]:
    return tuple(
        e.job.plan.strategy
        for e in estimates
        if not runs_natively(STRATEGIES[e.job.plan.strategy], e.job.train.precision)
    )


def estimate_whatifs(estimates: list[Estimate] | tuple[Estimate, ...]) -> EstimateWhatIfs:
    return EstimateWhatIfs(
        fragmentation=fragmentation(estimates), paged=paged_states(estimates), not_native=not_native(estimates)
    )


def finetune_modes(job: Job) -> tuple[ModeOutcome, ...]:
    """A LoRA or QLoRA job on one GPU: the same option under each fine-tune mode (none otherwise),
    each with the total every command reports (the replayed reserved in it: the job's own mode
    says the recommendation's bytes)."""
    if job.train.tuning.mode not in ("lora", "qlora") or job.cluster.gpus != 1:
        return ()
    finals = [(mode, final(est.job)) for mode, est in modes_compared(job)]
    return tuple(
        ModeOutcome(
            mode=mode,
            total_bytes=est.total_bytes,
            usable_bytes=est.usable_bytes,
            headroom_bytes=est.headroom_bytes,
            fits=est.fits,
            step_s=step_time(est.job, link_for(est.job)).step_s,
        )
        for mode, est in finals
    )
