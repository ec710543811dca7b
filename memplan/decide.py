"""The decision engine: every allowed option (strategy × precision × AC × offload ×
micro-batch) estimated exactly, the ones that fit ranked by the throughput model, the
documented rules of tables/rules.csv checked against the same arithmetic, and — when nothing
fits — the single changes that would make it fit.

The rules are data: this module only evaluates rows. Where a rule and the arithmetic
disagree, the arithmetic decides and the verdict says so, with numbers.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from functools import cache

from . import catalog, search
from .breakdown import Estimate
from .calibration import Calibration, Correction, Corrected, apply, resolve
from .errors import MemplanError
from .memory import estimate
from .specs import AC_MODES, OFFLOADS, Job, Plan
from .strategies import STRATEGIES, strategies_on
from .throughput import Link, StepTime, default, link_for, relative_to_ddp, step_time
from .units import GIB

PRIORITIES = ("speed", "memory", "simplicity")
AXES = ("strategy", "precision", "ac", "offload", "micro_batch")
_AC_ORDER = {mode: i for i, mode in enumerate(AC_MODES)}  # none < selective < full: more recompute


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB"


# ---------------------------------------------------------------------------- rules as data

@dataclass(frozen=True, kw_only=True)
class Rule:
    """One row of tables/rules.csv: a condition on the inputs and what a seed document claims."""

    id: str
    kind: str
    """recommend: an option to use; penalty: a strategy's throughput relative to DDP;
    ac-cost: throughput with activation checkpointing relative to without."""
    min_params: float | None
    max_params: float | None
    min_gpu_mem_gib: float | None
    max_gpu_mem_gib: float | None
    min_gpus: int | None
    max_gpus: int | None
    min_nodes: int | None
    max_nodes: int | None
    priorities: tuple[str, ...]
    when_ddp_fits: bool | None
    strategies: tuple[str, ...]
    precision: str | None
    ac: str | None
    offload: str | None
    claimed_rel_min: float | None
    claimed_rel_max: float | None
    source: str
    section: str
    quote: str

    def matches(self, *, params: int, gpu_mem_gib: float, gpus: int, nodes: int, priority: str,
                ddp_fits: bool) -> bool:
        """Inclusive ranges, as the seeds write them ('7-13B' and '13B+' both hold a 13B model);
        ``params`` is the size class (see ``size_class``)."""
        return ((self.min_params is None or params >= self.min_params)
                and (self.max_params is None or params <= self.max_params)
                and (self.min_gpu_mem_gib is None or gpu_mem_gib >= self.min_gpu_mem_gib)
                and (self.max_gpu_mem_gib is None or gpu_mem_gib <= self.max_gpu_mem_gib)
                and (self.min_gpus is None or gpus >= self.min_gpus)
                and (self.max_gpus is None or gpus <= self.max_gpus)
                and (self.min_nodes is None or nodes >= self.min_nodes)
                and (self.max_nodes is None or nodes <= self.max_nodes)
                and (not self.priorities or priority in self.priorities)
                and (self.when_ddp_fits is None or self.when_ddp_fits == ddp_fits))

    def describe(self) -> str:
        what = " or ".join(self.strategies) or "activation checkpointing"
        extras = ([f"AC {self.ac}"] if self.ac else []) + ([f"offload {self.offload}"] if self.offload else [])
        return " + ".join([what, *extras])


def size_class(num_params: int) -> float:
    """A model's size as the seeds name it: to the nearest billion from 1B up (Llama-2 '7B' has
    6.74e9 parameters, '13B' 13.02e9), the exact count below."""
    return round(num_params / 1e9) * 1e9 if num_params >= 1e9 else float(num_params)


def _num(text: str, kind=float):
    return kind(float(text)) if text.strip() else None


def _row_to_rule(row: dict[str, str]) -> Rule:
    strategies = tuple(s for s in row["strategy"].split("|") if s)
    for s in strategies:
        if s not in STRATEGIES:
            raise MemplanError(f"tables/rules.csv row {row['id']}: strategy {s!r} is not one of: {', '.join(STRATEGIES)}")
    return Rule(
        id=row["id"], kind=row["kind"], min_params=_num(row["min_params"]), max_params=_num(row["max_params"]),
        min_gpu_mem_gib=_num(row["min_gpu_mem_gib"]), max_gpu_mem_gib=_num(row["max_gpu_mem_gib"]),
        min_gpus=_num(row["min_gpus"], int), max_gpus=_num(row["max_gpus"], int),
        min_nodes=_num(row["min_nodes"], int), max_nodes=_num(row["max_nodes"], int),
        priorities=tuple(p for p in row["priority"].split("|") if p),
        when_ddp_fits={"yes": True, "no": False}.get(row["when_ddp_fits"]),
        strategies=strategies, precision=row["precision"] or None, ac=row["ac"] or None,
        offload=row["offload"] or None, claimed_rel_min=_num(row["claimed_rel_min"]),
        claimed_rel_max=_num(row["claimed_rel_max"]), source=row["source"], section=row["section"],
        quote=row["quote"],
    )


@cache
def rules() -> tuple[Rule, ...]:
    return tuple(_row_to_rule(row) for row in catalog.read_table("rules.csv"))


@cache
def simplicity_ranks() -> dict[str, int]:
    return {row["id"]: int(row["rank"]) for row in catalog.read_table("simplicity.csv")}


# ---------------------------------------------------------------------------- options

@dataclass(frozen=True, kw_only=True)
class Option:
    """One configuration, estimated and timed."""

    estimate: Estimate
    corrected: Corrected | None = None
    """The estimate with the calibration applied, where one applies: its total decides."""
    step: StepTime
    relative_throughput: float
    """Tokens/s over DDP's at the same settings (DDP fitting or not)."""

    @property
    def job(self) -> Job:
        return self.estimate.job

    @property
    def final(self) -> Estimate | Corrected:
        """What decides: the corrected estimate where a calibration applies."""
        return self.corrected or self.estimate

    @property
    def total_bytes(self) -> int:
        return self.final.total_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.final.headroom_bytes

    @property
    def fits(self) -> bool:
        return self.final.fits

    @property
    def key(self) -> tuple:
        j = self.job
        return (j.plan.strategy, j.train.precision, j.train.activation_checkpointing, j.plan.offload,
                j.train.micro_batch)

    def label(self) -> str:
        j = self.job
        return (f"{j.plan.strategy}, {j.train.precision}, AC {j.train.activation_checkpointing}, "
                f"offload {j.plan.offload}, micro-batch {j.train.micro_batch}")


