"""Per-op SAC under tensor parallel (validation/records/opsac_tp_cpu.md): memplan's estimate of
each traced job against its committed trace, and one small case traced live."""

from pathlib import Path

import pytest

from calibrate import records
from memplan.memory import estimate
from validation import opsac_tp
from validation.trace_matrix import traced_loop

PAGE = Path(opsac_tp.__file__).resolve().parent / "records" / "opsac_tp_cpu.md"


def _held() -> dict:
    return {records.record_key(r): r for r in records.read([opsac_tp.OUT])}


@pytest.mark.parametrize("name", [name for name, _ in opsac_tp.CASES])
def test_each_traced_case_within_a_tenth_of_a_percent(name):
    record = _held()[opsac_tp._run(dict(opsac_tp.CASES)[name]).key]
    traced = record["measurement"]["peak_allocated_bytes"]
    est = estimate(traced_loop(records.job_from_spec(record["spec"])))
    assert est.allocated_bytes == pytest.approx(traced, rel=1e-3)
    assert est.phase == record["measurement"]["phase"]


def test_the_page_holds_the_table_of_the_records():
    assert opsac_tp.report() in PAGE.read_text()


@pytest.mark.slow
def test_a_small_case_traced_live_equals_its_record(tmp_path):
    from calibrate.runs import sweep

    name = "h2048 x6, fsdp4 x tp4 no sp, 2x2k"
    run = opsac_tp._run(dict(opsac_tp.CASES)[name])
    sweep([run], out=tmp_path / "live.jsonl", timeout_s=900)
    (live,) = records.read([tmp_path / "live.jsonl"])
    assert live["measurement"]["peak_allocated_bytes"] == _held()[run.key]["measurement"]["peak_allocated_bytes"]
