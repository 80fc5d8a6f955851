"""Composing a whole training step's memory from the profile's traces, in milliseconds.

A traced pass covers the model with every stack cut to four blocks. The full model's pass is the
traced one with each stack's middle block repeated (``N - 3`` times for ``N`` blocks); with partial
checkpointing each block position takes its unit from the trace of its own mode. A step is ``m``
micro-batch passes (the first allocates the gradients, later ones accumulate into them), the optimizer
step and ``zero_grad``; the run is two steps for the allocated peak (the first creates the optimizer
states) and three for the allocator replay.

Frees are attributed to the block that allocated the bytes. A free in a segment outside the blocks
(autocast's weight-cast cache emptied at the end of the forward pass frees every block's casts at
once) is *deferred*: it is replayed for every block position that the freeing unit stands for, with
that block's own mode. A free inside a block of a neighbour's tensor (block ``i`` frees block
``i - 1``'s output) is resolved by relative position. A free inside one of the first two blocks of
the same tensor of *every* later traced block is a *release* (the autograd graph destroyed as the
backward pass ends frees what custom functions keep as context attributes, such as the input an
LLM.int8 layer saves): it is replayed for every later block position, with that block's own mode.

Two products:

* ``allocated_peak`` folds per-segment summaries (net bytes, highest point, bytes by category) along
  the sequence: exact for the peak of allocated bytes and fast enough for thousands of candidates;
* ``event_stream`` writes the full allocation sequence with per-block keys, which the caching
  allocator simulator turns into reserved bytes (used for the candidates that matter).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from memopt.categories import MemoryCategory
from memopt.profile.optimizer_trace import OptimizerTrace
from memopt.profile.trace import VariantKey, VariantTrace, traced_unit
from memopt.profile.tracker import ALLOC, FREE
from memopt.units import allocator_size

__all__ = ["Instance", "PassLayout", "PeakResult", "allocated_peak", "event_stream", "pass_layout"]

Cat = MemoryCategory


@dataclass(frozen=True)
class Instance:
    """One segment of the full model's pass: which trace, which segment, which block position."""

    variant: VariantKey
    segment: int
    block: tuple[int, int] | None = None  # (stack, position in the full stack) for block units
    unit: int | None = None  # which traced block (0..3) stands for it


@dataclass
class PassLayout:
    forward: list[Instance]
    backward: list[Instance]
    block_modes: list[list[VariantKey]] = field(default_factory=list)
    full_counts: list[int] = field(default_factory=list)


# -- per-trace indexes (cached on the trace object) ----------------------------------------------
@dataclass
class _Index:
    unit_of: dict[int, tuple[int, int, str]]  # segment -> (stack, unit, role "f0"/"f1"/"b0"/"b1")
    origin: dict[int, tuple[int, int]]  # key -> (segment, allocation index within it)
    by_name: dict[str, int]
    core: dict[int, list[tuple[int, int, int, int]]]  # non-unit segment -> its own events
    # non-unit segment -> (pos, stack, unit, role, idx, lo, hi, every): "every" marks a free made for every block
    # (the middle unit's counterpart in the previous block is freed here too); otherwise it is the free of the
    # stack's last middle block only (its successor frees the others in its own segments)
    deferred: dict[int, list[tuple[int, int, int, str, int, int, int, bool, int]]]  # ... + the traced key
    categories: dict[int, MemoryCategory]
    # unit segment -> its release frees (position in its own events, stack, source unit, role, allocation index,
    # lo, hi, traced key) and its own events without them; only segments that make releases
    released: dict[int, list[tuple[int, int, int, str, int, int, int, int]]] = field(default_factory=dict)
    unit_core: dict[int, list[tuple[int, int, int, int]]] = field(default_factory=dict)


def _unit_names(stack: int, unit: int, last: int) -> tuple[list[str], list[str]]:
    """A block's segments: its forward (and the code before the next block), its backward (and the code
    before the previous block's). The code after a stack (``gap``) belongs to no block."""
    fwd = [f"fwd:s{stack}.b{unit}"] + ([f"fwd:s{stack}.b{unit}.x"] if unit < last else [])
    bwd = [f"bwd:s{stack}.b{unit}"] + ([f"bwd:s{stack}.b{unit - 1}.x"] if unit > 0 else [])
    return fwd, bwd


