"""A simulator of PyTorch's CUDA caching allocator: from allocation/free events to reserved memory.

``torch.cuda.max_memory_reserved()`` is what decides whether a training step fits on a GPU, and it is
not the peak of live tensor bytes: the caching allocator rounds every request, carves small requests
out of 2 MiB segments and medium ones out of 20 MiB segments, caches freed blocks per stream, and only
gives memory back to the driver under pressure. This module replays an event stream through a Python
model of ``c10/cuda/CUDACachingAllocator.cpp`` (``DeviceCachingAllocator``) to predict
``max_memory_allocated`` and ``max_memory_reserved``.

The model is built in three modules, each importing only the ones before it: ``allocator_config``
(``PYTORCH_CUDA_ALLOC_CONF``, request rounding, segment sizes), ``allocator_pools`` (blocks, pools,
segments, expandable pages, releasing memory) and ``allocator_sim`` (``CachingAllocatorSim``: best fit,
splitting, merging, the cap).

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

* CUDA-graph private pools, ``MemPool``, IPC, ``release_lock_on_cudamalloc`` and the registered
  free-memory callbacks are not modelled;
* tensors the tracer never sees (cuBLAS workspaces, NCCL buffers, ...) are not in the event stream;
* events must be 3- or 4-tuples whose 4th field is a stream: ``TrackedRun.events`` (5-tuples whose 4th
  field is a phase) must be cut to ``(kind, key, size)`` first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from memopt.estimate.allocator_config import NO_LIMIT, AllocatorConfig
from memopt.estimate.allocator_sim import AllocatorOOMError, CachingAllocatorSim

__all__ = [
    "AllocatorResult",
    "simulate_allocator",
]


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


def simulate_allocator(
    events: Iterable[tuple[int, int, int]] | Iterable[tuple[int, int, int, int]],
    *,
    config: AllocatorConfig | None = None,
    cap_bytes: int | None = None,
    initial_events: Iterable[Sequence[int]] | None = None,
    device_total_bytes: int | None = None,
    stop_above: int | None = None,
    passes: Sequence[tuple[int, int]] | None = None,
) -> AllocatorResult:
    """Replay ``events`` through a fresh caching allocator and report its peaks.

    Events are ``(kind, key, size_bytes)`` or ``(kind, key, size_bytes, stream)`` with kind +1 (alloc)
    or -1 (free, of the earlier alloc with the same key; its size is ignored). Sizes are raw requested
    bytes. ``initial_events`` are replayed first (e.g. the weights and optimizer state alive before the
    step); the peaks are then reset, as ``torch.cuda.reset_peak_memory_stats()`` would, before ``events``.
    Replay stops at the first allocation that cannot be served under ``cap_bytes``, and (``stopped_at``) at the
    first event after which the reserved peak exceeds ``stop_above``: the caller only needs to know that the
    full replay's peak would be higher (peaks never decrease).

    ``passes``: ranges ``[begin, end)`` of ``events`` that may repeat one another (the micro-batches after the
    first of a step). Where a pass makes the same requests in the same order as the one ending where it begins
    (keys aside) and that one left the allocator as it found it, the rest of the run of such passes is skipped:
    from the same state the same requests make the same decisions, so no peak, count or block could change.
    """
    sim = CachingAllocatorSim(config, cap_bytes=cap_bytes, device_total_bytes=device_total_bytes)
    if initial_events is not None:
        try:
            _replay(sim, initial_events)
        except _ReplayOOM:
            return _result(sim, oom_index=-1, allocs0=0, frees0=0, peak_index=None)
        sim.reset_peak_stats()
    allocs0, frees0 = sim.num_device_allocs, sim.num_device_frees
    limit = NO_LIMIT if stop_above is None else stop_above
    if sim.peak_reserved_bytes > limit:
        return replace(_result(sim, oom_index=None, allocs0=allocs0, frees0=frees0, peak_index=None),
                                   stopped_at=-1)
    repeats = _repeat_marks(events, passes) if passes and not sim.gc_enabled else None
    try:
        peak_index = _replay(sim, events, limit, repeats)
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


def _replay(sim: CachingAllocatorSim, events: Iterable[Sequence[int]], stop_above: int = NO_LIMIT,
            repeats: dict[int, tuple[int, int]] | None = None) -> int | None:
    """Feed events to ``sim``; returns the index of the event that set the reserved peak (raises
    ``_ReplayStopped`` once that peak exceeds ``stop_above``). ``repeats``: :func:`_repeat_marks`."""
    if not repeats:
        return _replay_range(sim, events, 0, stop_above, None)
    events = events if isinstance(events, Sequence) else list(events)
    peak_index: int | None = None
    seen: dict[int, tuple] = {}  # run -> the allocator's state where its latest pass began
    pos = 0
    for mark in sorted(repeats):
        if mark < pos:
            continue
        peak_index = _replay_range(sim, events[pos:mark], pos, stop_above, peak_index)
        pos = mark
        run, run_end = repeats[mark]
        state = sim.state_key()
        if seen.get(run) == state:  # the previous pass changed nothing: so would every repeat of it
            pos = run_end
            seen.pop(run)
        else:
            seen[run] = state
    return _replay_range(sim, events[pos:], pos, stop_above, peak_index)


def _repeat_marks(events: Sequence[Sequence[int]], passes: Sequence[tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """The begin of every pass in a run of back-to-back passes that make the same requests (keys aside, each
    freeing everything it allocates) -> (the run's number, where the run ends)."""
    marks: dict[int, tuple[int, int]] = {}
    run: list[tuple[int, int]] = []
    shape: list[int] | None = None

    def close() -> None:
        if len(run) > 1:
            for b, _ in run:
                marks[b] = (run[0][0], run[-1][1])

    for b, e in sorted(passes):
        this = _shape(events, b, e)
        if this is not None and run and run[-1][1] == b and this == shape:
            run.append((b, e))
            continue
        close()
        run, shape = ([(b, e)], this) if this is not None else ([], None)
    close()
    return marks


def _shape(events: Sequence[Sequence[int]], begin: int, end: int) -> list[int] | None:
    """A pass's requests with its keys replaced by their order of allocation; None when it frees what it did not
    allocate or leaves something allocated (then its repeats would not start from the same state)."""
    rank: dict[int, int] = {}
    out: list[int] = []
    freed = 0
    for ev in events[begin:end]:
        kind, key, size = ev[0], ev[1], ev[2]
        if kind > 0:
            if key in rank:
                return None
            rank[key] = len(rank)
            out += (size, ev[3] if len(ev) > 3 else 0)
        else:
            r = rank.get(key)
            if r is None:
                return None
            out.append(-1 - r)
            freed += 1
    return out if freed == len(rank) else None


def _replay_range(sim: CachingAllocatorSim, events: Iterable[Sequence[int]], offset: int, stop_above: int,
                  peak_index: int | None) -> int | None:
    """:func:`_replay` over ``events``, whose first is event ``offset`` of the whole replay."""
    malloc, free = sim.malloc, sim.free
    for i, ev in enumerate(events, offset):
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
