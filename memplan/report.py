"""Estimates as data (the JSON contract of DESIGN.md), then as a table, CSV or an
explanation. Bytes stay integers until a human reads them."""
from __future__ import annotations

import csv
import io
import json

from .breakdown import Component, Estimate
from .calibration import Applied, Corrected
from .decide import Recommendation
from .inputs import ModelChoice
from .strategies import STRATEGIES
from .units import gib


COMPONENTS = [c.value for c in Component]


def inputs_dict(choice: ModelChoice, est: Estimate) -> dict:
    job = est.job
    model = {k: getattr(job.model, k) for k in job.model.__dataclass_fields__}
    model["num_params"] = job.model.num_params
    return {
        "model": model,
        "model_source": choice.source,
        "assumed_architecture": choice.assumed,
        "train": {k: getattr(job.train, k) for k in job.train.__dataclass_fields__},
        "cluster": {k: getattr(job.cluster, k) for k in job.cluster.__dataclass_fields__},
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
        "bytes": {**{c.value: by[c] for c in Component}, "allocated": est.allocated_bytes,
                  "overhead": est.overhead_bytes, "total": est.total_bytes},
        "host_bytes": est.host_bytes,
        "fits": est.fits,
        "headroom_bytes": est.headroom_bytes,
        "relative_throughput": relative_throughput,
        "notes": list(est.notes),
    }


def calibrated_dict(c: Corrected) -> dict:
    return {"allocated": c.allocated_bytes, "overhead": c.overhead_bytes, "total": c.total_bytes,
            "band": c.band_bytes, "phase": c.phase, "fits": c.fits, "headroom_bytes": c.headroom_bytes}


def calibration_dict(applied: Applied) -> dict:
    c = applied.correction
    return {"path": applied.calibration.path, "device": c.device, "torch_version": c.torch_version,
            "num_records": c.num_records, "band_pct": c.residual_pct, "device_matches": applied.device_matches}


def to_dict(choice: ModelChoice, estimates: list[Estimate], applied: Applied | None = None,
            relative: list[float] | None = None, rec: Recommendation | None = None) -> dict:
    rows = [estimate_dict(e, r) for e, r in zip(estimates, relative or [None] * len(estimates))]
    if rec:
        for row, est in zip(rows, estimates):
            row["documented_relative_throughput"] = [
                {"rule": r.id, "min": r.claimed_rel_min, "max": r.claimed_rel_max, "source": r.source}
                for r in documented_penalties(rec, est.job)]
    if applied:
        for row, corrected in zip(rows, applied.results):
            row["calibrated"] = calibrated_dict(corrected)
    return {"inputs": inputs_dict(choice, estimates[0]), "estimates": rows,
            "calibration": calibration_dict(applied) if applied else None,
            "recommendation": recommendation_dict(rec) if rec else None}


def render_json(choice: ModelChoice, estimates: list[Estimate], applied: Applied | None = None,
                relative: list[float] | None = None, rec: Recommendation | None = None) -> str:
    return json.dumps(to_dict(choice, estimates, applied, relative, rec), indent=2)


CALIBRATED_FIELDS = ["calibrated_allocated_bytes", "calibrated_total_bytes", "calibrated_band_bytes",
                     "calibrated_fits"]


def render_csv(estimates: list[Estimate], applied: Applied | None = None) -> str:
    out = io.StringIO()
    fields = ["strategy", "precision", "activation_checkpointing", "offload", "micro_batch", "phase",
              *[f"{c}_bytes" for c in COMPONENTS], "allocated_bytes", "overhead_bytes", "total_bytes",
              "host_bytes", "fits", "headroom_bytes"] + (CALIBRATED_FIELDS if applied else [])
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


def render_table(choice: ModelChoice, estimates: list[Estimate], applied: Applied | None = None,
                 relative: list[float] | None = None, rec: Recommendation | None = None) -> str:
    """One row per strategy; with a calibration, the corrected total decides what fits (its band shown beside it)."""
    job = estimates[0].job
    header = [_header(choice, job)] + ([applied.describe()] if applied else [])
    finals = list(applied.results) if applied else estimates
    rows = []
    for est, final in zip(estimates, finals):
        by = est.by_component
        row = [est.job.plan.strategy + ("" if est.job.plan.offload == "none" else f" +{est.job.plan.offload}"),
               est.phase, *(_g(by[c]) for c in Component), _g(est.allocated_bytes), _g(est.overhead_bytes),
               _g(est.total_bytes)]
        if applied:
            row.append(f"{_g(final.total_bytes)} ± {_g(final.band_bytes)}")
        rows.append(row + ["yes" if final.fits else "NO", _g(final.headroom_bytes)])
    headers = ["strategy", "peak in", *COMPONENTS, "allocated", "overhead", "total"]
    headers += ["calibrated total"] if applied else []
    headers += ["fits", "headroom"]
    if relative:
        rows = [row + [f"{r:.2f}"] for row, r in zip(rows, relative)]
        headers += ["vs DDP"]
    if rec:
        rows = [row + [", ".join(_claim(r) for r in documented_penalties(rec, e.job)) or "-"]
                for row, e in zip(rows, estimates)]
        headers += ["documented"]
    from tabulate import tabulate  # here, not at the top: JSON and --help never pay its import

    table = tabulate(rows, headers, tablefmt="simple", disable_numparse=True)
    lines = header + ["", "GiB per GPU at the peak moment of a steady-state step"
                      + ("; vs DDP: predicted tokens/s relative to DDP at the same settings" if relative else "")
                      + ("; documented: the seeds' claim (tables/rules.csv)" if rec else ""),
                      table, "", fits_line(estimates, finals), *native_note(estimates)]
    if rec:
        lines += ["", *recommendation_summary(rec)]
    return "\n".join(lines)


