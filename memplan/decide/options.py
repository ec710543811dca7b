"""Options: every allowed strategy × precision × AC × offload × micro-batch, estimated exactly
and timed on one ``Basis`` (links and, where one applies, a calibration), then ranked."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cache, cached_property, lru_cache, total_ordering
from typing import Any

from .. import catalog, search
from ..breakdown import Estimate, Fit
from ..calibration import Calibration, Corrected, Correction, apply, resolve
from ..errors import MemplanError
from ..frameworks import runs_natively
from ..moe import allows_ep
from ..specs import AC_MODES, OFFLOADS, Job
from ..strategies import STRATEGIES, strategies_on
from ..throughput import Link, StepTime, default, link_for, relative_to_ddp, step_time
from ..totals import bound, final

PRIORITIES = ("speed", "memory", "simplicity")
AXES = ("strategy", "precision", "ac", "offload", "micro_batch")
FRAMEWORKS = ("single", "ddp", "fsdp", "deepspeed")
"""What ``framework=`` restricts the search to; ``single`` is a plain loop (``Strategy.framework`` none)."""
_AC_ORDER = {mode: i for i, mode in enumerate(AC_MODES)}  # none < selective < full: more recompute


@cache
def simplicity_ranks() -> dict[str, int]:
    return {row["id"]: int(row["rank"]) for row in catalog.read_table("simplicity.csv")}


def framework_strategies(framework: str) -> tuple[str, ...]:
    """The strategy ids of one of ``FRAMEWORKS``."""
    if framework not in FRAMEWORKS:
        raise MemplanError(f"framework {framework!r} is not one of: {', '.join(FRAMEWORKS)}")
    own = "none" if framework == "single" else framework
    return tuple(s.id for s in STRATEGIES.values() if s.framework == own)


def allowed_strategies(framework: str | None, strategies=None) -> tuple[str, ...] | None:
    """The strategies of ``framework`` that are among ``strategies`` (None, None: all, as None)."""
    if framework is None and strategies is None:
        return None
    for s in strategies or ():
        if s not in STRATEGIES:
            raise MemplanError(f"strategy {s!r} is not one of: {', '.join(STRATEGIES)}")
    own = framework_strategies(framework) if framework else tuple(STRATEGIES)
    allowed = tuple(s for s in own if strategies is None or s in strategies)
    if not allowed:
        raise MemplanError(f"framework {framework} runs none of: {', '.join(strategies)}; it runs: {', '.join(own)}")
    return allowed


@dataclass(frozen=True, kw_only=True)
class Option(Fit):
    """One configuration, timed; its bytes are ``totals.final``'s, replayed when first read
    (where the bound does not fit, whether it fits needs no replay). Its micro-batch is the
    settings' own, or (``limit``) the largest that fits up to ``limit`` (1 where none does),
    searched when first read: an option the ranking never reaches is never replayed."""

    settings: Job
    """The job but, where ``limit`` is set, its micro-batch."""
    basis: Basis = field(repr=False, compare=False)
    limit: int = 0
    """0: the micro-batch is the settings'; else searched up to this (``search.max_micro_batch``)."""

    @property
    def modelled(self) -> bool:
        """Whether the model can estimate the settings (``unmodelled``: one estimate, when first
        asked): a search builds every combination, and ``ranked`` drops these as it reaches them."""
        return unmodelled(self.settings) is None

    @cached_property
    def job(self) -> Job:
        if not self.limit:
            return self.settings
        b = self.basis
        found = search.max_micro_batch(self.settings, limit=self.limit, headrooms=b.headrooms, bound=b.bound_headrooms)
        return self.settings.with_(micro_batch=max(found, 1))

    @cached_property
    def step(self) -> StepTime:
        return self.basis.step(self.job)

    @cached_property
    def relative_throughput(self) -> float:
        """Tokens/s over DDP's at the same settings (DDP fitting or not)."""
        return relative_to_ddp(self.job, self.basis.step)

    def micro_batches(self) -> range:
        """The micro-batches ``job`` can have where it fits, by the bound (no replay): none where
        it cannot fit."""
        if not self.limit:
            fits = self.basis.bound(self.settings).fits
            return range(self.settings.train.micro_batch, self.settings.train.micro_batch + fits)
        most = search.max_micro_batch(self.settings, limit=self.limit, headrooms=self.basis.bound_headrooms)
        return range(1, most + 1)

    @cached_property
    def estimate(self) -> Estimate:
        return final(self.job)

    @cached_property
    def corrected(self) -> Corrected | None:
        """The estimate with the calibration applied, where one applies: its total decides."""
        return self.basis.corrected(self.estimate)

    @property
    def fits(self) -> bool:
        return self.basis.bound(self.job).fits and self.final.fits

    @property
    def final(self) -> Estimate | Corrected:
        """What decides: the corrected estimate where a calibration applies."""
        return self.corrected or self.estimate

    @property
    def total_bytes(self) -> int:
        return self.final.total_bytes

    @property
    def usable_bytes(self) -> int:
        return self.estimate.usable_bytes

    @property
    def key(self) -> tuple:
        j = self.job
        return (
            j.plan.strategy,
            j.train.precision,
            j.train.activation_checkpointing,
            j.plan.offload,
            j.train.micro_batch,
        )

    def label(self) -> str:
        j = self.job
        return (
            f"{j.plan.strategy}, {j.train.precision}, AC {j.train.activation_checkpointing}, "
            f"offload {j.plan.offload}, micro-batch {j.train.micro_batch}"
        )


