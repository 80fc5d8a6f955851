"""The smallest footprint a policy reaches, from estimates shared over the search and the infeasibility report."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from memopt.errors import UserArgumentError
from memopt.estimate.allocator_sim import EventStreamError
from memopt.estimate.estimator import Estimate, TotalAbove, estimate_strategy
from memopt.estimate.store import EstimateStore
from memopt.hardware import HardwareSpec
from memopt.plan.evaluated import Evaluated
from memopt.plan.floors import FLOOR_REASON, state_floor
from memopt.plan.policy import Policy
from memopt.plan.search import candidates, evaluate
from memopt.profile.profile import Profile
from memopt.strategy import Strategy
from memopt.techniques.optimizers import states_per_item
from memopt.techniques.protocol import SearchContext
from memopt.techniques.registry import extras_saving

__all__ = ["Estimates", "level_fits", "min_footprint"]


class Estimates:
    """Estimates of one profile and hardware by strategy, quick (allocated bytes) and exact (allocator simulated):
    the infeasibility report asks for the same candidates under several policies, and the search has estimated
    some of them already. An estimate does not depend on the budget; ``fits`` is decided per call."""

    def __init__(self, prof: Profile, hw: HardwareSpec, seed: Sequence[Evaluated] = (),
                 store: EstimateStore | None = None) -> None:
        self.prof, self.hw = prof, hw
        self.store = store  # estimates of earlier plans of this profile (memopt.estimate.store)
        self.quick: dict[Strategy, Estimate | None] = {}
        self.exact: dict[Strategy, Evaluated] = {}
        self.above: dict[Strategy, int] = {}  # lower bounds of exact totals (replays stopped early), -1: none
        self.floors: dict = {}  # state_floor's cache
        for ev in seed:  # the allocated peak and runtime of an exact estimate are those of the quick one
            if ev.estimate is not None:
                self.quick[ev.strategy] = ev.estimate
                if ev.estimate.reserved_exact:
                    self.exact[ev.strategy] = ev

    def allocated_total(self, s: Strategy) -> int | None:
        """Allocated peak plus runtime bytes (a lower bound of the exact total), None if it cannot be estimated."""
        if s not in self.quick:
            stored = self.store.get(s, self.hw, exact=False) if self.store is not None else None
            if stored is not None:
                self.quick[s] = stored
            else:
                try:
                    self.quick[s] = estimate_strategy(self.prof, s, hardware=self.hw, exact_reserved=False)
                except (EventStreamError, UserArgumentError):
                    raise
                except ValueError:
                    self.quick[s] = None
                if self.store is not None and self.quick[s] is not None:
                    self.store.put(s, self.hw, False, self.quick[s])
        q = self.quick[s]
        return None if q is None else q.peak_allocated_bytes + q.runtime_bytes

    def _exceeds(self, s: Strategy) -> int:
        """A total that ``s``'s exact total is known to reach (a replay stopped there, in this plan or a stored
        earlier one), -1 when none is known."""
        if s not in self.above:
            stored = self.store.get_bound(s, self.hw) if self.store is not None else None
            self.above[s] = -1 if stored is None else stored
        return self.above[s]

    def evaluate(self, s: Strategy, budget: int, margin: int, at_most: int | None = None) -> Evaluated | None:
        """The exact estimate of ``s``; with ``at_most``, None when its total is provably above that (the
        allocator replay stops there, and the bound it reached is kept for later calls)."""
        ev = self.exact.get(s)
        if ev is None:
            if at_most is not None and self._exceeds(s) > at_most:
                return None
            stored = self.store.get(s, self.hw, exact=True) if self.store is not None else None
            if stored is not None:
                ev = Evaluated(s, stored, None, stored.total_bytes)
            else:
                try:
                    ev = evaluate(self.prof, s, self.hw, budget, margin, stop_above=at_most)
                except TotalAbove as exc:
                    self.above[s] = max(self._exceeds(s), exc.total_bytes)
                    if self.store is not None:
                        self.store.put_bound(s, self.hw, self.above[s])
                    return None
                if self.store is not None and ev.estimate is not None:
                    self.store.put(s, self.hw, True, ev.estimate)
            self.exact[s] = ev
        if ev.estimate is None:
            return ev
        fits = ev.total_bytes + margin <= budget
        return Evaluated(s, ev.estimate, fits, ev.total_bytes, "" if fits else "reserved bytes exceed the budget")


def level_fits(prof: Profile, hw: HardwareSpec, pol: Policy, ctx: SearchContext, budget: int,
               level: tuple, estimates: Estimates) -> tuple[bool, int | None]:
    """Whether anything of this extras level may fit, and the smallest total found (``min_footprint``: the
    trace-free floor of its model states when that exceeds the budget, else from estimates)."""
    margin = pol.margin(budget)
    cands = candidates(dataclasses.replace(ctx, max_micro_batch=1), pol, level)
    if not cands:
        return False, None
    ev = min_footprint(prof, hw, pol, ctx, budget, estimates, level=level)
    if ev is None:
        return False, None
    if ev.floor_only:  # the level's model states alone exceed the budget
        return False, ev.total_bytes
    # the extremes are near the level's smallest footprint, not provably at it (a plan without offload, or with
    # a larger micro-batch, can be a little smaller): a level within 5% of fitting is searched in full
    return ev.total_bytes + margin <= budget * _LEVEL_SKIP_SLACK, ev.total_bytes


_LEVEL_SKIP_SLACK = 1.05


def min_footprint(prof: Profile, hw: HardwareSpec, pol: Policy, ctx: SearchContext, budget: int,
                  estimates: Estimates | None = None, level: tuple | None = None,
                  floors_only: bool = False, first_fit: bool = False) -> Evaluated | None:
    """The smallest total the policy can reach at extras ``level`` (None: any level), from the most memory-saving
    value of every technique. When even the smallest model-state floor (``memopt.plan.floors``) of the policy's
    candidates exceeds the budget (or with ``floors_only``), that floor, as a ``floor_only`` lower bound: nothing
    is traced or simulated.

    Of the candidates considered, the one with the smallest exact total wins (the first in candidate order on a
    tie). Their allocated totals are lower bounds of the exact ones, so candidates are simulated in the order of
    those bounds and the rest are skipped once a bound cannot beat the best found.

    ``first_fit`` (what allowing more would reach): the candidate likeliest to fit (bf16 compute, no activation
    offload) is estimated first, and if it fits it is the answer: a footprint the policy reaches and that fits,
    not necessarily its smallest (a 70B model's QLoRA candidates took 20 s to trace in full)."""
    cands = candidates(dataclasses.replace(ctx, max_micro_batch=1), pol, level)
    if not cands:
        return None
    est = estimates if estimates is not None else Estimates(prof, hw)
    margin = pol.margin(budget)
    floor, at = min((state_floor(prof, s, hw, est.floors).total_bytes, i) for i, s in enumerate(cands))
    if floor + margin > budget or floors_only:  # every candidate's model states exceed the budget: no trace
        return Evaluated(cands[at], None, None if floor + margin <= budget else False, floor, FLOOR_REASON,
                         floor_only=True)

    # memory-saving extremes only: the most saving extras level, full checkpointing (if any), smallest micro-batch,
    # the most chunked loss, the smallest optimizer states. Activation offload and paged states are tried both ways:
    # their pinned buffers and paged memory count in the total, so on a model whose weights dominate they add more
    # than they save
    def rank(s: Strategy) -> tuple:
        return (-extras_saving(s), s.checkpointing.mode != "full" or s.checkpointing.num_blocks is not None,
                -s.chunked_ce, states_per_item(s.optimizer), not s.expandable_segments)

    cands.sort(key=rank)
    head = [c for c in cands if rank(c) == rank(cands[0])][:16]
    if first_fit:
        likeliest = min(head, key=lambda c: (c.activation_offload, _COMPUTE_ORDER.get(c.precision, 9)))
        ev = est.evaluate(likeliest, budget, margin)
        if ev is not None and ev.fits:
            return ev
    bounds = sorted((b, i) for i, s in enumerate(head) if (b := est.allocated_total(s)) is not None)
    best: Evaluated | None = None
    best_i = -1
    for lower, i in bounds:
        if best is not None and (lower, i) > (best.total_bytes, best_i):
            break  # this and every later bound can only tie later in order or lose
        # to win, a total must be below the best's (or equal, earlier in order): the replay stops once it is not
        at_most = None if best is None else best.total_bytes - int(i > best_i)
        ev = est.evaluate(head[i], budget, margin, at_most)
        if ev is not None and ev.estimate is not None and (best is None
                                                           or (ev.total_bytes, i) < (best.total_bytes, best_i)):
            best, best_i = ev, i
    return best


# precisions by how small their activations are, for ``min_footprint(first_fit=True)``
_COMPUTE_ORDER = {"bf16_pure": 0, "bf16_master": 1, "bf16_autocast": 2, "fp16_autocast": 3, "fp32": 4}
