"""Context parallel, per rank: torch's ``context_parallel`` splits the sequence over the cp ranks
(each keeps 1/cp of every activation, rotary table and logit) and runs ring attention
(torch/distributed/tensor/experimental/_context_parallel/_attention.py,
``_templated_ring_attention``). Modelled from that source, not measured (its CPU path is not
driven by the harness)."""

from __future__ import annotations

from ..activations import shapes
from ..breakdown import Component, Term
from ..frameworks.base import term
from ..layout import Layout
from ..specs import ModelSpec, TrainSpec

NOTE = "context parallel is modelled from torch's ring attention (ALL_GATHER rotater, its default), not measured"


def ring_buffers(model: ModelSpec, local: TrainSpec, layout: Layout) -> list[Term]:
    """Live while a block's attention runs its backward on one CP rank (``local`` is the rank's
    1/cp of the sequence): the K and V of every rank, all-gathered once per attention
    (``_AllGatherRotater``) beside the local ``torch.cat`` that feeds it, and the fp32 dK, dV
    accumulated over the ring steps."""
    if layout.cp == 1:
        return []
    x = shapes(model, local)
    chunk = x.b * x.s * 2 * x.kv // layout.tp  # one rank's K and V, its TP share of the kv heads
    gathered = (layout.cp + 1) * x.c * chunk
    accumulators = 4 * chunk
    return [
        term(
            Component.BUFFERS,
            "cp.ring",
            "ring attention: all-gathered K/V and the dK/dV accumulators",
            "(cp + 1)·c·b·(s/cp)·2·kv + 4·b·(s/cp)·2·kv (/tp)",
            gathered + accumulators,
        )
    ]
