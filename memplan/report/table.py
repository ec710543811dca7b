"""``memplan estimate``'s table: one row per strategy, GiB per component at the peak, and the
lines under it."""

from __future__ import annotations

from ..breakdown import Component, Estimate
from ..calibration import Applied, Corrected
from ..decide import Recommendation
from ..decide.whatifs import EstimateWhatIfs
from ..inputs import ModelChoice
from ..overheads import reserved_bytes
from .data import COMPONENTS
from .notes import fits_line, fragmentation_line, native_note, paged_line, stage_lines
from .recommendation import recommendation_summary
from .text import claim_text, header, num_gib


def render_table(
    choice: ModelChoice,
    estimates: list[Estimate],
    applied: Applied | None = None,
    relative: list[float] | None = None,
    rec: Recommendation | None = None,
    *,
    whatifs: EstimateWhatIfs,
) -> str:
    """One row per strategy; with a calibration, the corrected total decides what fits (its band
    shown beside it). ``whatifs``: the estimates' (``decide.whatifs.estimate_whatifs``)."""
    job = estimates[0].job
    top = [header(choice, job)] + ([applied.describe()] if applied else [])
    finals: list[Estimate] | list[Corrected] = list(applied.results) if applied else estimates
    rows = []
    for i, (est, final) in enumerate(zip(estimates, finals)):
        by = est.by_component
        row = [
            est.job.plan.strategy + ("" if est.job.plan.offload == "none" else f" +{est.job.plan.offload}"),
            est.phase,
            *(num_gib(by[c]) for c in Component),
            num_gib(est.allocated_bytes),
            num_gib(reserved_bytes(est)),
            num_gib(est.overhead_bytes),
            num_gib(est.total_bytes),
        ]
        if applied:
            corrected = applied.results[i]
            row.append(f"{num_gib(corrected.total_bytes)} ± {num_gib(corrected.band_bytes)}")
        rows.append(row + ["yes" if final.fits else "NO", num_gib(final.headroom_bytes)])
    headers = ["strategy", "peak in", *COMPONENTS, "allocated", "reserved", "overhead", "total"]
    headers += ["calibrated total"] if applied else []
    headers += ["fits", "headroom"]
    if relative:
        rows = [row + [f"{r:.2f}"] for row, r in zip(rows, relative)]
        headers += ["vs DDP"]
    if rec:
        rows = [
            row + [", ".join(claim_text(r) for r in rec.documented_penalties(e.job)) or "-"]
            for row, e in zip(rows, estimates)
        ]
        headers += ["documented"]
    table = simple_table(rows, headers)
    lines = top + [
        "",
        "GiB per GPU at the peak moment of a steady-state step"
        + ("; vs DDP: predicted tokens/s relative to DDP at the same settings" if relative else "")
        + ("; documented: the seeds' claim (tables/rules.csv)" if rec else ""),
        table,
        "",
        fits_line(estimates, finals),
        *native_note(whatifs.not_native, job.train.precision),
        *paged_line(whatifs.paged),
        *fragmentation_line(whatifs.fragmentation, several=len(estimates) > 1),
        *stage_lines(estimates),
    ]
    if rec:
        lines += ["", *recommendation_summary(rec)]
    return "\n".join(lines)


def simple_table(rows: list[list[str]], headers: list[str]) -> str:
    """``tabulate(rows, headers, tablefmt="simple", disable_numparse=True)``, character for
    character (tests/test_columns.py compares them), without its import (13 ms of the main
    job's start, most of it wcwidth's): cells stripped and left-aligned, each column as wide
    as its widest cell and at least its header + 2, columns two spaces apart, a dashed line
    under the headers, trailing spaces dropped. Widths are ``len``: the table's cells are
    strategy names, numbers and the seeds' claims, none of them wide characters."""
    columns = [[cell.strip() for cell in column] for column in zip(*rows)]
    widths = [max(len(h) + 2, *map(len, column)) for h, column in zip(headers, columns)]

    def line(cells) -> str:
        return "  ".join(cell.ljust(w) for cell, w in zip(cells, widths)).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *map(line, zip(*columns))])
