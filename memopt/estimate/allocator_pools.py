"""Blocks, pools and segments of the caching-allocator model, and how segments are mapped and released.

Rules modelled (each mirrors the C++ function of ``c10/cuda/CUDACachingAllocator.cpp`` named in brackets):

* expandable segments: one virtual segment per (pool, stream) mapped in pages of 2 MiB (small pool)
  or 20 MiB (large pool, ``large_segment_size_mb``); best fit counts the unmapped tail as room
  [``get_free_block``]; new pages go at the lowest address with enough free + unmapped room
  [``find_expandable_block``, ``try_allocate_expandable_block``, ``map_block``]; every block is split
  down to 512 B; only whole free pages are unmapped, and only by ``empty_cache`` or when an allocation
  would exceed the cap [``release_blocks``, ``unmap_block``].

Known limitations:

* addresses are synthetic (see ``AllocatorPools._segment_address``): large segments get
  decreasing addresses, small ones increasing, and freed ranges are never reused; the CUDA driver's
  placement has exceptions, so a tie between equal-size free blocks may be broken differently than on
  the GPU, after which the two histories can drift apart (in H200 replays the peaks still matched);
* the configuration is fixed for the life of a simulator (PyTorch lets ``expandable_segments`` be
  switched at run time); the virtual size of an expandable segment (1.125 x ``device_total_bytes``,
  default 141 GiB) only matters once a stream has used that much address space.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from memopt.estimate.allocator_config import K_ROUND_LARGE, K_SMALL_BUFFER, NO_LIMIT, AllocatorConfig
from memopt.units import GiB

__all__ = [
    "ADDR_MASK",
    "SHIFT",
    "AllocatorPools",
    "Block",
    "Pool",
]

SHIFT = 64  # free-list keys are (size << 64) | address
ADDR_MASK = (1 << SHIFT) - 1
_DEFAULT_DEVICE_TOTAL = 141 * GiB  # only sizes the virtual range of an expandable segment


class _Segment:
    """A virtual address range of an expandable segment, mapped in ``page``-sized pages."""

    __slots__ = ("base", "page", "size")

    def __init__(self, base: int, page: int, size: int) -> None:
        self.base, self.page, self.size = base, page, size


class Block:
    __slots__ = ("addr", "allocated", "gc_base", "mapped", "next", "prev", "seg", "size", "small", "stream")

    def __init__(self, addr: int, size: int, stream: int, small: bool, seg: _Segment | None, mapped: bool) -> None:
        self.addr = addr
        self.size = size
        self.stream = stream
        self.small = small
        self.allocated = False
        self.mapped = mapped
        self.prev: Block | None = None
        self.next: Block | None = None
        self.seg = seg
        self.gc_base = 0


class Pool:
    """Free blocks of one pool: per stream, a sorted list of (size << 64 | addr) keys."""

    __slots__ = ("free", "gc_calls", "small", "unmapped")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.free: dict[int, list[int]] = {}
        self.unmapped: dict[int, list[int]] = {}  # stream -> sorted addresses of unmapped blocks
        self.gc_calls = 0  # get_free_blocks_call_count


class AllocatorPools:
    """Pools, blocks and segments of one device's ``DeviceCachingAllocator``: the state that
    ``CachingAllocatorSim`` serves requests from, and how segments are created, mapped, unmapped and
    released."""

    def __init__(
        self,
        config: AllocatorConfig | None = None,
        *,
        cap_bytes: int | None = None,
        device_total_bytes: int | None = None,
    ) -> None:
        self.config = config if config is not None else AllocatorConfig()
        self.cap_bytes = cap_bytes
        cfg = self.config
        self._divisions = cfg.division_table()
        self._expandable = cfg.expandable_segments
        self._max_split = cfg.max_split_size_bytes if cfg.max_split_size_bytes is not None else NO_LIMIT
        self._non_split_rounding = cfg.max_non_split_rounding_bytes
        self._large_segment = cfg.large_segment_size_bytes
        self._gc_on = cap_bytes is not None and (cfg.garbage_collection_threshold or 0.0) > 0.0
        total = device_total_bytes if device_total_bytes is not None else max(_DEFAULT_DEVICE_TOTAL, cap_bytes or 0)
        self._va_bytes = total + total // 8  # the address space each expandable segment reserves
        self._small = Pool(True)
        self._large = Pool(False)
        self._free_by_addr: dict[int, Block] = {}  # free, mapped blocks
        self._unmapped_by_addr: dict[int, Block] = {}
        self._live: dict[int, Block | None] = {}  # key -> allocated block (None for 0-byte requests)
        # synthetic, disjoint address ranges (see _segment_address): large cudaMalloc segments grow down
        # from 2**50, small ones up from 2**48, expandable segments' virtual ranges up from 2**51
        self._large_va = 1 << 50
        self._small_va = 1 << 48
        self._next_va = 1 << 51
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self.peak_allocated_bytes = 0
        self.peak_reserved_bytes = 0
        self.num_device_allocs = 0  # cudaMalloc + cuMemMap calls
        self.num_device_frees = 0  # cudaFree + cuMemUnmap calls
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.num_segments_live = 0  # cudaMalloc'ed segments plus expandable segments

    @property
    def gc_enabled(self) -> bool:
        """Whether ``garbage_collection_threshold`` is in force (it ages cached blocks on every request)."""
        return self._gc_on

    # -- free-list helpers ---------------------------------------------------------------------
    def _remove_free(self, pool: Pool, block: Block) -> None:
        keys = pool.free[block.stream]
        del keys[bisect_left(keys, (block.size << SHIFT) | block.addr)]
        del self._free_by_addr[block.addr]

    def _insert_free(self, pool: Pool, block: Block) -> None:
        block.gc_base = pool.gc_calls
        keys = pool.free.get(block.stream)
        if keys is None:
            keys = pool.free[block.stream] = []
        insort(keys, (block.size << SHIFT) | block.addr)
        self._free_by_addr[block.addr] = block

    def _insert_unmapped(self, pool: Pool, block: Block) -> None:
        addrs = pool.unmapped.get(block.stream)
        if addrs is None:
            addrs = pool.unmapped[block.stream] = []
        insort(addrs, block.addr)
        self._unmapped_by_addr[block.addr] = block

    def _remove_unmapped(self, pool: Pool, block: Block) -> None:
        addrs = pool.unmapped[block.stream]
        del addrs[bisect_left(addrs, block.addr)]
        del self._unmapped_by_addr[block.addr]

    def _new_va(self, size: int, align: int) -> int:
        """Virtual range of a new expandable segment."""
        base = -(-self._next_va // align) * align
        self._next_va = base + size
        return base

    def _segment_address(self, size: int, small: bool) -> int:
        """Address of a new cudaMalloc segment, imitating where the CUDA driver tends to put it.

        Only the order of addresses matters: best fit breaks ties between equal-size free blocks by
        address. Replays on an H200 (driver 580, torch 2.11) placed each large segment below the earlier
        ones, while 2 MiB segments mostly went upwards; the driver's real placement has exceptions, so
        ties can still be broken differently (given the GPU's own segment addresses, the simulator
        reproduced the address of every block of those replays).
        """
        if small:
            addr = self._small_va
            self._small_va += size
            return addr
        self._large_va = (self._large_va - size) // K_ROUND_LARGE * K_ROUND_LARGE
        return self._large_va

    def _grow_reserved(self, nbytes: int) -> None:
        self.reserved_bytes += nbytes
        self.num_device_allocs += 1
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)

    # -- alloc_block ---------------------------------------------------------------------------
    def _alloc_block(self, pool: Pool, rsize: int, alloc_size: int, stream: int) -> Block | None:
        if self.cap_bytes is not None and self.reserved_bytes + alloc_size > self.cap_bytes:
            return None
        if self._expandable:
            return self._try_allocate_expandable_block(pool, rsize, stream)
        block = Block(self._segment_address(alloc_size, pool.small), alloc_size, stream, pool.small, None, True)
        self.num_segments_live += 1
        self._grow_reserved(alloc_size)
        return block

    # -- expandable segments -------------------------------------------------------------------
    def _find_expandable_block(self, pool: Pool, rsize: int, stream: int) -> Block:
        addrs = pool.unmapped.get(stream)
        if addrs:
            for addr in addrs:
                c = self._unmapped_by_addr[addr]
                p = c.prev
                if p is not None and not p.allocated:
                    c = p
                room, b = 0, c
                while room < rsize and b is not None and not b.allocated:
                    room += b.size
                    b = b.next
                if room >= rsize:
                    return c
        page = K_SMALL_BUFFER if pool.small else self._large_segment
        va = -(-self._va_bytes // page) * page
        seg = _Segment(self._new_va(va, page), page, va)
        block = Block(seg.base, va, stream, pool.small, seg, False)
        self._insert_unmapped(pool, block)
        self.num_segments_live += 1
        return block

    def _map_block(self, pool: Pool, block: Block, size: int) -> None:
        seg = block.seg
        assert seg is not None and not block.mapped
        page = seg.page
        mapped = -(-size // page) * page
        self._remove_unmapped(pool, block)
        block.mapped = True
        if mapped < block.size:
            rest = Block(block.addr + mapped, block.size - mapped, block.stream, block.small, seg, False)
            nxt = block.next
            rest.prev, rest.next = block, nxt
            if nxt is not None:
                nxt.prev = rest
            block.next = rest
            block.size = mapped
            self._insert_unmapped(pool, rest)
        prev = block.prev
        if prev is not None and not prev.allocated and prev.mapped:
            self._remove_free(pool, prev)
            block.addr = prev.addr
            block.size += prev.size
            block.prev = prev.prev
            if block.prev is not None:
                block.prev.next = block
        nxt = block.next
        if nxt is not None and not nxt.allocated and nxt.mapped:
            self._remove_free(pool, nxt)
            block.size += nxt.size
            block.next = nxt.next
            if block.next is not None:
                block.next.prev = block
        self._insert_free(pool, block)
        self._grow_reserved(mapped)

    def _try_allocate_expandable_block(self, pool: Pool, rsize: int, stream: int) -> Block:
        cand = self._find_expandable_block(pool, rsize, stream)
        if not cand.mapped:
            self._map_block(pool, cand, min(cand.size, rsize))
        while cand.size < rsize:
            nxt = cand.next  # invariant: free -> unmapped
            assert nxt is not None and not nxt.mapped
            self._map_block(pool, nxt, min(rsize - cand.size, nxt.size))
            cand = nxt  # map_block merged the free block before it into nxt
        self._remove_free(pool, cand)
        return cand

    def _unmap_block(self, pool: Pool, block: Block) -> None:
        seg = block.seg
        assert seg is not None
        page = seg.page
        off = block.addr - seg.base
        start = -(-off // page) * page
        end = (off + block.size) // page * page
        if start >= end:
            return
        self._remove_free(pool, block)
        before = start - off
        if before > 0:
            head = Block(block.addr, before, block.stream, block.small, seg, True)
            head.prev, head.next = block.prev, block
            if block.prev is not None:
                block.prev.next = head
            block.prev = head
            self._insert_free(pool, head)
        after = off + block.size - end
        if after > 0:
            tail = Block(seg.base + end, after, block.stream, block.small, seg, True)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            self._insert_free(pool, tail)
        block.addr = seg.base + start
        block.size = end - start
        block.mapped = False
        prev = block.prev
        if prev is not None and not prev.mapped:
            self._remove_unmapped(pool, prev)
            block.addr = prev.addr
            block.size += prev.size
            block.prev = prev.prev
            if block.prev is not None:
                block.prev.next = block
        nxt = block.next
        if nxt is not None and not nxt.mapped:
            self._remove_unmapped(pool, nxt)
            block.size += nxt.size
            block.next = nxt.next
            if block.next is not None:
                block.next.prev = block
        self._insert_unmapped(pool, block)
        self.reserved_bytes -= end - start
        self.num_device_frees += 1

    # -- giving memory back --------------------------------------------------------------------
    def _release_block(self, pool: Pool, block: Block) -> None:
        """cudaFree a whole, free, non-expandable segment."""
        self._remove_free(pool, block)
        self.reserved_bytes -= block.size
        self.num_device_frees += 1
        self.num_segments_live -= 1

    def _release_blocks(self, pool: Pool) -> None:
        to_unmap: list[Block] = []
        for stream in sorted(pool.free):
            for key in list(pool.free[stream]):
                block = self._free_by_addr[key & ADDR_MASK]
                if block.seg is not None:
                    to_unmap.append(block)
                elif block.prev is None and block.next is None:
                    self._release_block(pool, block)
        for block in to_unmap:
            self._unmap_block(pool, block)
            if block.prev is None and block.next is None and not block.mapped:
                self._remove_unmapped(pool, block)  # the whole segment is unmapped: release it
                self.num_segments_live -= 1

    def _release_cached_blocks(self) -> None:
        self._release_blocks(self._large)
        self._release_blocks(self._small)
