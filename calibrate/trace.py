"""``--mode trace``: the job at its real size with no bytes allocated (issue 26).

The job runs as ``--mode emulate`` runs it (``calibrate.measure.run``: the same model, wrapper,
recipe loop and MemTracker categories, rank 0 of a fake process group at the real world size),
but under ``torch._subclasses.FakeTensorMode``: every tensor is a FakeTensor, with its shape,
dtype and storage size and no data, so an 8B model at 32k tokens traces on a laptop. The
step's every storage allocation and free (``calibrate.alloctrace.Recorder``) is replayed
through memplan's caching-allocator model (``memplan.allocator.replay``) for the reserved peak,
in the step's own event order.

Two things of torch 2.13 are held off while tracing (``_fake_safe``):

- ``init_device_mesh`` and ``DeviceMesh`` (also built inside FSDP2 for a DP × TP mesh) build the
  mesh from a real tensor (``torch.arange``) and read it back (``.tolist()``, ``nonzero``), which
  a FakeTensor cannot do: meshes are built outside every mode;
- DTensor's sharding propagation infers an op's global output shape by running the op on
  global-size fake tensors (``ShardingPropagator._propagate_tensor_meta_non_cached``) under
  the fake mode it detects, that is ours, below the MemTracker and the Recorder, which would
  count those global-size temporaries (an FSDP2 optimizer step's ``_foreach`` ops over whole
  unsharded parameters): the propagation runs outside every mode, in a fake mode of its own.

What differs from a GPU: the kernels are the CPU ones (SDPA lowers to the CPU flash kernel,
whose output and logsumexp per-op SAC recomputes where CUDA's are saved). FSDP2's all-gather
copy-in and reduce-scatter streams are told apart (``_side_streams``); frees wait on no other
stream (a GPU frees a block once the streams that used it caught up).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch.distributed as dist

from memplan.allocator import Alloc, Free, replay
from memplan.specs import Job
from memplan.strategies import STRATEGIES

from . import measure, tensor_parallel
from .alloctrace import Recorder
from .records import UserModel
from .wrappers import Unsupported

DEVICE = "trace (fake tensors, cpu kernels)"
"""The ``device`` of a trace measurement: no device ran it."""


def refusal(job: Job, user: UserModel | None = None) -> str | None:
    """Why trace mode cannot run this job (one line), or None."""
    strategy = STRATEGIES[job.plan.strategy]
    layout = job.layout
    if user is not None and (layout.tp > 1 or job.plan.ep > 1):
        return f"--mode trace applies no TP or EP plan to {user.name()}: its module names are its own"
    if strategy.framework not in ("none", "ddp", "fsdp"):
        return f"--mode trace wraps FSDP2, not {strategy.id} ({strategy.framework})"
    for name, degree in (("cp", layout.cp), ("pp", layout.pp)):
        if degree > 1:
            return f"--mode trace does not trace --{name} {degree} yet; it traces one GPU, FSDP2 and FSDP2 × TP"
    tp_reason = tensor_parallel.refusal(job, "trace")
    if tp_reason:
        return tp_reason
    if strategy.framework == "ddp":
        # DistributedDataParallel's C++ Reducer allocates its buckets and broadcasts the module's
        # states on real storage, which fake tensors do not have ("data is not allocated yet")
        return "--mode trace does not trace ddp (its C++ reducer needs real storage); use --mode emulate"
    if job.plan.offload != "none":
        return f"--mode trace does not trace --offload {job.plan.offload} (FSDP2's CPU offload copies real host memory)"
    if job.train.compile:
        return "--mode trace does not run torch.compile yet (inductor under fake tensors); drop --compile"
    if job.train.finetune != "full":
        # peft's cast (calibrate.finetune.adapt: module.to) swaps each parameter for its cast copy,
        # which torch refuses for a tensor the recorder holds a weak reference to
        return f"--mode trace does not trace --finetune {job.train.finetune} yet; use --mode emulate"
    return None


@contextlib.contextmanager
def _fake_safe() -> Iterator[None]:
    """The two torch 2.13 steps that a fake mode breaks or miscounts, run outside every mode
    (the module docstring says why)."""
    import torch.distributed.device_mesh as device_mesh
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    def outside_modes(fn):
        def call(*args, **kwargs):
            with _disable_current_modes():
                return fn(*args, **kwargs)

        return call

    mesh_cls = device_mesh.DeviceMesh
    saved = (device_mesh.init_device_mesh, mesh_cls.__init__, ShardingPropagator._propagate_tensor_meta_non_cached)
    device_mesh.init_device_mesh = outside_modes(saved[0])
    mesh_cls.__init__ = outside_modes(saved[1])  # type: ignore[method-assign]
    ShardingPropagator._propagate_tensor_meta_non_cached = outside_modes(saved[2])  # type: ignore[method-assign]
    try:
        yield
    finally:
        device_mesh.init_device_mesh = saved[0]
        mesh_cls.__init__ = saved[1]  # type: ignore[method-assign]
        ShardingPropagator._propagate_tensor_meta_non_cached = saved[2]  # type: ignore[method-assign]


def _device_peak_only(self, peak_state) -> None:
    """MemTracker._update_peak_stats (torch 2.13 mem_tracker.py) without its per-module peaks,
    which walk every tracked module after every op (quadratic at 32+ blocks) and which nothing
    here reads: the device's peak and its snapshot by category, as there."""
    from copy import deepcopy

    for dev, dev_snap in self._curr_mem_snap.items():
        if self._peak_mem.get(dev, 0) < dev_snap["Total"]:
            self._peak_mem[dev] = dev_snap["Total"]
            self._peak_mem_snap[dev] = deepcopy(dev_snap)


