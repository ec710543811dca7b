"""``memplan explain``: every term of one estimate with its formula and its bytes."""

from __future__ import annotations

from ..breakdown import Estimate
from ..decide.whatifs import EstimateWhatIfs
from ..inputs import ModelChoice
from ..overheads import reserved_bytes
from .notes import fragmentation_line
from .text import header, num_gib


def render_explain(choice: ModelChoice, est: Estimate, whatifs: EstimateWhatIfs) -> str:
    """Every term of every candidate moment with its formula, so the arithmetic can be checked by
    hand. ``whatifs``: ``est``'s own (``decide.whatifs.estimate_whatifs([est])``)."""
    job = est.job
    lines = [
        header(choice, job),
        f"strategy {job.plan.strategy}, offload {job.plan.offload}",
        "",
        "Symbols: P parameters, b micro-batch, s sequence, h hidden, q query width a·d, kv k/v width, a heads,",
        "d head dim, f ffn width, V vocabulary, c compute bytes, r residual-stream bytes, m dropout-mask bytes.",
        f"Here P={job.model.num_params:,}, b={job.train.micro_batch}, s={job.train.seq_len}, "
        f"h={job.model.hidden}, q={job.model.q_hidden}, kv={job.model.kv_hidden}, a={job.model.num_heads}, "
        f"d={job.model.head_size}, f={job.model.ffn_hidden}, "
        f"V={job.model.vocab_size}.",
    ]
    for moment in est.moments:
        mark = "  <- peak" if moment is est.peak else ""
        lines += ["", f"[{moment.phase}] {moment.label}: {num_gib(moment.allocated_bytes)} GiB{mark}"]
        lines += [
            f"  {t.component.value:<12} {t.name:<48} {t.formula:<40} {t.bytes:>16,} B  {num_gib(t.bytes):>8} GiB"
            for t in moment.terms
        ]
    lines += ["", f"allocated (peak) = {est.allocated_bytes:,} B = {num_gib(est.allocated_bytes)} GiB"]
    reserved = reserved_bytes(est)
    lines += [f"reserved (caching allocator's peak, replayed) = {reserved:,} B = {num_gib(reserved)} GiB"]
    lines += [f"  + {t.name:<44} {t.formula:<28} {t.bytes:>16,} B" for t in est.overhead]
    lines += [
        f"total = {est.total_bytes:,} B = {num_gib(est.total_bytes)} GiB; "
        f"usable {num_gib(job.cluster.usable_bytes)} GiB"
        f" -> {'fits' if est.fits else 'does NOT fit'} (headroom {num_gib(est.headroom_bytes)} GiB)"
    ]
    lines += fragmentation_line(whatifs.fragmentation, several=False)
    if est.host_bytes:
        lines.append(f"host RAM for offloaded states: {num_gib(est.host_bytes)} GiB per GPU")
    return "\n".join(lines)
