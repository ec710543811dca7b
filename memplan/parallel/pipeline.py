"""Pipeline parallel, per rank: which layers a rank holds, how many micro-batches' forwards it
keeps at once under each schedule, and the receive buffers torch.distributed.pipelining
allocates for every micro-batch (torch/distributed/pipelining/stage.py,
``_setup_forward_recv_info`` / ``_setup_backward_recv_info``)."""

from __future__ import annotations

from dataclasses import dataclass

from ..layout import Layout


@dataclass(frozen=True, kw_only=True)
class Stage:
    """One pipeline rank: its (virtual) stages' layers and what its schedule keeps in flight."""

    rank: int
    chunk_layers: tuple[int, ...]
    """Layers of each virtual stage this rank runs (one entry without interleaving)."""
    first: bool
    """Holds the token embedding (virtual stage 0)."""
    last: bool
    """Holds the final norm, the head and the loss (the last virtual stage)."""
    in_flight: int
    """Chunk forwards whose activations are kept at once at the rank's peak."""
    carries_grads: bool
    """A forward runs after the first backward: gradients are live beside the in-flight activations."""
    losses_in_flight: int = 1
    """Micro-batches whose logits and loss the last stage holds at once: all of them under GPipe
    (every loss before any backward), one under the 1F1B family (each backward follows its loss)."""

    @property
    def layers(self) -> int:
        return sum(self.chunk_layers)

    @property
    def in_flight_layers(self) -> int:
        """Blocks' activations kept at the peak: the in-flight chunks, the largest first."""
        return self.in_flight * max(self.chunk_layers)


def split_layers(layers: int, stages: int) -> list[int]:
    """Layers per stage, the remainder on the earliest stages (torchtitan's even split when it divides)."""
    base, extra = divmod(layers, stages)
    return [base + (i < extra) for i in range(stages)]


def in_flight(layout: Layout, rank: int) -> int:
    """Chunk forwards a rank holds at once (torch/distributed/pipelining/schedules.py)."""
    m, pp, v = layout.microbatches, layout.pp, layout.pp_virtual
    if layout.pp_schedule == "gpipe":
        return m  # ScheduleGPipe: every forward before any backward
    if layout.pp_schedule == "1f1b":
        return min(m, pp - rank)  # Schedule1F1B: warmup_chunks = min(M, pp - stage_index)
    # ScheduleInterleaved1F1B (_get_warmup_ops, multiply_factor 2) and ScheduleInterleavedZeroBubble
    # (multiply_factor 1): warmup forwards, then one more before the first backward
    rounds = max(1, m // pp)
    per_round = m // rounds
    factor = 2 if layout.pp_schedule == "interleaved-1f1b" else 1
    warmup = min((v - 1) * per_round + factor * (pp - 1 - rank), m * v)
    return min(warmup + 1, m * v)


def stages(layout: Layout, layers: int) -> list[Stage]:
    """Every pipeline rank; without a pipeline, one holding everything with one micro-batch in flight."""
    counts = split_layers(layers, layout.stages)
    out = []
    for rank in range(layout.pp):
        held = in_flight(layout, rank)
        out.append(
            Stage(
                rank=rank,
                chunk_layers=tuple(counts[rank + k * layout.pp] for k in range(layout.pp_virtual)),
                first=rank == 0,
                last=rank == layout.pp - 1,
                in_flight=held,
                carries_grads=layout.microbatches * layout.pp_virtual > held,
                losses_in_flight=layout.microbatches if layout.pp_schedule == "gpipe" else 1,
            )
        )
    return out
