"""The package's import graph is a stack: each module imports only from its own layer or the
layers below, and no import cycle exists, counting imports inside functions and under
``TYPE_CHECKING`` (an import is a dependency wherever it is written). Imports written inside
functions are allowed only in the modules listed with the reason they need it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "memplan"

LAYERS: list[list[str]] = [
    # data and specs: what a job is, the tables, the records the producers below return
    [
        "errors",
        "version",
        "units",
        "precision",
        "layout",
        "settings",
        "csvtables",
        "specs",
        "catalog",
        "loop",
        "hfconfig",
        "infer",
        "strategies",
        "readers.base",
        "readers.deepspeed",
        "readers.torchtune",
        "readers.accelerate",
        "readers.hf_trainer",
        "readers.torchtitan",
        "readers.tp_plan",
        "readers",
        "breakdown",
        "saved",
        "moments",
    ],
    # model terms: producers of saved tensors and parameter counts, each with stable keys
    ["mla", "shapes", "moe", "finetune", "activations", "checkpointing", "loss"],
    # framework adapters and parallel dimensions: their buffers and their own moments
    [
        "frameworks.base",
        "frameworks.single",
        "frameworks.ddp",
        "frameworks.fsdp_emit",
        "frameworks.fsdp",
        "frameworks.deepspeed",
        "frameworks",
        "parallel",
        "parallel.pipeline",
        "parallel.context",
        "parallel.tensor",
        "overheads",
    ],
    # step assembly: a job's (or a mesh rank's) moments, and its estimate
    ["quantities", "step", "notes", "parallel.step", "memory"],
    # allocator replay, and its answers kept between processes
    ["allocator", "replaycache", "alloctrace", "replayed"],
    # the estimate entry point, and the inputs that build jobs
    ["totals", "request", "inputs", "module", "calibration", "throughput", "search"],
    # decide
    [
        "decide.options",
        "decide.fixes",
        "decide.layouts",
        "decide.rules",
        "decide.recommend",
        "decide.whatifs",
        "decide",
    ],
    # report
    [
        "report.text",
        "report.sentences",
        "report.decisions",
        "report.data",
        "report.notes",
        "report.explain",
        "report.recommendation",
        "report.searches",
        "report.table",
        "report",
        "emit",
    ],
    # API
    ["api", "grid", "plot"],
    # CLI
    ["cli", ""],
]
"""Lowest first; "" is the package itself (``memplan/__init__.py``)."""

DEFERRED: dict[str, str] = {
    # start-up time: the CLI and the API import the searches, reports and plots only when asked
    "cli": "start-up: each subcommand imports what it runs",
    "api": "start-up: the searches and the calibration only when a call needs them",
    "plot": "start-up: the sweep only when a plot is drawn",
}
"""Modules allowed imports of the package inside functions, with why."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _run_at_import(tree: ast.Module) -> set[int]:
    """The ids of the statements a module runs when imported: its body and, within it, the bodies
    of its try, if and with blocks (``memplan/__init__.py`` imports inside a try), not a
    function's or a class's."""
    found, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        found.add(id(node))
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            todo += [c for c in ast.iter_child_nodes(node) if isinstance(c, (ast.stmt, ast.excepthandler))]
    return found


def _imports(path: Path, name: str, modules: set[str]) -> list[tuple[str, bool]]:
    """(imported module of the package, written at module level) for each import in ``path``."""
    tree = ast.parse(path.read_text())
    top = _run_at_import(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name.removeprefix("memplan").lstrip(".") for a in node.names if a.name.startswith("memplan")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - node.level + 1] + ([node.module] if node.module else [])
                stem = ".".join(p for p in base if p)
            elif (node.module or "").startswith("memplan"):
                stem = node.module.removeprefix("memplan").lstrip(".")
            else:
                continue
            # `from . import moe` names a module; `from .moe import x` names one in moe
            targets = [
                f"{stem}.{a.name}".lstrip(".") if f"{stem}.{a.name}".lstrip(".") in modules else stem
                for a in node.names
            ]
        else:
            continue
        out += [(t, id(node) in top) for t in targets if t in modules and t != name]
    return out


def _graph() -> tuple[dict[str, set[str]], dict[str, int]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    edges: dict[str, set[str]] = {}
    deferred: dict[str, int] = {}
    for name, path in files.items():
        found = _imports(path, name, modules)
        edges[name] = {t for t, _ in found}
        deferred[name] = sum(not at_top for _, at_top in found)
    return edges, deferred


def _layer_of() -> dict[str, int]:
    return {m: i for i, layer in enumerate(LAYERS) for m in layer}


def test_every_module_has_one_layer():
    edges, _ = _graph()
    declared = [m for layer in LAYERS for m in layer]
    assert len(declared) == len(set(declared)), "a module in two layers"
    assert set(declared) == set(edges), (
        f"undeclared: {sorted(set(edges) - set(declared))}, gone: {sorted(set(declared) - set(edges))}"
    )


def test_imports_go_down_the_stack():
    edges, _ = _graph()
    layer = _layer_of()
    upward = {(a, b) for a, targets in edges.items() for b in targets if layer[b] > layer[a]}
    assert upward == set()


def _cycle(edges: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph (empty when it has none), by depth-first search."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(v: str) -> list[str]:
        state[v] = 1
        path.append(v)
        for w in sorted(edges[v]):
            if state.get(w) == 1:
                return path[path.index(w) :] + [w]
            if w not in state and (found := visit(w)):
                return found
        state[v] = 2
        path.pop()
        return []

    for v in sorted(edges):
        if v not in state and (found := visit(v)):
            return found
    return []


def test_no_import_cycle():
    edges, _ = _graph()
    assert _cycle(edges) == []


def test_cycle_search_finds_a_cycle():
    """The search itself: a three-module ring is found, a chain is not."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_deferred_imports_only_where_listed():
    _, deferred = _graph()
    unlisted = {m: n for m, n in deferred.items() if n and m not in DEFERRED}
    assert unlisted == {}
    assert [m for m in DEFERRED if not deferred.get(m)] == [], "a listed module without deferred imports"
