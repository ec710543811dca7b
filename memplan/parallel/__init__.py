"""Parallelism beyond data parallel (issue 14): tensor + sequence, pipeline and context
parallel, as adapters of the data-parallel memory model (``memory.Step``) to one rank of the
device mesh. ``estimate_layout`` is what ``memory.estimate`` returns for a job with a layout."""

from __future__ import annotations

from .step import LayoutEstimate, estimate_layout

__all__ = ["LayoutEstimate", "estimate_layout"]
