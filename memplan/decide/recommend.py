"""The engine: search the options, pick the best that fits by a priority, judge the matching
rules against the same arithmetic and, when nothing fits, list the single changes. Every
result is data; ``memplan.report`` writes the sentences (decide imports nothing of it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from ..errors import MemplanError
from ..specs import Job
from ..throughput import Link
from ..units import GIB
from .fixes import Fix, fixes
from .options import (
    AXES,
    FRAMEWORKS,
    PRIORITIES,
    Basis,
    Option,
    Rejected,
    allowed_strategies,
    basis_for,
    candidate_jobs,
    framework_strategies,
    rank,
    ranked,
    reject,
    search_options,
    searched_jobs,
    skipped_jobs,
    smallest,
    unmodelled,
)
from .rules import Rule, RuleVerdict, agrees, judge, rules, size_class
from .whatifs import ModeOutcome, finetune_modes


@dataclass(frozen=True, kw_only=True)
class Reason:
    """One reason for the pick, as data. ``code``:

    - assumed_gpu: no GPU named; throughput as on ``basis.link.gpu_name``
    - calibrated: ``basis`` carries a calibration
    - kept_as_given: ``fixed`` axes were not searched
    - restricted: only ``strategies`` were searched (a framework's, or what a launch form writes);
      ``framework`` names the framework where they are all of its strategies
    - nothing_fits: none of ``num_options``; ``option`` is the closest
    - ranked: ``num_fitting`` of ``num_options`` fit, ranked by ``priority``
    - fits: ``option`` (the pick) fits
    - predicted: ``option``'s step time over ``basis.link``
    - runner_up: ``rejected`` is the next best
    - skipped: ``num_options`` combinations searched were not estimated: ``why`` (the first's)
    """

    code: str
    basis: Basis | None = None
    fixed: tuple[tuple[str, object], ...] = ()
    strategies: tuple[str, ...] = ()
    option: Option | None = None
    num_options: int | None = None
    fitting: Sequence[Option] | None = None
    """ranked: the options that fit, best first (``options.Ranked``: counted when read)."""
    priority: str | None = None
    rejected: Rejected | None = None
    why: str | None = None
    framework: str | None = None

    @property
    def num_fitting(self) -> int | None:
        return None if self.fitting is None else len(self.fitting)


@dataclass(frozen=True, kw_only=True)
class Recommendation:
    """What ``recommend_job`` found: the pick (or none), and every why as data. The reasons, the
    rules' verdicts and the fixes are found when first read (a caller that needs only the pick,
    such as ``estimate``'s summary or a layout that beats it, replays none of their options)."""

    job: Job
    """The job asked about."""
    priority: str
    basis: Basis
    best: Option | None
    """None: nothing fits; see ``fixes``."""
    candidates: tuple[Option, ...]
    """Every combination searched, at its micro-batch; the model cannot estimate some
    (``Option.modelled``: asked as each is reached)."""
    fitting: Sequence[Option]
    """The options that fit, best first (``options.Ranked``: confirmed as read)."""
    fixed: tuple[tuple[str, object], ...] = ()
    """The axes given explicitly (options.AXES) and their values; the others were searched."""
    searched: tuple[str, ...] | None = None
    """The strategies the search was restricted to (None: all that run on the GPUs)."""

    @cached_property
    def options(self) -> tuple[Option, ...]:
        """Every option evaluated (the best micro-batch of each combination the model estimates)."""
        return tuple(o for o in self.candidates if o.modelled)

    @property
    def fixed_axes(self) -> tuple[str, ...]:
        return tuple(axis for axis, _ in self.fixed)

    @cached_property
    def matching(self) -> tuple[Rule, ...]:
        """The documented rules that match the job (judged in ``rules``)."""
        job, fixed = self.job, dict(self.fixed)
        size, ddp_fits = size_class(job.model.num_params), _ddp_fits(job, fixed, list(self.candidates), self.basis)
        return tuple(
            r
            for r in rules()
            if r.matches(
                params=size,
                gpu_mem_gib=job.cluster.gpu_mem_bytes / GIB,
                gpus=job.cluster.gpus,
                nodes=job.cluster.num_nodes,
                priority=self.priority,
                ddp_fits=ddp_fits,
            )
        )

    @cached_property
    def rules(self) -> tuple[RuleVerdict, ...]:
        """The verdicts of the documented rules that match the job."""
        judged = (judge(r, *self._judging) for r in self.matching)
        return tuple(v for v in judged if v is not None)

    @cached_property
    def agreement(self) -> tuple[tuple[Rule, bool], ...]:
        """Each verdict of ``rules`` as its rule and whether it agrees, found without the replays
        that confirm a rule's own options where a bound settles it (``rules.agrees``):
        ``estimate``'s summary reads this."""
        if "rules" in self.__dict__:
            return tuple((v.rule, v.agrees) for v in self.rules)
        found = ((r, agrees(r, *self._judging)) for r in self.matching)
        return tuple((r, a) for r, a in found if a is not None)

    @property
    def _judging(self) -> tuple:
        """What ``judge`` and ``agrees`` read besides the rule."""
        return list(self.candidates), self.best, self.job, self.basis, self.priority, dict(self.fixed)

    @cached_property
    def reasons(self) -> tuple[Reason, ...]:
        fixed = dict(self.fixed)
        reasons = _reasons(self.best, self.fitting, list(self.options), self.priority, self.basis, fixed, self.searched)
        skipped = skipped_jobs(self.job, fixed, self.searched)
        if skipped:
            reasons += (Reason(code="skipped", num_options=len(skipped), why=skipped[0]),)
        return reasons

    @cached_property
    def fixes(self) -> tuple[Fix, ...]:
        """Where nothing fits, the single changes that would make it fit."""
        if self.best is not None:
            return ()
        return tuple(fixes(self.job, dict(self.fixed), self.priority, self.basis, self.searched))

    @cached_property
    def rejected(self) -> tuple[Rejected, ...]:
        """Every option but the pick, the fitting ones best first (each confirmed here, when read)."""
        return tuple(
            reject(o, self.best, self.priority)
            for o in sorted(self.options, key=lambda o: (not o.fits, rank(o, self.priority)))
            if self.best is None or o.key != self.best.key
        )

    @property
    def link(self) -> Link:
        return self.basis.link

    @property
    def contradicted(self) -> tuple[RuleVerdict, ...]:
        return tuple(v for v in self.rules if not v.agrees)

    def documented_penalties(self, job: Job) -> tuple[Rule, ...]:
        """The matching penalty rules that speak about ``job``'s strategy and offload."""
        return tuple(
            r
            for r in self.matching
            if r.kind == "penalty" and job.plan.strategy in r.strategies and (r.offload or "none") == job.plan.offload
        )

    @cached_property
    def finetune_modes(self) -> tuple[ModeOutcome, ...]:
        """A LoRA or QLoRA job on one GPU: the pick (else the first option) under each fine-tune
        mode, with its memory and step time (``whatifs.finetune_modes``); empty otherwise."""
        return finetune_modes((self.best or self.options[0]).job)


def _check(job: Job, fixed: dict, priority: str, allowed: tuple[str, ...] | None) -> None:
    """Bad input, one line each: an unknown priority or axis, a fixed strategy outside the
    search, a search with nothing to run."""
    if priority not in PRIORITIES:
        raise MemplanError(f"priority {priority!r} is not one of: {', '.join(PRIORITIES)}")
    unknown = set(fixed) - set(AXES)
    if unknown:
        raise MemplanError(f"cannot fix {', '.join(sorted(unknown))}; fixable: {', '.join(AXES)}")
    if allowed is None:
        return
    if fixed.get("strategy", allowed[0]) not in allowed:
        raise MemplanError(f"strategy {fixed['strategy']} is not among the strategies searched: {', '.join(allowed)}")
    if not any(unmodelled(j) is None for j in searched_jobs(job, fixed, allowed)):
        skipped = skipped_jobs(job, fixed, allowed)
        if skipped:  # nothing else to search: the user's own choices are what cannot be modelled
            raise MemplanError(skipped[0])
        raise MemplanError(
            f"no strategy searched ({', '.join(allowed)}) runs on {job.cluster.gpus} GPUs with the choices given"
        )


def _ddp_fits(job: Job, fixed: dict, options: list[Option], basis: Basis) -> bool:
    """Whether DDP fits at the user's settings: from the options searched, or — DDP not among
    them (another strategy fixed, another framework) — on its own."""
    ddp = [o for o in options if o.settings.plan.strategy == "ddp"]
    if any(o.modelled for o in ddp):
        return any(o.modelled and o.fits for o in ddp)
    return any(basis.fits(j) for j in candidate_jobs(job, {**fixed, "strategy": "ddp", "offload": "none"}))


def recommend_job(
    job: Job,
    *,
    fixed: dict | None = None,
    priority: str = "speed",
    interconnect: str | None = None,
    bw_gbs: float | None = None,
    micro_batch_max: bool = False,
    calibration: str | None = None,
    framework: str | None = None,
    strategies: tuple[str, ...] | None = None,
) -> Recommendation:
    """The best option that fits for ``job`` by ``priority``, with reasons, rejections, rule verdicts
    and, when nothing fits, the single changes that would make it fit.

    ``fixed`` maps axes the user chose explicitly (strategy, precision, ac, offload, micro_batch)
    to their values; the others are searched. ``calibration`` (a corrections file, ``auto`` for
    the ones shipped for the job's device, or None) moves what fits and how fast (``Basis``).
    ``framework`` (single | ddp | fsdp | deepspeed) searches only that framework's strategies,
    ``strategies`` only those (``memplan.emit.WRITES``: the ones a launch form writes).

    Example usage::

        rec = recommend_job(job, fixed={"precision": "mixed-bf16"}, priority="speed")
        rec.best.label(), [(v.rule.id, v.code, v.value) for v in rec.contradicted]
    """
    fixed = dict(fixed or {})
    allowed = allowed_strategies(framework, strategies)
    _check(job, fixed, priority, allowed)
    basis = basis_for(job, interconnect=interconnect, bw_gbs=bw_gbs, calibration=calibration)
    options = search_options(job, fixed, priority, basis, micro_batch_max=micro_batch_max, allowed=allowed)
    if not any(o.modelled for o in options):
        skipped = skipped_jobs(job, fixed, allowed)
        raise MemplanError(f"nothing to search: {skipped[0] if skipped else 'no strategy runs these settings'}")
    fitting = ranked(options, priority)
    return Recommendation(
        job=job,
        priority=priority,
        basis=basis,
        best=fitting[0] if fitting else None,
        candidates=tuple(options),
        fitting=fitting,
        fixed=tuple(fixed.items()),
        searched=allowed,
    )


def _reasons(
    best: Option | None,
    fitting: Sequence[Option],
    options: list[Option],
    priority: str,
    basis: Basis,
    fixed: dict,
    allowed: tuple[str, ...] | None,
) -> tuple[Reason, ...]:
    out = []
    if basis.link.assumed_gpu:
        out.append(Reason(code="assumed_gpu", basis=basis))
    if basis.correction:
        out.append(Reason(code="calibrated", basis=basis))
    if fixed:
        out.append(Reason(code="kept_as_given", fixed=tuple(fixed.items())))
    if allowed is not None:
        named = next((f for f in FRAMEWORKS if framework_strategies(f) == allowed), None)
        out.append(Reason(code="restricted", strategies=allowed, framework=named))
    if best is None:
        closest = smallest(options)
        return (*out, Reason(code="nothing_fits", num_options=len(options), option=closest))
    out += [
        Reason(code="ranked", fitting=fitting, num_options=len(options), priority=priority),
        Reason(code="fits", option=best),
        Reason(code="predicted", option=best, basis=basis),
    ]
    if fitting[1:2]:
        out.append(Reason(code="runner_up", rejected=reject(fitting[1], best, priority)))
    return tuple(out)
