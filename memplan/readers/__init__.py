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
from dataclasses import dataclass, fields, is_dataclass
from functools import cache
from pathlib import Path
from typing import Any

from ..catalog import read_table
from ..errors import InputError

STATUSES = ("modelled", "ignored", "default-only", "at-least")


@dataclass(frozen=True, kw_only=True)
class FieldUse:
    """One field of the file: its value and what memplan does with it."""

    field: str
    """Dotted path in the file (``zero_optimization.reduce_bucket_size``)."""
    value: Any
    status: str
    """modelled | ignored | default-only | at-least (a ``default-only`` / ``at-least`` field that
    reaches a FileConfig holds the framework's default)."""
    input: str
    """The memplan input it sets ("" where none)."""
    note: str
    """Where the framework defines it, or why it changes no memory."""


@dataclass(frozen=True, kw_only=True)
class FileConfig:
    """A config file read: the memplan inputs it sets (``Request.of`` keywords) and every field."""

    path: str
    format: str
    inputs: dict[str, Any]
    fields: tuple[FieldUse, ...]
    deferred: tuple[str, ...] = ()
    """Inputs the file leaves to the caller (Hugging Face's ``"auto"``: the Trainer's value)."""

    def describe(self, explicit: set[str] | frozenset[str] = frozenset()) -> str:
        """Which inputs came from the file, which from explicit flags, which the file left to them."""

        def show(value) -> str:
            if is_dataclass(value):
                return "(" + ", ".join(f"{f.name} {show(getattr(value, f.name))}" for f in fields(value)) + ")"
            return str(value).lower() if isinstance(value, bool) else str(value)

        taken = [f"{k.replace('_', '-')} {show(v)}" for k, v in self.inputs.items() if k not in explicit]
        parts = [f"{self.path} ({self.format}) sets {', '.join(taken) or 'nothing'}"]
        won = sorted(explicit & set(self.inputs))
        if won:
            parts.append(f"explicit flags win: {', '.join(k.replace('_', '-') for k in won)}")
        if self.deferred:
            parts.append(f'"auto" (the flags\' values): {", ".join(k.replace("_", "-") for k in self.deferred)}')
        return "; ".join(parts)

    def ignored(self) -> tuple[FieldUse, ...]:
        return tuple(f for f in self.fields if f.status == "ignored")

    def explain(self) -> str:
        """Every field of the file: modelled (and the input it sets), at its default, or ignored."""
        lines = [f"{self.path} ({self.format}):"]
        for status, label in (
            ("modelled", "modelled"),
            ("default-only", "at the framework's default"),
            ("at-least", "at or above the framework's default"),
            ("ignored", "ignored (no memory effect)"),
        ):
            uses = [f for f in self.fields if f.status == status]
            if uses:
                lines.append(f"  {label}:")
                lines += [
                    f"    {f.field} = {json.dumps(f.value)}" + (f" → {f.input}" if f.input else "") + f"  ({f.note})"
                    for f in uses
                ]
        if self.deferred:
            lines.append(f'  left to the flags ("auto"): {", ".join(self.deferred)}')
        return "\n".join(lines)


@cache
def field_table(fmt: str) -> dict[str, dict[str, str]]:
    """tables/config_fields.csv rows of one format, by field (``a.*``: every key under ``a``)."""
    rows = {row["field"]: row for row in read_table("config_fields.csv") if row["format"] == fmt}
    for row in rows.values():
        if row["status"] not in STATUSES:
            raise ValueError(f"config_fields.csv: {row['field']} status {row['status']!r} is not one of {STATUSES}")
    return rows


def refuse(path: str, field: str, value: Any, accepted: str) -> InputError:
    return InputError(
        f"{path}: {field} {json.dumps(value)} is not modelled by memplan; accepted: {accepted}",
        field=field,
        value=value,
        accepted=accepted,
    )


def _number(value: Any) -> Any:
    """JSON's 2e8 is a float: a count of elements as an int where integral."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _at_default(value: Any, default: str) -> bool:
    if default == "":  # a section absent, empty, null, false or not enabled
        return value in (None, False, {}, []) or (isinstance(value, dict) and value.get("enabled") in (False, None))
    if isinstance(value, bool) or default in ("true", "false"):
        return str(value).lower() == default
    try:
        return float(value) == float(default)
    except (TypeError, ValueError):
        return str(value) == default


def _at_least(value: Any, default: str) -> bool:
    try:
        return not isinstance(value, bool) and float(value) >= float(default)
    except (TypeError, ValueError):
        return False


def classify(path: str, fmt: str, tree: dict, prefix: str = "") -> list[FieldUse]:
    """Every leaf (or whole section the table names) of ``tree`` with its row; a field the table
    does not know, or a memory-relevant one away from its default, is refused."""
    table, uses = field_table(fmt), []
    for key, value in tree.items():
        name = f"{prefix}{key}"
        row = table.get(name)  # a section's own row says what its absence (null) means
        if isinstance(value, dict) and any(f.startswith(name + ".") for f in table):
            uses += classify(path, fmt, value, name + ".")
            continue
        row = row or table.get(f"{prefix}*")
        if row is None:
            raise InputError(
                f"{path}: {name} is not a {fmt} field memplan knows (tables/config_fields.csv); remove it "
                "or add it there with its memory effect",
                field=name,
                value=value,
                accepted="a field of tables/config_fields.csv",
            )
        value = _number(value)
        status, default = row["status"], row["default"]
        if status == "default-only" and not _at_default(value, default):
            raise refuse(path, name, value, f"{default or 'absent or disabled'} ({row['source']})")
        if status == "at-least" and not _at_least(value, default):
            raise refuse(path, name, value, f"{default} or more ({row['source']})")
        uses.append(FieldUse(field=name, value=value, status=status, input=row["input"], note=row["source"]))
    return uses


def _formats():
    from . import accelerate, deepspeed, hf_trainer, torchtune

    return {
        "deepspeed": deepspeed.read,
        "torchtune": torchtune.read,
        "hf-trainer": hf_trainer.read,
        "accelerate": accelerate.read,
    }


def _detect_yaml(path: Path, text: str) -> str | None:
    """torchtune's recipe configs name their model builder (``model._component_``); accelerate's
    say their ``distributed_type`` / ``compute_environment``."""
    import yaml

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
    with a ``model._component_`` is torchtune's, with ``distributed_type`` accelerate's."""
    text = path.read_text(encoding="utf-8")
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
    formats = ", ".join(f"{f}:FILE" for f in _formats())
    raise InputError(
        f"{path}: cannot tell its format; name it ({formats})", field="from", value=str(path), accepted=formats
    )


def read(source: str | Path) -> FileConfig:
    """A config file (``path``, or ``format:path``) read into memplan's inputs."""
    formats = _formats()
    text = str(source)
    fmt, _, rest = text.partition(":")
    if rest and fmt in formats:
        path = Path(rest)
    else:
        fmt, path = "", Path(text)
    if not path.is_file():
        raise InputError(f"--from {text}: no such file", field="from", value=text, accepted="a config file")
    return formats[fmt or detect(path)](path)
