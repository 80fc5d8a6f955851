"""OOM recovery around one training step: free, re-plan, re-apply, retry the same batch.

``OOMGuard.run(batch)`` runs one optimizer step (``TrainStep.step``). When a CUDA out-of-memory error is
raised inside it:

1. the error is measured (allocator counters at the failure, the size it tried to allocate, the phase it
   happened in) and, when ``torch.cuda.memory._record_memory_history`` is on, a memory snapshot is dumped to
   ``RUN_DIR/snapshots/`` (open it in https://pytorch.org/memory_viz);
2. the step's tensors are freed: the exception and its frames are dropped, every gradient is set to None,
   activation offload's pending copies are released, ``gc.collect()`` and ``torch.cuda.empty_cache()``;
3. whatever the failed attempt changed is put back (see *Atomicity* below), and the random number
   generators are reset to where the step began, so the retry draws the same dropout masks;
4. the plan is escalated (``escalate(plan, measured, attempt) -> Plan``) and applied (``apply(strategy)``
   returns the new train step: the model is re-prepared; the optimizer state carries over);
5. the SAME batch is retried: no data is skipped or counted twice, the step counter advances once.

After ``max_escalations`` re-plans in a run (default 3), or when no smaller plan exists, it stops with
``MemoptOOMError``, whose ``report`` lists every failure and re-plan.

A leak is not a plan problem
----------------------------
Before re-planning (item 4 above) the guard asks ``leak_check(measured)`` (``RuntimeGuard`` passes its leak detector's
``diagnose_oom``, see ``memopt.guard.leaks``) whether memory grew steadily over the previous steps by more
than the step lacked. If so, re-planning cannot help (a leak fills any plan; it would only shrink the
micro-batch until ``max_escalations`` runs out), so the guard stops at once with ``MemoptLeakError`` (a
``MemoptOOMError``): its message gives the growth per step, over how many steps, the cause and the fix, and
``report.leak`` holds the diagnosis; a "leak" event is recorded. The user's state is intact: the failed
step was freed and rolled back (steps 1-3 above), the plan and the prepared model are unchanged, and the
step counter still counts the completed steps only, so after freeing what leaks the same batch can be
retried. Under ``torch.distributed`` rank 0's diagnosis is broadcast, so every rank stops alike.

Predictions of re-planned plans
-------------------------------
``PlanEscalator`` re-plans on the profile: the new plan carries the planner's fresh prediction for the new
strategy. ``step_down`` (no profile) changes the strategy without re-estimating it: its plan keeps the
failing plan's figures and marks them (``prediction["estimated_for"]``, the strategy they were made for).
For such a plan ``prediction_is_current`` is False; "replan" events then say ``prediction_recomputed:
false`` with ``predicted_total_bytes: null`` (the stale figure is kept as ``stale_predicted_total_bytes``),
and telemetry and calibration do not compare measurements against it.

Atomicity of the optimizer step
-------------------------------
Forward and backward change nothing but gradients, which are discarded. The optimizer step changes
parameters and optimizer states in place, so an OOM inside it could leave them half-updated. The guard
finds out where the OOM happened: the train step's phase callback ("optimizer" is announced before
unscaling, clipping and the update) and hooks on the optimizer (``register_step_pre_hook`` /
``register_step_post_hook``) say whether ``optimizer.step()`` was entered or completed; inside it, the
traceback says whether the error came from the optimizer's state initialisation of its first parameter
group (``_init_group``: torch.optim creates every state of a group before updating any parameter, so
nothing was changed yet; the states it created are removed). In those cases no copy is needed.

Anything else inside the step (the update itself, a later group, the copy back to bf16 weights) needs a
pre-step copy: ``StepTransaction`` then restores parameters, master weights and optimizer states from
copies taken in the optimizer's pre-step hook, in pinned CPU memory. The copies are enqueued on the
current CUDA stream before the update kernels, so they cost one transfer of the parameters and optimizer
states over the host link per step (and as much pinned host memory) but no host synchronisation. Because
that is not free, they are taken only when the step is at risk: ``transaction="always"``, or ``"auto"``
(the default) when the plan predicts its peak inside the optimizer step, or once an OOM has hit an
optimizer step in this run. Without a copy, an OOM
that may have changed parameters is not retried: ``MemoptOOMError`` says so (never silently continue with
half-updated weights). Version counters were considered and rejected: fused AdamW and bitsandbytes kernels
do not bump them.

Distributed
-----------
Under ``torch.distributed`` every attempt ends in the same collective sequence on every rank, so one rank's
OOM never leaves the others waiting: A1, an ``all_gather`` of each rank's status, right before the
optimizer step (a rank that failed earlier joins it from its error handler; the others learn of the failure
and abort their step before updating anything), and, when A1 was clean, A2 after the step (an OOM inside
the optimizer step on any rank makes every rank roll back its completed step, which needs the pre-step
copy; ``auto`` takes it on every rank alike). Rank 0 escalates and broadcasts the new plan. Gradient
collectives inside backward (DDP/FSDP) are outside this protocol: a rank that fails mid-backward leaves
its peers in an NCCL collective until the NCCL timeout; ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` turns that
into an error.

Under a Hugging Face ``Trainer`` the same idea runs in ``memopt.integrations.trainer_recovery``: the Trainer gets
one accumulation step over its process's global batch and memopt's ``training_step`` runs the plan's
micro-batches inside it, so after an OOM in forward or backward the gradients are cleared (the Trainer step
started without any), the plan escalated and the same batch retried. (A callback alone cannot do it: with the
Trainer's own gradient accumulation, an OOM in micro-batch j > 0 leaves the gradients of micro-batches 0..j-1
mixed with part of j's, and the earlier micro-batches are no longer at hand.) An OOM inside the Trainer's own
optimizer step stays outside the retry.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from memopt.guard.leaks import LeakReport
from memopt.guard.memory import MemorySource, state_bytes
from memopt.plan.policy import Policy
from memopt.plan.schema import Plan
from memopt.strategy import Checkpointing, Strategy
from memopt.units import format_bytes

__all__ = [
    "EscalationFailed",
    "FunctionReplanner",
    "MemoptLeakError",
    "MemoptOOMError",
    "OOMGuard",
    "OOMMeasurement",
    "PlanEscalator",
    "PreparedReplanner",
    "RecoveryReport",
    "Replanner",
    "StepTransaction",
    "Steppable",
    "escalation_policy",
    "is_oom",
    "parse_oom_message",
    "prediction_is_current",
    "release_cache",
    "reprepare",
    "step_down",
]

log = logging.getLogger(__name__)


# -- interfaces ------------------------------------------------------------------------------------
@runtime_checkable
class Steppable(Protocol):
    """What the guard runs: ``memopt.apply.train_step.TrainStep`` or an adapter with the same surface."""

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


# -- measurements and reports ----------------------------------------------------------------------
_UNITS = {"B": 1, "bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_SIZE = r"([0-9]+(?:\.[0-9]+)?) ?(bytes|B|KiB|MiB|GiB|TiB)"


def _size(m: re.Match | None) -> int | None:
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None


def parse_oom_message(message: str) -> dict[str, int | None]:
    """Figures in PyTorch's CUDA OOM message ("Tried to allocate 20.00 MiB. GPU 0 has a total capacity of
    79.19 GiB of which 3.06 MiB is free. ... this process has 79.18 GiB memory in use. Of the allocated memory
    78.12 GiB is allocated by PyTorch, and 512.00 MiB is reserved by PyTorch but unallocated.")."""
    return {
        "requested_bytes": _size(re.search(r"Tried to allocate " + _SIZE, message)),
        "device_total_bytes": _size(re.search(r"total capacity of " + _SIZE, message)),
        "device_free_bytes": _size(re.search(r"of which " + _SIZE + r" is free", message)),
        "process_bytes": _size(re.search(r"this process has " + _SIZE + r" memory in use", message)),
        "allocated_bytes": _size(re.search(_SIZE + r" is allocated by PyTorch", message)),
        "reserved_unallocated_bytes": _size(re.search(_SIZE + r" is reserved by PyTorch but unallocated", message)),
    }


