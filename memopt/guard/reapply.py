"""Applying a re-planned strategy to the running training: the model is re-prepared and the training state
(optimizer state, master weights, gradient scaler, LR scheduler, step counter) carries over.

``reprepare`` re-prepares a ``memopt.step.prepare.Prepared``; ``PreparedReplanner`` is the ``Replanner`` built on
it; ``switch_micro_batch`` is the ``apply`` for strategies that change the micro-batch only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from memopt.guard.escalation import ApplyFn, EscalateFn, EscalationFailed, Steppable, step_down
from memopt.guard.oom import OOMMeasurement, release_cache
from memopt.plan.schema import Plan
from memopt.step.prepare import Prepared, prepare
from memopt.strategy import Strategy

__all__ = ["PreparedReplanner", "reprepare"]

log = logging.getLogger(__name__)


# -- re-applying a strategy --------------------------------------------------------------------------
def _batching_only(old: Strategy, new: Strategy) -> bool:
    return old.replace(micro_batch_size=new.micro_batch_size, grad_accum_steps=new.grad_accum_steps) == new


def _to_host(obj: Any) -> Any:
    """A state dict with its device tensors copied to host memory (host tensors are kept as they are)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True) if obj.device.type != "cpu" else obj
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_host(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_host(v) for v in obj)
    return obj


def reprepare(prepared: Any, strategy: Strategy, **prepare_kwargs: Any) -> Any:
    """``prepared`` (a ``memopt.step.prepare.Prepared``) under ``strategy``, training state carried over.

    Only the micro-batch changes: the train step's strategy is swapped in place (nothing to rebuild).
    Otherwise every technique is undone and ``prepare`` runs again with ``prepare_kwargs`` (those the first
    ``prepare`` got); the optimizer state (same optimizer kind), master weights (bf16_master on both sides),
    gradient scaler, LR scheduler and step counter are loaded into the new objects. Changing precision
    across bf16_master keeps what the weights hold (the masters' extra bits are lost).
    """
    old = prepared.step
    if _batching_only(old.strategy, strategy):
        old.strategy = strategy
        return prepared
    same_opt = old.strategy.optimizer == strategy.optimizer
    # the old plan's states move to the host before the new plan is prepared, so that the device never holds
    # both plans' optimizer states and master weights (the new ones load from the host copies)
    opt_state = _to_host(prepared.optimizer.state_dict()) if same_opt else None
    masters = ([m.detach().to("cpu", copy=True) for m in old.master.state_dict()["masters"]]
               if old.master is not None else None)
    prepared.optimizer.state.clear()
    sched = old.lr_scheduler.state_dict() if old.lr_scheduler is not None else None
    scaler = old.scaler.state_dict() if old.scaler is not None and hasattr(old.scaler, "state_dict") else None
    steps_done = old.steps_done
    prepared.undo()
    release_cache()
    new: Prepared = prepare(prepared.model, strategy, stacks=prepared.stacks, **prepare_kwargs)
    if masters is not None and new.step.master is not None:
        new.step.master.load_state_dict({"masters": masters})
    if opt_state is not None:
        new.optimizer.load_state_dict(opt_state)
    else:
        log.warning("optimizer changed from %s to %s: its state starts afresh", old.strategy.optimizer,
                    strategy.optimizer)
    if sched is not None and new.step.lr_scheduler is not None:
        new.step.lr_scheduler.load_state_dict(sched)
    if scaler is not None and new.step.scaler is not None and hasattr(new.step.scaler, "load_state_dict"):
        new.step.scaler.load_state_dict(scaler)
    new.step.steps_done = steps_done
    return new


@dataclass
class PreparedReplanner:
    """The ``Replanner`` for a model prepared by ``memopt.step.prepare``: ``escalate_fn`` (``PlanEscalator``
    with a profile, ``step_down`` without) and ``reprepare`` with the original ``prepare`` arguments."""

    prepared: Any
    prepare_kwargs: dict[str, Any]
    escalate_fn: EscalateFn = step_down

    def escalate(self, plan: Plan, measured: OOMMeasurement, attempt: int) -> Plan:
        return self.escalate_fn(plan, measured, attempt)

    def apply(self, strategy: Strategy) -> Steppable:
        self.prepared = reprepare(self.prepared, strategy, **self.prepare_kwargs)
        return self.prepared.step


def switch_micro_batch(step: Any) -> ApplyFn:
    """An ``apply`` for strategies that differ from the running one in micro-batching only."""
    def apply(strategy: Strategy) -> Steppable:
        if not _batching_only(step.strategy, strategy):
            raise EscalationFailed(f"[{strategy.label()}] changes more than the micro-batch; give OOMGuard an "
                                   "apply= (or a Replanner) that re-prepares the model")
        step.strategy = strategy
        return step
    return apply
