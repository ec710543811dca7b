"""calibrate.peak_probe names what FSDP2 holds at a held-out case's peak: re-run live, the
composition adds up to the recorded peak and shows the instant memory.ROOT_REDUCE models."""

from pathlib import Path

import pytest

from calibrate import heldout, records

RECORDS = Path(__file__).resolve().parent.parent / heldout.OUT
CASE = "llama-h384-plain-kept-fsdp-mixed-bf16-acnone-g2-b1s128"


@pytest.mark.slow
def test_the_root_reduce_instant_is_the_llama_plain_kept_peak():
    from calibrate import peak_probe

    measurement, probe = peak_probe.run(CASE, from_mib=90)
    [record] = [r for r in heldout.latest(records.read([RECORDS])) if r["case"] == CASE]
    assert measurement.peak_allocated_bytes == record["measurement"]["peak_allocated_bytes"]
    held = probe.peak.bytes_by_holder
    assert sum(held.values()) == probe.peak.total_bytes == measurement.peak_allocated_bytes
    # the root resharded (no unsharded parameters), its reduce under way: the head weight's
    # unsharded gradient kept by foreach_reduce's loop variable after unsharded_grads.clear()
    assert not any(name.startswith("unsharded parameters") for name in held)
    assert held["gradient in foreach_reduce [hf.lm_head.weight]"] == 2 * 8192 * 384
