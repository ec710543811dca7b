"""A DeepSpeed config JSON (deepspeed/runtime/config.py DeepSpeedConfig, zero/config.py
DeepSpeedZeroConfig), as users write it, Hugging Face's ``"auto"`` values included.

The file sets the strategy (ZeRO stage), what is offloaded, the precision mode, the batch sizes,
the optimizer and the ``zero_optimization`` buckets and thresholds (``specs.ZeroConfig``); a key
it leaves out is DeepSpeed's default (``overlap_comm``: on for stage 3 only). ``"auto"``:
- the batch sizes and fp16 / bf16 are the Trainer's ``TrainingArguments``: memplan's flags say
  them (``--micro-batch``, ``--grad-accum``, ``--precision``);
- ``reduce_bucket_size``, ``stage3_prefetch_bucket_size``, ``stage3_param_persistence_threshold``
  are filled from the model's hidden size when the estimate runs (``ZeroConfig.resolved``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..specs import AUTO, ZeroConfig
from .base import FieldUse, FileConfig, _number, classify, load_json, refuse

DEFAULTS = {f: ZeroConfig.__dataclass_fields__[f].default for f in ZeroConfig.__dataclass_fields__}
ZERO_KEYS = tuple(DEFAULTS)
STAGES = {1: "zero1", 2: "zero2", 3: "zero3"}
OPTIMIZERS = {"adam": "adamw", "adamw": "adamw"}
"""DeepSpeed's optimizer types memplan models (deepspeed/runtime/config.py ADAM_OPTIMIZER,
ADAMW_OPTIMIZER: FusedAdam / DeepSpeedCPUAdam, two fp32 states each)."""


def _count(path: Path, field: str, value: Any, *, auto: bool = False) -> int | str:
    if auto and value == AUTO:
        return AUTO
    value = _number(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise refuse(str(path), field, value, "a count of elements" + (' or "auto"' if auto else ""))
    return value


def _zero(path: Path, section: dict, stage: int) -> ZeroConfig:
    """The zero_optimization section's buckets and thresholds, DeepSpeed's defaults where it is silent
    (deepspeed/runtime/zero/config.py; overlap_comm: ``overlap_comm_valid``, stage 3 only)."""
    values: dict[str, Any] = {
        "overlap_comm": stage == 3,
        "reduce_bucket_size": 500_000_000,
        "allgather_bucket_size": 500_000_000,
    }
    values |= {"stage3_prefetch_bucket_size": 50_000_000, "stage3_param_persistence_threshold": 100_000}
    for key in ZERO_KEYS:
        if key not in section:
            continue
        value, field = section[key], f"zero_optimization.{key}"
        if key in ("overlap_comm", "contiguous_gradients"):
            if not isinstance(value, bool):
                raise refuse(str(path), field, value, "true or false")
        else:
            value = _count(path, field, value, auto=key != "allgather_bucket_size")
        values[key] = value
    return ZeroConfig(**values)


def _offload(path: Path, section: dict) -> str:
    """offload_optimizer / offload_param devices (and the deprecated cpu_offload / cpu_offload_param)."""
    devices = {}
    for kind, key, old in (
        ("optimizer", "offload_optimizer", "cpu_offload"),
        ("params", "offload_param", "cpu_offload_param"),
    ):
        device = (section.get(key) or {}).get("device", "none")
        if section.get(old) is True:
            device = "cpu"
        if device not in ("none", "cpu"):
            raise refuse(str(path), f"zero_optimization.{key}.device", device, "none or cpu (nvme is not modelled)")
        devices[kind] = device == "cpu"
    if devices["optimizer"] and devices["params"]:
        return "all"
    return next((kind for kind, on in devices.items() if on), "none")


def _precision(path: Path, data: dict) -> str | None:
    """mixed-bf16 / mixed-fp16 (DeepSpeed's bf16 and fp16 modes keep fp32 master weights), fp32
    when neither is enabled; None where an ``"auto"`` leaves it to the Trainer's arguments."""
    enabled = {}
    for mode, keys in (("bf16", ("bf16", "bfloat16")), ("fp16", ("fp16",))):
        values = [(data.get(k) or {}).get("enabled", False) for k in keys if k in data]
        value = values[0] if values else False
        if value not in (True, False, AUTO):
            raise refuse(str(path), f"{keys[0]}.enabled", value, 'true, false or "auto"')
        enabled[mode] = value
    on = [mode for mode, value in enabled.items() if value is True]
    if len(on) == 2:
        raise refuse(str(path), "fp16.enabled", True, "bf16 or fp16 enabled, not both")
    if on:
        return f"mixed-{on[0]}"
    return None if AUTO in enabled.values() else "fp32"


def read(path: Path) -> FileConfig:
    return parse(load_json(path, "a DeepSpeed config"), path)


def parse(data: dict, path: Path | str = "<config>") -> FileConfig:
    """A DeepSpeed config already loaded (``path`` names it in messages)."""
    path = Path(path)
    uses = classify(str(path), "deepspeed", data)
    section = data.get("zero_optimization") or {}
    stage = section.get("stage", 0)
    if stage not in STAGES:
        raise refuse(str(path), "zero_optimization.stage", stage, "1, 2 or 3 (memplan's zero1-zero3)")
    inputs: dict[str, Any] = {
        "strategy": STAGES[stage],
        "offload": _offload(path, section),
        "zero": _zero(path, section, stage),
    }
    deferred = []
    for field, keyword in (
        ("train_micro_batch_size_per_gpu", "micro_batch"),
        ("gradient_accumulation_steps", "grad_accum"),
    ):
        value = _number(data.get(field))
        if value == AUTO or value is None:
            deferred.append(keyword)
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise refuse(str(path), field, value, 'a positive integer or "auto"')
        else:
            inputs[keyword] = value
    total = _number(data.get("train_batch_size"))
    if total not in (None, AUTO):
        per_rank = inputs.get("micro_batch", 0) * inputs.get(
            "grad_accum", 1 if "gradient_accumulation_steps" not in data else 0
        )
        if per_rank and (not isinstance(total, int) or isinstance(total, bool) or total % per_rank):
            raise refuse(str(path), "train_batch_size", total, f"a multiple of micro-batch × accumulation ({per_rank})")
        if per_rank:  # deepspeed/runtime/config.py _batch_assertion: total = micro × accumulation × world size
            inputs["gpus"] = total // per_rank
    precision = _precision(path, data)
    if precision is None:
        deferred.append("precision")
    else:
        inputs["precision"] = precision
    optimizer = (data.get("optimizer") or {}).get("type")
    if optimizer is not None:
        if str(optimizer).lower() not in OPTIMIZERS:
            raise refuse(str(path), "optimizer.type", optimizer, ", ".join(sorted(OPTIMIZERS)))
        inputs["optimizer"] = OPTIMIZERS[str(optimizer).lower()]
    return FileConfig(path=str(path), format="deepspeed", inputs=inputs, fields=tuple(uses), deferred=tuple(deferred))


__all__ = ["FieldUse", "read"]
