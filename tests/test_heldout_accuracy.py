"""memplan against the held-out matrix (validation/records/heldout_matrix_cpu.jsonl), each record estimated
with the loop that ran it (validation.heldout.loop_job): within 1 % of the measured peak. The
cases memplan does not yet meet are listed with what the measured categories show; each is
a strict xfail, so a fixed one must leave the list, and holds to its documented error."""

from pathlib import Path

import pytest

from memplan.memory import estimate
from validation import heldout

TOLERANCE = 0.01
RECORDS = Path(__file__).resolve().parent.parent / heldout.OUT

_KV_CACHE = (
    "Hugging Face's DynamicCache (use_cache, the plain loop without AC) copies k and v (torch.cat) beside the "
    "fused c_attn output the query's view pins: 2·c·b·s·h per block kept that the model does not have "
    "(autograd's saved tensors: 9 MiB c_attn output, 3 MiB k, 3 MiB v); measured peak 390.20 MiB, estimated "
    "384.17 (start of backward), -1.55 %"
)
_NEOX_RECOMPUTE = (
    "peak inside the first block's backward beside the input embedding unit's prefetched buffer and the MLP "
    "output projection's gradient (modelled); the recomputed block's tensors measured 35.0 MiB, the modelled "
    "transient 37.5 (the GELU output freed once the projection's weight gradient is made): +1.02 %"
)
_COMPILE = (
    "torchtune's loop compiled (blocks and chunked loss): +1.27 % (6.3 MB, two of the eight fp32 chunk gradients) "
    "on the allocator's peak; measured apart: eager 507.6 MB (the model's 507.6), blocks compiled alone 495.2 "
    "(= both compiled), the loss compiled alone 501.3; the modelled compiled blocks save 6.2 MB, measured 12.4"
)
_ZERO_GRAD = (
    "-3.08 % (4.3 MiB): zero-filled gradients under torchtitan's FSDP2 units peak at the head unit's "
    "post-backward (MemTracker: its unsharded bf16 gradient and the reduce-scatter input, 2 x 23.4 MiB, the "
    "reduce-scatter output and its fp32 cast, 5.9 MiB, added in place into the kept sharded gradient, the last "
    "block prefetched), an instant memplan has no moment for; the LM head's backward is its peak"
)
_CCE_BF16 = (
    "-1.19 % (0.63 MB): the allocator's timeline puts the peak on an 820,992 B buffer allocated and freed "
    "right after the bf16 head weight gradient, inside the compiled backward (about 4·b·(s−1)·h: the CPU bf16 "
    "matmul's fp32 scratch, by its size; fp32 cases have none); a transient of CPU's matmul, not modelled"
)
_CCE_FIRST_BLOCK = (
    "-1.08 % (+1.37 % before FSDP2's block backward instants): the peak is inside the first block's backward "
    "under full AC, after the loss has freed all it held, estimated the same with every loss model; its "
    "mixed-bf16 twin without AC, +7.18 % then, is -0.14 %"
)
KNOWN = {
    "llama-h384-cce-compile-single-bf16-acnone-sgd-w1-b2s256": (-1.19, _CCE_BF16),
    "qwen2-h448-cce-compile-fsdp-fp32-acfull-w4-b2s256": (-1.08, _CCE_FIRST_BLOCK),
    "llama-h768-torchtitan-fsdp-mixed-bf16-acfull-zgzeros-w8-b1s128": (-3.08, _ZERO_GRAD),
    "llama-h640-torchtune-fsdp-fp32-acnone-compile-w4-b2s128": (+1.27, _COMPILE),
    "gpt2-h384-s2048-plain-kept-fsdp-fp32-acnone-w4-b1s2048": (-1.55, _KV_CACHE),
    "neox-h768-hf-trainer-fsdp-fp32-acfull-w4-b1s512": (+1.02, _NEOX_RECOMPUTE),
}
"""case -> (its error in %, what is known of it)."""
DOCUMENTED_PCT = 0.05
"""How far a known case may move from its documented error before the reason is stale."""


def _records() -> list[dict]:
    return heldout.latest_ok(RECORDS)


def _params():
    return [
        pytest.param(
            r,
            id=r["case"],
            marks=[pytest.mark.xfail(strict=True, reason=KNOWN[r["case"]][1])] if r["case"] in KNOWN else [],
        )
        for r in _records()
    ]


def test_the_known_cases_are_cases():
    assert set(KNOWN) <= {r["case"] for r in _records()}


@pytest.mark.parametrize("record", _params())
def test_estimate_with_the_loop_within_1_percent(record):
    measured = record["measurement"]["peak_allocated_bytes"]
    est = estimate(heldout.loop_job(record))
    error = (est.allocated_bytes - measured) / measured
    assert abs(error) <= TOLERANCE, (
        f"{record['case']}: estimated {est.allocated_bytes:,} B, measured {measured:,} B: {error:+.2%}"
    )


@pytest.mark.parametrize("case", sorted(KNOWN))
def test_known_cases_keep_their_documented_error(case):
    """A known miss stays what its reason says: a change of size or sign is a stale reason."""
    [record] = [r for r in _records() if r["case"] == case]
    measured = record["measurement"]["peak_allocated_bytes"]
    error_pct = (estimate(heldout.loop_job(record)).allocated_bytes - measured) / measured * 100
    assert error_pct == pytest.approx(KNOWN[case][0], abs=DOCUMENTED_PCT)


def _offload_records() -> list[dict]:
    return [r for r in heldout.latest_ok(RECORDS) if r["loop"]["offload_activations"]]


def test_offloading_cases_are_recorded():
    assert len(_offload_records()) == sum(case.job.train.offload_activations for case in heldout.CASES) == 3


@pytest.mark.parametrize("record", _offload_records(), ids=lambda r: r["case"])
def test_offloading_forward_phase_within_1_percent(record):
    """Activation offloading acts at the end of forward (what the stash keeps on the device):
    each offloading case's forward-phase peak against memplan's largest forward moment. FSDP's
    forward peaks earlier (its twin without offloading measured the same 63.90 MiB), at an
    instant memplan's forward moments do not cover, so only the other strategies are held here."""
    if record["spec"]["plan"]["strategy"].startswith("fsdp"):
        pytest.skip("FSDP's forward peak is before the end of forward, offloading or not")
    measured = record["measurement"]["phase_peaks"]["forward"]
    moments = estimate(heldout.loop_job(record)).moments
    estimated = max(m.allocated_bytes for m in moments if m.phase == "forward")
    assert abs(estimated - measured) <= TOLERANCE * measured, (estimated, measured)
