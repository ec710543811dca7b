"""Corrections fitted from calibration records (by ``calibrate.fit``), and estimates with
them applied.

A record pairs memplan's estimate of a job (bytes by component at the peak moment) with
what the job really allocated. Per device and torch version, a robust fit (least absolute
deviations, by iteratively reweighted least squares) finds a scale for each group of
components and a constant offset,

    measured ≈ offset + Σ scale_g · estimated_g,      g ∈ states, activations, buffers,

in relative terms (each record weighted by 1/measured, so small and large runs count
alike) and shrunk towards scale 1 (a ridge on scale − 1). Only the terms the records
determine, within their physical ranges and lowering the held-out error, are fitted
(``calibrate.fit``); the others keep memplan's own arithmetic. The band of a corrected
estimate is the fit's leave-one-out error: each record judged by a fit made without it.
A corrections file applies only to the device and torch major version it was fitted on,
unless forced (``resolve``).

Where records carry the device's used memory and the allocator's reserved bytes (CUDA),
what lies outside the caching allocator (used − reserved: the CUDA context and the
communicators' buffers) is fitted as context + communicators × per-communicator bytes, the
communicators being those memplan charges the job (``overheads.communicators``); where
every record has the same number, only the context is fitted and a communicator keeps
its tabled size. The caching allocator itself (reserved − allocated) is not fitted: a
corrected estimate keeps the estimate's own allocator term (the replay, or the searches'
flat slack), so a calibration never absorbs fragmentation into a constant.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import catalog
from .breakdown import Component, Estimate, Fit
from .errors import InputError
from .overheads import allocator_bytes, communicator_bytes, communicators

GROUPS = {
    "states": (Component.PARAMS, Component.GRADIENTS, Component.OPTIMIZER),
    "activations": (Component.ACTIVATIONS,),
    "buffers": (Component.BUFFERS,),
}


@dataclass(frozen=True)
class Observation:
    """One ok record reduced to what the fit needs."""

    device: str
    torch_version: str
    estimated: dict[str, int]
    """Bytes by group at the estimate's peak moment."""
    measured_bytes: int
    outside_bytes: int | None = None
    """Device used minus the allocator's reserved bytes, where the record has both (CUDA):
    the CUDA context and the communicators' buffers."""
    communicators: int = 0
    """The NCCL communicators memplan charges the measured job."""
    strategy: str = ""
    step_time_s: float | None = None
    flops_per_step: float | None = None
    """The throughput model's training FLOPs of the measured step on this GPU."""
    peak_flops: float | None = None
    """The device's datasheet peak for the precision; None for a CPU or an unknown device."""
    comm_s: float | None = None
    """The throughput model's collective seconds, for runs whose collectives were real
    (local or cluster, more than one rank, a known device)."""


@dataclass(frozen=True)
class ThroughputFit:
    """Measured speed of one strategy on one device."""

    strategy: str
    num_records: int
    achieved_flops: float
    """Model FLOPs per second of step time: step_time ≈ flops / achieved (least squares)."""
    mfu: float | None
    """achieved over the datasheet peak, where the device is in tables/gpus.csv."""
    exposed_comm_fraction: float | None
    """Share of the modelled collective time that the steps did not hide, from runs with real
    collectives: step_time ≈ flops / achieved + fraction · comm."""


@dataclass(frozen=True)
class Correction:
    device: str
    torch_version: str
    scales: dict[str, float]
    offset_bytes: int
    residual_pct: float
    """The error band, in percent: the root mean square of the relative errors of each record
    under a fit made without it (leave-one-out), never of the records a fit was made on."""
    num_records: int
    before_median_abs_pct: float
    after_median_abs_pct: float
    """Median |error| of the records, each under the leave-one-out fit that did not see it."""
    context_bytes: int | None = None
    """The fitted CUDA context (None: no record had the device's used memory)."""
    communicator_bytes: int | None = None
    """The fitted buffers of one communicator (None: the tabled default)."""
    throughput: tuple[ThroughputFit, ...] = ()
    terms: tuple[str, ...] | None = None
    """The free parameters fitted (offset, states, activations, buffers); the others keep
    memplan's arithmetic. None: a file from before the fit chose its terms (all four)."""
    notes: tuple[str, ...] = ()
    """Why each term not fitted was not: undetermined, unphysical, no gain, too few records."""

    def corrected_bytes(self, by_group: dict[str, int]) -> int:
        return round(self.offset_bytes + sum(self.scales[g] * by_group.get(g, 0) for g in GROUPS))

    def outside_bytes(self, job) -> int | None:
        """What lies outside the caching allocator for ``job`` (context + communicators), as
        fitted; None where nothing was."""
        if self.context_bytes is None or job.train.device == "cpu":
            return None
        per = communicator_bytes() if self.communicator_bytes is None else self.communicator_bytes
        return self.context_bytes + communicators(job) * per

    def speed(self, strategy: str) -> ThroughputFit | None:
        """The strategy's measured speed; for a strategy that was not measured, the record-weighted
        mean of the others' compute speed (its communication stays modelled), so that measured and
        unmeasured strategies are ranked on the same device's compute."""
        fits = {t.strategy: t for t in self.throughput}
        if strategy in fits or not fits:
            return fits.get(strategy)
        n = sum(t.num_records for t in fits.values())
        with_mfu = [(t.mfu, t.num_records) for t in fits.values() if t.mfu is not None]
        mfu = (
            sum(m * records for m, records in with_mfu) / sum(records for _, records in with_mfu) if with_mfu else None
        )
        return ThroughputFit(
            strategy="mean of the measured strategies",
            num_records=n,
            achieved_flops=sum(t.achieved_flops * t.num_records for t in fits.values()) / n,
            mfu=mfu,
            exposed_comm_fraction=None,
        )


