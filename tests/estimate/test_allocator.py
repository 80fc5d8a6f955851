"""Tests of the CUDA caching-allocator simulator against hand-computed truths.

Every expected number below follows from the rules of c10/cuda/CUDACachingAllocator.cpp; the cases of
the first sections were also replayed on an H200 with torch 2.11 (scripts/allocator_replay_gpu.py) and
matched max_memory_allocated / max_memory_reserved exactly.
"""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memopt.estimate.allocator import simulate_allocator
from memopt.estimate.allocator_config import (
    AllocatorConfig,
    _roundup_power2_next_division,
    get_allocation_size,
    round_size,
)
from memopt.estimate.allocator_sim import AllocatorOOMError, CachingAllocatorSim

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
EXP = AllocatorConfig(expandable_segments=True)


class Trace:
    """Builds event lists: ``a = t.alloc(size)`` / ``t.free(a)``."""

    def __init__(self) -> None:
        self.events: list[tuple[int, ...]] = []
        self._next = 0

    def alloc(self, size: int, stream: int = 0) -> int:
        key = self._next
        self._next += 1
        self.events.append((1, key, size, stream) if stream else (1, key, size))
        return key

    def free(self, key: int) -> None:
        self.events.append((-1, key, 0))


def run(trace: Trace, **kwargs):
    return simulate_allocator(trace.events, **kwargs)


# -- rounding and segment sizes ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("size", "rounded"),
    [(1, 512), (511, 512), (512, 512), (513, 1024), (1000, 1024), (MiB, MiB), (MiB + 1, MiB + 512)],
)
def test_round_size(size: int, rounded: int) -> None:
    assert round_size(size) == rounded


@pytest.mark.parametrize(
    ("size", "rounded"),
    [
        (1200, 1536),  # <= 512 * divisions: plain 512 rounding
        (4096, 4096),  # a power of two stays
        (4097, 5120),  # [4096, 8192) in 4 steps of 1024
        (MiB + 1, MiB + MiB // 4),
        (5 * MiB, 5 * MiB),
        (10 * MiB - 1, 10 * MiB),
        (10 * MiB + 1, 12 * MiB),
        (100_000, 114_688),  # [65536, 131072) in steps of 16384
    ],
)
def test_round_size_power2_divisions(size: int, rounded: int) -> None:
    assert round_size(size, AllocatorConfig(roundup_power2_divisions=4)) == rounded
    assert _roundup_power2_next_division(1200, 4) == 1280  # the example in the C++ comment


def test_power2_divisions_per_interval() -> None:
    # 1 division (off) below 2 MiB, 4 from [2 MiB, 4 MiB) on
    cfg = AllocatorConfig.from_alloc_conf("roundup_power2_divisions:[1:1,2:4,>:4]")
    assert cfg.roundup_power2_divisions == (1, 4) + (4,) * 14
    assert round_size(MiB + 1, cfg) == MiB + 512
    assert round_size(2 * MiB + 1, cfg) == 2 * MiB + MiB // 2


@pytest.mark.parametrize(
    ("rounded", "segment"),
    [
        (512, 2 * MiB),
        (MiB, 2 * MiB),
        (MiB + 512, 20 * MiB),
        (10 * MiB - 512, 20 * MiB),
        (10 * MiB, 10 * MiB),
        (11 * MiB, 12 * MiB),
        (12 * MiB, 12 * MiB),
    ],
)
def test_allocation_size(rounded: int, segment: int) -> None:
    assert get_allocation_size(rounded) == segment


def test_config_round_trip() -> None:
    cfg = AllocatorConfig(
        expandable_segments=True,
        max_split_size_bytes=128 * MiB,
        garbage_collection_threshold=0.6,
        roundup_power2_divisions=4,
    )
    assert cfg.to_alloc_conf() == (
        "expandable_segments:True,max_split_size_mb:128,garbage_collection_threshold:0.6,roundup_power2_divisions:4"
    )
    assert AllocatorConfig.from_alloc_conf(cfg.to_alloc_conf()) == cfg
    assert AllocatorConfig().to_alloc_conf() == ""
    with pytest.raises(ValueError):
        AllocatorConfig(max_split_size_bytes=10 * MiB)
    with pytest.raises(ValueError):
        AllocatorConfig(garbage_collection_threshold=1.5)


# -- single allocations -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("size", "allocated", "reserved"),
    [
        (KiB, KiB, 2 * MiB),  # small pool: a 2 MiB segment
        (5 * MiB, 5 * MiB, 20 * MiB),  # 1-10 MiB: a 20 MiB segment
        (12 * MiB, 12 * MiB, 12 * MiB),  # >= 10 MiB: its own segment, rounded to 2 MiB
        (11 * MiB, 11 * MiB, 12 * MiB),  # 1 MiB remains: not split (needs > 1 MiB), the block is the segment...
    ],
)
def test_single_allocation(size: int, allocated: int, reserved: int) -> None:
    t = Trace()
    t.alloc(size)
    r = run(t)
    if size == 11 * MiB:
        allocated = 12 * MiB  # ...so max_memory_allocated counts all 12 MiB
    assert (r.peak_allocated_bytes, r.peak_reserved_bytes, r.num_segments) == (allocated, reserved, 1)


