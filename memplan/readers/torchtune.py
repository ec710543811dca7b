"""A torchtune recipe config (YAML, torchtune 0.6.1's recipes/configs/*), as ``tune run RECIPE
--config FILE`` reads it: the model builder, the batch, the precision, the optimizer, the loss and the
recipe's memory switches (activation checkpointing and offloading, optimizer_in_bwd, compile,
fsdp_cpu_offload). The loop's conventions are memplan's ``torchtune`` recipe (tables/recipes.csv).

The file does not name its recipe (``tune run`` does): a config named ``*single_device*`` or
``*low_memory*`` (the single-device recipes' configs) is ``--strategy single``; one that sets an FSDP
key (``fsdp_cpu_offload``, ``fsdp_reshard_after_forward``, ``custom_sharded_layers``) is the distributed
recipe's, ``fsdp-full-shard``; any other leaves the strategy to ``--strategy``. The world size is
``tune run --nproc_per_node``: ``--gpus``.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import yaml

from ..catalog import read_table
from ..errors import InputError
from .base import FileConfig, classify, refuse

LOSSES = {
    "torchtune.modules.loss.CEWithChunkedOutputLoss": "chunked-ce",
    "torch.nn.CrossEntropyLoss": "ce",
}
OPTIMIZERS = {
    "torch.optim.AdamW": "adamw",
    "torch.optim.Adam": "adam",
    "torch.optim.SGD": "sgd",
    "bitsandbytes.optim.AdamW8bit": "adam8bit",
    "bitsandbytes.optim.PagedAdamW8bit": "paged-adamw8bit",
    "bitsandbytes.optim.Lion": "lion",
    "bitsandbytes.optim.Lion8bit": "lion8bit",
}
"""torchtune's optimizer components memplan models (specs.OPTIMIZERS)."""
PRECISIONS = {"bf16": "bf16", "fp32": "fp32"}
"""torchtune 0.6.1 training/precision.py PRECISION_STR_TO_DTYPE (fp16 it refuses itself)."""
LORA_MODULES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "output_proj": "o"}
"""torchtune's LoRA attention modules (modules/peft LORA_ATTN_MODULES) as memplan's targets."""
MLP = ("gate", "up", "down")
"""apply_lora_to_mlp: w1 (gate), w3 (up), w2 (down)."""
DISTRIBUTED_KEYS = ("fsdp_cpu_offload", "fsdp_reshard_after_forward", "custom_sharded_layers")
SINGLE_NAMES = ("single_device", "low_memory")


@cache
def presets() -> dict[str, str]:
    """torchtune's model builders by name → memplan's preset of the same shapes."""
    return {row["component"]: row["preset"] for row in read_table("torchtune_models.csv")}


