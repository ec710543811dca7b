"""Estimates as data (the JSON contract of DESIGN.md), then as a table, CSV or an
explanation. Bytes stay integers until a human reads them."""
from __future__ import annotations

import csv
import io
import json

from tabulate import tabulate

from .breakdown import Component, Estimate
from .inputs import ModelChoice
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


def estimate_dict(est: Estimate) -> dict:
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
        "relative_throughput": None,
        "notes": list(est.notes),
    }


def to_dict(choice: ModelChoice, estimates: list[Estimate]) -> dict:
    return {"inputs": inputs_dict(choice, estimates[0]), "estimates": [estimate_dict(e) for e in estimates],
            "recommendation": None}


def render_json(choice: ModelChoice, estimates: list[Estimate]) -> str:
    return json.dumps(to_dict(choice, estimates), indent=2)


def render_csv(estimates: list[Estimate]) -> str:
    out = io.StringIO()
    fields = ["strategy", "precision", "activation_checkpointing", "offload", "micro_batch", "phase",
              *[f"{c}_bytes" for c in COMPONENTS], "allocated_bytes", "overhead_bytes", "total_bytes",
              "host_bytes", "fits", "headroom_bytes"]
    writer = csv.DictWriter(out, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    for est in estimates:
        row = estimate_dict(est)
        flat = {k: row[k] for k in fields[:6]}
        flat.update({f"{k}_bytes": v for k, v in row["bytes"].items()})
        flat.update(host_bytes=row["host_bytes"], fits=row["fits"], headroom_bytes=row["headroom_bytes"])
        writer.writerow(flat)
    return out.getvalue()


def _g(num_bytes: int) -> str:
    return f"{gib(num_bytes):.2f}"


def render_table(choice: ModelChoice, estimates: list[Estimate]) -> str:
    job = estimates[0].job
    header = [_header(choice, job)]
    rows = []
    for est in estimates:
        by = est.by_component
        rows.append([est.job.plan.strategy + ("" if est.job.plan.offload == "none" else f" +{est.job.plan.offload}"),
                     est.phase, *(_g(by[c]) for c in Component), _g(est.allocated_bytes), _g(est.overhead_bytes),
                     _g(est.total_bytes), "yes" if est.fits else "NO", _g(est.headroom_bytes)])
    table = tabulate(rows, headers=["strategy", "peak in", *COMPONENTS, "allocated", "overhead", "total", "fits",
                                    "headroom"], tablefmt="simple", disable_numparse=True, colalign=("left", "left"))
    return "\n".join(header + ["", "GiB per GPU at the peak moment of a steady-state step", table, "",
                               fits_line(estimates)])


def _header(choice: ModelChoice, job) -> str:
    c, t = job.cluster, job.train
    model = ("assumed " if choice.assumed else "") + job.model.describe()
    return (f"model    {model}\n"
            f"training seq {t.seq_len} × micro-batch {t.micro_batch} × accum {t.grad_accum}, {t.precision}, "
            f"{t.optimizer} ({t.optimizer_impl}), AC {t.activation_checkpointing}, {t.attention} attention\n"
            f"cluster  {c.gpus} × {c.gpu_name} {_g(c.gpu_mem_bytes)} GiB ({c.num_nodes} node(s) of "
            f"{c.gpus_per_node}), headroom {c.headroom:.0%}: {_g(c.usable_bytes)} GiB usable")


def fits_line(estimates: list[Estimate]) -> str:
    fit = [e.job.plan.strategy for e in estimates if e.fits]
    miss = [f"{e.job.plan.strategy} (over by {_g(-e.headroom_bytes)} GiB)" for e in estimates if not e.fits]
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