def trace_index(trace: VariantTrace) -> _Index:
    cached = trace.__dict__.get("_index")
    if cached is not None:
        return cached
    by_name = {s.name: i for i, s in enumerate(trace.segments)}
    unit_of: dict[int, tuple[int, int, str]] = {}
    for s, traced in enumerate(trace.traced_blocks):
        for unit in range(traced):
            fwd, bwd = _unit_names(s, unit, traced - 1)
            for role_prefix, names in (("f", fwd), ("b", bwd)):
                for j, name in enumerate(names):
                    if name in by_name:
                        unit_of[by_name[name]] = (s, unit, f"{role_prefix}{j}")
    origin: dict[int, tuple[int, int]] = {}
    for si, seg in enumerate(trace.segments):
        n = 0
        for kind, key, _, _ in seg.events:
            if kind == ALLOC:
                origin[key] = (si, n)
                n += 1
    core: dict[int, list[tuple[int, int, int, int]]] = {}
    deferred: dict[int, list[tuple[int, int, int, str, int, int, int, bool, int]]] = {}
    for si, seg in enumerate(trace.segments):
        if si in unit_of:
            continue
        own: list[tuple[int, int, int, int]] = []
        later: list[tuple[int, int, int, str, int, int, int, int]] = []
        for ev in seg.events:
            kind, key, lo, hi = ev
            src = origin.get(key)
            if kind == FREE and src is not None and src[0] in unit_of:
                s, unit, role = unit_of[src[0]]
                later.append((len(own), s, unit, role, src[1], lo, hi, key))
            else:
                own.append(ev)
        present = {(s, unit, role, ai) for _, s, unit, role, ai, _, _, _ in later}
        core[si] = own
        deferred[si] = [(pos, s, unit, role, ai, lo, hi, (s, unit - 1, role, ai) in present, key)
                        for pos, s, unit, role, ai, lo, hi, key in later]
    released: dict[int, list[tuple[int, int, int, str, int, int, int, int]]] = {}
    unit_core: dict[int, list[tuple[int, int, int, int]]] = {}
    for si, (s, unit, _role) in unit_of.items():
        traced = trace.traced_blocks[s]
        if unit > 1 or traced - 1 - unit < 2:
            continue
        later_units: dict[tuple[str, int], set[int]] = defaultdict(set)
        for kind, key, _, _ in trace.segments[si].events:
            src = origin.get(key)
            if kind == FREE and src is not None and src[0] in unit_of:
                ds, du, drole = unit_of[src[0]]
                if ds == s and du > unit:
                    later_units[(drole, src[1])].add(du)
        every = {k for k, units in later_units.items() if units == set(range(unit + 1, traced))}
        if not every:
            continue
        own: list[tuple[int, int, int, int]] = []
        rel: list[tuple[int, int, int, str, int, int, int, int]] = []
        for ev in trace.segments[si].events:
            kind, key, lo, hi = ev
            src = origin.get(key)
            if kind == FREE and src is not None and src[0] in unit_of:
                ds, du, drole = unit_of[src[0]]
                if ds == s and du > unit and (drole, src[1]) in every:
                    rel.append((len(own), ds, du, drole, src[1], lo, hi, key))
                    continue
            own.append(ev)
        released[si], unit_core[si] = rel, own
    index = _Index(unit_of=unit_of, origin=origin, by_name=by_name, core=core, deferred=deferred,
                   categories=_categories(trace), released=released, unit_core=unit_core)
    trace.__dict__["_index"] = index
    return index


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


def _categories(trace: VariantTrace) -> dict[int, MemoryCategory]:
    """Category of every key by its lifetime: kept from forward into backward = activation."""
    alloc_in_bwd: dict[int, bool] = {}
    freed_in_bwd: set[int] = set()
    alive: set[int] = set()
    for seg in trace.segments:
        is_bwd = seg.name.startswith(("bwd:", "backward"))
        for kind, key, _, _ in seg.events:
            if kind == ALLOC:
                alloc_in_bwd[key] = is_bwd
                alive.add(key)
            else:
                alive.discard(key)
                if is_bwd:
                    freed_in_bwd.add(key)
    out: dict[int, MemoryCategory] = {}
    for key, in_bwd in alloc_in_bwd.items():
        if key in trace.grad_keys:
            out[key] = Cat.GRADIENTS
        elif not in_bwd and (key in freed_in_bwd or key in alive) and key not in trace.persistent_keys:
            out[key] = Cat.ACTIVATIONS
        else:
            out[key] = Cat.TEMPORARIES
    return out


