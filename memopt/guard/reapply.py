"""Applying a re-planned strategy to the running training: the model is re-prepared and the training state
(optimizer state, master weights, gradient scaler, LR scheduler, step counter) carries over.

``reprepare`` re-prepares a ``memopt.step.prepare.Prepared``; ``PreparedReplanner`` is the ``Replanner`` built on
it; ``switch_micro_batch`` is the ``apply`` for strategies that change the micro-batch only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memopt.guard.escalation import ApplyFn, EscalateFn, EscalationFailed, Steppable, step_down
from memopt.guard.oom import OOMMeasurement, release_cache
from memopt.plan.schema import Plan
from memopt.step.carry_state import hold_state, prepare_holding
from memopt.step.prepare import Prepared
from memopt.strategy import Strategy

__all__ = ["PreparedReplanner", "reprepare"]


# -- re-applying a strategy --------------------------------------------------------------------------
def _batching_only(old: Strategy, new: Strategy) -> bool:
    return old.replace(micro_batch_size=new.micro_batch_size, grad_accum_steps=new.grad_accum_steps) == new


def reprepare(prepared: Any, strategy: Strategy, *, on_restored: Callable[[Any], None] | None = None,
              **prepare_kwargs: Any) -> Any:
    """``prepared`` (a ``memopt.step.prepare.Prepared``) under ``strategy``, training state carried over.

    Only the micro-batch changes: the train step's strategy is swapped in place (nothing to rebuild).
    Otherwise every technique is undone and ``prepare`` runs again with ``prepare_kwargs`` (those the first
    ``prepare`` got); the optimizer state (same optimizer kind), master weights (bf16_master on both sides),
    gradient scaler, LR scheduler and step counter are loaded into the new objects. Changing precision
    across bf16_master keeps what the weights hold (the masters' extra bits are lost).

    All or nothing: when anything fails on the way (an OOM while the new plan is prepared, a Ctrl-C), the old
    strategy is prepared again with the training state loaded back, ``on_restored`` gets that ``Prepared`` (the
    old one's objects are undone), and the error is raised.
    """
    old = prepared.step
    if _batching_only(old.strategy, strategy):
        old.strategy = strategy
        return prepared
    held = hold_state(prepared)
    try:
        prepared.undo()
        release_cache()
        return prepare_holding(prepared.model, strategy, held, stacks=prepared.stacks, **prepare_kwargs)
    except BaseException:
        # what the old plan's undo left (an interrupt inside it), then the old plan again: a model without its
        # optimizer state would train on with its moments silently reset
        prepared.undo()
        release_cache()
        back = prepare_holding(prepared.model, old.strategy, held, stacks=prepared.stacks, **prepare_kwargs)
        if on_restored is not None:
            on_restored(back)
        raise


@dataclass
class PreparedReplanner:
    """The ``Replanner`` for a model prepared by ``memopt.step.prepare``: ``escalate_fn`` (``PlanEscalator``
    with a profile, ``step_down`` without) and ``reprepare`` with the original ``prepare`` arguments."""

    prepared: Any
    prepare_kwargs: dict[str, Any]
    escalate_fn: EscalateFn = step_down

    def escalate(self, plan: Plan, measured: OOMMeasurement, attempt: int) -> Plan:
        return self.escalate_fn(plan, measured, attempt)

    @property
    def step(self) -> Steppable:
        """The train step in effect, also after an ``apply`` that failed (the old plan, prepared again)."""
        return self.prepared.step

    def apply(self, strategy: Strategy) -> Steppable:
        self.prepared = reprepare(self.prepared, strategy, on_restored=self._restored, **self.prepare_kwargs)
        return self.prepared.step

    def _restored(self, prepared: Prepared) -> None:
        self.prepared = prepared


def switch_micro_batch(step: Any) -> ApplyFn:
    """An ``apply`` for strategies that differ from the running one in micro-batching only."""
    def apply(strategy: Strategy) -> Steppable:
        if not _batching_only(step.strategy, strategy):
            raise EscalationFailed(f"[{strategy.label()}] changes more than the micro-batch; give OOMGuard an "
                                   "apply= (or a Replanner) that re-prepares the model")
        step.strategy = strategy
        return step
    return apply
