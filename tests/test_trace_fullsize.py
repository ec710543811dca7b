"""The full-size traced matrix (validation/records/trace_fullsize.jsonl) against the analytic
model: the planned job's estimate within the issue's 2 % on allocated wherever the trace's CPU
kernels run what CUDA's would, the job the trace ran (``traced_loop``) everywhere, and the gaps
of the first table (``FIRST``, the harness's own loop) derived from what that loop did
differently (the gradients freed between steps)."""

from __future__ import annotations

import statistics

import pytest

from calibrate import records
from memplan.memory import estimate
from validation.trace_matrix import CASES, FIRST, OUT, harness_loop, rows, traced_loop


def _ok_rows() -> list[dict]:
    return [r for r in rows() if r["status"] == "ok"]


def _record(name: str, path=OUT) -> dict:
    (case,) = [c for c in CASES if c.name == name]
    for recorded in reversed(records.read([path])):
        job = records.job_from_spec(recorded["spec"])
        train = job.train
        same = (job.model.name, train.seq_len, train.activation_checkpointing)
        if same == (case.flags.get("model"), case.flags["seq_len"], case.flags["ac"]):
            return recorded
    raise AssertionError(f"no record of {name}")


def _params(model) -> int:
    """A llama's parameter count from its shapes: embedding and head V·h, per block the q, k,
    v, o projections, the gated MLP's three and two norm weights, and the final norm."""
    h, f, V = model.hidden, model.ffn_hidden, model.vocab_size
    kv = h // model.num_heads * model.num_kv_heads
    block = h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h
    return 2 * V * h + model.num_layers * block + h


def test_every_case_traced():
    assert len(_ok_rows()) == len(CASES)


def test_traced_loop_within_two_percent_median_one():
    errors = [abs(r["traced_loop_allocated_gib"] / r["trace_allocated_gib"] - 1) for r in _ok_rows()]
    assert max(errors) < 0.02
    assert statistics.median(errors) < 0.01


def test_the_planned_estimate_is_the_trace_where_cpu_kernels_save_what_cudas_do():
    # the trace runs torchtitan's loop (gradients kept, the loss after the model): only per-op
    # SAC's attention differs between its CPU kernels and CUDA's (below). Within 0.01 % but 405B
    # FSDP 64 × TP 8, whose blocks' backward under TP is one moment per block (+0.73 %; −6.8 % in
    # the held-out cases' first table, before the zero-filled gradients were kept under TP)
    planned = [r for r in _ok_rows() if "op-sac" not in r["case"]]
    assert len(planned) == len(CASES) - 2
    errors = {r["case"]: r["estimate_allocated_gib"] / r["trace_allocated_gib"] - 1 for r in planned}
    assert statistics.median(abs(e) for e in errors.values()) < 0.01
    for case, error in errors.items():
        assert abs(error) < (0.0075 if "405b" in case else 0.0001), case


def test_op_sac_gap_is_cuda_sdpa_outputs():
    # under --ac op the CUDA sdpa kernels' output (c·b·s·q) and logsumexp (4·b·a·s) are in the
    # save list; the CPU flash kernel's are not (torch/_functorch/partitioners.py)
    job = records.job_from_spec(_record("llama-3.1-8b fsdp8 2x8k op-sac")["spec"])
    m, t = job.model, job.train
    gap = estimate(job).allocated_bytes - estimate(traced_loop(job)).allocated_bytes
    sdpa = m.num_layers * (2 * t.micro_batch * t.seq_len * m.hidden + 4 * t.micro_batch * m.num_heads * t.seq_len)
    assert gap == sdpa


def test_the_first_tables_loop_within_two_percent_and_its_gap_the_gradients():
    # the first table's traces freed the gradients between steps (zero_grad(set_to_none=True))
    # where torchtitan keeps them: without AC, 4·P/N fp32 shards were the whole gap
    first = [r for r in rows(FIRST, harness_loop) if r["status"] == "ok"]
    assert len(first) == 6  # the cases before the held-out ones
    assert max(abs(r["traced_loop_allocated_gib"] / r["trace_allocated_gib"] - 1) for r in first) < 0.02
    job = records.job_from_spec(_record("llama-3.1-8b fsdp8 8k no-ac", FIRST)["spec"])
    gap = estimate(job).allocated_bytes - estimate(harness_loop(job)).allocated_bytes
    assert gap == pytest.approx(4 * _params(job.model) / job.cluster.gpus, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("ac", ["full", "op"])
def test_a_small_traced_fsdp_job_keeps_each_blocks_rotary_casts(ac):
    """The full-size miss at a small shape: under FSDP2's input cast a checkpointed block keeps
    its own compute-dtype cos/sin (2·c·s·d per block). The trace holds the int64 labels
    (8·b·s) and a few scalars beyond the estimate, nothing else."""
    pytest.importorskip("torch")
    from calibrate import trace
    from calibrate.runs import plan
    from validation.trace_matrix import _COMMON

    flags = {"arch": "llama", "layers": 3, "hidden": 384, "heads": 6, "kv_heads": 2, "ffn": 1408}
    flags |= {"vocab": 32000, "gpus": 8, "seq_len": 2048, "micro_batch": 1, "ac": ac}
    (run,) = plan([_COMMON | flags], mode="trace", steps=2, warmup=1)[0]
    traced = trace.run(run.job, steps=2, warmup=1)
    estimated = estimate(traced_loop(run.job)).allocated_bytes
    labels = 8 * run.job.train.micro_batch * run.job.train.seq_len
    assert 0 <= traced.peak_allocated_bytes - estimated - labels < 1024


@pytest.mark.slow
def test_zero_filled_gradients_of_every_block_under_fsdp_by_tp():
    """The 405B miss at a small shape: under FSDP 64 × TP 8 and torchtitan's kept (zero-filled)
    gradients, every block's gradient shard is live in the last block's backward; memplan counted
    the head's alone there (−6.8 % on 405B). Two more blocks add what the trace adds (from four:
    with two the peak is elsewhere)."""
    pytest.importorskip("torch")
    from calibrate import trace
    from calibrate.runs import plan
    from validation.trace_matrix import _COMMON

    def both(layers: int) -> tuple[int, int]:
        flags = {"arch": "llama", "layers": layers, "hidden": 8192, "heads": 64, "kv_heads": 8, "ffn": 26624}
        flags |= {"vocab": 32000, "gpus": 512, "tp": 8, "seq_len": 2048, "micro_batch": 1, "ac": "full"}
        (run,) = plan([_COMMON | flags], mode="trace", steps=2, warmup=1)[0]
        traced = trace.run(run.job, steps=2, warmup=1).peak_allocated_bytes
        return traced, estimate(traced_loop(run.job)).allocated_bytes

    (trace_4, estimate_4), (trace_6, estimate_6) = both(4), both(6)
    assert estimate_6 - estimate_4 == pytest.approx(trace_6 - trace_4, rel=0.001)
