"""The Python API the CLI is a shell over: notebooks call these directly.

Every function takes a ``memplan.Request``, its inputs by keyword, or both (the keywords change
the request): ``memplan.estimate(params=13e9, gpus=8, gpu_mem=80)``. The input keywords are the
fields of ``ModelRequest``, ``TrainingRequest``, ``ClusterRequest`` and ``StrategyRequest``, with
their defaults; ``help(memplan.estimate)`` shows each function's whole signature.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Collection
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from .alloctrace import replay_ahead
from .breakdown import Estimate
from .errors import InputError
from .inputs import ModelChoice, build_jobs
from .replayed import expandable_ahead
from .request import FIELDS, ClusterRequest, Request, default, unknown_keyword
from .totals import final

if TYPE_CHECKING:
    from .calibration import Applied
    from .decide import EstimateWhatIfs, Recommendation
    from .search import MinGpus

FIXABLE = ("strategy", "precision", "ac", "offload", "micro_batch")
"""Inputs ``recommend`` keeps as given, searching the others."""
MODEL_INPUTS = tuple(k for k, (part, _) in FIELDS.items() if part == "model")


def takes_inputs(function=None, *, without: tuple[str, ...] = ()):
    """Give ``function(..., **inputs)`` the signature it accepts: its own parameters, then every
    input of a Request (but ``without``) as a keyword with its default. Calls are checked against
    it, so a misspelt keyword is a TypeError that names it, and ``help()`` lists every input."""
    if function is None:
        return functools.partial(takes_inputs, without=without)
    own = inspect.signature(function)
    params = [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    taken = {p.name for p in params} | set(without)
    params += [
        inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=default(k), annotation=f.type)
        for k, (_, f) in FIELDS.items()
        if k not in taken
    ]
    signature = own.replace(parameters=params)

    @functools.wraps(function)
    def checked(*args, **kwargs):
        for keyword in kwargs:
            if keyword not in signature.parameters:
                raise unknown_keyword(keyword, f"{function.__name__}()", tuple(signature.parameters))
        signature.bind(*args, **kwargs)
        return function(*args, **kwargs)

    checked.__signature__ = signature  # type: ignore[attr-defined]
    return checked


def check_keywords(kwargs: dict, *, extra: tuple[str, ...] = ()) -> None:
    """A keyword that is no input of a Request (nor one of ``extra``) is an error, not ignored."""
    accepted = (*FIELDS, *extra)
    for keyword in kwargs:
        if keyword not in accepted:
            raise unknown_keyword(keyword, "sweep()", accepted)


def _fixed(request: Request, inputs: dict, fixed: Collection[str] | None) -> tuple[str, ...]:
    """The axes to keep: as asked, or those given as keywords or, in the request, changed from the default."""
    if fixed is not None:
        return tuple(fixed)
    values = request.inputs()
    return tuple(a for a in FIXABLE if a in inputs or values[a] != default(a))


@dataclass(frozen=True, kw_only=True)
class Decision:
    """How the recommendation is made: the settings of ``recommend`` besides the request."""

    priority: str = "speed"
    """speed | memory | simplicity: what it optimizes among the options that fit."""
    interconnect: str | None = None
    """nvlink | infiniband | ethernet | pcie between nodes (on one node: between GPUs); None: infiniband
    across nodes, the GPU's own link within one."""
    bw: float | None = None
    """Bandwidth of that link in GB/s per direction (overrides the interconnect's table value)."""
    calibration: str | None = "auto"
    """Corrections file from ``memplan calibrate fit``; auto: those shipped for the GPU (or cpu); none or None."""
    fixed: tuple[str, ...] = ()
    """Axes of ``FIXABLE`` kept as the request has them; the others are searched."""
    framework: str | None = None
    """single | ddp | fsdp | deepspeed: search only that framework's strategies."""
    strategies: tuple[str, ...] | None = None
    """Search only these strategies (``memplan.emit.WRITES``: the ones a launch form writes)."""


def _jobs(request: Request):
    """build_jobs, with a micro-batch of ``"max"``: each strategy at the largest that fits (1 where none does)."""
    from . import search

    choice, jobs = build_jobs(request)
    if request.training.micro_batch != "max":
        return choice, jobs
    return choice, [job.with_(micro_batch=max(1, search.max_micro_batch(job))) for job in jobs]


