"""Record the allocation and free events of a real training step, in order, with their sizes:
the trace ``memplan.allocator`` replays.

Every tensor an operator returns (a ``TorchDispatchMode`` sees forward, backward and the
optimizer step) is looked at for its storage; a storage seen for the first time is an
allocation, and a weak reference to it reports its free when the storage dies, as torch's
MemTracker (``torch.distributed._tools.mem_tracker``) tracks storages. Parameters, which
exist before the first step, are allocated at the head of the trace. On CPU this is the
order and the sizes the caching allocator would see on a GPU for the same single-device
step (one stream: CPU has no others).

    python -m calibrate.alloctrace --layers 2 --hidden 64 --out trace.jsonl.gz
"""

from __future__ import annotations

import gzip
import json
import weakref
from functools import partial
from itertools import count
from pathlib import Path

import torch
from torch._guards import active_fake_mode
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from memplan.allocator import Alloc, Free
from memplan.specs import Job

from .measure import _optimizer
from .workloads import build_model, make_batch


class Recorder(TorchDispatchMode):
    """Storage births and deaths of every tensor operators produce, in order.

    A storage resized in place (``UntypedStorage.resize_``, which no dispatch mode sees: FSDP2
    frees an unsharded parameter with ``resize_(0)`` and gathers it again into the same storage)
    is a free of its old bytes and an allocation of its new ones; ``resize_`` is wrapped while
    the recorder is active, as MemTracker's ``_track_resize`` does.
    """

    def __init__(self) -> None:
        super().__init__()
        self.events: list[Alloc | Free] = []
        self.ids = count()
        self.slot_ids = count()
        self.slots: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """storage -> its slot; a slot holds the event id of the storage's live bytes."""
        self.live: dict[int, int | None] = {}
        self.refs: dict[int, weakref.ref] = {}
        self.stream = 0
        """The stream new allocations are made on (``calibrate.trace``'s ``_side_streams`` sets it)."""

    def see(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage not in self.slots:
            self._track(storage)

    def _track(self, storage: torch.UntypedStorage) -> int:
        slot = next(self.slot_ids)
        self.slots[storage] = slot
        self.live[slot] = None
        self.refs[slot] = weakref.ref(storage, partial(self._died, slot))
        self._alloc(slot, storage.nbytes())
        return slot

    def _alloc(self, slot: int, nbytes: int) -> None:
        if nbytes:
            i = next(self.ids)
            self.live[slot] = i
            self.events.append(Alloc(i, nbytes, self.stream))

    def _release(self, slot: int) -> None:
        i = self.live[slot]
        if i is not None:
            self.live[slot] = None
            self.events.append(Free(i))

    def _died(self, slot: int, _: weakref.ref) -> None:
        self._release(slot)
        del self.live[slot], self.refs[slot]

    def resized(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        slot = self.slots.get(storage)
        if slot is None:
            self._track(storage)
            return
        self._release(slot)
        self._alloc(slot, nbytes)

    def __enter__(self):
        resize = self._resize = torch.UntypedStorage.resize_

        def resize_(storage, nbytes):
            out = resize(storage, nbytes)
            self.resized(storage, storage.nbytes())
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
        return super().__enter__()

    def __exit__(self, *args):
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        return super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # as torch's MemTracker does (mem_tracker.py __torch_dispatch__): a DTensor op is left
        # to DTensor, whose local ops on the shards come back here (a DTensor's own storage is
        # a wrapper's, holding no bytes); under fake tensors, wait_tensor's meta kernel returns
        # a new tensor where eager returns its input
        if DTensor in types:
            return NotImplemented
        if func is torch.ops._c10d_functional.wait_tensor.default and active_fake_mode():
            return args[0]
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.see(leaf)
        return out


class LiveBytes(Recorder):
    """The recorder's births and deaths summed as they happen: the bytes of the storages alive
    now and their peak since ``reset_peak``. A meter that installs no module hooks (MemTracker's
    ModTracker registers multi-grad hooks on every module's inputs, which keep the graphs they
    close over alive: measured on peft's DoRA, validation/records/peft_dora_cpu.md)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def _alloc(self, slot: int, nbytes: int) -> None:
        super()._alloc(slot, nbytes)
        if nbytes:
            self.sizes[slot] = nbytes
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _release(self, slot: int) -> None:
        super()._release(slot)
        self.live_bytes -= self.sizes.pop(slot, 0)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes
        self.events.clear()  # the births and deaths are summed: the list need not grow


def record(job: Job, *, steps: int = 2) -> list[Alloc | Free]:
    """The events of ``steps`` training steps of ``job`` on one CPU device (no wrapper)."""
    train = job.train
    torch.manual_seed(0)
    model = build_model(job.model, attention=train.attention, ac=train.activation_checkpointing)
    inputs, labels = make_batch(job.model, micro_batch=train.micro_batch, seq_len=train.seq_len, device="cpu")
    optimizer = _optimizer(model, job)
    recorder = Recorder()
    for p in model.parameters():
        recorder.see(p)
    with recorder:
        for _ in range(steps):
            loss, logits = model(inputs, labels)
            loss.backward()
            del loss, logits
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return recorder.events


def _row(e: Alloc | Free) -> list:
    if isinstance(e, Free):
        return ["f", e.id]
    return ["a", e.id, e.size] + ([e.stream] if e.stream else [])


def save(events: list[Alloc | Free], path: Path) -> None:
    """One JSON list per event (``["a", id, size]``, ``["a", id, size, stream]`` off the first
    stream, or ``["f", id]``), gzip-compressed."""
    with gzip.open(path, "wt") as f:
        for e in events:
            f.write(json.dumps(_row(e)) + "\n")


def load(path: Path) -> list[Alloc | Free]:
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    return [Alloc(*r[1:]) if r[0] == "a" else Free(r[1]) for r in rows]


def from_snapshot(snapshot: dict, device: int = 0) -> list[Alloc | Free]:
    """The events of a CUDA caching-allocator snapshot (``torch.cuda.memory._snapshot()`` taken
    with ``_record_memory_history`` on) in the form ``memplan.allocator`` replays.

    The device's ``device_traces`` hold, in order, an ``alloc`` per request (its address, the
    requested size: ``orig_size`` in CUDACachingAllocator.cpp's ``malloc`` record_trace, which
    the replay rounds as the allocator does; its stream) and a ``free_completed`` when the block went back to the pool
    (after the streams it was recorded on caught up: ``free_requested`` comes first and is not
    a free yet; torch/cuda/_memory_viz.py reads them the same way). Streams are numbered in
    order of first use, the first one 0. A free of a block allocated before the history was
    switched on has no allocation here and is dropped.
    """
    events: list[Alloc | Free] = []
    live: dict[int, int] = {}
    streams: dict[int, int] = {}
    ids = count()
    for entry in snapshot["device_traces"][device]:
        action, addr = entry["action"], entry.get("addr")
        if action == "alloc":
            i = next(ids)
            live[addr] = i
            events.append(Alloc(i, entry["size"], streams.setdefault(entry.get("stream", 0), len(streams))))
        elif action == "free_completed" and addr in live:
            events.append(Free(live.pop(addr)))
    return events
