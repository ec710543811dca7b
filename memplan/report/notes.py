"""The lines under the estimate's table (and explain's total): what fits, the rows without a
built-in precision, paged states, fragmentation and what expandable segments would hold, the
pipeline's stages. Each from the what-ifs ``decide.whatifs`` computed."""

from __future__ import annotations

from ..breakdown import Estimate
from ..decide.whatifs import Fragmentation, PagedStates
from .text import num_gib


def stage_lines(estimates: list[Estimate]) -> list[str]:
    """Under a pipeline, the worst stage of each strategy and every stage's total."""
    lines = []
    for est in estimates:
        stages = getattr(est, "stages", ())
        if len(stages) > 1:
            each = ", ".join(num_gib(s.total_bytes) for s in stages)
            lines.append(
                f"worst pipeline stage ({est.job.plan.strategy}): rank {getattr(est, 'worst_stage', 0)} of "
                f"{len(stages)}; total GiB by stage: {each}"
            )
    return lines


def native_note(not_native: tuple[str, ...], precision: str) -> list[str]:
    """A line naming the rows whose framework has no built-in form of the precision asked for."""
    if not not_native:
        return []
    odd = not_native
    names = odd[0] if len(odd) == 1 else f"{', '.join(odd[:-1])} and {odd[-1]}"
    return [
        f"{names} {'has' if len(odd) == 1 else 'have'} no built-in {precision}: "
        "the row is what it would take; the recommendation searches only precisions each framework runs as is."
    ]


def paged_line(paged: tuple[PagedStates, ...]) -> list[str]:
    """bitsandbytes' paged states, which the table leaves out: how much each row has outside."""
    if not paged:
        return []
    each = ", ".join(f"{p.strategy} {num_gib(p.paged_bytes)}" for p in paged)
    return [
        "paged-adamw8bit: the 8-bit states of tensors of ≥ 1e5 elements live in CUDA unified memory, outside "
        f"torch's allocator counters and the table (GiB per GPU: {each}); the driver pages them to host RAM "
        "under pressure."
    ]


def fragmentation_line(frag: Fragmentation | None, *, several: bool) -> list[str]:
    """What the caching allocator holds beyond the tensors where it holds most, and what
    expandable_segments:True would hold there; ``several``: among several rows (named)."""
    if frag is None:
        return []
    excess, alternative = frag.excess_bytes, frag.expandable_excess_bytes
    verdict = (
        f"expandable_segments:True would hold {num_gib(alternative)} GiB (saves {num_gib(excess - alternative)})"
        if alternative < excess
        else "expandable_segments:True would not lower it"
    )
    where = f"most under {frag.strategy}: " if several else ""
    return [
        f"reserved: the caching allocator's peak (replayed); fragmentation costs {where}"
        f"{num_gib(excess)} GiB beyond the tensors; {verdict}."
    ]


def fits_line(estimates: list[Estimate], finals=None) -> str:
    pairs = list(zip(estimates, finals or estimates))
    fit = [e.job.plan.strategy for e, f in pairs if f.fits]
    miss = [f"{e.job.plan.strategy} (over by {num_gib(-f.headroom_bytes)} GiB)" for e, f in pairs if not f.fits]
    if not fit:
        return "Nothing fits: " + ", ".join(miss) + "."
    return "Fits: " + ", ".join(fit) + "." + (" Does not fit: " + ", ".join(miss) + "." if miss else "")
