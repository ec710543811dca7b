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
"""Shrinkage of each fitted scale towards 1, relative to the records' own weight."""
IRLS_STEPS = 30
IRLS_FLOOR = 1e-6
"""Relative residual below which a record's weight stops growing (IRLS for L1)."""

MIN_RECORDS_PER_TERM = 3
"""Records a fit needs per free parameter: with fewer, a leave-one-out fit has as many
parameters as records and its held-out error means nothing."""
MIN_GAIN = 0.01
"""Relative fall of the leave-one-out error a term must bring to be fitted (1 %): a term that
only follows the noise of the records it was fitted on is left at memplan's arithmetic."""
RANK_TOLERANCE = 1e-6
"""Smallest singular value, relative to the largest, of the records' normalised design for a
term to count as determined by them rather than a copy of the terms already fitted."""

TERMS = ("offset", *GROUPS)
"""The free parameters a fit may use: a constant offset and one scale per group."""

_MIB = 2**20
PHYSICAL_RANGE = {
    # dtype × numel of every parameter, gradient and optimizer state: exact arithmetic; what
    # differs on a device is rounding to the allocator's 512-B blocks and a few small tensors
    # (optimizer step counters, a loss scaler), a few percent at the smallest shapes at most
    "states": (0.95, 1.05),
    # the saved tensors of each op, counted from the autograd graph: kernel choices (attention
    # backends' saved statistics, fused norms, dropout masks) move them by tens of percent at
    # most; a scale beyond that is a missing or phantom tensor, a modelling bug to fix, not fit
    "activations": (0.8, 1.25),
    # DDP's buckets, FSDP's gather/reduce-scatter buffers, workspaces: sized by framework
    # settings memplan reads (bucket caps, unit sizes); a framework that rounds or overlaps two
    # of them is at most twice, at least half of what is modelled
    "buffers": (0.5, 2.0),
    # bytes no term models: cuBLAS/cuDNN workspaces (tens of MiB per handle), small
    # bookkeeping tensors; a negative offset beyond a few MiB would be tensors modelled that
    # do not exist, which every scale above would then hide
    "offset": (-64 * _MIB, 512 * _MIB),
}
"""Where a fitted term is physical, and why (each bound's reason is its comment)."""

KIND_OF_RUN = {
    "offset": "another model size (the offset is what does not grow with it)",
    "states": "another model size or another sharding strategy",
    "activations": "another micro-batch or sequence length",
    "buffers": "another strategy (DDP's buckets, FSDP's gather buffers)",
}
"""Which runs make a term's bytes move independently of the others', so that it can be fitted."""


def _errors_pct(predicted: np.ndarray, measured: np.ndarray) -> np.ndarray:
    return 100.0 * (predicted - measured) / measured


def _rms(values: np.ndarray) -> float:
    return float(np.sqrt(np.mean(values**2))) if len(values) else 0.0


def _columns(x: np.ndarray, terms: tuple[str, ...]) -> np.ndarray:
    """The design of ``terms``: the offset's column of ones, each group's estimated bytes."""
    groups = list(GROUPS)
    cols = [np.ones(len(x)) if t == "offset" else x[:, groups.index(t)] for t in terms]
    return np.column_stack(cols) if cols else np.zeros((len(x), 0))


def _solve(x: np.ndarray, y: np.ndarray, weights: np.ndarray, terms: tuple[str, ...]) -> np.ndarray:
    """Weighted least squares for the terms' values (scale − 1, or the offset's bytes), the
    scales shrunk towards 1; the terms left out keep scale 1 and no offset."""
    if not terms:
        return np.zeros(0)
    design = _columns(x, terms) * weights[:, None]
    target = (y - x.sum(axis=1)) * weights
    penalty = math.sqrt(RIDGE * len(y)) * np.diag([0.0 if t == "offset" else 1.0 for t in terms])
    rows = np.vstack([design, penalty])
    solution, *_ = np.linalg.lstsq(rows, np.concatenate([target, np.zeros(len(terms))]), rcond=None)
    return solution


def _predict(x: np.ndarray, terms: tuple[str, ...], solution: np.ndarray) -> np.ndarray:
    return x.sum(axis=1) + _columns(x, terms) @ solution


def _fit_terms(x: np.ndarray, y: np.ndarray, terms: tuple[str, ...]) -> np.ndarray:
    """Least absolute relative deviations by iteratively reweighted least squares: the records
    the model already gets right set the correction, and the few it gets wrong (a configuration
    it mis-models) cannot bend it towards themselves."""
    solution = _solve(x, y, 1.0 / y, terms)
    for _ in range(IRLS_STEPS):
        relative = np.abs(_predict(x, terms, solution) - y) / y
        solution = _solve(x, y, 1.0 / (y * np.sqrt(np.maximum(relative, IRLS_FLOOR))), terms)
    return solution


def _leave_one_out_pct(x: np.ndarray, y: np.ndarray, terms: tuple[str, ...]) -> np.ndarray:
    """Each record's error when the terms are fitted on every other record."""
    if not terms:
        return _errors_pct(x.sum(axis=1), y)
    out = np.empty(len(y))
    for i in range(len(y)):
        keep = np.arange(len(y)) != i
        solution = _fit_terms(x[keep], y[keep], terms)
        out[i] = _errors_pct(_predict(x[i : i + 1], terms, solution), y[i : i + 1])[0]
    return out


def _determined(x: np.ndarray, y: np.ndarray, terms: tuple[str, ...]) -> bool:
    """Whether the records determine every one of ``terms``: their relative design, each
    column normalised, has full rank."""
    design = _columns(x, terms) / y[:, None]
    norms = np.linalg.norm(design, axis=0)
    if (norms == 0).any():
        return False
    singular = np.linalg.svd(design / norms, compute_uv=False)
    return len(singular) == len(terms) and singular[-1] > RANK_TOLERANCE * singular[0]


