"""The Python API the CLI is a shell over: notebooks call these directly."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .breakdown import Estimate
from .errors import MemplanError
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
              calibration: str | None = "auto", framework: str | None = None,
              strategies: tuple[str, ...] | None = None, **kwargs) -> tuple[ModelChoice, "Recommendation"]:
    """The best option that fits, by ``priority`` (speed | memory | simplicity).

    Takes estimate_all's keywords; every one of strategy, precision, ac, offload and micro_batch
    that is passed (not None, strategy not "all") is kept fixed, the others are searched.
    ``micro_batch="max"`` searches the largest micro-batch. ``interconnect`` (nvlink | infiniband
    | ethernet | pcie) or ``bw`` (GB/s per direction) set the link between nodes. ``calibration``
    as for ``estimate``: a calibrated total decides what fits, measured speed replaces the defaults.
    ``framework`` (single | ddp | fsdp | deepspeed) searches only that framework's strategies,
    ``strategies`` only those.
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
                        micro_batch_max=micro_batch_max, calibration=calibration, framework=framework,
                        strategies=strategies)
    return choice, rec


def relative_throughputs(estimates: list[Estimate], *, interconnect: str | None = None,
                         bw: float | None = None, calibration: str | None = "auto") -> list[float]:
    """Each estimate's predicted tokens/s over DDP's at the same settings (of one job)."""
    from .decide import basis_for
    from .throughput import relative_to_ddp

    if not estimates:
        return []
    basis = basis_for(estimates[0].job, interconnect=interconnect, bw_gbs=bw, calibration=calibration)
    return [relative_to_ddp(e.job, basis.step) for e in estimates]


def min_gpus(*, strategy: str = "all", gpus_per_node: int = 0, calibration: str | None = "auto", **kwargs):
    """Fewest GPUs on which some strategy (or the one given) fits: ``memplan.search.MinGpus``;
    where a calibration applies (as for ``estimate``) its corrected totals decide."""
    from dataclasses import replace

    from .decide import basis_for
    from .search import min_gpus as search_min_gpus

    kwargs.pop("gpus", None)
    choice, jobs = _jobs(strategy=strategy, gpus=1, **kwargs)
    basis = basis_for(jobs[0], calibration=calibration)
    found = search_min_gpus(jobs[0], [j.plan.strategy for j in jobs], gpus_per_node=gpus_per_node, fits=basis.fits)
    return choice, replace(found, corrected=basis.corrected(found.estimate))


@dataclass(frozen=True)
class Result:
    """What ``memplan.estimate`` returns: the model it understood, one estimate per strategy and,
    where a calibration applies, the corrected totals."""

    choice: ModelChoice
    estimates: tuple[Estimate, ...]
    applied: "Applied | None" = None

    def __getitem__(self, strategy: str) -> Estimate:
        for est in self.estimates:
            if est.job.plan.strategy == strategy:
                return est
        raise KeyError(f"{strategy!r} was not estimated; these were: "
                       + ", ".join(e.job.plan.strategy for e in self.estimates))

    def to_frame(self):
        """One row per strategy: bytes by component at the peak, allocated, overhead, total, fits."""
        import pandas as pd

        from .report import estimate_dict

        rows = []
        for i, est in enumerate(self.estimates):
            row = estimate_dict(est)
            flat = {k: row[k] for k in ("strategy", "precision", "activation_checkpointing", "offload", "micro_batch",
                                        "phase", "fits", "headroom_bytes")}
            flat.update({f"{k}_bytes": v for k, v in row["bytes"].items()})
            if self.applied:
                corrected = self.applied.results[i]
                flat.update(calibrated_total_bytes=corrected.total_bytes, calibrated_band_bytes=corrected.band_bytes,
                            fits=corrected.fits, headroom_bytes=corrected.headroom_bytes)
            rows.append(flat)
        return pd.DataFrame(rows).set_index("strategy")


def check_keywords(kwargs: dict, *, extra: tuple[str, ...] = ()) -> None:
    """A keyword the CLI has no option for is an error, not silently ignored."""
    import inspect

    from .inputs import ARCH_FLAGS

    known = {*inspect.signature(build_jobs).parameters, "params", "model", "config", "arch", *ARCH_FLAGS, *extra}
    known.discard("model_args")
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise MemplanError(f"unknown keyword {', '.join(map(repr, unknown))}; accepted: {', '.join(sorted(known))}")


def estimate(*, calibration: str | None = "auto", **kwargs) -> Result:
    """Estimates for every strategy asked for, as ``memplan estimate`` prints them.

    ``memplan.estimate(params=13e9, gpus=8, gpu_mem=80)``; the model as ``params=``,
    ``model="llama-2-13b"``, ``config="config.json"`` or a config dict, ``model=ModelSpec(...)``,
    or ``arch=..., layers=..., hidden=...``; any CLI option as a keyword (``micro_batch=4``).
    """
    check_keywords(kwargs)
    choice, estimates = estimate_all(**kwargs)
    return Result(choice=choice, estimates=tuple(estimates), applied=calibrated(estimates, calibration))


def from_module(module, *, num_heads: int | None = None, arch: str | None = None, dropout: float | None = None,
                name: str | None = None, **kwargs) -> Result:
    """Estimate for a model object (an ``nn.Module`` or anything with ``named_parameters()``),
    without importing torch: its exact parameter shapes, or its Hugging Face ``config``."""
    from .module import spec_from_module

    spec = spec_from_module(module, num_heads=num_heads, arch=arch, dropout=dropout, name=name)
    return estimate(model=spec, **kwargs)
