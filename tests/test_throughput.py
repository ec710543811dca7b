"""The throughput model against hand arithmetic, and its invariants."""

from functools import partial

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.infer import model_for_params
from memplan.inputs import build_jobs
from memplan.specs import ClusterSpec, Job, Plan, TrainSpec
from memplan.strategies import strategies_on
from memplan.throughput import comm_seconds, flops_per_token, link_for, relative_to_ddp, step_time

M13 = model_for_params(13_000_000_000)  # 40 layers, hidden 5120: 13,015,864,320 parameters


def job(strategy="ddp", gpus=8, gpu="h100-sxm", **train):
    from memplan import catalog

    spec = catalog.gpu(gpu)
    cluster = ClusterSpec(gpus=gpus, gpu_mem_bytes=spec.memory_bytes, gpu_name=spec.name)
    return Job(model=M13, train=TrainSpec(**train), cluster=cluster, plan=Plan(strategy=strategy))


def test_flops_per_token_palm_formula_by_hand():
    # 6·N + 12·L·h·s = 6 × 13,015,864,320 + 12 × 40 × 5120 × 2048 = 78,095,185,920 + 5,033,164,800
    assert M13.num_params == 13_015_864_320
    assert flops_per_token(job()) == 83_128_350_720
    # full AC re-runs the forward: + 2·N + 4·L·h·s = 26,031,728,640 + 1,677,721,600
    assert flops_per_token(job(activation_checkpointing="full")) == 83_128_350_720 + 27_709_450_240
    # selective re-runs the attention core only: + 4·L·h·s
    assert flops_per_token(job(activation_checkpointing="selective")) == 83_128_350_720 + 1_677_721_600


def test_compute_and_comm_by_hand_13b_on_8_h100():
    j = job()
    link = link_for(j)
    step = step_time(j, link)
    # 2048 tokens × 83.128e9 FLOPs / (989.4e12 × 0.45 MFU) = 0.38238 s → 5,356 tokens/s per GPU
    assert step.compute_s == pytest.approx(2048 * 83_128_350_720 / (989.4e12 * 0.45))
    assert step.tokens_per_s == pytest.approx(5356, abs=1)
    # DDP all-reduce: 2·(7/8)·N·2 B = 45.56e9 B over NVLink 900/2 = 450 GB/s = 0.1012 s, hidden by 0.5 × 0.382 s
    assert link.intra_node_bytes_s == 450e9
    assert step.comm_s == pytest.approx(2 * 7 / 8 * M13.num_params * 2 / 450e9)
    assert step.exposed_comm_s == 0.0
    # FULL_SHARD: (7/8)·(2·W + G) = 1.5 × DDP's bytes (ZeRO §7.2.2)
    assert comm_seconds(job("fsdp-full-shard"), link) == pytest.approx(1.5 * step.comm_s)
    assert comm_seconds(job("fsdp-shard-grad-op"), link) == pytest.approx(step.comm_s)


def test_fsdp_penalty_appears_on_a_slow_fabric():
    """13B on 2 nodes × 8 H100 over one 100 GbE NIC per node (12.5 GB/s):
    DDP comm 2·15/16·26.03e9 B / 12.5e9 = 3.905 s, exposed 3.905 − 0.191 = 3.714 s, step 4.096 s;
    FULL_SHARD 15/16·78.10e9 / 12.5e9 = 5.857 s, exposed 5.666 s, step 6.048 s → 0.677× DDP."""
    j = job("fsdp-full-shard", gpus=16)
    link = link_for(j, interconnect="ethernet")
    assert link.inter_node_bytes_s == 12.5e9
    assert step_time(j, link).comm_s == pytest.approx(15 / 16 * 6 * M13.num_params / 12.5e9)
    assert relative_to_ddp(j, partial(step_time, link=link)) == pytest.approx(0.677, abs=0.002)


def test_offload_costs_host_link_and_cpu_adam():
    j = job("zero3").with_(offload="optimizer")
    link = link_for(j)
    # shard N/8 = 1.627e9 params: grads down + params up 4 B over 64 GB/s, AdamW 28 B at 200/8 GB/s
    shard = M13.num_params / 8
    expected = shard * 4 / 64e9 + shard * 28 / 25e9
    assert step_time(j, link).offload_s == pytest.approx(expected)


def test_bw_flag_and_bad_values():
    from memplan.errors import MemplanError

    j = job(gpus=16)
    assert link_for(j, bw_gbs=50).inter_node_bytes_s == 50e9
    with pytest.raises(MemplanError, match="interconnect 'carrier-pigeon' is not one of"):
        link_for(j, interconnect="carrier-pigeon")
    with pytest.raises(MemplanError, match="bw must be a positive number"):
        link_for(j, bw_gbs=-1)


@settings(max_examples=40, deadline=None)
@given(
    strategy=st.sampled_from(strategies_on(2)),
    gpus=st.sampled_from([2, 8, 16, 64]),
    ac=st.sampled_from(["none", "selective", "full"]),
    mb=st.integers(1, 8),
)
def test_ddp_is_its_own_baseline_and_relative_is_positive(strategy, gpus, ac, mb):
    j = job(strategy, gpus=gpus, activation_checkpointing=ac, micro_batch=mb)
    link = link_for(j)
    assert relative_to_ddp(j.with_(strategy="ddp"), partial(step_time, link=link)) == 1.0
    relative = relative_to_ddp(j, partial(step_time, link=link))
    assert relative > 0
    if strategy != "fsdp-hybrid-shard" or gpus <= 8:
        # every flat strategy moves at least DDP's bytes over the same ring
        assert relative <= 1.0 + 1e-12


def test_hybrid_crosses_nodes_with_a_shard_only():
    """13B, 2 nodes × 8 H100, 100 GbE: HYBRID_SHARD's inter-node all-reduce carries G/8 per GPU:
    2·(1/2)·26.03e9/8 / 12.5e9 = 0.260 s, plus (7/8)·78.10e9 / 450e9 = 0.152 s on NVLink;
    DDP sends 2·(15/16)·26.03e9 / 12.5e9 = 3.905 s over the NIC: hybrid is faster than DDP here."""
    j = job("fsdp-hybrid-shard", gpus=16)
    link = link_for(j, interconnect="ethernet")
    expected = 26.031728640e9 / 8 / 12.5e9 + 7 / 8 * 6 * M13.num_params / 450e9
    assert comm_seconds(j, link) == pytest.approx(expected)
    assert relative_to_ddp(j, partial(step_time, link=link)) > 1.5


@settings(max_examples=40, deadline=None)
@given(
    strategy=st.sampled_from(strategies_on(2)),
    gpus=st.sampled_from([2, 8, 16, 64]),
    bw=st.floats(0.5, 1000),
    factor=st.floats(1.0, 100.0),
)
def test_more_bandwidth_never_slows_a_step(strategy, gpus, bw, factor):
    j = job(strategy, gpus=gpus)
    slow, fast = step_time(j, link_for(j, bw_gbs=bw)), step_time(j, link_for(j, bw_gbs=bw * factor))
    assert fast.step_s <= slow.step_s * (1 + 1e-12)


def test_cli_defaults_give_the_same_link_as_the_api():
    _, jobs = build_jobs(params="13e9", gpus=8, gpu="a100-80gb")
    link = link_for(jobs[0])
    assert (link.intra_node_bytes_s, link.host_bytes_s, link.interconnect) == (300e9, 32e9, "nvlink")
