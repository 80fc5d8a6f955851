"""Making a smaller plan after an out-of-memory error: what the guard runs (``Steppable``), the ``Replanner``
interface, and the escalations ``PlanEscalator`` (re-plans on the profile under ``escalation_policy``, a margin
that rules the failing plan out) and ``step_down`` (one notch smaller without a profile).

Predictions of re-planned plans
-------------------------------
``PlanEscalator`` re-plans on the profile: the new plan carries the planner's fresh prediction for the new
strategy. ``step_down`` (no profile) changes the strategy without re-estimating it: its plan keeps the
failing plan's figures and marks them (``prediction["estimated_for"]``, the strategy they were made for).
For such a plan ``prediction_is_current`` is False; "replan" events then say ``prediction_recomputed:
false`` with ``predicted_total_bytes: null`` (the stale figure is kept as ``stale_predicted_total_bytes``),
and telemetry and calibration do not compare measurements against it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from memopt.estimate.calibration import calibration_for
from memopt.guard.oom import OOMMeasurement
from memopt.plan.planner import make_plan
from memopt.plan.policy import Policy
from memopt.plan.schema import Plan
from memopt.strategy import Checkpointing, Strategy
from memopt.techniques.quantization import extras_pins
from memopt.units import format_bytes

__all__ = [
    "EscalationFailed",
    "FunctionReplanner",
    "PlanEscalator",
    "Replanner",
    "Steppable",
    "escalation_policy",
    "prediction_is_current",
    "step_down",
]


# -- interfaces ------------------------------------------------------------------------------------
@runtime_checkable
class Steppable(Protocol):
    """What the guard runs: ``memopt.step.train_step.TrainStep`` or an adapter with the same surface."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    on_phase: Callable[[str], None] | None

    def step(self, batch: Any) -> float: ...


EscalateFn = Callable[[Plan, "OOMMeasurement", int], Plan]
ApplyFn = Callable[[Strategy], Steppable]


@runtime_checkable
class Replanner(Protocol):
    """Makes a smaller plan after an OOM and applies it.

    ``escalate(plan, measured, attempt)``: ``attempt`` counts re-plans in the run (1, 2, ...); raise
    ``EscalationFailed`` when nothing smaller exists. ``apply(strategy)`` re-prepares the model for the new
    strategy, carrying the optimizer state over, and returns the train step to use from now on.
    """

    def escalate(self, plan: Plan, measured: OOMMeasurement, attempt: int) -> Plan: ...

    def apply(self, strategy: Strategy) -> Steppable: ...


@dataclass
class FunctionReplanner:
    """A ``Replanner`` from two callables."""

    escalate_fn: EscalateFn
    apply_fn: ApplyFn

    def escalate(self, plan: Plan, measured: OOMMeasurement, attempt: int) -> Plan:
        return self.escalate_fn(plan, measured, attempt)

    def apply(self, strategy: Strategy) -> Steppable:
        return self.apply_fn(strategy)


class EscalationFailed(ValueError):
    """No plan needs less memory than the one that ran out."""


# -- escalation --------------------------------------------------------------------------------------
def policy_from_plan(plan: Plan) -> Policy:
    d = plan.policy
    return Policy(allow=frozenset(d.get("allow", ("exact",))), pins=dict(d.get("pins", {})),
                  forbid={k: tuple(v) for k, v in d.get("forbid", {}).items()},
                  margin_fraction=float(d.get("margin_fraction", 0.02)),
                  margin_bytes=int(d.get("margin_bytes", 0)), max_micro_batch=d.get("max_micro_batch"))


def escalation_policy(plan: Plan, measured: OOMMeasurement | None, attempt: int, *, step_fraction: float = 0.1,
                      calibration_ratio: float | None = None, extra_allowances: tuple[str, ...] = ()) -> Policy:
    """The failing plan's policy with a margin that rules the failing plan out.

    ``ratio`` = max(1, measured needed / predicted total, calibration ratio): the plan under-predicted at
    least that much, so the new plan may predict at most ``(budget - old margin) / ratio``; and at most
    ``attempt * step_fraction`` of the failing plan's own (non-runtime) bytes less than it, so each re-plan
    asks for strictly less. Fidelity stays the user's (lossy techniques only when the policy allows them)
    unless ``extra_allowances`` adds some; the allocator mode (expandable segments) stays the running one.
    """
    from memopt.guard.foreign import remaining_budget  # lazy: keeps memopt.guard.foreign out of import memopt

    pol = policy_from_plan(plan)
    budget = remaining_budget(plan, measured) if measured is not None else plan.budget_bytes
    old_margin = plan.margin_bytes or pol.margin(plan.budget_bytes)
    predicted = plan.total_bytes
    ratio = 1.0
    if measured is not None and measured.ratio:
        ratio = max(ratio, measured.ratio)
    if calibration_ratio:
        ratio = max(ratio, calibration_ratio)
    runtime = int(plan.prediction.get("runtime_bytes", 0))
    shrink = max(int(step_fraction * attempt * max(predicted - runtime, 0)), 1)
    target = min(int((budget - old_margin) / ratio), predicted - shrink)
    margin = max(old_margin, budget - target)
    # the running process keeps its allocator mode: its segments exist already, and switching mid-run is not
    # what the planner's allocator simulation (a fresh process) predicts
    # nor its training method: an OOM never turns full fine-tuning into LoRA, or LoRA into QLoRA, mid-run
    # and its engine: a process training on one GPU cannot move its states into an offload engine mid-run (the
    # re-plans of a run that found foreign memory were offload plans, applied on top of the old plan's states)
    engine = {"offload": False} if plan.strategy.extra("sharding") is None else {}
    pins = {"expandable_segments": plan.strategy.expandable_segments, **extras_pins(plan.strategy), **engine,
            **pol.pins}
    return dataclasses.replace(pol, margin_fraction=0.0, margin_bytes=int(margin), pins=pins,
                               allow=pol.allow | frozenset(extra_allowances))


