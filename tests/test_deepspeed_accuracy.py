"""memplan's DeepSpeed ZeRO model against DeepSpeed run on CPU (validation/records/deepspeed_matrix_cpu.jsonl,
validation.dsmatrix): every record's estimate, with the loop that ran it, within 2 % of the
measured peak; one case re-run live on 2 real ranks."""

import importlib.util
from pathlib import Path

import pytest

from calibrate import records
from memplan import catalog
from memplan.frameworks.deepspeed import tensor_numels
from memplan.memory import estimate
from validation import dsmatrix, heldout

TOLERANCE = 0.02
RECORDS = Path(__file__).resolve().parent.parent / dsmatrix.OUT


def _records() -> list[dict]:
    return heldout.latest(records.read([RECORDS]))


def _error(record: dict, measured: int) -> float:
    return (estimate(heldout.loop_job(record)).allocated_bytes - measured) / measured


def test_every_case_is_recorded_and_ran():
    recorded = {r["case"]: r["status"] for r in _records()}
    assert recorded == {case.id: "ok" for case in dsmatrix.CASES}


@pytest.mark.parametrize("record", _records(), ids=lambda r: r["case"])
def test_estimate_within_2_percent(record):
    measured = record["measurement"]["peak_allocated_bytes"]
    error = _error(record, measured)
    assert abs(error) <= TOLERANCE, f"{record['case']}: measured {measured:,} B, estimated {error:+.2%} off"


@pytest.mark.parametrize("record", [r for r in _records() if r.get("host_bytes")], ids=lambda r: r["case"])
def test_offloaded_host_bytes_within_2_percent(record):
    assert abs(dsmatrix.host_error_pct(record)) <= 100 * TOLERANCE


MODELS = {m.name: m for m in (*catalog.models().values(), *(c.job.model for c in dsmatrix.CASES))}


@pytest.mark.parametrize("model", MODELS.values(), ids=MODELS)
def test_the_tensors_zero3_persists_are_cut_from_the_model_s_own_parameters(model):
    """ZeRO-3's persistence threshold applies per tensor: the list must add up to the spec's count."""
    assert sum(tensor_numels(model)) == model.num_params


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_one_case_live_on_two_ranks():
    """ZeRO-3, mixed-bf16, 2 gloo ranks: the same peak as recorded (to 0.1 %), within 2 % of memplan."""
    case = dsmatrix.BY_ID["ds-llama-h256-zero3-mixed-bf16-g2-b1s128"]
    outcome = dsmatrix.measure_case(case)
    assert outcome["status"] == "ok", outcome["error"]
    recorded = next(r for r in _records() if r["case"] == case.id)
    measured = outcome["measurement"]["peak_allocated_bytes"]
    assert measured == pytest.approx(recorded["measurement"]["peak_allocated_bytes"], rel=1e-3)
    assert abs(_error(recorded, measured)) <= TOLERANCE
