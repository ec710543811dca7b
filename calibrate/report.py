"""Measured against estimated, from calibration records (torch-free).

Rows are computed once, then rendered as a table, JSON or CSV. The compared quantity is
peak allocated bytes: ``torch.cuda.max_memory_allocated`` on a GPU, MemTracker's peak of
live tensors on CPU, against memplan's ``allocated`` (the composition at the peak) as
memplan estimates the spec now; the record keeps the estimate made when it ran, which is
used only where today's memplan refuses the spec. A model memplan does not describe (a
record's ``user`` with ``no_estimate``) shows its measured side only.
"""

from __future__ import annotations

import csv
import io
import json
import statistics

from memplan.errors import MemplanError

from .records import STATUSES, describe, estimate_summary, job_from_spec

COLUMNS = (
    "id",
    "run",
    "status",
    "measured_bytes",
    "estimated_bytes",
    "error_pct",
    "measured_phase",
    "estimated_phase",
    "error",
)


def _current_estimate(record: dict, job_of) -> dict:
    if (record.get("user") or {}).get("no_estimate"):
        return {}  # a model memplan does not describe: its spec's model is a stand-in
    try:
        return estimate_summary(job_of(record))
    except MemplanError:
        return record.get("estimate") or {}


def _row(record: dict, job_of) -> dict:
    measurement, est = record.get("measurement") or {}, _current_estimate(record, job_of)
    measured, estimated = measurement.get("peak_allocated_bytes"), est.get("allocated_bytes")
    error_pct = 100.0 * (estimated - measured) / measured if measured and estimated is not None else None
    return {
        "id": record.get("id", ""),
        "status": record["status"],
        "run": describe(record["spec"], record["mode"], record.get("workload", "native"), record.get("user")),
        "measured_bytes": measured,
        "estimated_bytes": estimated,
        "error_pct": error_pct,
        "measured_phase": measurement.get("phase"),
        "estimated_phase": est.get("phase"),
        "error": (record.get("error") or "").split("\n")[0] or None,
    }


def rows(records: list[dict], job_of=lambda record: job_from_spec(record["spec"])) -> list[dict]:
    """One row per record, estimated on ``job_of(record)`` (default: the record's spec)."""
    return [_row(r, job_of) for r in records]


def summary(table: list[dict]) -> dict:
    """Counts by status and the spread of |error| over the ok runs that have both numbers."""
    errors = [abs(r["error_pct"]) for r in table if r["status"] == "ok" and r["error_pct"] is not None]
    counts = {s: sum(r["status"] == s for r in table) for s in STATUSES}
    return {
        "runs": len(table),
        **counts,
        "not_ok": len(table) - counts["ok"],
        "median_abs_error_pct": statistics.median(errors) if errors else None,
        "max_abs_error_pct": max(errors) if errors else None,
        "phase_agreement": sum(r["measured_phase"] == r["estimated_phase"] for r in table if r["status"] == "ok"),
    }


def render_json(table: list[dict]) -> str:
    return json.dumps({"runs": table, "summary": summary(table)}, indent=2)


def render_csv(table: list[dict]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(table)
    return buffer.getvalue()


def _mib(num_bytes) -> str:
    return "" if num_bytes is None else f"{num_bytes / 2**20:.2f}"


def _pct(value) -> str:
    return "" if value is None else f"{value:+.2f}"


def summary_lines(table: list[dict]) -> list[str]:
    s = summary(table)
    counts = ", ".join(f"{s[k]} {k}" for k in STATUSES if s[k])
    lines = [f"{s['runs']} runs: {counts or 'none'}"]
    if s["median_abs_error_pct"] is not None:
        lines.append(
            f"|error| over ok runs: median {s['median_abs_error_pct']:.2f} %, "
            f"max {s['max_abs_error_pct']:.2f} %; peak phase agrees in {s['phase_agreement']} of {s['ok']}"
        )
    return lines


def _short(text, width: int = 80) -> str:
    return "" if not text else text if len(text) <= width else text[: width - 1] + "…"


def render_table(table: list[dict]) -> str:
    from tabulate import tabulate  # here, not at the top: JSON and CSV never pay its import

    body = tabulate(
        [
            [
                r["id"],
                r["run"],
                r["status"],
                _mib(r["measured_bytes"]),
                _mib(r["estimated_bytes"]),
                _pct(r["error_pct"]),
                r["measured_phase"] or "",
                r["estimated_phase"] or "",
                _short(r["error"]),
            ]
            for r in table
        ],
        headers=[
            "id",
            "run",
            "status",
            "measured MiB",
            "estimated MiB",
            "error %",
            "measured phase",
            "estimated phase",
            "error",
        ],
        tablefmt="github",
        disable_numparse=True,
    )
    return "\n".join([body, "", *summary_lines(table)])
