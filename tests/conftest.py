import os

import pytest
from hypothesis import settings

from memplan.calibration import SHIPPED_DIR
from memplan.catalog import TABLES_DIR

# Every test replays for itself, its subprocesses too: none reads the answers of another run
# (memplan.replaycache); tests/test_replay_cache.py points it at a folder of its own. And in its
# own process: a fork of the test process (hundreds of MB, torch loaded) would cost more than the
# replays it shares (alloctrace.replay_ahead); tests/test_replay_cache.py forks on purpose.
os.environ["MEMPLAN_CACHE_DIR"] = "none"
os.environ["MEMPLAN_REPLAY_WORKERS"] = "1"

SHIPPED_CPU_RECORDS = TABLES_DIR / SHIPPED_DIR / "cpu-torch2.13.0.jsonl"
"""Real emulated DDP / FSDP2 steps on this project's CPU, as `memplan calibrate run` wrote them."""


@pytest.fixture(scope="session")
def shipped_cpu_records() -> list[dict]:
    from calibrate import records

    return records.read([SHIPPED_CPU_RECORDS])


# Every property test draws the same examples on every run (as tests/test_cli_properties.py
# does), so a CI failure reproduces and a run's verdict does not depend on its random seed.
settings.register_profile("derandomized", derandomize=True, database=None)
settings.load_profile("derandomized")
