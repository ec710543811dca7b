"""The decisions as sentences: why an option was rejected, what the arithmetic says about a
documented rule, a fix, a reason for the pick. Each written from the record's code and numbers."""

from __future__ import annotations

from ..calibration import fit_text
from ..decide import Fix, Reason, Rejected, RuleVerdict
from .text import claim_text, gib_text, given, tokens_text


def rejected_reason(r: Rejected) -> str:
    """Why an option was not picked."""
    o = r.option
    if r.code == "does_not_fit":
        over = gib_text(given(r.over_by_bytes))
        return f"does not fit by {over} (total {gib_text(o.total_bytes)} > {gib_text(o.usable_bytes)} usable)"
    slower = given(r.slower_fraction)
    speed = f"{slower:.0%} slower" if slower >= 0.01 else f"{slower:.1%} slower" if slower > 0.0005 else "as fast"
    if r.code == "more_memory":
        return f"uses {gib_text(given(r.extra_bytes))} more; {speed}"
    if r.code == "less_simple":
        j = o.job
        return (
            f"less simple ({j.plan.strategy}, offload {j.plan.offload}, AC {j.train.activation_checkpointing}); {speed}"
        )
    return f"{speed} ({tokens_text(o)} vs {tokens_text(given(r.best))} tokens/s per GPU)"


def _rule_option(rule) -> str:
    what = " or ".join(rule.strategies) or "activation checkpointing"
    extras = ([f"AC {rule.ac}"] if rule.ac else []) + ([f"offload {rule.offload}"] if rule.offload else [])
    return " + ".join([what, *extras])


def verdict_detail(v: RuleVerdict) -> str:
    """What the arithmetic says about a rule's claim, with numbers."""
    rule, o = v.rule, v.option
    if v.code in ("within_claim", "outside_claim"):
        measured = f"{v.value:.2f}× by the model, {claim_text(rule)}× claimed"
        if rule.kind == "ac-cost":
            return (
                f"AC {rule.ac} throughput relative to none ({v.strategy}): {measured} (full recompute adds one "
                f"forward: 2·N + 4·L·h·s FLOPs per token on top of 6·N + 12·L·h·s)"
            )
        st = given(v.step)
        return (
            f"{v.strategy} relative to DDP: {measured} (communication {st.comm_s:.3f} s, exposed "
            f"{st.exposed_comm_s:.3f} s, offload {st.offload_s:.3f} s vs compute {st.compute_s:.3f} s per step "
            f"over {v.interconnect})"
        )
    if rule.kind in ("recommend-layout", "tp-cost", "pp-bubble"):
        return _layout_verdict(v)
    o = given(o)
    if v.code == "does_not_fit":
        return (
            f"{_rule_option(rule)} does not fit: its smallest option ({o.label()}) needs "
            f"{gib_text(o.total_bytes)} > {gib_text(o.usable_bytes)} usable"
        )
    rel = f"; {o.relative_throughput:.2f}× DDP by the model" + (
        f", {v.claimed_low:.2f}× claimed" if v.claimed_low is not None else ""
    )
    if v.code == "best":
        return f"{o.label()} is the best option{rel}"
    best = given(v.versus)
    if v.code == "more_memory":
        return (
            f"{o.label()} fits but needs {v.value:.0%} more memory ({gib_text(o.total_bytes)} vs "
            f"{gib_text(best.total_bytes)} for {best.job.plan.strategy}){rel}"
        )
    slower = f"{v.value:.0%}" if v.value >= 0.01 else f"{v.value:.1%}"
    return (
        f"{o.label()} fits ({gib_text(o.headroom_bytes)} headroom) and is {slower} slower than "
        f"{best.job.plan.strategy} ({tokens_text(o)} vs {tokens_text(best)} tokens/s per GPU){rel}"
    )


def _layout_verdict(v: RuleVerdict) -> str:
    """The seeds' tensor / pipeline parallel rules in numbers: the layout judged, on its worst rank."""
    lay = given(v.layout)
    job = lay.job
    if v.rule.kind == "tp-cost":
        mp = v.value * lay.step.compute_s
        return (
            f"{job.layout.describe()} within the node: its per-layer collectives take {mp:.3f} s exposed against "
            f"{lay.step.compute_s:.3f} s of compute per step over {v.interconnect}, {v.value:.0%} of it "
            f"('high' here: above {given(v.tolerance):.0%})"
        )
    if v.rule.kind == "pp-bubble":
        layout = job.layout
        return (
            f"a {layout.pp}-stage {layout.pp_schedule} pipeline with {layout.microbatches} micro-batches idles "
            f"{v.value:.1%} of its compute time, (pp − 1)/M; one batch through it, as drawn, idles "
            f"{layout.pp - 1:.0%} ('high' here: above {given(v.tolerance):.0%})"
        )
    what, est = lay.describe(), lay.estimate
    if v.code == "does_not_fit":
        return (
            f"tensor parallel ({what}) does not fit: it needs {gib_text(est.total_bytes)} > "
            f"{gib_text(est.usable_bytes)} usable on its worst rank"
        )
    if v.code == "best":
        pick = f"the data-parallel pick's {tokens_text(v.versus)}" if v.versus else "no data-parallel option fits"
        return f"tensor parallel ({what}) fits with {tokens_text(lay)} tokens/s per GPU predicted; {pick}"
    best = given(v.versus)
    slower = f"{v.value:.0%}" if v.value >= 0.01 else f"{v.value:.1%}"
    return (
        f"tensor parallel ({what}) fits ({gib_text(est.headroom_bytes)} headroom) and is {slower} slower than "
        f"{best.job.plan.strategy} ({tokens_text(lay)} vs {tokens_text(best)} tokens/s per GPU)"
    )


