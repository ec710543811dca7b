"""Estimates and decisions as data (the JSON contract of docs/design.md), then as a table, CSV, an
explanation or a recommendation's text. Bytes stay integers until a human reads them.

Formatting only: every number printed was computed below (the estimate, ``decide``'s
decisions and its what-ifs in ``decide.whatifs``); no module here estimates, replays or times.

- ``data``: the estimate's JSON and CSV
- ``decisions``: the recommendation's JSON
- ``sentences``: a reason, a rejection, a rule's verdict, a fix, as a sentence
- ``table``, ``notes``: ``memplan estimate``'s table and the lines under it
- ``explain``: every term with its formula
- ``recommendation``: ``memplan recommend``'s text
- ``searches``: ``min-gpus`` and ``recommend --search-layout``
- ``text``: numbers and the header every report shares
"""

from .data import (
    CALIBRATED_FIELDS,
    COMPONENTS,
    calibrated_dict,
    calibration_dict,
    estimate_dict,
    inputs_dict,
    layout_dict,
    render_csv,
    render_json,
    to_dict,
)
from .decisions import recommendation_dict
from .explain import render_explain
from .notes import fits_line, fragmentation_line, native_note, paged_line, stage_lines
from .recommendation import finetune_lines, recommendation_summary, render_recommendation
from .searches import min_gpus_dict, render_layout_pick, render_min_gpus
from .sentences import (
    calibration_text,
    fix_change,
    fix_line,
    reason_text,
    rejected_reason,
    verdict_detail,
    verdict_line,
)
from .table import render_table, simple_table

__all__ = [
    "CALIBRATED_FIELDS",
    "COMPONENTS",
    "calibrated_dict",
    "calibration_dict",
    "calibration_text",
    "estimate_dict",
    "finetune_lines",
    "fits_line",
    "fix_change",
    "fix_line",
    "fragmentation_line",
    "inputs_dict",
    "layout_dict",
    "min_gpus_dict",
    "native_note",
    "paged_line",
    "reason_text",
    "recommendation_dict",
    "recommendation_summary",
    "rejected_reason",
    "render_csv",
    "render_explain",
    "render_json",
    "render_layout_pick",
    "render_min_gpus",
    "render_recommendation",
    "render_table",
    "simple_table",
    "stage_lines",
    "to_dict",
    "verdict_detail",
    "verdict_line",
]
