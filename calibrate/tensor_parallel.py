"""torchtitan's tensor-parallel wrapping of the harness's llama, for ``--mode trace`` (fake
tensors) and ``--mode emulate`` (real tensors on one device, fake process group)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from memplan.specs import Job
from memplan.strategies import STRATEGIES

from . import measure
from .wrappers import Unsupported


def refusal(job: Job, mode: str) -> str | None:
    """Why ``--mode MODE`` cannot run this job's layout (one line), or None: data parallel,
    alone or with TP."""
    layout, strategy = job.layout, STRATEGIES[job.plan.strategy]
    if layout.is_data_parallel:
        return None
    if layout.cp > 1 or layout.pp > 1:
        return f"--mode {mode} runs DDP, FSDP2 and FSDP2 × TP, not {layout.describe()}"
    if strategy.framework != "fsdp" and job.dp > 1:
        return f"--mode {mode} runs --tp {layout.tp} alone or under FSDP2, not under {strategy.id}"
    if job.model.arch != "llama":
        return f"--mode {mode} applies the TP plans to llama-family blocks, not to {job.model.arch}"
    return None


@contextlib.contextmanager
def tensor_parallel(job: Job, workload: str, mesh_device: str) -> Iterator[None]:
    """Under ``--tp``: ``measure.run`` builds the model without AC and wraps it as torchtitan's
    parallelize_llama does, in its order: the job's TP plan (``wrappers.apply_tp``: colwise
    q/k/v/gate/up, rowwise o/down, and by the plan SP norms, a vocabulary-parallel embedding and
    head), then AC on each block, then FSDP2 over the data-parallel mesh dimension
    (``wrappers._fsdp``'s units and mixed precision); under torchtitan's plan the loss runs under
    ``loss_parallel`` (the logits stay sharded over the vocabulary). ``measure``'s build and wrap
    are swapped for this run's. The process group must be up (the fake one: the mesh is
    ``mesh_device``'s, cpu or cuda)."""
    layout = job.layout
    if layout.tp == 1:
        yield
        return
    if workload != "native":
        raise Unsupported("the TP plan is applied to the native workload's module names; drop --workload hf")
    import torch.distributed.device_mesh as device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from . import workloads, wrappers

    ac = job.train.activation_checkpointing
    mesh = device_mesh.init_device_mesh(mesh_device, (job.dp, layout.tp), mesh_dim_names=("dp", "tp"))

    def build(spec, *, attention: str, ac: str, workload: str = "native") -> nn.Module:
        # AC wraps the blocks after the plan (its module names are the blocks' own)
        return workloads.build_model(
            spec, attention=attention, ac=ac if ac == "selective" else "none", workload=workload
        )

    def wrap(model, job, emulated):
        wrappers.apply_tp(model, mesh["tp"], sp=layout.sp, plan=layout.tp_plan)
        workloads.checkpoint_layers(model.layers, ac)
        if STRATEGIES[job.plan.strategy].framework != "fsdp":
            return model
        # over a dp mesh of one as well: torchtitan 0.3.0 "always run[s] apply_fsdp_to_decoder --
        # with shard_degree=1 it is a no-op for the all-gather but still installs the
        # MixedPrecisionPolicy" (models/llama3/parallelize.py l.69): TP alone trains mixed bf16
        return wrappers.fsdp_on(model, job, mesh["dp"])

    saved = (measure.build_model, measure.wrap)
    measure.build_model, measure.wrap = build, wrap
    try:
        with loss_parallel() if layout.loss_parallel else contextlib.nullcontext():
            yield
    finally:
        measure.build_model, measure.wrap = saved
