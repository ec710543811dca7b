"""memplan.allocator against the rules of PyTorch's CUDACachingAllocator.cpp (pytorch/pytorch
main, commit 001074d; the function each test derives from is named in it), and the traces
synthesized from the analytic model (memplan.alloctrace)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.allocator import (
    DEFAULT_CONF,
    LARGE_BUFFER_BYTES,
    MIB,
    Alloc,
    AllocConf,
    CachingAllocator,
    Free,
    Sync,
    allocation_size,
    parse_alloc_conf,
    replay,
    round_size,
)
from memplan.errors import MemplanError

KIB = 1024
SPLIT_40 = AllocConf(max_split_size_bytes=40 * MIB)


def allocs(*sizes, stream=0, start=0):
    return [Alloc(start + i, n, stream) for i, n in enumerate(sizes)]


def test_round_size_is_512_byte_multiples():
    # round_size: kMinBlockSize * ceil(size / kMinBlockSize), at least kMinBlockSize
    assert [round_size(n) for n in (1, 512, 513, 1000, 4096)] == [512, 512, 1024, 1024, 4096]


@pytest.mark.parametrize(
    "request_bytes,segment",
    [
        (1, 2 * MIB),  # <= kSmallSize: a kSmallBuffer
        (MIB, 2 * MIB),
        (MIB + 1, 20 * MIB),  # < kMinLargeAlloc: a kLargeBuffer
        (10 * MIB - 512, 20 * MIB),
        (10 * MIB, 10 * MIB),  # from kMinLargeAlloc: rounded to kRoundLarge
        (11 * MIB + 1, 12 * MIB),
    ],
)
def test_a_new_segment_has_get_allocation_size(request_bytes, segment):
    assert allocation_size(round_size(request_bytes)) == segment
    assert replay(allocs(request_bytes)).peak_reserved_bytes == segment


def test_small_requests_share_a_2_mib_segment():
    # should_split: a small-pool block keeps any remainder >= kMinBlockSize
    result = replay(allocs(*[512 * KIB] * 4))
    assert result.peak_reserved_bytes == 2 * MIB
    assert replay(allocs(*[512 * KIB] * 5)).peak_reserved_bytes == 4 * MIB


def test_mid_sized_requests_split_a_20_mib_segment():
    # get_allocation_size gives 20 MiB; should_split keeps remainders over kSmallSize
    assert replay(allocs(6 * MIB, 6 * MIB, 6 * MIB)).peak_reserved_bytes == 20 * MIB
    assert replay(allocs(6 * MIB, 6 * MIB, 6 * MIB, 6 * MIB)).peak_reserved_bytes == 40 * MIB


def test_a_large_remainder_of_1_mib_or_less_is_not_split():
    # should_split: remaining > kSmallSize for the large pool, else the whole block is handed out
    result = replay(allocs(19 * MIB + 512 * KIB))
    assert result.peak_allocated_bytes == 20 * MIB
    split = replay(allocs(18 * MIB))
    assert split.peak_allocated_bytes == 18 * MIB


def test_best_fit_takes_the_smallest_cached_block_that_fits():
    # get_free_block: lower_bound on (stream, size, address)
    events = allocs(30 * MIB, 12 * MIB) + [Free(0), Free(1)] + allocs(11 * MIB, 29 * MIB, start=2)
    assert replay(events).peak_reserved_bytes == 42 * MIB


def test_freed_neighbours_merge_back_into_one_block():
    # free_block -> try_merge_blocks with prev and next
    events = allocs(6 * MIB, 6 * MIB, 6 * MIB) + [Free(0), Free(2), Free(1)] + allocs(20 * MIB, start=3)
    assert replay(events).peak_reserved_bytes == 20 * MIB


def test_neighbours_released_by_one_sync_merge_once_each_is_cached():
    # process_events frees completed blocks one by one; a neighbour still in the event queue
    # is not yet in the pool, so it merges when its own turn comes (split blocks of one segment)
    events = allocs(6 * MIB, 6 * MIB, 6 * MIB)
    events += [Free(0, used_on=(1,)), Free(1, used_on=(1,)), Free(2, used_on=(1,)), Sync(1)]
    result = replay(events + allocs(18 * MIB, start=3))
    assert result.peak_reserved_bytes == 20 * MIB  # the three merged back into their 20 MiB segment


def test_cached_blocks_serve_only_their_own_stream():
    # get_free_block: the found block's stream must be the request's (pools are per stream)
    events = allocs(12 * MIB) + [Free(0)] + allocs(12 * MIB, stream=1, start=1)
    assert replay(events).peak_reserved_bytes == 24 * MIB


def test_a_block_recorded_on_another_stream_waits_for_it():
    # free: stream_uses -> insert_events; process_events frees it once the event completed
    waiting = allocs(12 * MIB) + [Free(0, used_on=(1,))] + allocs(12 * MIB, start=1)
    assert replay(waiting).peak_reserved_bytes == 24 * MIB
    assert replay(waiting).peak_active_bytes == 24 * MIB
    synced = allocs(12 * MIB) + [Free(0, used_on=(1,)), Sync(1)] + allocs(12 * MIB, start=1)
    assert replay(synced).peak_reserved_bytes == 12 * MIB
    # recordStream ignores uses on the allocation stream itself
    own = allocs(12 * MIB) + [Free(0, used_on=(0,))] + allocs(12 * MIB, start=1)
    assert replay(own).peak_reserved_bytes == 12 * MIB


def test_max_split_size_keeps_oversize_blocks_for_oversize_requests():
    # get_free_block: a request under max_split_size never takes a block at or over it
    events = allocs(100 * MIB) + [Free(0)] + allocs(30 * MIB, start=1)
    assert replay(events).peak_reserved_bytes == 100 * MIB  # default: split
    assert replay(events, SPLIT_40).peak_reserved_bytes == 130 * MIB


def test_an_oversize_request_takes_a_cached_block_at_most_20_mib_larger_unsplit():
    # get_free_block: size >= max_split_size and block >= size + kLargeBuffer -> no
    within = allocs(100 * MIB + LARGE_BUFFER_BYTES - 2 * MIB) + [Free(0)] + allocs(100 * MIB, start=1)
    result = replay(within, SPLIT_40)
    assert result.peak_reserved_bytes == 118 * MIB
    # should_split: no split at or over max_split_size, the whole block is allocated
    assert result.peak_allocated_bytes == 118 * MIB
    beyond = allocs(100 * MIB + LARGE_BUFFER_BYTES) + [Free(0)] + allocs(100 * MIB, start=1)
    assert replay(beyond, SPLIT_40).peak_reserved_bytes == 220 * MIB


def test_out_of_memory_frees_the_cache_and_retries():
    # malloc: alloc_block fails -> release_cached_blocks -> alloc_block(isRetry)
    events = allocs(60 * MIB) + [Free(0)] + allocs(70 * MIB, start=1)
    result = replay(events, limit_bytes=100 * MIB)
    assert (result.peak_reserved_bytes, result.retries, result.out_of_memory) == (70 * MIB, 1, False)
    # release_blocks frees only segments that are not split: a live neighbour pins its segment
    pinned = allocs(6 * MIB, 6 * MIB) + [Free(0)] + allocs(90 * MIB, start=2)
    assert replay(pinned, limit_bytes=100 * MIB).out_of_memory


def test_release_available_cached_blocks_frees_an_oversize_block_first():
    # with max_split_size set, the smallest oversize cached block that covers the request is
    # freed before the full release (the 80 MiB block is 20 MiB too large to serve 50 MiB)
    events = allocs(80 * MIB) + [Free(0)] + allocs(50 * MIB, start=1)
    result = replay(events, SPLIT_40, limit_bytes=100 * MIB)
    assert (result.peak_reserved_bytes, result.retries, result.out_of_memory) == (80 * MIB, 0, False)
    # blocks that together fall short of the request: false, and the full release retries
    short = allocs(60 * MIB) + [Free(0)] + allocs(70 * MIB, start=1)
    assert replay(short, SPLIT_40, limit_bytes=100 * MIB).retries == 1


def test_garbage_collection_frees_old_blocks_only_under_a_memory_fraction():
    # malloc: garbage_collect_cached_blocks runs when set_fraction and the threshold is set
    gc = AllocConf(garbage_collection_threshold=0.1)
    events = allocs(20 * MIB) + [Free(0)] + allocs(30 * MIB, start=1)
    assert replay(events, gc, limit_bytes=1000 * MIB).peak_reserved_bytes == 50 * MIB
    # above 0.1 x 100 MiB reserved, the cached 20 MiB segment (age >= average) is freed first
    assert replay(events, gc, limit_bytes=100 * MIB, fraction_set=True).peak_reserved_bytes == 30 * MIB


def test_expandable_segments_map_20_mib_pages_in_one_segment():
    # alloc_block -> try_allocate_expandable_block; find_expandable_block: kLargeBuffer pages
    expandable = AllocConf(expandable_segments=True)
    events = allocs(6 * MIB, 30 * MIB)
    assert replay(events).peak_reserved_bytes == 50 * MIB
    assert replay(events, expandable).peak_reserved_bytes == 40 * MIB
    # should_split: expandable blocks keep any remainder >= kMinBlockSize
    assert replay(allocs(19 * MIB + 512 * KIB), expandable).peak_allocated_bytes == 19 * MIB + 512 * KIB
    # the small pool maps kSmallBuffer pages
    assert replay(allocs(512 * KIB, 512 * KIB, 512 * KIB, 600 * KIB), expandable).peak_reserved_bytes == 4 * MIB


def test_expandable_segments_reuse_freed_space_of_any_size():
    # the fragmentation expandable segments remove: slivers between sizes that do not tile
    events = allocs(*[24 * MIB] * 4) + [Free(i) for i in range(4)] + allocs(*[32 * MIB] * 3, start=4)
    # four separate 24 MiB segments never merge: each 32 MiB request needs a segment of its own
    assert replay(events).peak_reserved_bytes == 96 * MIB + 96 * MIB
    assert replay(events, AllocConf(expandable_segments=True)).peak_reserved_bytes == 100 * MIB


def test_expandable_segments_unmap_free_pages_on_out_of_memory():
    # release_cached_blocks -> release_blocks -> unmap_block
    expandable = AllocConf(expandable_segments=True)
    events = allocs(40 * MIB, 6 * MIB, stream=0) + [Free(0)] + allocs(80 * MIB, stream=1, start=2)
    result = replay(events, expandable, limit_bytes=110 * MIB)
    assert not result.out_of_memory and result.retries == 1


@pytest.mark.parametrize(
    "text,conf",
    [
        ("", DEFAULT_CONF),
        ("expandable_segments:True", AllocConf(expandable_segments=True)),
        (
            "max_split_size_mb:128, garbage_collection_threshold:0.6",
            AllocConf(max_split_size_bytes=128 * MIB, garbage_collection_threshold=0.6),
        ),
    ],
)
def test_alloc_conf_strings(text, conf):
    assert parse_alloc_conf(text) == conf
    assert parse_alloc_conf(conf.text if conf != DEFAULT_CONF else "") == conf


@pytest.mark.parametrize(
    "text", ["max_split_size_mb:19", "garbage_collection_threshold:1.0", "expandable_segments:yes", "pinned:1", "x"]
)
def test_bad_alloc_conf_is_refused_by_name(text):
    # parseMaxSplitSize: >= kLargeBuffer / 1 MiB; parseGarbageCollectionThreshold: 0 < t < 1
    with pytest.raises(MemplanError, match="alloc-conf"):
        parse_alloc_conf(text)


# -- traces synthesized from the analytic model (memplan.alloctrace) ------------------------

from memplan.alloctrace import step_trace  # noqa: E402
from memplan.api import estimate  # noqa: E402
from memplan.memory import Step  # noqa: E402
from memplan.overheads import ALLOCATOR_KEYS, reserved_bytes  # noqa: E402


def _estimate(**flags):
    [est] = estimate(**flags, calibration=None).estimates
    return est


@pytest.mark.parametrize(
    "flags",
    [
        dict(params=1e9, gpus=1, strategy="single"),
        dict(params=1e9, gpus=1, strategy="single", ac="full"),
        dict(model="gpt2", micro_batch=8, gpus=1, strategy="single"),
        dict(params=1e9, gpus=1, strategy="single", precision="fp32", optimizer_impl="single"),
        dict(params=1e9, gpus=2, strategy="ddp"),
    ],
)
def test_the_trace_holds_the_models_tensors_at_its_peak(flags):
    # the trace allocates what the moments hold, in step order: its requested peak is the analytic peak
    est = _estimate(**flags)
    assert replay(step_trace(Step(est.job))).peak_requested_bytes == est.allocated_bytes


def test_the_trace_frees_all_but_the_states_each_step():
    step = Step(_estimate(params=1e9, gpus=2, strategy="fsdp-full-shard").job)
    allocator = CachingAllocator()
    allocator.replay(step_trace(step))
    # what is left live after two steps is the states, allocated once and never freed
    assert allocator.requested == sum(t.bytes for t in step.groups()["states"])
    assert not allocator.waiting  # every cross-stream free reached its stream's Sync


def test_reserved_sits_between_allocated_and_total():
    # docs/design.md output contract: allocated <= reserved <= total = reserved + context + communicators
    est = _estimate(params=13e9, gpus=8, strategy="fsdp-full-shard")
    fixed = sum(t.bytes for t in est.overhead if t.key not in ALLOCATOR_KEYS)
    assert est.allocated_bytes <= reserved_bytes(est) <= est.total_bytes
    assert est.total_bytes == reserved_bytes(est) + fixed


def test_alloc_conf_changes_the_answer():
    default = _estimate(params=13e9, gpus=8, strategy="fsdp-full-shard")
    expandable = _estimate(params=13e9, gpus=8, strategy="fsdp-full-shard", alloc_conf="expandable_segments:True")
    assert default.allocated_bytes == expandable.allocated_bytes
    assert reserved_bytes(expandable) < reserved_bytes(default)
    assert default.total_bytes - expandable.total_bytes == reserved_bytes(default) - reserved_bytes(expandable)


def test_cpu_jobs_reserve_what_they_allocate():
    est = _estimate(params=1e8, gpus=1, strategy="single", device="cpu")
    assert reserved_bytes(est) == est.allocated_bytes == est.total_bytes


# -- traces recorded from a real step (calibrate.alloctrace) --------------------------------


def test_a_recorded_cpu_step_replays_through_the_allocator(tmp_path):
    pytest.importorskip("torch")
    from calibrate.alloctrace import load, record, save
    from memplan.memory import estimate as estimate_job
    from memplan.specs import ClusterSpec, Job, ModelSpec, Plan, TrainSpec

    job = Job(
        model=ModelSpec(arch="llama", num_layers=2, hidden=64, num_heads=4, ffn_hidden=128, vocab_size=256),
        train=TrainSpec(seq_len=32, micro_batch=2, device="cpu", precision="fp32"),
        cluster=ClusterSpec(),
        plan=Plan(strategy="single"),
    )
    events = record(job)
    save(events, tmp_path / "trace.jsonl.gz")
    assert load(tmp_path / "trace.jsonl.gz") == events
    result = replay(events)
    # the recorded live bytes peak where the analytic model says (its own CPU measurements agree)
    assert result.peak_requested_bytes == pytest.approx(estimate_job(job).allocated_bytes, rel=0.01)
    # every tensor of this model is under kSmallSize: the small pool alone, in kSmallBuffer segments
    assert all(e.size <= MIB for e in events if isinstance(e, Alloc))
    assert result.peak_reserved_bytes % (2 * MIB) == 0
    assert result.peak_requested_bytes <= result.peak_allocated_bytes <= result.peak_reserved_bytes


# -- communicator and context tables ----------------------------------------------------------


def test_nccl_buffer_sizes_are_the_products_of_init_cc():
    from memplan import catalog

    table = {row["key"]: int(row["value"]) for row in catalog.read_table("nccl.csv")}
    assert table["simple_buffsize_bytes"] == 1 << 22  # DEFAULT_BUFFSIZE
    assert table["ll_buffsize_bytes"] == 8 * 512 * 8 * 16  # LINES_PER_THREAD x MAX_NTHREADS x STEPS x 16 B
    assert table["ll128_buffsize_bytes"] == 120 * 640 * 8 * 8  # ELEMS_PER_THREAD x MAX_NTHREADS x STEPS x 8 B
    assert all(len(row["source"]) > 40 for row in catalog.read_table("nccl.csv"))


def test_the_context_follows_the_gpu_generation_with_a_published_figure(monkeypatch):
    from memplan import catalog, overheads

    read = catalog.read_table
    rows = [dict(row, context_mib="1000") for row in read("cuda_context.csv")]
    monkeypatch.setattr(catalog, "read_table", lambda name: rows if name == "cuda_context.csv" else read(name))
    job = _estimate(params=1e9, gpus=1, strategy="single").job
    overheads._contexts.cache_clear()  # the table is read once per process
    try:
        [v100] = overheads.fixed_terms(job.with_(gpu_name=rows[0]["gpu_prefix"] + "-16gb"))
        [other] = overheads.fixed_terms(job.with_(gpu_name="h100-sxm"))
    finally:
        overheads._contexts.cache_clear()
    assert v100.bytes == 1000 * MIB
    assert other.bytes == int(catalog.overheads()["cuda_context_mib"]) * MIB


# -- the replay's written-out loop against the rules, event by event ---------------------------


def _state(allocator: CachingAllocator) -> tuple:
    """Everything the allocator holds: counters, peaks, the free lists per pool and stream
    with their blocks' segment neighbours, and the live blocks."""

    def where(block):
        return None if block is None else (block.addr, block.size, block.allocated)

    pools = tuple(
        (small, tuple((s, tuple(keys)) for s, keys in sorted(pool.streams.items())))
        + tuple((where(b.prev), where(b.next), b.stream) for b in pool.in_order())
        for small, pool in sorted(allocator.pools.items())
    )
    live = tuple(sorted((i, b.addr, b.size, b.stream, where(b.prev), where(b.next)) for i, b in allocator.live.items()))
    waiting = tuple((b.addr, b.size, tuple(sorted(b.pending))) for b in allocator.waiting)
    counters = (allocator.reserved, allocator.allocated, allocator.active, allocator.requested, allocator.retries)
    return pools, live, waiting, counters, tuple(allocator.peaks), allocator.next_addr