def _header(choice: ModelChoice, job) -> str:
    c, t = job.cluster, job.train
    model = ("assumed " if choice.assumed else "") + job.model.describe()
    return (f"model    {model}\n"
            f"training seq {t.seq_len} × micro-batch {t.micro_batch} × accum {t.grad_accum}, {t.precision}, "
            f"{t.optimizer} ({t.optimizer_impl}), AC {t.activation_checkpointing}, {t.attention} attention\n"
            f"cluster  {c.gpus} × {c.gpu_name} {_g(c.gpu_mem_bytes)} GiB ({c.num_nodes} node(s) of "
            f"{c.gpus_per_node}), headroom {c.headroom:.0%}: {_g(c.usable_bytes)} GiB usable")


def native_note(estimates: list[Estimate]) -> list[str]:
    """A line naming the rows whose framework has no built-in form of the precision asked for."""
    odd = [e.job.plan.strategy for e in estimates if not STRATEGIES[e.job.plan.strategy].runs_natively(e.job.train.precision)]
    if not odd:
        return []
    names = odd[0] if len(odd) == 1 else f"{', '.join(odd[:-1])} and {odd[-1]}"
    return [f"{names} {'has' if len(odd) == 1 else 'have'} no built-in {estimates[0].job.train.precision}: "
            "the row is what it would take; the recommendation searches only precisions each framework runs as is."]


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
    lines = [_header(choice, job), f"strategy {job.plan.strategy}, offload {job.plan.offload}", "",
             "Symbols: P parameters, b micro-batch, s sequence, h hidden, kv k/v width, a heads, d head dim,",
             "f ffn width, V vocabulary, c compute bytes, r residual-stream bytes, m dropout-mask bytes.",
             f"Here P={job.model.num_params:,}, b={job.train.micro_batch}, s={job.train.seq_len}, "
             f"h={job.model.hidden}, kv={job.model.kv_hidden}, a={job.model.num_heads}, f={job.model.ffn_hidden}, "
             f"V={job.model.vocab_size}."]
    for moment in est.moments:
        mark = "  <- peak" if moment is est.peak else ""
        lines += ["", f"[{moment.phase}] {moment.label}: {_g(moment.allocated_bytes)} GiB{mark}"]
        lines += [f"  {t.component.value:<12} {t.name:<48} {t.formula:<40} {t.bytes:>16,} B  {_g(t.bytes):>8} GiB"
                  for t in moment.terms]
    lines += ["", f"allocated (peak) = {est.allocated_bytes:,} B = {_g(est.allocated_bytes)} GiB"]
    lines += [f"  + {t.name:<44} {t.formula:<28} {t.bytes:>16,} B" for t in est.overhead]
    lines += [f"total = {est.total_bytes:,} B = {_g(est.total_bytes)} GiB; usable {_g(job.cluster.usable_bytes)} GiB"
              f" -> {'fits' if est.fits else 'does NOT fit'} (headroom {_g(est.headroom_bytes)} GiB)"]
    if est.host_bytes:
        lines.append(f"host RAM for offloaded states: {_g(est.host_bytes)} GiB per GPU")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- recommendation

def documented_penalties(rec: Recommendation, job) -> list:
    """The matching penalty rules that speak about ``job``'s strategy and offload."""
    return [v.rule for v in rec.rules if v.rule.kind == "penalty" and job.plan.strategy in v.rule.strategies
            and (v.rule.offload or "none") == job.plan.offload]


def _claim(rule) -> str:
    lo, hi = rule.claimed_rel_min, rule.claimed_rel_max
    return f"{lo:.2f}" if lo == hi else f"{lo:.2f}–{hi:.2f}"

def _option_dict(option) -> dict:
    j = option.job
    return {"strategy": j.plan.strategy, "precision": j.train.precision,
            "activation_checkpointing": j.train.activation_checkpointing, "offload": j.plan.offload,
            "micro_batch": j.train.micro_batch, "total_bytes": option.total_bytes, "fits": option.fits,
            "headroom_bytes": option.headroom_bytes, "tokens_per_s_per_gpu": option.step.tokens_per_s,
            "step_s": option.step.step_s, "relative_throughput": option.relative_throughput}


