"""PyTorch's CUDA caching allocator, replayed in Python: what ``max_memory_reserved`` reports
for a sequence of allocations and frees.

Read from ``c10/cuda/CUDACachingAllocator.cpp`` (pytorch/pytorch main, commit 001074d,
``DeviceCachingAllocator``) and its options from ``c10/core/AllocatorConfig.cpp``; each rule
names the function it comes from. The replay keeps blocks, segments and streams as the
source does, with integer addresses standing in for device pointers. It models the
default pools (no CUDA-graph private pools), one device, and ``roundup_power2_divisions``
off (the default).

A trace is a list of events: ``Alloc`` (a request on a stream), ``Free`` (with the other
streams the block was used on, ``record_stream``), and ``Sync`` (a stream's work has
completed: the events recorded for cross-stream frees on it are done).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple, cast

from .errors import MemplanError

MIB = 2**20
# the constants at the head of CUDACachingAllocator.cpp
MIN_BLOCK_BYTES = 512  # kMinBlockSize: all sizes are rounded to at least 512 bytes
SMALL_SIZE_BYTES = MIB  # kSmallSize: the largest "small" allocation
SMALL_BUFFER_BYTES = 2 * MIB  # kSmallBuffer: small allocations are packed in 2 MiB segments
LARGE_BUFFER_BYTES = 20 * MIB  # kLargeBuffer: 1-10 MiB requests are packed in 20 MiB segments
MIN_LARGE_ALLOC_BYTES = 10 * MIB  # kMinLargeAlloc
ROUND_LARGE_BYTES = 2 * MIB  # kRoundLarge: larger requests get a segment rounded to 2 MiB
NO_LIMIT = 2**64 - 1  # max_split_size's default: std::numeric_limits<size_t>::max()
_ADDR_BITS = 64  # a free block's sort key within its stream: size << 64 | address
_NO_STREAMS: frozenset[int] = frozenset()
_FIXED_TOP = 1 << 62
"""cudaMalloc's segments are given out downwards from here, each below the last. The address
breaks get_free_block's ties between free blocks of one size (BlockComparatorSize: stream, size,
then address), and the driver mostly hands out a new segment below the last: 321 of the 376
segments of the Llama-3.1-405B FSDP 64 × TP 8 rank on an H200 (its ``segment_alloc`` records,
validation/records/gpu/h200-torch2.11.0-cu130/llama-3.1-405b_fsdp64_x_tp8_sp__8k_full-ac.raw.json.gz).
With ascending addresses the ties went the other way and that rank's own events replayed 14.6 %
under its measured reserved (the second step's 3.9 GiB request found the first step's 3.9 GiB
block whole, where on the GPU a 256 MiB block sat in it); descending, to the byte, and the
Qwen3-32B rank's (was −1.4 %), the 70B's (−0.3 %) and a DDP run's (−0.2 %) to the byte too
(tests/test_gpu_trace_check.py; the DDP run's, tests/test_gpu_records.py). Expandable segments
reserve their address space upwards from 0."""


class Alloc(NamedTuple):
    id: int
    size: int
    stream: int = 0


class Free(NamedTuple):
    id: int
    used_on: tuple[int, ...] = ()
    """Streams other than the allocation's the block was recorded on (``record_stream``):
    it returns to the pool only once each has reached a ``Sync`` after this free."""


class Sync(NamedTuple):
    stream: int


Event = Alloc | Free | Sync


@dataclass(frozen=True, kw_only=True)
class AllocConf:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` options the replay honours."""

    expandable_segments: bool = False
    max_split_size_bytes: int = NO_LIMIT
    garbage_collection_threshold: float = 0.0

    @property
    def text(self) -> str:
        parts = ["expandable_segments:True"] if self.expandable_segments else []
        if self.max_split_size_bytes != NO_LIMIT:
            parts.append(f"max_split_size_mb:{self.max_split_size_bytes // MIB}")
        if self.garbage_collection_threshold:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold:g}")
        return ",".join(parts) or "default"


DEFAULT_CONF = AllocConf()
_ACCEPTED = "expandable_segments:True|False, max_split_size_mb:N (N >= 20), garbage_collection_threshold:F (0 < F < 1)"


