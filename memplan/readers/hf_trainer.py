"""Hugging Face ``TrainingArguments`` as JSON (what ``TrainingArguments.to_json_string()`` writes, or
the JSON file ``HfArgumentParser.parse_json_file`` reads): the batch, precision, activation
checkpointing, optimizer, compile and device of a ``Trainer`` run, and the DeepSpeed config it names.

The loop's conventions are memplan's ``hf-trainer`` recipe (tables/recipes.csv). Without
``deepspeed`` the strategy is the Trainer's plain one (one process: no wrapper; several: DDP) and is
left to ``--strategy`` / ``--gpus``; with it, the DeepSpeed file is read by the DeepSpeed reader and
its ``"auto"`` batch sizes and precision are these arguments (transformers
integrations/deepspeed.py ``HfTrainerDeepSpeedConfig.trainer_config_process``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import deepspeed as _deepspeed
from .base import FileConfig, _number, classify, load_json, refuse

OPTIMIZERS: dict[str, tuple[str, str | None]] = {
    "adamw_torch": ("adamw", None),
    "adamw_torch_fused": ("adamw", "fused"),
    "adafactor": ("adafactor", None),
    "adamw_bnb_8bit": ("adam8bit", None),
    "adamw_8bit": ("adam8bit", None),
    "paged_adamw_8bit": ("paged-adamw8bit", None),
    "lion_32bit": ("lion", None),
    "lion_8bit": ("lion8bit", None),
    "sgd": ("sgd", None),
}
"""transformers OptimizerNames memplan models → (optimizer, optimizer_impl); Trainer.get_optimizer_cls_and_kwargs
builds torch.optim.AdamW (fused=True for adamw_torch_fused), transformers' Adafactor, bitsandbytes'
AdamW8bit / PagedAdamW8bit / Lion / Lion8bit, torch.optim.SGD."""
AC_FIELDS = (
    ("activation_checkpointing", "activation_checkpointing_kwargs"),
    ("gradient_checkpointing", "gradient_checkpointing_kwargs"),
)
"""transformers 5's names and their deprecated aliases (training_args.py __post_init__: the old name
is used only when the new one is not set)."""


def read(path: Path) -> FileConfig:
    return parse(load_json(path, "TrainingArguments"), path)


def _ac(path: str, data: dict) -> str:
    """full where checkpointing is on (non-reentrant); a reentrant request is refused."""
    for flag, kwargs_field in AC_FIELDS:
        on = data.get(flag)
        if on is None:
            continue
        kwargs = data.get(kwargs_field) or {}
        if not isinstance(kwargs, dict):
            raise refuse(path, kwargs_field, kwargs, "a JSON object or null")
        if on and kwargs.get("use_reentrant", False) is not False:
            raise refuse(
                path,
                f"{kwargs_field}.use_reentrant",
                kwargs["use_reentrant"],
                "false (torch.utils.checkpoint's non-reentrant variant, transformers 5's default)",
            )
        return "full" if on else "none"
    return "none"


def _positive(path: str, data: dict, field: str, default: int) -> int:
    value = _number(data.get(field, default))
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise refuse(path, field, value, "a positive integer")
    return value


def _ddp_keywords(path: str, data: dict) -> dict:
    """``ddp_bucket_cap_mb`` and ``ddp_static_graph`` where set: the Trainer hands them to
    ``DistributedDataParallel`` (trainer.py, accelerate's DistributedDataParallelKwargs)."""
    cap, static = _number(data.get("ddp_bucket_cap_mb")), data.get("ddp_static_graph")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
        raise refuse(path, "ddp_bucket_cap_mb", cap, "a positive number of MiB")
    if static not in (None, True, False):
        raise refuse(path, "ddp_static_graph", static, "true or false")
    given = {"bucket_cap_mb": cap, "static_graph": static}
    return {keyword: value for keyword, value in given.items() if value is not None}


def _deepspeed_config(path: Path, value: Any) -> dict:
    """The ``deepspeed`` value: a config dict, or a path (as given, else beside the arguments' file)."""
    if isinstance(value, dict):
        return value
    candidates = [Path(str(value)), path.parent / str(value)]
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        raise refuse(str(path), "deepspeed", value, "a DeepSpeed config file that exists, or a JSON object")
    return load_json(found, "a DeepSpeed config")


def parse(data: dict, path: Path | str = "<arguments>") -> FileConfig:
    """TrainingArguments already loaded (``path`` names it in messages and locates ``deepspeed``)."""
    path = Path(path)
    where = str(path)
    uses = classify(where, "hf-trainer", data)
    mixed = [mode for mode in ("bf16", "fp16") if data.get(mode) is True]
    if len(mixed) == 2:
        raise refuse(where, "fp16", True, "bf16 or fp16, not both")
    inputs: dict[str, Any] = {
        "recipe": "hf-trainer",
        "micro_batch": _positive(where, data, "per_device_train_batch_size", 8),
        "grad_accum": _positive(where, data, "gradient_accumulation_steps", 1),
        "precision": f"amp-{mixed[0]}" if mixed else "fp32",
        "ac": _ac(where, data),
        "compile": bool(data.get("torch_compile", False)),
    }
    for field, accepted in (("torch_compile_backend", (None, "inductor")), ("torch_compile_mode", (None, "default"))):
        if data.get(field) not in accepted:
            raise refuse(where, field, data[field], " or ".join(json.dumps(a) for a in accepted))
    optim = str(data.get("optim", "adamw_torch_fused"))
    if optim not in OPTIMIZERS:
        raise refuse(where, "optim", optim, ", ".join(OPTIMIZERS))
    inputs["optimizer"], impl = OPTIMIZERS[optim]
    if impl:
        inputs["optimizer_impl"] = impl
    if data.get("use_cpu"):
        inputs["device"] = "cpu"
    inputs |= _ddp_keywords(where, data)
    deferred: tuple[str, ...] = ("strategy",)
    if data.get("deepspeed"):
        ds = _deepspeed.parse(_deepspeed_config(path, data["deepspeed"]), f"{where}: deepspeed")
        # "auto": the Trainer's values; explicit ones must match them (trainer_config_process's fill_match)
        inputs |= {k: v for k, v in ds.inputs.items() if k not in ("micro_batch", "grad_accum", "precision")}
        for keyword in ("micro_batch", "grad_accum"):
            if keyword in ds.inputs and ds.inputs[keyword] != inputs[keyword]:
                raise refuse(where, f"deepspeed {keyword}", ds.inputs[keyword], f"{inputs[keyword]} (these arguments')")
        if "precision" in ds.inputs:
            inputs["precision"] = ds.inputs["precision"]
        elif mixed:  # DeepSpeed's bf16 / fp16 modes keep fp32 master weights
            inputs["precision"] = f"mixed-{mixed[0]}"
        deferred = ()
    return FileConfig(path=where, format="hf-trainer", inputs=inputs, fields=tuple(uses), deferred=deferred)