@dataclass
class PlanEscalator:
    """The default escalation: ``memopt.plan.make_plan`` on the same profile with ``escalation_policy``.

    The planner then picks the fastest strategy under the tighter margin, which in practice means a smaller
    micro-batch with more accumulation (the global batch is the profile's and never changes), more
    checkpointing or activation offload, and lossy techniques only where the policy allows them.
    """

    profile: Any  # memopt.profile.Profile
    hardware: Any = None  # defaults to the plan's hardware
    step_fraction: float = 0.1
    calibration_ratio: float | None = None  # None: the stored calibration of this profile and GPU, if any
    extra_allowances: tuple[str, ...] = ()

    def __call__(self, plan: Plan, measured: OOMMeasurement | None, attempt: int) -> Plan:
        ratio = self.calibration_ratio
        if ratio is None:
            cal = calibration_for(getattr(self.profile, "key", ""), plan.hardware)
            ratio = cal.ratio_total if cal is not None else None
        policy = escalation_policy(plan, measured, attempt, step_fraction=self.step_fraction,
                                   calibration_ratio=ratio, extra_allowances=self.extra_allowances)
        from memopt.guard.foreign import remaining_budget  # lazy: keeps memopt.guard.foreign out of import memopt

        left = remaining_budget(plan, measured) if measured is not None else plan.budget_bytes
        try:
            new = make_plan(None, None, budget=left, hardware=self.hardware or plan.hardware, policy=policy,
                            profile=self.profile, calibration="ignore" if left != plan.budget_bytes else "use")
        except EscalationFailed:
            raise
        except ValueError as exc:  # e.g. what is left is below what the CUDA runtime alone holds
            raise EscalationFailed(str(exc).splitlines()[0]) from None
        if left != plan.budget_bytes:  # the cap stays the user's budget; the plan was made for what is left of it
            new = dataclasses.replace(new, budget_bytes=plan.budget_bytes, notes=[*new.notes, (
                f"re-planned for {format_bytes(left)} left of the {format_bytes(plan.budget_bytes)} budget: "
                f"{format_bytes(measured.foreign_bytes)} of foreign memory (not the plan's) is on the device")])
        if not new.fits:
            raise EscalationFailed("no plan fits with the margin the OOM calls for ("
                                   f"{format_bytes(policy.margin_bytes)}): "
                                   f"{(new.infeasible or {}).get('message', 'nothing fits')}")
        if new.strategy == plan.strategy:
            raise EscalationFailed(f"the planner chose the same strategy again ({plan.strategy.label()})")
        new.notes.append(f"re-planned after an out-of-memory error (escalation {attempt}, margin "
                         f"{format_bytes(policy.margin_bytes)}) from: {plan.strategy.label()}")
        return new


def step_down(plan: Plan, measured: OOMMeasurement | None = None, attempt: int = 1) -> Plan:
    """Escalation without a profile, exact techniques only, one notch per call: halve the micro-batch
    (a divisor of the global batch, accumulation makes up the rest), then checkpoint every block, then
    offload activations. Without a profile nothing is re-estimated: the returned plan keeps the old figures,
    marked as made for another strategy (``prediction["estimated_for"]``; see ``prediction_is_current``)."""
    s = plan.strategy
    pins = plan.policy.get("pins", {})
    forbid = {k: tuple(v) for k, v in plan.policy.get("forbid", {}).items()}
    global_batch = plan.global_batch or s.global_batch
    new: Strategy | None = None
    how = ""
    if "micro_batch_size" not in pins and s.micro_batch_size > 1:
        b = max(d for d in range(1, s.micro_batch_size // 2 + 1) if global_batch % d == 0)
        new, how = s.replace(micro_batch_size=b, grad_accum_steps=global_batch // b), f"micro-batch {b}"
    elif "checkpointing" not in pins and "full" not in forbid.get("checkpointing", ()) and \
            (s.checkpointing.mode != "full" or s.checkpointing.num_blocks is not None):
        new, how = s.replace(checkpointing=Checkpointing(mode="full")), "full checkpointing"
    elif "activation_offload" not in pins and not s.activation_offload and \
            True not in forbid.get("activation_offload", ()):
        new, how = s.replace(activation_offload=True), "activation offload"
    if new is None:
        raise EscalationFailed(f"nothing left to step down from [{s.label()}] with exact techniques")
    notes = [*plan.notes, f"stepped down after an out-of-memory error (escalation {attempt}): {how}; the "
             "prediction was not recomputed (no profile)"]
    prediction = {**plan.prediction, "estimated_for": plan.prediction.get("estimated_for") or s.label()}
    return dataclasses.replace(plan, strategy=new, notes=notes, prediction=prediction)


def prediction_is_current(plan: Plan) -> bool:
    """Whether ``plan.prediction`` was estimated for ``plan.strategy`` (False after ``step_down``)."""
    made_for = plan.prediction.get("estimated_for")
    return made_for is None or made_for == plan.strategy.label()


def replan_prediction(plan: Plan) -> dict[str, Any]:
    """The prediction fields of a "replan" event: the new total, or plainly that it was not recomputed."""
    if prediction_is_current(plan):
        return {"predicted_total_bytes": plan.total_bytes, "prediction_recomputed": True}
    made_for = plan.prediction["estimated_for"]
    return {"predicted_total_bytes": None, "prediction_recomputed": False,
            "stale_predicted_total_bytes": plan.total_bytes,
            "prediction_note": f"not recomputed: step_down changed the strategy without a profile to re-estimate "
                               f"it; the plan's figures are the prediction for [{made_for}]"}
