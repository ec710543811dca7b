"""Measure a model too big for the calibration device from shallow copies of it.

The same model at full width with 1, 2 and 4 blocks: per-GPU peak memory is, block for
block, the same tensors again (states, saved activations, gradients of one more unit),
so the peak is affine in depth. A least-squares line through the shallow runs,
extrapolated to the real depth, stands for a measurement of the full model; its
uncertainty is the line's prediction standard error at that depth.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from memplan.specs import Job

DEPTHS = (1, 2, 4)


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


def fit_depth(points: list[tuple[int, int]], num_layers: int) -> tuple[float, float, int, int]:
    """Least-squares line bytes = constant + per_block · blocks through ``points``; returns
    (per_block, constant, prediction at num_layers, its standard error)."""
    depth = np.array([p[0] for p in points], dtype=float)
    peak = np.array([p[1] for p in points], dtype=float)
    per_block, constant = np.polyfit(depth, peak, 1)
    predicted = constant + per_block * num_layers
    dof = len(points) - 2
    if dof <= 0:
        return per_block, constant, round(predicted), 0
    residual = peak - (constant + per_block * depth)
    sigma = math.sqrt(float(residual @ residual) / dof)
    spread = float(((depth - depth.mean()) ** 2).sum())
    se = sigma * math.sqrt(1 + 1 / len(points) + (num_layers - depth.mean()) ** 2 / spread)
    return per_block, constant, round(predicted), math.ceil(se)


def measure_layer_scaled(job: Job, *, depths=DEPTHS, measure) -> LayerScaled:
    """``measure(job)`` runs one shallow job for real and returns its Measurement."""
    if max(depths) >= job.model.num_layers:
        raise ValueError(f"layer scaling needs depths below the model's {job.model.num_layers} blocks, got {depths}")
    runs = [(d, measure(job.with_(num_layers=d))) for d in depths]
    points = [(d, m.peak_allocated_bytes) for d, m in runs]
    per_block, constant, predicted, se = fit_depth(points, job.model.num_layers)
    return LayerScaled(
        num_layers=job.model.num_layers, peak_allocated_bytes=predicted, uncertainty_bytes=se,
        per_block_bytes=per_block, constant_bytes=constant,
        points=tuple((d, m.peak_allocated_bytes, m.phase) for d, m in runs), phase=runs[-1][1].phase,
    )