def recommendation_dict(rec: Recommendation) -> dict:
    """DESIGN.md's ``recommendation`` keys (None where nothing fits), plus what was rejected,
    the rule verdicts and the fixes."""
    best = _option_dict(rec.best) if rec.best else {}
    keys = ("strategy", "precision", "activation_checkpointing", "offload", "micro_batch")
    return {
        **{k: best.get(k) for k in keys},
        "priority": rec.priority,
        "tokens_per_s_per_gpu": best.get("tokens_per_s_per_gpu"),
        "relative_throughput": best.get("relative_throughput"),
        "total_bytes": best.get("total_bytes"),
        "reasons": list(rec.reasons),
        "rules": [{"id": v.rule.id, "kind": v.rule.kind, "source": v.rule.source, "section": v.rule.section,
                   "quote": v.rule.quote, "verdict": "agrees" if v.agrees else "contradicted", "detail": v.detail}
                  for v in rec.rules],
        "rejected": [{**_option_dict(r.option), "reason": r.reason} for r in rec.rejected],
        "fixes": [{"change": f.change, "fits": f.fits, **({"option": _option_dict(f.option)} if f.option else {})}
                  for f in rec.fixes],
        "link": {"gpu": rec.link.gpu_name, "assumed_gpu": rec.link.assumed_gpu, "interconnect": rec.link.interconnect,
                 "intra_node_bytes_s": rec.link.intra_node_bytes_s, "inter_node_bytes_s": rec.link.inter_node_bytes_s},
        "calibration": rec.basis.describe() if rec.basis.correction else None,
    }


def recommendation_summary(rec: Recommendation) -> list[str]:
    """A few lines: the pick, why, and how many documented rules the arithmetic contradicts."""
    contradicted = [v.rule.id for v in rec.contradicted]
    rules = (f"Documented rules: {len(rec.rules) - len(contradicted)} agree, {len(contradicted)} contradicted by "
             f"the arithmetic ({', '.join(contradicted)}); `memplan recommend` shows why." if rec.rules else
             "No documented rule matches these inputs.")
    if rec.best is None:
        fix = next((f for f in rec.fixes if f.fits), None)
        return ["Recommendation: nothing fits.", *([f"Smallest change: {fix.line()}"] if fix else []), rules]
    st = rec.best.step
    return [f"Recommendation ({rec.priority}): {rec.best.label()}",
            f"  {_g(rec.best.total_bytes)} GiB per GPU, {st.tokens_per_s:,.0f} tokens/s per GPU predicted "
            f"({rec.best.relative_throughput:.2f}× DDP), step {st.step_s:.3f} s"
            + (f"; throughput as on {rec.link.gpu_name} (no --gpu given)"
               if rec.link.assumed_gpu and not rec.basis.measured_compute else "")
            + ("; calibrated" if rec.basis.correction else ""), rules]


def render_recommendation(choice: ModelChoice, rec: Recommendation, launch: str | None = None) -> str:
    """Everything: the pick and its reasons, every rejected option, every matching rule, fixes, launch config."""
    job = (rec.best or rec.options[0]).job
    lines = [_header(choice, job), "", *recommendation_summary(rec)[:2], "", "Reasons:"]
    lines += [f"  - {r}" for r in rec.reasons]
    if rec.fixes:
        lines += ["", "Nothing fits. Single changes, each with its resulting memory:"]
        lines += [f"  - {f.line()}" for f in rec.fixes]
    lines += ["", f"Documented rules matching these inputs ({len(rec.rules)}):"]
    lines += [f"  - {v.line()}" for v in rec.rules] or ["  (none)"]
    lines += ["", f"Rejected options ({len(rec.rejected)}):"]
    lines += [f"  - {r.option.label()}: {r.reason}" for r in rec.rejected]
    if launch:
        lines += ["", "Launch configuration:", launch.rstrip("\n")]
    return "\n".join(lines)


def render_min_gpus(choice: ModelChoice, result) -> str:
    final = result.corrected or result.estimate
    job = result.estimate.job
    calibrated = f"; calibrated: {result.corrected.correction.device}" if result.corrected else ""
    lines = [_header(choice, job), "",
             f"Fewest GPUs: {result.gpus} with {result.strategy} ({_g(final.total_bytes)} of "
             f"{_g(job.cluster.usable_bytes)} GiB usable, peak in {final.phase}{calibrated})", "", "By strategy:"]
    lines += [f"  {s:<20} {n if n is not None else 'nothing fits up to the limit'}"
              for s, n in result.by_strategy.items()]
    return "\n".join(lines)


def min_gpus_dict(choice: ModelChoice, result) -> dict:
    return {"inputs": inputs_dict(choice, result.estimate), "gpus": result.gpus, "strategy": result.strategy,
            "estimate": estimate_dict(result.estimate), "by_strategy": result.by_strategy,
            "calibrated_total_bytes": result.corrected.total_bytes if result.corrected else None}