@dataclass(frozen=True, kw_only=True)
class Basis:
    """What every option is judged on: the links and, where a calibration applies, its correction
    (the corrected total decides what fits; the measured MFU — or, on the very device it was
    measured on, FLOP/s — and exposed communication replace the throughput defaults)."""

    link: Link
    calibration: Calibration | None = None
    correction: Correction | None = None
    device_matches: bool = False

    @property
    def measured_compute(self) -> bool:
        """Compute time from FLOP/s measured on this very device (no datasheet peak involved)."""
        return bool(self.correction and self.device_matches
                    and any(t.mfu is None for t in self.correction.throughput))

    def step(self, job: Job) -> StepTime:
        fit = self.correction.speed(job.plan.strategy) if self.correction else None
        if fit is None:
            return step_time(job, self.link)
        measured = fit.achieved_flops if fit.mfu is None and self.device_matches else None
        return step_time(job, self.link, mfu=fit.mfu, achieved_flops=measured,
                         exposed_fraction=fit.exposed_comm_fraction)

    def corrected(self, est: Estimate) -> Corrected | None:
        return apply(est, self.correction, device_matches=self.device_matches) if self.correction else None

    def final(self, job: Job) -> Estimate | Corrected:
        est = estimate(job)
        return self.corrected(est) or est

    def headrooms(self, job: Job) -> tuple[int, ...]:
        """Per moment, as ``Estimate.moment_headrooms``: their least is the headroom."""
        return self.final(job).moment_headrooms

    def fits(self, job: Job) -> bool:
        return self.final(job).fits

    def describe(self) -> str:
        c = self.correction
        measured = ", ".join(t.strategy for t in c.throughput) or "none"
        where = "" if self.device_matches else " (fitted on another device: treat with care)"
        return (f"calibrated by {self.calibration.path}: {c.device}, torch {c.torch_version}, memory band "
                f"±{c.residual_pct:.2f} %; speed measured for: {measured}{where}")

    def evaluate(self, job: Job) -> Option:
        est = estimate(job)
        return Option(estimate=est, corrected=self.corrected(est), step=self.step(job),
                      relative_throughput=relative_to_ddp(job, self.step))