@dataclass(frozen=True, kw_only=True)
class Basis:
    """What every option is judged on: the links and, where a calibration applies, its correction
    (the corrected total decides what fits; the measured MFU — or, on the very device it was
    measured on, FLOP/s — and exposed communication replace the throughput defaults)."""

    link: Link
    calibration: Calibration | None = None
    correction: Correction | None = None
    device_matches: bool = False
    _steps: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """``step`` per job: a search times the same job for many options and rankings."""
    _rank_bounds: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """``rank_bound`` per (settings, limit, priority): the rules rank the recommendation's options again."""
    _fastest: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """``fastest_tokens_per_s`` per (settings, limit), as those: 258 asked, 144 distinct, in the main job."""

    @property
    def measured_compute(self) -> bool:
        """Compute time from FLOP/s measured on this very device (no datasheet peak involved)."""
        return bool(self.correction and self.device_matches and any(t.mfu is None for t in self.correction.throughput))

    def step(self, job: Job) -> StepTime:
        found = self._steps.get(job)
        if found is None:
            found = self._steps[job] = self._step(job)
        return found

    def _step(self, job: Job) -> StepTime:
        fit = self.correction.speed(job.plan.strategy) if self.correction else None
        if fit is None:
            return step_time(job, self.link)
        measured = fit.achieved_flops if fit.mfu is None and self.device_matches else None
        return step_time(
            job, self.link, mfu=fit.mfu, achieved_flops=measured, exposed_fraction=fit.exposed_comm_fraction
        )

    def corrected(self, est: Estimate) -> Corrected | None:
        return apply(est, self.correction, device_matches=self.device_matches) if self.correction else None

    def final(self, job: Job) -> Estimate | Corrected:
        est = final(job)
        return self.corrected(est) or est

    def bound(self, job: Job) -> Estimate | Corrected:
        """``final``'s lower bound: no allocator excess (``totals.bound``)."""
        est = bound(job)
        return self.corrected(est) or est

    def bound_fits(self, job: Job) -> bool:
        return self.bound(job).fits

    def bound_headrooms(self, job: Job) -> tuple[int, ...]:
        return self.bound(job).moment_headrooms

    def headrooms(self, job: Job) -> tuple[int, ...]:
        """Per moment, as ``Estimate.moment_headrooms``: their least is the headroom (the bound's
        where it does not fit: no replay needed to say so)."""
        rooms = self.bound(job).moment_headrooms
        return rooms if min(rooms) < 0 else self.final(job).moment_headrooms

    def fits(self, job: Job) -> bool:
        return self.bound(job).fits and self.final(job).fits

    def evaluate(self, job: Job, *, limit: int = 0) -> Option:
        """``job`` as an option; ``limit``: at the largest micro-batch up to it that fits."""
        return Option(settings=job, basis=self, limit=limit)


