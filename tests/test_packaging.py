"""What the wheel ships is the tree: every package under memplan/ and calibrate/, the data tables,
and nothing of the tests, benchmarks, scripts or the accuracy harness (validation/), by setuptools'
own reading of setup.py + setup.cfg (.ci/wheel checks the built wheel's files the same way)."""

import importlib
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def distribution():
    import setuptools  # noqa: F401 -- before distutils: from Python 3.12 on, setuptools provides it

    run_setup = importlib.import_module("distutils.core").run_setup

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return run_setup(str(ROOT / "setup.py"), stop_after="config")
    finally:
        os.chdir(cwd)


def _packages_in_tree() -> set[str]:
    return {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in ("memplan", "calibrate")
        for init in (ROOT / top).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }


def test_every_package_of_the_tree_ships(distribution):
    tree = _packages_in_tree()
    assert {"memplan", "memplan.frameworks", "memplan.decide", "memplan.parallel", "calibrate"} <= tree
    assert tree <= set(distribution.packages), tree - set(distribution.packages)


def test_the_tables_ship_as_memplan_tables(distribution):
    assert "memplan._tables" in distribution.packages
    assert Path(distribution.package_dir["memplan._tables"]).resolve() == ROOT / "tables"
    assert "*.csv" in distribution.package_data["memplan._tables"]


def test_nothing_else_ships(distribution):
    allowed = _packages_in_tree() | {"memplan._tables"}
    assert set(distribution.packages) == allowed
    assert not {p for p in distribution.packages if p.split(".")[0] in ("tests", "benchmarks", "scripts", "notebooks")}


def _harness_modules() -> set[str]:
    return {py.stem for py in (ROOT / "validation").glob("*.py") if py.stem != "__init__"}


def _shipped_modules(distribution) -> set[tuple[str, str]]:
    """(package, module) of every .py file the wheel's build_py step copies."""
    build_py = distribution.get_command_obj("build_py")
    build_py.ensure_finalized()
    return {(package, module) for package, module, _ in build_py.find_all_modules()}


def test_the_accuracy_harness_does_not_ship(distribution):
    harness = _harness_modules()
    assert {"heldout", "dsmatrix", "campaign", "parallel_matrix", "peak_probe"} <= harness
    shipped = _shipped_modules(distribution)
    assert ("calibrate.cli", "cli") not in shipped and ("calibrate", "cli") in shipped  # the listing is real
    assert not {p for p in distribution.packages if p.split(".")[0] == "validation"}
    assert not {(p, m) for p, m in shipped if p.split(".")[0] == "validation"}
    # no harness module under calibrate/ (nor a module of one name in both: which would import?)
    assert not {m for p, m in shipped if p.split(".")[0] == "calibrate"} & harness