def group_bytes(by_component: dict) -> dict[str, int]:
    by = {Component(k): v for k, v in by_component.items()}
    return {g: sum(by.get(c, 0) for c in comps) for g, comps in GROUPS.items()}


def same_device(measured_name: str, device: str) -> bool:
    """``NVIDIA H100 80GB HBM3`` is an ``h100-sxm``: the catalogue name's first part (the chip)
    appears in the name torch reports."""
    name, chip = measured_name.lower().replace(" ", ""), device.lower().split("-")[0]
    return name == device.lower() or (chip != "cpu" and chip in name)


@dataclass(frozen=True)
class Calibration:
    """A corrections file: what was fitted, from what."""

    corrections: tuple[Correction, ...]
    sources: tuple[str, ...] = field(default=())
    path: str = ""

    def for_device(self, device: str, torch_version: str | None = None) -> tuple[Correction | None, str]:
        """The correction measured on ``device`` (``cpu``, a tables/gpus.csv name such as
        ``h100-sxm``, or a measured device name) with ``torch_version``'s major version (when
        known; the same version if there is one), or None and why none applies."""
        same = [c for c in self.corrections if same_device(c.device, device)]
        if not same:
            fitted = ", ".join(sorted({c.device for c in self.corrections})) or "nothing"
            target = "a GPU this estimate does not name (--gpu NAME)" if device == "cuda" else device
            return None, f"it was fitted on {fitted}, not on {target}"
        if torch_version is None:
            return same[0], ""
        major = [c for c in same if _major(c.torch_version) == _major(torch_version)]
        if not major:
            fitted = ", ".join(sorted({c.torch_version for c in same}))
            here = f"torch {_major(torch_version)}.x ({torch_version} is installed here)"
            return None, f"it was fitted with torch {fitted}, not {here}"
        exact = [c for c in major if c.torch_version == torch_version]
        return (exact or major)[0], ""

    def save(self, path: str | Path) -> None:
        data = {"sources": list(self.sources), "corrections": [asdict(c) for c in self.corrections]}
        Path(path).write_text(json.dumps(data, indent=2) + "\n")


def _major(version: str) -> str:
    return version.split(".")[0]


def installed_torch() -> str | None:
    """The torch installed beside memplan, read from its metadata (memplan never imports torch):
    the torch a calibration's major version is checked against; None where there is none."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


# fitted before the allocator was replayed: used − allocated as a + b · allocated, which
# folded the allocator into the fit; such a file's scales still apply, these do not
_LEGACY_KEYS = ("overhead_base_bytes", "overhead_per_allocated")


def load(path: str | Path) -> Calibration:
    try:
        data = json.loads(Path(path).read_text())
        corrections = tuple(
            Correction(
                **{k: v for k, v in c.items() if k not in (*_LEGACY_KEYS, "throughput", "terms", "notes")},
                throughput=tuple(ThroughputFit(**t) for t in c.get("throughput", ())),
                terms=None if c.get("terms") is None else tuple(c["terms"]),
                notes=tuple(c.get("notes", ())),
            )
            for c in data["corrections"]
        )
    except FileNotFoundError:
        raise InputError(
            lambda n: f"{n('calibration')} {str(path)!r}: no such file",
            field="calibration",
            value=str(path),
            accepted="auto, none or a corrections file",
        ) from None
    except (ValueError, KeyError, TypeError) as exc:
        detail = str(exc)  # exc is unbound after the except block; the message is rendered later
        raise InputError(
            lambda n: (
                f"{n('calibration')} {str(path)!r} is not a corrections file written by "
                f"`memplan calibrate fit` ({detail})"
            ),
            field="calibration",
            value=str(path),
            accepted="auto, none or a corrections file",
        ) from None
    return Calibration(corrections=corrections, sources=tuple(data.get("sources", ())), path=str(path))


@dataclass(frozen=True)
class Corrected(Fit):
    """An estimate with a calibration applied: the peak over the same moments, corrected."""

    estimate: Estimate
    correction: Correction
    device_matches: bool
    allocated_bytes: int
    band_bytes: int
    """One residual standard deviation of the fit, in bytes of this estimate."""
    overhead_bytes: int
    phase: str
    moment_bytes: tuple[int, ...] = ()
    """The corrected allocated bytes of each of the estimate's moments."""

    @property
    def total_bytes(self) -> int:
        return self.allocated_bytes + self.overhead_bytes

    @property
    def usable_bytes(self) -> int:
        return self.estimate.usable_bytes

    @property
    def moment_headrooms(self) -> tuple[int, ...]:
        room = self.estimate.job.cluster.usable_bytes - self.overhead_bytes
        return tuple(room - b for b in self.moment_bytes)