def basis_for(
    job: Job, *, interconnect: str | None = None, bw_gbs: float | None = None, calibration: str | None = None
) -> Basis:
    found = resolve(job, calibration)
    link = link_for(job, interconnect=interconnect, bw_gbs=bw_gbs)
    if found is None:
        return Basis(link=link)
    loaded, correction, same = found
    return Basis(link=link, calibration=loaded, correction=correction, device_matches=same)


@total_ordering
class _Total:
    """An option's total in a sort key, read (replayed) only when the key's earlier items tie."""

    def __init__(self, option: Option):
        self.option = option

    def __eq__(self, other) -> bool:
        return self.option.total_bytes == other.option.total_bytes

    def __lt__(self, other) -> bool:
        return self.option.total_bytes < other.option.total_bytes


def rank(option: Option, priority: str) -> tuple:
    """The sort key of ``option`` by ``priority``: the least is the best."""
    speed = -option.step.tokens_per_s
    simple = simplicity_ranks()[option.job.plan.strategy]
    mem = _Total(option)
    if priority == "memory":
        return (mem, speed, simple)
    if priority == "simplicity":
        return (
            option.job.plan.offload != "none",
            simple,
            _AC_ORDER[option.job.train.activation_checkpointing],
            speed,
            mem,
        )
    # equal to speed_significant_figures: as fast; then an option with a safe margin, then the simpler
    tight = not option.fits or option.headroom_bytes < default("safe_headroom_fraction") * option.usable_bytes
    return (_as_fast(speed), tight, simple, mem)


def _as_fast(speed: float) -> float:
    """``speed`` (negative tokens/s) to speed_significant_figures: equal is as fast."""
    digits = int(catalog.decision_setting("speed_significant_figures"))
    return -float(f"{-speed:.{digits}g}")


BOUNDED_MICRO_BATCHES = 256
"""Past this many micro-batches the bound allows, an option's best rank is not bounded (it is confirmed)."""


def rank_floor(option: Option, priority: str) -> tuple:
    """A key no later than ``rank_bound(option, priority)`` where the option fits at all, from one
    step time and no estimate: the most tokens/s the option could reach at any micro-batch up
    to its limit (``fastest_tokens_per_s``); ``()`` by memory (every option is then bounded)."""
    if priority == "memory":
        return ()
    return _speed_key(option.settings, priority, -fastest_tokens_per_s(option))


def fastest_tokens_per_s(option: Option) -> float:
    """No fewer tokens/s than ``option`` predicts at any micro-batch up to its limit: the step at
    the limit with no communication exposed, its tokens not rounded to whole ones per GPU. A
    step's compute is its tokens' FLOPs (b·…) plus a constant (dequantization), its offload
    seconds constant in the micro-batch (``throughput.step_time``), so tokens over compute and
    offload grow with the micro-batch, and exposed communication only adds seconds."""
    key = (option.settings, option.limit)
    found = option.basis._fastest.get(key)
    if found is None:
        found = option.basis._fastest[key] = _fastest_tokens_per_s(option)
    return found


