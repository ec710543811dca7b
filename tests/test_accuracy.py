"""memplan's `allocated` against real CPU training steps (DDP and FSDP2 with gloo in 2
processes, the fake process group for larger worlds), measured with torch's MemTracker."""

import pytest

pytest.importorskip("torch")
from calibrate.matrix import CASES, measure_case
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
    "ViT under FSDP2 is 2.3-2.4 % high (README Limitations): its block moments charge a prefetched "
    "block and a block's full gradients that FSDP2 does not hold there"
)
KNOWN = {"hf-vit-full-amp-eager-w4": _VIT_FSDP, "hf-vit-full-mixed-ac-w4": _VIT_FSDP}


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