def _rank(option: Option, priority: str) -> tuple:
    speed = -option.step.tokens_per_s
    simple = simplicity_ranks()[option.job.plan.strategy]
    mem = option.total_bytes
    if priority == "memory":
        return (mem, speed, simple)
    if priority == "simplicity":
        return (option.job.plan.offload != "none", simple, _AC_ORDER[option.job.train.activation_checkpointing],
                speed, mem)
    # within 3 significant figures: as fast; then an option with a safe margin, then the simpler
    usable = option.job.cluster.usable_bytes
    tight = option.headroom_bytes < default("safe_headroom_fraction") * usable
    return (-float(f"{-speed:.3g}"), tight, simple, mem)


def _precisions(job: Job) -> tuple[str, ...]:
    """Precisions tried when the user fixed none: the mixed policy first (the safe default);
    fp32 and autocast use more memory and are never faster; pure bf16 (no master copy)
    changes the numerics, so it is tried only when asked for."""
    gpu_name = job.cluster.gpu_name
    has_bf16 = gpu_name == "custom" or catalog.gpu(gpu_name).peak_bf16_flops is not None
    return ("mixed-bf16", "amp-bf16", "fp32") if has_bf16 else ("mixed-fp16", "amp-fp16", "fp32")


def candidate_jobs(job: Job, fixed: dict) -> list[Job]:
    """Every strategy × precision × AC × offload allowed by ``fixed`` (axis -> value), at
    micro-batch 1 (the micro-batch is searched afterwards)."""
    strategies = [fixed["strategy"]] if "strategy" in fixed else strategies_on(job.cluster.gpus)
    precisions = [fixed["precision"]] if "precision" in fixed else list(_precisions(job))
    acs = [fixed["ac"]] if "ac" in fixed else list(AC_MODES)
    offloads = [fixed["offload"]] if "offload" in fixed else list(OFFLOADS)
    jobs = []
    for s, p, a, o in itertools.product(strategies, precisions, acs, offloads):
        if not STRATEGIES[s].supports_offload(o):
            continue
        if not STRATEGIES[s].runs_natively(p) and not {"strategy", "precision"} <= set(fixed):
            continue  # a recommendation must be launchable: searched options only where native
        train = replace(job.train, precision=p, activation_checkpointing=a, micro_batch=1)
        jobs.append(replace(job, train=train, plan=Plan(strategy=s, offload=o)))
    return jobs


def basis_for(job: Job, *, interconnect: str | None = None, bw_gbs: float | None = None,
              calibration: str | None = None) -> Basis:
    found = resolve(job, calibration)
    link = link_for(job, interconnect=interconnect, bw_gbs=bw_gbs)
    if found is None:
        return Basis(link=link)
    loaded, correction, same = found
    return Basis(link=link, calibration=loaded, correction=correction, device_matches=same)


# ---------------------------------------------------------------------------- results

@dataclass(frozen=True, kw_only=True)
class Rejected:
    option: Option
    reason: str


