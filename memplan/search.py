"""Exact integer searches over the exact ``totals.final`` (the replayed reserved included): the
largest micro-batch that fits and the fewest GPUs on which some strategy fits. Exponential
search for a bracket, then bisection (for the micro-batch, starting from where each moment's
straight line says it stops fitting).

Memory is non-decreasing in the micro-batch (every activation term is linear in it). In the
GPU count it is non-increasing for every strategy: sharded terms divide by the shard degree,
replicated ones (DDP, ZeRO-1 params) stay put, and HYBRID_SHARD shards over one node, so past
one node it is flat. The one exception is 1 → 2 GPUs (a second rank brings NCCL buffers), so
1 GPU is tried on its own before the bracket (``_first_true`` tests index 0 first and never
bisects across it). tests/test_search.py checks both against exhaustive scans.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from .breakdown import Estimate
from .catalog import decision_setting
from .errors import MemplanError
from .specs import Job
from .strategies import STRATEGIES
from .totals import bound, final
from .totals import fits as _fits
from .totals import headrooms as _headrooms


def _bound_headrooms(job: Job) -> tuple[int, ...]:
    return bound(job).moment_headrooms


def _bound_fits(job: Job) -> bool:
    return bound(job).fits


MICRO_BATCH_LIMIT = 1_000_000  # TrainSpec refuses more
GPU_LIMIT = 1_000_000  # ClusterSpec refuses more
SCAN = 16
"""GPU counts past the bound's answer tried one by one before bisecting."""


def _default_node() -> int:
    return int(decision_setting("default_gpus_per_node"))


def _first_true(pred, hi_limit: int) -> int | None:
    """Smallest i in [0, hi_limit) with pred(i), for a monotone pred (False...False True...True)."""
    if pred(0):
        return 0
    if hi_limit <= 1:
        return None
    lo, hi = 0, 1
    while not pred(hi):
        lo = hi
        if hi >= hi_limit - 1:
            return None
        hi = min(2 * hi, hi_limit - 1)
    while hi - lo > 1:  # pred(lo) False, pred(hi) True
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if pred(mid) else (mid, hi)
    return hi


def max_micro_batch(
    job: Job,
    *,
    limit: int = MICRO_BATCH_LIMIT,
    headrooms: Callable[[Job], tuple[int, ...]] = _headrooms,
    bound: Callable[[Job], tuple[int, ...]] | None = None,
) -> int:
    """Largest micro-batch ≤ limit at which ``job`` fits by ``headrooms``; bounded, then confirmed:
    ``bound`` (headrooms never below ``headrooms``': without the allocator's replayed excess)
    gives the most it can be at no replay's cost; there the exact headrooms decide, and where
    they do not fit, the bound shifted down by the excess found there guesses again below, each
    guess confirmed exactly, until a micro-batch that fits sits next to one that does not (one
    or two replays where the excess changes little with the micro-batch). ``bound`` None: ``totals.bound``'s
    for the default ``headrooms``, none for others (a calibration's may lie below it)."""
    if bound is None and headrooms is _headrooms:
        bound = _bound_headrooms
    if bound is None:
        return _max_micro_batch(job, limit=limit, headrooms=headrooms)
    most = _max_micro_batch(job, limit=limit, headrooms=bound)
    if most == 0:
        return 0

    def room(b: int) -> int:
        return min(headrooms(job.with_(micro_batch=b)))

    # lo fits, hi does not (above ``most`` the bound already does not fit): confirm ``most``; each
    # miss shifts the bound down by the excess found there to guess again below it, each fit steps up
    lo, hi, guess = 0, most + 1, most
    while hi - lo > 1:
        found = room(guess)
        if found >= 0:
            lo, guess = guess, guess + 1
            continue
        hi, excess = guess, min(bound(job.with_(micro_batch=guess))) - found
        shifted = _max_micro_batch(job, limit=hi - 1, headrooms=_less(bound, excess))
        guess = min(max(shifted, lo + 1), hi - 1)
    return lo


def _less(headrooms: Callable[[Job], tuple[int, ...]], excess: int) -> Callable[[Job], tuple[int, ...]]:
    """``headrooms`` less ``excess`` at every moment."""
    return lambda job: tuple(r - excess for r in headrooms(job))


