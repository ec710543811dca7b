"""The documented rules of tables/rules.csv as data, which of them match a job, and each one's
verdict: what the same arithmetic says about its claim, in numbers. Where a rule and the
arithmetic disagree, the arithmetic decides and the verdict says so."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache, cached_property

from .. import catalog
from ..errors import MemplanError
from ..frameworks import runs_natively
from ..layout import Layout
from ..memory import estimate
from ..specs import Job
from ..strategies import STRATEGIES
from ..throughput import StepTime, bubble_fraction, default, model_parallel_seconds, relative_to_ddp
from .layouts import MICROBATCHES_PER_STAGE, LayoutGroup, LayoutOption, layout_group, tp_within_node
from .options import Basis, Option, fastest_tokens_per_s, ranked, search_options, slower_fraction, smallest


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One row of tables/rules.csv: a condition on the inputs and what a seed document claims."""

    id: str
    kind: str
    """recommend: an option to use; penalty: a strategy's throughput relative to DDP;
    ac-cost: throughput with activation checkpointing relative to without; recommend-layout:
    tensor parallel within the node as the option (under the rule's dp strategy); tp-cost: TP's
    communication claimed high; pp-bubble: a pipeline's idle time claimed."""
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

    def matches(
        self, *, params: float, gpu_mem_gib: float, gpus: int, nodes: int, priority: str, ddp_fits: bool
    ) -> bool:
        """Inclusive ranges, as the seeds write them ('7-13B' and '13B+' both hold a 13B model);
        ``params`` is the size class (see ``size_class``)."""
        return (
            (self.min_params is None or params >= self.min_params)
            and (self.max_params is None or params <= self.max_params)
            and (self.min_gpu_mem_gib is None or gpu_mem_gib >= self.min_gpu_mem_gib)
            and (self.max_gpu_mem_gib is None or gpu_mem_gib <= self.max_gpu_mem_gib)
            and (self.min_gpus is None or gpus >= self.min_gpus)
            and (self.max_gpus is None or gpus <= self.max_gpus)
            and (self.min_nodes is None or nodes >= self.min_nodes)
            and (self.max_nodes is None or nodes <= self.max_nodes)
            and (not self.priorities or priority in self.priorities)
            and (self.when_ddp_fits is None or self.when_ddp_fits == ddp_fits)
        )

    @property
    def claims(self) -> dict[str, str | None]:
        """The option terms the rule names besides its strategies (None: any)."""
        return {"ac": self.ac, "offload": self.offload, "precision": self.precision}


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
            raise MemplanError(
                f"tables/rules.csv row {row['id']}: strategy {s!r} is not one of: {', '.join(STRATEGIES)}"
            )
    return Rule(
        id=row["id"],
        kind=row["kind"],
        min_params=_num(row["min_params"]),
        max_params=_num(row["max_params"]),
        min_gpu_mem_gib=_num(row["min_gpu_mem_gib"]),
        max_gpu_mem_gib=_num(row["max_gpu_mem_gib"]),
        min_gpus=_num(row["min_gpus"], int),
        max_gpus=_num(row["max_gpus"], int),
        min_nodes=_num(row["min_nodes"], int),
        max_nodes=_num(row["max_nodes"], int),
        priorities=tuple(p for p in row["priority"].split("|") if p),
        when_ddp_fits={"yes": True, "no": False}.get(row["when_ddp_fits"]),
        strategies=strategies,
        precision=row["precision"] or None,
        ac=row["ac"] or None,
        offload=row["offload"] or None,
        claimed_rel_min=_num(row["claimed_rel_min"]),
        claimed_rel_max=_num(row["claimed_rel_max"]),
        source=row["source"],
        section=row["section"],
        quote=row["quote"],
    )


@cache
def rules() -> tuple[Rule, ...]:
    return tuple(_row_to_rule(row) for row in catalog.read_table("rules.csv"))


