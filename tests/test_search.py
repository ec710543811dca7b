"""Searches are exact to the integer: the answer fits and the next step does not."""

import itertools
import re
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan import api
from memplan.breakdown import Component
from memplan.errors import MemplanError
from memplan.inputs import build_jobs
from memplan.search import gpu_counts, max_micro_batch, min_gpus, min_gpus_for, with_gpus, with_strategy
from memplan.strategies import strategies_on
from memplan.totals import bound
from memplan.totals import final as estimate


@pytest.mark.parametrize("params,gpu", [("7e9", "a100-80gb"), ("13e9", "h100-sxm"), ("1.3e9", "a100-40gb")])
def test_max_micro_batch_fits_and_one_more_does_not(params, gpu):
    _, jobs = build_jobs(params=params, gpus=8, gpu=gpu)
    for job in jobs:
        found = max_micro_batch(job)
        if found == 0:
            assert not estimate(job).fits
            continue
        assert estimate(job.with_(micro_batch=found)).fits
        assert not estimate(job.with_(micro_batch=found + 1)).fits


def test_max_micro_batch_agrees_with_an_exhaustive_scan():
    _, jobs = build_jobs(params="7e9", gpus=8, gpu="a100-80gb", ac="full")
    for job in jobs:
        fits = [estimate(job.with_(micro_batch=b)).fits for b in range(1, 129)]
        # memory is monotone in the micro-batch: fits is True...True False...False
        assert fits == sorted(fits, reverse=True)
        assert max_micro_batch(job, limit=128) == sum(fits)


@settings(max_examples=80, deadline=None)
@given(
    params=st.sampled_from(["125e6", "1.3e9", "7e9", "13e9"]),
    gpus=st.sampled_from([1, 2, 8, 64]),
    strategy=st.sampled_from(strategies_on(2)),
    precision=st.sampled_from(["fp32", "amp-bf16", "mixed-bf16", "bf16"]),
    ac=st.sampled_from(["none", "selective", "full"]),
    attention=st.sampled_from(["sdpa", "eager"]),
    seq_len=st.sampled_from([512, 2048, 8192]),
    gpu=st.sampled_from(["a100-40gb", "h100-sxm", "l4"]),
    limit=st.integers(1, 96),
    scale=st.sampled_from([0.8, 1.0, 1.3]),
)
def test_max_micro_batch_equals_a_linear_scan(
    params, gpus, strategy, precision, ac, attention, seq_len, gpu, limit, scale
):
    """The guess from the line through b = 1, 2 (and the bisection below it) against trying every
    micro-batch, for the analytic headroom and for one with activations scaled as a calibration may."""
    _, [job] = build_jobs(
        params=params,
        gpus=gpus,
        gpu=gpu,
        strategy=strategy,
        precision=precision,
        ac=ac,
        attention=attention,
        seq_len=seq_len,
    )

    def headrooms(j):
        est = estimate(j)
        return tuple(
            r - round((scale - 1) * m.by_component[Component.ACTIVATIONS])
            for r, m in zip(est.moment_headrooms, est.moments)
        )

    scan = next((b - 1 for b in range(1, limit + 1) if min(headrooms(job.with_(micro_batch=b))) < 0), limit)
    assert max_micro_batch(job, limit=limit, headrooms=headrooms) == scan


@pytest.mark.parametrize(
    "params,gpu,ac", [("70e9", "a100-80gb", "full"), ("13e9", "a100-40gb", "none"), ("175e9", "h100-sxm", "full")]
)
def test_min_gpus_fits_and_one_fewer_does_not(params, gpu, ac):
    _, jobs = build_jobs(params=params, gpus=1, gpu=gpu, ac=ac)
    result = min_gpus(jobs[0], [j.plan.strategy for j in jobs])
    assert result.estimate.fits and result.estimate.job.cluster.gpus == result.gpus
    count, _node = gpu_counts(0)
    index = next(i for i in range(10_000) if count(i) == result.gpus)
    if index:
        smaller = count(index - 1)
        for strategy in strategies_on(smaller):
            assert not estimate(with_gpus(with_strategy(jobs[0], strategy), smaller)).fits


