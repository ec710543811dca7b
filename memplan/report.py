"""Estimates as data (the JSON contract of DESIGN.md), then as a table, CSV or an
explanation. Bytes stay integers until a human reads them."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from dataclasses import asdict
from typing import TypeVar

from .breakdown import Component, Estimate
from .calibration import Applied, Corrected, fit_text
from .decide import FRAMEWORKS, Fix, Reason, Recommendation, Rejected, RuleVerdict, framework_strategies
from .finetune import FINETUNE_FIELDS, finetune_inputs, finetune_line
from .inputs import ModelChoice
from .loop import in_force
from .memory import modes_compared
from .overheads import reserved_bytes
from .replayed import expandable_excess
from .strategies import STRATEGIES
from .units import gib

_T = TypeVar("_T")

COMPONENTS = [c.value for c in Component]


def inputs_dict(choice: ModelChoice, est: Estimate) -> dict:
    job = est.job
    model = {k: getattr(job.model, k) for k in job.model.__dataclass_fields__}
    model["num_params"] = job.model.num_params
    loop = in_force(job.train)
    return {
        "model": model,
        "model_source": choice.source,
        "assumed_architecture": choice.assumed,
        "assumptions": list(choice.assumptions),
        "train": {k: getattr(job.train, k) for k in job.train.__dataclass_fields__ if k not in FINETUNE_FIELDS}
        | finetune_inputs(job),
        "cluster": {k: getattr(job.cluster, k) for k in job.cluster.__dataclass_fields__},
        "loop": [asdict(c) for c in loop.conventions + loop.elsewhere],
        **({} if job.layout.is_data_parallel else {"layout": {**asdict(job.layout), "dp": job.dp}}),
    }


def estimate_dict(est: Estimate, relative_throughput: float | None = None) -> dict:
    job = est.job
    by = est.by_component
    return {
        "strategy": job.plan.strategy,
        "precision": job.train.precision,
        "activation_checkpointing": job.train.activation_checkpointing,
        "offload": job.plan.offload,
        "micro_batch": job.train.micro_batch,
        "phase": est.phase,
        "peak_moment": est.peak.label,
        "bytes": {
            **{c.value: by[c] for c in Component},
            "allocated": est.allocated_bytes,
            "reserved": reserved_bytes(est),
            "overhead": est.overhead_bytes,
            "total": est.total_bytes,
        },
        "host_bytes": est.host_bytes,
        "fits": est.fits,
        "headroom_bytes": est.headroom_bytes,
        "relative_throughput": relative_throughput,
        "notes": list(est.notes),
        **layout_dict(est),
    }


def layout_dict(est: Estimate) -> dict:
    """The layout and every pipeline rank's peak, for a job with a layout (nothing otherwise)."""
    if est.job.layout.is_data_parallel:
        return {}
    stages = getattr(est, "stages", ())
    return {
        "layout": {**asdict(est.job.layout), "dp": est.job.dp},
        "worst_stage": getattr(est, "worst_stage", 0),
        "stages": [
            {
                "pp_rank": i,
                "phase": s.phase,
                "peak_moment": s.peak.label,
                "allocated": s.allocated_bytes,
                "total": s.total_bytes,
            }
            for i, s in enumerate(stages)
        ],
    }


def stage_lines(estimates: list[Estimate]) -> list[str]:
    """Under a pipeline, the worst stage of each strategy and every stage's total."""
    lines = []
    for est in estimates:
        stages = getattr(est, "stages", ())
        if len(stages) > 1:
            each = ", ".join(_g(s.total_bytes) for s in stages)
            lines.append(
                f"worst pipeline stage ({est.job.plan.strategy}): rank {getattr(est, 'worst_stage', 0)} of "
                f"{len(stages)}; total GiB by stage: {each}"
            )
    return lines


def calibrated_dict(c: Corrected) -> dict:
    return {
        "allocated": c.allocated_bytes,
        "overhead": c.overhead_bytes,
        "total": c.total_bytes,
        "band": c.band_bytes,
        "phase": c.phase,
        "fits": c.fits,
        "headroom_bytes": c.headroom_bytes,
    }


def calibration_dict(applied: Applied) -> dict:
    c = applied.correction
    return {
        "path": applied.calibration.path,
        "device": c.device,
        "torch_version": c.torch_version,
        "num_records": c.num_records,
        "band_pct": c.residual_pct,
        "band_from": "leave-one-out",
        "terms": None if c.terms is None else list(c.terms),
        "sources": list(applied.calibration.sources),
        "device_matches": applied.device_matches,
    }


