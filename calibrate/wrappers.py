"""How the harness wraps a model with each framework, keyed by the framework ids of
``memplan.frameworks`` (memplan itself never imports torch). A framework with no entry here
(DeepSpeed) is not driven by the harness."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from memplan.frameworks import FRAMEWORKS
from memplan.precision import POLICIES
from memplan.specs import Job
from memplan.strategies import STRATEGIES

from .workloads import blocks

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Unsupported(ValueError):
    """A configuration this harness cannot run here (e.g. DeepSpeed not installed)."""


def _single(model: nn.Module, job: Job, emulated: bool) -> nn.Module:
    return model


def _ddp(model: nn.Module, job: Job, emulated: bool) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model)
    if emulated:
        # the fake backend's all-reduce returns no tensor: hand the bucket back unchanged
        def keep_bucket(_, bucket):
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        ddp.register_comm_hook(None, keep_bucket)
    return ddp


def _fsdp(model: nn.Module, job: Job, emulated: bool) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    strategy, policy = STRATEGIES[job.plan.strategy], POLICIES[job.train.precision]
    world = dist.get_world_size()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if strategy.id == "fsdp-no-shard":
        mesh = init_device_mesh(device, (world, 1), mesh_dim_names=("replicate", "shard"))
    elif strategy.shard_group == "node":
        per_node = job.cluster.gpus_per_node
        mesh = init_device_mesh(device, (world // per_node, per_node), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device, (world,))
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": strategy.reshard_after_forward}
    if policy.master:
        reduce = job.train.reduce_dtype
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=DTYPES[policy.compute_dtype],
            reduce_dtype=DTYPES[reduce] if reduce else None,
        )
    if job.plan.offload != "none":
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


WRAPPERS = {"none": _single, "ddp": _ddp, "fsdp": _fsdp}


def wrap(model: nn.Module, job: Job, emulated: bool) -> nn.Module:
    """The model under the job's framework and precision, as memplan estimates it."""
    strategy, policy = STRATEGIES[job.plan.strategy], POLICIES[job.train.precision]
    if strategy.framework not in WRAPPERS:
        raise Unsupported(
            f"{strategy.id} needs {FRAMEWORKS[strategy.framework].label}, which this harness does not drive"
        )
    if not strategy.runs_natively(policy.id):
        raise Unsupported(f"{policy.id} under {strategy.id} has no native torch implementation")
    # a fine-tune's model was cast before its adapters were added (calibrate.finetune): peft
    # keeps them in fp32, as a cast here would not
    if policy.low_precision_params and not policy.master and job.train.finetune == "full":
        model = model.to(DTYPES[policy.param_dtype])
    return WRAPPERS[strategy.framework](model, job, emulated)
