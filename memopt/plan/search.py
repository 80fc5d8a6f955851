"""The search: the fastest strategy whose predicted total plus the safety margin fits the budget.

Every combination of the techniques' options is a candidate (thousands). Each gets an optimistic step
time from the plain trace of the default precision (its micro-batch size's cost, rescaled to the
candidate's precision, plus what its techniques must at least add: recomputation, offload copies).
Candidates are evaluated in that order, so nothing is traced that cannot win:

* a candidate is *pruned as slower* once ``runners_up + 1`` fitting candidates are all faster than its
  optimistic time (provably: its real time can only be higher);
* a candidate is *pruned as too big* when one that needs no more memory in every respect (same
  precision and optimizer, no larger micro-batch, at least as much checkpointing, offload and chunking)
  already exceeded the budget in allocated bytes, or when its model states alone (weights, gradients, optimizer
  states, plus what the CUDA runtime holds) exceed it: a floor that needs no trace (``memopt.plan.floors``);
* otherwise it is estimated exactly; the caching allocator is simulated only when its allocated bytes
  fit and it would enter the top ``runners_up + 1`` by time.

Adapters and quantized weights (``Strategy.extras``) are searched as a ladder of fidelity levels
(:func:`extras_levels`, which the registry's leveled techniques compose): full fine-tuning first, then LoRA,
then LoRA on an 8-bit base, then on a 4-bit base. A level is searched only when no candidate of the levels before
it fits.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

from memopt.errors import UserArgumentError
from memopt.estimate.allocator_sim import EventStreamError
from memopt.estimate.estimator import CappedOOM, estimate_strategy
from memopt.hardware import HardwareSpec
from memopt.plan.evaluated import UNESTIMATED, Evaluated, SearchResult, rank, timing_peer
from memopt.plan.floors import FLOOR_REASON, state_floor
from memopt.plan.policy import Policy
from memopt.plan.search_bounds import no_bigger, optimistic_time, refined_time, twin_time
from memopt.profile.profile import Profile, VariantFailed
from memopt.strategy import Checkpointing, Strategy
from memopt.techniques.protocol import SearchContext
from memopt.techniques.registry import TECHNIQUES, extras_ladder

__all__ = ["bisect_blocks", "candidates", "checkpointed_blocks", "evaluate", "extras_levels", "search"]

def extras_levels(ctx: SearchContext, policy: Policy) -> list[tuple[tuple[str, Any], ...]]:
    """The ``Strategy.extras`` levels the policy admits, highest fidelity first: none (full fine-tuning), LoRA,
    LoRA on an 8-bit base, LoRA on a 4-bit NF4 base, as the registry's leveled techniques compose them
    (``memopt.techniques.extras.extras_ladder``). Pins ``adapter_rank`` (0: none) and ``quant_bits``
    (0: unquantized) select levels; the rank is the pinned one or ``DEFAULT_ADAPTER_RANK``. Raises
    ``ValueError`` when a pin asks for adapters or quantization that is not installed."""
    return extras_ladder(ctx, policy)


def checkpointed_blocks(ck: Checkpointing, block_counts: tuple[int, ...]) -> int:
    """The block count a ``checkpoint_blocks`` pin names for ``ck``: 0 for no checkpointing (a pin of 0 blocks
    is the plan that checkpoints none), else its own count or every block of the largest stack."""
    if ck.mode == "none":
        return 0
    return ck.num_blocks if ck.num_blocks is not None else max(block_counts, default=0)


def candidates(ctx: SearchContext, policy: Policy,
               extras: tuple[tuple[str, Any], ...] | None = None) -> list[Strategy]:
    """Every combination of the options the policy allows, with ``extras`` (None: every level of
    :func:`extras_levels`)."""
    levels = extras_levels(ctx, policy) if extras is None else [extras]
    options: dict[str, list[Any]] = {}
    for tech in TECHNIQUES:
        values = tech.options(ctx)
        if tech.name == "checkpointing":
            mode = policy.pins.get("checkpointing")
            blocks = policy.pins.get("checkpoint_blocks")
            forbidden = set(policy.forbid.get("checkpointing", ()))
            values = [v for v in values if (mode is None or v.mode == mode) and v.mode not in forbidden
                      and (blocks is None or checkpointed_blocks(v, ctx.block_counts) == blocks)]
            if mode in ("full", "selective") and blocks is not None and not values:
                values = [Checkpointing(mode=mode, num_blocks=blocks)]
        else:
            if tech.name in policy.pins and policy.pins[tech.name] not in values:
                values = [policy.pins[tech.name]]  # a pin outside the default options (e.g. chunked_ce=32)
            values = [v for v in values if policy.allows(tech.name, v)]
        options[tech.name] = values
    names = list(options)
    out = []
    for level in levels:
        for combo in itertools.product(*(options[n] for n in names)):
            d = dict(zip(names, combo))  # each searched technique owns the Strategy field of its name
            s = Strategy(**d, grad_accum_steps=ctx.global_batch // d["micro_batch_size"], extras=level)
            if all(tech.admits(s, ctx) for tech in TECHNIQUES):
                out.append(s)
    return out


def search(profile: Profile, hw: HardwareSpec, budget_bytes: int, policy: Policy, ctx: SearchContext,
           *, runners_up: int = 3, base_group: str = "amp",
           level_check: Callable[[tuple[tuple[str, Any], ...]], tuple[bool, int | None]] | None = None,
           keep_within: float | None = None) -> SearchResult:
    """The fastest fitting strategy of the first extras level (:func:`extras_levels`) where any fits.

    ``level_check(level)`` -> (whether the level's smallest footprint fits, that footprint): a level that cannot
    fit is skipped without searching it (the last level is always searched, for the infeasibility report).
    ``keep_within``: also estimate every :func:`timing_peer` of the fastest whose step time may be within that
    fraction of it, and bisect the block count of each micro-batch size's fastest among them, so that
    ``result.feasible`` holds all the plans the clock cannot tell apart from the best (what the autotune measures,
    without a re-plan per candidate). The best and the runners-up are the same with or without it."""
    levels = extras_levels(ctx, policy)
    result = SearchResult(best=None, evaluated=[], num_candidates=0, pruned_slower=0, pruned_too_big=0, seconds=0.0)
    for i, level in enumerate(levels):
        result.levels_tried.append(level)
        if level_check is not None and i < len(levels) - 1:
            t0 = time.perf_counter()
            ok, smallest = level_check(level)
            result.seconds += time.perf_counter() - t0
            if not ok:
                result.level_minimums[level] = smallest
                continue
        r = _search_level(profile, hw, budget_bytes, policy, ctx, level, runners_up=runners_up,
                          base_group=base_group, keep_within=keep_within)
        result.best, result.feasible = r.best, r.feasible
        result.evaluated += r.evaluated
        result.floored += r.floored
        result.slower += r.slower
        result.num_candidates += r.num_candidates
        result.pruned_slower += r.pruned_slower
        result.pruned_too_big += r.pruned_too_big
        result.seconds += r.seconds
        if result.best is not None:
            break
    return result


def _search_level(profile: Profile, hw: HardwareSpec, budget_bytes: int, policy: Policy, ctx: SearchContext,
                  level: tuple[tuple[str, Any], ...], *, runners_up: int, base_group: str,
                  keep_within: float | None = None) -> SearchResult:
    start = time.perf_counter()
    cands = candidates(ctx, policy, level)
    margin = policy.margin(budget_bytes)
    total_blocks = max(profile.full_block_counts, default=0)
    if base_group == "amp" and not hw.supports_bf16:
        base_group = "fp32"
    cache: dict = {}
    try:
        bounds = sorted((optimistic_time(profile, s, hw, base_group, cache), i) for i, s in enumerate(cands))
    except VariantFailed:
        if base_group == "fp32":
            raise
        # the model cannot take a step in mixed precision (an op without a bf16 kernel): bound from fp32; the
        # mixed-precision candidates are then refused one by one with the reason
        base_group, cache = "fp32", {}
        bounds = sorted((optimistic_time(profile, s, hw, base_group, cache), i) for i, s in enumerate(cands))
    evaluated: list[Evaluated] = []
    top: list[Evaluated] = []  # fitting, by time
    too_big: list[Strategy] = []
    floored: list[Evaluated] = []
    slower: list[Evaluated] = []
    uncapped: dict[Strategy, float] = {}  # step times estimated without the hard cap's retries
    floors: dict = {}
    pruned_big = 0

    def threshold(s: Strategy) -> float:
        """The time above which ``s`` cannot matter: slower than the runners-up, and (``keep_within``) than the
        tolerance around the fastest when ``s`` is its timing peer."""
        if len(top) <= runners_up:
            return float("inf")
        limit = rank(top[runners_up])
        if keep_within is not None and timing_peer(s, top[0].strategy):
            limit = max(limit, rank(top[0]) * (1.0 + keep_within))
        return limit

    for n, (bound, i) in enumerate(bounds):
        s = cands[i]
        if bound > threshold(s):
            if keep_within is None or bound > threshold(top[0].strategy):  # no later candidate can matter either
                slower += [_slower(cands[j], b) for b, j in bounds[n:]]
                break
            slower.append(_slower(s, bound))
            continue
        if any(no_bigger(t, s, total_blocks) for t in too_big):
            pruned_big += 1
            continue
        floor = state_floor(profile, s, hw, floors).total_bytes
        if floor + margin > budget_bytes:  # its allocated bytes would exceed the budget: nothing to trace
            pruned_big += 1
            too_big.append(s)
            floored.append(Evaluated(s, None, False, floor, FLOOR_REASON, floor_only=True))
            continue
        limit = threshold(s)
        if limit < float("inf"):
            # its host time, its optimizer step, or the same plan without a technique that only adds work, is
            # already slower than the runners-up
            bound = twin_time(s, uncapped)
            if bound <= limit:
                bound = max(bound, refined_time(profile, s, hw, base_group, cache, limit))
            if bound > limit:
                slower.append(_slower(s, bound))
                continue
        ev = _evaluate(profile, s, hw, budget_bytes, margin, limit)
        evaluated.append(ev)
        if ev.estimate is not None and not ev.estimate.detail.get("capped"):
            uncapped[s] = ev.estimate.step_time_s
        if ev.fits is False and ev.reason.startswith("allocated"):
            too_big.append(s)
        if ev.fits:
            top.append(ev)
            top.sort(key=rank)
    if top and policy.allows("checkpointing", "full"):
        for ev in _refine_blocks(profile, hw, budget_bytes, margin, top[0], cands, total_blocks):
            evaluated.append(ev)
            if ev.fits:
                top.append(ev)
        top.sort(key=rank)
        # the neighbours' refinement widens what the autotune measures, never the plan itself (the dry run's choice)
        for neighbour in _micro_batch_bests(top, keep_within):
            for ev in _refine_blocks(profile, hw, budget_bytes, margin, neighbour, cands, total_blocks):
                evaluated.append(ev)
                if ev.fits:
                    top.insert(1, ev)
        top[1:] = sorted(top[1:], key=rank)
    return SearchResult(best=top[0] if top else None, evaluated=evaluated, num_candidates=len(cands),
                        pruned_slower=len(slower), pruned_too_big=pruned_big, seconds=time.perf_counter() - start,
                        feasible=top, floored=floored, slower=slower)


SLOWER_REASON = "slower than the runners-up by a lower bound of its step time (not traced)"


def _slower(s: Strategy, bound_s: float) -> Evaluated:
    return Evaluated(s, None, None, 0, SLOWER_REASON, time_bound_s=bound_s)


def _micro_batch_bests(top: list[Evaluated], keep_within: float | None) -> list[Evaluated]:
    """With ``keep_within``: the fastest fully checkpointed peer of the best at each other micro-batch size, within
    the tolerance (their block counts are bisected as the best's are: a neighbour in micro-batch is where a faster
    plan hides when the clock is off)."""
    if keep_within is None or not top:
        return []
    best = top[0]
    limit = rank(best) * (1.0 + keep_within)
    out: dict[int, Evaluated] = {}
    for ev in sorted(top[1:], key=rank):
        s = ev.strategy
        if s.checkpointing.mode == "full" and timing_peer(s, best.strategy) and rank(ev) <= limit \
                and s.micro_batch_size != best.strategy.micro_batch_size:
            out.setdefault(s.micro_batch_size, ev)
    return list(out.values())


def _refine_blocks(profile: Profile, hw: HardwareSpec, budget_bytes: int, margin: int, best: Evaluated,
                   cands: list[Strategy], total_blocks: int) -> list[Evaluated]:
    """The options checkpoint 1/8, 2/8, ... of the blocks. When the fastest plan checkpoints k of them and the
    next coarser option below k (fewer blocks) did not fit, the fewest blocks between the two that still fit, by
    bisection (memory falls as blocks are checkpointed; each block left alone saves its recomputation). Found
    on gpt2_medium at 12 GiB: every block checkpointed at 78% of the budget where 22 of 24 would have fitted."""
    ck = best.strategy.checkpointing
    if ck.mode != "full" or total_blocks < 2:
        return []
    k_best = ck.count(total_blocks)
    same = best.strategy.replace(checkpointing=Checkpointing())
    coarse = {c.checkpointing.count(total_blocks) for c in cands
              if c.checkpointing.mode != "selective" and c.replace(checkpointing=Checkpointing()) == same}
    lo = max((k for k in coarse if k < k_best), default=None)
    done: dict[int, Evaluated] = {}

    def at(k: int) -> Evaluated:
        if k not in done:
            done[k] = _evaluate(profile, best.strategy.replace(checkpointing=Checkpointing(mode="full", num_blocks=k)),
                                hw, budget_bytes, margin, float("inf"))
        return done[k]

    # twice: the fewest that fit outright, and the fewest that fit under the hard cap (whose allocator retries
    # cost time, so either may be the faster)
    for ok in (lambda e: bool(e.fits) and not (e.estimate and e.estimate.detail.get("capped")), lambda e: bool(e.fits)):
        bisect_blocks(lo, k_best, lambda k, ok=ok: ok(at(k)))
    return list(done.values())


def bisect_blocks(lo: int | None, hi: int, fits: Callable[[int], bool]) -> int:
    """The fewest checkpointed blocks in (``lo``, ``hi``] that fit, given that ``hi`` fits and ``lo`` does not
    (memory falls as blocks are checkpointed), by bisection; ``fits(k)`` evaluates k. ``lo`` None: ``hi``."""
    while lo is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _evaluate(profile: Profile, s: Strategy, hw: HardwareSpec, budget_bytes: int, margin: int,
              contender_below: float) -> Evaluated:
    """Memory and time of ``s``: the allocator is simulated only where its allocated bytes fit and its uncapped time
    is below ``contender_below`` (the time of plans that cannot matter)."""
    try:
        quick = estimate_strategy(profile, s, hardware=hw, exact_reserved=False)
    except (EventStreamError, UserArgumentError):
        raise
    except ValueError as exc:
        return Evaluated(s, None, False, 0, f"{UNESTIMATED}{exc}")
    allocated_total = quick.peak_allocated_bytes + quick.runtime_bytes
    if allocated_total + margin > budget_bytes:
        return Evaluated(s, quick, False, allocated_total, "allocated bytes alone exceed the budget")
    if quick.step_time_s >= contender_below:
        return Evaluated(s, quick, None, allocated_total, "not a contender (slower than the runners-up)")
    ev = evaluate(profile, s, hw, budget_bytes, margin)
    if ev.fits is False and ev.estimate is not None:
        return _under_cap(profile, s, hw, budget_bytes, margin, ev)
    return ev


def _under_cap(profile: Profile, s: Strategy, hw: HardwareSpec, budget_bytes: int, margin: int,
               uncapped: Evaluated) -> Evaluated:
    """A candidate whose uncapped reserved peak is over the budget while its allocated peak fits: ``memopt.wrap``
    runs it under the hard cap, where the caching allocator flushes its cache and retries instead of growing (on
    the H200, bert-large at 12 GiB trained at micro-batch 32 with 10.8 GiB reserved and 5 retries where the
    uncapped replay reserves 11.9 GiB). Replayed under the cap less the margin: it fits if the replay never runs
    out, with the capped run's reserved bytes and the retries' cost in its step time."""

    cap = budget_bytes - margin - uncapped.estimate.runtime_bytes
    try:
        capped = estimate_strategy(profile, s, hardware=hw, exact_reserved=True, num_steps=2, cap_bytes=cap)
    except CappedOOM:
        return uncapped
    return Evaluated(s, capped, True, capped.total_bytes, "")


def evaluate(profile: Profile, s: Strategy, hw: HardwareSpec, budget_bytes: int, margin: int,
             stop_above: int | None = None) -> Evaluated:
    """Exact memory (allocator simulated) and time of one candidate (``stop_above``: see ``estimate_strategy``,
    whose ``TotalAbove`` passes through)."""
    try:
        exact = estimate_strategy(profile, s, hardware=hw, exact_reserved=True, num_steps=2, stop_above=stop_above)
    except (EventStreamError, UserArgumentError):
        raise
    except ValueError as exc:
        return Evaluated(s, None, False, 0, f"{UNESTIMATED}{exc}")
    fits = exact.total_bytes + margin <= budget_bytes
    return Evaluated(s, exact, fits, exact.total_bytes, "" if fits else "reserved bytes exceed the budget")
