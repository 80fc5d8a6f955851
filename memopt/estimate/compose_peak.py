"""The allocated peak of a composed run, folded from per-segment summaries.

Each segment instance of the layout (``memopt.estimate.compose``) is summarised once (net bytes, highest
point, bytes by category), with the frees it makes on behalf of other blocks inserted, and the summaries are
folded along the run's steps. Exact for the peak of allocated bytes and fast enough for thousands of
candidates, so the search scores every candidate with it; reserved bytes need the full event stream
(``memopt.estimate.compose_stream``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from memopt.categories import MemoryCategory
from memopt.estimate.compose import Instance, PassLayout, deferred_for, has_releases, released_for, trace_index
from memopt.profile.optimizer_trace import OptimizerTrace
from memopt.profile.tracker import ALLOC
from memopt.profile.variant_trace import VariantKey, VariantTrace
from memopt.units import allocator_size

__all__ = ["PeakResult", "Summary", "allocated_peak"]

Cat = MemoryCategory


@dataclass
class Summary:
    net: int
    peak: int  # highest point relative to the segment's start (>= 0)
    net_by_cat: dict[MemoryCategory, int]
    at_peak_by_cat: dict[MemoryCategory, int]
    grads: int  # gradient bytes this segment leaves allocated (first micro-batch)
    grad_tensors: int = 0  # how many gradients it makes (each later micro-batch adds one into each)


def _summarize(trace: VariantTrace, events: list[tuple[int, int, int, int]], b: int, accumulate: bool,
               inserted: list[tuple[int, int, MemoryCategory]] | None = None) -> Summary:
    """Fold events (sizes at micro-batch ``b``); ``inserted`` frees (position, bytes, category) go before the
    event at that position."""
    idx = trace_index(trace)
    cur = peak = grads = grad_tensors = 0
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
                grad_tensors += 1
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
    return Summary(net=cur, peak=peak, net_by_cat=dict(by_cat), at_peak_by_cat=at_peak, grads=grads,
                   grad_tensors=grad_tensors)


@dataclass
class PeakResult:
    peak_bytes: int
    breakdown: dict[MemoryCategory, int]
    where: str
    grad_bytes: int
    grad_tensors: int = 0
    step_peaks: list[int] = field(default_factory=list)


def _instance_summary(traces: dict[VariantKey, VariantTrace], layout: PassLayout, inst: Instance, b: int,
                      acc: bool) -> Summary:
    trace = traces[inst.variant]
    idx = trace_index(trace)
    if has_releases(traces, layout, inst):
        rel = [(pos, allocator_size(traces[mode].size(lo, hi, b)),
                trace_index(traces[mode]).categories.get(key, Cat.TEMPORARIES))
               for pos, _s, _q, _role, _ai, lo, hi, mode, key in released_for(traces, layout, inst)]
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
    grad_total = grad_tensors = 0
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
                        grad_tensors += s.grad_tensors
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
                      grad_tensors=grad_tensors,
                      step_peaks=step_peaks)


