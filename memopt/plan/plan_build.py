"""A single-GPU search's result as a ``Plan``: the chosen strategy, its runners-up and rejections, or, where nothing
fits, the smallest footprint and what allowing more would reach."""

from __future__ import annotations

from typing import Any

from memopt.errors import UserArgumentError
from memopt.estimate.store import EstimateStore
from memopt.hardware import HardwareSpec
from memopt.plan.context import search_context
from memopt.plan.evaluated import (
    Evaluated,
    SearchResult,
    rank,
    timing_peer,
    unestimated_notes,
    unestimated_reasons,
)
from memopt.plan.floors import state_floor
from memopt.plan.footprint import Estimates, min_footprint
from memopt.plan.policy import ALLOWANCES, Policy
from memopt.plan.schema import Plan
from memopt.profile.profile import Profile
from memopt.strategy import Checkpointing, Strategy
from memopt.techniques.quantization import extras_label, method_change_note
from memopt.techniques.registry import TECHNIQUES
from memopt.units import format_bytes

__all__ = ["alternative_plans", "build_plan"]


def _summary(ev: Evaluated) -> dict[str, Any]:
    est = ev.estimate
    return {"techniques": ev.strategy.to_dict(), "label": ev.strategy.label(), "fits": ev.fits,
            "total_bytes": ev.total_bytes, "step_time_s": est.step_time_s if est else None,
            "throughput": est.throughput if est else None}


def _rejections(best: Evaluated, evaluated: list[Evaluated], budget: int) -> tuple[dict[str, str], dict]:
    """For each technique, why its other values lost, and what the chosen value saves and costs."""
    rejected: dict[str, str] = {}
    savings: dict[str, dict[str, Any]] = {}
    chosen = best.strategy
    for technique in TECHNIQUES:
        f = technique.name
        mine = getattr(chosen, f)
        others = [e for e in evaluated if getattr(e.strategy, f) != mine
                  and (e.estimate is not None or e.floor_only or e.time_bound_s is not None)]
        if not others:
            continue
        reasons = []
        for value in sorted({_key(getattr(e.strategy, f)) for e in others}):
            group = [e for e in others if _key(getattr(e.strategy, f)) == value]
            fit = [e for e in group if e.fits]
            unsimulated = [e for e in group if e.fits is None and e.estimate is not None]
            bounded = [e.time_bound_s for e in group if e.time_bound_s is not None]
            if fit:
                b = min(fit, key=lambda e: e.estimate.step_time_s)
                slower = b.estimate.step_time_s / best.estimate.step_time_s
                reasons.append(f"{value}: best fitting plan {slower:.2f}x the chosen step time")
            elif unsimulated:
                b = min(unsimulated, key=lambda e: e.estimate.step_time_s)
                slower = b.estimate.step_time_s / best.estimate.step_time_s
                reasons.append(f"{value}: {slower:.2f}x the chosen step time at best")
            elif bounded:
                reasons.append(f"{value}: at least {min(bounded) / best.estimate.step_time_s:.2f}x the chosen "
                               "step time (a lower bound; not traced)")
            else:
                smallest = min(group, key=lambda e: e.total_bytes)
                reasons.append(f"{value}: needs {format_bytes(smallest.total_bytes)} + margin at the least "
                               f"(budget {format_bytes(budget)})")
        rejected[f] = "; ".join(reasons)
        # the same plan with this technique at its "off" value: what the choice saves and costs
        off = technique.off
        if off is None or _key(off) == _key(mine):
            continue
        twin = next((e for e in evaluated if e.estimate is not None and e.strategy == chosen.replace(**{f: off})),
                    None)
        if twin is not None:
            savings[f] = {"saves_bytes": twin.estimate.total_bytes - best.estimate.total_bytes,
                          "costs_s": best.estimate.step_time_s - twin.estimate.step_time_s}
    return rejected, savings


def _key(value: Any) -> str:
    return value.label() if isinstance(value, Checkpointing) else str(value)


def _level_name(level: tuple[tuple[str, Any], ...]) -> str:
    return extras_label(Strategy(extras=level)) if level else "full fine-tuning"


