"""Allocation traces synthesized from the analytic model, and the reserved bytes the caching
allocator (``memplan.allocator``) turns them into.

The model knows every tensor of a step, its size and when it lives (``memory.Step``); the
trace allocates and frees them in step order, one tensor per saved activation of each block:
model states (one tensor per block and one for the rest of the model, as FSDP1's flat
parameters), forward block by block, the loss, backward block by block (the block's
transients, its gradients per parameter group, its activations freed), the optimizer step
(foreach temporaries per parameter group), and ``zero_grad``.
Two steps run, since the second starts from the first's cache. Parameters gathered by FSDP
or ZeRO-3 come from the all-gather stream and are recorded on the compute stream, gradients
handed to the reduce-scatter are recorded on its stream: both return to the pool one block
later (``Sync``), as the streams catch up.

``reserved`` is the analytic peak plus what the replay adds beyond its own allocated peak
(fragmentation, rounding, frees waiting on another stream). Every block is replayed: the
excess is not linear in the number of blocks (the peak moves between forward, loss and
backward as blocks are added): with an earlier version of this trace, four blocks scaled up
to 32 missed the 7B FSDP case by 0.3 GiB and to 28 the 3B single-GPU case by 6 GiB, so none.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial

from .allocator import DEFAULT_CONF, Alloc, AllocConf, Event, Free, Sync, replay
from .breakdown import Term

COMPUTE, ALL_GATHER, REDUCE_SCATTER = 0, 1, 2
# the events built without NamedTuple's keyword-handling constructor (the trace's hot line)
_ALLOC, _FREE = partial(tuple.__new__, Alloc), partial(tuple.__new__, Free)
# groups whose per-block tensors the trace emits itself (the rest are whole-model terms)
_BLOCK_KEYS = ("fsdp.block", "fsdp.prefetched_block", "fsdp.block_grads", "zero3.gathered")


class _Trace:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.next_id = 0

    def alloc(self, nbytes: int, stream: int = COMPUTE) -> list[int]:
        return self.allocs((nbytes,), stream)

    def allocs(self, sizes, stream: int = COMPUTE) -> list[int]:
        """One tensor per positive size, in order; their ids."""
        ids, append, i = [], self.events.append, self.next_id
        for n in sizes:
            if n > 0:
                append(_ALLOC((i, n, stream)))
                ids.append(i)
                i += 1
        self.next_id = i
        return ids

    def free(self, ids: list[int], used_on: tuple[int, ...] = ()) -> None:
        self.events.extend(_FREE((i, used_on)) for i in ids)

    def sync(self, stream: int) -> None:
        self.events.append(Sync(stream))


def _sizes(terms: list[Term]) -> list[int]:
    return [t.bytes for t in terms]


def _pieces(term: Term, model, groups: list[int]) -> list[int]:
    """``term`` split in proportion to parameter counts, the rest in a last piece."""
    params = max(model.num_params, 1)
    sizes = [term.bytes * n // params for n in groups]
    return sizes + [term.bytes - sum(sizes)]


def _per_block(term: Term, model) -> list[int]:
    """A state term (allocated once, never freed) as one tensor per block, as FSDP1's flat
    parameters, and one for the embedding and head: per-parameter tensors would multiply
    the events for a rounding difference of at most 2 MiB a tensor."""
    return _pieces(term, model, [model.block_params()] * model.num_layers + [_root(model)])


def _per_parameter(term: Term, model) -> list[int]:
    """A term freed every step (gradients, foreach temporaries) as one tensor per parameter
    group of each block (``block_param_counts``: fused qkv, attention out, MLP in, MLP out,
    norms) and one for the embedding and head: these sizes decide which cached blocks they reuse."""
    return _pieces(term, model, [*model.block_param_counts().values()] * model.num_layers + [_root(model)])


def _loss_backward(terms: list[Term]) -> list[int]:
    """The loss's backward tensors: its gradients term (``loss.gradients``: nll_loss's and
    log_softmax's b·s·V gradients, and under loss parallel the compute-dtype one) as tensors of
    the log_softmax output's size each, as autograd makes them one at a time. One tensor of
    their sum could not reuse the blocks the loss's forward freed, each that size: at the
    Qwen3-32B TP 8 job it cudaMalloc'd 14 GiB beside 9 GiB cached."""
    unit = max((t.bytes for t in terms if t.key == "loss.log_softmax"), default=0)
    sizes = []
    for t in terms:
        if t.key == "loss.gradients" and unit and t.bytes > unit:
            whole, rest = divmod(t.bytes, unit)
            sizes += [unit] * whole + ([rest] if rest else [])
        else:
            sizes.append(t.bytes)
    return sizes


def _root(model) -> int:
    return model.embedding_params() + model.head_params()


