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

Two things it does unlike the real step, measured on GPUs and left: it makes a torch optimizer's
states before the first forward (torch makes them at the first ``step()``), and it frees
torchtitan's gradients after each step (torchtitan fills them with zeros and keeps them). Made as
the real step makes them, with its coarse tensors (one per term and block, where the real step
makes ten times as many, and CUDA's kernel workspaces besides), the replay moved issue 28's
Qwen3-32B job further over its GPU's reserved and the full-size jobs under theirs
(validation/records/gpu_trace_check_h200.md item 6): they wait for the step's tensors to be the
real ones.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import signal
import threading
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import NamedTuple

from . import replaycache
from .allocator import DEFAULT_CONF, Alloc, AllocConf, Event, Free, Sync, parse_alloc_conf, replay
from .breakdown import Term
from .memory import estimate, step_of
from .parallel import pipeline
from .parallel.step import rank_step

COMPUTE, ALL_GATHER, REDUCE_SCATTER = 0, 1, 2
# the events built without NamedTuple's keyword-handling constructor (the trace's hot line)
_ALLOC, _FREE = partial(tuple.__new__, Alloc), partial(tuple.__new__, Free)
# groups whose per-block tensors the trace emits itself (the rest are whole-model terms)
_BLOCK_KEYS = ("fsdp.block", "fsdp.prefetched_block", "fsdp.block_grads", "zero3.gathered")


def _pieces(nbytes: int, params: int, groups: list[int]) -> list[int]:
    """``nbytes`` split in proportion to parameter counts (of ``params``), the rest in a last piece."""
    params = max(params, 1)
    sizes = [nbytes * n // params for n in groups]
    return sizes + [nbytes - sum(sizes)]


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


class TraceShape(NamedTuple):
    """Everything ``step_trace`` reads of a step, as byte counts: two steps with the same shape
    have the same trace (the pipeline's middle stages, which differ only in the micro-batches
    in flight, and often the options of a search), so the replay is cached per shape and a
    shape costs no events to build."""

    states: tuple[tuple[int, ...], ...]
    """Each state term as one tensor per block and one for the embedding and head (FSDP1's
    flat parameters: per-parameter tensors would multiply the events for a rounding
    difference of at most 2 MiB a tensor)."""
    forward: tuple[int, ...]
    """Whole-model buffers gathered for the forward, held to the end of backward."""
    block_buffers: tuple[int, ...]
    """Whole-model buffers gathered for backward only."""
    gather_bytes: int
    """One block's parameters gathered on the all-gather stream (0: none)."""
    reduce_bytes: int
    """One block's unsharded gradients handed to the reduce-scatter (0: none)."""
    kept: tuple[tuple[int, ...], ...]
    """Each block's saved activations."""
    transient: tuple[tuple[int, ...], ...]
    """Each block's backward transients."""
    outside: tuple[int, ...]
    logits: tuple[int, ...]
    loss_forward: tuple[int, ...]
    logits_to_loss: bool
    """Whether the logits are held into the loss's backward."""
    loss_backward: tuple[int, ...]
    grads: tuple[int, ...]
    """The gradients as one tensor per parameter group of each block (``block_param_counts``:
    fused qkv, attention out, MLP in, MLP out, norms) and one for the embedding and head
    (none under optimizer-in-backward): these sizes decide which cached blocks they reuse."""
    per_block: int
    """Parameter groups per block."""
    optimizer_step: tuple[int, ...]
    """The optimizer step's temporaries (foreach ones one tensor per parameter, as the gradients)."""
    grads_after_forward: bool = False
    """The gradients cleared after the next step's forward (``Loop.zero_grad`` after-forward)."""
    logits_held: bool = False
    """The logits held by the caller's outputs until the next step's forward returns (``Loop.logits``
    held; ``loss.outputs_held``)."""
    cache: tuple[int, ...] = ()
    """The held outputs' KV cache (``loss.kv_cache``): the blocks' keys and values, kept beyond their backward."""


@lru_cache(maxsize=4096)
def trace_shape(step) -> TraceShape:
    """The shape of ``step``'s trace (a ``memory.Step``, a ``parallel.RankStep``: each built once
    per job, ``memory.step_of``), kept: ``replay_ahead`` reads the shapes of an estimate's rows
    before the estimate asks for them."""
    model = step.job.model
    L = model.num_layers
    groups = step.built_groups
    params, root = model.num_params, _root(model)
    per_block = [model.block_params()] * L + [root]
    counts = list(model.block_param_counts().values())
    per_parameter = counts * L + [root]
    gathered_block = [x for x in groups["gathered.block"] if x.key in ("fsdp.block", "zero3.gathered")]
    whole = {g: [x for x in groups[g] if x.key not in _BLOCK_KEYS] for g in ("gathered.forward", "gathered.block")}
    forward_keys = {x.key for x in whole["gathered.forward"]}
    foreach = step.job.train.optimizer_impl == "foreach"
    # a block's kept activations and backward transients depend on its index only through its
    # kind (``Step.kept``, ``Step.transient_terms``): each kind's sizes are read once
    kinds = [step.kind(i) for i in range(L)]
    first = {k: i for i, k in reversed(list(enumerate(kinds)))}
    kept = {k: _sizes(step.kept(i)) for k, i in first.items()}
    transient = {k: _sizes(step.transient_terms(i)) for k, i in first.items()}
    return TraceShape(
        states=tuple(tuple(_pieces(x.bytes, params, per_block)) if x.bytes else () for x in groups["states"]),
        forward=_sizes(whole["gathered.forward"]),
        block_buffers=tuple(x.bytes for x in whole["gathered.block"] if x.key not in forward_keys),
        gather_bytes=step.gather_bytes * step.block_params if gathered_block else 0,
        reduce_bytes=sum(x.bytes for x in groups["gathered.block"] if x.key == "fsdp.block_grads"),
        kept=tuple(kept[k] for k in kinds),
        transient=tuple(transient[k] for k in kinds),
        outside=_sizes(groups["activations.outside"]),
        logits=_sizes(groups["logits.forward"]),
        loss_forward=_sizes(groups["loss.forward"]),
        logits_to_loss=bool(groups["logits.loss"]),
        loss_backward=tuple(_loss_backward(groups["loss.backward"])),
        grads=()
        if step.job.train.optimizer_in_backward
        else tuple(_pieces(step.grad_terms()[0].bytes, params, per_parameter)),
        per_block=len(counts),
        grads_after_forward=step.job.train.zero_grad == "after-forward",
        logits_held=any(x.name.startswith("logits") for x in groups.get("outputs.held", [])),
        cache=_sizes([x for x in groups.get("outputs.held", []) if x.name.startswith("KV cache")]),
        optimizer_step=tuple(
            n
            for x in groups["optimizer.step"]
            for n in (
                _pieces(x.bytes, params, per_parameter)
                if x.key == "optimizer.sqrt_temporaries" and foreach
                else [x.bytes]
            )
        ),
    )


def _sizes(terms: list[Term]) -> tuple[int, ...]:
    return tuple(t.bytes for t in terms)


def step_trace(step, *, steps: int = 2) -> list[Event]:
    """The events of ``steps`` training steps of ``step``'s job (a ``memory.Step``)."""
    return shape_trace(trace_shape(step), steps=steps)


def shape_trace(shape: TraceShape, *, steps: int = 2) -> list[Event]:
    """The events of ``steps`` training steps of a trace shape; written out as appends to one
    list (no per-event calls), each tensor's id its position among the allocations."""
    events: list[Event] = []
    append = events.append
    next_id = 0

    def allocs(sizes, stream: int = COMPUTE) -> list[int]:
        """One tensor per positive size, in order; their ids."""
        nonlocal next_id
        ids, i = [], next_id
        for n in sizes:
            if n > 0:
                append(_ALLOC((i, n, stream)))
                ids.append(i)
                i += 1
        next_id = i
        return ids

    def free(ids: list[int], used_on: tuple[int, ...] = ()) -> None:
        for i in ids:
            append(_FREE((i, used_on)))

    sync_compute, sync_reduce = Sync(COMPUTE), Sync(REDUCE_SCATTER)
    on_compute, on_reduce = (COMPUTE,), (REDUCE_SCATTER,)
    L, per_block, grad_pieces = len(shape.kept), shape.per_block, shape.grads
    gather = (shape.gather_bytes,)
    grad_stream = REDUCE_SCATTER if shape.reduce_bytes else COMPUTE
    for sizes in shape.states:
        allocs(sizes)
    stale: list[int] = []  # the step before's gradients, under Lightning's zero_grad order
    outputs: list[int] = []  # the step before's held outputs, until this forward returns
    for _ in range(steps):
        held = allocs(shape.forward)
        kept = []
        previous: list[int] = []
        for i in range(L):
            gathered = allocs(gather, ALL_GATHER)
            kept.append(allocs(shape.kept[i]))
            free(previous, on_compute)
            append(sync_compute)
            previous = gathered
        free(previous, on_compute)
        # the loss as memory.MOMENTS has it: its forward's tensors, then its backward's, the
        # logits held into backward only where the start-of-backward moment holds them
        outside = allocs(shape.outside)
        logits = allocs(shape.logits)
        free(allocs(shape.loss_forward))
        free(stale + outputs)  # zero_grad after the forward (Lightning's closure); the step before's outputs
        stale, outputs = [], (logits if shape.logits_held else [])
        if not shape.logits_to_loss:
            free(logits)
        free(allocs(shape.loss_backward) + (logits if shape.logits_to_loss and not outputs else []) + outside)
        grads: list[int] = []
        previous = []
        reducing: list[int] = []
        block_buffers = allocs(shape.block_buffers)
        for i in reversed(range(L)):
            gathered = allocs(gather, ALL_GATHER)
            transient = allocs(shape.transient[i])
            unsharded = allocs((shape.reduce_bytes,))
            free(transient)
            grads += allocs(grad_pieces[i * per_block : (i + 1) * per_block], grad_stream)
            free(kept[i])
            free(previous, on_compute)
            free(reducing, on_reduce)
            append(sync_compute)
            append(sync_reduce)
            previous, reducing = gathered, unsharded
        free(previous, on_compute)
        free(reducing, on_reduce)
        free(block_buffers + held)
        outputs += allocs(shape.cache)  # the keys and values the blocks' backward would have freed
        grads += allocs(grad_pieces[L * per_block :])
        append(sync_compute)
        append(sync_reduce)
        free(allocs(shape.optimizer_step))
        if shape.grads_after_forward:
            stale = grads
        else:
            free(grads)  # zero_grad(set_to_none=True)
    return events


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
    return _excess(trace_shape(step), conf)


_ANSWERS: dict[tuple[TraceShape, AllocConf], int] = {}
"""Every answer this process replayed, read from ``replaycache`` or had from a worker
(``replay_ahead``), by shape and configuration; the oldest forgotten past ``_KEPT``."""
_KEPT = 1024


def forget_answers() -> None:
    """Drop every answer this process holds, as a new process starts without them."""
    _ANSWERS.clear()


def _excess(shape: TraceShape, conf: AllocConf) -> int:
    """One replay per distinct trace shape (hybrid-shard on one node replays full-shard's, the
    pipeline's middle stages one another's): an answer this process holds, else the one a worker
    it started is making (``replay_later``), else one another process kept (``replaycache``),
    else a replay, kept there."""
    key = (shape, conf)
    found = _ANSWERS.get(key)
    if found is None:
        found = _collect(key) if key in _PENDING else None
        if found is None:
            found = replaycache.load(key)
        if found is None:
            found = _replay(shape, conf)
            replaycache.store(key, found)
        _remember(key, found)
    return found


def _remember(key: tuple[TraceShape, AllocConf], excess: int) -> None:
    if len(_ANSWERS) >= _KEPT:
        del _ANSWERS[next(iter(_ANSWERS))]
    _ANSWERS[key] = excess


def _replay(shape: TraceShape, conf: AllocConf) -> int:
    """The replay's excess, the cyclic garbage collector paused: the trace's thousands of events
    and blocks would start its passes over every object the process holds, and none of them is
    garbage before the replay ends."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        result = replay(shape_trace(shape), conf)
    finally:
        if enabled:
            gc.enable()
    return max(0, result.peak_reserved_bytes - result.peak_allocated_bytes)


WORKERS_ENV = "MEMPLAN_REPLAY_WORKERS"
"""The most processes one command's replays run in (unset: the CPUs this process may use; 1:
none forked)."""


def _workers() -> int:
    """``WORKERS_ENV``'s count; 1 where a worker cannot be forked safely: no ``fork`` (Windows),
    or other threads running (a notebook kernel's: a forked child holds none of their locks)."""
    if not hasattr(os, "fork") or threading.active_count() > 1:
        return 1
    given = os.environ.get(WORKERS_ENV, "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def replay_ahead(jobs) -> None:
    """The replays of the data-parallel ``jobs`` (an estimate's rows) that no cache answers,
    shared between this process and forked workers (``_workers``: one replay each at least),
    where a first command would otherwise make them one after another: the main job's seven on
    this project's 2-core machine, its process 1,175 M instructions where it ran 1,339 M making
    them all (``benchmarks/instructions.py``; 0.016–0.029 s of wall time, ``compare.py``). Each
    worker keeps its answers on disk (``replaycache``, as ``_excess`` keeps its own), sends them
    down a pipe and exits; one that dies sends fewer, and what it did not send is replayed here
    when asked."""
    workers = _workers()
    if workers < 2:
        return
    keys = (_unanswered(job, parse_alloc_conf(job.cluster.alloc_conf)) for job in jobs)
    todo = list(dict.fromkeys(key for key in keys if key is not None))
    workers = min(workers, len(todo))
    if workers < 2:
        return
    mine, *theirs = [todo[i::workers] for i in range(workers)]
    running = []
    for share in theirs:
        try:
            running.append((share, *_fork_replays(share)))
        except OSError:  # no process to be had (EAGAIN, ENOMEM): its share is replayed here
            mine += share
    for key in mine:
        excess = _replay(*key)
        _remember(key, excess)
        replaycache.store(key, excess)
    for share, pid, read in running:
        for key, excess in zip(share, _answers(pid, read)):
            _remember(key, excess)


def replay_later(job, conf: AllocConf) -> None:
    """A replay this process will soon ask for but not yet (``replayed.expandable_ahead``: the
    table's what-if, while the recommendation is searched), made meanwhile by a forked worker
    where ``_workers`` allows one; ``_excess`` takes its answer when asked (the main job's
    process: 1,069 M instructions where it ran 1,175 M). One at a time: a
    worker whose answer was not asked for is stopped when the next starts, or as the process
    exits."""
    key = _unanswered(job, conf) if _workers() > 1 else None
    if key is None or key in _PENDING:
        return
    _stop_pending()
    with contextlib.suppress(OSError):  # no process to be had: replayed here when asked
        _PENDING[key] = _fork_replays([key])


def _unanswered(job, conf: AllocConf) -> tuple[TraceShape, AllocConf] | None:
    """The key of ``job``'s data-parallel replay under ``conf`` where no answer is held or kept on
    disk (one found there is held); None where one is, or where ``job`` replays no such step (a
    CPU job, a layout's ranks)."""
    if job.train.device == "cpu" or not job.layout.is_data_parallel:
        return None
    key = (trace_shape(step_of(job)), conf)
    if key in _ANSWERS:
        return None
    kept = replaycache.load(key)
    if kept is None:
        return key
    _remember(key, kept)
    return None


_PENDING: dict[tuple[TraceShape, AllocConf], tuple[int, int]] = {}
"""``replay_later``'s worker, by the key it replays: its pid and the pipe its answer comes down."""


def _collect(key: tuple[TraceShape, AllocConf]) -> int | None:
    """The answer of ``key``'s worker (waited for); None where it died without one."""
    found = _answers(*_PENDING.pop(key))
    return found[0] if found else None


def _answers(pid: int, read: int) -> list[int]:
    """What a worker sent down its pipe, once it ended (the worker reaped)."""
    with os.fdopen(read, "rb") as answers:
        found = [int(x) for x in answers.read().split()]
    os.waitpid(pid, 0)
    return found


@atexit.register
def _stop_pending() -> None:
    """Stop the workers whose answers no one asked for (a table in JSON prints no what-if)."""
    for pid, read in list(_PENDING.values()):
        os.close(read)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    _PENDING.clear()


def _fork_replays(share: list) -> tuple[int, int]:
    """A forked worker replaying ``share``: its pid and the pipe its answers come down."""
    read, write = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(read)
        os.close(write)
        raise
    if pid == 0:  # the worker: its answers kept and sent, then gone (no exit handlers, no buffers flushed)
        try:
            os.close(read)
            found = [_replay(*key) for key in share]
            for key, excess in zip(share, found):
                replaycache.store(key, excess)
            with os.fdopen(write, "wb") as out:
                out.write(" ".join(map(str, found)).encode())
        finally:
            os._exit(0)
    os.close(write)
    return pid, read


def replayed_step(job, stage: int | None = None):
    """The step the replay follows: ``memory.Step`` for a data-parallel job; under a layout the
    rank of pipeline stage ``stage`` (None: the estimate's worst), as ``parallel.RankStep``
    counts its bytes. The data-parallel step of a TP job replays the unsliced model: at the
    Qwen3-32B TP 8 job it allocated 179 GiB against the rank's 39."""
    if job.layout.is_data_parallel:
        return step_of(job)
    index = getattr(estimate(job), "worst_stage", 0) if stage is None else stage
    return rank_step(job, pipeline.stages(job.layout, job.model.num_layers)[index])


@lru_cache(maxsize=4096)
def reserved(job, conf: AllocConf = DEFAULT_CONF, stage: int | None = None) -> Reserved:
    """Peak reserved bytes of ``job`` (of its pipeline stage ``stage``; None: the worst) under ``conf``."""
    est = estimate(job)
    if stage is not None:
        est = getattr(est, "stages", (est,))[stage]
    excess = excess_bytes(replayed_step(job, stage), conf)
    return Reserved(reserved_bytes=est.allocated_bytes + excess, excess_bytes=excess, conf=conf)