def _method_notes(best: Evaluated, result: SearchResult, budget: int, notes: list[str],
                  rejected: dict[str, str]) -> None:
    """Say that the training method changed, and why each higher-fidelity level was passed over."""
    reasons = []
    for level in result.levels_tried[:-1]:
        group = [e.total_bytes for e in result.evaluated + result.floored if e.strategy.extras == level]
        smallest = result.level_minimums.get(level)
        if smallest is not None:
            group.append(smallest)
        need = f"needs {format_bytes(min(group))} + margin at the least" if group else "nothing could be estimated"
        reasons.append(f"{_level_name(level)}: {need} (budget {format_bytes(budget)})")
    note = method_change_note(best.strategy)
    if note:
        notes.append(note + (" Chosen because nothing of higher fidelity fits: " + "; ".join(reasons) + "."
                             if reasons else " Chosen by the pins adapter_rank / quant_bits."))
    if reasons:
        rejected["extras"] = "; ".join(reasons)


def build_plan(prof: Profile, hw: HardwareSpec, budget: int, pol: Policy, result: SearchResult, notes: list[str],
               seconds: float, store: EstimateStore | None = None, floors_only: bool = False) -> Plan:
    """The plan of a single-GPU search; where nothing fits, the report of the smallest footprint and of what
    allowing more would reach (``floors_only``: those reaches as trace-free model-state floors, not estimated)."""
    margin = pol.margin(budget)
    model = {"name": prof.model_name, "class": prof.model_class, "num_params": prof.num_params,
             "num_trainable_params": prof.num_trainable_params, "sample": prof.sample, "profile_key": prof.key}
    search_info = {"candidates": result.num_candidates, "evaluated": len(result.evaluated),
                   "pruned_as_slower": result.pruned_slower, "pruned_as_too_big": result.pruned_too_big,
                   "seconds": seconds, "search_s": result.seconds, "profile_trace_s": prof.trace_s}
    global_batch = int(prof.sample["batch_size"])
    notes = notes + [n for n in unestimated_notes(result) if n not in notes]
    if result.best is not None:
        best = result.best
        rejected, savings = _rejections(best, result.evaluated + result.floored + result.slower, budget)
        if best.strategy.extras:
            _method_notes(best, result, budget, notes, rejected)
        feasible = [e for e in result.feasible if e is not best]
        return Plan(fits=True, strategy=best.strategy, budget_bytes=budget, margin_bytes=margin,
                    prediction=best.estimate.to_dict(), model=model, hardware=hw.name, policy=pol.to_dict(),
                    global_batch=global_batch, runners_up=[_summary(e) for e in feasible[:3]], rejected=rejected,
                    savings=savings, search=search_info, notes=notes)
    # nothing fits: report the smallest reachable footprint and what to allow to go lower
    ctx = search_context(prof, hw, global_batch, pol, False)
    estimates = Estimates(prof, hw, result.evaluated, store=store)
    smallest = min_footprint(prof, hw, pol, ctx, budget, estimates)
    relax = []
    for allowance in ALLOWANCES:
        if allowance in pol.allow:
            continue
        relaxed = pol.relaxed(allowance)
        if allowance == "quantized_weights" and "adapters" not in pol.allow:
            relaxed, allowance = relaxed.relaxed("adapters"), "adapters+quantized_weights"  # QLoRA needs both
        try:
            ev = min_footprint(prof, hw, relaxed, ctx, budget, estimates, floors_only=floors_only, first_fit=True)
        except UserArgumentError:
            raise
        except ValueError:
            continue  # e.g. peft or bitsandbytes not installed
        if ev is not None and smallest is not None and ev.total_bytes < smallest.total_bytes:
            # a floor under the budget says nothing of fitting: not estimated
            fits = ev.fits if not ev.floor_only or ev.total_bytes + margin > budget else None
            relax.append({"allow": allowance, "reaches_bytes": ev.total_bytes, "fits": fits,
                          "lower_bound": ev.floor_only})
    reach = smallest.total_bytes if smallest is not None else None
    bound = smallest is not None and smallest.floor_only
    message = (f"needs {'at least ' if bound else ''}{format_bytes(reach)} with every allowed technique"
               f"{', for its model states alone plus the CUDA runtime (no activations yet)' if bound else ''} "
               f"(budget {format_bytes(budget)}, "
               f"margin {format_bytes(margin)})" if reach is not None else _unestimated_message(result))
    for r in relax:
        if not r["lower_bound"]:
            message += f"; allowing {r['allow']} reaches {format_bytes(r['reaches_bytes'])}"
        elif r["fits"] is None:
            message += (f"; allowing {r['allow']}: its model states and the CUDA runtime take "
                        f"{format_bytes(r['reaches_bytes'])} (not estimated further)")
        else:
            message += f"; allowing {r['allow']} still needs at least {format_bytes(r['reaches_bytes'])}"
    if reach is not None and not any(r["fits"] for r in relax):
        message += "; beyond that: more GPUs (sharding), CPU/NVMe offload of model states, or a smaller batch"
    chosen = smallest if smallest is not None else (result.evaluated[0] if result.evaluated else None)
    if chosen is not None and chosen.estimate is not None:
        prediction = chosen.estimate.to_dict()
    elif chosen is not None and chosen.floor_only:
        prediction = state_floor(prof, chosen.strategy, hw).prediction()
    else:
        prediction = {"peak_allocated_bytes": 0, "peak_reserved_bytes": 0, "runtime_bytes": 0, "total_bytes": 0,
                      "step_time_s": 0.0, "breakdown": {}}
    return Plan(fits=False, strategy=chosen.strategy if chosen else Strategy(), budget_bytes=budget,
                margin_bytes=margin, prediction=prediction, model=model, hardware=hw.name, policy=pol.to_dict(),
                global_batch=global_batch, infeasible={"message": message, "smallest_total_bytes": reach,
                                                       "smallest_is_lower_bound": bound, "relaxations": relax},
                search=search_info, notes=notes)