def _recommend(request: Request, decision: Decision) -> tuple[ModelChoice, Recommendation]:
    from .decide import recommend_job

    values = {**request.inputs(), "ac": request.training.spec().activation_checkpointing}
    fixed = {
        a: values.get(a)
        for a in (*[a for a in FIXABLE if a in decision.fixed], *[a for a in decision.fixed if a not in FIXABLE])
    }
    if fixed.get("strategy") == "all":
        del fixed["strategy"]
    micro_batch_max = fixed.get("micro_batch") == "max"
    if micro_batch_max:
        del fixed["micro_batch"]
    choice, jobs = build_jobs(request, micro_batch=1)
    rec = recommend_job(
        jobs[0],
        fixed=fixed,
        priority=decision.priority,
        interconnect=decision.interconnect,
        bw_gbs=decision.bw,
        micro_batch_max=micro_batch_max,
        calibration=decision.calibration,
        framework=decision.framework,
        strategies=decision.strategies,
    )
    return choice, rec


@takes_inputs
def recommend(
    request: Request | None = None,
    /,
    *,
    priority: str = "speed",
    interconnect: str | None = None,
    bw: float | None = None,
    calibration: str | None = "auto",
    fixed: Collection[str] | None = None,
    framework: str | None = None,
    strategies: Collection[str] | None = None,
    **inputs,
) -> tuple[ModelChoice, Recommendation]:
    """The best option that fits, by ``priority`` (speed | memory | simplicity), why, what was
    rejected, and which documented rules the arithmetic agrees with.

    ``fixed``: the axes of strategy, precision, ac, offload and micro_batch kept as given, the
    others searched; by default those passed as keywords or, in ``request``, changed from their
    defaults (a strategy of "all" is searched; a micro_batch of "max" searches the largest).
    ``interconnect`` (nvlink | infiniband | ethernet | pcie) or ``bw`` (GB/s per direction) set the
    link between nodes. ``calibration`` as for ``estimate``: a calibrated total decides what fits,
    measured speed replaces the defaults. ``framework`` (single | ddp | fsdp | deepspeed) searches
    only that framework's strategies, ``strategies`` only those.
    """
    request = Request.of(request, **inputs)
    decision = Decision(
        priority=priority,
        interconnect=interconnect,
        bw=bw,
        calibration=calibration,
        fixed=_fixed(request, inputs, fixed),
        framework=framework,
        strategies=tuple(strategies) if strategies is not None else None,
    )
    return _recommend(request, decision)


@takes_inputs(without=("gpus",))
def min_gpus(
    request: Request | None = None, /, *, calibration: str | None = "auto", **inputs
) -> tuple[ModelChoice, MinGpus]:
    """Fewest GPUs (1-8, then whole nodes of ``gpus_per_node``) on which some strategy (or the one
    given) fits: ``memplan.search.MinGpus``; where a calibration applies (as for ``estimate``) its
    corrected totals decide. The GPU count is what it searches: a request for more than one is refused."""
    from dataclasses import replace

    from .decide import basis_for
    from .search import min_gpus as search_min_gpus

    per_node = inputs.pop("gpus_per_node", request.cluster.gpus_per_node if request else None)
    if per_node is not None:
        ClusterRequest(gpus=per_node, gpus_per_node=per_node)  # the node size checked as any request's
    request = Request.of(request, **inputs, gpus_per_node=None)
    if request.cluster.gpus != 1:
        raise InputError(
            lambda n: (
                f"min-gpus searches the number of GPUs itself: {n('gpus')} {request.cluster.gpus} does not apply; "
                f"leave it out ({n('gpus_per_node')} sets the node size)"
            ),
            field="gpus",
            value=request.cluster.gpus,
            accepted="none given (the search's own count)",
        )
    choice, jobs = _jobs(request)
    basis = basis_for(jobs[0], calibration=calibration)
    found = search_min_gpus(
        jobs[0],
        [j.plan.strategy for j in jobs],
        gpus_per_node=per_node or 0,
        fits=basis.fits,
        bound_fits=basis.bound_fits,
    )
    return choice, replace(found, corrected=basis.corrected(found.estimate))


