"""The decisions as data: ``recommend --format json`` and the ``recommendation`` of the
estimate's JSON. Each record with its sentence and its code and numbers."""

from __future__ import annotations

from ..decide import Fix, Reason, Recommendation, Rejected, RuleVerdict
from .sentences import calibration_text, fix_change, reason_text, rejected_reason, verdict_detail
from .text import given


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
        **job.layout.as_dict(),
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
        basis = given(r.basis)
        out.update(
            gpu=basis.link.gpu_name, interconnect=basis.link.interconnect, measured_compute=basis.measured_compute
        )
    if r.code == "calibrated":
        basis = given(r.basis)
        c = given(basis.correction)
        out.update(
            path=given(basis.calibration).path,
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
        out["step"] = _step_dict(given(r.option).step)
    if r.rejected is not None:
        out["option"] = _rejected_dict(r.rejected)
    return out


def recommendation_dict(rec: Recommendation, restricted_by: str | None = None) -> dict:
    """docs/design.md's ``recommendation`` keys (None where nothing fits), plus what was rejected,
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
