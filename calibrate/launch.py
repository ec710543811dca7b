"""Where a measurement runs: emulated in this process (fake process group of any world
size) or as N real local processes (gloo on CPU, nccl on GPUs)."""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from memplan.specs import Job

from . import measure


def emulate(job: Job, *, world_size: int, **run_kwargs) -> measure.Measurement:
    """One rank of a ``world_size`` job, with a fake process group: same bytes as a real rank
    (under ``--tp``, torchtitan's plan over a dp × tp mesh: ``calibrate.tensor_parallel``)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .tensor_parallel import tensor_parallel

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    on_cuda = job.train.device == "cuda" and torch.cuda.is_available()
    try:
        with tensor_parallel(job, run_kwargs.get("workload", "native"), "cuda" if on_cuda else "cpu"):
            return measure.run(job, emulated=True, **run_kwargs)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FAULT_ENV = "CALIBRATE_FAULT"
"""Test hook, ``exit:RANK`` or ``hang:RANK``: that rank exits (code 3) or hangs once the
process group is up, as a crashed or stuck rank would."""


def fault_if_asked(rank: int) -> None:
    action, _, target = os.environ.get(FAULT_ENV, "").partition(":")
    if target != str(rank):
        return
    if action == "exit":
        os._exit(3)
    if action == "hang":
        threading.Event().wait()


def failure_status(exc: BaseException) -> str:
    """``oom`` for an allocation failure (CUDA or host), ``failed`` for anything else."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return "oom"
    # the CPU allocator raises a plain RuntimeError: "DefaultCPUAllocator: can't allocate
    # memory: you tried to allocate N bytes" (c10/core/impl/alloc_cpu.cpp)
    return "oom" if isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc) else "failed"


class RankFailure(RuntimeError):
    """A rank of a local job raised or died; ``status`` is ``oom`` when one ran out of memory."""

    def __init__(self, message: str, *, status: str):
        super().__init__(message)
        self.status = status


def _worker(rank: int, world_size: int, port: int, job: Job, run_kwargs: dict, results) -> None:
    backend = "nccl" if torch.cuda.is_available() and job.train.device == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    fault_if_asked(rank)
    try:
        results.put((rank, dataclasses.asdict(measure.run(job, **run_kwargs)), None, None))
    except BaseException as exc:  # reported to the parent, which decides what failed
        results.put((rank, None, failure_status(exc), f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"))
    finally:
        dist.destroy_process_group()


def local(job: Job, *, nprocs: int, **run_kwargs) -> list[measure.Measurement]:
    """``nprocs`` real processes on this machine; one Measurement per rank.

    Raises RankFailure naming every rank that raised or exited without reporting.
    """
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, nprocs, port, job, run_kwargs, results)) for rank in range(nprocs)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    out, errors = {}, {}
    while not results.empty():
        rank, record, status, error = results.get()
        if error:
            errors[rank] = (status, error)
        else:
            out[rank] = measure.Measurement(**record)
    if errors or len(out) != nprocs:
        raise _rank_failure(procs, out, errors)
    return [out[r] for r in range(nprocs)]


def _rank_failure(procs, out: dict, errors: dict) -> RankFailure:
    silent = [
        f"rank {r} exited with code {p.exitcode} without reporting"
        for r, p in enumerate(procs)
        if r not in out and r not in errors
    ]
    raised = [f"rank {r} failed: {text}" for r, (_, text) in sorted(errors.items())]
    status = "oom" if any(s == "oom" for s, _ in errors.values()) else "failed"
    return RankFailure("; ".join(silent + raised), status=status)