@dataclass(frozen=True, kw_only=True)
class Result:
    """What ``memplan.estimate`` returns, all that ``memplan estimate`` prints: the model it
    understood, one estimate per strategy, the calibration applied (where one does), each
    strategy's throughput relative to DDP, the what-ifs printed under the table and the
    recommendation (these three computed when first read)."""

    request: Request
    choice: ModelChoice
    estimates: tuple[Estimate, ...]
    applied: Applied | None = None
    """The estimates with a calibration applied (``memplan.calibration.Applied``); None where none applies."""
    decision: Decision = field(default_factory=Decision)

    def __getitem__(self, strategy: str) -> Estimate:
        for est in self.estimates:
            if est.job.plan.strategy == strategy:
                return est
        raise KeyError(
            f"{strategy!r} was not estimated; these were: " + ", ".join(e.job.plan.strategy for e in self.estimates)
        )

    @cached_property
    def relative_throughputs(self) -> tuple[float, ...]:
        """Each estimate's predicted tokens/s over DDP's at the same settings."""
        from .decide import basis_for
        from .throughput import relative_to_ddp

        if not self.estimates:
            return ()
        d = self.decision
        basis = basis_for(self.estimates[0].job, interconnect=d.interconnect, bw_gbs=d.bw, calibration=d.calibration)
        return tuple(relative_to_ddp(e.job, basis.step) for e in self.estimates)

    @cached_property
    def whatifs(self) -> EstimateWhatIfs:
        """What the table prints below its rows: the fragmentation where the allocator holds most
        and what expandable segments would hold there (a second replay), paged states, the rows
        without a built-in precision (``decide.whatifs``)."""
        from .decide import estimate_whatifs  # the decision engine loads where an answer reads it

        return estimate_whatifs(self.estimates)

    @cached_property
    def recommendation(self) -> Recommendation:
        """``recommend``'s answer for the same request, with the axes of ``decision.fixed`` kept."""
        return _recommend(self.request, self.decision)[1]

    def to_frame(self):
        """One row per strategy: bytes by component at the peak, allocated, overhead, total, fits."""
        import pandas as pd

        from .report import estimate_dict

        rows = []
        for i, est in enumerate(self.estimates):
            row = estimate_dict(est)
            flat = {
                k: row[k]
                for k in (
                    "strategy",
                    "precision",
                    "activation_checkpointing",
                    "offload",
                    "micro_batch",
                    "phase",
                    "fits",
                    "headroom_bytes",
                )
            }
            flat.update({f"{k}_bytes": v for k, v in row["bytes"].items()})
            if self.applied:
                corrected = self.applied.results[i]
                flat.update(
                    calibrated_total_bytes=corrected.total_bytes,
                    calibrated_band_bytes=corrected.band_bytes,
                    fits=corrected.fits,
                    headroom_bytes=corrected.headroom_bytes,
                )
            rows.append(flat)
        return pd.DataFrame(rows).set_index("strategy")


@takes_inputs
def estimate(
    request: Request | None = None,
    /,
    *,
    calibration: str | None = "auto",
    priority: str = "speed",
    interconnect: str | None = None,
    bw: float | None = None,
    fixed: Collection[str] | None = None,
    **inputs,
) -> Result:
    """Estimates for every strategy asked for (``strategy="all"``: each that runs on the GPUs), as
    ``memplan estimate`` prints them: ``memplan.estimate(params=13e9, gpus=8, gpu_mem=80)``.

    The model as ``params=``, ``model="llama-2-13b"`` or ``model=ModelSpec(...)``, ``config=`` (a
    config.json path or dict), or ``arch=..., layers=..., hidden=...``; ``micro_batch="max"``: each
    strategy at the largest micro-batch that fits. ``calibration``: a corrections file from
    ``memplan calibrate fit``, ``"auto"`` (those shipped for the GPU, or cpu) or ``None``. The
    recommendation of the result is ``recommend``'s with ``priority``, ``interconnect``, ``bw`` and
    ``fixed`` as there.
    """
    from .calibration import apply_all

    request = Request.of(request, **inputs)
    choice, jobs = _jobs(request)
    replay_ahead(jobs)
    estimates = tuple(final(job) for job in jobs)
    expandable_ahead(estimates)
    decision = Decision(
        priority=priority,
        interconnect=interconnect,
        bw=bw,
        calibration=calibration,
        fixed=_fixed(request, inputs, fixed),
    )
    return Result(
        request=request,
        choice=choice,
        estimates=estimates,
        applied=apply_all(list(estimates), calibration),
        decision=decision,
    )


@takes_inputs(without=MODEL_INPUTS)
def from_module(
    module,
    request: Request | None = None,
    /,
    *,
    num_heads: int | None = None,
    arch: str | None = None,
    dropout: float | None = None,
    name: str | None = None,
    calibration: str | None = "auto",
    **inputs,
) -> Result:
    """``estimate`` for a model object (an ``nn.Module`` or anything with ``named_parameters()``),
    without importing torch: its exact parameter shapes, or its Hugging Face ``config``.
    ``num_heads``, ``arch``, ``dropout`` and ``name`` complete what the shapes do not tell."""
    from .module import spec_from_module

    spec = spec_from_module(module, num_heads=num_heads, arch=arch, dropout=dropout, name=name)
    return estimate(request, model=spec, calibration=calibration, **inputs)
