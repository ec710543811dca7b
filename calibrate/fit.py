"""Records → corrections: the torch-free fitting behind ``memplan calibrate fit`` (the
method is described in memplan.calibration, which applies what this fits).

memplan's current estimate of each ok record's spec (not the one stored in the record,
which an older memplan may have made) is set against what the run measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from memplan import catalog
from memplan.calibration import GROUPS, Calibration, Correction, Observation, ThroughputFit, group_bytes, same_device
from memplan.errors import MemplanError
from memplan.memory import estimate
from memplan.overheads import communicator_bytes, communicators
from memplan.throughput import comm_seconds, flops_per_token, link_for

from .records import job_from_spec

RIDGE = 1e-3
"""Shrinkage of each scale towards 1, relative to the records' own weight."""
IRLS_STEPS = 30
IRLS_FLOOR = 1e-6
"""Relative residual below which a record's weight stops growing (IRLS for L1)."""


def _errors_pct(predicted: np.ndarray, measured: np.ndarray) -> np.ndarray:
    return 100.0 * (predicted - measured) / measured


def _solve(x: np.ndarray, y: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted least squares for (scale_g − 1, offset), the scales shrunk towards 1."""
    design = np.column_stack([x, np.ones(len(y))]) * weights[:, None]
    target = (y - x.sum(axis=1)) * weights
    penalty = math.sqrt(RIDGE * len(y)) * np.eye(len(GROUPS) + 1)
    penalty[-1, -1] = 0.0  # the offset is not shrunk
    rows = np.vstack([design, penalty])
    solution, *_ = np.linalg.lstsq(rows, np.concatenate([target, np.zeros(len(GROUPS) + 1)]), rcond=None)
    return solution


def _predict(x: np.ndarray, solution: np.ndarray) -> np.ndarray:
    return solution[-1] + x @ (1.0 + solution[:-1])


def fit_one(observations: list[Observation]) -> Correction:
    """The correction for one (device, torch version) from its observations.

    Least absolute relative deviations by iteratively reweighted least squares: the records
    the model already gets right set the correction, and the few it gets wrong (a
    configuration it mis-models) cannot bend it towards themselves.
    """
    if not observations:
        raise MemplanError("no ok records to fit")
    first = observations[0]
    x = np.array([[o.estimated.get(g, 0) for g in GROUPS] for o in observations], dtype=float)
    y = np.array([o.measured_bytes for o in observations], dtype=float)
    solution = _solve(x, y, 1.0 / y)
    for _ in range(IRLS_STEPS):
        relative = np.abs(_predict(x, solution) - y) / y
        solution = _solve(x, y, 1.0 / (y * np.sqrt(np.maximum(relative, IRLS_FLOOR))))
    scales = {g: 1.0 + float(d) for g, d in zip(GROUPS, solution[:-1])}
    after = _errors_pct(_predict(x, solution), y)
    before = _errors_pct(x.sum(axis=1), y)
    context, per_communicator = fit_outside(observations)
    return Correction(
        throughput=fit_throughput(observations),
        device=first.device,
        torch_version=first.torch_version,
        scales=scales,
        offset_bytes=round(float(solution[-1])),
        residual_pct=float(np.sqrt(np.mean(after**2))),
        num_records=len(y),
        before_median_abs_pct=float(np.median(np.abs(before))),
        after_median_abs_pct=float(np.median(np.abs(after))),
        context_bytes=context,
        communicator_bytes=per_communicator,
    )


def fit_outside(observations: list[Observation]) -> tuple[int | None, int | None]:
    """(CUDA context, one communicator's buffers) from the records' used − reserved: least
    squares of outside = context + communicators × per-communicator where the records'
    communicator counts differ, else the context alone (median of outside less the tabled
    communicators; per-communicator None). (None, None) without such records. Nothing of
    the caching allocator (reserved − allocated) enters: the replay models it."""
    rows = [(o.communicators, o.outside_bytes) for o in observations if o.outside_bytes is not None]
    if not rows:
        return None, None
    if len({n for n, _ in rows}) > 1:
        design = np.array([[1.0, n] for n, _ in rows])
        (context, per), *_ = np.linalg.lstsq(design, np.array([b for _, b in rows], dtype=float), rcond=None)
        return round(float(context)), round(float(per))
    tabled = communicator_bytes()
    return round(float(np.median([b - n * tabled for n, b in rows]))), None


def _throughput_one(strategy: str, obs: list[Observation]) -> ThroughputFit:
    flops = np.array([o.flops_per_step for o in obs])
    seconds = np.array([o.step_time_s for o in obs])
    achieved = float(flops @ flops / (flops @ seconds))  # least squares of seconds = flops / achieved
    real = [o for o in obs if o.comm_s]
    exposed = None
    if len(real) >= 2:
        design = np.array([[o.flops_per_step, o.comm_s] for o in real])
        scale = design.max(axis=0)  # columns of equal weight: FLOPs are ~1e15 times seconds
        (inverse, exposed), *_ = np.linalg.lstsq(design / scale, np.array([o.step_time_s for o in real]), rcond=None)
        achieved, exposed = float(scale[0] / inverse), float(np.clip(exposed / scale[1], 0.0, 1.0))
    peak = obs[0].peak_flops
    return ThroughputFit(
        strategy=strategy,
        num_records=len(obs),
        achieved_flops=achieved,
        mfu=achieved / peak if peak else None,
        exposed_comm_fraction=exposed,
    )


def fit_throughput(observations: list[Observation]) -> tuple[ThroughputFit, ...]:
    """Per strategy, from the observations that carry a step time."""
    timed = [o for o in observations if o.step_time_s and o.flops_per_step]
    strategies = sorted({o.strategy for o in timed})
    return tuple(_throughput_one(s, [o for o in timed if o.strategy == s]) for s in strategies)


def fit(observations: list[Observation]) -> list[Correction]:
    """One correction per (device, torch version) present in the observations."""
    keys = sorted({(o.device, o.torch_version) for o in observations})
    return [fit_one([o for o in observations if (o.device, o.torch_version) == k]) for k in keys]


@dataclass(frozen=True)
class HeldOut:
    """Corrections fitted on one half of the records, judged on the other half."""

    fitted_on: str
    num_held_out: int
    before_median_abs_pct: float
    after_median_abs_pct: float
    before_max_abs_pct: float
    after_max_abs_pct: float


def held_out(observations: list[Observation]) -> list[HeldOut]:
    """Two-fold check: fit on the even records and judge on the odd ones, then the reverse."""
    out = []
    for name, half in (("even records", 0), ("odd records", 1)):
        train, test = observations[half::2], observations[1 - half :: 2]
        if not train or not test:
            continue
        [correction] = fit(train)[:1]
        y = np.array([o.measured_bytes for o in test], dtype=float)
        before = np.abs(_errors_pct(np.array([sum(o.estimated.values()) for o in test], dtype=float), y))
        after = np.abs(_errors_pct(np.array([correction.corrected_bytes(o.estimated) for o in test], dtype=float), y))
        out.append(
            HeldOut(
                fitted_on=name,
                num_held_out=len(test),
                before_median_abs_pct=float(np.median(before)),
                after_median_abs_pct=float(np.median(after)),
                before_max_abs_pct=float(before.max()),
                after_max_abs_pct=float(after.max()),
            )
        )
    return out


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
    used, reserved = measured.get("device_used_bytes"), measured.get("peak_reserved_bytes")
    job = job_from_spec(record["spec"])
    flops, peak, comm = _speed_model(job, measured, record["mode"])
    return Observation(
        device=measured["device"],
        torch_version=measured["torch_version"],
        estimated=group_bytes(estimate(job).by_component),
        measured_bytes=measured["peak_allocated_bytes"],
        # used (total − free after the step) less reserved: the allocator keeps its peak
        # segments cached, so what is left is the context and the communicators
        outside_bytes=None if used is None or reserved is None else used - reserved,
        # an emulated rank's fake process group creates no NCCL communicator (calibrate.launch)
        communicators=0 if measured.get("emulated") else communicators(job),
        strategy=job.plan.strategy,
        step_time_s=measured.get("step_time_s"),
        flops_per_step=flops,
        peak_flops=peak,
        comm_s=comm,
    )


def observations(records: list[dict]) -> list[Observation]:
    return [observation(r) for r in records if r["status"] == "ok" and r.get("estimate")]


def fit_records(records: list[dict], sources=()) -> Calibration:
    return Calibration(corrections=tuple(fit(observations(records))), sources=tuple(str(s) for s in sources))
