"""What every reader shares: the table of a format's fields (tables/config_fields.csv), how a
field is classified, and the file read (``FileConfig``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, is_dataclass
from functools import cache
from pathlib import Path
from typing import Any

from ..catalog import read_table
from ..errors import InputError
from ..specs import ModelSpec

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
    assumed: tuple[tuple[str, str], ...] = ()
    """Inputs the file does not hold, set to the framework's launch default: (keyword, why)."""

    def describe(self, explicit: set[str] | frozenset[str] = frozenset()) -> str:
        """Which inputs came from the file, which from explicit flags, which the file left to them."""

        def show(value) -> str:
            if isinstance(value, ModelSpec):  # its name: the report's header shows its shapes
                return value.name
            if is_dataclass(value):
                return "(" + ", ".join(f"{f.name} {show(getattr(value, f.name))}" for f in fields(value)) + ")"
            return str(value).lower() if isinstance(value, bool) else str(value)

        guessed = {k: why for k, why in self.assumed if k not in explicit}
        taken = [f"{k.replace('_', '-')} {show(v)}" for k, v in self.inputs.items() if k not in explicit | set(guessed)]
        parts = [f"{self.path} ({self.format}) sets {', '.join(taken) or 'nothing'}"]
        parts += [f"assumed {k.replace('_', '-')} {show(self.inputs[k])} ({why})" for k, why in guessed.items()]
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
        return value in (None, False, {}, [], "") or (isinstance(value, dict) and value.get("enabled") in (False, None))
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


def load_json(path: Path, what: str) -> dict:
    """A JSON file holding one object (``what`` names it in the error: "a DeepSpeed config")."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not JSON ({exc})", field="from", value=str(path), accepted="a JSON file") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: not {what} (a JSON object)", field="from", value=str(path), accepted="a JSON object")
    return data
