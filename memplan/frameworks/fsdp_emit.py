"""What FSDP writes for ``--emit``: ``fully_shard`` (FSDP2) and ``FullyShardedDataParallel``
(FSDP1) wrappers whose sharding, mixed precision, offload and checkpointing are the job's."""

from __future__ import annotations

from ..precision import POLICIES
from .base import TORCH_DTYPE, header, needs

FSDP1_SHARDING = {
    "fsdp-full-shard": "FULL_SHARD",
    "fsdp-shard-grad-op": "SHARD_GRAD_OP",
    "fsdp-hybrid-shard": "HYBRID_SHARD",
    "fsdp-no-shard": "NO_SHARD",
}
FSDP2_STRATEGIES = ("fsdp-full-shard", "fsdp-shard-grad-op", "fsdp-hybrid-shard")
"""The strategies ``fully_shard`` writes (no-shard is FSDP1's NO_SHARD)."""


def _dtypes(job) -> tuple[str, str]:
    """(compute dtype, reduce dtype) of the policy: mixed-bf16 -> (bf16, bf16 unless --reduce-dtype)."""
    compute = POLICIES[job.train.precision].compute_dtype
    return compute, job.train.reduce_dtype or compute


def _mp_args(job) -> str:
    """MixedPrecisionPolicy / MixedPrecision arguments. Under autocast (amp-*) the parameters
    stay fp32 as estimated: no param_dtype, only an explicit --reduce-dtype."""
    compute, reduce = _dtypes(job)
    if POLICIES[job.train.precision].autocast:
        return f"reduce_dtype={TORCH_DTYPE[reduce]}" if job.train.reduce_dtype else ""
    return f"param_dtype={TORCH_DTYPE[compute]}, reduce_dtype={TORCH_DTYPE[reduce]}"


def _autocast_lines(job) -> list[str]:
    """The forward under torch.autocast, for amp-* (FSDP's mixed precision would be mixed-*)."""
    policy = POLICIES[job.train.precision]
    if not policy.autocast:
        return []
    return [
        "",
        "",
        "def forward(model: torch.nn.Module, *args, **kwargs):",
        f"    # {policy.id}: fp32 parameters and gradients, the forward under autocast",
        f'    with torch.autocast("cuda", dtype={TORCH_DTYPE[policy.compute_dtype]}):',
        "        return model(*args, **kwargs)",
    ]


def _ac_lines(job, indent: str) -> list[str]:
    ac = job.train.activation_checkpointing
    if ac == "none":
        return []
    target = "block_cls" if ac == "full" else "attention_cls"
    note = "each block's input kept, the block recomputed" if ac == "full" else "attention recomputed"
    return [
        f"{indent}# activation checkpointing {ac}: {note}",
        f"{indent}apply_activation_checkpointing(",
        (
            f"{indent}    model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, "
            "checkpoint_impl=CheckpointImpl.NO_REENTRANT),"
        ),
        f"{indent}    check_fn=lambda m: isinstance(m, {target}))",
    ]


def _ac_imports(job) -> list[str]:
    if job.train.activation_checkpointing == "none":
        return []
    return [
        "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (",
        "    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)",
    ]


def fsdp2_snippet(job, strategy) -> str:
    """``fully_shard`` per block, then the root (torchtitan's parallelize order: AC first)."""
    needs(job, "fsdp2", FSDP2_STRATEGIES)
    c, mp = job.cluster, _mp_args(job)
    mesh = (
        f'init_device_mesh("cuda", ({c.num_nodes}, {c.gpus_per_node}), mesh_dim_names=("replicate", "shard"))'
        if strategy.shard_group == "node"
        else f'init_device_mesh("cuda", ({c.gpus},))'
    )
    offload = job.plan.offload in ("params", "all")
    imported = "CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy" if mp else "CPUOffloadPolicy, OffloadPolicy"
    policies = "mp_policy=mp, offload_policy=offload" if mp else "offload_policy=offload"
    lines = [
        f"# {header(job)}",
        "import functools",
        "",
        "import torch",
        "from torch.distributed.device_mesh import init_device_mesh",
        f"from torch.distributed.fsdp import {imported}, fully_shard",
        *_ac_imports(job),
        "",
        "",
        "def wrap(model: torch.nn.Module, block_cls: type, attention_cls: type | None = None) -> torch.nn.Module:",
        f"    mesh = {mesh}",
        *([f"    mp = MixedPrecisionPolicy({mp})"] if mp else []),
        f"    offload = {'CPUOffloadPolicy()' if offload else 'OffloadPolicy()'}",
        *_ac_lines(job, "    "),
        "    # shard each block (or the checkpoint wrapper around it), then the root",
        "    wrappers = {id(getattr(m, '_checkpoint_wrapped_module', None)): m for m in model.modules()}",
        "    for block in [m for m in model.modules() if isinstance(m, block_cls)]:",
        (
            f"        fully_shard(wrappers.get(id(block), block), mesh=mesh, {policies}, "
            f"reshard_after_forward={job.post_forward_group or strategy.reshard_after_forward})"
        ),
        f"    fully_shard(model, mesh=mesh, {policies}, reshard_after_forward=False)",
        "    return model",
        *_autocast_lines(job),
        "",
    ]
    return "\n".join(lines)


def fsdp1_snippet(job, strategy) -> str:
    """``FullyShardedDataParallel`` with a transformer auto-wrap policy per block; with
    ``--fsdp-wrap none`` without one (the whole model one unit), with the original parameters as
    Lightning's FSDPStrategy passes them, as it was measured."""
    needs(job, "fsdp1", tuple(FSDP1_SHARDING))
    compute, _ = _dtypes(job)
    mp, offload = _mp_args(job), job.plan.offload in ("params", "all")
    if mp and not POLICIES[job.train.precision].autocast:
        mp += f", buffer_dtype={TORCH_DTYPE[compute]}"
    one_unit = job.one_fsdp_unit
    wrap_policy = "functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={block_cls})"
    policy = (
        "        use_orig_params=True,  # no auto_wrap_policy: the whole model one unit (--fsdp-wrap none)"
        if one_unit
        else f"        auto_wrap_policy={wrap_policy},"
    )
    lines = [
        f"# {header(job)}",
        *([] if one_unit else ["import functools", ""]),
        "import torch",
        (
            "from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel as FSDP, "
            f"{'MixedPrecision, ' if mp else ''}ShardingStrategy"
        ),
        *([] if one_unit else ["from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy"]),
        *_ac_imports(job),
        "",
        "",
        "def wrap(model: torch.nn.Module, block_cls: type, attention_cls: type | None = None) -> torch.nn.Module:",
        "    model = FSDP(",
        "        model,",
        f"        sharding_strategy=ShardingStrategy.{FSDP1_SHARDING[strategy.id]},",
        policy,
        *([f"        mixed_precision=MixedPrecision({mp}),"] if mp else []),
        f"        cpu_offload=CPUOffload(offload_params={offload}),",
        "        device_id=torch.cuda.current_device(),",
        "    )",
        *_ac_lines(job, "    "),
        "    return model",
        *_autocast_lines(job),
        "",
    ]
    return "\n".join(lines)