def _fastest_tokens_per_s(option: Option) -> float:
    settings = option.settings
    most = settings.with_(micro_batch=option.limit or settings.train.micro_batch)
    step, layout, train = option.basis.step(most), most.layout, most.train
    tokens = train.seq_len * train.micro_batch * train.grad_accum * layout.microbatches / layout.model_parallel
    # a billionth more: these floats are summed in another order than ``StepTime.tokens_per_s``'s
    return tokens / (step.compute_s + step.offload_s) * (1 + 1e-9)


def rank_bound(option: Option, priority: str) -> tuple:
    """A key no later than ``rank(option, priority)`` from the bound alone (no replay): the most
    tokens/s at any micro-batch the bound allows (tokens/s is not always monotone in the
    micro-batch), a safe margin, and the total left off (a tuple's prefix sorts before it);
    ``()`` (before all) where it is not bounded: by memory, or where the bound allows none (its
    confirmation then needs no replay either)."""
    key = (option.settings, option.limit, priority)
    found = option.basis._rank_bounds.get(key)
    if found is None:
        found = option.basis._rank_bounds[key] = _rank_bound(option, priority)
    return found


def _rank_bound(option: Option, priority: str) -> tuple:
    batches = option.micro_batches()
    if priority == "memory" or not batches or len(batches) > BOUNDED_MICRO_BATCHES:
        return ()
    settings = option.settings
    speed = -max(option.basis.step(settings.with_(micro_batch=b)).tokens_per_s for b in batches)
    return _speed_key(settings, priority, speed)


def _speed_key(settings: Job, priority: str, speed: float) -> tuple:
    """``rank``'s key by speed or simplicity up to the total, at ``speed`` (negative tokens/s) and
    a safe margin: what ``rank_floor`` and ``rank_bound`` give at their bounds of the speed."""
    simple = simplicity_ranks()[settings.plan.strategy]
    if priority == "simplicity":
        return (settings.plan.offload != "none", simple, _AC_ORDER[settings.train.activation_checkpointing], speed)
    return (_as_fast(speed), False, simple)


_FLOOR, _BOUND, _CONFIRMED = range(3)


class Ranked(Sequence):
    """The options that fit, best first (``rank``; ties in the order given), confirmed only as far
    as they are read. Each option climbs three keys, each no later than the next: ``rank_floor``
    (one step time, no estimate), ``rank_bound`` (its micro-batches by the bound, no replay),
    then its ``rank`` once confirmed (its micro-batch searched, replayed; where it fits). The
    least key of all is taken next: a floor is raised to the bound (an option the model cannot
    estimate is dropped there), a bound confirmed (one that allows no micro-batch, its key
    ``()``, is dropped next: it does not fit), a rank is the next best, as no option left that
    fits can rank before it. An option below the pick is never estimated. Reading the length
    confirms them all."""

    def __init__(self, options: list[Option], priority: str):
        self.priority = priority
        self._out: list[Option] = []
        self._keys = [(rank_floor(o, priority), i, _FLOOR, o) for i, o in enumerate(options)]
        heapq.heapify(self._keys)  # (key, index, stage, option); an index is never in it twice

    def _next(self) -> bool:
        keys, priority = self._keys, self.priority
        while keys:
            _, i, stage, option = heapq.heappop(keys)
            if stage == _CONFIRMED:
                self._out.append(option)
                return True
            if stage == _FLOOR:
                if option.modelled:
                    heapq.heappush(keys, (rank_bound(option, priority), i, _BOUND, option))
            elif option.fits:
                heapq.heappush(keys, (rank(option, priority), i, _CONFIRMED, option))
        return False

    def _upto(self, n: int | None) -> list[Option]:
        """The first ``n`` (None: all)."""
        while (n is None or len(self._out) < n) and self._next():
            pass
        return self._out

    def __getitem__(self, i):
        if isinstance(i, slice):
            ahead = i.step is None and (i.start or 0) >= 0 and i.stop is not None and i.stop >= 0
            return self._upto(i.stop if ahead else None)[i]
        return self._upto(i + 1 if i >= 0 else None)[i]

    def __len__(self) -> int:
        return len(self._upto(None))

    def __bool__(self) -> bool:
        return bool(self._upto(1))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ranked) and self._upto(None) == other._upto(None)

    def __hash__(self) -> int:
        return hash(tuple(self._upto(None)))


