"""When nothing fits: the single changes, each alone, that would make the job fit (or get
closest), each with the option it results in."""

from __future__ import annotations

from dataclasses import dataclass

from .. import search
from ..errors import MemplanError
from ..frameworks import runs_natively
from ..specs import Job
from ..strategies import STRATEGIES
from .options import Basis, Option, candidate_jobs, ranked, smallest


@dataclass(frozen=True, kw_only=True)
class Fix:
    """One change, as data: ``axis`` (gpus, strategy, ac, offload, micro_batch, precision) set to
    ``value`` (None for strategy: another one), the option it results in and whether that fits.
    Without an option, ``blocked_by`` names the strategies that rule the change out, or
    ``error`` says why no GPU count helps."""

    axis: str
    value: int | str | None
    option: Option | None
    fits: bool
    from_gpus: int | None = None
    """gpus: the job's own count."""
    blocked_by: tuple[str, ...] = ()
    """The strategies (fixed, or all that were searched) none of which can make the change."""
    error: str | None = None


def _smallest(
    job: Job,
    fixed: dict,
    axis: str,
    value,
    basis: Basis,
    priority: str,
    allowed: tuple[str, ...] | None,
    blocked_by: tuple[str, ...],
) -> Fix:
    """The best option that fits with ``fixed`` (else the smallest), at the fixed micro-batch."""
    opts = [
        basis.evaluate(j.with_(micro_batch=fixed.get("micro_batch", job.train.micro_batch)))
        for j in candidate_jobs(job, fixed, allowed)
    ]
    if not opts:
        return Fix(axis=axis, value=value, option=None, fits=False, blocked_by=blocked_by)
    fitting = ranked(opts, priority)
    pick = fitting[0] if fitting else smallest(opts)
    return Fix(axis=axis, value=value, option=pick, fits=pick.fits)


def _more_gpus(job: Job, base_fixed: dict, strategies: list[str], basis: Basis) -> Fix:
    sized = (
        job.with_(activation_checkpointing=base_fixed["ac"])
        .with_(precision=base_fixed.get("precision", job.train.precision))
        .with_(micro_batch=base_fixed["micro_batch"])
    )
    try:
        multi_node = job.cluster.gpus > job.cluster.gpus_per_node
        found = search.min_gpus(
            sized,
            strategies,
            fits=basis.fits,
            bound_fits=basis.bound_fits,
            gpus_per_node=job.cluster.gpus_per_node if multi_node else 0,
        )
    except MemplanError as exc:  # its message names the limit
        return Fix(axis="gpus", value=None, option=None, fits=False, from_gpus=job.cluster.gpus, error=str(exc))
    return Fix(
        axis="gpus", value=found.gpus, option=basis.evaluate(found.estimate.job), fits=True, from_gpus=job.cluster.gpus
    )


def fixes(job: Job, fixed: dict, priority: str, basis: Basis, allowed: tuple[str, ...] | None = None) -> list[Fix]:
    """Single changes, each alone: more GPUs, another strategy (when one was fixed), AC full,
    offload, micro-batch 1, pure bf16; the ones that fit first."""
    base_fixed = {
        "ac": job.train.activation_checkpointing,
        "offload": job.plan.offload,
        "micro_batch": job.train.micro_batch,
        **fixed,
    }
    strategy = fixed.get("strategy")
    strategies = [strategy] if strategy else list(allowed or STRATEGIES)
    if any(runs_natively(STRATEGIES[s], job.train.precision) for s in strategies):
        base_fixed.setdefault("precision", job.train.precision)  # else searched among the native ones

    def smallest(changed: dict, axis: str, value) -> Fix:
        return _smallest(
            job, changed, axis, value, basis, priority, allowed, (strategy,) if strategy else allowed or ()
        )

    out = [_more_gpus(job, base_fixed, strategies, basis)]
    if strategy:
        out.append(smallest({k: v for k, v in base_fixed.items() if k != "strategy"}, "strategy", None))
    if base_fixed["ac"] != "full":
        out.append(smallest({**base_fixed, "ac": "full"}, "ac", "full"))
    for offload in ("optimizer", "all"):
        if base_fixed["offload"] != offload:
            out.append(smallest({**base_fixed, "offload": offload}, "offload", offload))
    if base_fixed["micro_batch"] > 1:
        out.append(smallest({**base_fixed, "micro_batch": 1}, "micro_batch", 1))
    if base_fixed.get("precision") != "bf16":
        out.append(smallest({**base_fixed, "precision": "bf16"}, "precision", "bf16"))
    return sorted(out, key=lambda f: not f.fits)
