"""Launch configuration for a recommended job: an FSDP2 or FSDP1 wrapping snippet, an
Accelerate config, a DeepSpeed config, a torchrun / srun command line. Text only; nothing
here imports torch. Bucket sizes come from tables/deepspeed.csv, the same numbers the
memory model charges.
"""
from __future__ import annotations

import json

import yaml

from .catalog import deepspeed_defaults
from .errors import MemplanError
from .specs import Job
from .strategies import STRATEGIES

KINDS = ("fsdp2", "fsdp1", "accelerate", "deepspeed", "torchrun")
_TORCH_DTYPE = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32"}
_FSDP1_SHARDING = {"fsdp-full-shard": "FULL_SHARD", "fsdp-shard-grad-op": "SHARD_GRAD_OP",
                   "fsdp-hybrid-shard": "HYBRID_SHARD", "fsdp-no-shard": "NO_SHARD"}
_ZERO_STAGE = {"zero1": 1, "zero2": 2, "zero3": 3}
WRITES = {"fsdp2": ("fsdp-full-shard", "fsdp-shard-grad-op", "fsdp-hybrid-shard"), "fsdp1": tuple(_FSDP1_SHARDING),
          "deepspeed": tuple(_ZERO_STAGE)}
"""The strategies each framework's own form writes (accelerate and torchrun launch any)."""


def _dtypes(job: Job) -> tuple[str, str]:
    """(compute dtype, reduce dtype) of the policy: mixed-bf16 -> (bf16, bf16 unless --reduce-dtype)."""
    precision = job.train.precision
    compute = "fp32" if precision == "fp32" else precision.split("-")[-1]
    return compute, job.train.reduce_dtype or compute


def _header(job: Job) -> str:
    t, c, p = job.train, job.cluster, job.plan
    return (f"memplan: {p.strategy}, {t.precision}, AC {t.activation_checkpointing}, offload {p.offload}, "
            f"micro-batch {t.micro_batch} x accum {t.grad_accum}, seq {t.seq_len}, {c.gpus} GPUs "
            f"({c.num_nodes} x {c.gpus_per_node})")


def _needs(job: Job, kind: str, allowed) -> None:
    if job.plan.strategy not in allowed:
        raise MemplanError(f"--emit {kind} does not apply to strategy {job.plan.strategy}; it needs one of: "
                           f"{', '.join(allowed)} (pass --strategy, or pick another --emit)")


def _ac_lines(job: Job, indent: str) -> list[str]:
    ac = job.train.activation_checkpointing
    if ac == "none":
        return []
    target = "block_cls" if ac == "full" else "attention_cls"
    note = "each block's input kept, the block recomputed" if ac == "full" else "attention recomputed"
    return [f"{indent}# activation checkpointing {ac}: {note}",
            f"{indent}apply_activation_checkpointing(",
            f"{indent}    model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, "
            "checkpoint_impl=CheckpointImpl.NO_REENTRANT),",
            f"{indent}    check_fn=lambda m: isinstance(m, {target}))"]


def _ac_imports(job: Job) -> list[str]:
    if job.train.activation_checkpointing == "none":
        return []
    return ["from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (",
            "    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)"]