@st.composite
def _traces(draw):
    """Allocations of every size class on three streams, frees recorded on other streams,
    syncs; a device limit sometimes, so that the release-and-retry paths run."""
    events, live, next_id = [], [], 0
    for _ in range(draw(st.integers(1, 80))):
        action = draw(st.sampled_from(["alloc", "alloc", "free", "free", "sync"]))
        if action == "alloc" or not live:
            size = draw(
                st.one_of(
                    st.integers(0, 4 * KIB),
                    st.integers(1, MIB),
                    st.integers(MIB, 12 * MIB),
                    st.integers(10 * MIB, 90 * MIB),
                    # the rules' edges: a block's remainder of exactly 512 B or 1 MiB, the pools' bounds
                    st.sampled_from(
                        [MIB - 512, MIB, MIB + 512, 10 * MIB - 512, 10 * MIB, 20 * MIB, 40 * MIB, 64 * MIB, 84 * MIB]
                    ),
                )
            )
            events.append(Alloc(next_id, size, draw(st.sampled_from([0, 0, 1, 2]))))
            live.append(next_id)
            next_id += 1
        elif action == "free":
            i = live.pop(draw(st.integers(0, len(live) - 1)))
            events.append(Free(i, tuple(draw(st.lists(st.sampled_from([0, 1, 2]), max_size=2, unique=True)))))
        else:
            events.append(Sync(draw(st.sampled_from([0, 1, 2]))))
    return events


