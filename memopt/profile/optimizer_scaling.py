"""The optimizer step of a deep model from traces over shallow copies of its parameter list.

Tracing an optimizer step over every parameter of an 80-block model replays thousands of fake-tensor ops (seconds
per optimizer). A standard optimizer treats its parameters as a list: each block's parameters add the same events
(per-parameter state creation, or one more entry in each ``_foreach`` op's output list). So the step is traced
over the parameter list of the same model with 4, 5 and 6 blocks per stack (the first two blocks, the middle one
repeated, the last; as :func:`memopt.profile.model_state.expand_model_state` lays them out), the events the 5-block
trace adds to the 4-block one are found by sequence alignment, and the full model's step is the 4-block trace
with those events repeated once per further block (sizes that grow with the block count grow linearly).

The result is used only when the same extrapolation reproduces the 6-block trace exactly (every event, the
states, every scalar and cost); otherwise the full parameter list is traced. ``tests/profile`` checks
extrapolated == fully traced on small models for every shipped optimizer and precision.
"""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from memopt.blocks import find_block_stacks
from memopt.profile.costs import PhaseCost
from memopt.profile.model_state import expand_model_state, model_state_entries
from memopt.profile.optimizer_trace import OptimizerTrace
from memopt.profile.tracker import ALLOC, FREE
from memopt.techniques.precision import stored_dtype

__all__ = ["SHALLOW_BLOCKS", "canonical_events", "extrapolate_optimizer", "model_layout", "scaled_optimizer_trace",
           "trainable_params"]

ParamList = list[tuple[tuple[int, ...], str]]
# one event of the step's two phases, with whether it is an optimizer state; _SEP separates the phases
_Event = tuple[int, int, int, bool]
_SEP: _Event = (0, 0, 0, False)
SHALLOW_BLOCKS = (4, 5, 6)  # blocks per stack of the traced copies: base, one more (aligned), check
_MIN_BLOCKS = 8  # shallower stacks are traced in full (the copies would cost as much)


def trainable_params(state: dict[str, Any], traced_blocks: Sequence[int], counts: Sequence[int]) -> ParamList:
    """The trainable parameters ``(shape, dtype)`` of a model with ``counts`` blocks per stack, from the state of
    a copy with ``traced_blocks`` (``VariantTrace.model_state`` layout)."""
    params, _ = expand_model_state(state, traced_blocks, counts)
    return [(shape, dtype) for shape, dtype, grad in params if grad]


def model_layout(model: nn.Module, weight_dtype: torch.dtype
                 ) -> tuple[dict[str, Any], list[int], list[int]] | None:
    """``(state, traced_blocks, full_counts)`` of ``model``'s parameters as :func:`scaled_optimizer_trace` takes
    them: a copy with the first two, the middle and the last block of each stack, floating parameters in
    ``weight_dtype`` (as ``trace_optimizer`` makes them). None when a stack is too shallow or its blocks differ
    after the first (the full list is traced then)."""
    stacks = find_block_stacks(model)
    counts = [len(s) for s in stacks]
    if not stacks or min(counts) < _MIN_BLOCKS or not all(s.uniform_tail for s in stacks):
        return None
    kept = {(s, u): (u if u < 3 else 3) for s, n in enumerate(counts) for u in (0, 1, 2, n - 1)}
    params = []
    for shape, dtype, grad, stack, unit in model_state_entries(model, stacks)["params"]:
        if stack >= 0 and (stack, unit) not in kept:
            continue
        stored = str(stored_dtype(weight_dtype, getattr(torch, dtype))).removeprefix("torch.")
        params.append([shape, stored, grad,
                       stack, kept.get((stack, unit), unit)])
    return {"params": params, "buffers": []}, [SHALLOW_BLOCKS[0]] * len(stacks), counts


def scaled_optimizer_trace(state: dict[str, Any], traced_blocks: Sequence[int], full_counts: Sequence[int],
                           trace: Callable[[ParamList], OptimizerTrace]) -> OptimizerTrace:
    """``trace`` over the full model's trainable parameters, extrapolated from shallow copies where that is
    exact (see the module docstring)."""
    full = trainable_params(state, traced_blocks, full_counts)
    depth = full_counts[0] if full_counts else 0
    uniform = all(n == depth for n in full_counts) and all(t == SHALLOW_BLOCKS[0] for t in traced_blocks)
    if not uniform or depth < _MIN_BLOCKS:
        return trace(full)
    shallow = [trace(trainable_params(state, traced_blocks, [k] * len(full_counts))) for k in SHALLOW_BLOCKS]
    out = extrapolate_optimizer(shallow, depth - SHALLOW_BLOCKS[0])
    return out if out is not None else trace(full)


