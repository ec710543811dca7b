"""The Python API the CLI is a shell over: notebooks call these directly."""
from __future__ import annotations

from .breakdown import Estimate
from .inputs import ModelChoice, build_jobs
from .memory import estimate as estimate_job


def estimate_all(**kwargs) -> tuple[ModelChoice, list[Estimate]]:
    """Estimates for every strategy asked for (``strategy="all"`` by default).

    Accepts the CLI's options as keywords: ``params=13e9`` or ``model="llama-2-13b"`` or
    ``config="config.json"`` or ``arch=... layers=... hidden=...``; ``gpus=8, gpu_mem=80``.
    """
    choice, jobs = build_jobs(**kwargs)
    return choice, [estimate_job(job) for job in jobs]


def calibrated(estimates: list[Estimate], calibration: str | None = "auto"):
    """The estimates with a calibration applied (``memplan.calibration.Applied``), or None where
    none applies: ``auto`` takes the corrections shipped for the job's device."""
    from .calibration import apply_all

    return apply_all(estimates, calibration)