@dataclass(frozen=True, kw_only=True)
class RuleVerdict:
    rule: Rule
    agrees: bool
    detail: str
    """With numbers: what the arithmetic says about the rule's claim."""

    def line(self) -> str:
        head = "agrees" if self.agrees else "contradicted by the arithmetic"
        return f"[{self.rule.id}] {self.rule.source} ({self.rule.section}): \"{self.rule.quote}\" -> {head}: {self.detail}"


@dataclass(frozen=True, kw_only=True)
class Fix:
    """One change that makes the job fit (or gets closest), with the memory it results in."""

    change: str
    option: Option | None
    fits: bool

    def line(self) -> str:
        if self.option is None:
            return self.change
        o = self.option
        verdict = "fits" if self.fits else f"still over by {_gib(-o.headroom_bytes)}"
        return (f"{self.change}: {o.label()} -> {_gib(o.total_bytes)} of "
                f"{_gib(o.job.cluster.usable_bytes)} usable, {verdict}")


@dataclass(frozen=True, kw_only=True)
class Recommendation:
    priority: str
    basis: Basis
    best: Option | None
    """None: nothing fits; see ``fixes``."""
    reasons: tuple[str, ...]
    rejected: tuple[Rejected, ...]
    rules: tuple[RuleVerdict, ...]
    fixes: tuple[Fix, ...]
    options: tuple[Option, ...]
    """Every option evaluated (the best micro-batch of each combination)."""

    @property
    def link(self) -> Link:
        return self.basis.link

    @property
    def contradicted(self) -> tuple[RuleVerdict, ...]:
        return tuple(v for v in self.rules if not v.agrees)


# ---------------------------------------------------------------------------- the engine

def _options(job: Job, fixed: dict, priority: str, basis: Basis, micro_batch_max: bool) -> list[Option]:
    cap = int(default("micro_batch_cap"))
    options = []
    for candidate in candidate_jobs(job, fixed):
        if "micro_batch" in fixed and not micro_batch_max:
            mb = fixed["micro_batch"]
        else:
            limit = search.MICRO_BATCH_LIMIT if micro_batch_max else cap
            found = search.max_micro_batch(candidate, limit=limit, headrooms=basis.headrooms)
            mb = 1 if found == 0 or (priority == "memory" and not micro_batch_max) else found
        options.append(basis.evaluate(candidate.with_(micro_batch=mb)))
    return options


def _reject_reason(option: Option, best: Option | None, priority: str) -> str:
    if not option.fits:
        return (f"does not fit by {_gib(-option.headroom_bytes)} (total {_gib(option.total_bytes)} > "
                f"{_gib(option.job.cluster.usable_bytes)} usable)")
    slower = 1 - option.step.tokens_per_s / best.step.tokens_per_s
    speed = (f"{slower:.0%} slower" if slower >= 0.01 else f"{slower:.1%} slower" if slower > 0.0005
             else "as fast")
    if priority == "memory":
        return f"uses {_gib(option.total_bytes - best.total_bytes)} more; {speed}"
    if priority == "simplicity" and _rank(option, priority)[:3] != _rank(best, priority)[:3]:
        return f"less simple ({option.job.plan.strategy}, offload {option.job.plan.offload}, " \
               f"AC {option.job.train.activation_checkpointing}); {speed}"
    return f"{speed} ({option.step.tokens_per_s:,.0f} vs {best.step.tokens_per_s:,.0f} tokens/s per GPU)"


def _rule_options(rule: Rule, options: list[Option]) -> list[Option]:
    return [o for o in options
            if o.job.plan.strategy in rule.strategies
            and (rule.ac is None or o.job.train.activation_checkpointing == rule.ac)
            and (rule.offload is None or o.job.plan.offload == rule.offload)
            and (rule.precision is None or o.job.train.precision == rule.precision)]


def _claim_verdict(rule: Rule, measured: float, what: str) -> tuple[bool, str]:
    close = default("close_fraction")
    lo, hi = rule.claimed_rel_min, rule.claimed_rel_max
    claim = f"{lo:.2f}" if lo == hi else f"{lo:.2f}–{hi:.2f}"
    ok = lo - close <= measured <= hi + close
    return ok, f"{what} {measured:.2f}× by the model, {claim}× claimed"


