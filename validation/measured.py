"""The records of a framework's own loop measured against memplan (one JSON object per line, with
``case`` and ``measured_peak_bytes``), and their table."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def load(path: Path) -> list[dict]:
    """The records of ``path`` (none where it does not exist yet)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def table(records: list[dict], estimate: Callable[[dict], int], *, decimals: int) -> str:
    """Each record's measured peak beside ``estimate(record)``, in MiB, and the error in %."""
    lines = ["| case | measured MiB | estimated MiB | error |", "|---|---:|---:|---:|"]
    for record in records:
        measured, est = record["measured_peak_bytes"], estimate(record)
        error = 100 * (est - measured) / measured
        lines.append(f"| {record['case']} | {measured / 2**20:.2f} | {est / 2**20:.2f} | {error:+.{decimals}f} % |")
    return "\n".join(lines)
