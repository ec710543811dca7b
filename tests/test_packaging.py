"""What the wheel ships is the tree: every package under memplan/ and calibrate/, the data tables,
and nothing of the tests, benchmarks or scripts (setuptools' own reading of setup.py + setup.cfg)."""

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