def _own_terms(claims: dict, strategy: str, fixed: dict) -> dict:
    """The user's fixed axes with a rule's own claims and ``strategy``; a fixed precision the
    strategy does not run natively is searched instead (DDP has no mixed-bf16 of its own)."""
    terms = {**fixed, **{k: v for k, v in claims.items() if v is not None}, "strategy": strategy}
    if "precision" in terms and not STRATEGIES[strategy].runs_natively(terms["precision"]):
        del terms["precision"]
    return terms


def _judge(rule: Rule, options: list[Option], best: Option | None, job: Job, basis: Basis,
           priority: str, fixed: dict) -> RuleVerdict:
    close = default("close_fraction")
    if rule.kind == "ac-cost":
        ref = best.job if best else job
        with_ac = basis.step(ref.with_(activation_checkpointing=rule.ac))
        without = basis.step(ref.with_(activation_checkpointing="none"))
        ok, text = _claim_verdict(rule, with_ac.tokens_per_s / without.tokens_per_s,
                                  f"AC {rule.ac} throughput relative to none ({ref.plan.strategy}):")
        return RuleVerdict(rule=rule, agrees=ok, detail=f"{text} (full recompute adds one forward: 2·N + 4·L·h·s "
                           f"FLOPs per token on top of 6·N + 12·L·h·s)")
    if rule.kind == "penalty":
        ref = (best.job if best else job).with_(offload="none").with_(
            strategy=rule.strategies[0]).with_(offload=rule.offload or "none")
        st = basis.step(ref)
        ok, text = _claim_verdict(rule, relative_to_ddp(ref, basis.step), f"{rule.strategies[0]} relative to DDP:")
        return RuleVerdict(rule=rule, agrees=ok, detail=(
            f"{text} (communication {st.comm_s:.3f} s, exposed {st.exposed_comm_s:.3f} s, offload {st.offload_s:.3f} s "
            f"vs compute {st.compute_s:.3f} s per step over {basis.link.interconnect})"))
    candidates = _rule_options(rule, options)
    claims = {"ac": rule.ac, "offload": rule.offload, "precision": rule.precision}
    overridden = any(v is not None and k in fixed and fixed[k] != v for k, v in claims.items())
    if overridden or not candidates:
        # the user's fixed choices exclude the rule's option: judge it on its own terms
        candidates = [o for strategy in rule.strategies
                      for o in _options(job, _own_terms(claims, strategy, fixed), priority, basis, micro_batch_max=False)
                      if STRATEGIES[strategy].supports_offload(o.job.plan.offload)]
    fitting = sorted((o for o in candidates if o.fits), key=lambda o: _rank(o, priority))
    if not fitting:
        smallest = min(candidates, key=lambda o: o.total_bytes)
        return RuleVerdict(rule=rule, agrees=False, detail=(
            f"{rule.describe()} does not fit: its smallest option ({smallest.label()}) needs "
            f"{_gib(smallest.total_bytes)} > {_gib(job.cluster.usable_bytes)} usable"))
    mine = fitting[0]
    rel = f"; {mine.relative_throughput:.2f}× DDP by the model" + (
        f", {rule.claimed_rel_min:.2f}× claimed" if rule.claimed_rel_min is not None else "")
    if best is None or mine.key == best.key:
        return RuleVerdict(rule=rule, agrees=True, detail=f"{mine.label()} is the best option{rel}")
    if priority == "memory":
        extra = mine.total_bytes / best.total_bytes - 1
        ok = extra <= close
        return RuleVerdict(rule=rule, agrees=ok, detail=(
            f"{mine.label()} fits but needs {extra:.0%} more memory ({_gib(mine.total_bytes)} vs "
            f"{_gib(best.total_bytes)} for {best.job.plan.strategy}){rel}"))
    slower = 1 - mine.step.tokens_per_s / best.step.tokens_per_s
    ok = slower <= close
    return RuleVerdict(rule=rule, agrees=ok, detail=(
        f"{mine.label()} fits ({_gib(mine.headroom_bytes)} headroom) and is "
        f"{f'{slower:.0%}' if slower >= 0.01 else f'{slower:.1%}'} slower than "
        f"{best.job.plan.strategy} ({mine.step.tokens_per_s:,.0f} vs {best.step.tokens_per_s:,.0f} tokens/s per GPU){rel}"))