def extrapolate_optimizer(shallow: Sequence[OptimizerTrace], extra: int) -> OptimizerTrace | None:
    """The trace with ``extra`` more blocks than ``shallow[0]``, from traces with 0, 1 and 2 more (None when the
    third is not what the first two predict)."""
    a, b, c = shallow
    seqs = [_sequence(t) for t in shallow]
    check = _extrapolate(seqs[0], seqs[1], 2)
    if check is None or canonical_events(check) != canonical_events(seqs[2]):
        return None
    events = _extrapolate(seqs[0], seqs[1], extra)
    scalars = {}
    for name in ("state_bytes", "master_bytes", "host_state_bytes"):
        va, vb, vc = (getattr(t, name) for t in shallow)
        if vc != va + 2 * (vb - va):
            return None
        scalars[name] = va + extra * (vb - va)
    cost = _linear_cost(a.cost, b.cost, c.cost, extra)
    if events is None or cost is None or {(t.precision, t.optimizer, t.extras) for t in shallow} != {
            (a.precision, a.optimizer, a.extras)}:
        return None
    sep = events.index(_SEP)
    first, steady = events[:sep], events[sep + 1:]
    return OptimizerTrace(precision=a.precision, optimizer=a.optimizer, first=[e[:3] for e in first],
                          steady=[e[:3] for e in steady], cost=cost, extras=a.extras,
                          state_keys={key for kind, key, _, state in first if state and kind == ALLOC}, **scalars)


def _sequence(t: OptimizerTrace) -> list[_Event]:
    tag = [(kind, key, size, key in t.state_keys) for kind, key, size in t.first]
    return [*tag, _SEP, *((kind, key, size, False) for kind, key, size in t.steady)]


