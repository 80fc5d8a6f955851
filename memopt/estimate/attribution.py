"""Where every predicted byte goes: what is live at the predicted peak, by module group, module and category.

The composed run (``compose_stream.event_stream``, two steps: the first creates the optimizer states) is replayed with
each fresh allocation traced back to the segment instance and traced key it repeats; the trace's attribution
(``VariantTrace.attribution``) names the module and op that made the key, and the instance's block position
puts a repeated block's bytes at their place in the full-depth model. Parameters, buffers, fp32 master copies
and the input batch are live throughout: each parameter is counted once per block position its traced block
stands for. Optimizer states are split over the groups that own their parameters by tracing the optimizer over
each group's parameters (one block per traced unit, repeated); memory that belongs to no module -- workspaces,
the caching allocator's slack (reserved - allocated) and what the CUDA runtime holds -- is the ``runtime`` group.

Rows sum to the predicted total (peak reserved + outside the allocator) exactly.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

from memopt.categories import MemoryCategory
from memopt.estimate.compose import pass_layout, trace_index
from memopt.estimate.compose_peak import allocated_peak
from memopt.estimate.compose_stream import event_stream
from memopt.estimate.estimator import estimate_strategy, static_bytes, step_plan
from memopt.estimate.event_levels import first_step_length, level_at, levels, live_at, step_timeline
from memopt.profile.attribution import EMBEDDING, OPTIMIZER, RUNTIME, block_pattern, group_of
from memopt.profile.model_state import traced_unit
from memopt.profile.optimizer_trace import trace_optimizer
from memopt.profile.tracker import ALLOC
from memopt.profile.variant_trace import VariantTrace
from memopt.strategy import Strategy
from memopt.units import allocator_size

__all__ = ["AttributionTable", "attach_to_plan", "predict_attribution", "split_exact"]

Cat = MemoryCategory


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def split_exact(total: int, weights: dict[str, int]) -> dict[str, int]:
    """``total`` split in proportion to ``weights`` (largest remainder), summing to ``total`` exactly."""
    wsum = sum(weights.values())
    if total == 0 or wsum <= 0:
        return {k: 0 for k in weights}
    if wsum == total:
        return dict(weights)
    base = {k: total * w // wsum for k, w in weights.items()}
    left = total - sum(base.values())
    order = sorted(weights, key=lambda k: -(total * weights[k] % wsum))
    for k in order[:left]:
        base[k] += 1
    return base


class AttributionTable:
    """Bytes by (group, module pattern, category), plus the individual tensors for the largest-tensor list."""

    def __init__(self) -> None:
        self.cells: dict[tuple[str, str, str], int] = defaultdict(int)
        self.tensors: list[dict[str, Any]] = []

    def add(self, group: str, module: str, cat: MemoryCategory | str, nbytes: int, *, op: str = "", phase: str = "",
            count: int = 1, tensor_path: str | None = None, tensor: bool = True) -> None:
        if nbytes <= 0:
            return
        self.cells[(group, module, str(cat))] += nbytes * count
        if tensor:  # not the aggregates (allocator slack, runtime, one group's optimizer states)
            self.tensors.append({"bytes": nbytes, "count": count, "category": str(cat), "group": group,
                             "module": tensor_path if tensor_path is not None else module, "op": op, "phase": phase})

    def result(self, group_order: list[str], top: int) -> dict[str, Any]:
        by_group: dict[str, dict[str, int]] = {}
        by_module: dict[str, dict[str, int]] = {}
        module_group: dict[str, str] = {}
        for (g, mod, c), v in self.cells.items():
            by_group.setdefault(g, {})
            by_group[g][c] = by_group[g].get(c, 0) + v
            by_module.setdefault(mod, {})
            by_module[mod][c] = by_module[mod].get(c, 0) + v
            module_group[mod] = g
        groups = [g for g in group_order if g in by_group] + sorted(set(by_group) - set(group_order))
        by_category: dict[str, int] = defaultdict(int)
        for cats in by_group.values():
            for c, v in cats.items():
                by_category[c] += v
        largest = sorted(self.tensors, key=lambda t: -t["bytes"])[:top]
        return {"groups": groups, "by_group": {g: by_group[g] for g in groups}, "by_category": dict(by_category),
                "by_module": {m: {"group": module_group[m], **by_module[m]} for m in
                              sorted(by_module, key=lambda m: -sum(by_module[m].values()))},
                "top_tensors": largest, "total_bytes": sum(by_category.values())}


def _record(trace: VariantTrace) -> dict[str, Any]:
    rec = trace.attribution
    if rec is None:
        raise ValueError(f"the trace of {trace.key.label()} records no module attribution (a profile cached by an "
                         "older memopt); profile the model again (use_cache=False) to attribute its memory")
    cached = trace.__dict__.get("_attr_maps")
    if cached is None:
        mods, ops = rec["modules"], rec["ops"]
        alloc = {k: (mods[m], ops[o]) for k, m, o in rec["alloc"]}
        grads = {k: mods[m] for k, m in rec["grads"]}
        first = {mods[m]: ph for m, ph in rec["first_phase"]}
        cached = trace.__dict__["_attr_maps"] = (alloc, grads, first)
    return cached


def _at_position(path: str, stack_paths: Sequence[str], position: int | None) -> str:
    """A traced block's module path at block ``position`` of the full stack."""
    s, unit, _ = block_pattern(path, stack_paths)
    if s < 0 or position is None:
        return path
    prefix = f"{stack_paths[s]}.{unit}"
    return f"{stack_paths[s]}.{position}{path[len(prefix):]}"