@pytest.mark.parametrize("params,gpu,ac", [("70e9", "a100-80gb", "full"), ("13e9", "a100-40gb", "none")])
def test_memory_is_monotone_in_gpu_count(params, gpu, ac):
    """Over 2..8 GPUs then whole nodes up to 512 the bound (the tensors and the overheads outside
    the allocator) never grows, so its bisection in min_gpus_for loses no count; the replayed
    fragmentation is not monotone, so min_gpus_for tries the counts from there in order and
    equals the exhaustive answer. 1 → 2 GPUs can grow (NCCL buffers appear with a second rank:
    +0.5 GiB for DDP); the search tests 1 GPU on its own first."""
    _, jobs = build_jobs(params=params, gpus=1, gpu=gpu, ac=ac)
    count, _ = gpu_counts(0)
    counts = [count(i) for i in range(8 + 63)]
    for strategy in strategies_on(2):
        job = with_strategy(jobs[0], strategy)
        bounds = [bound(with_gpus(job, n)).total_bytes for n in counts]
        assert all(a >= b for a, b in itertools.pairwise(bounds[1:])), strategy
        totals = [estimate(with_gpus(job, n)).total_bytes for n in counts]
        exhaustive = next((n for n, t in zip(counts, totals) if t <= job.cluster.usable_bytes), None)
        found = min_gpus_for(job, limit=counts[-1])
        assert found == exhaustive, strategy


def test_min_gpus_by_hand_70b_full_ac():
    """70B (68,976,648,192 params) mixed-bf16: 16 B/param of states = 1,027.8 GiB; on 16 GPUs
    ZeRO-3 holds 64.2 GiB of states + activations and buffers: over 76 GiB usable; on 24 it fits."""
    _, result = api.min_gpus(params="70e9", gpu="a100-80gb", ac="full")
    assert (result.gpus, result.strategy) == (24, "fsdp-full-shard")
    assert result.by_strategy["ddp"] is None


def test_min_gpus_nothing_fits():
    _, jobs = build_jobs(params="70e9", gpus=1, gpu="a100-80gb", strategy="ddp")
    with pytest.raises(MemplanError, match="nothing fits even on 1000 GPUs"):
        min_gpus(jobs[0], ["ddp"], limit=1000)


def test_a_one_gpu_strategy_is_found_on_one_gpu_or_not_at_all():
    _, [small] = build_jobs(params="1e9", gpus=1, gpu="a100-80gb", strategy="single")
    assert min_gpus_for(small) == 1
    _, [big] = build_jobs(params="70e9", gpus=1, gpu="a100-80gb", strategy="single", ac="full")
    assert min_gpus_for(big) is None
    assert min_gpus(big, ["single", "fsdp-full-shard"]).strategy == "fsdp-full-shard"


@settings(max_examples=40, deadline=None)
@given(
    micro_batch=st.one_of(st.integers(min_value=-2, max_value=1_000_002), st.sampled_from([True, 2.0, "4"])),
    model=st.sampled_from(["gpt2", "llama-2-7b", "vit-large-patch16-224"]),
)
def test_a_micro_batch_copy_is_the_checked_copy(micro_batch, model):
    """``Job.with_(micro_batch=...)`` copies a checked job without re-running every check: the
    same job as one built through the constructors, and the same error for a bad micro-batch."""
    _, (job, *_) = build_jobs(model=model, gpus=8, **({} if model.startswith("vit") else {"seq_len": 128}))
    try:
        checked = replace(job, train=replace(job.train, micro_batch=micro_batch))
    except MemplanError as error:
        with pytest.raises(MemplanError, match=re.escape(str(error))):
            job.with_(micro_batch=micro_batch)
        return
    copied = job.with_(micro_batch=micro_batch)
    assert copied == checked and repr(copied) == repr(checked)
    assert copied.train.loop == checked.train.loop
    assert bound(copied).total_bytes == bound(checked).total_bytes
