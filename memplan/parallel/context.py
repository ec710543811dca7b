"""Context parallel, per rank: torch's ``context_parallel`` splits the sequence over the cp ranks
(each keeps 1/cp of every activation, rotary table and logit) and runs ring attention
(torch/distributed/tensor/experimental/_context_parallel/_attention.py,
``_templated_ring_attention``). Measured on CPU (``validation.parallel_matrix``: torch's ring functions
on the CPU flash kernel, validation/records/parallel_matrix_cpu.md); the ring's own buffers are modelled from
the source where they are not at the measured peaks."""

from __future__ import annotations

from dataclasses import replace

from ..breakdown import Component, Term, term
from ..layout import Layout
from ..saved import Saved
from ..shapes import shapes
from ..specs import ModelSpec, TrainSpec

NOTE = (
    "context parallel: torch's ring attention (ALL_GATHER rotater, head-tail load balancing), measured on CPU "
    "gloo ranks with torch's ring functions on the CPU flash kernel"
)


def merged_output(kept: list[Saved], model: ModelSpec, local: TrainSpec, layout: Layout) -> list[Saved]:
    """One more attention output per block on the worst CP rank. The flash kernels return their
    output (b, heads, s, d) as a view of (b, s, heads, d) memory, so the block's
    ``transpose(1, 2).reshape(b, s, h)`` into the output projection is a view. Under head-tail load
    balancing rank 0's last ring step updates only its second query chunk, and ``_SDPAMerger``'s
    ``_partial_update`` rebuilds the output with ``torch.cat`` along the sequence: contiguous
    (b, heads, s, d), so the reshape copies it and the output projection saves the copy beside
    the output the attention saved (measured: rank 0 of every CP case holds c·b·(s/cp)·h per
    block more than rank 1, whose last merge keeps the kernel's layout)."""
    if layout.cp == 1 or not any(s.name.startswith("attention output") for s in kept):
        return []
    x = shapes(model, local)
    return [
        Saved("attention output, copied by the reshape after the ring's merge", "c·b·(s/cp)·q", x.c * x.tokens * x.q)
    ]


def ring_buffers(model: ModelSpec, local: TrainSpec, layout: Layout) -> list[Term]:
    """Live on a CP rank where ring attention's backward peaks: the first ring step's dK/dV sent
    on (``_templated_ring_attention_backward``, ``dkv_rotater.exchange_buffers``; measured: the
    peak of cp4-fsdp and of the ring alone under the fake process group, cp 2 to 8). ``local`` is
    the rank's 1/cp of the sequence; q, k and v hold its TP share of the heads. Live then: the
    fp32 accumulators ``grad_query``, ``grad_key``, ``grad_value`` (``convert_to_f32``); the
    contiguous copies of k and v (the kernel's inputs are views of (b, s, heads, d) memory); the
    K/V concatenation handed to the all-gather and its output, every rank's K/V
    (``_AllGatherRotater``, the default); the kernel's dq, dk, dv; the fp32 dK/dV concatenation
    and the all-to-all rotater's receive buffer (``_AllToAllRotater``, always used for dK/dV);
    and the gradient of the attention output coming in (the output projection's backward)."""
    if layout.cp == 1:
        return []
    x = shapes(model, local)
    q = x.b * x.s * x.q // layout.tp  # one rank's q (and attention output), its TP share of the heads
    kv = x.b * x.s * 2 * x.kv // layout.tp  # one rank's K and V
    parts = (
        ("fp32 dQ, dK, dV accumulators", "4·(q + kv)", 4 * (q + kv)),
        ("contiguous k, v", "c·kv", x.c * kv),
        ("K/V concatenated and all-gathered from every rank", "(1 + cp)·c·kv", (1 + layout.cp) * x.c * kv),
        ("the kernel's dq, dk, dv", "c·(q + kv)", x.c * (q + kv)),
        ("dK/dV sent (fp32 cat) and received (all-to-all)", "2·4·kv", 2 * 4 * kv),
        ("incoming gradient of the attention output", "c·q", x.c * q),
    )
    return [
        term(
            Component.BUFFERS,
            "cp.ring",
            "ring attention's backward: " + "; ".join(name for name, _, _ in parts),
            " + ".join(f for _, f, _ in parts) + " (q = b·(s/cp)·a·d/tp, kv = b·(s/cp)·2·kv/tp)",
            sum(n for _, _, n in parts),
        )
    ]


AFTER_CORE = ("norm 2", "SwiGLU", "MLP up output", "gelu_new", "attention output, copied")
"""What a block keeps for the modules after its attention core (the second norm, the MLP, the
output projection's copied input): released by their backward before the core's runs."""


def kept_before_core(kept: list[Saved]) -> list[Saved]:
    """A block's kept tensors still held while its attention core runs its backward: all but
    ``AFTER_CORE`` and the second norm's output (half of the norms' outputs the linears keep)."""
    out = []
    for s in kept:
        if s.name.startswith(AFTER_CORE):
            continue
        if s.name.startswith("norm outputs (linear inputs)"):
            s = replace(s, name="norm 1 output (q, k, v input)", formula=f"({s.formula})/2", bytes=s.bytes // 2)
        out.append(s)
    return out


def grads_after_core(model: ModelSpec, tp: int) -> int:
    """The block parameters whose gradients exist when the attention core runs its backward:
    the output projection, the second norm and the MLP (their backward came first)."""
    counts = model.block_param_counts()
    return (counts["attn_out"] + counts["mlp_in"] + counts["mlp_out"]) // tp + counts["norms"] // 2
