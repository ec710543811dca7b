"""A grid of configurations at numpy speed, identical to the scalar estimate.

Within a group that shares everything but micro-batch b and sequence length s, every byte
count of every moment is c0 + c1·s + c2·b·s + c3·b·s² (states and buffers are constant,
activations scale with the b·s tokens, eager attention with b·s², rotary tables with s),
so four scalar estimates fix each moment's integer coefficients and numpy evaluates the
rest. Across GPU counts only c0 moves (states and gathered buffers are divided among the
GPUs; activations are each GPU's own), so a family of groups that differs only in GPU count
takes its c1..c3 from its first group and each further group's c0 from one estimate. The
bases are checked, not assumed: the first group is re-estimated at a fifth point, the
family's last group at that point too (else each group is solved on its own), and a test
compares random grids with the scalar path byte for byte.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from functools import lru_cache

import numpy as np

from .api import MODEL_INPUTS, check_keywords, takes_inputs
from .errors import MemplanError
from .inputs import build_jobs
from .memory import estimate
from .overheads import allocator_bytes, fixed_terms
from .specs import Job
from .totals import final

_POINTS = ((1, 1), (1, 2), (2, 1), (2, 2))  # (b, s): a unique solve for the four coefficients
_CHECK = (3, 5)


def _basis(b, s):
    return np.stack([np.ones_like(s), s, b * s, b * s * s], axis=-1).astype(np.float64)


@lru_cache(maxsize=8192)
def _moments(job: Job, b: int, s: int) -> tuple:
    """The moments of ``job`` at micro-batch b and sequence s (cached: no job copy when asked again)."""
    return estimate(job.with_(micro_batch=b, seq_len=s)).moments


def _moment_bytes(job: Job, b: int, s: int) -> list[int]:
    return [m.allocated_bytes for m in _moments(job, b, s)]


def _coefficients(job: Job) -> np.ndarray:
    """Integer coefficients (moments × 4) of the group of ``job``."""
    values = np.array([_moment_bytes(job, b, s) for b, s in _POINTS], dtype=np.float64)
    basis = _basis(np.array([p[0] for p in _POINTS]), np.array([p[1] for p in _POINTS]))
    coef = np.rint(np.linalg.solve(basis, values)).T  # moments × 4
    check = _moment_bytes(job, *_CHECK)
    predicted = np.rint(coef @ _basis(np.array(_CHECK[0]), np.array(_CHECK[1])))
    if list(predicted.astype(np.int64)) != check:
        raise MemplanError(
            f"the sweep's polynomial basis does not hold for {job.plan.strategy} "
            f"{job.train.precision}: use the scalar estimate"
        )
    return coef.astype(np.int64)


def _listify(value) -> list:
    return list(value) if isinstance(value, (list, tuple, range, np.ndarray)) else [value]


def _family_coefficients(jobs: list[Job]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Coefficients (moments × 4) and moment phases of each job of a family that differs only
    in GPU count."""
    base = [_moments(job, 1, 1) for job in jobs]
    phases = [np.array([m.phase for m in moments]) for moments in base]  # the same at every (b, s)
    first = _coefficients(jobs[0])
    tokens = first[:, 1:]  # c1..c3: the same on every GPU count
    out = [first] + [
        np.column_stack([np.array([m.allocated_bytes for m in moments]) - tokens.sum(axis=1), tokens])
        for moments in base[1:]
    ]
    check = _basis(np.array(_CHECK[0]), np.array(_CHECK[1])).astype(np.int64) @ out[-1].T
    if list(check) != _moment_bytes(jobs[-1], *_CHECK):
        out = [_coefficients(job) for job in jobs]
    return list(zip(out, phases))


def _excess(job: Job, b: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The caching allocator's replayed excess of each configuration (``totals.final``'s, one
    replay per configuration; none on CPU)."""
    if job.train.device == "cpu":
        return np.zeros(len(b), dtype=np.int64)
    return np.array(_group_excess(job, tuple(zip(b.tolist(), s.tolist()))), dtype=np.int64)


_REPLAYED: dict[tuple[Job, tuple[tuple[int, int], ...]], tuple[int, ...]] = {}
"""Each group's excess at its points, as ``_group_excess`` found it: a sweep asked again costs
one look-up per group, not a job copy per configuration."""

PARALLEL_FROM = 64
"""Replays a sweep needs before it spreads them over worker processes (fewer: starting the
workers costs more than it saves)."""


def _group_excess(job: Job, points: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """``_excess`` of one group's (micro-batch, sequence) points."""
    found = _REPLAYED.get((job, points))
    if found is None:
        found = _REPLAYED[(job, points)] = _replay_group(job, points)
    return found


