"""Where a measurement runs: emulated in this process (fake process group of any world
size) or as N real local processes (gloo on CPU, nccl on GPUs)."""
from __future__ import annotations

import dataclasses
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from memplan.specs import Job

from . import measure


def emulate(job: Job, *, world_size: int, **run_kwargs) -> measure.Measurement:
    """One rank of a ``world_size`` job, with a fake process group: same bytes as a real rank."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        return measure.run(job, emulated=True, **run_kwargs)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, job: Job, run_kwargs: dict, results) -> None:
    backend = "nccl" if torch.cuda.is_available() and job.train.device == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        results.put((rank, dataclasses.asdict(measure.run(job, **run_kwargs)), None))
    except BaseException as exc:  # reported to the parent, which decides what failed
        results.put((rank, None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"))
    finally:
        dist.destroy_process_group()


def local(job: Job, *, nprocs: int, **run_kwargs) -> list[measure.Measurement]:
    """``nprocs`` real processes on this machine; one Measurement per rank."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, nprocs, port, job, run_kwargs, results)) for rank in range(nprocs)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    out = {}
    while not results.empty():
        rank, record, error = results.get()
        if error:
            raise RuntimeError(f"rank {rank} failed: {error}")
        out[rank] = measure.Measurement(**record)
    if len(out) != nprocs:
        codes = [p.exitcode for p in procs]
        raise RuntimeError(f"only {len(out)} of {nprocs} ranks reported (exit codes {codes})")
    return [out[r] for r in range(nprocs)]