@dataclass(frozen=True, kw_only=True)
class RuleVerdict:
    """What the arithmetic says about one rule, as data (``memplan.report`` writes it out).

    ``code``: within_claim / outside_claim (penalty, ac-cost: ``value`` is the modelled
    throughput ratio against the claimed range widened by ``tolerance``); for a recommend rule,
    best (its option is the pick), does_not_fit (``value``: the smallest total of its options,
    bytes), more_memory (ranked by memory: extra fraction of the pick's total) or slower
    (fraction of the pick's tokens/s); ``agrees`` when that is within ``tolerance``. A
    recommend-layout rule's codes are a recommend rule's, its option the ``layout``. tp-cost,
    pp-bubble: overhead_high / overhead_low, ``value`` the fraction (``metric``), ``agrees``
    when it exceeds ``tolerance`` (an overhead within what memplan calls close is not high)."""

    rule: Rule
    agrees: bool
    code: str
    metric: str
    """relative_to_ddp | ac_relative_throughput | total_bytes | extra_memory_fraction | slower_fraction
    | tp_exposed_fraction (TP's exposed seconds over compute) | bubble_fraction"""
    measured: float | None = None
    """``value`` where the judging found it; None: does_not_fit, whose least total is found
    (replayed) only when read (``estimate``'s summary counts verdicts and reads none)."""
    unit: str
    """x (a ratio), bytes or fraction"""
    tolerance: float | None = None
    chosen: Option | None = None
    """recommend: the rule's own best option that fits (``option``)."""
    none_fit: tuple[Option, ...] = ()
    """does_not_fit: the rule's options, none of which fits (``option``: their smallest)."""
    versus: Option | None = None
    """more_memory, slower: the pick it is compared with."""
    strategy: str | None = None
    """penalty: the strategy relative to DDP; ac-cost: the one the AC cost is modelled on."""
    step: StepTime | None = None
    """penalty: the step times behind the ratio, over ``interconnect``."""
    interconnect: str | None = None
    layout: LayoutOption | None = None
    """recommend-layout, tp-cost, pp-bubble: the layout the verdict is about, estimated and timed."""

    @cached_property
    def option(self) -> Option | None:
        """recommend: the rule's own best option that fits (its smallest, when none does)."""
        return smallest(list(self.none_fit)) if self.none_fit else self.chosen

    @cached_property
    def value(self) -> float:
        if self.measured is not None:
            return self.measured
        if self.layout is not None:  # recommend-layout, does_not_fit: the least-memory setting's total
            return self.layout.estimate.total_bytes
        assert self.option is not None, "a does_not_fit verdict has its options"
        return self.option.total_bytes

    @property
    def claimed_low(self) -> float | None:
        return self.rule.claimed_rel_min

    @property
    def claimed_high(self) -> float | None:
        return self.rule.claimed_rel_max


def _claim_verdict(rule: Rule, measured: float, **fields) -> RuleVerdict:
    close = default("close_fraction")
    low, high = rule.claimed_rel_min, rule.claimed_rel_max
    assert low is not None and high is not None  # judged as a claim only where rules.csv gives one
    ok = low - close <= measured <= high + close
    return RuleVerdict(
        rule=rule,
        agrees=ok,
        code="within_claim" if ok else "outside_claim",
        measured=measured,
        unit="x",
        tolerance=close,
        **fields,
    )


def _own_terms(claims: dict, strategy: str, fixed: dict) -> dict:
    """The user's fixed axes with a rule's own claims and ``strategy``; a fixed precision the
    strategy does not run natively is searched instead (DDP has no mixed-bf16 of its own)."""
    terms = {**fixed, **{k: v for k, v in claims.items() if v is not None}, "strategy": strategy}
    if "precision" in terms and not runs_natively(STRATEGIES[strategy], terms["precision"]):
        del terms["precision"]
    return terms


def _axis_value(option: Option, axis: str) -> str:
    j = option.settings
    return {"ac": j.train.activation_checkpointing, "offload": j.plan.offload, "precision": j.train.precision}[axis]


def _rule_options(
    rule: Rule, options: list[Option], job: Job, basis: Basis, priority: str, fixed: dict
) -> list[Option]:
    """The searched options the rule speaks about; where the user's fixed choices (or the
    framework searched) exclude them, the rule's options on its own terms. The ones the model
    cannot estimate are among them (``Option.modelled``; ``ranked`` drops them)."""
    mine = [
        o
        for o in options
        if o.settings.plan.strategy in rule.strategies
        and all(v is None or v == _axis_value(o, k) for k, v in rule.claims.items())
    ]
    overridden = any(v is not None and k in fixed and fixed[k] != v for k, v in rule.claims.items())
    if any(o.modelled for o in mine) and not overridden:
        return mine
    return [
        o
        for strategy in rule.strategies
        for o in search_options(job, _own_terms(rule.claims, strategy, fixed), priority, basis)
        if STRATEGIES[strategy].supports_offload(o.settings.plan.offload)
    ]


