"""A job as its user already holds it: a framework's own config file read into memplan's inputs
(``memplan estimate --from FILE``). One reader per format, each mapping every field the framework
defines (tables/config_fields.csv): ``modelled`` fields set an input; ``ignored`` ones change no
memory of the step; ``default-only`` / ``at-least`` ones change memory in a way memplan does not
model and are refused, naming the field and the file, unless they hold the framework's default.

Layering: readers sit above the framework adapters (they name the adapters' strategies and the
specs' inputs) and below the API and the CLI, which merge a file's inputs with explicit ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import tomllib
import yaml

from ..errors import InputError
from . import accelerate, deepspeed, hf_trainer, torchtitan, torchtune, tp_plan
from .base import STATUSES, FieldUse, FileConfig, classify, field_table, refuse

__all__ = ["STATUSES", "FieldUse", "FileConfig", "classify", "detect", "field_table", "read", "refuse"]


def _formats():
    return {
        "deepspeed": deepspeed.read,
        "torchtune": torchtune.read,
        "hf-trainer": hf_trainer.read,
        "accelerate": accelerate.read,
        "torchtitan": torchtitan.read,
        "tp-plan": tp_plan.read,
    }


def _detect_yaml(path: Path, text: str) -> str | None:
    """torchtune's recipe configs name their model builder (``model._component_``); accelerate's
    say their ``distributed_type`` / ``compute_environment``."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InputError(
            f"{path}: not YAML ({str(exc).splitlines()[0]})", field="from", value=str(path), accepted="a YAML file"
        ) from None
    if isinstance(data, dict) and isinstance(data.get("model"), dict) and "_component_" in data["model"]:
        return "torchtune"
    if isinstance(data, dict) and {"distributed_type", "compute_environment"} & set(data):
        return "accelerate"
    return None


def detect(path: Path) -> str:
    """The format of a file by its content: JSON with zero_optimization or DeepSpeed's batch keys
    is DeepSpeed's; JSON with TrainingArguments' batch, optim or output_dir is the Trainer's; YAML
    with a ``model._component_`` is torchtune's, with ``distributed_type`` accelerate's; TOML with a
    torchtitan section ([job], [model], [training], [parallelism] ...) is torchtitan's; JSON whose
    values are all torch's TP style names is a ``parallelize_module`` plan."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise InputError(
                f"{path}: not TOML ({exc})", field="from", value=str(path), accepted="a TOML file"
            ) from None
        if torchtitan.is_torchtitan(data):
            return "torchtitan"
    if path.suffix in (".yaml", ".yml"):
        found = _detect_yaml(path, text)
        if found:
            return found
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(
                f"{path}: not JSON ({exc})", field="from", value=str(path), accepted="a JSON file"
            ) from None
        if isinstance(data, dict) and (
            {"zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size"} & set(data)
        ):
            return "deepspeed"
        if isinstance(data, dict) and {"per_device_train_batch_size", "optim", "output_dir"} & set(data):
            return "hf-trainer"
        if isinstance(data, dict) and {"distributed_type", "compute_environment"} & set(data):
            return "accelerate"  # accelerate's write_basic_config and `accelerate config` write JSON too
        if tp_plan.is_tp_plan(data):
            return "tp-plan"
    formats = ", ".join(f"{f}:FILE" for f in _formats())
    raise InputError(
        f"{path}: cannot tell its format; name it ({formats})", field="from", value=str(path), accepted=formats
    )


def read(source: str | Path, gpus: int | None = None) -> FileConfig:
    """A config file (``path``, or ``format:path``) read into memplan's inputs; ``gpus``: the world
    size the launch gives (torchtitan's TOML leaves it to torchrun)."""
    formats = _formats()
    text = str(source)
    fmt, _, rest = text.partition(":")
    if rest and fmt in formats:
        path = Path(rest)
    else:
        fmt, path = "", Path(text)
    if not path.is_file():
        raise InputError(f"--from {text}: no such file", field="from", value=text, accepted="a config file")
    fmt = fmt or detect(path)
    return torchtitan.read(path, gpus=gpus) if fmt == "torchtitan" else formats[fmt](path)
