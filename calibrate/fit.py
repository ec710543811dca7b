"""Records → corrections: the torch-free half of ``memplan calibrate fit``.

memplan's current estimate of each ok record's spec (not the one stored in the record,
which an older memplan may have made) is set against what the run measured.
"""
from __future__ import annotations

from memplan import catalog
from memplan.calibration import Calibration, Observation, fit, group_bytes, same_device
from memplan.memory import estimate
from memplan.throughput import comm_seconds, flops_per_token, link_for

from .records import job_from_spec


def _speed_model(job, measured: dict, mode: str) -> tuple[float, float | None, float | None]:
    """(model FLOPs of the measured step, the device's peak, modelled collective seconds)."""
    flops = flops_per_token(job) * job.train.tokens_per_micro_batch * job.train.grad_accum
    gpu = next((g for g in catalog.gpus().values() if same_device(measured["device"], g.name)), None)
    if gpu is None:
        return flops, None, None
    real = mode in ("local", "cluster") and job.cluster.gpus > 1 and not measured.get("emulated")
    link = link_for(job.with_(gpu_name=gpu.name))
    return flops, gpu.peak_flops(job.train.precision), comm_seconds(job, link) if real else None


def observation(record: dict) -> Observation:
    measured = record["measurement"]
    used = measured.get("device_used_bytes")
    job = job_from_spec(record["spec"])
    flops, peak, comm = _speed_model(job, measured, record["mode"])
    return Observation(
        device=measured["device"], torch_version=measured["torch_version"],
        estimated=group_bytes(estimate(job).by_component),
        measured_bytes=measured["peak_allocated_bytes"],
        overhead_bytes=None if used is None else used - measured["peak_allocated_bytes"],
        strategy=job.plan.strategy, step_time_s=measured.get("step_time_s"), flops_per_step=flops,
        peak_flops=peak, comm_s=comm,
    )


def observations(records: list[dict]) -> list[Observation]:
    return [observation(r) for r in records if r["status"] == "ok" and r.get("estimate")]


def fit_records(records: list[dict], sources=()) -> Calibration:
    return Calibration(corrections=tuple(fit(observations(records))), sources=tuple(str(s) for s in sources))