def test_large_segment_size() -> None:
    # torch 2.11 accepts large_segment_size_mb: it sizes the segments of 1-10 MiB requests and the large
    # pool's expandable pages (an H200 reserved 40 MiB for a 5 MiB tensor with large_segment_size_mb:40)
    for conf in ("large_segment_size_mb:40", "expandable_segments:True,large_segment_size_mb:40"):
        cfg = AllocatorConfig.from_alloc_conf(conf)
        assert cfg.large_segment_size_bytes == 40 * MiB and cfg.to_alloc_conf() == conf
        t = Trace()
        t.alloc(5 * MiB)
        t.alloc(12 * MiB)  # fits in the 35 MiB left of the segment (or page)
        assert run(t, config=cfg).peak_reserved_bytes == 40 * MiB, conf


def test_zero_byte_allocation_takes_nothing() -> None:
    t = Trace()
    a = t.alloc(0)
    t.free(a)
    r = run(t)
    assert (r.peak_allocated_bytes, r.peak_reserved_bytes, r.num_segments) == (0, 0, 0)


def test_expandable_single_allocations() -> None:
    for size, reserved in [(KiB, 2 * MiB), (5 * MiB, 20 * MiB), (12 * MiB, 20 * MiB), (30 * MiB, 40 * MiB)]:
        t = Trace()
        t.alloc(size)
        assert run(t, config=EXP).peak_reserved_bytes == reserved, size


# -- reuse, splitting, merging ------------------------------------------------------------------------
def test_reuse_splits_cached_segment() -> None:
    t = Trace()
    a = t.alloc(12 * MiB)
    t.free(a)
    t.alloc(6 * MiB)  # best fit: the free 12 MiB block, split 6 + 6 (6 MiB > 1 MiB remain)
    r = run(t)
    assert (r.peak_reserved_bytes, r.final_reserved_bytes, r.num_segments) == (12 * MiB, 12 * MiB, 1)
    assert r.final_allocated_bytes == 6 * MiB


def test_small_pool_packs_2mib_segments() -> None:
    t = Trace()
    for _ in range(6):
        t.alloc(400 * 1000)  # 400000 -> 400384 bytes; five fit in 2 MiB, the sixth needs a new segment
    r = run(t)
    assert (r.peak_reserved_bytes, r.num_segments) == (4 * MiB, 2)


def test_small_pool_splits_down_to_512_bytes() -> None:
    t = Trace()
    t.alloc(MiB)
    t.alloc(MiB - 512)
    t.alloc(512)  # exactly fills the 2 MiB segment
    t.alloc(512)  # needs a second one
    r = run(t)
    assert (r.peak_reserved_bytes, r.num_segments) == (4 * MiB, 2)