def _value(term: str, delta: float) -> float:
    return delta if term == "offset" else 1.0 + delta


def _shown(term: str, value: float) -> str:
    return f"offset {value / _MIB:+,.2f} MiB" if term == "offset" else f"{term} ×{value:.4f}"


def _out_of_range(terms: tuple[str, ...], solution: np.ndarray) -> str | None:
    for term, delta in zip(terms, solution):
        low, high = PHYSICAL_RANGE[term]
        value = _value(term, float(delta))
        if not low <= value <= high:
            bounds = f"[{low / _MIB:+,.0f}, {high / _MIB:+,.0f}] MiB" if term == "offset" else f"[×{low:g}, ×{high:g}]"
            return f"{_shown(term, value)} is outside its physical range {bounds} (calibrate.fit.PHYSICAL_RANGE)"
    return None


@dataclass(frozen=True)
class _Selection:
    terms: tuple[str, ...]
    solution: np.ndarray
    held_out_pct: np.ndarray
    notes: tuple[str, ...]


def _select(x: np.ndarray, y: np.ndarray) -> _Selection:
    """The terms to fit, added one at a time while each lowers the leave-one-out error by
    MIN_GAIN, stays in its physical range, is determined by the records and leaves
    MIN_RECORDS_PER_TERM records per term; the notes say why each other term was not fitted."""
    n = len(y)
    max_terms = n // MIN_RECORDS_PER_TERM
    terms: tuple[str, ...] = ()
    loo = _leave_one_out_pct(x, y, terms)
    refused: dict[str, str] = {}
    while True:
        candidates = [t for t in TERMS if t not in terms and t not in refused]
        if len(terms) >= max_terms or not candidates:
            break
        tried = []
        for term in candidates:
            trial = (*terms, term)
            if not _determined(x, y, trial):
                refused[term] = (
                    f"{term}: not determined by these records (its bytes move with the terms fitted); "
                    f"runs of {KIND_OF_RUN[term]} would let it be fitted"
                )
                continue
            problem = _out_of_range(trial, _fit_terms(x, y, trial))
            if problem:
                refused[term] = f"{term}: refused, {problem}; kept at memplan's arithmetic"
                continue
            tried.append((_rms(_leave_one_out_pct(x, y, trial)), term))
        if not tried:
            break
        best_rms, best = min(tried)
        if best_rms >= (1 - MIN_GAIN) * _rms(loo):
            for rms, term in tried:
                refused[term] = (
                    f"{term}: not fitted, it does not lower the held-out error "
                    f"(±{_rms(loo):.3f} % -> ±{rms:.3f} % with it)"
                )
            break
        terms = (*terms, best)
        loo = _leave_one_out_pct(x, y, terms)
    notes = list(refused.values())
    waiting = [t for t in TERMS if t not in terms and t not in refused]
    if waiting:
        more = MIN_RECORDS_PER_TERM * (len(terms) + 1) - n
        notes.append(
            f"{', '.join(waiting)}: not tried, {n} records determine at most {max_terms} term(s) "
            f"({MIN_RECORDS_PER_TERM} per term); {more} more run(s) would let one more be tried: "
            + "; ".join(f"for {t}, runs of {KIND_OF_RUN[t]}" for t in waiting)
        )
    return _Selection(terms=terms, solution=_fit_terms(x, y, terms), held_out_pct=loo, notes=tuple(notes))


def fit_one(observations: list[Observation], terms: tuple[str, ...] | None = None) -> Correction:
    """The correction for one (device, torch version) from its observations: the terms the
    records determine (``_select``; or exactly ``terms``, unchecked), fitted on all of them;
    its band is the leave-one-out error, each record judged by a fit that did not see it."""
    if not observations:
        raise MemplanError("no ok records to fit")
    first = observations[0]
    if terms is None and len(observations) < MIN_RECORDS_PER_TERM:
        raise MemplanError(
            f"{len(observations)} ok record(s) of {first.device} (torch {first.torch_version}): a fit needs at "
            f"least {MIN_RECORDS_PER_TERM} per fitted term; {MIN_RECORDS_PER_TERM - len(observations)} more "
            f"run(s), of {KIND_OF_RUN['activations']} or {KIND_OF_RUN['states']}, would let it fit one"
        )
    x = np.array([[o.estimated.get(g, 0) for g in GROUPS] for o in observations], dtype=float)
    y = np.array([o.measured_bytes for o in observations], dtype=float)
    if terms is None:
        chosen = _select(x, y)
    else:
        chosen = _Selection(terms, _fit_terms(x, y, terms), _leave_one_out_pct(x, y, terms), ())
    values = {t: _value(t, float(d)) for t, d in zip(chosen.terms, chosen.solution)}
    before = _errors_pct(x.sum(axis=1), y)
    context, per_communicator = fit_outside(observations)
    return Correction(
        throughput=fit_throughput(observations),
        device=first.device,
        torch_version=first.torch_version,
        scales={g: values.get(g, 1.0) for g in GROUPS},
        offset_bytes=round(values.get("offset", 0.0)),
        residual_pct=_rms(chosen.held_out_pct),
        num_records=len(y),
        before_median_abs_pct=float(np.median(np.abs(before))),
        after_median_abs_pct=float(np.median(np.abs(chosen.held_out_pct))),
        context_bytes=context,
        communicator_bytes=per_communicator,
        terms=chosen.terms,
        notes=chosen.notes,
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