def parse_alloc_conf(text: str) -> AllocConf:
    """A ``PYTORCH_CUDA_ALLOC_CONF`` string, as ``AcceleratorAllocatorConfig::parseArgs``
    reads it: comma-separated ``key:value`` pairs."""
    options: dict = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = (s.strip() for s in item.partition(":"))
        try:
            if not sep:
                raise ValueError
            if key == "expandable_segments":
                if value not in ("True", "False"):
                    raise ValueError
                options["expandable_segments"] = value == "True"
            elif key == "max_split_size_mb":
                # parseMaxSplitSize: at least kLargeBuffer / 1 MiB (20)
                if int(value) < LARGE_BUFFER_BYTES // MIB:
                    raise ValueError
                options["max_split_size_bytes"] = int(value) * MIB
            elif key == "garbage_collection_threshold":
                # parseGarbageCollectionThreshold: strictly between 0 and 1
                if not 0.0 < float(value) < 1.0:
                    raise ValueError
                options["garbage_collection_threshold"] = float(value)
            else:
                raise ValueError
        except ValueError:
            raise MemplanError(f"--alloc-conf: {item!r} is not understood; accepted: {_ACCEPTED}") from None
    return AllocConf(**options)


def round_size(size: int) -> int:
    """``round_size``: up to a multiple of 512 bytes, at least 512."""
    return max(MIN_BLOCK_BYTES, -(-size // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES)


def is_small(size: int) -> bool:
    """``get_pool``: rounded requests up to 1 MiB go to the small pool."""
    return size <= SMALL_SIZE_BYTES


def allocation_size(size: int) -> int:
    """``get_allocation_size``: the segment cudaMalloc'd for a request no cached block serves."""
    if size <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return -(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


class _Block:
    __slots__ = (
        "addr",
        "allocated",
        "expandable",
        "gc_base",
        "mapped",
        "next",
        "pending",
        "prev",
        "request",
        "size",
        "small",
        "stream",
        "waiting",
    )

    def __init__(self, addr: int, size: int, stream: int, small: bool, *, expandable: bool = False):
        self.addr, self.size, self.stream, self.small = addr, size, stream, small
        self.request = 0  # the bytes asked for, while allocated
        self.allocated, self.expandable, self.mapped = False, expandable, True
        self.waiting = False
        self.prev: _Block | None = None
        self.next: _Block | None = None
        # streams whose events must complete (event_count): a set of its own once freed on others
        self.pending: set[int] | frozenset[int] = _NO_STREAMS
        self.gc_base = 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def free_to_use(self) -> bool:
        # a block whose events completed is cached only when process_events reaches it
        return not self.allocated and not self.pending and not self.waiting


def _room(block: _Block | None, size: int) -> int:
    """``has_available_address_space``: free or unmapped bytes from ``block`` on, up to ``size``."""
    room = 0
    while room < size and block is not None and block.free_to_use():
        room, block = room + block.size, block.next
    return room


class _Pool:
    """``BlockPool``: free mapped blocks sorted as ``BlockComparatorSize`` (by stream, then
    size, then address): one sorted list of ``size << 64 | address`` per stream (addresses
    are unique, so a key names one block); unmapped ones (expandable segments) by address."""

    def __init__(self, small: bool):
        self.small = small
        self.streams: dict[int, list[int]] = {}
        self.blocks: dict[int, _Block] = {}
        self.unmapped: dict[tuple[int, int], _Block] = {}
        self.calls = 0  # get_free_blocks_call_count

    def insert(self, block: _Block) -> None:
        """``insert_into_blocks``: also stamps the block's gc age base."""
        block.gc_base = self.calls
        key = block.size << _ADDR_BITS | block.addr
        keys = self.streams.get(block.stream)
        if keys is None:
            self.streams[block.stream] = [key]
        else:
            bisect.insort(keys, key)
        self.blocks[key] = block

    def erase(self, block: _Block) -> None:
        key = block.size << _ADDR_BITS | block.addr
        keys = self.streams[block.stream]
        del keys[bisect.bisect_left(keys, key)]
        del self.blocks[key]

    def in_order(self) -> list[_Block]:
        """Every free mapped block in ``BlockComparatorSize`` order."""
        blocks = self.blocks
        return [blocks[k] for stream in sorted(self.streams) for k in self.streams[stream]]


@dataclass(frozen=True, kw_only=True)
class Replay:
    """What the allocator's counters say after a trace (``torch.cuda.memory_stats``)."""

    peak_reserved_bytes: int
    """``reserved_bytes.all.peak``: ``max_memory_reserved``."""
    peak_allocated_bytes: int
    """``allocated_bytes.all.peak``: block sizes (requests rounded to 512 bytes)."""
    peak_active_bytes: int
    """``active_bytes.all.peak``: allocated plus blocks waiting on another stream."""
    peak_requested_bytes: int
    """``requested_bytes.all.peak``: the requests as made."""
    retries: int
    """``num_alloc_retries``: allocations that freed the cache and tried again."""
    out_of_memory: bool


class CachingAllocator:
    """One device's ``DeviceCachingAllocator``. ``limit_bytes``: what cudaMalloc can get
    (None: unbounded); ``fraction_set``: the limit comes from ``set_per_process_memory_fraction``
    (garbage collection only runs then)."""

    def __init__(self, conf: AllocConf = DEFAULT_CONF, *, limit_bytes: int | None = None, fraction_set: bool = False):
        self.conf, self.limit, self.fraction_set = conf, limit_bytes, fraction_set
        self.pools = {True: _Pool(True), False: _Pool(False)}
        self.live: dict[int, _Block] = {}
        self.waiting: list[_Block] = []  # freed, recorded on other streams (cuda_events)
        self.next_addr = _FIXED_TOP
        self.next_span = 0  # expandable segments' address space, upward from 0
        self.reserved = self.allocated = self.active = self.requested = 0
        self.peaks = [0, 0, 0, 0]
        self.retries = 0
        self.gc_on = fraction_set and conf.garbage_collection_threshold > 0

    # -- counters (increase_stat / decrease_stat) ----------------------------------------
    def _reserve(self, nbytes: int) -> None:
        """Segments mapped (positive) or given back (negative)."""
        self.reserved += nbytes
        if self.reserved > self.peaks[0]:
            self.peaks[0] = self.reserved

    def _new_address(self, size: int) -> int:
        """A new fixed segment's address: below the last one's (``_FIXED_TOP``)."""
        self.next_addr -= size
        return self.next_addr

    # -- malloc ------------------------------------------------------------------------
    def malloc(self, id_: int, request: int, stream: int = 0) -> bool:
        """``DeviceCachingAllocator::malloc``; False: out of memory."""
        if self.waiting:
            self._process_events()
        # round_size, inlined (the replay's hottest line): a multiple of 512 bytes, at least 512
        size = (request + MIN_BLOCK_BYTES - 1) // MIN_BLOCK_BYTES * MIN_BLOCK_BYTES or MIN_BLOCK_BYTES
        pool = self.pools[size <= SMALL_SIZE_BYTES]
        block = self._get_free_block(pool, size, stream)
        if block is None:
            if self.gc_on:
                self._garbage_collect()
            block = (
                self._alloc_block(pool, size, stream)
                or (self._release_available(pool, size, stream) and self._alloc_block(pool, size, stream))
                or self._retry(pool, size, stream)
            )
        if block is None:
            return False
        block = self._alloc_found_block(pool, block, size)
        block.request = request
        self.live[id_] = block
        self.allocated += block.size
        self.active += block.size
        self.requested += request
        peaks = self.peaks
        if self.allocated > peaks[1]:
            peaks[1] = self.allocated
        if self.active > peaks[2]:
            peaks[2] = self.active
        if self.requested > peaks[3]:
            peaks[3] = self.requested
        return True

    def _retry(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        """malloc's last resort: ``release_cached_blocks`` then ``alloc_block(isRetry=true)``."""
        self._release_cached_blocks()
        self.retries += 1
        return self._alloc_block(pool, size, stream)

    def _get_free_block(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        """``get_free_block``: the smallest free block of the stream that fits (best fit)."""
        if self.gc_on:
            pool.calls += 1
        keys = pool.streams.get(stream)
        if not keys:
            return None
        i = bisect.bisect_left(keys, size << _ADDR_BITS)
        if i == len(keys):
            return None
        block = pool.blocks[keys[i]]
        if block.expandable:
            # an expandable block counts as big as the unmapped room after it
            def room(b: _Block) -> int:
                return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

            for key in keys[i + 1 :]:
                nxt = pool.blocks[key]
                if not block.expandable or room(nxt) >= room(block):
                    break
                block = nxt
        split_limit = self.conf.max_split_size_bytes
        # do not return an oversized block for a large request
        if size < split_limit <= block.size:
            return None
        # an oversize request may take a cached block at most kLargeBuffer larger
        if size >= split_limit and block.size >= size + LARGE_BUFFER_BYTES:
            return None
        pool.erase(block)
        return block

    def _should_split(self, block: _Block, size: int) -> bool:
        """``should_split``: small-pool and expandable blocks keep any remainder of 512 bytes
        or more; large blocks only a remainder over 1 MiB, and only below max_split_size."""
        remaining = block.size - size
        if block.small or self.conf.expandable_segments:
            return remaining >= MIN_BLOCK_BYTES
        return size < self.conf.max_split_size_bytes and remaining > SMALL_SIZE_BYTES

    def _alloc_found_block(self, pool: _Pool, block: _Block, size: int) -> _Block:
        """``alloc_found_block``: the front of the block is handed out, the rest stays cached."""
        remaining = block.size - size
        if remaining >= MIN_BLOCK_BYTES and self._should_split(block, size):
            front = _Block(block.addr, size, block.stream, block.small, expandable=block.expandable)
            front.prev, front.next = block.prev, block
            if block.prev is not None:
                block.prev.next = front
            block.prev = front
            block.addr += size
            block.size -= size
            pool.insert(block)
            block = front
        block.allocated = True
        return block

    def _fits_limit(self, size: int) -> bool:
        return self.limit is None or self.reserved + size <= self.limit

    def _alloc_block(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        """``alloc_block``: a new segment of ``get_allocation_size`` (cudaMalloc), or mapped
        pages of the stream's expandable segment."""
        if self.conf.expandable_segments:
            return self._try_allocate_expandable(pool, size, stream)
        segment = allocation_size(size)
        if not self._fits_limit(segment):
            return None
        self._reserve(segment)
        return _Block(self._new_address(segment), segment, stream, pool.small)

    # -- expandable segments -------------------------------------------------------------
    def _page_bytes(self, pool: _Pool) -> int:
        """``find_expandable_block``: 2 MiB pages for the small pool, 20 MiB for the large."""
        return SMALL_BUFFER_BYTES if pool.small else LARGE_BUFFER_BYTES

    def _find_expandable(self, pool: _Pool, size: int, stream: int) -> _Block:
        """``find_expandable_block``: the lowest-address room of free and unmapped blocks in
        the stream's segment; a new segment (reserving address space only) if none."""
        for (s, _), c in sorted(pool.unmapped.items()):
            if s != stream:
                continue
            if c.prev is not None and c.prev.free_to_use():
                c = c.prev
            if _room(c, size) >= size:
                return c
        # address space of 1 1/8 of the GPU: in the replay, enough never to run out
        span = 2**50
        block = _Block(self.next_span, span, stream, pool.small, expandable=True)
        self.next_span += span
        block.mapped = False
        pool.unmapped[(stream, block.addr)] = block
        return block

    def _map(self, pool: _Pool, block: _Block, size: int) -> bool:
        """``map_block``: map whole pages from the front of an unmapped block."""
        page = self._page_bytes(pool)
        mapped = min(block.size, -(-size // page) * page)
        if not self._fits_limit(mapped):
            return False
        del pool.unmapped[(block.stream, block.addr)]
        block.mapped = True
        if mapped < block.size:
            rest = _Block(block.addr + mapped, block.size - mapped, block.stream, pool.small, expandable=True)
            rest.mapped = False
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = mapped
            pool.unmapped[(rest.stream, rest.addr)] = rest
        self._merge(block, block.prev, pool)
        self._merge(block, block.next, pool)
        pool.insert(block)
        self._reserve(mapped)
        return True

    def _try_allocate_expandable(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        """``try_allocate_expandable_block``."""
        candidate = self._find_expandable(pool, size, stream)
        if not candidate.mapped and not self._map(pool, candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            following = candidate.next
            assert following is not None
            if not self._map(pool, following, min(size - candidate.size, following.size)):
                return None
            candidate = following  # the merge folded the free front into it
        pool.erase(candidate)
        return candidate

    def _unmap(self, pool: _Pool, block: _Block) -> None:
        """``unmap_block``: return the whole pages inside a free expandable block."""
        page = self._page_bytes(pool)
        start, end = -(-block.addr // page) * page, (block.addr + block.size) // page * page
        if end <= start:
            return
        pool.erase(block)
        for lo, hi in ((block.addr, start), (end, block.addr + block.size)):
            if hi > lo:
                piece = _Block(lo, hi - lo, block.stream, pool.small, expandable=True)
                if lo < start:
                    piece.prev, piece.next = block.prev, block
                    if block.prev is not None:
                        block.prev.next = piece
                    block.prev = piece
                else:
                    piece.prev, piece.next = block, block.next
                    if block.next is not None:
                        block.next.prev = piece
                    block.next = piece
                pool.insert(piece)
        block.addr, block.size, block.mapped = start, end - start, False
        self._merge(block, block.prev, pool)
        self._merge(block, block.next, pool)
        pool.unmapped[(block.stream, block.addr)] = block
        self._reserve(-(end - start))

    # -- free --------------------------------------------------------------------------
    def free(self, id_: int, used_on: Iterable[int] = ()) -> None:
        """``free``: back to the pool, or, if recorded on other streams, once their events
        complete (``insert_events``); ``recordStream`` ignores the allocation's own stream."""
        block = self.live.pop(id_)
        block.allocated = False
        self.allocated -= block.size
        self.requested -= block.request
        if used_on:
            block.pending = {s for s in used_on if s != block.stream} or _NO_STREAMS
        if block.pending:
            block.waiting = True
            self.waiting.append(block)
        else:
            self._free_block(block)

    def sync(self, stream: int) -> None:
        """The stream's recorded events have completed (``cudaEventQuery`` succeeds)."""
        for block in self.waiting:
            cast(set, block.pending).discard(stream)  # a waiting block's own set

    def _process_events(self) -> None:
        """``process_events``: blocks whose events all completed return to the pool."""
        done = [b for b in self.waiting if not b.pending]
        if done:
            self.waiting = [b for b in self.waiting if b.pending]
            for block in done:
                block.waiting = False
                self._free_block(block)

    def _free_block(self, block: _Block) -> None:
        """``free_block``: merge with free neighbours of the segment, then cache."""
        pool = self.pools[block.small]
        self.active -= block.size
        self._merge(block, block.prev, pool)
        self._merge(block, block.next, pool)
        pool.insert(block)

    def _merge(self, dst: _Block, src: _Block | None, pool: _Pool) -> None:
        """``try_merge_blocks``: absorb a free neighbour in the same mapped state."""
        if src is None or src.allocated or src.pending or src.waiting or src.mapped != dst.mapped:
            return
        if src.mapped:
            pool.erase(src)
        else:
            del pool.unmapped[(src.stream, src.addr)]
        if dst.prev is src:
            dst.addr, dst.prev = src.addr, src.prev
            if src.prev is not None:
                src.prev.next = dst
        else:
            dst.next = src.next
            if src.next is not None:
                src.next.prev = dst
        dst.size += src.size

    # -- giving memory back --------------------------------------------------------------
    def _release(self, pool: _Pool, block: _Block) -> None:
        """``release_block``: cudaFree a whole cached segment."""
        pool.erase(block)
        self._reserve(-block.size)

    def _release_available(self, pool: _Pool, size: int, stream: int) -> bool:
        """``release_available_cached_blocks``: with max_split_size set, free cached oversize
        segments (the smallest that covers the request, else the largest ones) and retry."""
        limit = self.conf.max_split_size_bytes
        if limit == NO_LIMIT:
            return False
        want = max(size, limit)
        keys = pool.streams.get(stream, [])
        i = bisect.bisect_left(keys, want << _ADDR_BITS)
        if i < len(keys):
            self._release(pool, pool.blocks[keys[i]])
            return True
        released = 0
        for key in reversed(keys[:i]):
            if released >= want or key >> _ADDR_BITS < limit:
                break
            released += key >> _ADDR_BITS
            self._release(pool, pool.blocks[key])
        return released >= want

    def _release_cached_blocks(self) -> None:
        """``release_cached_blocks``: wait for all streams, then free every cached segment
        that is not split (expandable ones give back their free pages)."""
        for block in self.waiting:
            cast(set, block.pending).clear()
        self._process_events()
        for pool in self.pools.values():
            for block in pool.in_order():
                if block.expandable:
                    self._unmap(pool, block)
                elif not block.is_split():
                    self._release(pool, block)

    def _garbage_collect(self) -> None:
        """``garbage_collect_cached_blocks``: above threshold × the allowed memory, free the
        large pool's unsplit cached segments older than the average (in get_free_block calls)
        until enough is reclaimed."""
        assert self.limit is not None
        threshold = int(self.conf.garbage_collection_threshold * self.limit)
        if self.reserved <= threshold:
            return
        target, reclaimed = self.reserved - threshold, 0
        pool = self.pools[False]
        candidates = [b for b in pool.in_order() if not b.is_split() and not b.expandable]
        freed = True
        while reclaimed < target and freed and candidates:
            ages = [pool.calls - b.gc_base for b in candidates]
            average = sum(ages) / len(candidates)
            freed, kept = False, []
            for block, age in zip(candidates, ages):
                if age >= average:
                    freed, reclaimed = True, reclaimed + block.size
                    self._release(pool, block)
                else:
                    kept.append(block)
            candidates = kept

    def replay(self, events: Iterable[Event]) -> Replay:
        if self.conf.expandable_segments or self.gc_on:
            oom = self._replay_by_rule(events)
        else:
            oom = self._replay_fixed_segments(events)
        reserved, allocated, active, requested = self.peaks
        return Replay(
            peak_reserved_bytes=reserved,
            peak_allocated_bytes=allocated,
            peak_active_bytes=active,
            peak_requested_bytes=requested,
            retries=self.retries,
            out_of_memory=oom,
        )

    def _replay_by_rule(self, events: Iterable[Event]) -> bool:
        """Each event through ``malloc`` / ``free`` / ``sync``; True: out of memory."""
        malloc, free, sync = self.malloc, self.free, self.sync
        for event in events:
            kind = type(event)
            if kind is Alloc:
                if not malloc(*event):
                    return True
            elif kind is Free:
                free(*event)
            else:
                sync(*event)
        return False

    def _new_segment(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        """``malloc`` where no cached block serves and the limit may not allow a new segment,
        without expandable segments: ``alloc_block`` where the limit allows, else
        ``release_available_cached_blocks`` and the retry; None: out of memory."""
        return (
            self._alloc_block(pool, size, stream)
            or (self._release_available(pool, size, stream) and self._alloc_block(pool, size, stream))
            or self._retry(pool, size, stream)
        )

    def _replay_fixed_segments(self, events: Iterable[Event]) -> bool:
        """``_replay_by_rule`` without expandable segments or garbage collection, with the
        common paths of ``malloc`` (a cached block found, split; a new segment under no limit),
        ``free`` (merged with its free neighbours) and ``sync`` written out in the loop, the
        counters held in locals: the same rules, the same state after each event
        (tests/test_allocator.py compares the two on random traces), about twice as fast.
        Everything else (a new segment under a limit, events pending) goes through the methods,
        the counters handed over around each call."""
        split_limit, limit = self.conf.max_split_size_bytes, self.limit
        live, peaks, waiting = self.live, self.peaks, self.waiting
        small_pool, large_pool = self.pools[True], self.pools[False]
        small_streams, large_streams = small_pool.streams, large_pool.streams
        small_blocks, large_blocks = small_pool.blocks, large_pool.blocks
        bisect_left, insort = bisect.bisect_left, bisect.insort
        new_block = _Block
        reserved, allocated, active, requested = self.reserved, self.allocated, self.active, self.requested
        peak_reserved, peak_allocated, peak_active, peak_requested = peaks
        next_addr = self.next_addr
        oom = False
        for event in events:
            if type(event) is Alloc:
                id_, request, stream = event
                size = (request + MIN_BLOCK_BYTES - 1) // MIN_BLOCK_BYTES * MIN_BLOCK_BYTES or MIN_BLOCK_BYTES
                small = size <= SMALL_SIZE_BYTES
                if small:
                    streams, blocks = small_streams, small_blocks
                else:
                    streams, blocks = large_streams, large_blocks
                if waiting:
                    done = [b for b in waiting if not b.pending]
                    if done:  # process_events: their blocks return to the pool (free_block)
                        waiting[:] = [b for b in waiting if b.pending]
                        self.active = active
                        for b in done:
                            b.waiting = False
                            self._free_block(b)
                        active = self.active
                # get_free_block: the smallest of the stream's free blocks that fits
                block = None
                keys = streams.get(stream)
                if keys:
                    i = bisect_left(keys, size << _ADDR_BITS)
                    if i < len(keys):
                        key = keys[i]
                        found = key >> _ADDR_BITS
                        if not (size < split_limit <= found) and not (
                            size >= split_limit and found >= size + LARGE_BUFFER_BYTES
                        ):
                            del keys[i]
                            block = blocks.pop(key)
                if block is None:
                    if limit is None:
                        # alloc_block: a new segment of get_allocation_size (cudaMalloc)
                        if small:
                            segment = SMALL_BUFFER_BYTES
                        elif size < MIN_LARGE_ALLOC_BYTES:
                            segment = LARGE_BUFFER_BYTES
                        else:
                            segment = -(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES
                        reserved += segment
                        if reserved > peak_reserved:
                            peak_reserved = reserved
                        next_addr -= segment
                        block = new_block(next_addr, segment, stream, small)
                    else:
                        self.reserved, self.active, self.next_addr = reserved, active, next_addr
                        peaks[0] = peak_reserved
                        block = self._new_segment(small_pool if small else large_pool, size, stream)
                        reserved, active, next_addr = self.reserved, self.active, self.next_addr
                        peak_reserved, waiting = peaks[0], self.waiting
                        if block is None:
                            oom = True
                            break
                # alloc_found_block with should_split (no expandable segments here)
                remaining = block.size - size
                if remaining >= MIN_BLOCK_BYTES and (small or (size < split_limit and remaining > SMALL_SIZE_BYTES)):
                    front = new_block(block.addr, size, stream, small)
                    before = block.prev
                    front.prev, front.next = before, block
                    if before is not None:
                        before.next = front
                    block.prev = front
                    addr = block.addr = block.addr + size
                    block.size = remaining
                    # insert_into_blocks (gc ages stay 0: no garbage collection here)
                    key = remaining << _ADDR_BITS | addr
                    keys = streams.get(block.stream)
                    if keys is None:
                        streams[block.stream] = [key]
                    else:
                        insort(keys, key)
                    blocks[key] = block
                    block = front
                block.allocated = True
                block.request = request
                live[id_] = block
                nbytes = block.size
                allocated += nbytes
                active += nbytes
                requested += request
                if allocated > peak_allocated:
                    peak_allocated = allocated
                if active > peak_active:
                    peak_active = active
                if requested > peak_requested:
                    peak_requested = requested
            elif type(event) is Free:
                id_, used_on = event
                block = live.pop(id_)
                block.allocated = False
                nbytes = block.size
                allocated -= nbytes
                requested -= block.request
                if used_on:  # else its pending set is the empty one it was allocated with
                    block.pending = {s for s in used_on if s != block.stream} or _NO_STREAMS
                    if block.pending:
                        block.waiting = True
                        waiting.append(block)
                        continue
                # free_block: merge with the free neighbours (try_merge_blocks), then cache
                active -= nbytes
                if block.small:
                    streams, blocks = small_streams, small_blocks
                else:
                    streams, blocks = large_streams, large_blocks
                before = block.prev
                if before is not None and not (before.allocated or before.pending or before.waiting):
                    key = before.size << _ADDR_BITS | before.addr
                    keys = streams[before.stream]
                    del keys[bisect_left(keys, key)]
                    del blocks[key]
                    block.addr, block.prev = before.addr, before.prev
                    if before.prev is not None:
                        before.prev.next = block
                    block.size += before.size
                after = block.next
                if after is not None and not (after.allocated or after.pending or after.waiting):
                    key = after.size << _ADDR_BITS | after.addr
                    keys = streams[after.stream]
                    del keys[bisect_left(keys, key)]
                    del blocks[key]
                    block.next = after.next
                    if after.next is not None:
                        after.next.prev = block
                    block.size += after.size
                key = block.size << _ADDR_BITS | block.addr
                keys = streams.get(block.stream)
                if keys is None:
                    streams[block.stream] = [key]
                else:
                    insort(keys, key)
                blocks[key] = block
            else:
                # sync: the stream's recorded events have completed
                stream = event[0]
                for block in waiting:
                    block.pending.discard(stream)  # type: ignore[union-attr]  # a waiting block's own set
        self.reserved, self.allocated, self.active, self.requested = reserved, allocated, active, requested
        peaks[:] = peak_reserved, peak_allocated, peak_active, peak_requested
        self.next_addr = next_addr
        return oom


def replay(
    events: Iterable[Event],
    conf: AllocConf = DEFAULT_CONF,
    *,
    limit_bytes: int | None = None,
    fraction_set: bool = False,
) -> Replay:
    """The allocator's peaks after ``events``, from an empty cache."""
    return CachingAllocator(conf, limit_bytes=limit_bytes, fraction_set=fraction_set).replay(events)