def apply(est: Estimate, correction: Correction, *, device_matches: bool) -> Corrected:
    peaks = [(correction.corrected_bytes(group_bytes(m.by_component)), m.phase) for m in est.moments]
    allocated, phase = max(peaks, key=lambda p: p[0])
    outside = correction.outside_bytes(est.job)
    overhead = est.overhead_bytes
    if outside is not None:
        # the allocator's term is the estimate's own (replayed or flat), never fitted
        overhead = allocator_bytes(est) + outside
    return Corrected(
        estimate=est,
        correction=correction,
        device_matches=device_matches,
        allocated_bytes=allocated,
        band_bytes=math.ceil(allocated * correction.residual_pct / 100),
        overhead_bytes=overhead,
        phase=phase,
        moment_bytes=tuple(b for b, _ in peaks),
    )


SHIPPED_DIR = "calibration"


def shipped(device_key: str) -> Calibration | None:
    """The corrections shipped in tables/calibration/ for a device (``cpu`` or a tables/gpus.csv
    name), fitted from the record sets beside them; None where none were measured."""
    # catalog.TABLES_DIR read at call time (a test points it at its own tables)
    paths = sorted((catalog.TABLES_DIR / SHIPPED_DIR).glob(f"{device_key}-*.corrections.json"))
    return load(paths[-1]) if paths else None


@dataclass(frozen=True)
class Applied:
    """A calibration applied to a set of estimates (one per strategy)."""

    calibration: Calibration
    correction: Correction
    device_matches: bool
    results: tuple[Corrected, ...]

    def describe(self) -> str:
        fit = fit_text(self.calibration, self.correction, self.device_matches)
        return f"calibration {self.calibration.path}: {fit}"


def fit_text(calibration: Calibration, c: Correction, device_matches: bool) -> str:
    """Which fit applies, from which records, with which band (and that it was forced)."""
    if c.terms is None:
        terms = "all four terms (fitted before terms were chosen)"
    else:
        terms = f"{len(c.terms)} term(s): {', '.join(c.terms)}" if c.terms else "no term (the band alone)"
    sources = f" of {', '.join(calibration.sources)}" if calibration.sources else ""
    forced = "" if device_matches else "; applied by force where it was not measured"
    return (
        f"fitted on {c.device}, torch {c.torch_version}, {terms} from {c.num_records} records{sources}, "
        f"band ±{c.residual_pct:.2f} % (leave-one-out){forced}"
    )


def _device_key(job) -> str | None:
    if job.cluster.gpu_name != "custom":
        return job.cluster.gpu_name
    return "cpu" if job.train.device == "cpu" else None


FORCE = "force:"
"""Prefix of ``--calibration force:FILE``: apply FILE even where it was not measured."""


def resolve(job, calibration: str | None = "auto") -> tuple[Calibration, Correction, bool] | None:
    """The calibration file, the correction in it for ``job``'s device, and whether it was
    measured there; None where none applies. ``auto``: the corrections shipped for the job's
    device (``--gpu NAME``, or cpu), if any; ``none``: nothing; otherwise a corrections file
    written by ``memplan calibrate fit``, applied only to the device and torch major version
    (the torch installed here, when there is one) it was fitted on: anything else is refused,
    unless named ``force:FILE``."""
    if calibration in (None, "none"):
        return None
    if calibration == "auto":
        key = _device_key(job)
        loaded = shipped(key) if key else None
        if key is None or loaded is None:
            return None
        correction, _ = loaded.for_device(key, installed_torch())
        return None if correction is None else (loaded, correction, True)
    forced = calibration.startswith(FORCE)
    path = calibration[len(FORCE) :] if forced else calibration
    loaded = load(path)
    correction, why_not = loaded.for_device(_device_key(job) or job.train.device, installed_torch())
    if correction is not None:
        return loaded, correction, True
    if not forced or not loaded.corrections:
        raise InputError(
            lambda n: (
                f"{n('calibration')} {path!r} does not apply here: {why_not}; a fit applies only where it "
                f"was measured ({n('calibration')} {FORCE}{path} applies it anyway)"
            ),
            field="calibration",
            value=calibration,
            accepted="auto, none, a corrections file fitted on this device and torch, or force:FILE",
        )
    return loaded, loaded.corrections[0], False


def apply_all(estimates: list[Estimate], calibration: str | None = "auto") -> Applied | None:
    """``estimates`` (of one job under several strategies) with ``resolve``'s correction applied."""
    found = resolve(estimates[0].job, calibration) if estimates else None
    if found is None:
        return None
    loaded, correction, same = found
    return Applied(
        calibration=loaded,
        correction=correction,
        device_matches=same,
        results=tuple(apply(e, correction, device_matches=same) for e in estimates),
    )
