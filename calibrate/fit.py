"""Records → corrections: the torch-free half of ``memplan calibrate fit``.

memplan's current estimate of each ok record's spec (not the one stored in the record,
which an older memplan may have made) is set against what the run measured.
"""
from __future__ import annotations

from memplan.calibration import Calibration, Observation, fit, group_bytes
from memplan.memory import estimate

from .records import job_from_spec


def observation(record: dict) -> Observation:
    measured = record["measurement"]
    used = measured.get("device_used_bytes")
    return Observation(
        device=measured["device"], torch_version=measured["torch_version"],
        estimated=group_bytes(estimate(job_from_spec(record["spec"])).by_component),
        measured_bytes=measured["peak_allocated_bytes"],
        overhead_bytes=None if used is None else used - measured["peak_allocated_bytes"],
    )


def observations(records: list[dict]) -> list[Observation]:
    return [observation(r) for r in records if r["status"] == "ok" and r.get("estimate")]


def fit_records(records: list[dict], sources=()) -> Calibration:
    return Calibration(corrections=tuple(fit(observations(records))), sources=tuple(str(s) for s in sources))
