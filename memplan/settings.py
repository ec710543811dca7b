"""A setting declared once: a dataclass field whose default, accepted values and docstring are
the whole of its declaration. The CLI's options, the API's keywords and the checks are built
from these fields (as torchtitan builds its command line from its config dataclasses).

``setting(default, choices=...)`` declares a field; the string literal under it is its help.
``check_fields`` checks a spec's values against its declared choices. This module is the bottom
of the stack: it imports nothing of memplan but its errors.
"""

from __future__ import annotations

import ast
import itertools
import re
import sys
from dataclasses import MISSING, Field, field, fields
from functools import cache
from typing import Any

from .errors import InputError, MemplanError

CHOICES = "choices"
"""Field metadata: the values a setting accepts (in the order the help lists them)."""
DEFAULT_HELP = "default_help"
"""Field metadata: what the help says the default is where the default value alone would not
(``None`` standing for "the recipe's")."""
DECLARED_IN = "declared_in"
"""Field metadata: the class whose field this one repeats (``optional``), where its docstring is."""


def setting(default: Any = MISSING, *, choices: tuple = (), default_help: str = "") -> Any:
    """A dataclass field with its accepted values (and, for its help, what its default means
    where the value does not say); its docstring is the string literal under it."""
    metadata: dict[str, Any] = {CHOICES: tuple(choices)} if choices else {}
    metadata |= {DEFAULT_HELP: default_help} if default_help else {}
    return field(default=default, metadata=metadata)


def choices(f: Field) -> tuple:
    """The values a field accepts, () where any value of its type is."""
    return f.metadata.get(CHOICES, ())


@cache
def _class_bodies(path: str) -> dict[str, list[ast.stmt]]:
    """The top-level classes of a source file, by name (each file parsed once)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return {node.name: node.body for node in tree.body if isinstance(node, ast.ClassDef)}


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal under it in the class body, or under the field
    it repeats), as one line of plain text (reST ``code`` marks dropped)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        path = getattr(sys.modules.get(klass.__module__), "__file__", None)
        body = _class_bodies(path).get(klass.__name__, []) if path else []
        for node, after in itertools.pairwise(body):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                docs[node.target.id] = str(after.value.value)
    docs = {name: _plain(text) for name, text in docs.items()}
    for f in fields(cls):
        if DECLARED_IN in f.metadata:
            docs[f.name] = field_docs(f.metadata[DECLARED_IN]).get(f.name, "")
    return docs


def show(value) -> str:
    """A value as the command line spells it (``true``, ``none``, ``8``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _plain(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("``", "")).strip()


def check_choice(value, accepted, what: str) -> None:
    if value not in accepted:
        raise MemplanError(f"{what} {value!r} is not one of: {', '.join(accepted)}")


def check_positive(obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise not_positive(name, value)


def not_positive(name: str, value) -> InputError:
    return InputError(
        lambda n: f"{n.word(name)} must be a positive integer, got {value!r}",
        field=name,
        value=value,
        accepted="a positive integer",
    )


def check_choices(obj) -> None:
    """Every field of ``obj`` that declares its choices holds one of them (in field order; the
    message names the setting with dashes: ``zero-grad 'x' is not one of: none, zeros``)."""
    for f in fields(obj):
        accepted = choices(f)
        if accepted:
            check_choice(getattr(obj, f.name), accepted, f.name.replace("_", "-"))


def optional(cls: type, name: str, *, exclude: tuple[str, ...] = (), default_help: str = "", doc: str = "") -> type:
    """A frozen keyword-only dataclass of ``cls``'s fields, each None where not given (then set
    elsewhere: a recipe's), with their choices and docstrings: the fields declared once, in ``cls``.
    ``default_help`` may name ``{default}``: ``cls``'s default of the field."""
    from dataclasses import make_dataclass

    specs = [
        (
            f.name,
            f"{f.type} | None",
            field(
                default=None,
                metadata={**f.metadata, DECLARED_IN: cls, DEFAULT_HELP: default_help.format(default=show(f.default))},
            ),
        )
        for f in fields(cls)
        if f.name not in exclude
    ]
    made = make_dataclass(name, specs, frozen=True, kw_only=True)
    made.__doc__, made.__module__ = doc, cls.__module__
    return made