def _times(stack: int, unit: int, traced: Sequence[int], full: Sequence[int]) -> int:
    return sum(1 for p in range(full[stack]) if traced_unit(p, full[stack], traced[stack]) == unit)


def _static_entries(profile: Any, trace: VariantTrace, static: dict[MemoryCategory, int], master_bytes: int,
                    table: AttributionTable) -> dict[str, list[tuple[list[tuple[tuple[int, ...], str]], int]]]:
    """Parameters, buffers, master copies, inputs and workspaces into ``table``; returns each group's trainable
    parameters as (one traced unit's list, how many times it repeats), for the optimizer states."""
    rec = trace.attribution
    mods, stacks = rec["modules"], rec["stacks"]
    _, _, first = _record(trace)
    order = rec.get("order")
    traced, full = trace.traced_blocks, profile.full_block_counts
    trainable: dict[tuple[str, int, int], list[tuple[tuple[int, ...], str]]] = defaultdict(list)
    params_total = masters_total = 0
    for kind, entries in (("parameter", rec["params"]), ("buffer", rec["buffers"])):
        for entry in entries:
            m, shape, dtype = entry[0], entry[1], entry[2]
            path = mods[m]
            s, unit, pattern = block_pattern(path, stacks)
            times = _times(s, unit, traced, full) if s >= 0 else 1
            group = group_of(path, "forward", stacks, first, order)
            size = allocator_size(_numel(shape) * _itemsize(dtype))
            table.add(group, pattern or "(root)", Cat.PARAMETERS, size, op=kind, count=times,
                      tensor_path=path if s < 0 else pattern)
            params_total += size * times
            if kind == "parameter" and entry[3]:
                trainable[(group, s, unit if s >= 0 else 0)].append((tuple(shape), dtype))
                if master_bytes and getattr(torch, dtype).is_floating_point:
                    msize = allocator_size(_numel(shape) * 4)
                    table.add(group, pattern or "(root)", Cat.OPTIMIZER_STATES, msize, op="fp32 master copy",
                              count=times, tensor_path=path if s < 0 else pattern)
                    masters_total += msize * times
    if params_total != static[Cat.PARAMETERS] or masters_total != master_bytes:
        raise ValueError(f"parameter attribution does not add up ({params_total} vs {static[Cat.PARAMETERS]}, "
                         f"masters {masters_total} vs {master_bytes}): the trace and the static estimate disagree")
    table.add(EMBEDDING, "(input batch)", Cat.ACTIVATIONS, static.get(Cat.ACTIVATIONS, 0), op="input")
    alloc, _, _ = _record(trace)
    for key in sorted(trace.persistent_keys):
        size = next((allocator_size(lo) for seg in trace.segments for kind, k, lo, _ in seg.events
                     if k == key and kind == ALLOC), 0)
        module, op = alloc.get(key, ("", "workspace"))
        table.add(RUNTIME, "(workspaces)", Cat.TEMPORARIES, size, op=op, tensor_path=f"(workspace, first used in "
                  f"{module or 'no module'})")
    out: dict[str, list[tuple[list[tuple[tuple[int, ...], str]], int]]] = defaultdict(list)
    for (group, s, unit), plist in trainable.items():
        out[group].append((plist, _times(s, unit, traced, full) if s >= 0 else 1))
    return out