# -- layout ------------------------------------------------------------------------------------
_traced_unit = traced_unit  # which traced block stands for a block position of the full stack


def pass_layout(traces: dict[VariantKey, VariantTrace], base: VariantKey, block_modes: list[list[VariantKey]],
                full_counts: list[int]) -> PassLayout:
    """The full model's forward and backward as segment instances.

    ``block_modes[s][p]`` is the variant of block ``p`` of stack ``s``; other segments come from ``base``.
    """
    trace = traces[base]
    index = trace_index(trace)
    forward: list[Instance] = []
    backward: list[Instance] = []
    expanded: set[tuple[int, bool]] = set()
    for i, seg in enumerate(trace.segments):
        is_fwd = not seg.name.startswith(("bwd:", "backward"))
        target = forward if is_fwd else backward
        if i not in index.unit_of:
            target.append(Instance(base, i))
            continue
        s = index.unit_of[i][0]
        if (s, is_fwd) in expanded:
            continue
        expanded.add((s, is_fwd))
        full, traced = full_counts[s], trace.traced_blocks[s]
        for p in (range(full) if is_fwd else range(full - 1, -1, -1)):
            mode = block_modes[s][p]
            u = _traced_unit(p, full, traced)
            fwd, bwd = _unit_names(s, u, traced - 1)
            by_name = trace_index(traces[mode]).by_name
            for name in fwd if is_fwd else bwd:
                if name in by_name:
                    target.append(Instance(mode, by_name[name], (s, p), u))
    return PassLayout(forward=forward, backward=backward, block_modes=block_modes, full_counts=full_counts)


def deferred_for(traces: dict[VariantKey, VariantTrace], layout: PassLayout, inst: Instance
                  ) -> list[tuple[int, int, int, str, int, int, int, VariantKey, int]]:
    """Frees that a non-block segment makes of block bytes, for every block position of the full model:
    (position in the core events, stack, block position, role, allocation index, lo, hi, block variant,
    traced key)."""
    name = traces[inst.variant].segments[inst.segment].name
    out = []
    for s, modes in enumerate(layout.block_modes):
        full = layout.full_counts[s]
        for p, mode in enumerate(modes):
            t = traces[mode]
            idx = trace_index(t)
            g = idx.by_name.get(name)
            if g is None:
                continue
            traced = t.traced_blocks[s]
            u = _traced_unit(p, full, traced)
            repeated = full > traced and u == 2
            for pos, ds, unit, role, ai, lo, hi, every, key in idx.deferred.get(g, ()):
                if ds != s or unit != u:
                    continue
                if repeated and not every and p != full - 2:
                    continue  # the block after this one frees it in its own segment
                out.append((pos, s, p, role, ai, lo, hi, mode, key))
    out.sort(key=lambda e: (e[0], e[2]))
    return out


def _released_for(traces: dict[VariantKey, VariantTrace], layout: PassLayout, inst: Instance
                  ) -> list[tuple[int, int, int, str, int, int, int, VariantKey, int]]:
    """The release frees a block segment makes, for every later block position of its stack: (position in the
    segment's own events, stack, block position, role, allocation index, lo, hi, block variant, traced key).
    Each later block is freed as its own mode's trace frees it here (a checkpointed block keeps nothing)."""
    assert inst.block is not None
    trace = traces[inst.variant]
    name = trace.segments[inst.segment].name
    s, p = inst.block
    end = len(trace_index(trace).unit_core.get(inst.segment, trace.segments[inst.segment].events))
    full = layout.full_counts[s]
    out = []
    for q in range(p + 1, full):
        mode = layout.block_modes[s][q]
        t = traces[mode]
        idx = trace_index(t)
        g = idx.by_name.get(name)
        if g is None:
            continue
        uq = _traced_unit(q, full, t.traced_blocks[s])
        for pos, ds, du, role, ai, lo, hi, key in idx.released.get(g, ()):
            if ds == s and du == uq:
                out.append((pos if mode == inst.variant else end, s, q, role, ai, lo, hi, mode, key))
    out.sort(key=lambda e: (e[0], e[2]))
    return out