def step_trace(step, *, steps: int = 2) -> list[Event]:
    """The events of ``steps`` training steps of ``step``'s job (a ``memory.Step``)."""
    model = step.job.model
    L = model.num_layers
    groups = step.groups()
    t = _Trace()
    for term in groups["states"]:
        t.allocs(_per_block(term, model) if term.bytes else [])
    gathered_block = [x for x in groups["gathered.block"] if x.key in ("fsdp.block", "zero3.gathered")]
    # the block buffers: one block's parameters, gathered on the all-gather stream
    gather_bytes = step.gather_bytes * step.block_params if gathered_block else 0
    reduce_bytes = sum(x.bytes for x in groups["gathered.block"] if x.key == "fsdp.block_grads")
    whole = {g: [x for x in groups[g] if x.key not in _BLOCK_KEYS] for g in ("gathered.forward", "gathered.block")}
    grad_pieces = [] if step.job.train.optimizer_in_backward else _per_parameter(step.grad_terms()[0], model)
    per_block = len(model.block_param_counts())
    foreach = step.job.train.optimizer_impl == "foreach"
    for _ in range(steps):
        held = t.allocs(_sizes(whole["gathered.forward"]))
        kept = []
        previous: list[int] = []
        reducing: list[int] = []
        for i in range(L):
            gathered = t.alloc(gather_bytes, ALL_GATHER)
            kept.append(t.allocs(s.bytes for s in step.kept(i)))
            t.free(previous, (COMPUTE,))
            t.sync(COMPUTE)
            previous = gathered
        t.free(previous, (COMPUTE,))
        # the loss as memory.MOMENTS has it: its forward's tensors, then its backward's, the
        # logits held into backward only where the start-of-backward moment holds them
        outside = t.allocs(_sizes(groups["activations.outside"]))
        logits = t.allocs(_sizes(groups["logits.forward"]))
        t.free(t.allocs(_sizes(groups["loss.forward"])))
        if not groups["logits.loss"]:
            t.free(logits)
        t.free(t.allocs(_loss_backward(groups["loss.backward"])) + (logits if groups["logits.loss"] else []) + outside)
        grads: list[int] = []
        previous, reducing = [], []
        forward_keys = {x.key for x in whole["gathered.forward"]}
        block_buffers = t.allocs(x.bytes for x in whole["gathered.block"] if x.key not in forward_keys)
        for i in reversed(range(L)):
            gathered = t.alloc(gather_bytes, ALL_GATHER)
            transient = t.allocs(_sizes(step.transient_terms(i)))
            unsharded = t.alloc(reduce_bytes)
            t.free(transient)
            grad_stream = REDUCE_SCATTER if reduce_bytes else COMPUTE
            grads += t.allocs(grad_pieces[i * per_block : (i + 1) * per_block], grad_stream)
            t.free(kept[i])
            t.free(previous, (COMPUTE,))
            t.free(reducing, (REDUCE_SCATTER,))
            t.sync(COMPUTE)
            t.sync(REDUCE_SCATTER)
            previous, reducing = gathered, unsharded
        t.free(previous, (COMPUTE,))
        t.free(reducing, (REDUCE_SCATTER,))
        t.free(block_buffers + held)
        grads += t.allocs(grad_pieces[L * per_block :])
        t.sync(COMPUTE)
        t.sync(REDUCE_SCATTER)
        # foreach temporaries are one tensor per parameter (_foreach_sqrt over the group)
        step_sizes = [
            n
            for x in groups["optimizer.step"]
            for n in (_per_parameter(x, model) if x.key == "optimizer.sqrt_temporaries" and foreach else [x.bytes])
        ]
        t.free(t.allocs(step_sizes))
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


def excess_bytes(step, conf: AllocConf = DEFAULT_CONF) -> int:
    """reserved − allocated at the replay's peaks (never negative)."""
    return _excess(tuple(step_trace(step)), conf)


@lru_cache(maxsize=1024)
def _excess(events: tuple[Event, ...], conf: AllocConf) -> int:
    """One replay per distinct trace (hybrid-shard on one node replays full-shard's)."""
    result = replay(events, conf)
    return max(0, result.peak_reserved_bytes - result.peak_allocated_bytes)


def replayed_step(job, stage: int | None = None):
    """The step the replay follows: ``memory.Step`` for a data-parallel job; under a layout the
    rank of pipeline stage ``stage`` (None: the estimate's worst), as ``parallel.RankStep``
    counts its bytes. The data-parallel step of a TP job replays the unsliced model: at the
    Qwen3-32B TP 8 job it allocated 179 GiB against the rank's 39."""
    from .memory import Step, estimate

    if job.layout.is_data_parallel:
        return Step(job)
    from .parallel import pipeline
    from .parallel.step import RankStep

    index = getattr(estimate(job), "worst_stage", 0) if stage is None else stage
    return RankStep(job, pipeline.stages(job.layout, job.model.num_layers)[index])


@lru_cache(maxsize=4096)
def reserved(job, conf: AllocConf = DEFAULT_CONF, stage: int | None = None) -> Reserved:
    """Peak reserved bytes of ``job`` (of its pipeline stage ``stage``; None: the worst) under ``conf``."""
    from .memory import estimate

    est = estimate(job)
    if stage is not None:
        est = getattr(est, "stages", (est,))[stage]
    excess = excess_bytes(replayed_step(job, stage), conf)
    return Reserved(reserved_bytes=est.allocated_bytes + excess, excess_bytes=excess, conf=conf)
