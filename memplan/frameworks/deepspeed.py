"""DeepSpeed ZeRO stages 1-3: its bf16 / fp16 optimizer, gather and reduce buckets, and
the config that sets the bucket sizes the memory model charges (tables/deepspeed.csv)."""

from __future__ import annotations

import json
from typing import ClassVar

from ..breakdown import Component
from ..catalog import deepspeed_defaults
from ..errors import MemplanError
from ..precision import POLICIES
from .base import Emitter, Framework, needs, term

B = Component.BUFFERS
ZERO_STAGE = {"zero1": 1, "zero2": 2, "zero3": 3}


def config(job, strategy) -> dict:
    """A DeepSpeed config whose bucket sizes are the ones the memory model charges."""
    needs(job, "deepspeed", tuple(ZERO_STAGE))
    policy = POLICIES[job.train.precision]
    if policy.id not in DeepSpeed.native_precisions:
        raise MemplanError(
            lambda n: (
                f"{n('emit')} deepspeed needs {n('precision')} "
                f"{', '.join(DeepSpeed.native_precisions[1:])} or {DeepSpeed.native_precisions[0]}, got {policy.id}"
            )
        )
    ds = deepspeed_defaults()
    stage = ZERO_STAGE[strategy.id]
    zero: dict[str, object] = {
        "stage": stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": ds["reduce_bucket_size"],
        "allgather_bucket_size": ds["allgather_bucket_size"],
    }
    if stage == 3:
        zero.update(
            stage3_prefetch_bucket_size=ds["stage3_prefetch_bucket_size"],
            stage3_max_live_parameters=ds["stage3_max_live_parameters"],
            stage3_param_persistence_threshold=ds["stage3_param_persistence_threshold"],
        )
    if job.plan.offload in ("optimizer", "all"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if job.plan.offload in ("params", "all"):
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    t = job.train
    # bf16 / fp16 modes keep fp32 master weights: they are mixed-*, never autocast
    config = {
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.micro_batch * t.grad_accum * job.cluster.gpus,
        "bf16": {"enabled": policy.master and policy.compute_dtype == "bf16"},
        "fp16": {"enabled": policy.master and policy.compute_dtype == "fp16"},
        "zero_optimization": zero,
    }
    if t.activation_checkpointing != "none":
        config["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False}
    return config


def config_json(job, strategy) -> str:
    return json.dumps(config(job, strategy), indent=2) + "\n"


class DeepSpeed(Framework):
    id = "deepspeed"
    label = "DeepSpeed"
    # its bf16 / fp16 optimizer modes keep master weights; torch.autocast is not a DeepSpeed
    # precision mode, and `--emit deepspeed` writes only these
    native_precisions = ("fp32", "mixed-bf16", "mixed-fp16")
    emitters: ClassVar[dict[str, Emitter]] = {"deepspeed": config_json}

    def gathered(self, step, instant: str) -> list:
        ds, bp = deepspeed_defaults(), step.block_params
        terms = []
        if step.strategy.shards_params:
            prefetch = min(ds["stage3_prefetch_bucket_size"], bp)
            live = bp if instant != "loss" else max(bp, step.root_params)
            terms.append(
                term(
                    B,
                    "zero3.gathered",
                    "gathered unit + prefetch bucket (ZeRO-3)",
                    f"{step.gather_bytes}·{live + prefetch:,}",
                    step.gather_bytes * (live + prefetch),
                )
            )
        if instant != "forward":
            # backward() allocates an ipg bucket of reduce_bucket_size elements (contiguous_gradients)
            bucket, nbytes = ds["reduce_bucket_size"], step.policy.grad_bytes
            terms.append(
                term(
                    B,
                    "zero.ipg_bucket",
                    "ipg reduce bucket",
                    f"{nbytes}·reduce_bucket_size ({bucket:.0e})",
                    nbytes * bucket,
                )
            )
        return terms

    def step_buffers(self, step) -> list:
        if not step.policy.master:
            return []
        # stage_1_and_2.py: reduced bf16 gradients are copied into an fp32 partition for the step
        sharded = step.strategy.shards_optimizer
        return [
            term(
                B,
                "deepspeed.fp32_grad_partition",
                "fp32 gradient partition",
                f"4·P{step.div(sharded)}",
                4 * step.local(step.params, sharded),
            )
        ]

    def accelerate(self, job, strategy) -> dict:
        offload = job.plan.offload
        return {
            "distributed_type": "DEEPSPEED",
            "deepspeed_config": {
                "zero_stage": ZERO_STAGE[strategy.id],
                "gradient_accumulation_steps": job.train.grad_accum,
                "offload_optimizer_device": "cpu" if offload in ("optimizer", "all") else "none",
                "offload_param_device": "cpu" if offload in ("params", "all") else "none",
                "zero3_init_flag": strategy.id == "zero3",
            },
        }