def _states_by_group(profile: Any, strategy: Strategy,
                     params: dict[str, list[tuple[list[tuple[tuple[int, ...], str]], int]]]) -> dict[str, int]:
    """Optimizer-state bytes each group's parameters make (traced per group; by parameter bytes without a
    tracing policy at hand)."""
    policy = getattr(profile, "_policy", None)
    out: dict[str, int] = {}
    memo = profile.derived.setdefault("attribution_states", {})
    for group, parts in params.items():
        total = 0
        for plist, times in parts:
            if policy is None:
                total += times * sum(allocator_size(_numel(s) * 8) for s, _ in plist)
                continue
            key = (strategy.precision, strategy.optimizer, tuple(plist))
            if key not in memo:
                memo[key] = trace_optimizer(None, strategy.precision, strategy.optimizer, policy,
                                            optimizer_spec=profile._optimizer_spec, params=plist).state_bytes
            total += times * memo[key]
        out[group] = total
    return out


def predict_attribution(profile: Any, strategy: Strategy, *, hardware: Any = None,
                        prediction: dict[str, Any] | None = None, top: int = 10) -> dict[str, Any]:
    """What is live at the predicted peak of ``strategy`` (``peak``), and at each of the two steps' own peaks
    (``steps``: the first creates the optimizer states, the second is the steady state), by module group,
    module and category, with the ``top`` largest live tensors and the predicted memory over the second step
    (``timeline``) and the first (``timeline_first_step``). ``prediction``: the strategy's
    ``Estimate.to_dict()`` when known (else estimated here)."""
    if prediction is None:
        prediction = estimate_strategy(profile, strategy, hardware=hardware).to_dict()
    sp = step_plan(profile, strategy)
    traces = {k: profile.variant(k, strategy.micro_batch_size) for k in sp.variants}
    base = traces[sp.base]
    layout = pass_layout(traces, sp.base, sp.block_modes, profile.full_block_counts)
    opt = profile.optimizer(strategy.precision, strategy.optimizer, base)
    b, m = strategy.micro_batch_size, strategy.grad_accum_steps
    static, _ = static_bytes(profile, strategy, traces, sp.base, b * m, opt.master_bytes)
    for t in traces.values():
        _record(t)
    peak = allocated_peak(traces, layout, b, m, opt, static)
    origins: dict[int, Any] = {}
    events, _ = event_stream(traces, layout, b, m, opt, [], num_steps=2, origins=origins)
    n1 = first_step_length(events, origins, layout)
    if n1 is None:  # an optimizer step that allocates nothing: the first step's stream alone tells
        n1 = len(event_stream(traces, layout, b, m, opt, [], num_steps=1)[0])
    static_total = sum(static.values())
    # the highest point of the whole run and of each step (first reached, as allocated_peak reports it)
    best = [(static_total, -1)] * 3
    for i, level in enumerate(levels(events, static_total)):
        for slot in (0, 1 if i < n1 else 2):
            if level > best[slot][0]:
                best[slot] = (level, i)
    states_weights = None
    tables = {}
    for name, (_lvl, at) in (("peak", best[0]), ("step1", best[1]), ("step2", best[2])):
        table = AttributionTable()
        params = _static_entries(profile, base, static, opt.master_bytes, table)
        if states_weights is None:
            states_weights = _states_by_group(profile, strategy, params)
        live = live_at(events, at)
        states_live = _add_live(table, live, origins, traces, layout, opt)
        for g, v in split_exact(states_live, _weights(states_weights, opt.state_bytes)).items():
            table.add(g, f"({g} optimizer states)" if g != OPTIMIZER else "(optimizer)", Cat.OPTIMIZER_STATES, v,
                      op="optimizer state", tensor=False)
        if name == "peak":
            _add_residual(table, peak.breakdown)
            overhead = int(prediction["peak_reserved_bytes"]) - int(prediction["peak_allocated_bytes"])
            table.add(RUNTIME, "(caching allocator)", Cat.ALLOCATOR_OVERHEAD, overhead, op="reserved - allocated",
                      tensor=False)
            table.add(RUNTIME, "(outside the allocator)", Cat.RUNTIME, int(prediction["runtime_bytes"]),
                      op="CUDA context, handles", tensor=False)
        group_order = [EMBEDDING, *base.attribution["stacks"], "between stacks", "head and loss", OPTIMIZER, RUNTIME,
                       UNPLACED]
        tables[name] = table.result(group_order, top)
        tables[name]["peak_allocated_bytes"] = _lvl
    out = tables["peak"]
    out["residual_bytes"] = peak.peak_bytes - best[0][0]
    out.update({"where": peak.where,
                "peak_allocated_bytes": peak.peak_bytes, "steps": [tables["step1"], tables["step2"]],
                "timeline": step_timeline(events[n1:], origins, layout, level_at(events, n1, static_total)),
                "timeline_first_step": step_timeline(events[:n1], origins, layout, static_total)})
    return out


