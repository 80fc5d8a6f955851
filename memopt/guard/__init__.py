"""Runtime guard and observability: per-step memory telemetry, leak detection, OOM recovery, calibration.

* ``memopt.guard.telemetry``: ``Telemetry`` (``RUN_DIR/telemetry.jsonl``, ``progress()``) and the
  ``MemorySource`` readings it uses (``memopt.guard.memory``);
* ``memopt.guard.leaks``: ``LeakDetector`` (sustained growth at the same point of the step, with its cause);
* ``memopt.guard.recovery``: ``OOMGuard`` (free, re-plan, re-apply, retry the same batch; atomic optimizer
  step; ranks retry together; an OOM that a leak explains stops with ``MemoptLeakError`` instead of
  re-planning), built on ``memopt.guard.oom`` (detecting and measuring the error), ``memopt.guard.recovery_failure``
  (measuring a failed attempt, freeing what it held), ``memopt.guard.recovery_ranks`` (the collectives that make
  ranks retry together), ``memopt.guard.escalation`` (the escalations ``PlanEscalator``/``step_down``),
  ``memopt.guard.reapply`` (re-preparing the model) and ``memopt.guard.transaction`` (the all-or-nothing
  optimizer step);
* ``memopt.guard.foreign``: memory the plan does not own, measured at an OOM, re-planned around (the budget
  less it) or named when nothing fits in what is left;
* ``memopt.estimate.calibration``: measured/predicted ratios per model, GPU and strategy for the planner, from
  clean steps only (bounded, keyed to the estimator; ``python -m memopt.calibration clear``);
* ``memopt.guard.runtime``: ``RuntimeGuard``, all of the above around a train step (for ``memopt.wrap``);
* ``memopt.guard.report``: ``python -m memopt.report RUN_DIR``.
"""

from memopt.estimate.calibration import Calibration, CalibrationEntry, calibration_for, record_calibration
from memopt.guard.escalation import EscalationFailed, PlanEscalator, Replanner, step_down
from memopt.guard.leaks import LeakDetector, LeakReport, MemoryLeakWarning
from memopt.guard.memory import (
    CudaMemorySource,
    MemorySample,
    MemorySource,
    SimulatedMemorySource,
    TrackedMemorySource,
)
from memopt.guard.oom import MemoptLeakError, MemoptOOMError, OOMMeasurement
from memopt.guard.reapply import PreparedReplanner, reprepare
from memopt.guard.recovery import OOMGuard
from memopt.guard.runtime import RuntimeGuard
from memopt.guard.telemetry import Telemetry
from memopt.guard.transaction import StepTransaction

__all__ = [
    "Calibration",
    "CalibrationEntry",
    "CudaMemorySource",
    "EscalationFailed",
    "LeakDetector",
    "LeakReport",
    "MemoptLeakError",
    "MemoptOOMError",
    "MemoryLeakWarning",
    "MemorySample",
    "MemorySource",
    "OOMGuard",
    "OOMMeasurement",
    "PlanEscalator",
    "PreparedReplanner",
    "Replanner",
    "RuntimeGuard",
    "SimulatedMemorySource",
    "StepTransaction",
    "Telemetry",
    "TrackedMemorySource",
    "calibration_for",
    "record_calibration",
    "reprepare",
    "step_down",
]
