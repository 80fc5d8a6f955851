"""``Wrapped``'s autotune on the first batch (``memopt.apply.autotune``): the planner's candidates measured, the
fastest applied, and the training state the wrap held before it (a ``load()``, a hand-set learning rate) carried
into the plan kept."""

from __future__ import annotations

from typing import Any

from memopt import progress
from memopt.plan.schema import Plan
from memopt.step.carry_state import hold_state
from memopt.step.prepare import keeps_placement

__all__ = ["WrappedAutotune"]


class WrappedAutotune:
    """The autotune of ``memopt.apply.wrapped.Wrapped``, which holds what it reads: the user's model, the prepared
    pieces, the plan, its guard and profile."""

    _autotune_pending: bool
    _prepared: Any
    _profile: Any
    _hw: Any
    _user_model: Any
    plan: Plan | None
    guard: Any
    autotune_trials: list[dict[str, Any]]

    def _apply(self, plan: Plan) -> None:
        raise NotImplementedError

    def _prepare_kwargs(self) -> dict[str, Any]:
        raise NotImplementedError

    def _run_autotune(self, batch: Any) -> None:
        """Measure the planner's choice against the plans its search could not tell apart from it (predicted within
        ``ALTERNATIVES_WITHIN``) on this batch and keep the fastest (see memopt.apply.autotune); the choice and every
        timing go into the plan's notes. The optimizer state, schedule, scaler, masters and step count go to the plan
        kept (the chosen one again when the autotune fails), so a ``load()`` before the first step is kept."""
        # lazy: keeps memopt.apply.autotune out of import memopt
        from memopt.apply.autotune import autotune, describe, frontier

        self._autotune_pending = False
        chosen = self.plan
        candidates = frontier(chosen, chosen.alternatives)
        if len(candidates) < 2:
            return
        if self.guard is not None:
            self.guard.close()
            self.guard = None
        held = hold_state(self._prepared)
        # the model stays on the device between candidates where it can (a round trip through host memory per
        # candidate was most of the autotune's time on a 0.4B model); its move home goes to the plan kept
        home = self._prepared.undo(keep_on_device=keeps_placement(chosen.strategy))
        self._prepared = None
        progress.report(f"autotune: timing {len(candidates)} candidate plans on the first batch")
        try:
            best, trials = autotune(self._user_model, candidates, batch, self._prepare_kwargs())
        except BaseException:
            if home is not None:
                home()
            # the plan the wrap had, with its training state: an interrupted or failed autotune loses nothing
            self._apply(chosen)
            held.load_into(self._prepared)
            raise
        if best is not chosen:
            # lazy: keeps memopt.estimate.attribution out of import memopt
            from memopt.estimate.attribution import attach_to_plan

            attach_to_plan(best, self._profile, self._hw)
        best.notes.append(describe(trials, best))
        self.autotune_trials = [t.to_dict() for t in trials]
        self.plan = best
        self._apply(best)
        self._prepared.adopt_placement(home)
        held.load_into(self._prepared)