def _judge_recommend(
    rule: Rule, options: list[Option], best: Option | None, job: Job, basis: Basis, priority: str, fixed: dict
) -> RuleVerdict | None:
    close = default("close_fraction")
    candidates = _rule_options(rule, options, job, basis, priority, fixed)
    if not any(o.modelled for o in candidates):
        return None  # no option of the rule's under the user's choices (e.g. DDP with --offload all)
    fitting = ranked(candidates, priority)
    if not fitting:
        return RuleVerdict(
            rule=rule,
            agrees=False,
            code="does_not_fit",
            metric="total_bytes",
            unit="bytes",
            none_fit=tuple(o for o in candidates if o.modelled),
        )
    mine = fitting[0]
    if best is None or mine.key == best.key:
        return RuleVerdict(
            rule=rule,
            agrees=True,
            code="best",
            metric="relative_to_ddp",
            measured=mine.relative_throughput,
            unit="x",
            chosen=mine,
        )
    if priority == "memory":
        code, metric, value = "more_memory", "extra_memory_fraction", mine.total_bytes / best.total_bytes - 1
    else:
        code, metric, value = "slower", "slower_fraction", slower_fraction(mine, best)
    return RuleVerdict(
        rule=rule,
        agrees=value <= close,
        code=code,
        metric=metric,
        measured=value,
        unit="fraction",
        tolerance=close,
        chosen=mine,
        versus=best,
    )


def judge(
    rule: Rule, options: list[Option], best: Option | None, job: Job, basis: Basis, priority: str, fixed: dict
) -> RuleVerdict | None:
    """The verdict on ``rule`` given the searched ``options`` and the pick ``best`` (None: nothing
    fits); None where the rule has no option the user's fixed choices allow."""
    ref = best.job if best else job
    if rule.kind == "ac-cost":
        with_ac = basis.step(ref.with_(activation_checkpointing=rule.ac))
        without = basis.step(ref.with_(activation_checkpointing="none"))
        return _claim_verdict(
            rule,
            with_ac.tokens_per_s / without.tokens_per_s,
            metric="ac_relative_throughput",
            strategy=ref.plan.strategy,
        )
    if rule.kind == "penalty":
        ref = ref.with_(offload="none").with_(strategy=rule.strategies[0]).with_(offload=rule.offload or "none")
        return _claim_verdict(
            rule,
            relative_to_ddp(ref, basis.step),
            metric="relative_to_ddp",
            strategy=rule.strategies[0],
            step=basis.step(ref),
            interconnect=basis.link.interconnect,
        )
    if rule.kind in ("recommend-layout", "tp-cost", "pp-bubble"):
        if job.plan.ep > 1:
            return None  # expert parallel folds into the mesh its own way; TP beside it is not searched
        try:
            if rule.kind == "recommend-layout":
                return _judge_layout(rule, best, job, basis)
            return _judge_overhead(rule, ref, basis)
        except MemplanError:
            return None  # a layout this job cannot take (the mesh, the heads) is not judged
    return _judge_recommend(rule, options, best, job, basis, priority, fixed)


def agrees(
    rule: Rule, options: list[Option], best: Option | None, job: Job, basis: Basis, priority: str, fixed: dict
) -> bool | None:
    """``judge``'s verdict on ``rule`` as agrees or not (None: no verdict), without confirming
    (replaying) the rule's own options where a bound settles it (``_slower_by_bound``)."""
    if best is not None and _slower_by_bound(rule, options, best, job, basis, priority, fixed):
        return False
    verdict = judge(rule, options, best, job, basis, priority, fixed)
    return None if verdict is None else verdict.agrees


def _slower_by_bound(
    rule: Rule, options: list[Option], best: Option, job: Job, basis: Basis, priority: str, fixed: dict
) -> bool:
    """Whether every option of a recommend or recommend-layout rule, at the most tokens/s it could
    reach, is slower than the pick by more than ``close_fraction``: the rule is then contradicted
    whichever of them fits, and where none does (``_judge_recommend``'s and ``_judge_layout``'s
    slower and does_not_fit). A recommend option's most is ``fastest_tokens_per_s`` (at any
    micro-batch its bound allows), a layout's the fastest of the settings its bound walk kept
    (the pick is one of them); the fraction is computed as the judges compute it, and a larger
    speed never gives a larger one. False where the bound does not settle it (by memory, a
    rule of another kind, a layout the model cannot take: ``judge`` decides)."""
    close, speed = default("close_fraction"), best.step.tokens_per_s
    if rule.kind in ("ac-cost", "penalty", "tp-cost", "pp-bubble"):
        return False
    if rule.kind == "recommend-layout":
        if job.plan.ep > 1:
            return False
        try:
            group = _tp_group(rule, best, job, basis)
        except MemplanError:
            return False
        return group is not None and (not group.candidates or 1 - group.most_tokens_per_s / speed > close)
    if priority == "memory":
        return False
    mine = _rule_options(rule, options, job, basis, priority, fixed)
    # the speeds first (a step time each); then one the model estimates, as judge has a verdict only then
    return all(1 - fastest_tokens_per_s(o) / speed > close for o in mine) and any(o.modelled for o in mine)


