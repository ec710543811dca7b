"""The data contract of docs/design.md: an estimate as JSON and CSV, bytes as integers."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict

from ..breakdown import Component, Estimate
from ..calibration import Applied, Corrected
from ..decide import Recommendation
from ..finetune import FINETUNE_FIELDS, finetune_inputs
from ..inputs import ModelChoice
from ..loop import in_force
from ..overheads import reserved_bytes
from .decisions import recommendation_dict

COMPONENTS = [c.value for c in Component]


def inputs_dict(choice: ModelChoice, est: Estimate) -> dict:
    job = est.job
    model = {k: getattr(job.model, k) for k in job.model.__dataclass_fields__}
    if not job.model.fused_projections:  # added later: a JSON report states it where it is set
        del model["fused_projections"]
    model["num_params"] = job.model.num_params
    train = {k: getattr(job.train, k) for k in job.train.__dataclass_fields__ if k not in FINETUNE_FIELDS}
    if not job.train.use_cache:  # added later: a JSON report states it where it is set
        del train["use_cache"]
    loop = in_force(job.train)
    return {
        "model": model,
        "model_source": choice.source,
        "assumed_architecture": choice.assumed,
        "assumptions": list(choice.assumptions),
        "train": train | finetune_inputs(job),
        "cluster": {k: getattr(job.cluster, k) for k in job.cluster.__dataclass_fields__},
        "loop": [asdict(c) for c in loop.conventions + loop.elsewhere],
        **({} if job.layout.is_data_parallel else {"layout": {**job.layout.as_dict(), "dp": job.dp}}),
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
        "layout": {**est.job.layout.as_dict(), "dp": est.job.dp},
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
                for r in rec.documented_penalties(est.job)
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