UNPLACED = "unplaced (composition)"


def _add_residual(table: AttributionTable, breakdown: dict[MemoryCategory, int]) -> None:
    """Where the composed summaries (the plan's allocated peak) and the composed event stream disagree -- the
    stream frees, at the end of a micro-batch, bytes the summaries keep -- the difference per category is a row
    of its own, so the table still adds up to the plan's figures and the disagreement stays visible."""
    have: dict[str, int] = defaultdict(int)
    for (_g, _m, c), v in table.cells.items():
        have[c] += v
    for cat, v in breakdown.items():
        diff = v - have.get(str(cat), 0)
        if diff:
            table.cells[(UNPLACED, "(bytes the event stream does not place)", str(cat))] += diff


def _weights(by_group: dict[str, int], state_bytes: int) -> dict[str, int]:
    """Per-group state bytes, plus what no group's own trace makes (shared states) as the optimizer's."""
    weights = dict(by_group)
    rest = state_bytes - sum(weights.values())
    if rest > 0:
        weights[OPTIMIZER] = weights.get(OPTIMIZER, 0) + rest
    return weights


def _add_live(table: AttributionTable, live: dict[int, int], origins: dict[int, Any], traces: dict, layout: Any,
              opt: Any) -> int:
    """The step's live allocations into ``table``; returns the optimizer-state bytes among them (split later)."""
    states = 0
    forward = set(layout.forward)
    for k, size in live.items():
        inst, tkey = origins[k]
        if inst is None:
            if tkey in opt.state_keys:
                states += size
            else:
                table.add(OPTIMIZER, "(optimizer step)", Cat.TEMPORARIES, size, op="optimizer step",
                          phase="optimizer")
            continue
        trace = traces[inst.variant]
        alloc, grads, first = _record(trace)
        rec = trace.attribution
        stacks = rec["stacks"]
        module, op = alloc.get(tkey, ("", ""))
        cat = trace_index(trace).categories.get(tkey, Cat.TEMPORARIES)
        if tkey in grads:
            module = grads[tkey]
        phase = trace.segments[inst.segment].name
        group = group_of(module, phase, stacks, first, rec.get("order"))
        _, _, pattern = block_pattern(module, stacks)
        path = _at_position(module, stacks, inst.block[1] if inst.block is not None else None)
        direction = "forward" if inst in forward else "backward"
        table.add(group, pattern or "(root)", cat, size, op=op, phase=f"{direction}: {phase}",
                  tensor_path=path or "(root)")
    return states


def attach_to_plan(plan: Any, profile: Any, hardware: Any) -> None:
    """Put the chosen strategy's attribution into ``plan.prediction["attribution"]`` (single-GPU plans whose
    prediction is an estimate); a profile that cannot attribute leaves a note instead of failing the plan."""
    if plan.strategy.extra("sharding") is not None or "peak_at" not in plan.prediction:
        return
    try:
        attribution = predict_attribution(profile, plan.strategy, hardware=hardware, prediction=plan.prediction)
    except ValueError as exc:
        plan.notes.append(f"no memory attribution: {exc}")
        return
    if attribution["peak_allocated_bytes"] != int(plan.prediction["peak_allocated_bytes"]):
        plan.notes.append("no memory attribution: the plan's allocated peak is not the composed one")
        return
    plan.prediction["attribution"] = attribution
