"""A simulator of PyTorch's CUDA caching allocator: from allocation/free events to reserved memory.

``torch.cuda.max_memory_reserved()`` is what decides whether a training step fits on a GPU, and it is
not the peak of live tensor bytes: the caching allocator rounds every request, carves small requests
out of 2 MiB segments and medium ones out of 20 MiB segments, caches freed blocks per stream, and only
gives memory back to the driver under pressure. This module replays an event stream through a Python
model of ``c10/cuda/CUDACachingAllocator.cpp`` (``DeviceCachingAllocator``) to predict
``max_memory_allocated`` and ``max_memory_reserved``.

Rules modelled (each mirrors the C++ function named in brackets):

* request rounding: < 512 B -> 512 B, else a multiple of 512 B, or the next power-of-two division
  when ``roundup_power2_divisions`` is set [``round_size``, ``roundup_power2_next_division``];
* pools: requests <= 1 MiB go to the small pool, larger ones to the large pool [``get_pool``];
* segment sizes: 2 MiB for the small pool, 20 MiB for large requests < 10 MiB, else the request
  rounded up to 2 MiB [``get_allocation_size``];
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
  frees old unsplit large segments first [``garbage_collect_cached_blocks``];
* expandable segments: one virtual segment per (pool, stream) mapped in pages of 2 MiB (small pool)
  or 20 MiB (large pool, ``large_segment_size_mb``); best fit counts the unmapped tail as room
  [``get_free_block``]; new pages go at the lowest address with enough free + unmapped room
  [``find_expandable_block``, ``try_allocate_expandable_block``, ``map_block``]; every block is split
  down to 512 B; only whole free pages are unmapped, and only by ``empty_cache`` or when an allocation
  would exceed the cap [``release_blocks``, ``unmap_block``].

Validation: ``scripts/allocator_replay_gpu.py`` replayed 12 traces (hand-computed cases, a transformer
step, small tensors, a fragmentation-heavy random trace, two streams, two capped runs) under 6
configurations on an H200 with torch 2.11.0+cu130: peak allocated, peak reserved and the OOM point
matched in all 72 runs; given the GPU's own segment addresses, every block address matched too.

Example::

    >>> from memopt.estimate.allocator import simulate_allocator
    >>> MiB = 1 << 20
    >>> r = simulate_allocator([(1, 0, 12 * MiB), (-1, 0, 12 * MiB), (1, 1, 6 * MiB)])
    >>> r.peak_reserved_bytes // MiB, r.num_segments
    (12, 1)

Known limitations:

* no cross-stream lifetime: ``record_stream`` and the CUDA events that delay a free are not modelled,
  a free takes effect at once; streams are plain integers ordered by value (the real order is that of
  the ``cudaStream_t`` handles, the default stream first);
* addresses are synthetic (see ``CachingAllocatorSim._segment_address``): large segments get
  decreasing addresses, small ones increasing, and freed ranges are never reused; the CUDA driver's
  placement has exceptions, so a tie between equal-size free blocks may be broken differently than on
  the GPU, after which the two histories can drift apart (in H200 replays the peaks still matched);
* the cap is the only source of OOM (``cap_bytes`` plays ``allowed_memory_maximum``); the driver's own
  limit, the CUDA context and memory taken by other processes or by non-PyTorch libraries are not
  modelled; with no cap, allocation never fails (and the garbage collector, which PyTorch only runs
  under a memory fraction, never runs);
* CUDA-graph private pools, ``MemPool``, IPC, ``release_lock_on_cudamalloc`` and the registered
  free-memory callbacks are not modelled;
* ``release_available_cached_blocks`` only releases unsplit blocks (the C++ code would ``cudaFree`` a
  split oversize block in a corner case that needs ``max_split_size`` just above a segment size);
* tensors the tracer never sees (cuBLAS workspaces, NCCL buffers, ...) are not in the event stream;
* events must be 3- or 4-tuples whose 4th field is a stream: ``TrackedRun.events`` (5-tuples whose 4th
  field is a phase) must be cut to ``(kind, key, size)`` first;
* the configuration is fixed for the life of a simulator (PyTorch lets ``expandable_segments`` be
  switched at run time); the virtual size of an expandable segment (1.125 x ``device_total_bytes``,
  default 141 GiB) only matters once a stream has used that much address space.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

__all__ = [
    "AllocatorConfig",
    "AllocatorOOMError",
    "AllocatorResult",
    "CachingAllocatorSim",
    "EventStreamError",
    "get_allocation_size",
    "round_size",
    "simulate_allocator",
]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

K_MIN_BLOCK_SIZE = 512  # every request is rounded to a multiple of this
K_SMALL_SIZE = 1 * MiB  # largest request served by the small pool
K_SMALL_BUFFER = 2 * MiB  # small-pool segment (and expandable page) size
K_LARGE_BUFFER = 20 * MiB  # segment for large requests < K_MIN_LARGE_ALLOC; large expandable page size
K_MIN_LARGE_ALLOC = 10 * MiB  # requests from here on get their own segment
K_ROUND_LARGE = 2 * MiB  # such segments are rounded up to this

_NO_LIMIT = (1 << 64) - 1  # SIZE_MAX, the "unset" value of max_split_size
_SHIFT = 64  # free-list keys are (size << 64) | address
_ADDR_MASK = (1 << _SHIFT) - 1
_N_DIVISION_INTERVALS = 16  # roundup_power2_divisions intervals: [1 MiB, 2 MiB), ..., [32 GiB, inf)
_DEFAULT_DEVICE_TOTAL = 141 * GiB  # only sizes the virtual range of an expandable segment


@dataclass(frozen=True)
class AllocatorConfig:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` knobs the simulator honours.

    ``roundup_power2_divisions`` is one number of divisions for all sizes, or 16 numbers, one per
    power-of-two interval starting at [1 MiB, 2 MiB) (sizes below 1 MiB use the first, sizes from
    32 GiB on the last), as the bracketed form ``roundup_power2_divisions:[...]`` sets them.
    ``max_non_split_rounding_bytes`` (``max_non_split_rounding_mb``) and ``large_segment_size_bytes``
    (``large_segment_size_mb``, newer PyTorch only) keep their PyTorch defaults unless set.
    """

    expandable_segments: bool = False
    max_split_size_bytes: int | None = None
    garbage_collection_threshold: float | None = None
    roundup_power2_divisions: int | tuple[int, ...] | None = None
    max_non_split_rounding_bytes: int = K_LARGE_BUFFER
    large_segment_size_bytes: int = K_LARGE_BUFFER

    def __post_init__(self) -> None:
        if self.max_split_size_bytes is not None and self.max_split_size_bytes < K_LARGE_BUFFER:
            raise ValueError("max_split_size_bytes must be >= 20 MiB (PyTorch rejects smaller values)")
        if self.garbage_collection_threshold is not None and not 0.0 < self.garbage_collection_threshold < 1.0:
            raise ValueError("garbage_collection_threshold must be in (0, 1)")
        if self.max_non_split_rounding_bytes < K_LARGE_BUFFER:
            raise ValueError("max_non_split_rounding_bytes must be >= 20 MiB")
        if self.large_segment_size_bytes <= 0 or self.large_segment_size_bytes % K_ROUND_LARGE:
            raise ValueError("large_segment_size_bytes must be a positive multiple of 2 MiB")
        divs = self.roundup_power2_divisions
        if divs is not None:
            values = (divs,) if isinstance(divs, int) else tuple(divs)
            if not isinstance(divs, int) and len(values) != _N_DIVISION_INTERVALS:
                raise ValueError(f"roundup_power2_divisions needs 1 or {_N_DIVISION_INTERVALS} values")
            for v in values:
                if v < 0 or (v > 0 and v & (v - 1)):
                    raise ValueError("roundup_power2_divisions values must be 0 or powers of two")

    def division_table(self) -> tuple[int, ...] | None:
        """The 16 per-interval divisions, or None when rounding to powers of two is off."""
        divs = self.roundup_power2_divisions
        if divs is None:
            return None
        table = (divs,) * _N_DIVISION_INTERVALS if isinstance(divs, int) else tuple(divs)
        return table if any(d > 1 for d in table) else None

    def to_alloc_conf(self) -> str:
        """The ``PYTORCH_CUDA_ALLOC_CONF`` string with these settings ('' for the defaults)."""
        parts: list[str] = []
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.max_split_size_bytes is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size_bytes // MiB}")
        if self.garbage_collection_threshold is not None:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold}")
        divs = self.roundup_power2_divisions
        if isinstance(divs, int):
            parts.append(f"roundup_power2_divisions:{divs}")
        elif divs is not None:
            items = [f"{1 << i}:{d}" for i, d in enumerate(divs[:-1])] + [f">:{divs[-1]}"]
            parts.append("roundup_power2_divisions:[" + ",".join(items) + "]")
        if self.max_non_split_rounding_bytes != K_LARGE_BUFFER:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding_bytes // MiB}")
        if self.large_segment_size_bytes != K_LARGE_BUFFER:
            parts.append(f"large_segment_size_mb:{self.large_segment_size_bytes // MiB}")
        return ",".join(parts)

    @classmethod
    def from_alloc_conf(cls, conf: str) -> AllocatorConfig:
        """Parse the subset of ``PYTORCH_CUDA_ALLOC_CONF`` that matters here (other keys are ignored)."""
        kwargs: dict[str, object] = {}
        for key, value in _split_conf(conf):
            if key == "expandable_segments":
                kwargs["expandable_segments"] = value == "True"
            elif key == "max_split_size_mb":
                kwargs["max_split_size_bytes"] = int(value) * MiB
            elif key == "garbage_collection_threshold":
                kwargs["garbage_collection_threshold"] = float(value)
            elif key == "max_non_split_rounding_mb":
                kwargs["max_non_split_rounding_bytes"] = int(value) * MiB
            elif key == "large_segment_size_mb":
                kwargs["large_segment_size_bytes"] = int(value) * MiB
            elif key == "roundup_power2_divisions":
                kwargs["roundup_power2_divisions"] = _parse_divisions(value)
        return cls(**kwargs)  # type: ignore[arg-type]


