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

This module holds the layout (which traced segment stands for each segment of the full pass) and the
per-trace index that attributes every free; the two products read it:

* ``memopt.estimate.compose_peak.allocated_peak`` folds per-segment summaries (net bytes, highest point,
  bytes by category) along the sequence: exact for the peak of allocated bytes and fast enough for
  thousands of candidates;
* ``memopt.estimate.compose_stream.event_stream`` writes the full allocation sequence with per-block keys,
  which the caching allocator simulator turns into reserved bytes (used for the candidates that matter).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from memopt.categories import MemoryCategory
from memopt.profile.model_state import traced_unit
from memopt.profile.tracker import ALLOC, FREE
from memopt.profile.variant_trace import VariantKey, VariantTrace

__all__ = ["Index", "Instance", "PassLayout", "deferred_for", "has_releases", "pass_layout", "released_for",
           "trace_index"]

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
class Index:
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


def trace_index(trace: VariantTrace) -> Index:
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
    index = Index(unit_of=unit_of, origin=origin, by_name=by_name, core=core, deferred=deferred,
                   categories=_categories(trace), released=released, unit_core=unit_core)
    trace.__dict__["_index"] = index
    return index


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


def released_for(traces: dict[VariantKey, VariantTrace], layout: PassLayout, inst: Instance
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


def has_releases(traces: dict[VariantKey, VariantTrace], layout: PassLayout, inst: Instance) -> bool:
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