def _has_releases(traces: dict[VariantKey, VariantTrace], layout: PassLayout, inst: Instance) -> bool:
    """Whether a block segment makes release frees (in its own trace, or as a later block's mode traces it)."""
    if inst.block is None:
        return False
    name = traces[inst.variant].segments[inst.segment].name
    for mode in set(layout.block_modes[inst.block[0]]) | {inst.variant}:
        idx = trace_index(traces[mode])
        g = idx.by_name.get(name)
        if g is not None and g in idx.released:
            return True
    return False


# -- allocated peak -----------------------------------------------------------------------------
@dataclass
class Summary:
    net: int
    peak: int  # highest point relative to the segment's start (>= 0)
    net_by_cat: dict[MemoryCategory, int]
    at_peak_by_cat: dict[MemoryCategory, int]
    grads: int  # gradient bytes this segment leaves allocated (first micro-batch)


def _summarize(trace: VariantTrace, events: list[tuple[int, int, int, int]], b: int, accumulate: bool,
               inserted: list[tuple[int, int, MemoryCategory]] | None = None) -> Summary:
    """Fold events (sizes at micro-batch ``b``); ``inserted`` frees (position, bytes, category) go before the
    event at that position."""
    idx = trace_index(trace)
    cur = peak = grads = 0
    by_cat: dict[MemoryCategory, int] = defaultdict(int)
    at_peak: dict[MemoryCategory, int] = {}
    ins = inserted or []
    j = 0
    for pos, (kind, key, lo, hi) in enumerate(events):
        while j < len(ins) and ins[j][0] <= pos:
            cur -= ins[j][1]
            by_cat[ins[j][2]] -= ins[j][1]
            j += 1
        if key in trace.persistent_keys:
            continue
        size = allocator_size(trace.size(lo, hi, b))
        cat = idx.categories.get(key, Cat.TEMPORARIES)
        if kind == ALLOC:
            cur += size
            by_cat[cat] += size
            is_grad = key in trace.grad_keys
            if is_grad:
                grads += size
            if cur > peak:
                peak, at_peak = cur, dict(by_cat)
            if accumulate and is_grad:  # accumulated into the existing gradient, then freed
                cur -= size
                by_cat[cat] -= size
                grads -= size
        else:
            cur -= size
            by_cat[cat] -= size
    for _, size, cat in ins[j:]:
        cur -= size
        by_cat[cat] -= size
    return Summary(net=cur, peak=peak, net_by_cat=dict(by_cat), at_peak_by_cat=at_peak, grads=grads)


@dataclass
class PeakResult:
    peak_bytes: int
    breakdown: dict[MemoryCategory, int]
    where: str
    grad_bytes: int
    step_peaks: list[int] = field(default_factory=list)


def _instance_summary(traces: dict[VariantKey, VariantTrace], layout: PassLayout, inst: Instance, b: int,
                      acc: bool) -> Summary:
    trace = traces[inst.variant]
    idx = trace_index(trace)
    if _has_releases(traces, layout, inst):
        rel = [(pos, allocator_size(traces[mode].size(lo, hi, b)),
                trace_index(traces[mode]).categories.get(key, Cat.TEMPORARIES))
               for pos, _s, _q, _role, _ai, lo, hi, mode, key in _released_for(traces, layout, inst)]
        own = idx.unit_core.get(inst.segment, trace.segments[inst.segment].events)
        return _summarize(trace, own, b, acc, rel)
    if inst.block is not None:
        # a block's summary depends on its segment, the micro-batch and the accumulation mode only
        cache = trace.__dict__.setdefault("_summaries", {})
        key = (inst.segment, b, acc)
        if key not in cache:
            cache[key] = _summarize(trace, trace.segments[inst.segment].events, b, acc)
        return cache[key]
    inserted = []
    for pos, _s, _p, _role, _ai, lo, hi, mode, key in deferred_for(traces, layout, inst):
        t = traces[mode]
        inserted.append((pos, allocator_size(t.size(lo, hi, b)), trace_index(t).categories.get(key, Cat.TEMPORARIES)))
    return _summarize(trace, idx.core[inst.segment], b, acc, inserted)


