"""Each setting declared once: the CLI's options are the request's fields.

Every job option of every command is built from a request dataclass field (``memplan.request``):
its name, its accepted values, its default and its help are read off the field and its
docstring (``memplan.settings``). A loop setting is declared on ``memplan.loop.Loop`` alone; the
request repeats it, optional, by generation (``request.LoopSettings``).

Adding a loop flag such as ``--zero-grad`` touches two source files:

- ``memplan/loop.py``: the ``Loop`` field (type, accepted values, default, docstring = the help);
  the CLI option, the API keyword, ``Request.of``'s keyword, the record keys of
  ``calibrate.loops`` and the check of its value all follow from it;
- ``memplan/specs.py``: ``TrainSpec``'s field of the same name (``zero_grad: str =
  Loop.zero_grad``), which the step reads and the JSON output lists.

Each recipe's value of it, with its source, is a row of the data table ``tables/recipes.csv``;
what it changes in memory is modelled where the step is assembled.
"""

from __future__ import annotations

import ast
from dataclasses import MISSING, fields
from pathlib import Path

import click
import pytest

from memplan import loop
from memplan.cli import main
from memplan.request import FIELDS, PARTS, Request, TrainingRequest
from memplan.settings import choices, field_docs
from memplan.specs import TrainSpec
from memplan.strategies import STRATEGIES

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ("estimate", "recommend", "min-gpus", "explain")
SPELLED = {k: f for k, (_, f) in FIELDS.items() if any(t in str(f.type) for t in ("str", "float", "int", "bool"))}
"""The request fields a command line can spell (all but Python values such as a ZeroConfig)."""


def _options(command: str) -> dict[str, click.Option]:
    return {p.name: p for p in main.commands[command].params if isinstance(p, click.Option) and p.name in FIELDS}


@pytest.mark.parametrize("command", COMMANDS)
def test_the_job_options_are_the_request_fields(command):
    options = _options(command)
    assert set(options) == set(SPELLED)
    assert "zero" in FIELDS and "zero" not in options  # the API's alone
    for name, option in options.items():
        f = SPELLED[name]
        if command == "explain" and name == "strategy":  # explain's own: one strategy, not all
            assert list(option.type.choices) == list(STRATEGIES)
            continue
        assert option.opts[0] == "--" + name.replace("_", "-")
        assert tuple(getattr(option.type, "choices", ())) == choices(f), name
        assert option.default == f.default, name
        assert option.help.startswith(field_docs(PARTS[FIELDS[name][0]])[name]), name
        assert option.is_bool_flag == str(f.type).startswith("bool"), name


def test_a_loop_setting_is_the_loops_field_optional_and_mirrored_by_the_step():
    step = {f.name: f for f in fields(TrainSpec)}
    for f in fields(loop.Loop):
        mirror = step["activation_checkpointing" if f.name == "ac" else f.name]
        assert (mirror.type, mirror.default) == (f.type, f.default), f.name
        if f.name == "recipe":
            continue
        _, request_field = FIELDS[f.name]
        assert request_field.default is None and choices(request_field) == choices(f), f.name
        assert field_docs(TrainingRequest)[f.name] == field_docs(loop.Loop)[f.name]
    # the help's "[default: the recipe's; plain: X]" states plain's values, which are Loop's defaults
    assert loop.resolve("plain").loop == loop.Loop()


def test_a_loop_flag_reaches_the_step_from_the_cli_and_by_keyword():
    ctx = main.commands["estimate"].make_context("estimate", ["--params", "1e9", "--zero-grad", "zeros", "--ac", "op"])
    flags = {k: v for k, v in ctx.params.items() if k in FIELDS}
    request = Request.of(**flags)
    assert request == Request.of(params="1e9", zero_grad="zeros", ac="op")
    train = request.training.spec()
    assert (train.zero_grad, train.activation_checkpointing) == ("zeros", "op")
    assert train.loop.zero_grad == "zeros" and Request.of(**request.inputs()) == request


def test_a_bad_loop_value_names_the_setting_and_what_is_accepted():
    with pytest.raises(ValueError, match="zero-grad 'sometimes' is not one of: none, zeros"):
        loop.Loop(zero_grad="sometimes")


def _declarations(path: Path, name: str) -> int:
    """Where ``path`` declares the setting ``name``: a class field, a parameter, or the name as a
    string (a flag, a list of setting names)."""
    spelled = (name, "--" + name.replace("_", "-"))

    def declares(node) -> bool:
        field = isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name
        parameter = isinstance(node, ast.arg) and node.arg == name
        return field or parameter or (isinstance(node, ast.Constant) and node.value in spelled)

    return sum(declares(node) for node in ast.walk(ast.parse(path.read_text())))


def test_zero_grad_is_declared_in_loop_and_mirrored_in_the_step_only():
    """``--zero-grad``: declared in memplan/loop.py, mirrored in memplan/specs.py; nowhere else in
    the package, nor in the calibration's loops (which take memplan's)."""
    files = sorted(ROOT.glob("memplan/**/*.py")) + [ROOT / "calibrate" / "loops.py"]
    where = {str(p.relative_to(ROOT)): n for p in files if (n := _declarations(p, "zero_grad"))}
    assert where == {"memplan/loop.py": 1, "memplan/specs.py": 1}


def test_every_request_field_has_help():
    for keyword, (part, f) in FIELDS.items():
        assert field_docs(PARTS[part]).get(keyword), keyword
        assert f.default is not MISSING, keyword
