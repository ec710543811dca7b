"""The searches' answers: ``memplan min-gpus`` (table and JSON) and ``recommend --search-layout``."""

from __future__ import annotations

import json

from ..inputs import ModelChoice
from .data import estimate_dict, inputs_dict
from .text import header, num_gib


def render_min_gpus(choice: ModelChoice, result) -> str:
    final = result.corrected or result.estimate
    job = result.estimate.job
    calibrated = f"; calibrated: {result.corrected.correction.device}" if result.corrected else ""
    lines = [
        header(choice, job),
        "",
        f"Fewest GPUs: {result.gpus} with {result.strategy} ({num_gib(final.total_bytes)} of "
        f"{num_gib(job.cluster.usable_bytes)} GiB usable, peak in {final.phase}{calibrated})",
        "",
        "By strategy:",
    ]
    lines += [
        f"  {s:<20} {n if n is not None else 'nothing fits up to the limit'}" for s, n in result.by_strategy.items()
    ]
    return "\n".join(lines)


def min_gpus_dict(choice: ModelChoice, result) -> dict:
    return {
        "inputs": inputs_dict(choice, result.estimate),
        "gpus": result.gpus,
        "strategy": result.strategy,
        "estimate": estimate_dict(result.estimate),
        "by_strategy": result.by_strategy,
        "calibrated_total_bytes": result.corrected.total_bytes if result.corrected else None,
    }


def render_layout_pick(choice: ModelChoice, pick, launch: str | None, fmt: str) -> str:
    """``recommend --search-layout``: the layout picked, its worst stage, and why (``launch``: the
    JSON document's field; as text, the launch configuration is a file of its own)."""
    best = pick.best
    if fmt == "json":
        body = {
            "layout": None if best is None else estimate_dict(best.estimate),
            "tokens_per_s_per_gpu": None if best is None else best.step.tokens_per_s,
            "step_s": None if best is None else best.step.step_s,
            "searched": pick.searched,
            "reasons": pick.reasons(),
            "launch": launch,
        }
        return json.dumps(body, indent=2)
    lines = [header(choice, (best or pick.data_parallel).job), ""]
    if best is None:
        lines.append("Nothing fits among the layouts searched.")
    else:
        est = best.estimate
        lines.append(f"Recommended layout: {best.describe()}")
        lines.append(
            f"  {num_gib(est.total_bytes)} GiB per GPU on the worst rank ({num_gib(est.usable_bytes)} usable), "
            f"{best.step.tokens_per_s:,.0f} tokens/s per GPU predicted, step {best.step.step_s:.3f} s"
        )
    lines += ["Why:", *(f"  - {r}" for r in pick.reasons())]
    return "\n".join(lines)