_OOM_TEXT = ("CUDA out of memory", "out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED",
             "HIP out of memory")


def release_cache(*, empty_cache: bool = True) -> None:
    """Free what nothing references any more, then hand the allocator's free blocks back, so that a retry finds
    contiguous memory. Call it after the failed attempt's exception handler has ended: until then its frames hold
    the attempt's temporaries, whose blocks would stay cached as holes."""
    gc.collect()
    if empty_cache and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    """A device out-of-memory error (``torch.OutOfMemoryError``, or a library's allocation failure)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(t in str(exc) for t in _OOM_TEXT)


@dataclass
class OOMMeasurement:
    """What is known about one failed attempt (figures in bytes; None where unknown)."""

    step: int
    attempt: int  # the attempt of this step that failed (1 = first try)
    phase: str  # the train step's phase: "forward[0]", "backward[1]", "optimizer", "zero_grad", or "peer"
    location: str  # before_optimizer | optimizer_state_init | optimizer | after_optimizer | completed | peer
    message: str
    strategy: str
    rank: int = 0
    failed_ranks: list[int] = field(default_factory=list)
    requested_bytes: int | None = None
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    device_used_bytes: int | None = None
    device_total_bytes: int | None = None
    categories_bytes: dict[str, int] = field(default_factory=dict)
    predicted: dict[str, Any] = field(default_factory=dict)  # the failing plan's prediction
    budget_bytes: int | None = None
    snapshot_path: str | None = None
    foreign_bytes: int | None = None  # memory the plan does not own, measured after freeing (memopt.guard.foreign)
    foreign: dict[str, Any] | None = None  # ForeignMemory.to_dict() plus a description

    @property
    def needed_bytes(self) -> int | None:
        """A lower bound of the device memory the step needs: what was reserved plus what it asked for,
        plus what lives outside the allocator."""
        if self.reserved_bytes is None and self.peak_reserved_bytes is None:
            return None
        reserved = self.reserved_bytes or 0
        base = max(self.peak_reserved_bytes or 0, reserved + (self.requested_bytes or 0))
        outside = 0
        if self.device_used_bytes is not None:
            outside = max(self.device_used_bytes - reserved, 0)
        return base + outside

    @property
    def ratio(self) -> float | None:
        """needed / predicted total: how far the plan under-predicted, at least (foreign memory is not the plan's
        under-prediction, so it is left out)."""
        needed, predicted = self.needed_bytes, self.predicted.get("total_bytes")
        if not needed or not predicted:
            return None
        return max(needed - (self.foreign_bytes or 0), 0) / predicted

    @property
    def shortfall_bytes(self) -> int:
        """What the failed step lacked, at least: the allocation that failed, or its need beyond the budget."""
        over = 0
        if self.needed_bytes is not None and self.budget_bytes is not None:
            over = self.needed_bytes - self.budget_bytes
        return max(self.requested_bytes or 0, over, 0)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["needed_bytes"] = self.needed_bytes
        d["ratio"] = self.ratio
        return d


@dataclass
class RecoveryReport:
    """Every OOM, rollback and re-plan of a run."""

    failures: list[OOMMeasurement] = field(default_factory=list)
    replans: list[dict[str, Any]] = field(default_factory=list)
    final: str = ""
    leak: dict[str, Any] | None = None  # the leak diagnosed at an OOM (LeakReport.to_dict()), if any

    def to_dict(self) -> dict[str, Any]:
        return {"failures": [f.to_dict() for f in self.failures], "replans": self.replans, "final": self.final,
                "leak": self.leak}

    def summary(self, *, include_final: bool = True) -> str:
        lines = [self.final] if self.final and include_final else []
        for f in self.failures:
            need = f" (needs >= {format_bytes(f.needed_bytes)})" if f.needed_bytes else ""
            lines.append(f"step {f.step} attempt {f.attempt}: OOM in {f.phase} under [{f.strategy}] on rank "
                         f"{f.rank}{need}")
        for r in self.replans:
            lines.append(f"re-plan {r['attempt']}: [{r['from']}] -> [{r['to']}]")
        return "\n".join(lines)


class MemoptOOMError(RuntimeError):
    """Training ran out of memory and memopt could not (or may not) recover; ``report`` says what happened."""

    def __init__(self, message: str, report: RecoveryReport) -> None:
        super().__init__(message + ("\n" + report.summary(include_final=False) if report.failures else ""))
        self.report = report


class MemoptLeakError(MemoptOOMError):
    """Out of memory because memory leaks, not because of the plan: no re-plan was tried. ``leak`` is the
    diagnosis (``LeakReport.to_dict()``: growth per step, steps, cause, fix); ``report`` as for the base."""

    def __init__(self, message: str, report: RecoveryReport) -> None:
        super().__init__(message, report)
        self.leak = report.leak


def leak_message(leak: dict[str, Any], failure: OOMMeasurement) -> str:
    """The sentence a ``MemoptLeakError`` starts with."""
    rate, n = leak["growth_bytes_per_step"], leak["window"]
    return (f"out of memory at step {failure.step}, most likely from a memory leak rather than from the plan: "
            f"likely leak: {format_bytes(rate)}/step over {n} steps (allocated memory at "
            f"{str(leak['point']).replace('_', ' ')}), cause {leak['cause']} ({leak['category']}): "
            f"{leak['fix']}. memopt did not re-plan: a smaller plan cannot hold a leak, it would only postpone the "
            f"next out-of-memory error. The failed step was undone (parameters, optimizer state and step count are "
            f"those after {failure.step} completed step(s)); free what is kept and call step(batch) again with the "
            "same batch. To re-plan anyway: RuntimeGuard(diagnose_leaks=False) (under memopt.wrap: "
            "wrapped.guard.oom.leak_check = None)")


class _PeerFailure(Exception):
    """Raised inside a rank's step when another rank failed (the step is abandoned before the update)."""


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
    from memopt.guard.foreign import remaining_budget

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
    from memopt.techniques.quantization import extras_pins

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
        from memopt.guard.calibration import calibration_for
        from memopt.plan.planner import make_plan

        ratio = self.calibration_ratio
        if ratio is None:
            cal = calibration_for(getattr(self.profile, "key", ""), plan.hardware)
            ratio = cal.ratio_total if cal is not None else None
        policy = escalation_policy(plan, measured, attempt, step_fraction=self.step_fraction,
                                   calibration_ratio=ratio, extra_allowances=self.extra_allowances)
        from memopt.guard.foreign import remaining_budget

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
    """``prepared`` (a ``memopt.apply.prepare.Prepared``) under ``strategy``, training state carried over.

    Only the micro-batch changes: the train step's strategy is swapped in place (nothing to rebuild).
    Otherwise every technique is undone and ``prepare`` runs again with ``prepare_kwargs`` (those the first
    ``prepare`` got); the optimizer state (same optimizer kind), master weights (bf16_master on both sides),
    gradient scaler, LR scheduler and step counter are loaded into the new objects. Changing precision
    across bf16_master keeps what the weights hold (the masters' extra bits are lost).
    """
    from memopt.apply.prepare import Prepared, prepare

    old = prepared.step
    if _batching_only(old.strategy, strategy):
        old.strategy = strategy
        return prepared
    same_opt = old.strategy.optimizer == strategy.optimizer
    # the old plan's states move to the host before the new plan is prepared, so that the device never holds
    # both plans' optimizer states and master weights (the new ones load from the host copies)
    opt_state = _to_host(prepared.optimizer.state_dict()) if same_opt else None
    masters = [m.detach().to("cpu", copy=True) for m in old.master.masters] if old.master is not None else None
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
    """The ``Replanner`` for a model prepared by ``memopt.apply.prepare``: ``escalate_fn`` (``PlanEscalator``
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


# -- the transaction ---------------------------------------------------------------------------------
_UPDATE_FN = re.compile(r"^_(single_tensor|multi_tensor|fused)_|^_fused|^adamw?$|^sgd$")


def _state_init_of_first_group(tb: Any, optimizer: torch.optim.Optimizer) -> bool:
    """The traceback ends in torch.optim's state initialisation of the optimizer's first parameter group,
    before any update function (torch.optim initialises a group's states before updating it)."""
    init_group = None
    for frame, _ in traceback.walk_tb(tb):
        code = frame.f_code
        if "torch/optim/" not in code.co_filename.replace("\\", "/"):
            continue
        if _UPDATE_FN.search(code.co_name):
            return False
        if code.co_name == "_init_group":
            init_group = frame
    if init_group is None:
        return False
    group = init_group.f_locals.get("group")
    return bool(optimizer.param_groups) and group is optimizer.param_groups[0]


def _copy(t: torch.Tensor, buf: torch.Tensor | None) -> torch.Tensor:
    if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
        pin = t.device.type == "cuda"
        buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    buf.copy_(t.detach(), non_blocking=buf.is_pinned())
    return buf


class StepTransaction:
    """Makes one optimizer step all-or-nothing (see the module docstring): knows whether the step was
    entered and completed, keeps pre-step copies when asked, and puts things back."""

    MODES = ("auto", "always", "never")

    def __init__(self, mode: str = "auto") -> None:
        self.mode = self.check_mode(mode)
        self.step: Any = None
        self._handles: list[Any] = []
        self._buffers: list[torch.Tensor | None] = []
        self.snapshot_bytes = 0
        self._reset()

    @classmethod
    def check_mode(cls, mode: str) -> str:
        if mode not in cls.MODES:
            raise ValueError(f"transaction={mode!r}: use one of {', '.join(cls.MODES)} (when parameters and "
                             "optimizer states are copied before an optimizer step, to undo an OOM inside it)")
        return mode

    def _reset(self) -> None:
        self.want_snapshot = False
        self.entered = False
        self.completed = False
        self.n_states_before: int | None = None
        self._saved: dict[str, Any] | None = None
        self._cheap: dict[str, Any] = {}

    def bind(self, step: Any) -> None:
        for h in self._handles:
            h.remove()
        self.step = step
        opt = step.optimizer
        self._handles = [opt.register_step_pre_hook(self._pre), opt.register_step_post_hook(self._post)]
        self._buffers = []

    def unbind(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def begin(self, *, at_risk: bool) -> None:
        """An attempt starts: note the cheap state (scaler, scheduler, step counter)."""
        self._reset()
        self.want_snapshot = self.mode == "always" or (self.mode == "auto" and at_risk)
        step = self.step
        scaler = getattr(step, "scaler", None)
        if scaler is not None and getattr(scaler, "_scale", None) is not None:
            self._cheap["scaler"] = (scaler._scale.clone(), scaler._growth_tracker.clone())
        sched = getattr(step, "lr_scheduler", None)
        if sched is not None:
            self._cheap["scheduler"] = sched.state_dict()
        self._cheap["steps_done"] = getattr(step, "steps_done", None)

    # -- optimizer hooks -------------------------------------------------------------------------
    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.want_snapshot:
            with _disable_current_modes():  # host copies: not device memory, not ops of the step
                self._snapshot(optimizer)
        self.n_states_before = len(optimizer.state)
        self.entered = True  # after the copy: an error inside it has changed nothing

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.completed = True

    def _params(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        master = getattr(self.step, "master", None)
        if master is not None:
            params = params + list(master.params)  # the bf16 weights that masters_to_params writes
        return params

    def _snapshot(self, optimizer: torch.optim.Optimizer) -> None:
        tensors: list[torch.Tensor] = self._params(optimizer)
        states: dict[Any, dict[str, Any]] = {}
        for p, st in optimizer.state.items():
            entry = {}
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    entry[k] = ("t", v, len(tensors))
                    tensors.append(v)
                else:
                    entry[k] = ("v", v, None)
            states[p] = entry
        while len(self._buffers) < len(tensors):
            self._buffers.append(None)
        copies = []
        for i, t in enumerate(tensors):
            self._buffers[i] = _copy(t, self._buffers[i])
            copies.append(self._buffers[i])
        self.snapshot_bytes = sum(b.numel() * b.element_size() for b in copies)
        self._saved = {"tensors": tensors, "copies": copies, "states": states, "keys": list(optimizer.state.keys())}

    # -- outcome ---------------------------------------------------------------------------------
    def classify(self, tb: Any) -> str:
        """Where an error raised now (with traceback ``tb``) left the step."""
        if self.completed:
            return "after_optimizer"
        if not self.entered:
            return "before_optimizer"
        if _state_init_of_first_group(tb, self.step.optimizer):
            return "optimizer_state_init"
        return "optimizer"

    def can_restore(self, location: str) -> bool:
        if location in ("before_optimizer", "optimizer_state_init", "peer"):
            return True
        return self._saved is not None

    def rollback(self, location: str) -> None:
        """Undo what the attempt changed (call ``can_restore`` first)."""
        step = self.step
        opt = step.optimizer
        if location == "optimizer_state_init" and self.n_states_before is not None:
            for p in list(opt.state.keys())[self.n_states_before:]:
                del opt.state[p]
        elif location in ("optimizer", "after_optimizer", "completed") and self._saved is not None:
            with _disable_current_modes():
                self._restore(opt)
        scaler = getattr(step, "scaler", None)
        if "scaler" in self._cheap:
            scale, growth = self._cheap["scaler"]
            scaler._scale.copy_(scale)
            scaler._growth_tracker.copy_(growth)
        if scaler is not None and hasattr(scaler, "_per_optimizer_states"):
            from torch.amp.grad_scaler import _refresh_per_optimizer_state

            scaler._per_optimizer_states.clear()
            scaler._per_optimizer_states.default_factory = _refresh_per_optimizer_state
        if "scheduler" in self._cheap:
            step.lr_scheduler.load_state_dict(self._cheap["scheduler"])
        if self._cheap.get("steps_done") is not None:
            step.steps_done = self._cheap["steps_done"]

    def _restore(self, opt: torch.optim.Optimizer) -> None:
        saved = self._saved
        with torch.no_grad():
            for t, c in zip(saved["tensors"], saved["copies"]):
                t.copy_(c, non_blocking=c.is_pinned())
        keys = set(map(id, saved["keys"]))
        for p in list(opt.state.keys()):
            if id(p) not in keys:
                del opt.state[p]
        for p, entry in saved["states"].items():
            opt.state[p] = {k: v for k, (_kind, v, _i) in entry.items()}

    def commit(self) -> None:
        self._saved = None
        self._cheap = {}


# -- the guard ---------------------------------------------------------------------------------------
_STATUS_OK, _STATUS_OOM, _STATUS_ERROR = 0, 1, 2
_LOCATIONS = ("none", "before_optimizer", "optimizer_state_init", "optimizer", "after_optimizer", "completed",
              "peer")


@dataclass
class _Attempt:
    phase: str = ""
    gathered: list[list[int]] | None = None  # A1's result
    a1_done: bool = False


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


class OOMGuard:
    """Runs train steps and recovers from out-of-memory errors inside them (see the module docstring).

    ``step``: the train step (``TrainStep`` or a ``Steppable``); ``plan``: the plan it runs under;
    ``replanner`` (or ``escalate`` + ``apply``): how to make and apply a smaller plan (defaults:
    ``step_down`` and ``switch_micro_batch``); ``memory``: where measurements come from; ``run_dir``: where
    memory snapshots go; ``transaction``: "auto" | "always" | "never" (pre-step copies, see above);
    ``process_group``: the group whose ranks retry together (the default group when torch.distributed is
    initialised with more than one rank); ``on_event(kind, data)``: "oom" and "replan" as they happen;
    ``on_retry(batch)``: called before each retry (telemetry restarts its per-attempt figures);
    ``leak_check(measured)``: a ``LeakReport`` when the OOM is a leak's (then ``MemoptLeakError``, no re-plan;
    see "A leak is not a plan problem" above), else None.
    """

    def __init__(self, step: Steppable, plan: Plan, *, replanner: Replanner | None = None,
                 escalate: EscalateFn | None = None, apply: ApplyFn | None = None, max_escalations: int = 3,
                 transaction: str = "auto", memory: MemorySource | None = None, run_dir: str | Path | None = None,
                 process_group: Any = None, restore_rng: bool = True,
                 is_oom: Callable[[BaseException], bool] = is_oom,
                 on_event: Callable[[str, dict[str, Any]], None] | None = None,
                 on_retry: Callable[[Any], None] | None = None, empty_cache: bool = True,
                 leak_check: Callable[[OOMMeasurement], LeakReport | None] | None = None,
                 foreign_threshold_bytes: int | None = None) -> None:
        from memopt.guard.foreign import DEFAULT_FOREIGN_THRESHOLD

        self.plan = plan
        # None: the default; 0 or less: do not look for foreign memory
        self.foreign_threshold_bytes = DEFAULT_FOREIGN_THRESHOLD if foreign_threshold_bytes is None \
            else foreign_threshold_bytes
        self.leak_check = leak_check
        if replanner is None:
            replanner = FunctionReplanner(escalate or step_down, apply or switch_micro_batch(step))
        self.replanner = replanner
        self.max_escalations = max_escalations
        self.transaction = StepTransaction(transaction)
        self.memory = memory
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.restore_rng = restore_rng
        self.is_oom = is_oom
        self.on_event = on_event
        self.on_retry = on_retry
        self.empty_cache = empty_cache
        self.phase_listeners: list[Callable[[str], None]] = []
        self.report = RecoveryReport()
        self.escalations = 0
        self.steps = 0  # optimizer steps completed under the guard
        self.optimizer_oom_seen = False
        self.pg = process_group
        self.rank, self.world = 0, 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self.world = torch.distributed.get_world_size(process_group)
            self.rank = torch.distributed.get_rank(process_group)
        self._attempt = _Attempt()
        self.step: Steppable = step
        self._user_on_phase = getattr(step, "on_phase", None)
        self._hook(step)

    @property
    def distributed(self) -> bool:
        return self.world > 1

    # -- phases ------------------------------------------------------------------------------------
    def _hook(self, step: Steppable) -> None:
        step.on_phase = self._on_phase
        self.transaction.bind(step)

    def _on_phase(self, name: str) -> None:
        self._attempt.phase = name
        for fn in self.phase_listeners:
            fn(name)
        if self._user_on_phase is not None:
            self._user_on_phase(name)
        if name == "optimizer" and self.distributed and not self._attempt.a1_done:
            gathered = self._agree([_STATUS_OK, 0, 1, 0, 0, 0])
            if any(row[0] != _STATUS_OK for row in gathered):
                raise _PeerFailure()

    def _at_risk(self) -> bool:
        peak_at = str(self.plan.prediction.get("peak_at") or "")
        return self.optimizer_oom_seen or "optimizer" in peak_at

    # -- collectives ---------------------------------------------------------------------------------
    def _device(self) -> torch.device:
        backend = torch.distributed.get_backend(self.pg)
        if backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _agree(self, row: list[int]) -> list[list[int]]:
        """All-gather one row of ints per rank: [status, location, can_restore, needed, peak_reserved, requested]."""
        dist = torch.distributed
        t = torch.tensor(row, dtype=torch.int64, device=self._device())
        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t, group=self.pg)
        gathered = [o.tolist() for o in out]
        if not self._attempt.a1_done:
            self._attempt.a1_done = True
            self._attempt.gathered = gathered
        return gathered

    def _broadcast_plan(self, plan: Plan | None, error: str | None) -> tuple[Plan | None, str | None]:
        payload = [{"plan": plan.to_dict() if plan is not None else None, "error": error}]
        torch.distributed.broadcast_object_list(payload, src=0, group=self.pg,
                                                device=self._device() if self._device().type == "cuda" else None)
        data = payload[0]
        return (Plan.from_dict(data["plan"]) if data["plan"] is not None else None), data["error"]

    # -- one step ------------------------------------------------------------------------------------
    def run(self, batch: Any) -> float:
        """One optimizer step over ``batch``, retried under a smaller plan after an OOM."""
        rng = _rng_state() if self.restore_rng else None
        attempt = 0
        while True:
            attempt += 1
            self._attempt = _Attempt()
            self.transaction.begin(at_risk=self._at_risk())
            if self.memory is not None:
                self.memory.reset_peak()
            failure: OOMMeasurement | None = None
            status, location, loss = _STATUS_OK, "completed", float("nan")
            try:
                loss = self.step.step(batch)
            except _PeerFailure:
                location = "peer"
            except Exception as exc:
                if not self.is_oom(exc):
                    self._share_error()
                    raise
                status = _STATUS_OOM
                location = self.transaction.classify(exc.__traceback__)
                failure = self._measure(exc, attempt, location)
                del exc
            can_restore = self.transaction.can_restore(location)
            rows = self._outcome(status, location, can_restore, failure)
            failed = [r for r, row in enumerate(rows) if row[0] == _STATUS_OOM]
            if any(row[0] == _STATUS_ERROR for row in rows):
                self._cleanup()
                raise RuntimeError("another rank failed with an error that is not an out-of-memory error; "
                                   "stopping this rank too")
            if not failed:
                self.transaction.commit()
                self.steps += 1
                return loss
            # -- recovery ------------------------------------------------------------------------------
            if failure is None:  # another rank ran out of memory
                failure = self._peer_measurement(rows, attempt, location)
            failure.failed_ranks = failed
            self.report.failures.append(failure)
            if any(_LOCATIONS[row[1]] in ("optimizer", "after_optimizer") for row in rows):
                self.optimizer_oom_seen = True
            self._cleanup()
            if can_restore:
                self.transaction.rollback(location)
            self._event("oom", failure.to_dict())
            leak = self._diagnose_leak(failure)
            blocked = [r for r, row in enumerate(rows) if not row[2]]
            if blocked:
                self._stop_blocked(blocked, failure, leak)
            if leak is not None:
                self.report.final = leak_message(leak, failure)
                raise MemoptLeakError(self.report.final, self.report)
            self._find_foreign(failure, batch)
            if self.escalations >= self.max_escalations:
                self.report.final = (f"still out of memory after {self.escalations} re-plan(s) "
                                     f"(max_escalations={self.max_escalations}); stopping")
                if failure.foreign_bytes:
                    from memopt.guard.foreign import foreign_message

                    self.report.final = foreign_message(failure, self.plan, self.report.final)
                raise MemoptOOMError(self.report.final, self.report)
            self.escalations += 1
            new_plan = self._escalate(self._worst(failure, rows, attempt, location))
            old = self.plan
            self._swap(self.replanner.apply(new_plan.strategy))
            self.plan = new_plan
            replan = {"attempt": self.escalations, "step": self.steps, "from": old.strategy.label(),
                      "to": new_plan.strategy.label(), **replan_prediction(new_plan)}
            self.report.replans.append(replan)
            self._event("replan", {**replan, "plan": new_plan})
            if rng is not None:
                _set_rng_state(rng)
            if self.on_retry is not None:
                self.on_retry(batch)

    def _outcome(self, status: int, location: str, can_restore: bool,
                 failure: OOMMeasurement | None) -> list[list[int]]:
        row = [status, _LOCATIONS.index(location), int(can_restore), (failure.needed_bytes or 0) if failure else 0,
               (failure.peak_reserved_bytes or 0) if failure else 0, (failure.requested_bytes or 0) if failure else 0]
        if not self.distributed:
            return [row]
        if not self._attempt.a1_done:
            return self._agree(row)  # A1 (this rank failed before the optimizer, or the step has no phases)
        a1 = self._attempt.gathered
        if any(r[0] != _STATUS_OK for r in a1):
            # A1 already told everyone; only this rank's own row differs from what A1 carried
            return [row if i == self.rank else r for i, r in enumerate(a1)]
        return self._agree(row)  # A2: after the optimizer step

    def _stop_blocked(self, blocked: list[int], failure: OOMMeasurement, leak: dict[str, Any] | None) -> None:
        self.report.final = (
            f"the optimizer step may have been partly applied on rank(s) {blocked} when memory ran out "
            f"({failure.location}), and no pre-step copy was kept, so the step cannot be retried safely. "
            "Use transaction='always' (pre-step copies of parameters and optimizer states in pinned "
            "CPU memory) or a plan with more headroom in the optimizer step")
        if leak is not None:
            self.report.final += (f". Memory also leaks: likely leak: {format_bytes(leak['growth_bytes_per_step'])}"
                                  f"/step over {leak['window']} steps, cause {leak['cause']}: {leak['fix']}")
            raise MemoptLeakError(self.report.final, self.report)
        raise MemoptOOMError(self.report.final, self.report)

    def _diagnose_leak(self, failure: OOMMeasurement) -> dict[str, Any] | None:
        """Rank 0's answer to ``leak_check`` (shared with every rank), recorded in the report and as an event."""
        if self.leak_check is None:
            return None
        leak = None
        if self.rank == 0:
            try:
                found = self.leak_check(failure)
                leak = found.to_dict() if found is not None else None
            except Exception:  # a diagnosis must never hide the OOM
                log.exception("could not check the memory history for a leak")
        if self.distributed:
            payload = [leak]
            device = self._device()
            torch.distributed.broadcast_object_list(payload, src=0, group=self.pg,
                                                    device=device if device.type == "cuda" else None)
            leak = payload[0]
        if leak is not None:
            self.report.leak = leak
            self._event("leak", {**leak, "at_oom": True, "oom_step": failure.step, "oom_attempt": failure.attempt})
        return leak

    def _share_error(self) -> None:
        if not self.distributed:
            return
        try:
            self._outcome(_STATUS_ERROR, "none", True, None)
        except Exception:  # the original error matters more
            log.exception("could not tell the other ranks about an error")

    def _escalate(self, failure: OOMMeasurement) -> Plan:
        plan, error = None, None
        if self.rank == 0:
            try:
                plan = self.replanner.escalate(self.plan, failure, self.escalations)
            except EscalationFailed as exc:
                error = str(exc)
        if self.distributed:
            plan, error = self._broadcast_plan(plan, error)
        if plan is None:
            self.report.final = f"out of memory and no smaller plan: {error}"
            if failure.foreign_bytes:
                from memopt.guard.foreign import foreign_message

                self.report.final = foreign_message(failure, self.plan, f"no smaller plan: {error}")
            raise MemoptOOMError(self.report.final, self.report)
        return plan

    def _find_foreign(self, failure: OOMMeasurement, batch: Any) -> None:
        """Measure memory the plan does not own (the failed step is freed by now); on every rank alike."""
        if self.foreign_threshold_bytes is None or self.foreign_threshold_bytes <= 0:
            return
        from memopt.guard.foreign import measure_foreign

        found = None
        try:
            found = measure_foreign(self.memory, self.step, self.plan, batch,
                                    threshold_bytes=self.foreign_threshold_bytes)
        except Exception:  # a measurement must never hide the OOM
            log.exception("could not measure foreign memory at the OOM")
        foreign = found.total_bytes if found is not None else 0
        if self.distributed:  # the rank with the most foreign memory decides what every rank plans for
            t = torch.tensor([foreign], dtype=torch.int64, device=self._device())
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.pg)
            foreign = int(t.item())
        if not foreign:
            return
        failure.foreign_bytes = foreign
        failure.foreign = {**(found.to_dict() if found is not None else {}),
                           "description": found.describe() if found is not None else
                           f"{format_bytes(foreign)} of foreign memory (on another rank)"}
        log.warning("out of memory with %s on the device; re-planning for what is left of the budget",
                    failure.foreign["description"])
        self._event("foreign_memory", {"step": failure.step, "attempt": failure.attempt, **failure.foreign})

    def _swap(self, step: Steppable) -> None:
        if step is not self.step:
            self.step.on_phase = self._user_on_phase
            self.transaction.unbind()
            self.step = step
            self._user_on_phase = getattr(step, "on_phase", None)
            if self._user_on_phase == self._on_phase:
                self._user_on_phase = None
        self._hook(self.step)

    # -- measurement and cleanup ----------------------------------------------------------------------
    def _measure(self, exc: BaseException, attempt: int, location: str) -> OOMMeasurement:
        message = str(exc)[:4000]
        parsed = parse_oom_message(message)
        m = OOMMeasurement(step=self.steps, attempt=attempt, phase=self._attempt.phase or "unknown",
                           location=location, message=message, strategy=self.plan.strategy.label(), rank=self.rank,
                           requested_bytes=parsed["requested_bytes"], predicted=_prediction(self.plan),
                           budget_bytes=self.plan.budget_bytes)
        if self.memory is not None:
            s = self.memory.sample()
            m.allocated_bytes, m.reserved_bytes = s.allocated_bytes, s.reserved_bytes
            m.peak_allocated_bytes, m.peak_reserved_bytes = s.peak_allocated_bytes, s.peak_reserved_bytes
            m.device_used_bytes, m.device_total_bytes = s.device_used_bytes, s.device_total_bytes
            try:
                m.categories_bytes = state_bytes(self.memory, getattr(self.step, "model", None),
                                                 self.step.optimizer)
            except Exception:  # a measurement must never hide the OOM
                log.exception("could not measure the model state at the OOM")
        m.snapshot_path = self._dump_snapshot(attempt)
        log.warning("out of memory at step %d (attempt %d) in %s under [%s]", m.step, attempt, m.phase, m.strategy)
        return m

    def _worst(self, failure: OOMMeasurement, rows: list[list[int]], attempt: int,
               location: str) -> OOMMeasurement:
        """What escalation plans for: this rank's measurement, or the failing rank's that needed the most."""
        if not self.distributed:
            return failure
        merged = self._peer_measurement(rows, attempt, location)
        merged.failed_ranks = failure.failed_ranks
        return merged if (merged.needed_bytes or 0) > (failure.needed_bytes or 0) else failure

    def _peer_measurement(self, rows: list[list[int]], attempt: int, location: str) -> OOMMeasurement:
        failed = [row for row in rows if row[0] == _STATUS_OOM]
        return OOMMeasurement(step=self.steps, attempt=attempt, phase="peer", location=location,
                              message="another rank ran out of memory", strategy=self.plan.strategy.label(),
                              rank=self.rank, requested_bytes=max(r[5] for r in failed) or None,
                              peak_reserved_bytes=max(r[4] for r in failed) or None,
                              reserved_bytes=max(r[3] - r[5] for r in failed) or None,
                              predicted=_prediction(self.plan), budget_bytes=self.plan.budget_bytes)

    def _dump_snapshot(self, attempt: int) -> str | None:
        if self.run_dir is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        try:
            snap = torch.cuda.memory._snapshot()
            if not any(snap.get("device_traces") or []):
                return None  # history recording is off: a snapshot without traces says little
            path = self.run_dir / "snapshots" / f"oom_step{self.steps}_attempt{attempt}_rank{self.rank}.pickle"
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(path))
            return str(path)
        except Exception:
            log.exception("could not dump a CUDA memory snapshot")
            return None

    def _cleanup(self) -> None:
        """Free what the failed attempt held: gradients, offload copies, then collect and empty the cache."""
        step = self.step
        for group in step.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        model = getattr(step, "model", None)
        if model is not None:
            model.zero_grad(set_to_none=True)
        master = getattr(step, "master", None)
        if master is not None:
            for m in master.masters:
                m.grad = None
        offload = getattr(step, "offload", None)
        if offload is not None:
            offload.flush()
        if hasattr(step, "last_micro_losses"):
            step.last_micro_losses = []
        release_cache(empty_cache=self.empty_cache)
        if self.memory is not None:
            self.memory.empty_cache()

    def _event(self, kind: str, data: dict[str, Any]) -> None:
        if self.on_event is not None:
            self.on_event(kind, data)

    def close(self) -> None:
        self.transaction.unbind()
        self.step.on_phase = self._user_on_phase


def _prediction(plan: Plan) -> dict[str, Any]:
    """The failing plan's prediction for an OOM record; empty when it was not made for the running strategy
    (after ``step_down``): a stale figure would make the measured/predicted ratio meaningless."""
    if not prediction_is_current(plan):
        return {"not_recomputed_for": plan.strategy.label(), "estimated_for": plan.prediction.get("estimated_for")}
    p = plan.prediction
    return {"peak_allocated_bytes": p.get("peak_allocated_bytes"), "peak_reserved_bytes": p.get("peak_reserved_bytes"),
            "runtime_bytes": p.get("runtime_bytes"), "total_bytes": p.get("total_bytes"),
            "breakdown": dict(p.get("breakdown") or {}), "peak_at": p.get("peak_at")}

