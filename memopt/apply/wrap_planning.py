"""What ``memopt.wrap`` adds around the planner when it plans on the user's device: the pins its arguments and the
allocator already running imply, a re-plan for the room other memory leaves, and the one-line refusal of a plan that
does not fit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memopt import progress
from memopt.errors import InputError
from memopt.plan.schema import Plan
from memopt.step.hard_cap import allocator_mode_in_force, warn_allocator_mode_fixed
from memopt.techniques.optimizers import optimizer_choice, pinned_variant_refusal
from memopt.units import format_bytes

__all__ = ["plan_for_room_left", "planning_pins", "refuse_unfit"]


def planning_pins(optimizer: Any, pins: dict[str, Any] | None, loss_fn: Any) -> tuple[dict[str, Any], Any]:
    """(the planner's pins, the user's optimizer callable or None): the optimizer argument's pins under the user's
    own (an optimizer pin beside the user's optimizer: a variant of its algorithm, built from its groups, else
    refused in one line); no chunked cross-entropy for a loss of the user's (it replaces the model's own loss); the
    allocator mode already in force when CUDA holds memory (it can no longer change), with a warning."""
    optimizer_pins, user_opt = optimizer_choice(optimizer)
    refusal = pinned_variant_refusal(user_opt, (pins or {}).get("optimizer"))
    if refusal is not None:
        raise InputError([refusal], "pins")
    merged = {**optimizer_pins, **(pins or {})}
    if loss_fn is not None:
        merged.setdefault("chunked_ce", 0)
    in_force = allocator_mode_in_force()
    if in_force is not None and "expandable_segments" not in merged:
        merged["expandable_segments"] = in_force
        warn_allocator_mode_fixed(in_force)
    return merged, user_opt


def plan_for_room_left(budget_bytes: int, taken: int, replan: Callable[[], Plan]) -> Plan:
    """The plan ``replan`` makes for what is left when ``taken`` bytes of the budget are already in use on the device
    by memory the plan cannot own (``memopt.step.hard_cap.room_taken_bytes``), with a note; a one-line error when
    nothing fits in it."""
    left = max(budget_bytes - taken, 0)
    taken_note = (f"{format_bytes(taken)} of the {format_bytes(budget_bytes)} budget was already in use on the "
                  "device when memopt.wrap planned (memory outside the allocator beyond the CUDA runtime, or tensors "
                  "that are not the model's)")
    try:
        smaller = replan()
    except InputError as exc:  # the room left is below the policy's margin: no budget to plan with
        raise ValueError(f"{taken_note}, and the {format_bytes(left)} left is too little to plan with ({exc}); free "
                         "that memory or raise the budget") from None
    if not smaller.fits:
        reason = smaller.infeasible["message"] if smaller.infeasible else "no strategy fits"
        raise ValueError(f"{taken_note}, and no plan fits in the {format_bytes(left)} left ({reason}); free that "
                         "memory or raise the budget")
    smaller.notes.append(f"{taken_note}: planned for the {format_bytes(left)} left")
    return smaller


def refuse_unfit(plan: Plan) -> None:
    """Raise one line when ``plan`` does not fit: "no strategy can be planned" when nothing could be estimated at all
    (the model cannot take the pinned techniques, not a memory problem), else "no strategy fits the budget"."""
    if plan.fits:
        return
    infeasible = plan.infeasible or {}
    said = ("no strategy can be planned" if infeasible.get("smallest_total_bytes") is None
            else "no strategy fits the budget")
    progress.done(said)
    raise ValueError(f"{said}: {infeasible.get('message', '')}")
