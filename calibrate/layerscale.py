"""Measure a model too big for the calibration device from shallow copies of it.

The same model at full width with 2, 3 and 4 blocks: per-GPU peak memory is, block for
block, the same tensors again (states, saved activations, gradients of one more unit),
so the peak is affine in depth from two blocks on (on CPU exactly: a 12-block FSDP2 llama's
peak equals the line through its 2/3/4-block peaks to the byte; through 1/2/4 it is 3.2 %
high, a one-block model's block being both the first and the last, with no other unit to
prefetch or reduce beside it). A least-squares line through the shallow runs, extrapolated
to the real depth, stands for a measurement of the full model; its uncertainty is the
line's prediction standard error at that depth.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from memplan.specs import Job

DEPTHS = (2, 3, 4)


@dataclass(frozen=True)
class LayerScaled:
    num_layers: int
    peak_allocated_bytes: int
    """Extrapolated to ``num_layers``."""
    uncertainty_bytes: int
    """One standard error of the prediction at ``num_layers``."""
    per_block_bytes: float
    constant_bytes: float
    points: tuple[tuple[int, int, str], ...]
    """(blocks, measured peak bytes, phase) of each shallow run."""
    phase: str
    """The phase of the deepest shallow run."""


def fit_depth(points: list[tuple[int, float]], num_layers: int) -> tuple[float, float, float, float]:
    """Least-squares line value = constant + per_block · blocks through ``points``; returns
    (per_block, constant, prediction at num_layers, its standard error)."""
    depth = np.array([p[0] for p in points], dtype=float)
    value = np.array([p[1] for p in points], dtype=float)
    per_block, constant = np.polyfit(depth, value, 1)
    predicted = float(constant + per_block * num_layers)
    dof = len(points) - 2
    if dof <= 0:
        return float(per_block), float(constant), predicted, 0.0
    residual = value - (constant + per_block * depth)
    sigma = math.sqrt(float(residual @ residual) / dof)
    spread = float(((depth - depth.mean()) ** 2).sum())
    se = sigma * math.sqrt(1 + 1 / len(points) + (num_layers - depth.mean()) ** 2 / spread)
    return float(per_block), float(constant), predicted, se


def _shallow_runs(job: Job, depths, measure) -> list[dict]:
    if max(depths) >= job.model.num_layers:
        raise ValueError(f"layer scaling needs depths below the model's {job.model.num_layers} blocks, got {depths}")
    return [dataclasses.asdict(measure(job.with_(num_layers=d))) for d in depths]


def _scaled(num_layers: int, depths, runs: list[dict]) -> LayerScaled:
    points = [(d, r["peak_allocated_bytes"]) for d, r in zip(depths, runs)]
    per_block, constant, predicted, se = fit_depth(points, num_layers)
    return LayerScaled(
        num_layers=num_layers,
        peak_allocated_bytes=round(predicted),
        uncertainty_bytes=math.ceil(se),
        per_block_bytes=per_block,
        constant_bytes=constant,
        points=tuple((d, r["peak_allocated_bytes"], r["phase"]) for d, r in zip(depths, runs)),
        phase=runs[-1]["phase"],
    )


def measure_layer_scaled(job: Job, *, depths=DEPTHS, measure) -> LayerScaled:
    """``measure(job)`` runs one shallow job for real and returns its Measurement."""
    return _scaled(job.model.num_layers, depths, _shallow_runs(job, depths, measure))


def scaled_measurement(job: Job, *, measure, depths=DEPTHS) -> dict:
    """A record's ``measurement`` for the full model from its shallow copies: every size and
    the step time extrapolated along depth, the fit itself under ``layer_scaled``."""
    runs = _shallow_runs(job, depths, measure)
    scaled = _scaled(job.model.num_layers, depths, runs)
    out = dict(runs[-1], categories={}, phase_peaks={}, peak_allocated_bytes=scaled.peak_allocated_bytes)
    for key in ("peak_reserved_bytes", "device_used_bytes", "step_time_s"):
        if all(r.get(key) is not None for r in runs):
            value = fit_depth([(d, r[key]) for d, r in zip(depths, runs)], job.model.num_layers)[2]
            out[key] = value if key == "step_time_s" else round(value)
    out["tokens_per_s"] = job.train.tokens_per_micro_batch * job.train.grad_accum / out["step_time_s"]
    out["layer_scaled"] = {
        "depths": list(depths),
        "per_block_bytes": scaled.per_block_bytes,
        "constant_bytes": scaled.constant_bytes,
        "uncertainty_bytes": scaled.uncertainty_bytes,
        "points": [list(p) for p in scaled.points],
    }
    return out
