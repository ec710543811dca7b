"""Constants that are data: tables/overheads.csv and tables/decision.csv, each row sourced."""

import pytest

from memplan import catalog
from memplan.errors import MemplanError
from memplan.inputs import build_jobs
from memplan.memory import estimate


@pytest.mark.parametrize("name", ["overheads.csv", "decision.csv"])
def test_every_setting_has_a_value_a_unit_and_a_source(name):
    for row in catalog.read_table(name):
        assert float(row["value"]) > 0 and row["unit"] and len(row["source"]) > 40, row["key"]


def test_the_estimate_adds_the_tabled_overheads():
    table = {row["key"]: float(row["value"]) for row in catalog.read_table("overheads.csv")}
    _, (job,) = build_jobs(params=7e9, gpus=8, strategy="fsdp-full-shard", gpu_mem=80)
    est = estimate(job)
    fixed = (table["cuda_context_mib"] + table["nccl_mib"]) * 2**20
    assert est.overhead_bytes == fixed + int(est.allocated_bytes * table["allocator_slack_fraction"])


def test_an_unknown_decision_setting_is_one_line():
    assert catalog.decision_setting("default_gpus_per_node") == 8
    with pytest.raises(MemplanError, match=r"'nope' is not in tables/decision.csv; known: speed_significant"):
        catalog.decision_setting("nope")
