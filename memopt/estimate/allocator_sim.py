"""The request path of the caching-allocator model: ``malloc`` and ``free`` of one ``DeviceCachingAllocator``.

Rules modelled (each mirrors the C++ function of ``c10/cuda/CUDACachingAllocator.cpp`` named in brackets):

* pools: requests <= 1 MiB go to the small pool, larger ones to the large pool [``get_pool``];
* best fit over the free blocks of the pool ordered by (stream, size, address), blocks reused only by
  their own stream; oversize rules with ``max_split_size`` [``get_free_block``];
* splitting: small pool (and every pool under expandable segments) when >= 512 B remain, large pool
  when > 1 MiB remain and the request is below ``max_split_size`` [``should_split``,
  ``alloc_found_block``];
* merging a freed block with free neighbours of the same segment [``free_block``, ``try_merge_blocks``];
* a per-process cap (``torch.cuda.set_per_process_memory_fraction``): a new segment that would take the
  reserved total over the cap fails; then oversize cached blocks are released
  [``release_available_cached_blocks``], then every unsplit cached segment (and, with expandable
  segments, every free page) [``release_cached_blocks``], then OOM; ``garbage_collection_threshold``
  frees old unsplit large segments first [``garbage_collect_cached_blocks``].

Known limitations:

* no cross-stream lifetime: ``record_stream`` and the CUDA events that delay a free are not modelled,
  a free takes effect at once; streams are plain integers ordered by value (the real order is that of
  the ``cudaStream_t`` handles, the default stream first);
* the cap is the only source of OOM (``cap_bytes`` plays ``allowed_memory_maximum``); the driver's own
  limit, the CUDA context and memory taken by other processes or by non-PyTorch libraries are not
  modelled; with no cap, allocation never fails (and the garbage collector, which PyTorch only runs
  under a memory fraction, never runs);
* ``release_available_cached_blocks`` only releases unsplit blocks (the C++ code would ``cudaFree`` a
  split oversize block in a corner case that needs ``max_split_size`` just above a segment size).
"""

from __future__ import annotations

from bisect import bisect_left, insort

from memopt.estimate.allocator_config import (
    K_MIN_BLOCK_SIZE,
    K_MIN_LARGE_ALLOC,
    K_ROUND_LARGE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    NO_LIMIT,
    round_size_by_table,
)
from memopt.estimate.allocator_pools import ADDR_MASK, SHIFT, AllocatorPools, Block, Pool

__all__ = [
    "AllocatorOOMError",
    "CachingAllocatorSim",
    "EventStreamError",
]


class EventStreamError(ValueError):
    """An event stream no program can make (a negative size, a key allocated twice). In the planner it is a bug in
    how memopt composed the stream, never a property of the user's model: the search lets it through instead of
    counting it as a candidate that cannot be estimated."""


class AllocatorOOMError(MemoryError):
    """An allocation could not be served without going over the simulated cap."""

    def __init__(self, key: int, size: int, allocated: int, reserved: int, cap: int | None) -> None:
        super().__init__(
            f"simulated CUDA OOM: request of {size} bytes (key {key}) with {allocated} bytes allocated, "
            f"{reserved} reserved, cap {cap}"
        )
        self.key, self.size, self.allocated, self.reserved, self.cap = key, size, allocated, reserved, cap