def _unestimated_message(result: SearchResult) -> str:
    """Why a plan has no estimate at all: not memory, but a technique the model cannot take (a pin that forces it)."""
    reasons = [reason for reason, _ in unestimated_reasons(result)]
    return "no candidate could be estimated" + (f": {'; '.join(reasons)}" if reasons else "")


def alternative_plans(chosen: Plan, result: SearchResult, within: float, *, limit: int = 3) -> list[Plan]:
    """The search's fitting timing peers of the chosen plan (``memopt.plan.search.timing_peer``) predicted within
    ``within`` of its step time, fastest first, at most ``limit``: each a plan of its own, with the chosen plan's
    model, policy and notes (what the autotune measures and may keep). One per shape of step (checkpointing mode,
    micro-batch size, activation offload), the chosen plan standing for its own: what the clock predicts worst is
    the host's overhead per micro-batch and per checkpointed block, while a block more or less at the same shape is
    a difference of a few percent, inside the measurement's own noise."""
    if not chosen.fits or result.best is None or result.best.strategy != chosen.strategy:
        return []
    best = result.best
    top = rank(best) * (1.0 + within)
    picked: list[Evaluated] = []
    seen = {_shape(chosen.strategy)}
    for ev in sorted(result.feasible, key=rank):
        shape = _shape(ev.strategy)
        if ev is best or not ev.fits or ev.estimate is None or shape in seen or rank(ev) > top \
                or not timing_peer(ev.strategy, best.strategy):
            continue
        seen.add(shape)
        picked.append(ev)
        if len(picked) == limit:
            break
    # each one's runners-up are the planner's choice and the other alternatives, should the autotune keep it
    return [Plan(fits=True, strategy=ev.strategy, budget_bytes=chosen.budget_bytes, margin_bytes=chosen.margin_bytes,
                 prediction=ev.estimate.to_dict(), model=dict(chosen.model), hardware=chosen.hardware,
                 policy=chosen.policy, global_batch=chosen.global_batch,
                 runners_up=[_summary(e) for e in [best, *picked] if e is not ev], search=dict(chosen.search),
                 notes=list(chosen.notes)) for ev in picked]


def _shape(s: Strategy) -> tuple[str, int, bool]:
    return s.checkpointing.mode, s.micro_batch_size, s.activation_offload