def to_dict(
    choice: ModelChoice,
    estimates: list[Estimate],
    applied: Applied | None = None,
    relative: list[float] | None = None,
    rec: Recommendation | None = None,
) -> dict:
    ratios: list[float | None] = list(relative) if relative else [None] * len(estimates)
    rows = [estimate_dict(e, r) for e, r in zip(estimates, ratios)]
    if rec:
        for row, est in zip(rows, estimates):
            row["documented_relative_throughput"] = [
                {"rule": r.id, "min": r.claimed_rel_min, "max": r.claimed_rel_max, "source": r.source}
                for r in documented_penalties(rec, est.job)
            ]
    if applied:
        for row, corrected in zip(rows, applied.results):
            row["calibrated"] = calibrated_dict(corrected)
    return {
        "inputs": inputs_dict(choice, estimates[0]),
        "estimates": rows,
        "calibration": calibration_dict(applied) if applied else None,
        "recommendation": recommendation_dict(rec) if rec else None,
    }


def render_json(
    choice: ModelChoice,
    estimates: list[Estimate],
    applied: Applied | None = None,
    relative: list[float] | None = None,
    rec: Recommendation | None = None,
) -> str:
    return json.dumps(to_dict(choice, estimates, applied, relative, rec), indent=2)


CALIBRATED_FIELDS = ["calibrated_allocated_bytes", "calibrated_total_bytes", "calibrated_band_bytes", "calibrated_fits"]


def render_csv(estimates: list[Estimate], applied: Applied | None = None) -> str:
    out = io.StringIO()
    fields = [
        "strategy",
        "precision",
        "activation_checkpointing",
        "offload",
        "micro_batch",
        "phase",
        *[f"{c}_bytes" for c in COMPONENTS],
        "allocated_bytes",
        "reserved_bytes",
        "overhead_bytes",
        "total_bytes",
        "host_bytes",
        "fits",
        "headroom_bytes",
    ] + (CALIBRATED_FIELDS if applied else [])
    writer = csv.DictWriter(out, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    for i, est in enumerate(estimates):
        row = estimate_dict(est)
        flat = {k: row[k] for k in fields[:6]}
        flat.update({f"{k}_bytes": v for k, v in row["bytes"].items()})
        flat.update(host_bytes=row["host_bytes"], fits=row["fits"], headroom_bytes=row["headroom_bytes"])
        if applied:
            c = applied.results[i]
            flat.update(zip(CALIBRATED_FIELDS, (c.allocated_bytes, c.total_bytes, c.band_bytes, c.fits)))
        writer.writerow(flat)
    return out.getvalue()


def _g(num_bytes: int) -> str:
    return f"{gib(num_bytes):.2f}"


def render_table(
    choice: ModelChoice,
    estimates: list[Estimate],
    applied: Applied | None = None,
    relative: list[float] | None = None,
    rec: Recommendation | None = None,
) -> str:
    """One row per strategy; with a calibration, the corrected total decides what fits (its band shown beside it)."""
    job = estimates[0].job
    header = [_header(choice, job)] + ([applied.describe()] if applied else [])
    finals: list[Estimate] | list[Corrected] = list(applied.results) if applied else estimates
    rows = []
    for est, final in zip(estimates, finals):
        by = est.by_component
        row = [
            est.job.plan.strategy + ("" if est.job.plan.offload == "none" else f" +{est.job.plan.offload}"),
            est.phase,
            *(_g(by[c]) for c in Component),
            _g(est.allocated_bytes),
            _g(reserved_bytes(est)),
            _g(est.overhead_bytes),
            _g(est.total_bytes),
        ]
        if isinstance(final, Corrected):
            row.append(f"{_g(final.total_bytes)} ± {_g(final.band_bytes)}")
        rows.append(row + ["yes" if final.fits else "NO", _g(final.headroom_bytes)])
    headers = ["strategy", "peak in", *COMPONENTS, "allocated", "reserved", "overhead", "total"]
    headers += ["calibrated total"] if applied else []
    headers += ["fits", "headroom"]
    if relative:
        rows = [row + [f"{r:.2f}"] for row, r in zip(rows, relative)]
        headers += ["vs DDP"]
    if rec:
        rows = [
            row + [", ".join(_claim(r) for r in documented_penalties(rec, e.job)) or "-"]
            for row, e in zip(rows, estimates)
        ]
        headers += ["documented"]
    table = simple_table(rows, headers)
    lines = header + [
        "",
        "GiB per GPU at the peak moment of a steady-state step"
        + ("; vs DDP: predicted tokens/s relative to DDP at the same settings" if relative else "")
        + ("; documented: the seeds' claim (tables/rules.csv)" if rec else ""),
        table,
        "",
        fits_line(estimates, finals),
        *native_note(estimates),
        *paged_line(estimates),
        *fragmentation_line(estimates),
        *stage_lines(estimates),
    ]
    if rec:
        lines += ["", *recommendation_summary(rec)]
    return "\n".join(lines)


def simple_table(rows: list[list[str]], headers: list[str]) -> str:
    """``tabulate(rows, headers, tablefmt="simple", disable_numparse=True)``, character for
    character (tests/test_columns.py compares them), without its import (13 ms of the main
    job's start, most of it wcwidth's): cells stripped and left-aligned, each column as wide
    as its widest cell and at least its header + 2, columns two spaces apart, a dashed line
    under the headers, trailing spaces dropped. Widths are ``len``: the table's cells are
    strategy names, numbers and the seeds' claims, none of them wide characters."""
    columns = [[cell.strip() for cell in column] for column in zip(*rows)]
    widths = [max(len(h) + 2, *map(len, column)) for h, column in zip(headers, columns)]

    def line(cells) -> str:
        return "  ".join(cell.ljust(w) for cell, w in zip(cells, widths)).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *map(line, zip(*columns))])