def _opt_summary(events: list[tuple[int, int, int]], state_keys: set[int]) -> Summary:
    """The optimizer step: states it creates (kept) and temporaries (fp32 gradient copies, foreach buffers)."""
    cur = peak = 0
    by_cat: dict[MemoryCategory, int] = defaultdict(int)
    at_peak: dict[MemoryCategory, int] = {}
    cat_of: dict[int, MemoryCategory] = {}
    for kind, key, size in events:
        size = allocator_size(size)
        if kind == ALLOC:
            cat = cat_of[key] = Cat.OPTIMIZER_STATES if key in state_keys else Cat.TEMPORARIES
            cur += size
            by_cat[cat] += size
            if cur > peak:
                peak, at_peak = cur, dict(by_cat)
        else:
            cur -= size
            by_cat[cat_of.get(key, Cat.TEMPORARIES)] -= size
    return Summary(net=cur, peak=peak, net_by_cat=dict(by_cat), at_peak_by_cat=at_peak, grads=0)


def allocated_peak(traces: dict[VariantKey, VariantTrace], layout: PassLayout, b: int, m: int,
                   optimizer: OptimizerTrace, static: dict[MemoryCategory, int], num_steps: int = 2) -> PeakResult:
    """The highest allocated bytes over ``num_steps`` steps of ``m`` micro-batches of size ``b``."""
    cache: dict[tuple[Instance, bool], Summary] = {}
    level = sum(static.values())
    running: dict[MemoryCategory, int] = defaultdict(int, static)
    best, best_where, best_cats = level, "start", dict(running)
    step_peaks: list[int] = []
    grad_total = 0
    opt_first = _opt_summary(optimizer.first, optimizer.state_keys)
    opt_steady = _opt_summary(optimizer.steady, optimizer.state_keys)

    def visit(s: Summary, where: str) -> None:
        nonlocal level, best, best_where, best_cats
        if level + s.peak > best:
            best, best_where = level + s.peak, where
            merged = defaultdict(int, running)
            for c, v in s.at_peak_by_cat.items():
                merged[c] += v
            best_cats = dict(merged)
        level += s.net
        for c, v in s.net_by_cat.items():
            running[c] += v

    for step in range(num_steps):
        start_best = best
        for mb in range(m):
            acc = mb > 0
            for part, insts in (("forward", layout.forward), ("backward", layout.backward)):
                for inst in insts:
                    key = (inst, acc)
                    s = cache.get(key)
                    if s is None:
                        s = cache[key] = _instance_summary(traces, layout, inst, b, acc)
                    if step == 0 and mb == 0:
                        grad_total += s.grads
                    if level + s.peak > best:
                        name = traces[inst.variant].segments[inst.segment].name
                        where = f"step {step + 1}, micro-batch {mb + 1}, {part}: {name}"
                        if inst.block is not None:
                            where += f" (block {inst.block[1]})"
                    else:
                        where = ""
                    visit(s, where)
        visit(opt_first if step == 0 else opt_steady, f"step {step + 1}, optimizer step")
        level -= grad_total  # zero_grad(set_to_none=True)
        running[Cat.GRADIENTS] -= grad_total
        step_peaks.append(best if best > start_best else start_best)
    breakdown = {c: v for c, v in best_cats.items() if v}
    return PeakResult(peak_bytes=best, breakdown=breakdown, where=best_where, grad_bytes=grad_total,
                      step_peaks=step_peaks)


# -- full event stream ----------------------------------------------------------------------------
def event_stream(traces: dict[VariantKey, VariantTrace], layout: PassLayout, b: int, m: int,
                 optimizer: OptimizerTrace, static_events: list[tuple[int, int, int]],
                 num_steps: int = 3, origins: dict[int, tuple[Instance | None, int]] | None = None
                 ) -> tuple[list[tuple[int, int, int]], int]:
    """The full run's allocation events ``(kind, key, bytes)`` and the index where the steps begin.

    ``origins`` (attribution, ``memopt.estimate.attribution``): filled with each fresh key's source, the
    segment instance and the traced key it repeats (instance None: the optimizer step's)."""
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
                        deferred_cache[inst] = (_released_for(traces, layout, inst)
                                                if _has_releases(traces, layout, inst) else None)
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


def _resolve(inst: Instance, key: int, idx: _Index, live: dict[tuple, int], slots: dict[tuple, int],
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
