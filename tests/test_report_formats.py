"""memplan.report only formats: its modules import data types, units and the few descriptions
the data's own modules write, never an estimate, a replay or a step time; the what-ifs it
prints are computed in ``decide.whatifs`` as data; and decide imports nothing of report."""

from __future__ import annotations

import ast
import dataclasses
import importlib
from pathlib import Path

import pytest

import memplan
from memplan import report
from memplan.allocator import AllocConf
from memplan.alloctrace import reserved
from memplan.decide import whatifs
from memplan.overheads import reserved_bytes

PACKAGE = Path(memplan.__file__).parent

COMPUTING = (
    "memplan.memory",
    "memplan.allocator",
    "memplan.alloctrace",
    "memplan.totals",
    "memplan.throughput",
    "memplan.search",
    "memplan.grid",
    "memplan.parallel",
    "memplan.frameworks",
    "memplan.decide.options",
    "memplan.decide.rules",
    "memplan.decide.fixes",
    "memplan.decide.layouts",
)
"""Modules that estimate, replay, time or search: nothing in report imports them."""

DESCRIPTIONS = {
    ("memplan.units", "gib"): "bytes as GiB",
    ("memplan.overheads", "reserved_bytes"): "an estimate's allocated plus the allocator terms it carries",
    ("memplan.calibration", "fit_text"): "a calibration's fit as a sentence",
    ("memplan.finetune", "finetune_line"): "a fine-tune's header line",
    ("memplan.finetune", "finetune_inputs"): "a fine-tune's JSON inputs",
    ("memplan.finetune", "FINETUNE_FIELDS"): "the fine-tune fields of TrainSpec",
    ("memplan.loop", "in_force"): "the loop's conventions and where each came from",
}
"""The functions report may call besides reading data: descriptions of a job's own fields."""


def _imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, name) of every import in ``path``, at any depth, relative ones made absolute."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    package = package.removesuffix(".__init__")
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found += [(base, a.name) for a in node.names]
    return found


REPORT_FILES = sorted((PACKAGE / "report").glob("*.py"))


@pytest.mark.parametrize("path", REPORT_FILES, ids=lambda p: p.name)
def test_report_imports_only_data_types_units_and_descriptions(path):
    for module, name in _imports(path):
        if not module.startswith("memplan") or module.startswith("memplan.report"):
            continue
        assert not module.startswith(COMPUTING), f"{path.name} imports {module}"
        assert name is not None, f"{path.name} imports the module {module}"
        value = getattr(importlib.import_module(module), name)
        assert isinstance(value, type) or (module, name) in DESCRIPTIONS, f"{path.name} imports {module}.{name}"


def test_decide_imports_nothing_of_report():
    for path in sorted((PACKAGE / "decide").glob("*.py")):
        assert not [m for m, _ in _imports(path) if m.startswith("memplan.report")], path.name


def test_whatifs_are_frozen_data_with_units_in_their_names():
    for cls in (whatifs.Fragmentation, whatifs.PagedStates, whatifs.ModeOutcome, whatifs.EstimateWhatIfs):
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
        for f in dataclasses.fields(cls):
            if f.type == "int":
                assert f.name.endswith("_bytes"), (cls.__name__, f.name)
            if f.type == "float":
                assert f.name.endswith("_s"), (cls.__name__, f.name)


def test_fragmentation_is_the_worst_rows_excess_and_a_second_replay():
    result = memplan.estimate(params=7e9, gpus=8, gpu="h100-sxm", strategy="all")
    frag = result.whatifs.fragmentation
    assert frag is not None
    excess = {e.job.plan.strategy: reserved_bytes(e) - e.allocated_bytes for e in result.estimates}
    assert frag.excess_bytes == max(excess.values()) == excess[frag.strategy] > 0
    worst = result[frag.strategy]
    assert frag.expandable_excess_bytes == reserved(worst.job, AllocConf(expandable_segments=True)).excess_bytes
    table = report.render_table(result.choice, list(result.estimates), whatifs=result.whatifs)
    assert f"fragmentation costs most under {frag.strategy}: {frag.excess_bytes / 2**30:.2f} GiB" in table


def test_explain_names_no_row_and_a_job_without_excess_prints_no_line():
    result = memplan.estimate(params=7e9, gpus=8, gpu="h100-sxm", strategy="ddp", calibration=None)
    frag = result.whatifs.fragmentation
    assert frag is not None and frag.strategy == "ddp"
    text = report.render_explain(result.choice, result.estimates[0], result.whatifs)
    assert f"fragmentation costs {frag.excess_bytes / 2**30:.2f} GiB beyond the tensors" in text
    assert report.fragmentation_line(None, several=True) == []


def test_paged_states_and_precisions_without_a_built_in_form():
    paged = memplan.estimate(params=1e9, gpus=2, gpu="h100-sxm", strategy="all", optimizer="paged-adamw8bit")
    rows = {p.strategy: p.paged_bytes for p in paged.whatifs.paged}
    assert list(rows) == [e.job.plan.strategy for e in paged.estimates] and all(rows.values())
    plain = memplan.estimate(params=1e9, gpus=2, gpu="h100-sxm", strategy="all")
    assert plain.whatifs.paged == () and report.paged_line(()) == []
    assert report.native_note(("ddp", "zero1"), "mixed-bf16")[0].startswith("ddp and zero1 have no built-in mixed-bf16")