def smallest(options: list[Option]) -> Option:
    """The option of the least total (the first listed among equal ones), as ``min`` finds it,
    confirming (replaying) them in the order of their bound's total at their least micro-batch
    (no more than their total: the bound's is, and memory grows with the micro-batch) until
    none left can be smaller."""
    bounds = sorted((o.basis.bound(o.settings).total_bytes, i, o) for i, o in enumerate(options))
    best: tuple[int, int, Option] | None = None
    for low, i, option in bounds:
        if best is not None and best[:2] < (low, i):
            break
        found = (option.total_bytes, i, option)
        best = found if best is None or found[:2] < best[:2] else best
    assert best is not None, "no options"
    return best[2]


def ranked(options: list[Option], priority: str) -> Ranked:
    """The options that fit, best first, confirmed as they are read (``Ranked``)."""
    return Ranked(options, priority)


def _precisions(job: Job) -> tuple[str, ...]:
    """Precisions tried when the user fixed none: the mixed policy first (the safe default);
    fp32 and autocast use more memory and are never faster; pure bf16 (no master copy)
    changes the numerics of what is trained, so it is tried only when asked for, or where only
    adapters are trained (LoRA, QLoRA: the frozen base has no master copy to keep; a plain loop
    runs no mixed policy, so without it a one-GPU adapter search had autocast's fp32 weights)."""
    gpu_name = job.cluster.gpu_name
    has_bf16 = gpu_name == "custom" or catalog.gpu(gpu_name).peak_bf16_flops is not None
    if not has_bf16:
        return ("mixed-fp16", "amp-fp16", "fp32")
    adapters = job.train.finetune in ("lora", "qlora")
    return ("mixed-bf16", "amp-bf16", "fp32", *(("bf16",) if adapters else ()))


@lru_cache(maxsize=4096)
def unmodelled(job: Job) -> str | None:
    """Why ``job`` cannot be estimated (what its model does not cover), None where it can."""
    try:
        bound(job)
    except MemplanError as error:
        return str(error)
    return None


def skipped_jobs(job: Job, fixed: dict, allowed: tuple[str, ...] | None = None) -> list[str]:
    """Why each searched combination of ``_combinations`` the model cannot build or estimate:
    a search skips them and says so; only what the user chose explicitly is refused."""
    whys = (why or unmodelled(j) for j, why in _combinations(job, fixed, allowed))
    return [why for why in whys if why is not None]


def searched_jobs(job: Job, fixed: dict, allowed: tuple[str, ...] | None = None) -> list[Job]:
    """Every strategy × precision × AC × offload allowed by ``fixed`` (axis -> value) and among
    the strategies ``allowed`` (None: all), at micro-batch 1 (the micro-batch is searched
    afterwards), that could be built; whether the model can estimate each is asked when it is
    reached (``unmodelled``: one estimate each)."""
    return [j for j, why in _combinations(job, fixed, allowed) if why is None]


def candidate_jobs(job: Job, fixed: dict, allowed: tuple[str, ...] | None = None) -> list[Job]:
    """``searched_jobs`` but those the model cannot estimate (``skipped_jobs``)."""
    return [j for j in searched_jobs(job, fixed, allowed) if unmodelled(j) is None]


def _combinations(job: Job, fixed: dict, allowed: tuple[str, ...] | None) -> tuple[tuple[Job, str | None], ...]:
    """Each combination searched, with why it cannot be built (None: it can); built once per job
    and choices (a recommendation asks for the candidates and the skipped ones)."""
    return _combinations_of(job, tuple(fixed.items()), allowed)