def _header(choice: ModelChoice, job, searched: tuple[str, ...] = ()) -> str:
    c, t = job.cluster, job.train
    model = ("assumed " if choice.assumed else "") + job.model.describe()
    layout = "" if job.layout.is_data_parallel else f"\nlayout   {job.layout.describe()} × dp {job.dp} (per rank below)"
    return (
        f"model    {model}\n"
        f"training seq {t.seq_len} × micro-batch {t.micro_batch} × accum {t.grad_accum}, {t.precision}, "
        f"{t.optimizer} ({t.optimizer_impl}), AC {t.activation_checkpointing}, {t.attention} attention\n"
        f"loop     {in_force(t, searched).describe()}\n"
        f"{finetune_line(job)}"
        f"cluster  {c.gpus} × {c.gpu_name} {_g(c.gpu_mem_bytes)} GiB ({c.num_nodes} node(s) of "
        f"{c.gpus_per_node}), headroom {c.headroom:.0%}: {_g(c.usable_bytes)} GiB usable"
        f"{layout}" + "".join(f"\nassumed  {line}" for line in choice.assumptions)
    )


def native_note(estimates: list[Estimate]) -> list[str]:
    """A line naming the rows whose framework has no built-in form of the precision asked for."""
    odd = [
        e.job.plan.strategy
        for e in estimates
        if not STRATEGIES[e.job.plan.strategy].runs_natively(e.job.train.precision)
    ]
    if not odd:
        return []
    names = odd[0] if len(odd) == 1 else f"{', '.join(odd[:-1])} and {odd[-1]}"
    return [
        f"{names} {'has' if len(odd) == 1 else 'have'} no built-in {estimates[0].job.train.precision}: "
        "the row is what it would take; the recommendation searches only precisions each framework runs as is."
    ]


def paged_line(estimates: list[Estimate]) -> list[str]:
    """bitsandbytes' paged states, which the table leaves out: how much each row has outside."""
    from .notes import paged_state_bytes

    job = estimates[0].job
    if job.train.optimizer != "paged-adamw8bit" or job.train.device != "cuda":
        return []
    each = ", ".join(f"{e.job.plan.strategy} {_g(paged_state_bytes(e.job))}" for e in estimates)
    return [
        "paged-adamw8bit: the 8-bit states of tensors of ≥ 1e5 elements live in CUDA unified memory, outside "
        f"torch's allocator counters and the table (GiB per GPU: {each}); the driver pages them to host RAM "
        "under pressure."
    ]


def fragmentation_line(estimates: list[Estimate]) -> list[str]:
    """What the caching allocator holds beyond the tensors where it holds most, and what
    expandable_segments:True would hold there."""
    worst = max(estimates, key=lambda e: reserved_bytes(e) - e.allocated_bytes)
    excess = reserved_bytes(worst) - worst.allocated_bytes
    if not excess:
        return []
    alternative = expandable_excess(worst)
    verdict = (
        f"expandable_segments:True would hold {_g(alternative)} GiB (saves {_g(excess - alternative)})"
        if alternative < excess
        else "expandable_segments:True would not lower it"
    )
    where = f"most under {worst.job.plan.strategy}: " if len(estimates) > 1 else ""
    return [
        f"reserved: the caching allocator's peak (replayed); fragmentation costs {where}"
        f"{_g(excess)} GiB beyond the tensors; {verdict}."
    ]


def fits_line(estimates: list[Estimate], finals=None) -> str:
    pairs = list(zip(estimates, finals or estimates))
    fit = [e.job.plan.strategy for e, f in pairs if f.fits]
    miss = [f"{e.job.plan.strategy} (over by {_g(-f.headroom_bytes)} GiB)" for e, f in pairs if not f.fits]
    if not fit:
        return "Nothing fits: " + ", ".join(miss) + "."
    return "Fits: " + ", ".join(fit) + "." + (" Does not fit: " + ", ".join(miss) + "." if miss else "")


