"""Where the data tables live (``tables/``, installed as ``memplan/_tables``) and how one is read:
the bottom of the stack, beneath the specs (``catalog`` turns rows into specs)."""

from __future__ import annotations

import csv
from pathlib import Path

_INSTALLED = Path(__file__).with_name("_tables")
TABLES_DIR = _INSTALLED if _INSTALLED.is_dir() else Path(__file__).resolve().parent.parent / "tables"


def read_table(name: str) -> list[dict[str, str]]:
    with open(TABLES_DIR / name, newline="") as f:
        return list(csv.DictReader(f))