def _same_event_by_event(events, conf, limit=None):
    fast, ruled = CachingAllocator(conf, limit_bytes=limit), CachingAllocator(conf, limit_bytes=limit)
    for n, event in enumerate(events):
        oom = fast._replay_fixed_segments([event])
        assert oom == ruled._replay_by_rule([event]), f"event {n}: {event}"
        if oom:
            return
        assert _state(fast) == _state(ruled), f"after event {n}: {event}"


_LIMIT_64 = AllocConf(max_split_size_bytes=64 * MIB)


@pytest.mark.parametrize(
    "events,conf",
    [
        # a 12 MiB segment serving 11 MiB: a remainder of exactly 1 MiB is not split off (> kSmallSize)
        ([Alloc(0, 12 * MIB), Free(0), Alloc(1, 11 * MIB), Alloc(2, MIB)], DEFAULT_CONF),
        # a small segment keeps a remainder of exactly 512 bytes
        ([Alloc(0, MIB), Alloc(1, MIB - 512), Alloc(2, 512)], DEFAULT_CONF),
        # max_split_size: a cached block of exactly the limit is oversize for a smaller request
        ([Alloc(0, 64 * MIB), Free(0), Alloc(1, 30 * MIB)], _LIMIT_64),
        # an oversize request takes a cached block only if less than kLargeBuffer larger
        ([Alloc(0, 84 * MIB), Free(0), Alloc(1, 64 * MIB)], _LIMIT_64),
        ([Alloc(0, 82 * MIB), Free(0), Alloc(1, 64 * MIB)], _LIMIT_64),
        # freed on another stream: cached only after that stream's Sync, then merged both ways
        (
            [*allocs(MIB, MIB, MIB), Free(1, (1,)), Free(0), Free(2), Alloc(3, 2 * MIB), Sync(1), Alloc(4, 512)],
            DEFAULT_CONF,
        ),
    ],
)
def test_the_written_out_loop_at_the_rules_edges(events, conf):
    _same_event_by_event(events, conf)


