import pytest

from memplan.calibration import SHIPPED_DIR
from memplan.catalog import TABLES_DIR

SHIPPED_CPU_RECORDS = TABLES_DIR / SHIPPED_DIR / "cpu-torch2.13.0.jsonl"
"""Real emulated DDP / FSDP2 steps on this project's CPU, as `memplan calibrate run` wrote them."""


@pytest.fixture(scope="session")
def shipped_cpu_records() -> list[dict]:
    from calibrate import records

    return records.read([SHIPPED_CPU_RECORDS])