def fsdp2_snippet(job: Job) -> str:
    """``fully_shard`` per block, then the root (torchtitan's parallelize order: AC first)."""
    _needs(job, "fsdp2", WRITES["fsdp2"])
    compute, reduce = _dtypes(job)
    c = job.cluster
    hybrid = STRATEGIES[job.plan.strategy].shard_group == "node"
    mesh = (f'init_device_mesh("cuda", ({c.num_nodes}, {c.gpus_per_node}), mesh_dim_names=("replicate", "shard"))'
            if hybrid else f'init_device_mesh("cuda", ({c.gpus},))')
    offload = job.plan.offload in ("params", "all")
    lines = [f"# {_header(job)}", "import functools", "", "import torch",
             "from torch.distributed.device_mesh import init_device_mesh",
             "from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard",
             *_ac_imports(job), "", "",
             "def wrap(model: torch.nn.Module, block_cls: type, attention_cls: type | None = None) -> torch.nn.Module:",
             f"    mesh = {mesh}",
             f"    mp = MixedPrecisionPolicy(param_dtype={_TORCH_DTYPE[compute]}, reduce_dtype={_TORCH_DTYPE[reduce]})",
             f"    offload = {'CPUOffloadPolicy()' if offload else 'OffloadPolicy()'}",
             *_ac_lines(job, "    "),
             "    # shard each block (or the checkpoint wrapper around it), then the root",
             "    wrappers = {id(getattr(m, '_checkpoint_wrapped_module', None)): m for m in model.modules()}",
             "    for block in [m for m in model.modules() if isinstance(m, block_cls)]:",
             f"        fully_shard(wrappers.get(id(block), block), mesh=mesh, mp_policy=mp, offload_policy=offload, "
             f"reshard_after_forward={STRATEGIES[job.plan.strategy].reshard_after_forward})",
             "    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=False)",
             "    return model", ""]
    return "\n".join(lines)


def fsdp1_snippet(job: Job) -> str:
    """``FullyShardedDataParallel`` with a transformer auto-wrap policy per block."""
    _needs(job, "fsdp1", WRITES["fsdp1"])
    compute, reduce = _dtypes(job)
    offload = job.plan.offload in ("params", "all")
    lines = [f"# {_header(job)}", "import functools", "", "import torch",
             "from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel as FSDP, MixedPrecision, "
             "ShardingStrategy",
             "from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy", *_ac_imports(job), "", "",
             "def wrap(model: torch.nn.Module, block_cls: type, attention_cls: type | None = None) -> torch.nn.Module:",
             "    model = FSDP(",
             "        model,",
             f"        sharding_strategy=ShardingStrategy.{_FSDP1_SHARDING[job.plan.strategy]},",
             "        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={block_cls}),",
             f"        mixed_precision=MixedPrecision(param_dtype={_TORCH_DTYPE[compute]}, "
             f"reduce_dtype={_TORCH_DTYPE[reduce]}, buffer_dtype={_TORCH_DTYPE[compute]}),",
             f"        cpu_offload=CPUOffload(offload_params={offload}),",
             "        device_id=torch.cuda.current_device(),",
             "    )", *_ac_lines(job, "    "), "    return model", ""]
    return "\n".join(lines)