@settings(max_examples=120, deadline=None)
@given(
    _traces(),
    st.sampled_from([DEFAULT_CONF, AllocConf(max_split_size_bytes=20 * MIB), AllocConf(max_split_size_bytes=64 * MIB)]),
    st.one_of(st.none(), st.integers(40, 600).map(lambda n: n * MIB)),
)
def test_the_written_out_replay_loop_is_the_rules_event_by_event(events, conf, limit):
    # CachingAllocator.replay runs _replay_fixed_segments where neither expandable segments nor
    # garbage collection are on; after every prefix of the trace its state is the rules' state
    _same_event_by_event(events, conf, limit)


def test_the_loss_backward_makes_its_gradients_one_tensor_at_a_time():
    """torch's cross-entropy backward on fp32 logits, recorded: each b·s·V gradient is its own
    allocation of the log_softmax output's size, as the synthesized trace emits the
    ``loss.gradients`` term (one tensor of their sum could not reuse the loss forward's blocks)."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    from calibrate.alloctrace import Recorder
    from memplan.alloctrace import _loss_backward
    from memplan.breakdown import Component, Term

    b, s, V = 2, 16, 1000
    logits = torch.randn(b, s, V, dtype=torch.bfloat16, requires_grad=True)
    loss = F.cross_entropy(logits.float().view(-1, V), torch.randint(0, V, (b * s,)))
    recorder = Recorder()
    with recorder:
        loss.backward()
    fp32 = 4 * b * s * V
    recorded = [e.size for e in recorder.events if isinstance(e, Alloc) and e.size >= fp32]
    assert len(recorded) >= 2 and set(recorded) == {fp32}  # several, each one b·s·V in fp32, none larger
    terms = [
        Term(Component.ACTIVATIONS, "log_softmax output (fp32)", "4·b·s·V", fp32, "loss.log_softmax"),
        Term(Component.ACTIVATIONS, "loss gradients (nll, log_softmax)", "2·4·b·s·V", 2 * fp32, "loss.gradients"),
    ]
    assert _loss_backward(terms) == [fp32] * 3