class CachingAllocatorSim(AllocatorPools):
    """Incremental model of one device's ``DeviceCachingAllocator``.

    ``malloc(key, size, stream)`` / ``free(key)`` / ``empty_cache()``; ``cap_bytes`` is the memory
    fraction's ``allowed_memory_maximum`` (None: no cap). ``malloc`` raises ``AllocatorOOMError`` when
    the request cannot be served; the state is then as PyTorch leaves it after its OOM (caches flushed).
    """

    # -- public API ----------------------------------------------------------------------------
    @property
    def num_live_allocations(self) -> int:
        return len(self._live)

    def state_key(self) -> tuple:
        """What the allocator's future behaviour depends on besides the live allocations' keys: byte counts,
        device calls, and every free and unmapped block by (size, address). Two equal keys with the same live
        allocations mean the same decisions on the same requests (garbage collection's ages aside)."""
        pools = tuple((tuple((s, tuple(v)) for s, v in sorted(p.free.items())),
                       tuple((s, tuple(v)) for s, v in sorted(p.unmapped.items()))) for p in (self._small, self._large))
        return (self.allocated_bytes, self.reserved_bytes, self.num_device_allocs, self.num_device_frees,
                self.num_alloc_retries, len(self._live), pools)

    def reset_peak_stats(self) -> None:
        """As ``torch.cuda.reset_peak_memory_stats()``: peaks restart from the current values."""
        self.peak_allocated_bytes = self.allocated_bytes
        self.peak_reserved_bytes = self.reserved_bytes

    def malloc(self, key: int, size: int, stream: int = 0) -> int:
        """Allocate ``size`` bytes for ``key`` on ``stream``; returns the block size (rounded size)."""
        live = self._live
        if key in live:
            raise EventStreamError(f"key {key} is already allocated")
        if size <= 0:
            if size < 0:
                raise EventStreamError(f"negative size {size} for key {key}")
            live[key] = None  # PyTorch hands out a null pointer without touching the allocator
            return 0
        # round_size
        if size < K_MIN_BLOCK_SIZE:
            rsize = K_MIN_BLOCK_SIZE
        elif self._divisions is None:
            rsize = (size + 511) & ~511
        else:
            rsize = round_size_by_table(size, self._divisions)
        small = rsize <= K_SMALL_SIZE
        pool = self._small if small else self._large
        free_by_addr = self._free_by_addr
        max_split = self._max_split
        # get_free_block: best fit among this stream's free blocks
        if self._gc_on:
            pool.gc_calls += 1
        block = None
        keys = pool.free.get(stream)
        if keys:
            i = bisect_left(keys, rsize << SHIFT)
            if i < len(keys):
                if self._expandable:
                    i = self._expandable_best_fit(keys, i)
                bkey = keys[i]
                bsize = bkey >> SHIFT
                # oversize blocks go only to requests >= max_split_size, and only if not much larger
                if not (
                    (rsize < max_split and bsize >= max_split)
                    or (rsize >= max_split and bsize >= rsize + self._non_split_rounding)
                ):
                    del keys[i]
                    block = free_by_addr.pop(bkey & ADDR_MASK)
        if block is None:
            block = self._new_block(pool, rsize, stream)
            if block is None:
                self.num_ooms += 1
                raise AllocatorOOMError(key, size, self.allocated_bytes, self.reserved_bytes, self.cap_bytes)
        # should_split / alloc_found_block
        remaining = block.size - rsize
        if small or self._expandable:
            split = remaining >= K_MIN_BLOCK_SIZE
        else:
            split = rsize < max_split and remaining > K_SMALL_SIZE
        if split:
            rest = Block(block.addr + rsize, remaining, stream, small, block.seg, True)
            nxt = block.next
            rest.prev = block
            rest.next = nxt
            if nxt is not None:
                nxt.prev = rest
            block.next = rest
            block.size = rsize
            rest.gc_base = pool.gc_calls
            keys = pool.free.get(stream)
            if keys is None:
                keys = pool.free[stream] = []
            insort(keys, (remaining << SHIFT) | rest.addr)
            free_by_addr[rest.addr] = rest
        block.allocated = True
        live[key] = block
        allocated = self.allocated_bytes + block.size
        self.allocated_bytes = allocated
        if allocated > self.peak_allocated_bytes:
            self.peak_allocated_bytes = allocated
        return block.size

    def free(self, key: int) -> None:
        """Free the allocation made for ``key``; its block goes back to the cache (merged with free neighbours)."""
        block = self._live.pop(key)
        if block is None:
            return
        block.allocated = False
        self.allocated_bytes -= block.size
        pool = self._small if block.small else self._large
        free_by_addr = self._free_by_addr
        stream = block.stream
        keys = pool.free.get(stream)
        if keys is None:
            keys = pool.free[stream] = []
        prev = block.prev
        if prev is not None and not prev.allocated and prev.mapped:
            del keys[bisect_left(keys, (prev.size << SHIFT) | prev.addr)]
            del free_by_addr[prev.addr]
            block.addr = prev.addr
            block.size += prev.size
            prev = block.prev = prev.prev
            if prev is not None:
                prev.next = block
        nxt = block.next
        if nxt is not None and not nxt.allocated and nxt.mapped:
            del keys[bisect_left(keys, (nxt.size << SHIFT) | nxt.addr)]
            del free_by_addr[nxt.addr]
            block.size += nxt.size
            nxt = block.next = nxt.next
            if nxt is not None:
                nxt.prev = block
        block.gc_base = pool.gc_calls
        insort(keys, (block.size << SHIFT) | block.addr)
        free_by_addr[block.addr] = block

    def _new_block(self, pool: Pool, rsize: int, stream: int) -> Block | None:
        """No cached block fits: garbage-collect, then get a new segment, freeing cached ones if capped."""
        if rsize <= K_SMALL_SIZE:
            alloc_size = K_SMALL_BUFFER
        elif rsize < K_MIN_LARGE_ALLOC:
            alloc_size = self._large_segment
        else:
            alloc_size = (rsize + K_ROUND_LARGE - 1) // K_ROUND_LARGE * K_ROUND_LARGE
        if self._gc_on:
            self._garbage_collect()
        block = self._alloc_block(pool, rsize, alloc_size, stream)
        if block is None and self._release_available_cached_blocks(pool, rsize, stream):
            block = self._alloc_block(pool, rsize, alloc_size, stream)
        if block is None:
            self._release_cached_blocks()
            self.num_alloc_retries += 1
            block = self._alloc_block(pool, rsize, alloc_size, stream)
        return block

    def _release_available_cached_blocks(self, pool: Pool, rsize: int, stream: int) -> bool:
        max_split = self._max_split
        if max_split == NO_LIMIT:
            return False
        keys = pool.free.get(stream)
        if not keys:
            return False
        want = max(rsize, max_split)
        i = bisect_left(keys, want << SHIFT)
        if i < len(keys):
            block = self._free_by_addr[keys[i] & ADDR_MASK]
            if block.seg is None:
                if block.prev is not None or block.next is not None:
                    return False  # see Known limitations: PyTorch would cudaFree a split block here
                self._release_block(pool, block)
                return True
        # no single block is large enough: free oversize blocks from the largest down
        released = 0
        j = i - 1
        while released < want and j >= 0:
            key = keys[j]
            if key >> SHIFT < max_split:
                break
            block = self._free_by_addr[key & ADDR_MASK]
            if block.seg is None and block.prev is None and block.next is None:
                released += block.size
                self._release_block(pool, block)
            j -= 1
        return released >= want

    def _garbage_collect(self) -> None:
        assert self.cap_bytes is not None
        threshold = int((self.config.garbage_collection_threshold or 0.0) * self.cap_bytes)
        if self.reserved_bytes <= threshold:
            return
        target = self.reserved_bytes - threshold
        pool = self._large
        calls = pool.gc_calls
        candidates = [
            b
            for stream in sorted(pool.free)
            for b in (self._free_by_addr[k & ADDR_MASK] for k in pool.free[stream])
            if b.prev is None and b.next is None
        ]
        if not candidates:
            return
        total_age = sum(calls - b.gc_base for b in candidates)
        count = len(candidates)
        reclaimed = 0
        freed = True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            survivors: list[Block] = []
            for b in candidates:
                age = calls - b.gc_base
                if b.seg is None and age >= age_threshold:
                    freed = True
                    reclaimed += b.size
                    total_age -= age
                    count -= 1
                    self._release_block(pool, b)
                else:
                    survivors.append(b)
            candidates = survivors

    def _expandable_best_fit(self, keys: list[int], i: int) -> int:
        """get_free_block under expandable segments: count the unmapped room behind a block as its size."""
        free_by_addr = self._free_by_addr
        block = free_by_addr[keys[i] & ADDR_MASK]
        cur = _expandable_size(block)
        n = len(keys)
        while block.seg is not None and i + 1 < n:
            cand = free_by_addr[keys[i + 1] & ADDR_MASK]
            cand_size = _expandable_size(cand)
            if cand_size >= cur:
                break
            i += 1
            block, cur = cand, cand_size
        return i

    def empty_cache(self) -> None:
        """As ``torch.cuda.empty_cache()``: release unsplit cached segments and unmap free pages."""
        self._release_cached_blocks()

    def segments(self) -> list[dict[str, object]]:
        """Mapped memory as segments (one entry per contiguous mapped range), for inspection and tests."""
        heads: dict[int, Block] = {}
        for b in list(self._free_by_addr.values()) + [b for b in self._live.values() if b is not None]:
            while b.prev is not None and b.prev.mapped:
                b = b.prev
            heads[b.addr] = b
        out: list[dict[str, object]] = []
        for addr in sorted(heads):
            b: Block | None = heads[addr]
            blocks: list[tuple[int, bool]] = []
            head = heads[addr]
            while b is not None and b.mapped:
                blocks.append((b.size, b.allocated))
                b = b.next
            out.append(
                {
                    "address": addr,
                    "stream": head.stream,
                    "is_large": not head.small,
                    "is_expandable": head.seg is not None,
                    "total_size": sum(s for s, _ in blocks),
                    "allocated_size": sum(s for s, a in blocks if a),
                    "blocks": blocks,
                }
            )
        return out

    def check_invariants(self) -> None:
        """Raise AssertionError if the internal state is inconsistent (for tests and debugging)."""
        blocks: dict[int, Block] = {}
        for b in self._free_by_addr.values():
            blocks[id(b)] = b
        for b in self._unmapped_by_addr.values():
            blocks[id(b)] = b
        for b in self._live.values():
            if b is not None:
                blocks[id(b)] = b
        heads = {}
        for b in blocks.values():
            while b.prev is not None:
                b = b.prev
            heads[id(b)] = b
        mapped = allocated = 0
        for head in heads.values():
            b: Block | None = head
            expect = head.addr
            while b is not None:
                assert b.addr == expect, "blocks of a segment must be contiguous"
                assert id(b) in blocks, "a block is in no index"
                assert (b.seg is None) == (head.seg is None) and b.small == head.small and b.stream == head.stream
                if b.mapped:
                    mapped += b.size
                    if b.allocated:
                        allocated += b.size
                    else:
                        assert self._free_by_addr.get(b.addr) is b, "free block missing from the free index"
                        pool = self._small if b.small else self._large
                        keys = pool.free[b.stream]
                        k = (b.size << SHIFT) | b.addr
                        i = bisect_left(keys, k)
                        assert i < len(keys) and keys[i] == k, "free block missing from its size list"
                else:
                    assert not b.allocated and b.seg is not None
                    assert self._unmapped_by_addr.get(b.addr) is b, "unmapped block missing from its index"
                    assert (b.addr - b.seg.base) % b.seg.page == 0 and b.size % b.seg.page == 0
                nxt = b.next
                if nxt is not None:
                    assert nxt.prev is b, "broken links"
                    if not b.allocated and not nxt.allocated:
                        assert b.mapped != nxt.mapped, "adjacent free blocks were not merged"
                expect = b.addr + b.size
                b = nxt
            if head.seg is not None:
                assert expect - head.addr == head.seg.size, "an expandable segment must cover its range"
        assert mapped == self.reserved_bytes, (mapped, self.reserved_bytes)
        assert allocated == self.allocated_bytes, (allocated, self.allocated_bytes)
        assert self.peak_reserved_bytes >= self.reserved_bytes and self.peak_allocated_bytes >= self.allocated_bytes
        n_free = sum(len(v) for p in (self._small, self._large) for v in p.free.values())
        assert n_free == len(self._free_by_addr)


def _expandable_size(block: Block) -> int:
    nxt = block.next
    return block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)