def _fixes(job: Job, fixed: dict, priority: str, basis: Basis) -> list[Fix]:
    """Single changes, each alone: more GPUs, AC, offload, micro-batch 1, lower precision."""
    def smallest(changed_fixed: dict, change: str, base: Job = job) -> Fix:
        opts = [basis.evaluate(j.with_(micro_batch=changed_fixed.get("micro_batch", job.train.micro_batch)))
                for j in candidate_jobs(base, changed_fixed)]
        if not opts:
            return Fix(change=f"{change}: not available with strategy {fixed.get('strategy')}", option=None, fits=False)
        fitting = sorted((o for o in opts if o.fits), key=lambda o: _rank(o, priority))
        pick = fitting[0] if fitting else min(opts, key=lambda o: o.total_bytes)
        return Fix(change=change, option=pick, fits=pick.fits)

    base_fixed = {**{"ac": job.train.activation_checkpointing, "offload": job.plan.offload,
                     "micro_batch": job.train.micro_batch}, **fixed}
    if "strategy" not in fixed or STRATEGIES[fixed["strategy"]].runs_natively(job.train.precision):
        base_fixed.setdefault("precision", job.train.precision)  # else searched among the native ones
    fixes = []
    strategies = [fixed["strategy"]] if "strategy" in fixed else list(STRATEGIES)
    try:
        found = search.min_gpus(job.with_(activation_checkpointing=base_fixed["ac"]).with_(
            precision=base_fixed.get("precision", job.train.precision)).with_(micro_batch=base_fixed["micro_batch"]), strategies,
            gpus_per_node=job.cluster.gpus_per_node if job.cluster.gpus > job.cluster.gpus_per_node else 0,
            fits=basis.fits)
        option = basis.evaluate(found.estimate.job)
        fixes.append(Fix(change=f"more GPUs: {found.gpus} (instead of {job.cluster.gpus})", option=option, fits=True))
    except MemplanError as exc:
        fixes.append(Fix(change=f"more GPUs: {exc}", option=None, fits=False))  # exc names the limit
    if "strategy" in fixed:
        fixes.append(smallest({k: v for k, v in base_fixed.items() if k != "strategy"}, "another strategy"))
    if base_fixed["ac"] != "full":
        fixes.append(smallest({**base_fixed, "ac": "full"}, "activation checkpointing full"))
    for offload in ("optimizer", "all"):
        if base_fixed["offload"] != offload:
            fixes.append(smallest({**base_fixed, "offload": offload} | ({"strategy": fixed["strategy"]}
                                  if "strategy" in fixed else {}), f"offload {offload}"))
    if base_fixed["micro_batch"] > 1:
        fixes.append(smallest({**base_fixed, "micro_batch": 1}, "micro-batch 1"))
    if base_fixed.get("precision") != "bf16":
        fixes.append(smallest({**base_fixed, "precision": "bf16"}, "lower precision: pure bf16 (no fp32 master copy)"))
    return sorted(fixes, key=lambda f: not f.fits)


