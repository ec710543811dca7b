"""An accelerate config YAML (``accelerate config`` output, ``accelerate launch --config_file``;
accelerate commands/config/config_args.py ``ClusterConfig``): the strategy (``distributed_type`` and
its ``fsdp_config`` / ``deepspeed_config`` section), the precision, the world size, offload, FSDP's
activation checkpointing and ``dynamo_config``. The loop's conventions are memplan's ``accelerate``
recipe (tables/recipes.csv); the batch is the training script's (``--micro-batch``).

``mixed_precision`` means what accelerate does with it: autocast over fp32 parameters without a
sharding plugin (amp-bf16 / amp-fp16), FSDP's MixedPrecisionPolicy under FSDP and DeepSpeed's bf16 /
fp16 modes under DeepSpeed (both keep fp32 master weights: mixed-bf16 / mixed-fp16).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import deepspeed as _deepspeed
from .base import FileConfig, classify, refuse
from .torchtune import _load as _load_yaml

FSDP_SHARDING = {
    "FULL_SHARD": "fsdp-full-shard",
    "SHARD_GRAD_OP": "fsdp-shard-grad-op",
    "NO_SHARD": "fsdp-no-shard",
    "HYBRID_SHARD": "fsdp-hybrid-shard",
}
"""torch's ShardingStrategy names (accelerate FSDP_SHARDING_STRATEGY; 1-4 their numbers) as memplan's
strategies; HYBRID_SHARD_ZERO2 (5) has none."""
PLAIN = {"NO": "single", "MULTI_GPU": "ddp", "MULTI_CPU": "ddp"}


def read(path: Path) -> FileConfig:
    return parse(_load_yaml(path), path)


def _precision(where: str, value: Any, sharded: bool) -> str:
    value = str(value).lower()
    if value == "no":
        return "fp32"
    if value not in ("bf16", "fp16"):
        raise refuse(where, "mixed_precision", value, "no, bf16 or fp16")
    return f"{'mixed' if sharded else 'amp'}-{value}"


def _fsdp(where: str, section: dict) -> dict[str, Any]:
    version = section.get("fsdp_version", 1)
    if version not in (1, 2):
        raise refuse(where, "fsdp_config.fsdp_version", version, "1 or 2")
    policy = section.get("fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP")
    # NO_WRAP: FSDP1 over the whole model, one unit (fsdp_wrap none, measured under FSDP1 alone)
    wraps = ("TRANSFORMER_BASED_WRAP", "NO_WRAP") if version == 1 else ("TRANSFORMER_BASED_WRAP",)
    if policy not in wraps:
        raise refuse(
            where,
            "fsdp_config.fsdp_auto_wrap_policy",
            policy,
            "TRANSFORMER_BASED_WRAP (one unit per block)" + (", NO_WRAP (one unit)" if version == 1 else ""),
        )
    prefetch = section.get("fsdp_backward_prefetch")
    if prefetch not in (None, "BACKWARD_PRE"):
        raise refuse(where, "fsdp_config.fsdp_backward_prefetch", prefetch, "BACKWARD_PRE (FSDP's default)")
    field, value = "fsdp_config.fsdp_reshard_after_forward", section.get("fsdp_reshard_after_forward")
    if value is None or (version == 1 and "fsdp_sharding_strategy" in section):
        field, value = "fsdp_config.fsdp_sharding_strategy", section.get("fsdp_sharding_strategy", "FULL_SHARD")
    if isinstance(value, bool):
        strategy = "fsdp-full-shard" if value else "fsdp-shard-grad-op"
    else:
        names = list(FSDP_SHARDING)
        name = names[value - 1] if isinstance(value, int) and 1 <= value <= len(names) else str(value).upper()
        if name not in FSDP_SHARDING:
            raise refuse(where, field, value, ", ".join(FSDP_SHARDING) + " (or true / false for version 2)")
        strategy = FSDP_SHARDING[name]
    offload = section.get("fsdp_offload_params", section.get("fsdp_cpu_offload", False))
    return {
        "strategy": strategy,
        "offload": "all" if offload else "none",
        "ac": "full" if section.get("fsdp_activation_checkpointing", False) else "none",
        **({"fsdp_wrap": "none"} if policy == "NO_WRAP" else {}),
    }


def _deepspeed_section(path: Path, section: dict) -> dict[str, Any]:
    """The DeepSpeedPlugin's settings, or the DeepSpeed file it names (read by the DeepSpeed reader)."""
    where = str(path)
    file = section.get("deepspeed_config_file")
    if file not in (None, "", "none"):
        candidates = [Path(str(file)), path.parent / str(file)]
        found = next((p for p in candidates if p.is_file()), None)
        if found is None:
            raise refuse(where, "deepspeed_config.deepspeed_config_file", file, "a DeepSpeed config file that exists")
        return {k: v for k, v in _deepspeed.read(found).inputs.items() if k not in ("gpus",)}
    stage = section.get("zero_stage")
    # accelerate utils/dataclasses.py DeepSpeedPlugin.__post_init__: the config it builds (no bucket keys)
    config: dict[str, Any] = {
        "gradient_accumulation_steps": section.get("gradient_accumulation_steps", 1),
        "zero_optimization": {
            "stage": stage,
            "offload_optimizer": {"device": section.get("offload_optimizer_device", "none")},
            "offload_param": {"device": section.get("offload_param_device", "none")},
        },
    }
    try:
        inputs = _deepspeed.parse(config, where).inputs
    except Exception as exc:  # a stage or device DeepSpeed's reader refuses: name accelerate's key
        field = getattr(exc, "field", "")
        names = {
            "zero_optimization.stage": "zero_stage",
            "zero_optimization.offload_optimizer.device": "offload_optimizer_device",
            "zero_optimization.offload_param.device": "offload_param_device",
        }
        if field in names:
            key = names[field]
            raise refuse(where, f"deepspeed_config.{key}", section.get(key), getattr(exc, "accepted", "")) from None
        raise
    return {k: v for k, v in inputs.items() if k not in ("precision",)}


