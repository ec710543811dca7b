"""validation.peak_probe names what FSDP2 holds at a held-out case's peak: re-run live, the
composition adds up to the recorded peak and shows the instant memory.ROOT_REDUCE models."""

from pathlib import Path

import pytest

from calibrate import records
from validation import heldout

RECORDS = Path(__file__).resolve().parent.parent / heldout.OUT
CASE = "llama-h384-plain-kept-fsdp-mixed-bf16-acnone-g2-b1s128"


@pytest.mark.slow
def test_the_root_reduce_instant_is_the_llama_plain_kept_peak():
    from validation import peak_probe

    measurement, probe = peak_probe.run(CASE, from_mib=90)
    [record] = [r for r in heldout.latest(records.read([RECORDS])) if r["case"] == CASE]
    assert measurement.peak_allocated_bytes == record["measurement"]["peak_allocated_bytes"]
    held = probe.peak.bytes_by_holder
    assert sum(held.values()) == probe.peak.total_bytes == measurement.peak_allocated_bytes
    # the root resharded (no unsharded parameters), its reduce under way: the head weight's
    # unsharded gradient kept by foreach_reduce's loop variable after unsharded_grads.clear()
    assert not any(name.startswith("unsharded parameters") for name in held)
    assert held["gradient in foreach_reduce [hf.lm_head.weight]"] == 2 * 8192 * 384


@pytest.mark.slow
@pytest.mark.parametrize("dtype,per_element", [("bfloat16", 18), ("float16", 18), ("float32", 16)])
def test_the_rmsnorm_backward_temporaries_are_the_modelled_bytes(dtype, per_element):
    """memory.Step.block_end_terms: LlamaRMSNorm's backward peaks this many bytes per element
    above its start (the input, what it saved, its output and the incoming gradient live)."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from memplan.memory import Step
    from memplan.specs import ClusterSpec, Job, ModelSpec, Plan, TrainSpec

    b, s, h = 1, 128, 512
    torch_dtype = getattr(torch, dtype)
    norm = LlamaRMSNorm(h).to(torch_dtype)
    x = torch.randn(b, s, h, dtype=torch_dtype, requires_grad=True)
    cpu = torch.device("cpu")
    with MemTracker() as tracker:
        y = norm(x)
        grad = torch.randn_like(y)
        start = tracker.get_tracker_snapshot("current")[cpu]["Total"]
        tracker._peak_mem = {cpu: start}
        y.backward(grad)
        peak = tracker._peak_mem[cpu]
    assert peak - start == pytest.approx(per_element * b * s * h, abs=4096)  # rstd and small tensors

    precision = {"bfloat16": "bf16", "float16": "mixed-fp16", "float32": "fp32"}[dtype]
    job = Job(
        model=ModelSpec(num_layers=2, hidden=h, num_heads=4, ffn_hidden=4 * h, vocab_size=1024),
        train=TrainSpec(seq_len=s, micro_batch=b, precision=precision),
        cluster=ClusterSpec(gpus=4),
        plan=Plan(strategy="fsdp-full-shard"),
    )
    [temporaries] = [t for t in Step(job).block_end_terms(0) if t.name == "input norm's backward temporaries"]
    assert temporaries.bytes == per_element * b * s * h
