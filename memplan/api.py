"""The Python API the CLI is a shell over: notebooks call these directly."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .breakdown import Estimate
from .inputs import ModelChoice, build_jobs
from .memory import estimate as estimate_job

if TYPE_CHECKING:
    from .decide import Recommendation


def estimate_all(**kwargs) -> tuple[ModelChoice, list[Estimate]]:
    """Estimates for every strategy asked for (``strategy="all"`` by default).

    Accepts the CLI's options as keywords: ``params=13e9`` or ``model="llama-2-13b"`` or
    ``config="config.json"`` or ``arch=... layers=... hidden=...``; ``gpus=8, gpu_mem=80``;
    ``micro_batch="max"``: each strategy at the largest micro-batch that fits.
    """
    choice, jobs = _jobs(**kwargs)
    return choice, [estimate_job(job) for job in jobs]


def calibrated(estimates: list[Estimate], calibration: str | None = "auto"):
    """The estimates with a calibration applied (``memplan.calibration.Applied``), or None where
    none applies: ``auto`` takes the corrections shipped for the job's device."""
    from .calibration import apply_all

    return apply_all(estimates, calibration)


def _jobs(micro_batch=1, **kwargs):
    """build_jobs, with ``micro_batch="max"``: each strategy at the largest micro-batch that
    fits (1 where none does)."""
    from . import search

    if micro_batch != "max":
        return build_jobs(micro_batch=micro_batch, **kwargs)
    choice, jobs = build_jobs(micro_batch=1, **kwargs)
    return choice, [job.with_(micro_batch=max(1, search.max_micro_batch(job))) for job in jobs]


FIXABLE = ("strategy", "precision", "ac", "offload", "micro_batch")


def recommend(*, priority: str = "speed", interconnect: str | None = None, bw: float | None = None,
              **kwargs) -> tuple[ModelChoice, "Recommendation"]:
    """The best option that fits, by ``priority`` (speed | memory | simplicity).

    Takes estimate_all's keywords; every one of strategy, precision, ac, offload and micro_batch
    that is passed (not None, strategy not "all") is kept fixed, the others are searched.
    ``micro_batch="max"`` searches the largest micro-batch. ``interconnect`` (nvlink | infiniband
    | ethernet | pcie) or ``bw`` (GB/s per direction) set the link between nodes.
    """
    from .decide import recommend_job

    fixed = {axis: kwargs[axis] for axis in FIXABLE if kwargs.get(axis) is not None}
    if fixed.get("strategy") == "all":
        del fixed["strategy"]
    micro_batch_max = fixed.get("micro_batch") == "max"
    if micro_batch_max:
        del fixed["micro_batch"]
    args = {k: v for k, v in kwargs.items() if v is not None and k != "micro_batch"}
    choice, jobs = build_jobs(**args)
    rec = recommend_job(jobs[0], fixed=fixed, priority=priority, interconnect=interconnect, bw_gbs=bw,
                        micro_batch_max=micro_batch_max)
    return choice, rec


def relative_throughputs(estimates: list[Estimate], *, interconnect: str | None = None,
                         bw: float | None = None) -> list[float]:
    """Each estimate's predicted tokens/s over DDP's at the same settings."""
    from .throughput import link_for, relative_to_ddp

    return [relative_to_ddp(e.job, link_for(e.job, interconnect=interconnect, bw_gbs=bw)) for e in estimates]


def min_gpus(*, strategy: str = "all", gpus_per_node: int = 0, **kwargs):
    """Fewest GPUs on which some strategy (or the one given) fits: ``memplan.search.MinGpus``."""
    from .search import min_gpus as search_min_gpus

    kwargs.pop("gpus", None)
    choice, jobs = _jobs(strategy=strategy, gpus=1, **kwargs)
    return choice, search_min_gpus(jobs[0], [j.plan.strategy for j in jobs], gpus_per_node=gpus_per_node)