def recommend_job(job: Job, *, fixed: dict | None = None, priority: str = "speed", interconnect: str | None = None,
                  bw_gbs: float | None = None, micro_batch_max: bool = False,
                  calibration: str | None = None) -> Recommendation:
    """The best option that fits for ``job`` by ``priority``, with reasons, rejections, rule verdicts
    and, when nothing fits, the single changes that would make it fit.

    ``fixed`` maps axes the user chose explicitly (strategy, precision, ac, offload, micro_batch)
    to their values; the others are searched. ``calibration`` (a corrections file, ``auto`` for
    the ones shipped for the job's device, or None) moves what fits and how fast (``Basis``).

    Example usage::

        rec = recommend_job(job, fixed={"precision": "mixed-bf16"}, priority="speed")
        rec.best.label(), [v.line() for v in rec.contradicted]
    """
    if priority not in PRIORITIES:
        raise MemplanError(f"priority {priority!r} is not one of: {', '.join(PRIORITIES)}")
    fixed = dict(fixed or {})
    unknown = set(fixed) - set(AXES)
    if unknown:
        raise MemplanError(f"cannot fix {', '.join(sorted(unknown))}; fixable: {', '.join(AXES)}")
    basis = basis_for(job, interconnect=interconnect, bw_gbs=bw_gbs, calibration=calibration)
    options = _options(job, fixed, priority, basis, micro_batch_max)
    fitting = sorted((o for o in options if o.fits), key=lambda o: _rank(o, priority))
    best = fitting[0] if fitting else None
    rejected = tuple(Rejected(option=o, reason=_reject_reason(o, best, priority))
                     for o in sorted(options, key=lambda o: (not o.fits, _rank(o, priority)))
                     if best is None or o.key != best.key)
    ddp_fits = any(o.fits for o in options if o.job.plan.strategy == "ddp")
    if "strategy" in fixed and fixed["strategy"] != "ddp":
        ddp_fits = any(basis.fits(j) for j in candidate_jobs(job, {**fixed, "strategy": "ddp",
                                                                            "offload": "none"}))
    inputs = dict(params=size_class(job.model.num_params), gpu_mem_gib=job.cluster.gpu_mem_bytes / GIB, gpus=job.cluster.gpus,
                  nodes=job.cluster.num_nodes, priority=priority, ddp_fits=ddp_fits)
    verdicts = tuple(_judge(r, options, best, job, basis, priority, fixed) for r in rules() if r.matches(**inputs))
    reasons = _reasons(best, fitting, options, priority, basis, fixed)
    fixes = tuple(_fixes(job, fixed, priority, basis)) if best is None else ()
    return Recommendation(priority=priority, basis=basis, best=best, reasons=reasons, rejected=rejected,
                          rules=verdicts, fixes=fixes, options=tuple(options))


def _reasons(best: Option | None, fitting: list[Option], options: list[Option], priority: str, basis: Basis,
             fixed: dict) -> tuple[str, ...]:
    out = []
    if basis.link.assumed_gpu:
        what = "links (compute: measured speed)" if basis.measured_compute else "peak FLOPS and links"
        out.append(f"throughput assumes {basis.link.gpu_name} (no --gpu given): its {what}")
    if basis.correction:
        out.append(basis.describe())
    if fixed:
        out.append("kept as given: " + ", ".join(f"{k.replace('_', '-')} {v}" for k, v in fixed.items()))
    if best is None:
        out.append(f"none of the {len(options)} options fits; the closest: {min(options, key=lambda o: o.total_bytes).label()}")
        return tuple(out)
    st = best.step
    out.append(f"{len(fitting)} of {len(options)} options fit; ranked by {priority}")
    out.append(f"fits: {_gib(best.total_bytes)} of {_gib(best.job.cluster.usable_bytes)} usable "
               f"({_gib(best.headroom_bytes)} headroom), peak in {best.final.phase}")
    out.append(f"predicted {st.tokens_per_s:,.0f} tokens/s per GPU ({best.relative_throughput:.2f}× DDP at the same "
               f"settings): compute {st.compute_s:.3f} s, communication {st.comm_s:.3f} s of which "
               f"{st.exposed_comm_s:.3f} s exposed over {basis.link.interconnect}, offload {st.offload_s:.3f} s per step")
    if len(fitting) > 1:
        runner = fitting[1]
        out.append(f"runner-up: {runner.label()} ({_reject_reason(runner, best, priority)})")
    return tuple(out)