def _dynamo(where: str, section: dict) -> bool:
    backend = str(section.get("dynamo_backend", "NO")).upper()
    if backend not in ("NO", "INDUCTOR"):
        raise refuse(where, "dynamo_config.dynamo_backend", backend, "NO or INDUCTOR")
    mode = section.get("dynamo_mode", "default")
    if backend == "INDUCTOR" and mode not in (None, "default"):
        raise refuse(where, "dynamo_config.dynamo_mode", mode, "default")
    return backend == "INDUCTOR"


def parse(data: dict, path: Path | str = "<config>") -> FileConfig:
    """An accelerate config already loaded (``path`` names it and locates a DeepSpeed file)."""
    path = Path(path)
    where = str(path)
    uses = classify(where, "accelerate", data)
    for section in ("parallelism_config", "fp8_config", "megatron_lm_config"):  # a mapping of sizes / recipes
        if data.get(section):
            raise refuse(where, section, data[section], "absent or null (not modelled)")
    kind = str(data.get("distributed_type", "NO"))
    inputs: dict[str, Any] = {"recipe": "accelerate"}
    if kind in PLAIN:
        inputs["strategy"] = PLAIN[kind]
    elif kind == "FSDP":
        inputs |= _fsdp(where, data.get("fsdp_config") or {})
    elif kind == "DEEPSPEED":
        inputs |= _deepspeed_section(path, data.get("deepspeed_config") or {})
    else:
        raise refuse(where, "distributed_type", kind, "NO, MULTI_GPU, MULTI_CPU, FSDP or DEEPSPEED")
    if "precision" not in inputs:
        inputs["precision"] = _precision(where, data.get("mixed_precision", "no"), kind in ("FSDP", "DEEPSPEED"))
    if data.get("use_cpu") or kind == "MULTI_CPU":
        inputs["device"] = "cpu"
    processes, machines = data.get("num_processes"), data.get("num_machines", 1)
    deferred: tuple[str, ...] = ()
    if isinstance(processes, int) and processes >= 1:
        inputs["gpus"] = processes
        if isinstance(machines, int) and machines > 1:
            if processes % machines:
                raise refuse(where, "num_processes", processes, f"a multiple of num_machines ({machines})")
            inputs["gpus_per_node"] = processes // machines
    else:
        deferred = ("gpus",)
    if data.get("dynamo_config"):
        inputs["compile"] = _dynamo(where, data["dynamo_config"])
    return FileConfig(path=where, format="accelerate", inputs=inputs, fields=tuple(uses), deferred=deferred)