def verdict_line(v: RuleVerdict) -> str:
    head = "agrees" if v.agrees else "contradicted by the arithmetic"
    return f'[{v.rule.id}] {v.rule.source} ({v.rule.section}): "{v.rule.quote}" -> {head}: {verdict_detail(v)}'


_FIX_CHANGES = {
    "strategy": "another strategy",
    "ac": "activation checkpointing {}",
    "offload": "offload {}",
    "micro_batch": "micro-batch {}",
    "precision": "lower precision: pure {} (no fp32 master copy)",
}


def fix_change(f: Fix) -> str:
    """The change a fix makes, as the user would make it."""
    if f.axis == "gpus":
        return f"more GPUs: {f.error}" if f.error else f"more GPUs: {f.value} (instead of {f.from_gpus})"
    change = _FIX_CHANGES[f.axis].format(f.value)
    if f.blocked_by:
        return (
            f"{change}: not available with strateg{'y' if len(f.blocked_by) == 1 else 'ies'} {', '.join(f.blocked_by)}"
        )
    return change


def fix_line(f: Fix) -> str:
    """The change with the memory it results in."""
    if f.option is None:
        return fix_change(f)
    o = f.option
    verdict = "fits" if f.fits else f"still over by {gib_text(-o.headroom_bytes)}"
    return f"{fix_change(f)}: {o.label()} -> {gib_text(o.total_bytes)} of {gib_text(o.usable_bytes)} usable, {verdict}"


def calibration_text(basis) -> str:
    c = basis.correction
    measured = ", ".join(t.strategy for t in c.throughput) or "none"
    return (
        f"calibrated by {basis.calibration.path}: {fit_text(basis.calibration, c, basis.device_matches)}; "
        f"speed measured for: {measured}"
    )


def _strategies_named(r: Reason) -> str:
    """The framework's name where they are all of its strategies (decide names it), else their ids."""
    return f"{r.framework} strategies" if r.framework else ", ".join(r.strategies)


def reason_text(r: Reason, restricted_by: str | None = None) -> str:
    """One reason for the pick; ``restricted_by`` names what restricted the framework (a flag)."""
    if r.code == "assumed_gpu":
        basis = given(r.basis)
        what = "links (compute: measured speed)" if basis.measured_compute else "peak FLOPS and links"
        return f"throughput assumes {basis.link.gpu_name} (no --gpu given): its {what}"
    if r.code == "calibrated":
        return calibration_text(given(r.basis))
    if r.code == "kept_as_given":
        return "kept as given: " + ", ".join(f"{k.replace('_', '-')} {v}" for k, v in r.fixed)
    if r.code == "restricted":
        return f"searched only {_strategies_named(r)}" + (f" ({restricted_by})" if restricted_by else "")
    if r.code == "nothing_fits":
        return f"none of the {r.num_options} options fits; the closest: {given(r.option).label()}"
    if r.code == "skipped":
        return f"skipped {r.num_options} combinations the model cannot estimate, e.g. {r.why}"
    if r.code == "ranked":
        return f"{r.num_fitting} of {r.num_options} options fit; ranked by {r.priority}"
    if r.code == "fits":
        o = given(r.option)
        return (
            f"fits: {gib_text(o.total_bytes)} of {gib_text(o.usable_bytes)} usable "
            f"({gib_text(o.headroom_bytes)} headroom), "
            f"peak in {o.final.phase}"
        )
    if r.code == "predicted":
        o = given(r.option)
        st = o.step
        return (
            f"predicted {tokens_text(o)} tokens/s per GPU ({o.relative_throughput:.2f}× DDP at the same settings): "
            f"compute {st.compute_s:.3f} s, communication {st.comm_s:.3f} s of which {st.exposed_comm_s:.3f} s "
            f"exposed over {given(r.basis).link.interconnect}, offload {st.offload_s:.3f} s per step"
        )
    rejected = given(r.rejected)
    return f"runner-up: {rejected.option.label()} ({rejected_reason(rejected)})"
