"""What the search records of each candidate (:class:`Evaluated`, :class:`SearchResult`), how two candidates compare
(:func:`rank`, :func:`timing_peer`), and why some could not be estimated."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from memopt.estimate.estimator import Estimate
from memopt.profile.profile import STEP_FAILS
from memopt.strategy import Strategy
from memopt.techniques.registry import TECHNIQUES

__all__ = ["ALTERNATIVES_WITHIN", "UNESTIMATED", "Evaluated", "SearchResult", "complexity", "rank", "timing_peer",
           "unestimated_notes", "unestimated_reasons"]

# plans predicted this close to the fastest cannot be told apart by the clock (its held-out error per row is about
# 10%): the autotune measures them on the GPU
ALTERNATIVES_WITHIN = 0.15


@dataclass
class Evaluated:
    strategy: Strategy
    estimate: Estimate | None
    fits: bool | None  # None: allocated bytes fit but the allocator was not simulated (not a contender)
    total_bytes: int
    reason: str = ""
    floor_only: bool = False  # total_bytes is only a lower bound (pruned by its state floor, never estimated)
    time_bound_s: float | None = None  # pruned as slower: a lower bound of its step time (never estimated)


@dataclass
class SearchResult:
    best: Evaluated | None
    evaluated: list[Evaluated]
    num_candidates: int
    pruned_slower: int
    pruned_too_big: int
    seconds: float
    feasible: list[Evaluated] = field(default_factory=list)
    floored: list[Evaluated] = field(default_factory=list)  # pruned as too big by their state floor (not estimated)
    slower: list[Evaluated] = field(default_factory=list)  # pruned as slower by a bound of their time (not estimated)
    levels_tried: list[tuple[tuple[str, Any], ...]] = field(default_factory=list)  # extras levels, in order
    # levels skipped because their smallest footprint (bytes, None: not estimable) does not fit
    level_minimums: dict[tuple[tuple[str, Any], ...], int | None] = field(default_factory=dict)


def complexity(s: Strategy) -> int:
    """How many techniques a strategy switches on (ties in predicted time go to the simpler plan)."""
    return sum(t.engaged(s) for t in TECHNIQUES) + len(s.extras)


def rank(e: Evaluated) -> float:
    """Predicted step time, with a 0.2% preference per technique left off."""
    return e.estimate.step_time_s * (1.0 + 0.002 * complexity(e.strategy))


def timing_peer(a: Strategy, b: Strategy) -> bool:
    """Whether the autotune may measure ``a`` against ``b`` in one process: the same optimizer, allocator mode (set
    once, when CUDA starts), precision and training method or engine (``extras``: a timing never changes what is
    trained or where the model states live)."""
    return (a.optimizer, a.expandable_segments, a.precision, a.extras) == \
        (b.optimizer, b.expandable_segments, b.precision, b.extras)


UNESTIMATED = "cannot be estimated: "
_STEP_FAILS = re.compile(re.escape(STEP_FAILS) + r"(?P<variant>.+?) \((?P<cause>.*)\)$")


def unestimated_notes(result: SearchResult) -> list[str]:
    """What the plan must say about candidates that could not be estimated (a technique refused for this model):
    each distinct reason once, with how many candidates it removed (:func:`unestimated_reasons`)."""
    return [f"{n} candidate(s) not considered, they cannot be estimated: {reason}"
            for reason, n in unestimated_reasons(result)]


def unestimated_reasons(result: SearchResult) -> list[tuple[str, int]]:
    """(reason, candidates it removed) for the candidates that could not be estimated; a model step that fails the
    same way under several variants is one reason, naming the variants. Internal errors are not among them: they
    propagate (``EventStreamError``), so no candidate disappears without a word."""
    counts: dict[str, int] = {}
    variants: dict[str, list[str]] = {}
    for ev in result.evaluated:
        if ev.reason.startswith(UNESTIMATED):
            reason = ev.reason.removeprefix(UNESTIMATED)
            failed = _STEP_FAILS.match(reason)
            if failed:
                reason = f"the model's step fails ({failed['cause']})"
                seen = variants.setdefault(reason, [])
                if failed["variant"] not in seen:
                    seen.append(failed["variant"])
            counts[reason] = counts.get(reason, 0) + 1
    reasons = []
    for reason, n in counts.items():
        named = variants.get(reason, [])
        if named:
            more = f" and {len(named) - 3} more" if len(named) > 3 else ""
            reason += f" under {', '.join(named[:3])}{more}"
        reasons.append((reason, n))
    return reasons
