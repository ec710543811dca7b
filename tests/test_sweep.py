"""The vectorized sweep equals the scalar estimate, row for row, to the byte."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memplan.errors import MemplanError
from memplan.grid import sweep
from memplan.inputs import build_jobs
from memplan.overheads import reserved_bytes
from memplan.totals import final as estimate

PRECISIONS = ["fp32", "amp-bf16", "mixed-bf16", "bf16"]


@pytest.mark.parametrize(
    "attention,device,optimizer_impl",
    [("sdpa", "cuda", "foreach"), ("eager", "cpu", "single"), ("sdpa", "cuda", "fused")],
)
def test_random_rows_equal_the_scalar_path(attention, device, optimizer_impl):
    # on a GPU every row replays the allocator (one replay a row): a smaller grid there
    cuda = device == "cuda"
    grid = sweep(
        params=[1.3e9, 7e9],
        gpus=[2, 8, 24],
        precision=PRECISIONS[::2] if cuda else PRECISIONS,
        ac=["none", "full"] if cuda else ["none", "selective", "full"],
        micro_batch=[1, 3] if cuda else [1, 3, 8],
        seq_len=[128, 1000] if cuda else [128, 1000, 4096],
        gpu="a100-80gb",
        attention=attention,
        device=device,
        optimizer_impl=optimizer_impl,
    )
    assert set(grid.strategy) == {
        "ddp",
        "fsdp-no-shard",
        "fsdp-shard-grad-op",
        "fsdp-full-shard",
        "fsdp-hybrid-shard",
        "zero1",
        "zero2",
        "zero3",
    }
    rows = grid.sample(n=120, random_state=0)
    for row in rows.itertuples():
        _, jobs = build_jobs(
            params=row.params,
            gpus=row.gpus,
            precision=row.precision,
            ac=row.activation_checkpointing,
            micro_batch=row.micro_batch,
            seq_len=row.seq_len,
            strategy=row.strategy,
            gpu="a100-80gb",
            attention=attention,
            device=device,
            optimizer_impl=optimizer_impl,
        )
        est = estimate(jobs[0])
        assert (row.allocated_bytes, row.reserved_bytes, row.total_bytes, row.phase, row.fits) == (
            est.allocated_bytes,
            reserved_bytes(est),
            est.total_bytes,
            est.phase,
            est.fits,
        )


def _subset(values, max_size=2):
    return st.lists(st.sampled_from(values), min_size=1, max_size=max_size, unique=True)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    params=_subset([1.3e9, 7e9, 30e9]),
    gpus=_subset([1, 2, 3, 8, 24, 64], 3),
    precision=st.sampled_from(PRECISIONS),
    ac=st.sampled_from(["none", "selective", "full"]),
    micro_batch=_subset([1, 2, 5, 16]),
    seq_len=_subset([128, 1000, 4096]),
    attention=st.sampled_from(["sdpa", "eager"]),
    optimizer_impl=st.sampled_from(["foreach", "single", "fused"]),
    offload=st.sampled_from(["none", "optimizer"]),
)
def test_every_cell_of_a_random_grid_equals_the_scalar_path(
    params, gpus, precision, ac, micro_batch, seq_len, attention, optimizer_impl, offload
):
    """Every cell, across GPU counts too: the sweep takes the token coefficients of a family from
    its first GPU count, so a grid of several counts is where it could go wrong."""
    held = dict(
        precision=precision, ac=ac, gpu="a100-80gb", attention=attention, optimizer_impl=optimizer_impl, offload=offload
    )
    try:
        grid = sweep(params=params, gpus=gpus, micro_batch=micro_batch, seq_len=seq_len, **held)
    except MemplanError as e:
        assert "no strategy" in str(e)  # an offload that no strategy on these GPU counts runs
        return
    for row in grid.itertuples():
        _, jobs = build_jobs(
            params=row.params,
            gpus=row.gpus,
            micro_batch=row.micro_batch,
            seq_len=row.seq_len,
            strategy=row.strategy,
            **held,
        )
        est = estimate(jobs[0])
        assert (row.allocated_bytes, row.overhead_bytes, row.total_bytes, row.headroom_bytes, row.phase, row.fits) == (
            est.allocated_bytes,
            est.overhead_bytes,
            est.total_bytes,
            est.headroom_bytes,
            est.phase,
            est.fits,
        )


def test_grid_shape_and_fixed_arguments():
    grid = sweep(params=[7e9, 70e9], gpus=[8, 64], micro_batch=[1, 4], seq_len=[2048], gpu_mem=80)
    assert len(grid) == 2 * 2 * 8 * 2
    assert grid.allocated_bytes.dtype == np.int64
    assert (grid.total_bytes == grid.allocated_bytes + grid.overhead_bytes).all()
    only = sweep(model=["llama-2-7b"], gpus=8, strategy=["ddp", "zero3"], micro_batch=range(1, 5))
    assert list(only.strategy.unique()) == ["ddp", "zero3"] and len(only) == 8


def test_bad_grids_are_one_line_errors():
    with pytest.raises(MemplanError, match=r"params=.*or model="):
        sweep(gpus=[8])
    with pytest.raises(MemplanError, match="positive"):
        sweep(params=7e9, micro_batch=[0, 1])
    with pytest.raises(MemplanError, match=r"processes must be a positive integer .* got 0"):
        sweep(params=7e9, processes=0)


def test_replays_spread_over_workers_give_the_rows_one_process_gives(monkeypatch):
    """The replays a sweep spreads over forked workers come back to the same rows, byte for byte
    (``PARALLEL_FROM`` lowered: this small grid replays in workers too)."""
    import multiprocessing

    from memplan import grid

    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork on this platform: a sweep replays in its own process")
    kwargs = dict(params=[1.3e9, 3e9], gpus=[2, 8], micro_batch=[1, 2], seq_len=[256, 512], gpu="a100-80gb")
    grid._REPLAYED.clear()
    monkeypatch.setattr(grid, "PARALLEL_FROM", 1)
    spread = sweep(**kwargs, processes=2)
    assert len(grid._REPLAYED) == len(spread) // 4  # every group's four points, from the workers
    grid._REPLAYED.clear()
    alone = sweep(**kwargs, processes=1)
    assert spread.equals(alone)


def test_a_one_gpu_strategy_appears_only_on_one_gpu():
    frame = sweep(params=[7e9], gpus=[1, 8], strategy=["single", "ddp"], gpu_mem=80)
    assert sorted(zip(frame.gpus, frame.strategy)) == [(1, "ddp"), (1, "single"), (8, "ddp")]
    with pytest.raises(MemplanError, match=r"no strategy in \['single'\] runs on gpus=\[8\]"):
        sweep(params=[7e9], gpus=[8], strategy=["single"], gpu_mem=80)


def test_a_family_whose_token_terms_move_with_the_gpu_count_is_solved_group_by_group(monkeypatch):
    """Were activations to depend on the GPU count (tensor parallelism would), the check at a
    family's last group fails and every group is solved on its own: here 64 GPUs add 64·b·s
    bytes to every moment, which the shared coefficients of 8 GPUs cannot carry."""
    import memplan.grid as grid

    plain = sweep(params=[7e9], gpus=[8, 64], strategy=["zero3"], micro_batch=[1, 4], seq_len=[512, 2048])
    moment_bytes = grid._moment_bytes

    def shifted(job, b, s):
        extra = job.cluster.gpus * b * s if job.cluster.gpus == 64 else 0
        return [v + extra for v in moment_bytes(job, b, s)]

    monkeypatch.setattr(grid, "_moment_bytes", shifted)
    moved = sweep(params=[7e9], gpus=[8, 64], strategy=["zero3"], micro_batch=[1, 4], seq_len=[512, 2048])
    extra = np.where(plain.gpus == 64, plain.gpus * plain.micro_batch * plain.seq_len, 0)
    assert (moved.allocated_bytes == plain.allocated_bytes + extra).all()