def _split_conf(conf: str) -> list[tuple[str, str]]:
    """'a:1,b:[x:1,>:2]' -> [('a', '1'), ('b', '[x:1,>:2]')]."""
    out: list[tuple[str, str]] = []
    depth, start = 0, 0
    conf = conf.replace(" ", "")
    for i, ch in enumerate(conf + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            item = conf[start:i]
            start = i + 1
            if item:
                key, _, value = item.partition(":")
                out.append((key, value))
    return out


def _parse_divisions(value: str) -> int | tuple[int, ...]:
    if not value.startswith("["):
        return int(value)
    table = [0] * _N_DIVISION_INTERVALS
    first, last_index = True, 0
    for item in value.strip("[]").split(","):
        bound, _, div = item.partition(":")
        d = int(div)
        if bound == ">":
            for i in range(last_index, _N_DIVISION_INTERVALS):
                table[i] = d
            continue
        # PyTorch indexes the interval by log2 of the bound (given in MiB)
        index = min(max(int(bound).bit_length() - 1, 0), _N_DIVISION_INTERVALS - 1)
        if first:
            for i in range(index):
                table[i] = d
            first = False
        table[index] = d
        last_index = index
    return tuple(table)


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    if size & (size - 1) == 0:
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    step = power2_floor >> (divisions.bit_length() - 1)
    if step == 0:
        return power2_floor << 1
    floor = size & ~(step - 1)
    return size if floor == size else floor + step


def round_size(size: int, config: AllocatorConfig | None = None) -> int:
    """Bytes the allocator reserves for a block answering a request of ``size`` bytes."""
    return _round_size(size, config.division_table() if config is not None else None)


def _round_size(size: int, table: tuple[int, ...] | None) -> int:
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    if table is not None:
        divisions = table[min(max(size.bit_length() - 21, 0), _N_DIVISION_INTERVALS - 1)]
        if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
            return _roundup_power2_next_division(size, divisions)
    return (size + K_MIN_BLOCK_SIZE - 1) & ~(K_MIN_BLOCK_SIZE - 1)


def get_allocation_size(rounded: int, config: AllocatorConfig | None = None) -> int:
    """Size of the segment cudaMalloc'ed for a (rounded) request that found no cached block."""
    if rounded <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if rounded < K_MIN_LARGE_ALLOC:
        return config.large_segment_size_bytes if config is not None else K_LARGE_BUFFER
    return (rounded + K_ROUND_LARGE - 1) // K_ROUND_LARGE * K_ROUND_LARGE


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


class _Segment:
    """A virtual address range of an expandable segment, mapped in ``page``-sized pages."""

    __slots__ = ("base", "page", "size")

    def __init__(self, base: int, page: int, size: int) -> None:
        self.base, self.page, self.size = base, page, size


class _Block:
    __slots__ = ("addr", "allocated", "gc_base", "mapped", "next", "prev", "seg", "size", "small", "stream")

    def __init__(self, addr: int, size: int, stream: int, small: bool, seg: _Segment | None, mapped: bool) -> None:
        self.addr = addr
        self.size = size
        self.stream = stream
        self.small = small
        self.allocated = False
        self.mapped = mapped
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.seg = seg
        self.gc_base = 0


class _Pool:
    """Free blocks of one pool: per stream, a sorted list of (size << 64 | addr) keys."""

    __slots__ = ("free", "gc_calls", "small", "unmapped")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.free: dict[int, list[int]] = {}
        self.unmapped: dict[int, list[int]] = {}  # stream -> sorted addresses of unmapped blocks
        self.gc_calls = 0  # get_free_blocks_call_count


@dataclass(frozen=True)
class AllocatorResult:
    """What ``torch.cuda.memory_stats()`` would report after replaying an event stream."""

    peak_allocated_bytes: int  # as max_memory_allocated (sum of block sizes, i.e. rounded requests)
    peak_reserved_bytes: int  # as max_memory_reserved
    final_reserved_bytes: int
    num_segments: int  # cudaMalloc calls (or page-range maps with expandable segments) during `events`
    oom: bool  # an allocation could not be served under cap_bytes
    oom_event_index: int | None  # index in `events` of the failing alloc; -1 if it was in `initial_events`
    final_allocated_bytes: int = 0
    num_device_frees: int = 0  # cudaFree / unmap calls during `events`
    peak_event_index: int | None = field(default=None)  # event at which peak_reserved_bytes was reached
    stopped_at: int | None = None  # index in `events` where reserved bytes passed `stop_above` (replay ended)
    num_alloc_retries: int = 0  # as memory_stats()["num_alloc_retries"]: cache flushes to stay under the cap


class CachingAllocatorSim:
    """Incremental model of one device's ``DeviceCachingAllocator``.

    ``malloc(key, size, stream)`` / ``free(key)`` / ``empty_cache()``; ``cap_bytes`` is the memory
    fraction's ``allowed_memory_maximum`` (None: no cap). ``malloc`` raises ``AllocatorOOMError`` when
    the request cannot be served; the state is then as PyTorch leaves it after its OOM (caches flushed).
    """

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
        self._max_split = cfg.max_split_size_bytes if cfg.max_split_size_bytes is not None else _NO_LIMIT
        self._non_split_rounding = cfg.max_non_split_rounding_bytes
        self._large_segment = cfg.large_segment_size_bytes
        self._gc_on = cap_bytes is not None and (cfg.garbage_collection_threshold or 0.0) > 0.0
        total = device_total_bytes if device_total_bytes is not None else max(_DEFAULT_DEVICE_TOTAL, cap_bytes or 0)
        self._va_bytes = total + total // 8  # the address space each expandable segment reserves
        self._small = _Pool(True)
        self._large = _Pool(False)
        self._free_by_addr: dict[int, _Block] = {}  # free, mapped blocks
        self._unmapped_by_addr: dict[int, _Block] = {}
        self._live: dict[int, _Block | None] = {}  # key -> allocated block (None for 0-byte requests)
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

    # -- public API ----------------------------------------------------------------------------
    @property
    def num_live_allocations(self) -> int:
        return len(self._live)

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
            rsize = _round_size(size, self._divisions)
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
            i = bisect_left(keys, rsize << _SHIFT)
            if i < len(keys):
                if self._expandable:
                    i = self._expandable_best_fit(keys, i)
                bkey = keys[i]
                bsize = bkey >> _SHIFT
                # oversize blocks go only to requests >= max_split_size, and only if not much larger
                if not (
                    (rsize < max_split and bsize >= max_split)
                    or (rsize >= max_split and bsize >= rsize + self._non_split_rounding)
                ):
                    del keys[i]
                    block = free_by_addr.pop(bkey & _ADDR_MASK)
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
            rest = _Block(block.addr + rsize, remaining, stream, small, block.seg, True)
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
            insort(keys, (remaining << _SHIFT) | rest.addr)
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
            del keys[bisect_left(keys, (prev.size << _SHIFT) | prev.addr)]
            del free_by_addr[prev.addr]
            block.addr = prev.addr
            block.size += prev.size
            prev = block.prev = prev.prev
            if prev is not None:
                prev.next = block
        nxt = block.next
        if nxt is not None and not nxt.allocated and nxt.mapped:
            del keys[bisect_left(keys, (nxt.size << _SHIFT) | nxt.addr)]
            del free_by_addr[nxt.addr]
            block.size += nxt.size
            nxt = block.next = nxt.next
            if nxt is not None:
                nxt.prev = block
        block.gc_base = pool.gc_calls
        insort(keys, (block.size << _SHIFT) | block.addr)
        free_by_addr[block.addr] = block

    def _new_block(self, pool: _Pool, rsize: int, stream: int) -> _Block | None:
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

    def _expandable_best_fit(self, keys: list[int], i: int) -> int:
        """get_free_block under expandable segments: count the unmapped room behind a block as its size."""
        free_by_addr = self._free_by_addr
        block = free_by_addr[keys[i] & _ADDR_MASK]
        cur = _expandable_size(block)
        n = len(keys)
        while block.seg is not None and i + 1 < n:
            cand = free_by_addr[keys[i + 1] & _ADDR_MASK]
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
        heads: dict[int, _Block] = {}
        for b in list(self._free_by_addr.values()) + [b for b in self._live.values() if b is not None]:
            while b.prev is not None and b.prev.mapped:
                b = b.prev
            heads[b.addr] = b
        out: list[dict[str, object]] = []
        for addr in sorted(heads):
            b: _Block | None = heads[addr]
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
        blocks: dict[int, _Block] = {}
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
            b: _Block | None = head
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
                        k = (b.size << _SHIFT) | b.addr
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

    # -- free-list helpers ---------------------------------------------------------------------
    def _remove_free(self, pool: _Pool, block: _Block) -> None:
        keys = pool.free[block.stream]
        del keys[bisect_left(keys, (block.size << _SHIFT) | block.addr)]
        del self._free_by_addr[block.addr]

    def _insert_free(self, pool: _Pool, block: _Block) -> None:
        block.gc_base = pool.gc_calls
        keys = pool.free.get(block.stream)
        if keys is None:
            keys = pool.free[block.stream] = []
        insort(keys, (block.size << _SHIFT) | block.addr)
        self._free_by_addr[block.addr] = block

    def _insert_unmapped(self, pool: _Pool, block: _Block) -> None:
        addrs = pool.unmapped.get(block.stream)
        if addrs is None:
            addrs = pool.unmapped[block.stream] = []
        insort(addrs, block.addr)
        self._unmapped_by_addr[block.addr] = block

    def _remove_unmapped(self, pool: _Pool, block: _Block) -> None:
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
    def _alloc_block(self, pool: _Pool, rsize: int, alloc_size: int, stream: int) -> _Block | None:
        if self.cap_bytes is not None and self.reserved_bytes + alloc_size > self.cap_bytes:
            return None
        if self._expandable:
            return self._try_allocate_expandable_block(pool, rsize, stream)
        block = _Block(self._segment_address(alloc_size, pool.small), alloc_size, stream, pool.small, None, True)
        self.num_segments_live += 1
        self._grow_reserved(alloc_size)
        return block

    # -- expandable segments -------------------------------------------------------------------
    def _find_expandable_block(self, pool: _Pool, rsize: int, stream: int) -> _Block:
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
        block = _Block(seg.base, va, stream, pool.small, seg, False)
        self._insert_unmapped(pool, block)
        self.num_segments_live += 1
        return block

    def _map_block(self, pool: _Pool, block: _Block, size: int) -> None:
        seg = block.seg
        assert seg is not None and not block.mapped
        page = seg.page
        mapped = -(-size // page) * page
        self._remove_unmapped(pool, block)
        block.mapped = True
        if mapped < block.size:
            rest = _Block(block.addr + mapped, block.size - mapped, block.stream, block.small, seg, False)
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

    def _try_allocate_expandable_block(self, pool: _Pool, rsize: int, stream: int) -> _Block:
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

    def _unmap_block(self, pool: _Pool, block: _Block) -> None:
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
            head = _Block(block.addr, before, block.stream, block.small, seg, True)
            head.prev, head.next = block.prev, block
            if block.prev is not None:
                block.prev.next = head
            block.prev = head
            self._insert_free(pool, head)
        after = off + block.size - end
        if after > 0:
            tail = _Block(seg.base + end, after, block.stream, block.small, seg, True)
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
    def _release_block(self, pool: _Pool, block: _Block) -> None:
        """cudaFree a whole, free, non-expandable segment."""
        self._remove_free(pool, block)
        self.reserved_bytes -= block.size
        self.num_device_frees += 1
        self.num_segments_live -= 1

    def _release_blocks(self, pool: _Pool) -> None:
        to_unmap: list[_Block] = []
        for stream in sorted(pool.free):
            for key in list(pool.free[stream]):
                block = self._free_by_addr[key & _ADDR_MASK]
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

    def _release_available_cached_blocks(self, pool: _Pool, rsize: int, stream: int) -> bool:
        max_split = self._max_split
        if max_split == _NO_LIMIT:
            return False
        keys = pool.free.get(stream)
        if not keys:
            return False
        want = max(rsize, max_split)
        i = bisect_left(keys, want << _SHIFT)
        if i < len(keys):
            block = self._free_by_addr[keys[i] & _ADDR_MASK]
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
            if key >> _SHIFT < max_split:
                break
            block = self._free_by_addr[key & _ADDR_MASK]
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
            for b in (self._free_by_addr[k & _ADDR_MASK] for k in pool.free[stream])
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
            survivors: list[_Block] = []
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


def _expandable_size(block: _Block) -> int:
    nxt = block.next
    return block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)


def simulate_allocator(
    events: Iterable[tuple[int, int, int]] | Iterable[tuple[int, int, int, int]],
    *,
    config: AllocatorConfig | None = None,
    cap_bytes: int | None = None,
    initial_events: Iterable[Sequence[int]] | None = None,
    device_total_bytes: int | None = None,
    stop_above: int | None = None,
) -> AllocatorResult:
    """Replay ``events`` through a fresh caching allocator and report its peaks.

    Events are ``(kind, key, size_bytes)`` or ``(kind, key, size_bytes, stream)`` with kind +1 (alloc)
    or -1 (free, of the earlier alloc with the same key; its size is ignored). Sizes are raw requested
    bytes. ``initial_events`` are replayed first (e.g. the weights and optimizer state alive before the
    step); the peaks are then reset, as ``torch.cuda.reset_peak_memory_stats()`` would, before ``events``.
    Replay stops at the first allocation that cannot be served under ``cap_bytes``, and (``stopped_at``) at the
    first event after which the reserved peak exceeds ``stop_above``: the caller only needs to know that the
    full replay's peak would be higher (peaks never decrease).
    """
    sim = CachingAllocatorSim(config, cap_bytes=cap_bytes, device_total_bytes=device_total_bytes)
    if initial_events is not None:
        try:
            _replay(sim, initial_events)
        except _ReplayOOM:
            return _result(sim, oom_index=-1, allocs0=0, frees0=0, peak_index=None)
        sim.reset_peak_stats()
    allocs0, frees0 = sim.num_device_allocs, sim.num_device_frees
    limit = _NO_LIMIT if stop_above is None else stop_above
    if sim.peak_reserved_bytes > limit:
        return replace(_result(sim, oom_index=None, allocs0=allocs0, frees0=frees0, peak_index=None),
                                   stopped_at=-1)
    try:
        peak_index = _replay(sim, events, limit)
    except _ReplayOOM as exc:
        return _result(sim, oom_index=exc.index, allocs0=allocs0, frees0=frees0, peak_index=exc.peak_index)
    except _ReplayStopped as exc:
        return replace(_result(sim, oom_index=None, allocs0=allocs0, frees0=frees0,
                                           peak_index=exc.index), stopped_at=exc.index)
    return _result(sim, oom_index=None, allocs0=allocs0, frees0=frees0, peak_index=peak_index)


class _ReplayOOM(Exception):
    def __init__(self, index: int, peak_index: int | None) -> None:
        super().__init__(index)
        self.index, self.peak_index = index, peak_index


class _ReplayStopped(Exception):
    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.index = index


def _replay(sim: CachingAllocatorSim, events: Iterable[Sequence[int]], stop_above: int = _NO_LIMIT) -> int | None:
    """Feed events to ``sim``; returns the index of the event that set the reserved peak (raises
    ``_ReplayStopped`` once that peak exceeds ``stop_above``)."""
    malloc, free = sim.malloc, sim.free
    peak_index: int | None = None
    for i, ev in enumerate(events):
        n = len(ev)
        if n == 3:
            kind, key, size = ev
            stream = 0
        elif n == 4:
            kind, key, size, stream = ev
        else:
            raise ValueError(f"event {i}: expected (kind, key, size[, stream]), got {ev!r}")
        if kind > 0:
            before = sim.peak_reserved_bytes
            try:
                malloc(key, size, stream)
            except AllocatorOOMError:
                raise _ReplayOOM(i, peak_index) from None
            if sim.peak_reserved_bytes > before:
                peak_index = i
                if sim.peak_reserved_bytes > stop_above:
                    raise _ReplayStopped(i)
        elif kind < 0:
            free(key)
        else:
            raise ValueError(f"event {i}: kind must be +1 or -1, got {kind}")
    return peak_index


def _result(
    sim: CachingAllocatorSim, *, oom_index: int | None, allocs0: int, frees0: int, peak_index: int | None
) -> AllocatorResult:
    return AllocatorResult(
        peak_allocated_bytes=sim.peak_allocated_bytes,
        peak_reserved_bytes=sim.peak_reserved_bytes,
        final_reserved_bytes=sim.reserved_bytes,
        num_segments=sim.num_device_allocs - allocs0,
        oom=oom_index is not None,
        oom_event_index=oom_index,
        final_allocated_bytes=sim.allocated_bytes,
        num_device_frees=sim.num_device_frees - frees0,
        peak_event_index=peak_index,
        num_alloc_retries=sim.num_alloc_retries,
    )