def render_explain(choice: ModelChoice, est: Estimate) -> str:
    """Every term of every candidate moment with its formula, so the arithmetic can be checked by hand."""
    job = est.job
    lines = [
        _header(choice, job),
        f"strategy {job.plan.strategy}, offload {job.plan.offload}",
        "",
        "Symbols: P parameters, b micro-batch, s sequence, h hidden, q query width a·d, kv k/v width, a heads,",
        "d head dim, f ffn width, V vocabulary, c compute bytes, r residual-stream bytes, m dropout-mask bytes.",
        f"Here P={job.model.num_params:,}, b={job.train.micro_batch}, s={job.train.seq_len}, "
        f"h={job.model.hidden}, q={job.model.q_hidden}, kv={job.model.kv_hidden}, a={job.model.num_heads}, "
        f"d={job.model.head_size}, f={job.model.ffn_hidden}, "
        f"V={job.model.vocab_size}.",
    ]
    for moment in est.moments:
        mark = "  <- peak" if moment is est.peak else ""
        lines += ["", f"[{moment.phase}] {moment.label}: {_g(moment.allocated_bytes)} GiB{mark}"]
        lines += [
            f"  {t.component.value:<12} {t.name:<48} {t.formula:<40} {t.bytes:>16,} B  {_g(t.bytes):>8} GiB"
            for t in moment.terms
        ]
    lines += ["", f"allocated (peak) = {est.allocated_bytes:,} B = {_g(est.allocated_bytes)} GiB"]
    reserved = reserved_bytes(est)
    lines += [f"reserved (caching allocator's peak, replayed) = {reserved:,} B = {_g(reserved)} GiB"]
    lines += [f"  + {t.name:<44} {t.formula:<28} {t.bytes:>16,} B" for t in est.overhead]
    lines += [
        f"total = {est.total_bytes:,} B = {_g(est.total_bytes)} GiB; usable {_g(job.cluster.usable_bytes)} GiB"
        f" -> {'fits' if est.fits else 'does NOT fit'} (headroom {_g(est.headroom_bytes)} GiB)"
    ]
    lines += fragmentation_line([est])
    if est.host_bytes:
        lines.append(f"host RAM for offloaded states: {_g(est.host_bytes)} GiB per GPU")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- recommendation


def documented_penalties(rec: Recommendation, job) -> list:
    """The matching penalty rules that speak about ``job``'s strategy and offload."""
    return [
        v.rule
        for v in rec.rules
        if v.rule.kind == "penalty"
        and job.plan.strategy in v.rule.strategies
        and (v.rule.offload or "none") == job.plan.offload
    ]


def _claim(rule) -> str:
    lo, hi = rule.claimed_rel_min, rule.claimed_rel_max
    return f"{lo:.2f}" if lo == hi else f"{lo:.2f}–{hi:.2f}"


def _given(value: _T | None) -> _T:
    """A field of a decision record that its code sets (decide fills each code's own fields)."""
    assert value is not None, "decide sets this field for this record's code"
    return value


def _gib(num_bytes: int) -> str:
    return f"{_g(num_bytes)} GiB"


def _tokens(option) -> str:
    return f"{option.step.tokens_per_s:,.0f}"


# ---------------------------------------------------------------------------- decisions as sentences


def rejected_reason(r: Rejected) -> str:
    """Why an option was not picked."""
    o = r.option
    if r.code == "does_not_fit":
        over = _gib(_given(r.over_by_bytes))
        return f"does not fit by {over} (total {_gib(o.total_bytes)} > {_gib(o.usable_bytes)} usable)"
    slower = _given(r.slower_fraction)
    speed = f"{slower:.0%} slower" if slower >= 0.01 else f"{slower:.1%} slower" if slower > 0.0005 else "as fast"
    if r.code == "more_memory":
        return f"uses {_gib(_given(r.extra_bytes))} more; {speed}"
    if r.code == "less_simple":
        j = o.job
        return (
            f"less simple ({j.plan.strategy}, offload {j.plan.offload}, AC {j.train.activation_checkpointing}); {speed}"
        )
    return f"{speed} ({_tokens(o)} vs {_tokens(_given(r.best))} tokens/s per GPU)"


def _rule_option(rule) -> str:
    what = " or ".join(rule.strategies) or "activation checkpointing"
    extras = ([f"AC {rule.ac}"] if rule.ac else []) + ([f"offload {rule.offload}"] if rule.offload else [])
    return " + ".join([what, *extras])


