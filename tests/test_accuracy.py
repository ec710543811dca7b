"""memplan's `allocated` against real CPU training steps (DDP and FSDP2 with gloo in 2
processes, the fake process group for larger worlds), measured with torch's MemTracker."""

from pathlib import Path

import pytest

pytest.importorskip("torch")
from calibrate import records
from calibrate.matrix import CASES, measure_case, runs
from memplan.memory import estimate

TOLERANCE = 0.01  # the claimed error is 0.2 %; a case whose error grows past 1 % fails


def test_matrix_covers_what_it_must():
    jobs = [c.job for c in CASES]
    assert len(CASES) >= 16
    assert {"ddp", "fsdp-full-shard", "fsdp-shard-grad-op"} <= {j.plan.strategy for j in jobs}
    assert {"fp32", "amp-bf16", "mixed-bf16"} <= {j.train.precision for j in jobs}
    assert {"none", "full"} <= {j.train.activation_checkpointing for j in jobs}
    assert {"sdpa", "eager"} <= {j.train.attention for j in jobs}
    assert {"local", "emulate"} <= {c.mode for c in CASES}
    assert any(c.workload == "hf" for c in CASES)
    assert {"optimizer", "backward"} <= {estimate(j).phase for j in jobs}


_VIT_FSDP = (
    "ViT under FSDP2 is 2.3-2.4 % high (docs/accuracy.md, Limitations): its block moments charge a prefetched "
    "block and a block's full gradients that FSDP2 does not hold there"
)
KNOWN = {"hf-vit-full-amp-eager-w4": _VIT_FSDP, "hf-vit-full-mixed-ac-w4": _VIT_FSDP}
KNOWN_BAND = (0.01, 0.03)
"""Where a KNOWN case's committed record must stay: high (the safe side) by what its reason says."""
RECORDS = Path(__file__).resolve().parent.parent / "docs" / "accuracy_matrix_cpu.jsonl"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_committed_record_within_tolerance(case):
    """Every case's committed measurement against today's model (fast: no run); a KNOWN case
    inside its documented band, so a residual that changes sign or grows fails too."""
    [run] = runs([case])
    [record] = [r for r in records.read([RECORDS]) if r["id"] == run.id][-1:]
    measured = record["measurement"]["peak_allocated_bytes"]
    error = (estimate(case.job).allocated_bytes - measured) / measured
    low, high = KNOWN_BAND if case.id in KNOWN else (-TOLERANCE, TOLERANCE)
    assert low <= error <= high, f"{case.id}: {error:+.2%}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, id=c.id, marks=[pytest.mark.xfail(strict=True, reason=KNOWN[c.id])] if c.id in KNOWN else [])
        for c in CASES
    ],
)
def test_allocated_within_tolerance_of_measured_peak(case):
    measured = measure_case(case)
    est = estimate(case.job)
    error = (est.allocated_bytes - measured.peak_allocated_bytes) / measured.peak_allocated_bytes
    assert abs(error) <= TOLERANCE, (
        f"{case.id}: estimated {est.allocated_bytes:,} B ({est.phase}), "
        f"measured {measured.peak_allocated_bytes:,} B ({measured.phase}): {error:+.2%}"
    )
    assert est.phase == measured.phase