def _max_micro_batch(job: Job, *, limit: int, headrooms: Callable[[Job], tuple[int, ...]]) -> int:
    """Largest micro-batch ≤ limit at which ``job`` fits (the least of ``headrooms`` ≥ 0: the
    analytic moments', or calibrated ones); 0 when not even 1 does.

    Each moment's bytes are affine in the micro-batch (activations are b·…, the rest constant),
    so each moment's line through b = 1 and 2 says where it alone would stop fitting; the
    earliest of these is the answer, up to rounding and the overhead following the peak. That
    guess and the next are checked exactly, then an exponential search and bisection walk from
    the guess (up, or down when it does not fit) to the exact answer."""

    def room(b: int) -> int:
        return min(headrooms(job.with_(micro_batch=b)))

    rooms1 = headrooms(job.with_(micro_batch=1))
    if min(rooms1) < 0 or limit == 1:
        return 0 if min(rooms1) < 0 else 1
    rooms2 = headrooms(job.with_(micro_batch=2))
    if min(rooms2) < 0:
        return 1
    guess = min([limit] + [1 + r1 // (r1 - r2) for r1, r2 in zip(rooms1, rooms2) if r1 > r2])
    guess = max(2, min(limit, guess))
    if room(guess) >= 0:
        if guess == limit:
            return limit
        above = _first_true(lambda i: room(guess + 1 + i) < 0, limit - guess)  # exact if not affine
        return limit if above is None else guess + above
    below = _first_true(lambda i: room(guess - 1 - i) >= 0, guess - 2)  # guess-1 down to 2, which fits
    return 2 if below is None else guess - 1 - below


def gpu_counts(gpus_per_node: int = 0):
    """The i-th GPU count a search may propose: 1..node size, then whole nodes."""
    node = gpus_per_node or _default_node()

    def count(i: int) -> int:
        return i + 1 if i < node else node * (i - node + 2)

    return count, node


def with_gpus(job: Job, gpus: int, gpus_per_node: int = 0) -> Job:
    """``job`` on ``gpus`` GPUs in nodes of ``gpus_per_node`` (0: 8), a partial node below that."""
    cluster = replace(job.cluster, gpus=gpus, gpus_per_node=min(gpus, gpus_per_node or _default_node()))
    return replace(job, cluster=cluster)


def with_strategy(job: Job, strategy: str) -> Job:
    """``job`` under another strategy, keeping its offload where that strategy supports it."""
    offload = job.plan.offload if STRATEGIES[strategy].supports_offload(job.plan.offload) else "none"
    return replace(job, plan=replace(job.plan, strategy=strategy, offload=offload))


@dataclass(frozen=True, kw_only=True)
class MinGpus:
    gpus: int
    strategy: str
    estimate: Estimate
    by_strategy: dict
    """strategy -> fewest GPUs (None: none up to the limit)."""
    corrected: object | None = None
    """The estimate with a calibration applied (``memplan.calibration.Corrected``), where one was."""


def min_gpus_for(
    job: Job,
    *,
    gpus_per_node: int = 0,
    limit: int = GPU_LIMIT,
    fits: Callable[[Job], bool] = _fits,
    bound_fits: Callable[[Job], bool] | None = None,
) -> int | None:
    """Fewest GPUs (1..node size, then whole nodes) on which ``job``'s own strategy fits.

    Bounded, then confirmed: the bound (``totals.bound``: no allocator excess; monotone in the GPU
    count as the module says) is bisected to the fewest GPUs it allows; no fewer can fit. From
    there the counts are tried in order with ``fits`` (the replayed excess, fragmentation, is
    not monotone in the GPU count), the first ``SCAN`` one by one, then by bisection.
    ``bound_fits`` None: ``totals.bound``'s for the default ``fits``, ``fits`` itself for others."""
    count, node = gpu_counts(gpus_per_node)
    limit = min(limit, STRATEGIES[job.plan.strategy].max_gpus or limit)  # "single": one GPU at most
    # the number of counts ≤ limit: 1..limit below a node, else count(index_limit - 1) = node · (limit // node)
    index_limit = limit if limit < node else node + limit // node - 1
    if bound_fits is None:
        bound_fits = _bound_fits if fits is _fits else fits
    first = _first_true(lambda i: bound_fits(with_gpus(job, count(i), gpus_per_node)), index_limit)
    if first is None:
        return None
    for i in range(first, min(first + SCAN, index_limit)):
        if fits(with_gpus(job, count(i), gpus_per_node)):
            return count(i)
    rest = first + SCAN
    if rest >= index_limit:
        return None
    found = _first_true(lambda i: fits(with_gpus(job, count(rest + i), gpus_per_node)), index_limit - rest)
    return None if found is None else count(rest + found)


def min_gpus(
    job: Job,
    strategies: list[str],
    *,
    gpus_per_node: int = 0,
    limit: int = GPU_LIMIT,
    fits: Callable[[Job], bool] = _fits,
    bound_fits: Callable[[Job], bool] | None = None,
) -> MinGpus:
    """Fewest GPUs for which some strategy of ``strategies`` fits, and which (the first listed wins a tie)."""
    one = with_gpus(job, 1, gpus_per_node)  # every strategy runs on one GPU
    by = {
        s: min_gpus_for(
            with_strategy(one, s), gpus_per_node=gpus_per_node, limit=limit, fits=fits, bound_fits=bound_fits
        )
        for s in strategies
    }
    found = [(n, s) for s, n in by.items() if n is not None]
    if not found:
        raise MemplanError(
            f"nothing fits even on {limit} GPUs; try --ac full, --offload all or a smaller --micro-batch"
        )
    gpus, strategy = min(found, key=lambda t: t[0])
    best = with_gpus(with_strategy(job, strategy), gpus, gpus_per_node)
    return MinGpus(gpus=gpus, strategy=strategy, estimate=final(best), by_strategy=by)