def _tp_group(rule: Rule, best: Option | None, job: Job, basis: Basis) -> LayoutGroup | None:
    """TP over the node (the largest degree that divides the model there; None: none does) under
    the rule's dp strategy, on the pick's precision (the search's, so that the two compare like
    for like), its AC and micro-batch walked by the bound as the layout search walks them."""
    tp = tp_within_node(job)
    if tp == 1:
        return None
    base = job if best is None else replace(job, train=replace(job.train, precision=best.job.train.precision))
    base = base.with_(strategy=rule.strategies[0])
    return layout_group(base, Layout(tp=tp), base.plan.strategy, basis.link)


def _judge_layout(rule: Rule, best: Option | None, job: Job, basis: Basis) -> RuleVerdict | None:
    """Tensor parallel as the seed's alternative: TP over the node (the largest degree that
    divides the heads, kv-heads, MLP and vocabulary, with SP) under the rule's dp strategy, its
    AC and micro-batch searched as the layout search does; against the data-parallel pick
    (faster or as fast: best; else slower by a fraction of its tokens/s, agreeing within
    ``close_fraction``)."""
    group = _tp_group(rule, best, job, basis)
    if group is None:
        return None  # no TP degree divides this model within the node
    mine, smallest = group.pick(), group.least
    if mine is None:
        return RuleVerdict(
            rule=rule,
            agrees=False,
            code="does_not_fit",
            metric="total_bytes",
            unit="bytes",
            layout=smallest,
        )
    if best is None or mine.step.tokens_per_s >= best.step.tokens_per_s:
        return RuleVerdict(
            rule=rule,
            agrees=True,
            code="best",
            metric="tokens_per_s",
            measured=mine.step.tokens_per_s,
            unit="tokens/s",
            layout=mine,
            versus=best,
        )
    close = default("close_fraction")
    value = 1 - mine.step.tokens_per_s / best.step.tokens_per_s
    return RuleVerdict(
        rule=rule,
        agrees=value <= close,
        code="slower",
        metric="slower_fraction",
        measured=value,
        unit="fraction",
        tolerance=close,
        layout=mine,
        versus=best,
    )


def _judge_overhead(rule: Rule, ref: Job, basis: Basis) -> RuleVerdict | None:
    """The seed's qualitative costs in numbers. tp-cost: TP over the node (as ``_judge_layout``)
    on the reference job, its exposed collective seconds over its compute seconds. pp-bubble: a
    pipeline over 2 GPUs as the seed draws it, 1F1B with the layout search's 4 micro-batches per
    stage, the bubble over compute (``throughput.bubble_fraction``)."""
    if rule.kind == "tp-cost":
        tp = tp_within_node(ref)
        if tp == 1:
            return None
        job = replace(ref, layout=Layout(tp=tp))
        value = model_parallel_seconds(job, basis.link) / basis.step(job).compute_s
        metric = "tp_exposed_fraction"
    else:
        if ref.cluster.gpus % 2 or ref.model.num_layers < 2:
            return None
        job = replace(ref, layout=Layout(pp=2, pp_microbatches=2 * MICROBATCHES_PER_STAGE))
        value, metric = bubble_fraction(job), "bubble_fraction"
    # the verdict's layout is estimated when the report reads it: a layout whose ranks this job
    # cannot take (finetune frozen:2 on a 2-layer stage) raises here, and is not judged
    estimate(job)
    close = default("close_fraction")
    return RuleVerdict(
        rule=rule,
        agrees=value > close,
        code="overhead_high" if value > close else "overhead_low",
        metric=metric,
        measured=value,
        unit="fraction",
        tolerance=close,
        layout=LayoutOption(job=job, step=basis.step(job)),
        interconnect=basis.link.interconnect,
    )