def verdict_detail(v: RuleVerdict) -> str:
    """What the arithmetic says about a rule's claim, with numbers."""
    rule, o = v.rule, v.option
    if v.code in ("within_claim", "outside_claim"):
        measured = f"{v.value:.2f}× by the model, {_claim(rule)}× claimed"
        if rule.kind == "ac-cost":
            return (
                f"AC {rule.ac} throughput relative to none ({v.strategy}): {measured} (full recompute adds one "
                f"forward: 2·N + 4·L·h·s FLOPs per token on top of 6·N + 12·L·h·s)"
            )
        st = _given(v.step)
        return (
            f"{v.strategy} relative to DDP: {measured} (communication {st.comm_s:.3f} s, exposed "
            f"{st.exposed_comm_s:.3f} s, offload {st.offload_s:.3f} s vs compute {st.compute_s:.3f} s per step "
            f"over {v.interconnect})"
        )
    if rule.kind in ("recommend-layout", "tp-cost", "pp-bubble"):
        return _layout_verdict(v)
    o = _given(o)
    if v.code == "does_not_fit":
        return (
            f"{_rule_option(rule)} does not fit: its smallest option ({o.label()}) needs "
            f"{_gib(o.total_bytes)} > {_gib(o.usable_bytes)} usable"
        )
    rel = f"; {o.relative_throughput:.2f}× DDP by the model" + (
        f", {v.claimed_low:.2f}× claimed" if v.claimed_low is not None else ""
    )
    if v.code == "best":
        return f"{o.label()} is the best option{rel}"
    best = _given(v.versus)
    if v.code == "more_memory":
        return (
            f"{o.label()} fits but needs {v.value:.0%} more memory ({_gib(o.total_bytes)} vs "
            f"{_gib(best.total_bytes)} for {best.job.plan.strategy}){rel}"
        )
    slower = f"{v.value:.0%}" if v.value >= 0.01 else f"{v.value:.1%}"
    return (
        f"{o.label()} fits ({_gib(o.headroom_bytes)} headroom) and is {slower} slower than "
        f"{best.job.plan.strategy} ({_tokens(o)} vs {_tokens(best)} tokens/s per GPU){rel}"
    )