def _load(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise InputError(
            f"{path}: not YAML ({str(exc).splitlines()[0]})", field="from", value=str(path), accepted="a YAML file"
        ) from None
    if not isinstance(data, dict):
        raise InputError(
            f"{path}: not a torchtune config (a YAML mapping)", field="from", value=str(path), accepted="a mapping"
        )
    return data


def _model(path: str, model: dict) -> dict[str, Any]:
    """The builder's preset and, for lora_* / qlora_* builders, the adapters."""
    component = str(model.get("_component_", ""))
    name = component.rsplit(".", 1)[-1]
    finetune = next((kind for kind in ("qlora", "lora") if name.startswith(kind + "_")), "full")
    base = name.removeprefix(finetune + "_") if finetune != "full" else name
    if not component.startswith("torchtune.models.") or base not in presets():
        raise refuse(path, "model._component_", component, "torchtune.models builders of " + ", ".join(presets()))
    inputs: dict[str, Any] = {"model": presets()[base]}
    if model.get("quantize_base") is True:
        finetune = "qlora"
    if finetune == "full":
        return inputs
    inputs["finetune"] = finetune
    modules = model.get("lora_attn_modules", [])
    unknown = [m for m in modules if m not in LORA_MODULES]
    if unknown or not isinstance(modules, list):
        raise refuse(path, "model.lora_attn_modules", modules, "a list of " + ", ".join(LORA_MODULES))
    targets = [LORA_MODULES[m] for m in LORA_MODULES if m in modules]
    if model.get("apply_lora_to_mlp", False):
        targets += MLP
    if not targets:
        raise refuse(path, "model.lora_attn_modules", modules, "at least one module (or apply_lora_to_mlp)")
    inputs["lora_targets"] = ",".join(targets)
    for field, keyword in (("lora_rank", "lora_rank"), ("lora_alpha", "lora_alpha"), ("lora_dropout", "lora_dropout")):
        if field in model:
            inputs[keyword] = model[field]
    return inputs


def _strategy(path: Path, data: dict) -> str | None:
    if any(key in path.name for key in SINGLE_NAMES):
        return "single"
    if any(key in data for key in DISTRIBUTED_KEYS):
        return "fsdp-full-shard"
    return None


def _component(data: dict, section: str) -> str:
    return str((data.get(section) or {}).get("_component_", ""))


def read(path: Path) -> FileConfig:
    return parse(_load(path), path)


def parse(data: dict, path: Path | str = "<config>") -> FileConfig:
    """A torchtune config already loaded (``path`` names it in messages and tells the recipe)."""
    path = Path(path)
    where = str(path)
    model = _model(where, data.get("model") or {})  # a builder memplan lacks is named before its keywords
    uses = classify(where, "torchtune", data)
    inputs: dict[str, Any] = {"recipe": "torchtune", **model}
    deferred = []
    strategy = _strategy(path, data)
    if strategy is None:
        deferred.append("strategy")
    else:
        inputs["strategy"] = strategy
    seq_len = (data.get("tokenizer") or {}).get("max_seq_len")
    if seq_len is None:
        deferred.append("seq_len")
    else:
        inputs["seq_len"] = seq_len
    for field, keyword in (("batch_size", "micro_batch"), ("gradient_accumulation_steps", "grad_accum")):
        if field in data:
            inputs[keyword] = data[field]
    if "dtype" in data:
        if data["dtype"] not in PRECISIONS:
            raise refuse(where, "dtype", data["dtype"], ", ".join(PRECISIONS))
        inputs["precision"] = PRECISIONS[data["dtype"]]
    if "device" in data:
        if data["device"] not in ("cuda", "cpu"):
            raise refuse(where, "device", data["device"], "cuda or cpu")
        inputs["device"] = data["device"]
    inputs |= _optimizer(where, data.get("optimizer") or {})
    loss = _component(data, "loss")
    if loss:
        if loss not in LOSSES:
            raise refuse(where, "loss._component_", loss, ", ".join(LOSSES))
        inputs["loss"] = LOSSES[loss]
        if "num_output_chunks" in data["loss"]:
            inputs["loss_chunks"] = data["loss"]["num_output_chunks"]
    # the recipes' switches: cfg.get(key, False) each (recipes/*_finetune_*.py)
    for field, keyword in (
        ("compile", "compile"),
        ("enable_activation_offloading", "offload_activations"),
        ("optimizer_in_bwd", "optimizer_in_backward"),
    ):
        inputs[keyword] = bool(data.get(field, False))
    inputs["ac"] = "full" if data.get("enable_activation_checkpointing", False) else "none"
    if data.get("fsdp_cpu_offload", False):
        inputs["offload"] = "all"
    return FileConfig(path=where, format="torchtune", inputs=inputs, fields=tuple(uses), deferred=tuple(deferred))


def _optimizer(path: str, section: dict) -> dict[str, Any]:
    component = str(section.get("_component_", ""))
    if not component:
        return {}
    if component not in OPTIMIZERS:
        raise refuse(path, "optimizer._component_", component, ", ".join(OPTIMIZERS))
    name = OPTIMIZERS[component]
    if name == "sgd" and section.get("momentum", 0):
        name = "sgd-momentum"
    inputs: dict[str, Any] = {"optimizer": name}
    if section.get("fused") is True:
        inputs["optimizer_impl"] = "fused"
    elif "foreach" in section:
        inputs["optimizer_impl"] = "foreach" if section["foreach"] else "single"
    return inputs
