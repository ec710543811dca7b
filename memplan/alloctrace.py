"""Allocation traces synthesized from the analytic model, and the reserved bytes the caching
allocator (``memplan.allocator``) turns them into.

The model knows every tensor of a step, its size and when it lives (``memory.Step``); the
trace allocates and frees them in step order, one tensor per saved activation of each block:
model states (one tensor per block and one for the rest of the model, as FSDP1's flat
parameters), forward block by block, the loss, backward block by block (the block's
transients, its gradients, its activations freed), the optimizer step, and ``zero_grad``.
Two steps run, since the second starts from the first's cache. Parameters gathered by FSDP
or ZeRO-3 come from the all-gather stream and are recorded on the compute stream, gradients
handed to the reduce-scatter are recorded on its stream: both return to the pool one block
later (``Sync``), as the streams catch up.

``reserved`` is the analytic peak plus what the replay adds beyond its own allocated peak
(fragmentation, rounding, frees waiting on another stream). Every block is replayed: the
excess is not linear in the number of blocks (the peak moves between forward, loss and
backward as blocks are added): four blocks scaled up to 32 missed the 7B FSDP case by 0.3 GiB,
to 28 blocks the 3B single-GPU case by 6 GiB (measured while building this), so no scaling.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import count

from .allocator import DEFAULT_CONF, Alloc, AllocConf, Event, Free, Sync, replay
from .breakdown import Term

COMPUTE, ALL_GATHER, REDUCE_SCATTER = 0, 1, 2
# groups whose per-block tensors the trace emits itself (the rest are whole-model terms)
_BLOCK_KEYS = ("fsdp.block", "fsdp.prefetched_block", "fsdp.block_grads", "zero3.gathered")


class _Trace:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.ids = count()

    def alloc(self, nbytes: int, stream: int = COMPUTE) -> list[int]:
        if nbytes <= 0:
            return []
        i = next(self.ids)
        self.events.append(Alloc(i, nbytes, stream))
        return [i]

    def allocs(self, sizes) -> list[int]:
        return [i for n in sizes for i in self.alloc(n)]

    def free(self, ids: list[int], used_on: tuple[int, ...] = ()) -> None:
        self.events.extend(Free(i, used_on) for i in ids)

    def sync(self, stream: int) -> None:
        self.events.append(Sync(stream))


def _sizes(terms: list[Term]) -> list[int]:
    return [t.bytes for t in terms]


def _blockwise(term: Term, blocks: int, share: float) -> list[int]:
    """A whole-model state term as one tensor per block (``share`` of it each) and the rest."""
    per_block = int(term.bytes * share)
    return [per_block] * blocks + [term.bytes - per_block * blocks]


def step_trace(step, blocks: int | None = None, *, steps: int = 2) -> list[Event]:
    """The events of ``steps`` training steps of ``step``'s job with ``blocks`` blocks (all by
    default); ``step`` is a ``memory.Step``."""
    model = step.job.model
    L = model.num_layers if blocks is None else blocks
    share = step.block_params / max(step.params, 1)
    groups = step.groups()
    t = _Trace()
    for term in groups["states"]:
        t.allocs(_blockwise(term, L, share) if term.bytes else [])
    gathered_block = [x for x in groups["gathered.block"] if x.key in ("fsdp.block", "zero3.gathered")]
    # the block buffers: one block's parameters, gathered on the all-gather stream
    gather_bytes = step.gather_bytes * step.block_params if gathered_block else 0
    reduce_bytes = sum(x.bytes for x in groups["gathered.block"] if x.key == "fsdp.block_grads")
    whole = {g: [x for x in groups[g] if x.key not in _BLOCK_KEYS] for g in ("gathered.forward", "gathered.block")}
    grad_per_block = int(step.grad_terms()[0].bytes * share)
    grads_total = step.grad_terms()[0].bytes
    in_backward = step.job.train.optimizer_in_backward
    for _ in range(steps):
        held = t.allocs(_sizes(whole["gathered.forward"]))
        kept = []
        previous: list[int] = []
        for i in range(L):
            gathered = t.alloc(gather_bytes, ALL_GATHER)
            kept.append(t.allocs(s.bytes for s in step.kept(i)))
            t.free(previous, (COMPUTE,))
            t.sync(COMPUTE)
            previous = gathered
        t.free(previous, (COMPUTE,))
        outside = t.allocs(_sizes(groups["activations.outside"] + groups["logits.forward"]))
        loss = t.allocs(_sizes(groups["loss.forward"]))
        loss_bwd = t.allocs(_sizes(groups["loss.backward"]))
        t.free(loss + loss_bwd + outside)
        grads, previous, reducing = [], [], []
        forward_keys = {x.key for x in whole["gathered.forward"]}
        block_buffers = t.allocs(x.bytes for x in whole["gathered.block"] if x.key not in forward_keys)
        for i in reversed(range(L)):
            gathered = t.alloc(gather_bytes, ALL_GATHER)
            transient = t.allocs(_sizes(step.transient_terms(i)))
            unsharded = t.alloc(reduce_bytes)
            t.free(transient)
            grads += t.alloc(grad_per_block if not in_backward else 0, REDUCE_SCATTER if reduce_bytes else COMPUTE)
            t.free(kept[i])
            t.free(previous, (COMPUTE,))
            t.free(reducing, (REDUCE_SCATTER,))
            t.sync(COMPUTE)
            t.sync(REDUCE_SCATTER)
            previous, reducing = gathered, unsharded
        t.free(previous, (COMPUTE,))
        t.free(reducing, (REDUCE_SCATTER,))
        t.free(block_buffers + held)
        grads += t.alloc(grads_total - grad_per_block * L if not in_backward else 0)
        t.sync(COMPUTE)
        t.sync(REDUCE_SCATTER)
        t.free(t.allocs(_sizes(groups["optimizer.step"])))
        t.free(grads)  # zero_grad(set_to_none=True)
    return t.events


@dataclass(frozen=True, kw_only=True)
class Reserved:
    """The allocator's view of one estimate."""

    reserved_bytes: int
    """Peak reserved: the analytic allocated peak plus the replay's excess over its own."""
    excess_bytes: int
    """What the allocator holds beyond the tensors at the peak (reserved − allocated)."""
    conf: AllocConf


def excess_bytes(step, conf: AllocConf = DEFAULT_CONF, blocks: int | None = None) -> int:
    """reserved − allocated at the replay's peaks (never negative)."""
    result = replay(step_trace(step, blocks), conf)
    return max(0, result.peak_reserved_bytes - result.peak_allocated_bytes)


@lru_cache(maxsize=4096)
def reserved(job, conf: AllocConf = DEFAULT_CONF) -> Reserved:
    """Peak reserved bytes of ``job`` under ``conf``."""
    from .memory import Step, estimate

    excess = excess_bytes(Step(job), conf)
    return Reserved(reserved_bytes=estimate(job).allocated_bytes + excess, excess_bytes=excess, conf=conf)
