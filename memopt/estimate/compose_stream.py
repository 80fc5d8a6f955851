"""The full allocation event stream of a composed run, for the caching allocator simulator.

The layout (``memopt.estimate.compose``) is written out event by event with a fresh key per allocation of
every block position, every micro-batch and step: the simulator replays it for reserved bytes and the
attribution (``memopt.estimate.attribution``) traces each fresh key back to what it repeats. Slower than the
folded peak (``memopt.estimate.compose_peak``), so it runs for the candidates that matter.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator
from typing import Any

from memopt.estimate.compose import (
    Index,
    Instance,
    PassLayout,
    deferred_for,
    has_releases,
    released_for,
    trace_index,
)
from memopt.profile.optimizer_trace import OptimizerTrace
from memopt.profile.tracker import ALLOC, FREE
from memopt.profile.variant_trace import VariantKey, VariantTrace

__all__ = ["event_stream"]


def _interleaved(count: int, pending: list) -> Iterator[tuple[Any, int]]:
    """Positions of a segment's ``count`` own events, with the frees it makes on behalf of other blocks
    (``pending``, each placed by its first field: the position it precedes): (release, -1) or (None, pos)."""
    j = 0
    for pos in range(count + 1):
        while j < len(pending) and pending[j][0] <= pos:
            yield pending[j], -1
            j += 1
        if pos < count:
            yield None, pos


def _sizes(trace: VariantTrace, segment: int, b: int) -> list[int]:
    """Requested bytes of every event of a segment at micro-batch ``b`` (cached on the trace)."""
    cache = trace.__dict__.setdefault("_sizes", {})
    key = (segment, b)
    out = cache.get(key)
    if out is None:
        out = cache[key] = [trace.size(lo, hi, b) for _, _, lo, hi in trace.segments[segment].events]
    return out


def event_stream(traces: dict[VariantKey, VariantTrace], layout: PassLayout, b: int, m: int,
                 optimizer: OptimizerTrace, static_events: list[tuple[int, int, int]],
                 num_steps: int = 3, origins: dict[int, tuple[Instance | None, int]] | None = None,
                 passes: list[tuple[int, int]] | None = None) -> tuple[list[tuple[int, int, int]], int]:
    """The full run's allocation events ``(kind, key, bytes)`` and the index where the steps begin.

    ``origins`` (attribution, ``memopt.estimate.attribution``): filled with each fresh key's source, the
    segment instance and the traced key it repeats (instance None: the optimizer step's). ``passes``: filled
    with the ``[begin, end)`` range of every micro-batch after the first of a step, which make the same requests
    (its gradients are added into those of the first), for ``simulate_allocator(passes=...)``."""
    out: list[tuple[int, int, int]] = list(static_events)
    start = len(out)
    next_key = [10**12]
    grads_live: list[tuple[int, int]] = []
    deferred_cache: dict[Instance, list | None] = {}
    alive: set[int] = set()  # fresh keys allocated and not yet freed, over the whole run
    for step in range(num_steps):
        for mb in range(m):
            acc = mb > 0
            live: dict[tuple, int] = {}  # (block position or None, traced key) -> fresh key
            slots: dict[tuple, int] = {}  # (block position, role, allocation index) -> fresh key
            transient: dict[int, int] = {}  # this micro-batch's non-gradient allocations: fresh key -> bytes

            def emit_alloc(scope: tuple | None, key: int, size: int, slot: tuple | None, is_grad: bool) -> None:
                next_key[0] += 1
                k = next_key[0]
                alive.add(k)
                if not is_grad:
                    transient[k] = size
                live[(scope, key)] = k
                if origins is not None:
                    origins[k] = (inst, key)
                if slot is not None:
                    slots[slot] = k
                out.append((ALLOC, k, size))
                if is_grad:
                    if acc:
                        alive.discard(k)
                        out.append((FREE, k, size))
                    else:
                        grads_live.append((k, size))

            def emit_free(k: int | None, size: int) -> None:
                if k is not None and k in alive:
                    alive.discard(k)
                    out.append((FREE, k, size))

            n_forward = len(layout.forward)
            mb_start = len(out)
            # (position in ``out`` where a block's backward ends, the keys it allocated)
            block_backwards: list[tuple[int, range]] = []
            for i_inst, inst in enumerate([*layout.forward, *layout.backward]):
                in_block_backward = inst.block is not None and i_inst >= n_forward
                made_before = next_key[0]
                trace = traces[inst.variant]
                idx = trace_index(trace)
                events = trace.segments[inst.segment].events
                sizes: list[int] | None = None
                role = None
                if inst.block is None:  # code outside the blocks: frees on behalf of every block it stands for
                    if inst not in deferred_cache:
                        deferred_cache[inst] = deferred_for(traces, layout, inst)
                    pending, own = deferred_cache[inst], idx.core[inst.segment]
                else:
                    role = idx.unit_of[inst.segment][2]
                    if inst not in deferred_cache:  # None: the block makes no release frees
                        deferred_cache[inst] = (released_for(traces, layout, inst)
                                                if has_releases(traces, layout, inst) else None)
                    released = deferred_cache[inst]
                    if released is not None:
                        pending, own = released, idx.unit_core.get(inst.segment, events)
                    else:
                        pending, own = [], events
                    sizes = _sizes(trace, inst.segment, b) if own is events else None
                n = 0
                for release, pos in _interleaved(len(own), pending):
                    if release is not None:
                        _, s, q, rrole, ai, lo, hi, mode, _key = release
                        emit_free(slots.pop(((s, q), rrole, ai), None), traces[mode].size(lo, hi, b))
                        continue
                    kind, key, lo, hi = own[pos]
                    if key in trace.persistent_keys:
                        continue
                    size = sizes[pos] if sizes is not None else trace.size(lo, hi, b)
                    if kind == ALLOC:
                        tag = (inst.block, role, n) if inst.block is not None else None
                        emit_alloc(inst.block, key, size, tag, key in trace.grad_keys)
                        n += 1
                    else:
                        emit_free(_resolve(inst, key, idx, live, slots, alive), size)
                if in_block_backward:
                    block_backwards.append((len(out), range(made_before + 1, next_key[0] + 1)))
            _free_leftovers(out, mb_start, block_backwards, transient, alive)
            if passes is not None and acc:
                passes.append((mb_start, len(out)))
        remap: dict[int, int] = {}
        for kind, key, size in optimizer.first if step == 0 else optimizer.steady:
            if kind == ALLOC:
                next_key[0] += 1
                remap[key] = next_key[0]
                out.append((ALLOC, remap[key], size))
                if origins is not None:
                    origins[remap[key]] = (None, key)
            elif key in remap:
                out.append((FREE, remap.pop(key), size))
        for k, size in grads_live:
            if k in alive:
                alive.discard(k)
                out.append((FREE, k, size))
        grads_live = []
    return out, start


def _free_leftovers(out: list[tuple[int, int, int]], mb_start: int, block_backwards: list[tuple[int, range]],
                    transient: dict[int, int], alive: set[int]) -> None:
    """Free what a micro-batch's events left alive besides gradients (activations cannot outlive their
    micro-batch's backward). A block's backward hands the gradient of its input to the block before it, which
    frees it; for a repeated block that free was not mapped to the instance (found on gpt2_medium, every block
    checkpointed with the chunked loss, and on tiny Llama models so set: each middle block's 64 MiB input gradient
    stayed in the replay for the whole run, 1.25 GiB a step, +19% reserved on the H200). Such a leftover is freed
    where the next block's backward ends; any other at the micro-batch's end."""
    left = [k for k in transient if k in alive]
    if not left:
        return
    inserts: dict[int, list[int]] = {}
    starts = [keys.start for _, keys in block_backwards]
    for k in left:
        i = bisect_right(starts, k) - 1  # the block backward that allocated k, if any
        owned = i >= 0 and k in block_backwards[i][1]
        pos = block_backwards[i + 1][0] if owned and i + 1 < len(block_backwards) else len(out)
        inserts.setdefault(pos, []).append(k)
        alive.discard(k)
    tail = out[mb_start:]
    del out[mb_start:]
    for j, ev in enumerate(tail, start=mb_start):
        for k in inserts.pop(j, ()):
            out.append((FREE, k, transient[k]))
        out.append(ev)
    for pos in sorted(inserts):  # at or after the last event
        for k in inserts[pos]:
            out.append((FREE, k, transient[k]))


def _resolve(inst: Instance, key: int, idx: Index, live: dict[tuple, int], slots: dict[tuple, int],
             alive: set[int]) -> int | None:
    """The fresh key a traced free refers to (None when nothing still allocated matches)."""
    for scope in (inst.block, None):
        k = live.pop((scope, key), None)
        if k is not None and k in alive:
            return k
    src = idx.origin.get(key)
    unit = idx.unit_of.get(src[0]) if src is not None else None
    if unit is not None and inst.block is not None and inst.unit is not None:
        stack, src_unit, role = unit
        k = slots.pop(((stack, inst.block[1] + src_unit - inst.unit), role, src[1]), None)
        if k is not None and k in alive:
            return k
    for (scope, k0), k in reversed(list(live.items())):
        if k0 == key and k in alive:
            del live[(scope, k0)]
            return k
    return None