def _layout_verdict(v: RuleVerdict) -> str:
    """The seeds' tensor / pipeline parallel rules in numbers: the layout judged, on its worst rank."""
    lay = _given(v.layout)
    est, job = lay.estimate, lay.job
    if v.rule.kind == "tp-cost":
        mp = v.value * lay.step.compute_s
        return (
            f"{job.layout.describe()} within the node: its per-layer collectives take {mp:.3f} s exposed against "
            f"{lay.step.compute_s:.3f} s of compute per step over {v.interconnect}, {v.value:.0%} of it "
            f"('high' here: above {_given(v.tolerance):.0%})"
        )
    if v.rule.kind == "pp-bubble":
        layout = job.layout
        return (
            f"a {layout.pp}-stage {layout.pp_schedule} pipeline with {layout.microbatches} micro-batches idles "
            f"{v.value:.1%} of its compute time, (pp − 1)/M; one batch through it, as drawn, idles "
            f"{layout.pp - 1:.0%} ('high' here: above {_given(v.tolerance):.0%})"
        )
    what = lay.describe()
    if v.code == "does_not_fit":
        return (
            f"tensor parallel ({what}) does not fit: it needs {_gib(est.total_bytes)} > "
            f"{_gib(est.usable_bytes)} usable on its worst rank"
        )
    if v.code == "best":
        pick = f"the data-parallel pick's {_tokens(v.versus)}" if v.versus else "no data-parallel option fits"
        return f"tensor parallel ({what}) fits with {_tokens(lay)} tokens/s per GPU predicted; {pick}"
    best = _given(v.versus)
    slower = f"{v.value:.0%}" if v.value >= 0.01 else f"{v.value:.1%}"
    return (
        f"tensor parallel ({what}) fits ({_gib(est.headroom_bytes)} headroom) and is {slower} slower than "
        f"{best.job.plan.strategy} ({_tokens(lay)} vs {_tokens(best)} tokens/s per GPU)"
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
    verdict = "fits" if f.fits else f"still over by {_gib(-o.headroom_bytes)}"
    return f"{fix_change(f)}: {o.label()} -> {_gib(o.total_bytes)} of {_gib(o.usable_bytes)} usable, {verdict}"


def calibration_text(basis) -> str:
    c = basis.correction
    measured = ", ".join(t.strategy for t in c.throughput) or "none"
    return (
        f"calibrated by {basis.calibration.path}: {fit_text(basis.calibration, c, basis.device_matches)}; "
        f"speed measured for: {measured}"
    )


def _strategies_named(strategies: tuple[str, ...]) -> str:
    """A framework's name where they are all of its strategies, else their ids."""
    name = next((f for f in FRAMEWORKS if framework_strategies(f) == strategies), None)
    return f"{name} strategies" if name else ", ".join(strategies)


def reason_text(r: Reason, restricted_by: str | None = None) -> str:
    """One reason for the pick; ``restricted_by`` names what restricted the framework (a flag)."""
    if r.code == "assumed_gpu":
        basis = _given(r.basis)
        what = "links (compute: measured speed)" if basis.measured_compute else "peak FLOPS and links"
        return f"throughput assumes {basis.link.gpu_name} (no --gpu given): its {what}"
    if r.code == "calibrated":
        return calibration_text(_given(r.basis))
    if r.code == "kept_as_given":
        return "kept as given: " + ", ".join(f"{k.replace('_', '-')} {v}" for k, v in r.fixed)
    if r.code == "restricted":
        return f"searched only {_strategies_named(r.strategies)}" + (f" ({restricted_by})" if restricted_by else "")
    if r.code == "nothing_fits":
        return f"none of the {r.num_options} options fits; the closest: {_given(r.option).label()}"
    if r.code == "skipped":
        return f"skipped {r.num_options} combinations the model cannot estimate, e.g. {r.why}"
    if r.code == "ranked":
        return f"{r.num_fitting} of {r.num_options} options fit; ranked by {r.priority}"
    if r.code == "fits":
        o = _given(r.option)
        return (
            f"fits: {_gib(o.total_bytes)} of {_gib(o.usable_bytes)} usable ({_gib(o.headroom_bytes)} headroom), "
            f"peak in {o.final.phase}"
        )
    if r.code == "predicted":
        o = _given(r.option)
        st = o.step
        return (
            f"predicted {_tokens(o)} tokens/s per GPU ({o.relative_throughput:.2f}× DDP at the same settings): "
            f"compute {st.compute_s:.3f} s, communication {st.comm_s:.3f} s of which {st.exposed_comm_s:.3f} s "
            f"exposed over {_given(r.basis).link.interconnect}, offload {st.offload_s:.3f} s per step"
        )
    rejected = _given(r.rejected)
    return f"runner-up: {rejected.option.label()} ({rejected_reason(rejected)})"


# ---------------------------------------------------------------------------- decisions as data


def _option_dict(option) -> dict:
    j = option.job
    return {
        "strategy": j.plan.strategy,
        "precision": j.train.precision,
        "activation_checkpointing": j.train.activation_checkpointing,
        "offload": j.plan.offload,
        "micro_batch": j.train.micro_batch,
        "total_bytes": option.total_bytes,
        "fits": option.fits,
        "headroom_bytes": option.headroom_bytes,
        "tokens_per_s_per_gpu": option.step.tokens_per_s,
        "step_s": option.step.step_s,
        "relative_throughput": option.relative_throughput,
    }


def _step_dict(st) -> dict:
    return {
        "compute_s": st.compute_s,
        "comm_s": st.comm_s,
        "exposed_comm_s": st.exposed_comm_s,
        "offload_s": st.offload_s,
        "step_s": st.step_s,
    }


def _verdict_dict(v: RuleVerdict) -> dict:
    return {
        "id": v.rule.id,
        "kind": v.rule.kind,
        "source": v.rule.source,
        "section": v.rule.section,
        "quote": v.rule.quote,
        "verdict": "agrees" if v.agrees else "contradicted",
        "detail": verdict_detail(v),
        "code": v.code,
        "metric": v.metric,
        "value": v.value,
        "unit": v.unit,
        "claimed_low": v.claimed_low,
        "claimed_high": v.claimed_high,
        "tolerance": v.tolerance,
        "strategy": v.strategy,
        "option": _option_dict(v.option) if v.option else None,
        "versus": _option_dict(v.versus) if v.versus else None,
        "step": _step_dict(v.step) if v.step else None,
        "interconnect": v.interconnect,
        "layout": _layout_dict(v.layout) if v.layout else None,
    }


def _layout_dict(lay) -> dict:
    """The layout a tensor / pipeline parallel rule was judged on, on its worst rank."""
    job = lay.job
    return {
        **dataclasses.asdict(job.layout),
        "strategy": job.plan.strategy,
        "activation_checkpointing": job.train.activation_checkpointing,
        "micro_batch": job.train.micro_batch,
        "total_bytes": lay.estimate.total_bytes,
        "fits": lay.fits,
        "step": _step_dict(lay.step),
    }


def _rejected_dict(r: Rejected) -> dict:
    return {
        **_option_dict(r.option),
        "reason": rejected_reason(r),
        "reason_code": r.code,
        "over_by_bytes": r.over_by_bytes,
        "slower_fraction": r.slower_fraction,
        "extra_bytes": r.extra_bytes,
    }


def _fix_dict(f: Fix) -> dict:
    return {
        "change": fix_change(f),
        "fits": f.fits,
        **({"option": _option_dict(f.option)} if f.option else {}),
        "axis": f.axis,
        "value": f.value,
        "from_gpus": f.from_gpus,
        "blocked_by": f.blocked_by,
        "error": f.error,
    }


def _reason_dict(r: Reason, restricted_by: str | None) -> dict:
    """A reason's code and numbers (its sentence is in ``reasons``, at the same index)."""
    out: dict = {"code": r.code}
    if r.code == "skipped":
        out.update(num_options=r.num_options, why=r.why)
    if r.code in ("assumed_gpu", "predicted"):
        basis = _given(r.basis)
        out.update(
            gpu=basis.link.gpu_name, interconnect=basis.link.interconnect, measured_compute=basis.measured_compute
        )
    if r.code == "calibrated":
        basis = _given(r.basis)
        c = _given(basis.correction)
        out.update(
            path=_given(basis.calibration).path,
            device=c.device,
            torch_version=c.torch_version,
            band_pct=c.residual_pct,
            speed_measured_for=[t.strategy for t in c.throughput],
            device_matches=basis.device_matches,
        )
    if r.code == "kept_as_given":
        out["fixed"] = dict(r.fixed)
    if r.code == "restricted":
        out.update(strategies=list(r.strategies), restricted_by=restricted_by)
    if r.code in ("nothing_fits", "ranked"):
        out.update(num_options=r.num_options, num_fitting=r.num_fitting or 0)
    if r.code == "ranked":
        out["priority"] = r.priority
    if r.option is not None:
        out["option"] = {**_option_dict(r.option), "usable_bytes": r.option.usable_bytes, "phase": r.option.final.phase}
    if r.code == "predicted":
        out["step"] = _step_dict(_given(r.option).step)
    if r.rejected is not None:
        out["option"] = _rejected_dict(r.rejected)
    return out


def recommendation_dict(rec: Recommendation, restricted_by: str | None = None) -> dict:
    """DESIGN.md's ``recommendation`` keys (None where nothing fits), plus what was rejected,
    the rule verdicts and the fixes: each with its sentence and its code and numbers."""
    best = _option_dict(rec.best) if rec.best else {}
    keys = ("strategy", "precision", "activation_checkpointing", "offload", "micro_batch")
    return {
        **{k: best.get(k) for k in keys},
        "priority": rec.priority,
        "tokens_per_s_per_gpu": best.get("tokens_per_s_per_gpu"),
        "relative_throughput": best.get("relative_throughput"),
        "total_bytes": best.get("total_bytes"),
        "reasons": [reason_text(r, restricted_by) for r in rec.reasons],
        "rules": [_verdict_dict(v) for v in rec.rules],
        "rejected": [_rejected_dict(r) for r in rec.rejected],
        "fixes": [_fix_dict(f) for f in rec.fixes],
        "link": {
            "gpu": rec.link.gpu_name,
            "assumed_gpu": rec.link.assumed_gpu,
            "interconnect": rec.link.interconnect,
            "intra_node_bytes_s": rec.link.intra_node_bytes_s,
            "inter_node_bytes_s": rec.link.inter_node_bytes_s,
        },
        "calibration": calibration_text(rec.basis) if rec.basis.correction else None,
        "searched_strategies": list(rec.searched) if rec.searched else None,
        "reason_details": [_reason_dict(r, restricted_by) for r in rec.reasons],
    }


def recommendation_summary(rec: Recommendation) -> list[str]:
    """A few lines: the pick, why, and how many documented rules the arithmetic contradicts."""
    contradicted = [v.rule.id for v in rec.contradicted]
    rules = (
        f"Documented rules: {len(rec.rules) - len(contradicted)} agree, {len(contradicted)} contradicted by "
        f"the arithmetic ({', '.join(contradicted)}); `memplan recommend` shows why."
        if rec.rules
        else "No documented rule matches these inputs."
    )
    if rec.best is None:
        fix = next((f for f in rec.fixes if f.fits), None)
        return ["Recommendation: nothing fits.", *([f"Smallest change: {fix_line(fix)}"] if fix else []), rules]
    st = rec.best.step
    return [
        f"Recommendation ({rec.priority}): {rec.best.label()}",
        f"  {_g(rec.best.total_bytes)} GiB per GPU, {st.tokens_per_s:,.0f} tokens/s per GPU predicted "
        f"({rec.best.relative_throughput:.2f}× DDP), step {st.step_s:.3f} s"
        + (
            f"; throughput as on {rec.link.gpu_name} (no --gpu given)"
            if rec.link.assumed_gpu and not rec.basis.measured_compute
            else ""
        )
        + ("; calibrated" if rec.basis.correction else ""),
        rules,
    ]


def finetune_lines(job) -> list[str]:
    """A LoRA or QLoRA job on one GPU: the same option under each fine-tune mode (none otherwise)."""
    if job.train.tuning.mode not in ("lora", "qlora") or job.cluster.gpus != 1:
        return []
    from .throughput import link_for, step_time

    compared = [(mode, est, step_time(est.job, link_for(est.job))) for mode, est in modes_compared(job)]
    full_s = compared[0][2].step_s
    lines = ["", "Fine-tune modes at this option (memory; predicted step time, relative to full's):"]
    for mode, est, time in compared:
        verdict = "fits" if est.fits else f"over by {_gib(-est.headroom_bytes)}"
        speed = f"step {time.step_s:.2f} s ({full_s / time.step_s:.2f}× full's speed)"
        lines.append(f"  - {mode}: {_gib(est.total_bytes)} of {_gib(est.usable_bytes)} usable, {verdict}; {speed}")
    fitting = [(time.step_s, mode) for mode, est, time in compared if est.fits]
    if fitting:
        lines.append(
            f"  Fastest mode that fits: {min(fitting)[1]} (full trains every weight; lora and qlora train "
            "adapters only, qlora on 4-bit weights: the choice is also one of quality)"
        )
    else:
        lines.append("  No mode fits at this option.")
    return lines


def render_recommendation(
    choice: ModelChoice, rec: Recommendation, launch: str | None = None, restricted_by: str | None = None
) -> str:
    """Everything: the pick and its reasons, every rejected option, every matching rule, fixes, launch config."""
    job = (rec.best or rec.options[0]).job
    searched = () if "ac" in rec.fixed_axes else ("ac",)  # the loop setting recommend searches
    lines = [_header(choice, job, searched), "", *recommendation_summary(rec)[:2], "", "Reasons:"]
    lines += [f"  - {reason_text(r, restricted_by)}" for r in rec.reasons]
    lines += finetune_lines(job)
    if rec.fixes:
        lines += ["", "Nothing fits. Single changes, each with its resulting memory:"]
        lines += [f"  - {fix_line(f)}" for f in rec.fixes]
    lines += ["", f"Documented rules matching these inputs ({len(rec.rules)}):"]
    lines += [f"  - {verdict_line(v)}" for v in rec.rules] or ["  (none)"]
    lines += ["", f"Rejected options ({len(rec.rejected)}):"]
    lines += [f"  - {r.option.label()}: {rejected_reason(r)}" for r in rec.rejected]
    if launch:
        lines += ["", "Launch configuration:", launch.rstrip("\n")]
    return "\n".join(lines)


def render_min_gpus(choice: ModelChoice, result) -> str:
    final = result.corrected or result.estimate
    job = result.estimate.job
    calibrated = f"; calibrated: {result.corrected.correction.device}" if result.corrected else ""
    lines = [
        _header(choice, job),
        "",
        f"Fewest GPUs: {result.gpus} with {result.strategy} ({_g(final.total_bytes)} of "
        f"{_g(job.cluster.usable_bytes)} GiB usable, peak in {final.phase}{calibrated})",
        "",
        "By strategy:",
    ]
    lines += [
        f"  {s:<20} {n if n is not None else 'nothing fits up to the limit'}" for s, n in result.by_strategy.items()
    ]
    return "\n".join(lines)


def min_gpus_dict(choice: ModelChoice, result) -> dict:
    return {
        "inputs": inputs_dict(choice, result.estimate),
        "gpus": result.gpus,
        "strategy": result.strategy,
        "estimate": estimate_dict(result.estimate),
        "by_strategy": result.by_strategy,
        "calibrated_total_bytes": result.corrected.total_bytes if result.corrected else None,
    }


def render_layout_pick(choice: ModelChoice, pick, launch: str | None, fmt: str) -> str:
    """``recommend --search-layout``: the layout picked, its worst stage, and why."""
    best = pick.best
    if fmt == "json":
        body = {
            "layout": None if best is None else estimate_dict(best.estimate),
            "tokens_per_s_per_gpu": None if best is None else best.step.tokens_per_s,
            "step_s": None if best is None else best.step.step_s,
            "searched": pick.searched,
            "fitting": pick.fitting,
            "reasons": pick.reasons(),
            "launch": launch,
        }
        return json.dumps(body, indent=2)
    lines = [_header(choice, (best or pick.data_parallel).job), ""]
    if best is None:
        lines.append("Nothing fits among the layouts searched.")
    else:
        est = best.estimate
        lines.append(f"Recommended layout: {best.describe()}")
        lines.append(
            f"  {_g(est.total_bytes)} GiB per GPU on the worst rank ({_g(est.usable_bytes)} usable), "
            f"{best.step.tokens_per_s:,.0f} tokens/s per GPU predicted, step {best.step.step_s:.3f} s"
        )
    lines += ["Why:", *(f"  - {r}" for r in pick.reasons())]
    if launch:
        lines += ["", launch.rstrip("\n")]
    return "\n".join(lines)
