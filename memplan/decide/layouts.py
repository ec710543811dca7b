"""The layout search (issue 14): tp within the node × pp (1F1B or interleaved) × the dp
strategy × AC × micro-batch, each estimated on its worst rank and timed by the throughput
model; the fastest that fits is the pick, with the numbers that say why."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache

from ..breakdown import Estimate
from ..errors import MemplanError
from ..layout import Layout
from ..overheads import fixed_terms
from ..parallel.step import worst_candidates
from ..specs import Job
from ..throughput import Link, StepTime, bubble_fraction, default, step_time
from ..totals import final, fits

DP_STRATEGIES = ("fsdp-full-shard", "fsdp-hybrid-shard", "ddp")
"""The data-parallel dimension as torchtitan runs it: FSDP2, HSDP or DDP."""
AC_SEARCHED = ("none", "selective", "full")
MICRO_BATCHES = (1, 2, 4)
PP_DEGREES = (1, 2, 4, 8, 16)
CP_DEGREES = (1, 2, 4)
LONG_SEQUENCE = 32768
"""Sequences from which the search tries context parallel."""
MICROBATCHES_PER_STAGE = 4
"""Pipeline micro-batches searched: 4 per rank, the bubble (pp−1)/(4·pp·V) under 1F1B."""


@dataclass(frozen=True, kw_only=True)
class LayoutOption:
    """One layout with its strategy and step settings, estimated on its worst rank and timed.
    Its bytes are ``totals.final``'s (the replayed reserved included), replayed when first read
    or when the bound (the worst rank without the allocator's excess) fits."""

    job: Job
    step: StepTime

    @property
    def estimate(self) -> Estimate:
        return final(self.job)

    @cached_property
    def fits(self) -> bool:
        """False where the model cannot estimate it: the search skips it."""
        try:
            return _bound_fits(self.job) and fits(self.job)
        except MemplanError:
            return False

    def describe(self) -> str:
        job = self.job
        return (
            f"{job.layout.describe()} × dp {job.dp} ({job.plan.strategy}), AC {job.train.activation_checkpointing}, "
            f"micro-batch {job.train.micro_batch}"
        )


@dataclass(frozen=True, kw_only=True)
class LayoutPick:
    """The search's result: the pick (None: nothing fits), the data-parallel baseline it beat,
    how many settings were weighed and why the layouts the model cannot estimate were skipped."""

    best: LayoutOption | None
    data_parallel: LayoutOption
    """The least memory data parallel alone needs (FSDP over every GPU, full AC, micro-batch 1)."""
    searched: int
    skipped: tuple[str, ...] = ()
    """Per layout and strategy skipped, why (MLA under TP, say): a search skips what it cannot model."""

    def reasons(self) -> list[str]:
        """Why the pick, in numbers."""
        dp = self.data_parallel
        gib = 2**30
        lines = [
            f"{dp.job.plan.strategy} alone over {dp.job.cluster.gpus} GPUs needs "
            f"{dp.estimate.total_bytes / gib:.1f} GiB per GPU even with AC full at micro-batch 1; "
            f"{dp.estimate.usable_bytes / gib:.1f} GiB usable"
            + ("" if not dp.fits else " (it fits, and is the baseline the layouts beat)")
        ]
        if self.skipped:
            lines.append(
                f"{len(self.skipped)} layouts × strategies the model cannot estimate were skipped: {self.skipped[0]}"
            )
        best = self.best
        if best is None:
            return [*lines, f"none of {self.searched} layouts searched fits"]
        job = best.job
        layout, per_node = job.layout, job.cluster.gpus_per_node
        if layout.tp > 1:
            lines.append(
                f"TP {layout.tp} within the node ({per_node} GPUs): each rank holds 1/{layout.tp} of every block, "
                "its per-layer collectives stay on the intra-node link"
            )
        if layout.cp > 1:
            lines.append(
                f"CP {layout.cp}: each rank holds 1/{layout.cp} of the {job.train.seq_len}-token sequence's "
                "activations, K and V passed round the ring"
            )
        if layout.pp > 1:
            lines.append(
                f"PP {layout.pp} ({layout.pp_schedule}, {layout.microbatches} micro-batches"
                + (f", {layout.pp_virtual} stages per rank" if layout.pp_virtual > 1 else "")
                + f"): bubble {bubble_fraction(job):.1%} of compute; worst stage rank "
                f"{getattr(best.estimate, 'worst_stage', 0)} at {best.estimate.total_bytes / gib:.1f} GiB"
            )
        lines.append(
            f"the fastest of {self.searched} layouts searched that keeps "
            f"{default('safe_headroom_fraction'):.0%} of the memory free: "
            f"{best.step.tokens_per_s:,.0f} tokens/s per GPU predicted"
        )
        return lines


def _tp_degrees(job: Job) -> list[int]:
    m, per_node = job.model, job.cluster.gpus_per_node
    sizes = (m.num_heads, m.num_kv_heads, m.ffn_hidden, m.vocab_size)
    return [t for t in (1, 2, 4, 8) if t <= per_node and all(n % t == 0 for n in sizes)]


def tp_within_node(job: Job) -> int:
    """The largest TP degree within the node that divides the model and the GPUs (1: none)."""
    return max(t for t in _tp_degrees(job) if job.cluster.gpus % t == 0)


def _cp_degrees(job: Job) -> list[int]:
    """Context parallel for long sequences only (torchtitan's long-context runs), within the node beside TP."""
    s = job.train.seq_len
    return [c for c in CP_DEGREES if c == 1 or (s >= LONG_SEQUENCE and s % (2 * c) == 0)]


def _layouts(job: Job) -> list[Layout]:
    out = []
    for tp, cp, pp in itertools.product(_tp_degrees(job), _cp_degrees(job), PP_DEGREES):
        if job.cluster.gpus % (tp * cp * pp) or pp > job.model.num_layers or tp * cp > job.cluster.gpus_per_node:
            continue
        m = MICROBATCHES_PER_STAGE * pp
        if pp == 1:
            out.append(Layout(tp=tp, cp=cp))
            continue
        out.append(Layout(tp=tp, cp=cp, pp=pp, pp_microbatches=m))
        if job.model.num_layers >= 2 * pp:
            out.append(Layout(tp=tp, cp=cp, pp=pp, pp_microbatches=m, pp_schedule="interleaved-1f1b", pp_virtual=2))
    return out


def _bound_fits(job: Job) -> bool:
    """The worst rank's allocated peak and the overheads outside the allocator fit: without it,
    nothing does (``totals.bound``, on the ranks ``worst_candidates`` weighs)."""
    room = job.cluster.usable_bytes - sum(t.bytes for t in fixed_terms(job))
    return all(est.allocated_bytes <= room for est in worst_candidates(job))


def _option(job: Job, link: Link) -> LayoutOption:
    return LayoutOption(job=job, step=step_time(job, link))


def _rank(option: LayoutOption) -> tuple:
    """A layout with the safe margin of headroom first (as ``options.rank`` prefers), then the fastest."""
    return (tight(option.estimate), -option.step.tokens_per_s)


def tight(estimate: Estimate) -> bool:
    """Less than the safe margin of headroom (``options.rank``'s and ``_rank``'s preference)."""
    return estimate.headroom_bytes < default("safe_headroom_fraction") * estimate.usable_bytes


def layout_matters(job: Job) -> bool:
    """Whether a layout can matter for ``job``: more than one node, or data parallel alone
    (FSDP over every GPU, AC full, micro-batch 1) keeps less than the safe margin free."""
    if job.cluster.num_nodes > 1:
        return True
    smallest = job.with_(strategy="fsdp-full-shard", activation_checkpointing="full", micro_batch=1, offload="none")
    return tight(final(replace(smallest, layout=Layout())))


def prefer_layout(pick: LayoutPick, best_tokens_per_s: float | None, best_tight: bool) -> bool:
    """Whether the layout search's pick beats data parallel's (None: nothing fits there) by the
    layouts' own rank: the safe margin of headroom first, then tokens/s."""
    if pick.best is None:
        return False
    if best_tokens_per_s is None:
        return True
    return (_rank(pick.best) < (best_tight, -best_tokens_per_s)) and pick.best.job.layout != Layout()


def _settings() -> list[tuple[str, int]]:
    """AC and micro-batch as the search tries them: the least memory first (AC full, micro-batch
    1: where it does not fit, nothing does), then from the cheapest recompute and the largest batch."""
    return [("full", 1), *itertools.product(AC_SEARCHED, sorted(MICRO_BATCHES, reverse=True))]


def _with(job: Job, layout: Layout, strategy: str, ac: str, micro: int) -> Job:
    # a post-forward reshard group is plain data parallel's (torch reshards DTensor parameters to
    # the whole group only), as is the one-unit wrapping (measured there only): a layout's
    # alternative runs without them
    dp = layout.is_data_parallel
    group, wrap = (job.plan.reshard_after_forward, job.plan.fsdp_wrap) if dp else (None, "blocks")
    return replace(
        job,
        plan=replace(job.plan, strategy=strategy, reshard_after_forward=group, fsdp_wrap=wrap),
        train=job.train.with_ac(ac, micro_batch=micro),
        layout=layout,
    )


@dataclass(frozen=True)
class LayoutGroup:
    """One layout and data-parallel strategy of the search: its settings in the order tried,
    from the first whose bound fits (none fits before it; none at all where even the least
    memory's bound does not fit)."""

    order: int
    least: LayoutOption
    """AC full at micro-batch 1: where it does not fit, the group has no option."""
    candidates: tuple[LayoutOption, ...]
    weighed: int
    """How many settings the bound weighed."""

    @cached_property
    def most_tokens_per_s(self) -> float:
        """No option of the group is faster (its pick is one of the candidates)."""
        return max(o.step.tokens_per_s for o in self.candidates)

    def pick(self) -> LayoutOption | None:
        """The first setting that fits, where the least-memory one does."""
        if not self.candidates or not self.least.fits:
            return None
        return next(o for o in self.candidates if o.fits)


@lru_cache(maxsize=256)
def layout_group(job: Job, layout: Layout, strategy: str, link: Link, order: int = 0) -> LayoutGroup:
    """A layout and strategy's settings walked by the bound (no replay); cached, as the rules'
    bound (``rules.agrees``) walks the group their verdict then confirms (``pick``). A setting the model
    cannot take (MLA under selective AC, say) is skipped; where it cannot take the least-memory
    one, this raises (``search_layouts`` skips the layout and strategy)."""
    settings = _settings()
    least = _option(_with(job, layout, strategy, *settings[0]), link)
    if not _bound_fits(least.job):
        return LayoutGroup(order, least, (), 1)
    built = [least.job, *(_built(job, layout, strategy, s) for s in settings[1:])]
    # the last setting is the least-memory one again: its bound fits
    first = next(i for i in range(1, len(settings)) if _fits_by_bound(built[i]))
    rest = (_option(j, link) for j in built[first:] if j is not None)
    return LayoutGroup(order, least, tuple(rest), 1 + first)


def _built(job: Job, layout: Layout, strategy: str, setting: tuple[str, int]) -> Job | None:
    """``_with`` at ``setting`` (AC, micro-batch); None where the model cannot take it."""
    try:
        return _with(job, layout, strategy, *setting)
    except MemplanError:
        return None


def _fits_by_bound(job: Job | None) -> bool:
    """``_bound_fits``; False where the model cannot build (None) or estimate ``job``."""
    try:
        return job is not None and _bound_fits(job)
    except MemplanError:
        return False


@lru_cache(maxsize=64)
def search_layouts(job: Job, link: Link) -> LayoutPick:
    """Every layout of ``_layouts`` × ``DP_STRATEGIES`` × ``AC_SEARCHED`` × ``MICRO_BATCHES``; for
    each layout and strategy the AC and micro-batch are tried from the cheapest recompute and
    the largest batch down, and the first that fits is that layout's option; the pick is the
    least of them by ``_rank``. Bound, then confirm: the settings are walked by the bound (no
    replay), and the groups are confirmed (replayed) from the fastest any of their settings
    could be, until none left could beat a pick with the safe margin free. Cached:
    ``recommend`` asks whether the pick wins, then prints it."""
    groups: list[LayoutGroup] = []
    searched, skipped = 0, []
    for layout in _layouts(job):
        for strategy in DP_STRATEGIES:
            if strategy == "fsdp-hybrid-shard" and job.cluster.num_nodes == 1:
                continue
            try:
                group = layout_group(job, layout, strategy, link, len(groups))
            except MemplanError as error:
                skipped.append(str(error))
                continue
            searched += group.weighed
            if group.candidates:
                groups.append(group)
    best, best_key = None, None
    for group in sorted(groups, key=lambda g: -g.most_tokens_per_s):
        if best_key is not None and not best_key[0] and group.most_tokens_per_s < -best_key[1]:
            break  # neither it nor any after it is as fast as a pick with the margin free
        option = group.pick()
        key = None if option is None else (*_rank(option), group.order)
        if key is not None and (best_key is None or key < best_key):
            best, best_key = option, key
    baseline = _option(_with(job, Layout(), "fsdp-full-shard", "full", 1), link)
    return LayoutPick(best=best, data_parallel=baseline, searched=searched, skipped=tuple(skipped))
