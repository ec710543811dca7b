"""One calibration run inside the process that measures it (the child of a sweep, or a
rank started by torchrun). Every failure becomes an outcome: status and error text.

An outcome is ``{"status": ok | oom | failed, "measurement": dict | None, "error": str | None}``;
``timeout`` is decided by whoever watches the clock (the sweep's parent, or Slurm's
``timeout`` in a cluster script).
"""

from __future__ import annotations

import dataclasses
import os
import resource
import traceback

import torch
import torch.distributed as dist

from . import launch, layerscale, measure, tensor_parallel
from .records import Run


def _ok(measurement: measure.Measurement) -> dict:
    return {"status": "ok", "measurement": dataclasses.asdict(measurement), "error": None}


def _failed(status: str, exc: BaseException) -> dict:
    return {
        "status": status,
        "measurement": None,
        "error": f"{type(exc).__name__}: {str(exc) or 'no message'}\n{traceback.format_exc(limit=3)}".strip(),
    }


def _check_device(run: Run) -> None:
    if run.job.train.device == "cuda" and not torch.cuda.is_available():
        raise measure.Unsupported("device cuda was asked for but torch sees no CUDA device; pass --device cpu")


def limit_host_memory(budget_bytes: int) -> None:
    """Cap this process's address space (RLIMIT_AS) at ``budget_bytes`` above what it maps now.

    Measured from here, once torch is imported (torch alone maps ~3 GiB of address space);
    processes spawned later inherit the cap and re-import torch under it.
    """
    with open("/proc/self/statm") as f:
        mapped_bytes = int(f.read().split()[0]) * resource.getpagesize()
    limit = mapped_bytes + budget_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


def execute(run: Run, *, max_host_mem_bytes: int | None = None) -> dict:
    """Run a ``local`` (real processes), ``emulate`` (fake process group) or ``trace`` (fake
    tensors too) point here."""
    kwargs = dict(steps=run.steps, warmup=run.warmup, workload=run.workload)
    world = run.job.cluster.gpus

    def measure_here(job) -> measure.Measurement:
        if run.mode == "local" and not job.layout.is_data_parallel:
            raise measure.Unsupported(
                f"--mode local runs DDP and FSDP2 over the whole world, not {job.layout.describe()}; "
                "--mode emulate and trace run TP (validation.parallel_matrix measures the CPU layouts)"
            )
        if run.mode == "emulate":
            reason = tensor_parallel.refusal(job, "emulate")
            if reason:
                raise measure.Unsupported(reason)
            return launch.emulate(job, world_size=world, **kwargs)
        if run.mode == "trace":
            from . import trace

            return trace.run(job, steps=run.steps, warmup=run.warmup, workload=run.workload, user=run.user)
        if run.mode == "local":
            return launch.local(job, nprocs=world, **kwargs)[0]
        raise measure.Unsupported(f"mode {run.mode} runs under torchrun, not here")

    try:
        if run.mode != "trace":  # a trace needs no device
            _check_device(run)
        if max_host_mem_bytes:
            limit_host_memory(max_host_mem_bytes)
        if run.layers_scaled:
            return {
                "status": "ok",
                "measurement": layerscale.scaled_measurement(run.job, measure=measure_here),
                "error": None,
            }
        return _ok(measure_here(run.job))
    except launch.RankFailure as exc:
        return {"status": exc.status, "measurement": None, "error": str(exc)}
    except BaseException as exc:  # an outcome, whatever went wrong: the sweep goes on
        return _failed(launch.failure_status(exc), exc)


def execute_torchrun(run: Run) -> dict:
    """This rank's outcome of a job started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR in the env)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        _check_device(run)
        if world != run.job.cluster.gpus:
            raise measure.Unsupported(
                f"the spec is for {run.job.cluster.gpus} GPUs but torchrun started {world} processes"
            )
        on_cuda = run.job.train.device == "cuda"
        if on_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if on_cuda else "gloo")
    except BaseException as exc:
        return _failed("failed", exc)
    launch.fault_if_asked(rank)
    try:
        return _ok(measure.run(run.job, steps=run.steps, warmup=run.warmup, workload=run.workload))
    except BaseException as exc:
        return _failed(launch.failure_status(exc), exc)
    finally:
        dist.destroy_process_group()
