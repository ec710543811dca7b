"""The GPU record set shipped from the campaign on an H200 (tables/calibration/h200-*.jsonl,
validation/records/gpu_campaign_h200.md): today's model against every record, the allocator replay against
each snapshot run's own events, and the accuracy page regenerated."""

import json
from pathlib import Path

import pytest

from calibrate import alloctrace, records
from memplan.allocator import replay
from memplan.calibration import shipped
from memplan.memory import estimate
from memplan.overheads import _context_bytes
from validation import campaign

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "tables" / "calibration" / "h200-torch2.11.0-cu130.jsonl"
TRACES = ROOT / "validation" / "records" / "gpu" / "h200-torch2.11.0-cu130"
PAGE = ROOT / "validation" / "records" / "gpu_campaign_h200.md"

KNOWN_MISSES = {
    # inductor's saved tensors on CUDA (5)
    "loop/1b-fsdp-w8-mixed-bf16-compile-b2s2048": -35.6,
    "ac/0.5b-ddp-w8-amp-bf16-ac-op-b2s2048": 5.6,
    "model/gpt2-ddp-w8-amp-bf16-eager-b8s1024": -8.2,
    "model/vit-l-fsdp-w8-mixed-bf16-b32s197": -2.6,
    "model/vit-l-ddp-w8-amp-bf16-b32s197": -1.6,
}
"""Runs whose allocated the model misses by more than 1 %, each held to its documented error."""


def _ok():
    return [r for r in records.read([RECORDS]) if r["status"] == "ok"]


def test_allocated_within_one_percent_on_the_gpu_but_the_documented_misses():
    ok = _ok()
    assert len(ok) == 69
    for record in ok:
        measured = record["measurement"]["peak_allocated_bytes"]
        error = (estimate(records.job_from_spec(record["spec"])).allocated_bytes / measured - 1) * 100
        name = record["campaign"]["name"]
        if name in KNOWN_MISSES:
            assert error == pytest.approx(KNOWN_MISSES[name], abs=0.05), name
        else:
            assert abs(error) <= 1.0, (name, error)


@pytest.mark.parametrize("trace", sorted(TRACES.glob("snapshot_*.trace.jsonl.gz")), ids=lambda p: p.name[9:40])
def test_the_allocator_replays_each_gpu_runs_own_events_to_its_measured_reserved(trace):
    name = "snapshot/" + trace.name.removeprefix("snapshot_").removesuffix(".trace.jsonl.gz")
    (record,) = [r for r in _ok() if r["campaign"]["name"] == name]
    measured = record["measurement"]["peak_reserved_bytes"]
    replayed = replay(alloctrace.load(trace))
    assert replayed.peak_allocated_bytes == pytest.approx(record["measurement"]["peak_allocated_bytes"], rel=1e-3)
    # to the byte (DDP's was one 64 MiB segment under while the replay's segments ascended:
    # memplan.allocator._FIXED_TOP)
    assert replayed.peak_reserved_bytes == measured


def test_the_shipped_h200_corrections_are_these_records_and_take_the_measured_context():
    calibration = shipped("h200")
    assert calibration is not None
    (correction,) = calibration.corrections
    assert correction.num_records == len(_ok()) and correction.device == "NVIDIA H200"
    # an emulated rank has no NCCL communicator: the table's per-communicator default stays
    assert correction.communicator_bytes is None
    outside = sorted(r["measurement"]["device_used_bytes"] - r["measurement"]["peak_reserved_bytes"] for r in _ok())
    assert correction.context_bytes == pytest.approx(outside[len(outside) // 2], rel=1e-3)
    job = records.job_from_spec(_ok()[0]["spec"])
    assert abs(_context_bytes(job) - outside[len(outside) // 2]) < 2**20


def test_probes_measured_the_context_lazily_and_eagerly():
    probes = {json.loads(line)["probe"]: json.loads(line) for line in (TRACES / "probes.jsonl").open()}
    lazy = probes["context-lazy"]["measurement"]["nvml_process_used_bytes"]
    eager = probes["context-eager"]["measurement"]["nvml_process_used_bytes"]
    assert 500 * 2**20 < lazy < eager < 3 * lazy


@pytest.mark.slow  # 69 replayed estimates and two fits: ~20 s
def test_the_accuracy_page_is_todays_model():
    page = PAGE.read_text(encoding="utf-8")
    table = campaign.report(records.read([RECORDS]), campaign.replayed_traces(TRACES))
    assert page.endswith(table)
