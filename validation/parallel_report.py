"""validation/records/parallel_matrix_cpu.md: each recorded parallel case, measured against today's estimate
on the worst rank (torch-free: the records and memplan only)."""

from __future__ import annotations

import json
from pathlib import Path

from memplan.memory import estimate

from .parallel_cases import job_of

MIB = 2**20


def rows(path: Path) -> list[dict]:
    """One row per record: the worst rank measured and estimated, and the error."""
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        est = estimate(job_of(rec))
        measured, predicted = rec["measured_bytes"], est.allocated_bytes
        out.append(
            {
                "case": rec["case"],
                "layout": job_of(rec).layout.describe(),
                "strategy": rec["strategy"],
                "gpus": rec["gpus"],
                "measured_mib": measured / MIB,
                "measured_stage": rec["worst_pp_rank"],
                "estimated_mib": predicted / MIB,
                "estimated_stage": getattr(est, "worst_stage", 0),
                "error_pct": 100 * (predicted - measured) / measured,
            }
        )
    return out


FIRST_TABLES = (
    (
        ".first.md",
        "The first table, measured before any model change, is `{}` (the model as it was then, on the same records).",
    ),
    (
        ".cp-first.md",
        "The context-parallel cases' first table, measured before the CP model changed, is `{}`; "
        "cp4-fsdp-s1024-b1 and cp2-fsdp-v512 were measured after that change, held out from it.",
    ),
    (
        ".ppfsdp-first.md",
        "FSDP2 under pipelining's first table, measured before its model changed, is `{}`; "
        "dp2-pp2-fsdp-m8 and dp2-pp2-int-v2-fsdp-m4 were measured then, held out from that change.",
    ),
    (
        ".units-first.md",
        "torchtitan's FSDP2 units under TP and PP (the `-units` cases) were measured before their model "
        "changed (issue 28: a rank's units taken from the whole model's V·h, the root's remainder "
        "negative); `{}` is the model as it was then, on the same records.",
    ),
)
"""The first tables kept beside the report (suffix of its path), each said where it stands."""


def write_report(path: Path) -> None:
    table = rows(path)
    lines = [
        "# Parallel matrix on CPU (gloo), worst rank",
        "",
        "Measured: peak live bytes (MemTracker) of each rank over the last of three steps, fp32, "
        "AdamW; `python -m validation.parallel_matrix`. Estimated: `memplan.memory.estimate` of the same Job "
        "today (`python -m validation.parallel_matrix --report`). Stage: the pipeline rank at the peak.",
        "",
        "| case | layout | dp strategy | ranks | measured MiB | stage | estimated MiB | stage | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        lines.append(
            f"| {r['case']} | {r['layout']} | {r['strategy']} | {r['gpus']} | {r['measured_mib']:.2f} | "
            f"{r['measured_stage']} | {r['estimated_mib']:.2f} | {r['estimated_stage']} | {r['error_pct']:+.1f} % |"
        )
    worst = max(abs(r["error_pct"]) for r in table)
    within = sum(abs(r["error_pct"]) <= 2 for r in table)
    lines += ["", f"{len(table)} cases, {within} within 2 %; largest error {worst:.1f} %."]
    for suffix, sentence in FIRST_TABLES:
        first = path.with_suffix(suffix)
        if first.exists():
            lines += ["", sentence.format(first.name)]
    lines += [
        "",
        "tp2-sp-d64x8, cp2-fsdp-d64x8 (8 heads of 64 over hidden 256: `ModelSpec.head_dim`) and cp2-fsdp-kv2 "
        "(its twin, heads of hidden / heads) were measured after the head-dim model, held out from it "
        "(validation/records/headdim_matrix_cpu.md).",
    ]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