def canonical_events(events: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Events with keys renamed by first appearance (two traces of the same step compare equal)."""
    names: dict[int, int] = {}
    return [(e[0], names.setdefault(e[1], len(names)), *e[2:]) if e[0] else tuple(e) for e in events]


def _extrapolate(a: list[_Event], b: list[_Event], copies: int) -> list[_Event] | None:
    """``b`` with each run of events it adds to ``a`` repeated ``copies`` times (``copies=1`` gives ``b``); sizes
    that differ between aligned events change by their difference per copy. None when the difference is not
    such runs. Which tensor an event of a copy refers to: one of the same copy when the tensor first appears in
    an added run (a ``_foreach`` op's output freed by a later op; copies of a reversed sweep come last first);
    when it appears in the period before the run, the previous copy's (a temporary kept until the next
    parameter's); an aligned event after a run refers to its last copy's."""
    tokens_b = [_token(e) for e in b]
    diff = _diff([_token(e) for e in a], tokens_b, a, b)
    if diff is None:
        return None
    runs, grow = diff
    region = _place(b, tokens_b, runs, grow)
    if region is None:
        return None
    first: dict[int, int] = {}
    for j, (_, key, _, _) in enumerate(b):
        first.setdefault(key, j)
    out: list[_Event] = []
    names: dict[tuple[int, ...], int] = {}
    for reg, group in itertools.groupby(range(len(b)), key=region.__getitem__):
        span = list(group)
        order = (0,) if not reg else range(copies - 1, -1, -1) if _reversed(b, region, first, span) else range(copies)
        for c in order:
            for j in span:
                kind, key, size, st = b[j]
                if kind:
                    name = _name(b, region, first, j, c, copies, len(span) if reg else 0)
                    if name is None:
                        return None
                    key = names.setdefault(name, len(names) + 1)
                    size += (copies - 1) * grow.get(j, 0)
                out.append((kind, key, size, st))
    return out


def _reversed(b: list[_Event], region: list[int], first: dict[int, int], span: list[int]) -> bool:
    """Whether a run refers to an earlier run's tensors last parameter first (a sweep in reverse order, such as
    the frees after a ``_foreach`` op): its copies then come in reverse order too."""
    refs = [p for j in span if region[p := first[b[j][1]]] and p < span[0]]
    return len(refs) > 1 and all(x > y for x, y in itertools.pairwise(refs))


def _name(b: list[_Event], region: list[int], first: dict[int, int], j: int, c: int, copies: int, period: int
          ) -> tuple[int, ...] | None:
    """The tensor event ``j`` of ``b`` refers to in copy ``c`` of its run (see :func:`_extrapolate`): (position
    of its first appearance in ``b``, copy), copy -1 for aligned tensors; None when no rule applies."""
    p = first[b[j][1]]
    if not region[j]:
        return (p, -1) if not region[p] else (p, copies - 1)
    if region[p]:
        return p, c
    if c == 0:
        return p, -1
    q = p + period  # the same tensor one period later: the previous copy's
    if region[q] != region[j] or first.get(b[q][1]) != q:
        return None
    return q, c - 1


def _token(e: _Event) -> tuple[int, int, bool] | str:
    return (e[0], e[2], e[3]) if e[0] else "sep"


def _diff(tokens_a: list[Any], tokens_b: list[Any], a: list[_Event], b: list[_Event]
          ) -> tuple[list[tuple[int, int]], dict[int, int]] | None:
    """The runs ``(start, end)`` of ``b`` that ``a`` lacks, and the bytes per copy of aligned events whose size
    differs; None when ``b`` is not ``a`` plus such runs."""
    runs: list[tuple[int, int]] = []
    grow: dict[int, int] = {}  # position in b -> bytes added per copy
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, tokens_a, tokens_b, autojunk=False).get_opcodes():
        if op == "insert":
            runs.append((j1, j2))
        elif op == "replace" and i2 - i1 == j2 - j1 and all(
                a[i][0] == b[j][0] and a[i][3] == b[j][3] for i, j in zip(range(i1, i2), range(j1, j2))):
            grow.update({j: b[j][2] - a[i][2] for i, j in zip(range(i1, i2), range(j1, j2))})
        elif op != "equal":
            return None
    return runs, grow


def _place(b: list[_Event], tokens: list[Any], runs: list[tuple[int, int]], grow: dict[int, int]
           ) -> list[int] | None:
    """Which run (1, 2, ...; 0: aligned) each event of ``b`` belongs to. An added run may sit anywhere among the
    equal events around it (the alignment places it arbitrarily within a repeating stretch): each is placed,
    in order, at the leftmost position where every tensor its events free was allocated in a run (:func:`_first_fit`).
    """
    region = [0] * len(b)
    first: dict[int, int] = {}
    for j, (_, key, _, _) in enumerate(b):
        first.setdefault(key, j)
    blocked = set(grow) | {j for start, end in runs for j in range(start, end)}
    for r, (start, end) in enumerate(runs, 1):
        own = set(range(start, end))
        lo = 0
        while start + lo > 0 and start + lo - 1 not in blocked - own and tokens[start + lo - 1] == tokens[end + lo - 1]:
            lo -= 1
        hi = 0
        while end + hi < len(b) and end + hi not in blocked - own and tokens[start + hi] == tokens[end + hi]:
            hi += 1
        span = _first_fit(b, first, region, [range(start + k, end + k) for k in range(lo, hi + 1)])
        if span is None:
            return None
        region[span.start:span.stop] = [r] * len(span)
        blocked = (blocked - own) | set(span)
    return region


def _first_fit(b: list[_Event], first: dict[int, int], region: list[int], spans: list[range]) -> range | None:
    """The first span whose frees all free tensors of runs (placed before, or this one); failing that, the first
    whose frees may also free tensors of the period before it (a chain from one parameter to the next)."""
    for chain in (0, 1):
        for span in spans:
            floor = span.start - chain * len(span)
            if all(b[j][0] != FREE or (p := first[b[j][1]]) >= floor or region[p] for j in span):
                return span
    return None


def _linear_cost(a: PhaseCost, b: PhaseCost, c: PhaseCost, extra: int) -> PhaseCost | None:
    """The cost with ``extra`` more blocks (every count grows linearly; None when ``c`` is not on that line)."""
    da, db, dc = a.to_dict(), b.to_dict(), c.to_dict()
    if not da["attention_dtype"] == db["attention_dtype"] == dc["attention_dtype"]:
        return None
    out: dict[str, Any] = {"attention_dtype": da["attention_dtype"]}
    for name in ("attention_flops", "memory_bytes", "num_ops", "bnb4_calls", "library_kernels"):
        if dc[name] != da[name] + 2 * (db[name] - da[name]):
            return None
        out[name] = da[name] + extra * (db[name] - da[name])
    for key in ("matmul_flops", "library_flops"):
        flops: dict[str, Any] = {}
        for dtype in {*da[key], *db[key], *dc[key]}:
            va, vb, vc = (d[key].get(dtype, 0.0) for d in (da, db, dc))
            if vc != va + 2 * (vb - va):
                return None
            flops[dtype] = va + extra * (vb - va)
        out[key] = flops
    return PhaseCost.from_dict(out)
