"""The replay's caches (memplan.alloctrace's trace shapes, totals.fits's stage-by-stage check,
the sweep's per-group caches) give the answers of the uncached path."""

from dataclasses import replace

import pytest

from memplan import alloctrace, grid, totals
from memplan.allocator import replay
from memplan.inputs import build_jobs
from memplan.layout import Layout
from memplan.memory import Step
from memplan.parallel import pipeline
from memplan.parallel.step import RankStep


def _uncached_excess(step) -> int:
    result = replay(alloctrace.step_trace(step))
    return max(0, result.peak_reserved_bytes - result.peak_allocated_bytes)


@pytest.mark.parametrize(
    "inputs",
    [
        dict(ac="full", ac_every=2),
        dict(ac="selective", ac_every=3, finetune="frozen:2"),
        dict(ac="full", ac_every=2, finetune="lora"),
    ],
)
def test_a_shape_reads_each_block_as_its_own_index_does(inputs):
    """The shape reads one block of each kind; every block's own kept and transient sizes agree."""
    _, jobs = build_jobs(model="llama-2-7b", gpus=8, gpu="h100-sxm", **inputs)
    for job in jobs:
        step = Step(job)
        shape = alloctrace.trace_shape(step)
        L = job.model.num_layers
        assert shape.kept == tuple(tuple(s.bytes for s in step.kept(i)) for i in range(L))
        assert shape.transient == tuple(tuple(t.bytes for t in step.transient_terms(i)) for i in range(L))


def test_middle_pipeline_stages_share_one_replay_which_is_each_ones_own():
    _, jobs = build_jobs(model="llama-2-7b", gpus=64, gpu="h100-sxm", ac="full", strategy="fsdp-full-shard")
    job = replace(jobs[0], layout=Layout(tp=2, pp=8, pp_microbatches=32))
    stages = pipeline.stages(job.layout, job.model.num_layers)
    steps = [RankStep(job, s) for s in stages]
    shapes = {alloctrace.trace_shape(s) for s in steps}
    assert len(shapes) < len(stages)  # the middle stages differ only in the micro-batches in flight
    alloctrace._excess.cache_clear()
    assert [alloctrace.excess_bytes(s) for s in steps] == [_uncached_excess(s) for s in steps]
    assert alloctrace._excess.cache_info().misses == len(shapes)


def _clear() -> None:
    for cached in (totals.final, totals.bound, alloctrace.reserved, alloctrace._excess):
        cached.cache_clear()


def _pipelined(gpu_mem: float, pp: int, micro: int):
    _, jobs = build_jobs(model="llama-2-7b", gpus=64, gpu_mem=gpu_mem, strategy="fsdp-full-shard")
    job = jobs[0].with_(micro_batch=micro, activation_checkpointing="selective")
    return replace(job, layout=Layout(tp=2, pp=pp, pp_microbatches=4 * pp))


@pytest.mark.parametrize(("pp", "micro"), [(4, 1), (4, 4), (8, 2)])
def test_fits_stage_by_stage_is_the_replayed_totals_answer(pp, micro):
    """On memory that fits the replayed total, memory between the bound's and the replayed
    total's (the stage-by-stage check stops at a stage over it), and memory under the bound."""
    job = _pipelined(80, pp, micro)
    low, high = totals.bound(job).total_bytes, totals.final(job).total_bytes
    assert low < high
    fraction = job.cluster.usable_bytes / job.cluster.gpu_mem_bytes
    answers = []
    for total in (high + 2**20, (low + high) // 2, low - 2**30):
        squeezed = _pipelined(total / fraction / 2**30, pp, micro)
        _clear()
        answers.append((totals.bound(squeezed).fits, totals.fits(squeezed)))
        assert totals.fits(squeezed) == totals.final(squeezed).fits
    assert answers == [(True, True), (True, False), (False, False)]


def test_a_sweep_asked_again_replays_nothing_and_gives_the_same_rows():
    kwargs = dict(params=[1e9, 3e9], gpus=[1, 8], micro_batch=[1, 2], seq_len=[512, 1024], gpu="h100-sxm")
    first = grid.sweep(**kwargs)
    misses = alloctrace._excess.cache_info().misses, totals.final.cache_info().misses
    again = grid.sweep(**kwargs)
    assert (alloctrace._excess.cache_info().misses, totals.final.cache_info().misses) == misses
    assert first.equals(again)