def deepspeed_config(job: Job) -> dict:
    """A DeepSpeed config whose bucket sizes are the ones the memory model charges."""
    _needs(job, "deepspeed", WRITES["deepspeed"])
    if job.train.precision not in ("mixed-bf16", "mixed-fp16", "fp32"):
        raise MemplanError(f"--emit deepspeed needs precision mixed-bf16, mixed-fp16 or fp32, "
                           f"got {job.train.precision}")
    ds = deepspeed_defaults()
    stage = _ZERO_STAGE[job.plan.strategy]
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": ds["reduce_bucket_size"], "allgather_bucket_size": ds["allgather_bucket_size"]}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=ds["stage3_prefetch_bucket_size"],
                    stage3_max_live_parameters=ds["stage3_max_live_parameters"],
                    stage3_param_persistence_threshold=ds["stage3_param_persistence_threshold"])
    if job.plan.offload in ("optimizer", "all"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if job.plan.offload in ("params", "all"):
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    t = job.train
    config = {"train_micro_batch_size_per_gpu": t.micro_batch, "gradient_accumulation_steps": t.grad_accum,
              "train_batch_size": t.micro_batch * t.grad_accum * job.cluster.gpus,
              "bf16": {"enabled": t.precision == "mixed-bf16"}, "fp16": {"enabled": t.precision == "mixed-fp16"},
              "zero_optimization": zero}
    if t.activation_checkpointing != "none":
        config["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False}
    return config


def _autocast_under_fsdp(job: Job) -> bool:
    """accelerate's bf16/fp16 under FSDP sets a MixedPrecisionPolicy (accelerate 1.x,
    FullyShardedDataParallelPlugin.set_mixed_precision): mixed-*, not autocast."""
    return STRATEGIES[job.plan.strategy].framework == "fsdp" and job.train.precision.startswith("amp")


def accelerate_config(job: Job) -> dict:
    """``accelerate launch --config_file`` contents (accelerate's own key names)."""
    c, t, s = job.cluster, job.train, STRATEGIES[job.plan.strategy]
    compute, _ = _dtypes(job)
    config = {"compute_environment": "LOCAL_MACHINE", "machine_rank": 0, "main_training_function": "main",
              "mixed_precision": "no" if _autocast_under_fsdp(job) else {"bf16": "bf16", "fp16": "fp16"}.get(compute, "no"),
              "num_machines": c.num_nodes, "num_processes": c.gpus, "rdzv_backend": "static",
              "same_network": True, "use_cpu": False}
    if s.framework == "none":
        config["distributed_type"] = "NO"
    elif s.framework == "ddp":
        config["distributed_type"] = "MULTI_GPU"
    elif s.framework == "deepspeed":
        config["distributed_type"] = "DEEPSPEED"
        config["deepspeed_config"] = {
            "zero_stage": _ZERO_STAGE[s.id], "gradient_accumulation_steps": t.grad_accum,
            "offload_optimizer_device": "cpu" if job.plan.offload in ("optimizer", "all") else "none",
            "offload_param_device": "cpu" if job.plan.offload in ("params", "all") else "none",
            "zero3_init_flag": s.id == "zero3"}
    else:
        config["distributed_type"] = "FSDP"
        config["fsdp_config"] = {
            "fsdp_version": 2 if s.id != "fsdp-no-shard" else 1,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_reshard_after_forward": s.reshard_after_forward if s.id != "fsdp-no-shard" else "NO_SHARD",
            "fsdp_sharding_strategy": _FSDP1_SHARDING[s.id],
            "fsdp_offload_params": job.plan.offload in ("params", "all"),
            "fsdp_activation_checkpointing": t.activation_checkpointing != "none",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_use_orig_params": True}
    return config


def launch_command(job: Job, script: str = "train.py") -> str:
    """torchrun on one node; srun + torchrun (one task per node, c10d rendezvous) on several."""
    c = job.cluster
    args = f"{script} --micro-batch {job.train.micro_batch} --grad-accum {job.train.grad_accum}"
    if STRATEGIES[job.plan.strategy].framework == "none":
        return f"# {_header(job)}\npython {args}\n"
    if c.num_nodes == 1:
        return f"# {_header(job)}\ntorchrun --standalone --nproc_per_node={c.gpus_per_node} {args}\n"
    return (f"# {_header(job)}\n"
            "export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\n"
            f"srun --nodes={c.num_nodes} --ntasks-per-node=1 --gpus-per-node={c.gpus_per_node} \\\n"
            f"  torchrun --nnodes={c.num_nodes} --nproc_per_node={c.gpus_per_node} --rdzv_id=$SLURM_JOB_ID \\\n"
            f"  --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 {args}\n")


def emit(job: Job, kind: str) -> str:
    """The launch configuration of ``kind`` for ``job`` as text."""
    if kind == "fsdp2":
        return fsdp2_snippet(job)
    if kind == "fsdp1":
        return fsdp1_snippet(job)
    if kind == "accelerate":
        note = ""
        if _autocast_under_fsdp(job):
            compute, _ = _dtypes(job)
            note = (f"# {job.train.precision}: wrap the forward in torch.autocast('cuda', dtype={_TORCH_DTYPE[compute]}); "
                    "accelerate's own mixed_precision would give FSDP a MixedPrecisionPolicy (mixed-*)\n")
        return f"# {_header(job)}\n{note}" + yaml.safe_dump(accelerate_config(job), sort_keys=False)
    if kind == "deepspeed":
        return json.dumps(deepspeed_config(job), indent=2) + "\n"
    if kind == "torchrun":
        return launch_command(job)
    raise MemplanError(f"emit {kind!r} is not one of: {', '.join(KINDS)}")
