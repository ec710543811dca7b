"""Plain-text tables, every cell left-aligned: the layout of tabulate's ``simple`` format, or
Markdown (``github``), without importing tabulate (a fifth of the main job's start-up)."""
from __future__ import annotations

MIN_PADDING = 2
"""A column is at least this much wider than its header (tabulate's rule, kept so tables read alike)."""


def render_columns(rows: list[list], headers: list[str], *, markdown: bool = False) -> str:
    cells = [[str(c).strip() for c in row] for row in rows]
    widths = [max([len(h) + MIN_PADDING, *(len(row[i]) for row in cells)]) for i, h in enumerate(headers)]

    def line(values) -> str:
        padded = [v.ljust(w) for v, w in zip(values, widths)]
        return "| " + " | ".join(padded) + " |" if markdown else "  ".join(padded).rstrip()

    rule = ("|" + "|".join("-" * (w + 2) for w in widths) + "|") if markdown else "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in cells)])