def _replay_group(job: Job, points: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    return tuple(allocator_bytes(final(job.with_(micro_batch=b, seq_len=s))) for b, s in points)


def default_processes() -> int:
    """The CPUs this process may run on where workers can be forked (Linux), else 1: a spawned
    worker re-runs the caller's script, which a notebook or an unguarded script cannot take."""
    if "fork" not in multiprocessing.get_all_start_methods() or not hasattr(os, "sched_getaffinity"):
        return 1
    return len(os.sched_getaffinity(0))


def _replay_ahead(jobs: list[Job], points: tuple[tuple[int, int], ...], processes: int) -> None:
    """The groups' replays, one per configuration and independent of one another, spread over
    ``processes`` forked workers where at least ``PARALLEL_FROM`` are needed; each group's
    result lands in ``_REPLAYED``. The first group runs here first, so that every module the
    replays use is imported before the fork (a worker then imports nothing)."""
    todo = [job for job in dict.fromkeys(jobs) if job.train.device != "cpu" and (job, points) not in _REPLAYED]
    if processes <= 1 or len(todo) * len(points) < PARALLEL_FROM:
        return
    _group_excess(todo[0], points)
    rest = todo[1:]
    chunk = max(1, len(rest) // (4 * processes))
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("fork")) as pool:
        for job, found in zip(rest, pool.map(_replay_group, rest, [points] * len(rest), chunksize=chunk)):
            _REPLAYED[(job, points)] = found


def _group_rows(job: Job, coef: np.ndarray, phases: np.ndarray, basis: np.ndarray) -> dict[str, np.ndarray]:
    """The columns of one group from its coefficients; ``basis``: configurations × 4 (b, s in
    its second and third columns: s and b·s)."""
    per_moment = basis @ coef.T  # configurations × moments, exact integers
    peak = per_moment.argmax(axis=1)  # the first largest, as max() picks in the scalar path
    allocated = per_moment[np.arange(len(basis)), peak]
    fixed = sum(t.bytes for t in fixed_terms(job))
    s = basis[:, 1]
    excess = _excess(job, basis[:, 2] // s, s)
    overhead = fixed + excess
    total = allocated + overhead
    headroom = job.cluster.usable_bytes - total
    return {
        "allocated_bytes": allocated,
        "reserved_bytes": allocated + excess,
        "overhead_bytes": overhead,
        "total_bytes": total,
        "headroom_bytes": headroom,
        "fits": headroom >= 0,
        "phase": phases[peak],
    }


def _jobs(key: str, source, gpus, precision, ac, fixed: tuple) -> tuple:
    """``build_jobs`` of one point of the grid's outer product, cached where its inputs hash (a
    sweep asked again resolves no model and builds no job)."""
    args = (key, source, gpus, precision, ac, fixed)
    try:
        hash(args)
    except TypeError:  # an unhashable input: built each time
        return _build(*args)
    return _cached_jobs(*args)


def _build(key: str, source, gpus, precision, ac, fixed: tuple) -> tuple:
    choice, jobs = build_jobs(**{key: source}, gpus=gpus, precision=precision, ac=ac, strategy="all", **dict(fixed))
    return choice, tuple(jobs)


_cached_jobs = lru_cache(maxsize=1024)(_build)


@takes_inputs(without=MODEL_INPUTS)
def sweep(
    *,
    params=None,
    model=None,
    gpus=8,
    strategy="all",
    precision="mixed-bf16",
    ac="none",
    micro_batch=1,
    seq_len=2048,
    processes: int | None = None,
    **fixed,
):
    """One row per configuration of the grid (pandas DataFrame).

    Lists are swept, scalars held: ``sweep(params=[7e9, 70e9], gpus=[8, 64], micro_batch=[1, 4],
    seq_len=[2048], gpu_mem=80)``. Any other keyword of ``memplan.estimate`` (gpu, optimizer,
    attention, device, headroom, ...) is held fixed. Each configuration's caching allocator is
    replayed, the replays spread over ``processes`` workers (None: ``default_processes()``; 1:
    none) where a sweep needs many.
    """
    import pandas as pd

    check_keywords(fixed)
    if processes is not None and (type(processes) is not int or processes < 1):
        raise MemplanError(f"processes must be a positive integer (or None: the CPUs), got {processes!r}")
    if (params is None) == (model is None):
        raise MemplanError("sweep needs params=[...] or model=[...] (one of them)")
    sources = (
        [("params", p) for p in _listify(params)] if params is not None else [("model", m) for m in _listify(model)]
    )
    b_grid, s_grid = np.meshgrid(np.array(_listify(micro_batch)), np.array(_listify(seq_len)), indexing="ij")
    b, s = b_grid.ravel().astype(np.int64), s_grid.ravel().astype(np.int64)
    if (b <= 0).any() or (s <= 0).any():
        raise MemplanError("micro_batch and seq_len must be positive integers")
    groups = []  # (labels, job) in the order of the rows
    for (key, source), n, prec, mode in itertools.product(sources, _listify(gpus), _listify(precision), _listify(ac)):
        choice, jobs = _jobs(key, source, n, prec, mode, tuple(sorted(fixed.items())))
        wanted = set(_listify(strategy)) if strategy != "all" else None
        groups += [
            (
                {
                    "model": choice.spec.name,
                    "params": choice.spec.num_params,
                    "gpus": n,
                    "strategy": job.plan.strategy,
                    "precision": prec,
                    "activation_checkpointing": mode,
                },
                job,
            )
            for job in jobs
            if wanted is None or job.plan.strategy in wanted
        ]
    if not groups:
        raise MemplanError(
            f"no strategy in {strategy!r} runs on gpus={gpus!r} with offload "
            f"{fixed.get('offload', 'none')!r}; those that do: {', '.join(j.plan.strategy for j in jobs)}"
        )
    families: dict[tuple, list[Job]] = {}
    for labels, job in groups:
        families.setdefault(
            (
                labels["model"],
                labels["params"],
                labels["strategy"],
                labels["precision"],
                labels["activation_checkpointing"],
            ),
            [],
        ).append(job)
    solved = {id(job): c for family in families.values() for job, c in zip(family, _family_coefficients(family))}
    points = tuple(zip(b.tolist(), s.tolist()))
    _replay_ahead([job for _, job in groups], points, default_processes() if processes is None else processes)
    basis = _basis(b, s).astype(np.int64)
    parts = [_group_rows(job, *solved[id(job)], basis) for _, job in groups]
    columns = {name: np.repeat([labels[name] for labels, _ in groups], len(b)) for name in groups[0][0]}
    columns |= {"micro_batch": np.tile(b, len(groups)), "seq_len": np.tile(s, len(groups))}
    columns |= {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
    return pd.DataFrame(columns)
