"""``memplan recommend``'s text: the pick, its reasons, the fine-tune modes compared, the
fixes, the documented rules' verdicts and every rejected option (and the summary ``estimate``
prints under its table)."""

from __future__ import annotations

from ..decide import Recommendation
from ..decide.whatifs import ModeOutcome
from ..inputs import ModelChoice
from .sentences import fix_line, reason_text, rejected_reason, verdict_line
from .text import gib_text, header, num_gib


def recommendation_summary(rec: Recommendation) -> list[str]:
    """A few lines: the pick, why, and how many documented rules the arithmetic contradicts."""
    contradicted = [r.id for r, agrees in rec.agreement if not agrees]
    rules = (
        f"Documented rules: {len(rec.agreement) - len(contradicted)} agree, {len(contradicted)} contradicted by "
        f"the arithmetic ({', '.join(contradicted)}); `memplan recommend` shows why."
        if rec.agreement
        else "No documented rule matches these inputs."
    )
    if rec.best is None:
        fix = next((f for f in rec.fixes if f.fits), None)
        return ["Recommendation: nothing fits.", *([f"Smallest change: {fix_line(fix)}"] if fix else []), rules]
    st = rec.best.step
    return [
        f"Recommendation ({rec.priority}): {rec.best.label()}",
        f"  {num_gib(rec.best.total_bytes)} GiB per GPU, {st.tokens_per_s:,.0f} tokens/s per GPU predicted "
        f"({rec.best.relative_throughput:.2f}× DDP), step {st.step_s:.3f} s"
        + (
            f"; throughput as on {rec.link.gpu_name} (no --gpu given)"
            if rec.link.assumed_gpu and not rec.basis.measured_compute
            else ""
        )
        + ("; calibrated" if rec.basis.correction else ""),
        rules,
    ]


def finetune_lines(modes: tuple[ModeOutcome, ...]) -> list[str]:
    """The same option under each fine-tune mode (``Recommendation.finetune_modes``; none: no lines)."""
    if not modes:
        return []
    full_s = modes[0].step_s
    lines = ["", "Fine-tune modes at this option (memory; predicted step time, relative to full's):"]
    for m in modes:
        verdict = "fits" if m.fits else f"over by {gib_text(-m.headroom_bytes)}"
        speed = f"step {m.step_s:.2f} s ({full_s / m.step_s:.2f}× full's speed)"
        memory = f"{gib_text(m.total_bytes)} of {gib_text(m.usable_bytes)} usable"
        lines.append(f"  - {m.mode}: {memory}, {verdict}; {speed}")
    fitting = [(m.step_s, m.mode) for m in modes if m.fits]
    if fitting:
        lines.append(
            f"  Fastest mode that fits: {min(fitting)[1]} (full trains every weight; lora and qlora train "
            "adapters only, qlora on 4-bit weights: the choice is also one of quality)"
        )
    else:
        lines.append("  No mode fits at this option.")
    return lines


def render_recommendation(choice: ModelChoice, rec: Recommendation, restricted_by: str | None = None) -> str:
    """Everything: the pick and its reasons, every rejected option, every matching rule, fixes (the
    launch configuration is a file of its own: ``cli._deliver``)."""
    job = (rec.best or rec.options[0]).job
    searched = () if "ac" in rec.fixed_axes else ("ac",)  # the loop setting recommend searches
    lines = [header(choice, job, searched), "", *recommendation_summary(rec)[:2], "", "Reasons:"]
    lines += [f"  - {reason_text(r, restricted_by)}" for r in rec.reasons]
    lines += finetune_lines(rec.finetune_modes)
    if rec.fixes:
        lines += ["", "Nothing fits. Single changes, each with its resulting memory:"]
        lines += [f"  - {fix_line(f)}" for f in rec.fixes]
    lines += ["", f"Documented rules matching these inputs ({len(rec.rules)}):"]
    lines += [f"  - {verdict_line(v)}" for v in rec.rules] or ["  (none)"]
    lines += ["", f"Rejected options ({len(rec.rejected)}):"]
    lines += [f"  - {r.option.label()}: {rejected_reason(r)}" for r in rec.rejected]
    return "\n".join(lines)