@lru_cache(maxsize=64)
def _combinations_of(
    job: Job, fixed_items: tuple[tuple[str, Any], ...], allowed: tuple[str, ...] | None
) -> tuple[tuple[Job, str | None], ...]:
    fixed = dict(fixed_items)
    jobs: list[tuple[Job, str | None]] = []
    strategies = [fixed["strategy"]] if "strategy" in fixed else strategies_on(job.cluster.gpus)
    if allowed is not None:
        strategies = [s for s in strategies if s in allowed]
    precisions = [fixed["precision"]] if "precision" in fixed else list(_precisions(job))
    acs = [fixed["ac"]] if "ac" in fixed else list(AC_MODES)
    offloads = [fixed["offload"]] if "offload" in fixed else list(OFFLOADS)
    for s, p, a, o in itertools.product(strategies, precisions, acs, offloads):
        if not STRATEGIES[s].supports_offload(o) or not allows_ep(STRATEGIES[s], job.plan.ep):
            continue
        if not runs_natively(STRATEGIES[s], p) and not {"strategy", "precision"} <= set(fixed):
            continue  # a recommendation must be launchable: searched options only where native
        try:
            train = job.train.with_ac(a, precision=p, micro_batch=1)
            candidate = replace(job, train=train, plan=replace(job.plan, strategy=s, offload=o))
        except MemplanError as error:
            jobs.append((job, str(error)))
            continue
        jobs.append((candidate, None))
    return tuple(jobs)


def search_options(
    job: Job,
    fixed: dict,
    priority: str,
    basis: Basis,
    *,
    micro_batch_max: bool = False,
    allowed: tuple[str, ...] | None = None,
) -> list[Option]:
    """Each of ``searched_jobs`` at its micro-batch: the one fixed, else the largest that fits up
    to the cap (``--micro-batch max``: without it; searched when first read), 1 when ranked by
    memory. The ones the model cannot estimate are among them (``Option.modelled``)."""
    if micro_batch_max:
        limit = search.MICRO_BATCH_LIMIT
    elif "micro_batch" in fixed or priority == "memory":
        limit = 0
    else:
        limit = int(default("micro_batch_cap"))
    mb = fixed.get("micro_batch", 1) if not micro_batch_max else 1
    return [basis.evaluate(c.with_(micro_batch=mb), limit=limit) for c in searched_jobs(job, fixed, allowed)]


def slower_fraction(option: Option, than: Option) -> float:
    """How much fewer tokens/s ``option`` predicts than ``than``: 0.22 is 22 % slower."""
    return 1 - option.step.tokens_per_s / than.step.tokens_per_s


@dataclass(frozen=True, kw_only=True)
class Rejected:
    """An option not picked, and why, as data: ``code`` is does_not_fit, more_memory (ranked by
    memory), less_simple (ranked by simplicity) or slower."""

    option: Option
    code: str
    best: Option | None
    slower_fraction: float | None = None
    """Every code but does_not_fit: 1 - its tokens/s over the best's."""
    extra_bytes: int | None = None
    """more_memory: its total minus the best's."""

    @property
    def over_by_bytes(self) -> int | None:
        """does_not_fit: total minus usable (the option's replay, read here)."""
        return -self.option.headroom_bytes if self.code == "does_not_fit" else None


def reject(option: Option, best: Option | None, priority: str) -> Rejected:
    if not option.fits:
        return Rejected(option=option, code="does_not_fit", best=best)
    assert best is not None  # an option that fits is ranked, so there is a best
    slower = slower_fraction(option, best)
    if priority == "memory":
        return Rejected(
            option=option,
            code="more_memory",
            best=best,
            slower_fraction=slower,
            extra_bytes=option.total_bytes - best.total_bytes,
        )
    code = (
        "less_simple"
        if priority == "simplicity" and rank(option, priority)[:3] != rank(best, priority)[:3]
        else "slower"
    )
    return Rejected(option=option, code=code, best=best, slower_fraction=slower)
