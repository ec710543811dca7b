"""How the harness wraps a model with each framework, keyed by the framework ids of
``memplan.frameworks`` (memplan itself never imports torch). DeepSpeed has no entry here: its
engine owns the step (``engine.backward``, ``engine.step``), so it runs in its own loop,
``validation.dsmatrix``, with the config memplan emits."""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from memplan.frameworks import FRAMEWORKS, runs_natively
from memplan.loop import fsdp_units
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

    ddp = DDP(model, **job.plan.ddp_kwargs())  # gradient_as_bucket_view, bucket_cap_mb, static_graph as given
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

    strategy = STRATEGIES[job.plan.strategy]
    world = dist.get_world_size()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if strategy.id == "fsdp-no-shard":
        mesh = init_device_mesh(device, (world, 1), mesh_dim_names=("replicate", "shard"))
    elif strategy.shard_group == "node":
        per_node = job.cluster.gpus_per_node
        mesh = init_device_mesh(device, (world // per_node, per_node), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device, (world,))
    return fsdp_on(model, job, mesh)


def fsdp_on(model: nn.Module, job: Job, mesh) -> nn.Module:
    """FSDP2 over ``mesh`` (the whole world, or the data-parallel dimension of a TP job) with
    the job's units, mixed precision and offload."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    strategy, policy = STRATEGIES[job.plan.strategy], POLICIES[job.train.precision]
    # full shard's integer reshard group where the plan gives one below the shard group (fully_shard's
    # own keyword; the whole group is True, as torch reads it)
    reshard = job.post_forward_group or strategy.reshard_after_forward
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard}
    if policy.master:
        reduce = job.train.reduce_dtype
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=DTYPES[policy.compute_dtype],
            reduce_dtype=DTYPES[reduce] if reduce else None,
        )
    if job.plan.offload != "none":
        kwargs["offload_policy"] = CPUOffloadPolicy()
    if job.plan.ep > 1:  # EP over the whole world: each rank's experts are its own, not sharded
        from .moe_ep import expert_parameters

        kwargs["ignored_params"] = expert_parameters(model)
    for block in blocks(model):
        fully_shard(block, **kwargs)
    units = fsdp_units(job.train.recipe)
    if units == "blocks":
        _shard_embedding_and_head(model, kwargs, fully_shard)
    # the root reshards after forward only where the recipe passes reshard_after_forward=True
    # to it explicitly (torchtune's shard_model); fully_shard's default (None) keeps it
    fully_shard(model, **{**kwargs, "reshard_after_forward": reshard if units == "all" else False})
    return model


def _shard_embedding_and_head(model: nn.Module, kwargs: dict, fully_shard) -> None:
    """torchtitan's apply_fsdp and accelerate's fsdp2_prepare_model: the input embedding its
    own unit (resharded after forward as the blocks), [final norm, lm head] one that is not
    (a tied embedding joins the head's unit)."""
    hf: Any = getattr(model, "hf", model)  # a transformers PreTrainedModel
    embed, head = hf.get_input_embeddings(), hf.get_output_embeddings()
    tied = embed.weight is head.weight
    if not tied:
        fully_shard(embed, **kwargs)
    base = getattr(hf, hf.base_model_prefix)
    norm = [m for _, m in base.named_children() if "Norm" in type(m).__name__][-1:]
    fully_shard([*norm, *([embed] if tied else []), head], **{**kwargs, "reshard_after_forward": False})


WRAPPERS = {"none": _single, "ddp": _ddp, "fsdp": _fsdp}


def wrap(model: nn.Module, job: Job, emulated: bool) -> nn.Module:
    """The model under the job's framework and precision, as memplan estimates it."""
    strategy, policy = STRATEGIES[job.plan.strategy], POLICIES[job.train.precision]
    if strategy.framework not in WRAPPERS:
        raise Unsupported(
            f"{strategy.id} needs {FRAMEWORKS[strategy.framework].label}, which this harness does not wrap "
            "(DeepSpeed runs in validation.dsmatrix)"
        )
    if not runs_natively(strategy, policy.id):
        raise Unsupported(f"{policy.id} under {strategy.id} has no native torch implementation")
    # a fine-tune's model was cast before its adapters were added (calibrate.finetune): peft
    # keeps them in fp32, as a cast here would not
    if policy.low_precision_params and not policy.master and job.train.finetune == "full":
        model = model.to(DTYPES[policy.param_dtype])
    if job.plan.ep > 1:
        from .moe_ep import apply_expert_parallel

        apply_expert_parallel(model, job.plan.ep)
    return WRAPPERS[strategy.framework](model, job, emulated)


def apply_tp(model: nn.Module, mesh, *, sp: bool, plan: str = "torchtitan") -> None:
    """A TP plan of ``layout.TP_PLANS`` on the reference llama's module names (or a pipeline stage
    of it: the embedding and head where the stage has them). torchtitan: its apply_tp
    (llama3/parallelize.py), the logits kept sharded for loss parallel; tutorial: the same with the
    head's output all-gathered (pytorch/examples fsdp_tp_example.py, torchtitan's apply_tp with
    loss parallel off); blocks: the blocks alone (the example's layer_tp_plan), no SP."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    stream = Shard(1) if sp else Replicate()
    top: dict = {}
    if plan != "blocks" and getattr(model, "embed_tokens", None) is not None:
        top["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    if plan != "blocks" and getattr(model, "lm_head", None) is not None:
        if plan == "torchtitan":  # loss parallel: the logits stay sharded over the vocabulary
            top["lm_head"] = ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False)
        else:
            top["lm_head"] = ColwiseParallel(input_layouts=stream, output_layouts=Replicate())
        if sp:
            top["norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    for block in cast(nn.ModuleList, model.layers):
        layer: dict = {
            "attn.q_proj": ColwiseParallel(),
            "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(),
            "attn.o_proj": RowwiseParallel(output_layouts=stream),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=stream),
        }
        if sp:
            layer |= {
                "input_norm": SequenceParallel(),
                "post_attention_norm": SequenceParallel(),
                "attn": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
                ),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            }
        parallelize_module(block, mesh, layer)