@contextlib.contextmanager
def _fast_tracker() -> Iterator[None]:
    from torch.distributed._tools.mem_tracker import MemTracker

    saved = MemTracker._update_peak_stats
    MemTracker._update_peak_stats = _device_peak_only  # type: ignore[method-assign]
    try:
        yield
    finally:
        MemTracker._update_peak_stats = saved  # type: ignore[method-assign]


@contextlib.contextmanager
def _side_streams(recorder: Recorder) -> Iterator[None]:
    """FSDP2's side streams told apart on CPU: it runs its all-gather copy-in and its
    reduce-scatter under ``device_handle.stream(...)`` (torch 2.13 _fsdp_collectives.py
    ``foreach_all_gather``, ``foreach_reduce``), a no-op ``torch.cpu.stream`` here; while one is
    entered, the recorder's allocations are on that stream, numbered in order of first use as
    ``calibrate.alloctrace.from_snapshot`` numbers CUDA's. On an H100 the 8B FSDP 8 16k run's own
    events replayed on one stream gave the one-stream trace's reserved, on their streams the
    GPU's (validation/records/gpu_trace_check_h100.md)."""
    import torch

    saved, numbers = torch.cpu.stream, {id(torch.cpu.current_stream()): 0}

    @contextlib.contextmanager
    def stream(side) -> Iterator[None]:
        outer = recorder.stream
        recorder.stream = numbers.setdefault(id(side), len(numbers))
        try:
            yield
        finally:
            recorder.stream = outer

    torch.cpu.stream = stream  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cpu.stream = saved


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[Recorder]:
    """Rank 0 of a fake process group of ``world_size``, under a FakeTensorMode, recording."""
    from torch._subclasses import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    recorder = Recorder()
    try:
        # allow_non_fake_inputs: module-level constants (a real scalar tensor) meet fake ones
        with (
            _fake_safe(),
            _fast_tracker(),
            FakeTensorMode(allow_non_fake_inputs=True),
            recorder,
            _side_streams(recorder),
        ):
            yield recorder
    finally:
        dist.destroy_process_group()


def after_setup(events: list[Alloc | Free], start: int) -> list[Alloc | Free]:
    """The events from ``start`` on, after the storages live there allocated afresh, in the
    order they were allocated: the run as an allocator meets it when the model was built on
    the meta device and materialized already sharded (torchtitan's ``to_empty`` after
    ``fully_shard``), not built whole and then sharded, as the harness builds it."""
    live: dict[int, Alloc] = {}
    for event in events[:start]:
        if isinstance(event, Alloc):
            live[event.id] = event
        else:
            live.pop(event.id, None)
    return [*live.values(), *events[start:]]


@contextlib.contextmanager
def _mark_setup(recorder: Recorder) -> Iterator[list[int]]:
    """The index of the first event after the model is wrapped and its optimizer built
    (``measure._optimizer`` is the last step of ``measure.run``'s setup)."""
    saved = measure._optimizer
    mark: list[int] = []

    def optimizer(model, job):
        built = saved(model, job)
        mark.append(len(recorder.events))
        return built

    measure._optimizer = optimizer
    try:
        yield mark
    finally:
        measure._optimizer = saved


def _on_cpu(job: Job) -> Job:
    """The job on the CPU meter (MemTracker) and CPU kernels, whatever device it plans for."""
    return dataclasses.replace(job, train=dataclasses.replace(job.train, device="cpu"))


def run(
    job: Job, *, steps: int = 2, warmup: int = 1, workload: str = "native", user: UserModel | None = None
) -> measure.Measurement:
    """The measurement ``--mode emulate`` would make, traced: no bytes allocated; with the
    reserved peak of the run's events from the sharded model on (``after_setup``; the pool the
    measured step meets was filled by the steps before it) replayed through memplan's allocator.
    ``user``: the model built by its own code (``calibrate.usermodel``), not the spec's."""
    reason = refusal(job, user)
    if reason:
        raise Unsupported(reason)
    workload_of_user = None
    if user is not None:
        from .usermodel import UserWorkload

        workload_of_user = UserWorkload(user)
    with (
        fake_world(job.cluster.gpus) as recorder,
        tensor_parallel.tensor_parallel(job, workload, "cpu"),
        _mark_setup(recorder) as mark,
    ):
        measured = measure.run(
            _on_cpu(job), steps=steps, warmup=warmup, emulated=True, workload=workload, user=workload_of_user
        )
    replayed = replay(after_setup(recorder.events, mark[0]))
    return dataclasses.replace(
        measured,
        device=DEVICE,
        peak_reserved_bytes=replayed.peak_reserved_bytes,
        step_time_s=0.0,
        tokens_per_s=0.0,
    )