def test_large_pool_remainder_of_1mib_is_not_split() -> None:
    t = Trace()
    for _ in range(13):
        t.alloc(3 * MiB // 2)  # 12 x 1.5 MiB from a 20 MiB segment leave 2 MiB; the 13th takes all 2 MiB
    r = run(t)
    assert (r.peak_reserved_bytes, r.peak_allocated_bytes, r.num_segments) == (20 * MiB, 20 * MiB, 1)
    # expandable segments split down to 512 bytes in every pool
    r = run(t, config=EXP)
    assert (r.peak_reserved_bytes, r.peak_allocated_bytes) == (20 * MiB, 13 * 3 * MiB // 2)


def test_merging_neighbours_restores_the_segment() -> None:
    t = Trace()
    a, b, c = t.alloc(4 * MiB), t.alloc(4 * MiB), t.alloc(4 * MiB)  # one 20 MiB segment: a b c [8 free]
    t.free(a)
    t.free(c)  # c merges with the 8 MiB tail
    t.free(b)  # b merges with both: one free 20 MiB block
    t.alloc(20 * MiB)  # fits the merged block exactly
    r = run(t)
    assert (r.peak_reserved_bytes, r.num_segments) == (20 * MiB, 1)


def test_without_merge_a_new_segment_is_needed() -> None:
    t = Trace()
    a, _b, c = t.alloc(4 * MiB), t.alloc(4 * MiB), t.alloc(4 * MiB)
    t.free(a)
    t.free(c)  # free blocks: 4 MiB and 12 MiB, b still in between
    t.alloc(14 * MiB)
    r = run(t)
    assert (r.peak_reserved_bytes, r.num_segments) == (20 * MiB + 14 * MiB, 2)


def test_best_fit_picks_smallest_sufficient_block() -> None:
    sim = CachingAllocatorSim()
    for key, size in enumerate([30 * MiB, 14 * MiB, 22 * MiB]):
        sim.malloc(key, size)
    for key in range(3):
        sim.free(key)
    sim.malloc(10, 13 * MiB)  # best fit: the 14 MiB block (1 MiB remains: not split)
    assert sim.allocated_bytes == 14 * MiB
    sim.malloc(11, 21 * MiB)  # best fit: the 22 MiB one
    assert sim.allocated_bytes == 14 * MiB + 22 * MiB
    assert sim.reserved_bytes == 66 * MiB
    sim.check_invariants()


def test_fragmentation_reserved_exceeds_allocated() -> None:
    t = Trace()
    a, _b, c = t.alloc(12 * MiB), t.alloc(12 * MiB), t.alloc(12 * MiB)  # three 12 MiB segments
    t.free(a)
    t.free(c)  # 24 MiB cached in two 12 MiB holes
    t.alloc(14 * MiB)  # fits neither: a new 14 MiB segment
    r = run(t)
    assert r.peak_reserved_bytes == 50 * MiB
    assert r.final_allocated_bytes == 26 * MiB and r.peak_allocated_bytes == 36 * MiB


def test_expandable_segments_reserve_less_on_fragmentation() -> None:
    t = Trace()
    a, _b, c = t.alloc(12 * MiB), t.alloc(12 * MiB), t.alloc(12 * MiB)
    t.free(a)
    t.free(c)
    t.alloc(14 * MiB)
    # one segment: a|b|c packed into 40 MiB of 20 MiB pages; c's hole merges with the free tail and
    # takes the 14 MiB request without mapping more
    r = run(t, config=EXP)
    assert r.peak_reserved_bytes == 40 * MiB < run(t).peak_reserved_bytes == 50 * MiB


def test_expandable_is_not_always_below_default() -> None:
    # the true relation is not "expandable <= default": a 12 MiB tensor gets a 12 MiB cudaMalloc segment,
    # but maps a whole 20 MiB page with expandable segments
    t = Trace()
    t.alloc(12 * MiB)
    assert run(t, config=EXP).peak_reserved_bytes == 20 * MiB > run(t).peak_reserved_bytes == 12 * MiB


# -- streams ----------------------------------------------------------------------------------------
def test_streams_do_not_share_blocks() -> None:
    t = Trace()
    a = t.alloc(12 * MiB)
    t.free(a)
    t.alloc(12 * MiB, stream=1)  # the cached block belongs to stream 0
    t.alloc(12 * MiB)  # stream 0 reuses its own
    r = run(t)
    assert (r.peak_reserved_bytes, r.num_segments) == (24 * MiB, 2)
    # with expandable segments each stream gets its own segment (a 20 MiB page each)
    assert run(t, config=EXP).peak_reserved_bytes == 40 * MiB


# -- caps, releasing cached memory, OOM ----------------------------------------------------------------
def test_cap_releases_cached_segments_then_succeeds() -> None:
    t = Trace()
    a, b = t.alloc(20 * MiB), t.alloc(20 * MiB)
    t.free(a)
    t.free(b)  # 40 MiB cached
    t.alloc(30 * MiB)  # no block fits; 40 + 30 > 40: release both cached segments, then cudaMalloc
    r = run(t, cap_bytes=40 * MiB)
    assert not r.oom
    assert (r.peak_reserved_bytes, r.final_reserved_bytes) == (40 * MiB, 30 * MiB)
    assert r.num_device_frees == 2
    # without a cap the cache is kept
    assert run(t).final_reserved_bytes == 70 * MiB


def test_cap_oom() -> None:
    t = Trace()
    a, _b = t.alloc(20 * MiB), t.alloc(20 * MiB)
    t.free(a)
    t.alloc(30 * MiB)  # a's segment is released, but 20 + 30 > 40
    r = run(t, cap_bytes=40 * MiB)
    assert r.oom and r.oom_event_index == 3
    assert r.final_reserved_bytes == 20 * MiB  # the cache was flushed before giving up


def test_small_request_under_cap_oom() -> None:
    sim = CachingAllocatorSim(cap_bytes=10 * MiB)
    with pytest.raises(AllocatorOOMError):
        sim.malloc(0, 4 * MiB)  # a 20 MiB segment does not fit under a 10 MiB cap
    sim.malloc(1, 10 * MiB)  # a 10 MiB one does
    assert sim.reserved_bytes == 10 * MiB


def test_expandable_under_cap_unmaps_free_pages() -> None:
    t = Trace()
    a = t.alloc(30 * MiB)  # maps 2 pages: [a 30][10 free]
    t.alloc(10 * MiB)  # takes the free 10 MiB exactly
    t.free(a)  # [30 free][b]
    t.alloc(35 * MiB)  # 40 + 36 > 60: unmap the free page [0, 20), keep [20, 30); then map 2 pages at the end
    r = run(t, config=EXP, cap_bytes=60 * MiB)
    assert not r.oom
    assert (r.peak_reserved_bytes, r.final_reserved_bytes, r.num_device_frees) == (60 * MiB, 60 * MiB, 1)


def test_max_split_size_keeps_oversize_blocks_whole() -> None:
    cfg = AllocatorConfig(max_split_size_bytes=40 * MiB)
    t = Trace()
    a = t.alloc(50 * MiB)
    t.free(a)
    t.alloc(25 * MiB)  # below max_split: may not take the oversize 50 MiB block -> new 26 MiB segment
    assert run(t, config=cfg).peak_reserved_bytes == 76 * MiB
    assert run(t).peak_reserved_bytes == 50 * MiB  # default: split the cached 50 MiB block
    t = Trace()
    a = t.alloc(50 * MiB)
    t.free(a)
    t.alloc(45 * MiB)  # oversize request: takes the 50 MiB block whole (within 20 MiB), no split
    r = run(t, config=cfg)
    assert (r.peak_reserved_bytes, r.final_allocated_bytes) == (50 * MiB, 50 * MiB)
    t = Trace()
    a = t.alloc(80 * MiB)
    t.free(a)
    t.alloc(50 * MiB)  # 80 >= 50 + 20: too wasteful, a new segment
    assert run(t, config=cfg).peak_reserved_bytes == 130 * MiB


def test_release_available_cached_blocks_frees_only_oversize() -> None:
    cfg = AllocatorConfig(max_split_size_bytes=40 * MiB)
    t = Trace()
    a, b = t.alloc(20 * MiB), t.alloc(70 * MiB)
    t.free(a)
    t.free(b)  # cached: 20 MiB (normal) and 70 MiB (oversize)
    t.alloc(25 * MiB)  # 90 + 26 > 100; release_available_cached_blocks frees the 70 MiB block only
    r = run(t, config=cfg, cap_bytes=100 * MiB)
    assert not r.oom and r.final_reserved_bytes == 20 * MiB + 26 * MiB
    # without max_split_size the 70 MiB block is simply split
    assert run(t, cap_bytes=100 * MiB).final_reserved_bytes == 90 * MiB
    # with max_split_size, a request no single oversize block covers frees oversize blocks from the largest
    # down; when they are not enough, every unsplit cached segment goes (release_cached_blocks)
    t = Trace()
    a, b, _c = t.alloc(20 * MiB), t.alloc(42 * MiB), t.alloc(30 * MiB)
    t.free(a)
    t.free(b)
    t.alloc(60 * MiB)  # 92 + 60 > 120: frees the 42 MiB block (< 60: not enough), then the 20 MiB one
    r = run(t, config=cfg, cap_bytes=120 * MiB)
    assert not r.oom and r.final_reserved_bytes == 30 * MiB + 60 * MiB and r.num_device_frees == 2


def test_garbage_collection_frees_old_blocks_first() -> None:
    cfg = AllocatorConfig(garbage_collection_threshold=0.5)
    t = Trace()
    a = t.alloc(30 * MiB)
    t.free(a)
    b = t.alloc(40 * MiB)  # new segment, reserved 70
    t.free(b)
    t.alloc(50 * MiB)  # reserved 70 > 50 (0.5 x cap): gc frees the older 30 MiB block; 40 + 50 <= 100
    r = run(t, config=cfg, cap_bytes=100 * MiB)
    assert (r.peak_reserved_bytes, r.final_reserved_bytes) == (90 * MiB, 90 * MiB)
    # no gc: the cap forces release of both cached blocks
    assert run(t, cap_bytes=100 * MiB).final_reserved_bytes == 50 * MiB
    # gc only runs under a cap (a memory fraction), as in PyTorch
    assert run(t, config=cfg).final_reserved_bytes == 120 * MiB


# -- empty_cache, initial events -----------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [AllocatorConfig(), EXP])
def test_empty_cache_returns_everything_free(cfg: AllocatorConfig) -> None:
    sim = CachingAllocatorSim(cfg)
    sim.malloc(0, 5 * MiB)
    sim.malloc(1, KiB)
    sim.malloc(2, 50 * MiB)
    sim.free(0)
    sim.empty_cache()  # the 5 MiB block merged back into a whole free 20 MiB segment: released
    assert sim.reserved_bytes == (2 * MiB + 50 * MiB if not cfg.expandable_segments else 2 * MiB + 60 * MiB)
    sim.check_invariants()
    sim.free(1)
    sim.free(2)
    sim.empty_cache()
    sim.check_invariants()
    assert sim.reserved_bytes == 0 and sim.num_segments_live == 0


def test_expandable_empty_cache_keeps_partially_used_pages() -> None:
    sim = CachingAllocatorSim(EXP)
    sim.malloc(0, 30 * MiB)  # pages [0, 40)
    sim.malloc(1, 2 * MiB)  # [30, 32)
    sim.free(0)
    sim.empty_cache()  # [0, 20) is unmapped; [20, 40) holds the live 2 MiB
    assert sim.reserved_bytes == 20 * MiB
    sim.check_invariants()
    sim.malloc(2, 25 * MiB)  # lowest address with room: the hole at 0 (+ free [20, 30)) -> maps [0, 20) again
    assert sim.reserved_bytes == 40 * MiB
    sim.check_invariants()


def test_initial_events_then_peak_reset() -> None:
    init = [(1, 100, 100 * MiB)]  # e.g. weights, alive before the step
    events = [(1, 0, 12 * MiB), (-1, 0, 0)]
    r = simulate_allocator(events, initial_events=init)
    assert (r.peak_reserved_bytes, r.peak_allocated_bytes, r.num_segments) == (112 * MiB, 112 * MiB, 1)
    r = simulate_allocator(events, initial_events=init, cap_bytes=105 * MiB)
    assert r.oom and r.oom_event_index == 0
    r = simulate_allocator(events, initial_events=init, cap_bytes=50 * MiB)
    assert r.oom and r.oom_event_index == -1


def test_bad_events_are_rejected() -> None:
    with pytest.raises(ValueError):
        simulate_allocator([(1, 0, 10, 0, 0)])  # e.g. a TrackedRun event: its 4th field is a phase
    with pytest.raises(ValueError):
        simulate_allocator([(1, 0, 10), (1, 0, 10)])
    with pytest.raises(KeyError):
        simulate_allocator([(-1, 0, 10)])


# -- properties ----------------------------------------------------------------------------------------
_sizes = st.one_of(
    st.integers(1, 4 * KiB), st.integers(4 * KiB, MiB), st.integers(MiB, 10 * MiB), st.integers(10 * MiB, 120 * MiB)
)


@st.composite
def traces(draw: st.DrawFn, max_ops: int = 120) -> list[tuple[int, ...]]:
    n = draw(st.integers(1, max_ops))
    streams = draw(st.integers(1, 2))
    live: list[int] = []
    events: list[tuple[int, ...]] = []
    key = 0
    for _ in range(n):
        if live and draw(st.booleans()):
            events.append((-1, live.pop(draw(st.integers(0, len(live) - 1))), 0))
        else:
            events.append((1, key, draw(_sizes), draw(st.integers(0, streams - 1))))
            live.append(key)
            key += 1
    for k in live:  # free everything at the end
        events.append((-1, k, 0))
    return events


_configs = st.sampled_from(
    [
        AllocatorConfig(),
        EXP,
        AllocatorConfig(max_split_size_bytes=40 * MiB),
        AllocatorConfig(roundup_power2_divisions=4),
        AllocatorConfig(expandable_segments=True, max_split_size_bytes=40 * MiB),
    ]
)


@settings(max_examples=150, deadline=None)
@given(events=traces(), cfg=_configs, cap=st.sampled_from([None, 150 * MiB, 400 * MiB]))
def test_properties(events: list[tuple[int, ...]], cfg: AllocatorConfig, cap: int | None) -> None:
    sim = CachingAllocatorSim(cfg, cap_bytes=cap)
    oom = False
    for i, (kind, key, size, *rest) in enumerate(events):
        if kind > 0:
            try:
                sim.malloc(key, size, rest[0] if rest else 0)
            except AllocatorOOMError:
                oom = True
                break
        else:
            sim.free(key)
        if i % 7 == 0:
            sim.check_invariants()
        assert sim.peak_reserved_bytes >= sim.peak_allocated_bytes
        assert sim.reserved_bytes >= sim.allocated_bytes
        if cap is not None and not cfg.expandable_segments:
            assert sim.reserved_bytes <= cap
    sim.check_invariants()
    if not oom:
        assert sim.allocated_bytes == 0 and sim.num_live_allocations == 0
        assert sim.reserved_bytes % (2 * MiB) == 0
        sim.empty_cache()  # with nothing live, everything goes back
        sim.check_invariants()
        assert sim.reserved_bytes == 0 and sim.num_segments_live == 0
    # the batch API agrees with the incremental one
    r = simulate_allocator(events, config=cfg, cap_bytes=cap)
    assert r.peak_reserved_bytes == sim.peak_reserved_bytes and r.oom == oom


@settings(max_examples=100, deadline=None)
@given(events=traces(), cfg=_configs, limit=st.integers(0, 600 * MiB))
def test_a_replay_stops_exactly_when_the_full_peak_would_pass_the_limit(events: list[tuple[int, ...]],
                                                                       cfg: AllocatorConfig, limit: int) -> None:
    # without a cap reserved bytes never go back: a replay may stop at the first event that passes the limit
    full = simulate_allocator(events, config=cfg)
    stopped = simulate_allocator(events, config=cfg, stop_above=limit)
    assert (stopped.stopped_at is not None) == (full.peak_reserved_bytes > limit)
    if stopped.stopped_at is None:
        assert stopped == full
    else:
        assert limit < stopped.peak_reserved_bytes <= full.peak_reserved_bytes
        prefix = simulate_allocator(events[:stopped.stopped_at + 1], config=cfg)
        assert prefix.peak_reserved_bytes == stopped.peak_reserved_bytes


@settings(max_examples=100, deadline=None)
@given(events=traces())
def test_expandable_reserved_is_whole_pages(events: list[tuple[int, ...]]) -> None:
    # with expandable segments, reserved memory is 2 MiB pages for the small pool plus 20 MiB pages for
    # the large pool; mapped memory is never given back without empty_cache or a cap
    sim = CachingAllocatorSim(EXP)
    last = 0
    for kind, key, size, *rest in events:
        if kind > 0:
            sim.malloc(key, size, rest[0] if rest else 0)
        else:
            sim.free(key)
        assert sim.reserved_bytes >= last
        last = sim.reserved_bytes
    for seg in sim.segments():
        page = 20 * MiB if seg["is_large"] else 2 * MiB
        assert seg["total_size"] % page == 0


# -- speed --------------------------------------------------------------------------------------------
def _random_trace(n: int, seed: int) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    live: list[int] = []
    events: list[tuple[int, int, int]] = []
    key = 0
    while len(events) < n:
        if live and (rng.random() < 0.5 or len(live) > 2000):
            j = rng.randrange(len(live))
            live[j], live[-1] = live[-1], live[j]
            events.append((-1, live.pop(), 0))
        else:
            r = rng.random()
            size = (
                rng.randint(1, MiB)
                if r < 0.6
                else rng.randint(MiB, 10 * MiB)
                if r < 0.9
                else rng.randint(10 * MiB, 200 * MiB)
            )
            events.append((1, key, size))
            live.append(key)
            key += 1
    return events


@pytest.mark.parametrize("cfg", [AllocatorConfig(), EXP])
def test_200k_events_are_fast(cfg: AllocatorConfig) -> None:
    events = _random_trace(200_000, seed=0)
    t0 = time.perf_counter()
    r = simulate_allocator(events, config=cfg)
    elapsed = time.perf_counter() - t0
    assert r.peak_reserved_bytes >= r.peak_allocated_bytes > 0
    assert elapsed < 3.0, elapsed  # ~0.5 s on a 2-core machine; generous for loaded CI runners
