"""``RuntimeGuard``: telemetry, leak detection, OOM recovery and calibration around one train step.

This is the piece ``memopt.wrap`` plugs in::

    prepared = prepare(model, plan.strategy, device_type="cuda", **prepare_kwargs)
    guard = RuntimeGuard(prepared.step, plan, run_dir="runs/x",
                         replanner=PreparedReplanner(prepared, prepare_kwargs, PlanEscalator(profile)))
    for batch in loader:
        loss = guard.step(batch)            # retried under a smaller plan after an OOM
        bar.set_postfix_str(guard.progress())
    guard.close()                           # calibration of the plan with what was measured

Files in ``run_dir``: ``telemetry.jsonl`` (a line per step), ``events.jsonl`` (OOMs, re-plans, leaks),
``plan.json`` and ``plans/plan_<n>.json``, ``snapshots/`` (CUDA memory snapshots at OOMs, when memory
history recording is on), ``oom_report.json`` when recovery gave up. ``python -m memopt.report RUN_DIR``
renders them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from memopt.estimate.calibration import record_from_telemetry
from memopt.guard.escalation import ApplyFn, EscalateFn, Replanner, Steppable
from memopt.guard.leaks import LeakDetector, LeakReport
from memopt.guard.memory import MemorySource, default_memory_source
from memopt.guard.oom import MemoptOOMError, OOMMeasurement
from memopt.guard.recovery import OOMGuard
from memopt.guard.telemetry import Telemetry
from memopt.plan.schema import Plan
from memopt.units import MiB

__all__ = ["RuntimeGuard"]


class RuntimeGuard:
    """Runs ``step.step(batch)`` with telemetry, leak detection and (``recover=True``) OOM recovery.

    ``memory``: a ``MemorySource`` (CUDA counters by default when a GPU is present; none on a CPU, where
    telemetry records time and loss only). ``leaks``: a ``LeakDetector``, or True for one with
    ``leak_threshold_bytes``/``leak_window``. The recovery arguments are ``OOMGuard``'s. ``diagnose_leaks``
    (with a leak detector): at an OOM, first ask the detector whether memory has been leaking
    (``LeakDetector.diagnose_oom``); if so, stop with ``MemoptLeakError`` and a "leak" event instead of
    re-planning (``memopt.guard.recovery``, "A leak is not a plan problem"). ``calibrate``: store measured
    peaks for the planner when the run closes (GPU runs only; clean steps only: none after an OOM or foreign
    memory in the run). ``foreign_threshold_bytes``: at an OOM, memory the plan does not own above this is planned
    around (``memopt.guard.foreign``; None: 256 MiB, 0: off).
    """

    def __init__(self, step: Steppable, plan: Plan, *, run_dir: str | os.PathLike[str] | None = None,
                 memory: MemorySource | None = None, recover: bool = True, replanner: Replanner | None = None,
                 escalate: EscalateFn | None = None, apply: ApplyFn | None = None, max_escalations: int = 3,
                 transaction: str = "auto", leaks: LeakDetector | bool = True, leak_threshold_bytes: int = 32 * MiB,
                 leak_window: int = 5, census: bool | str = "auto", record_modules: bool = False,
                 calibrate: bool = True, calibration_dir: str | os.PathLike[str] | None = None,
                 process_group: Any = None, diagnose_leaks: bool = True,
                 foreign_threshold_bytes: int | None = None) -> None:
        self.memory = memory if memory is not None else default_memory_source()
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.rank = torch.distributed.get_rank(process_group) if (
            torch.distributed.is_available() and torch.distributed.is_initialized()) else 0
        self.calibrate = calibrate
        self.calibration_dir = calibration_dir
        self.telemetry = Telemetry(self.memory, plan=plan, run_dir=self.run_dir, leaks=leaks,
                                   leak_threshold_bytes=leak_threshold_bytes, leak_window=leak_window,
                                   census=census, record_modules=record_modules, rank=self.rank)
        self.oom: OOMGuard | None = None
        self._step = step
        if recover:
            self.oom = OOMGuard(step, plan, replanner=replanner, escalate=escalate, apply=apply,
                                max_escalations=max_escalations, transaction=transaction, memory=self.memory,
                                run_dir=self.run_dir, process_group=process_group, on_event=self._on_event,
                                on_retry=self.telemetry.retry, foreign_threshold_bytes=foreign_threshold_bytes,
                                leak_check=self._leak_check if diagnose_leaks and self.telemetry.leaks else None)
            self.oom.phase_listeners.append(self.telemetry.on_phase)
            self.telemetry.bind(step)
        else:
            self.telemetry.attach(step)
        self._closed = False

    @property
    def train_step(self) -> Steppable:
        """The train step in use (a re-plan replaces it)."""
        return self.oom.step if self.oom is not None else self._step

    @property
    def prepared(self) -> Any:
        """The current ``Prepared`` when the replanner re-prepares the model (``PreparedReplanner``), else None."""
        replanner = self.oom.replanner if self.oom is not None else None
        return getattr(replanner, "prepared", None)

    @property
    def plan(self) -> Plan:
        return self.oom.plan if self.oom is not None else self.telemetry.plan

    def step(self, batch: Any) -> float:
        """One optimizer step over ``batch``; returns its loss."""
        self.telemetry.begin_step(batch)
        try:
            loss = self.oom.run(batch) if self.oom is not None else self._step.step(batch)
        except MemoptOOMError as exc:
            self.telemetry.event("stopped", reason=str(exc).splitlines()[0])
            if self.run_dir is not None and self.rank == 0:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                (self.run_dir / "oom_report.json").write_text(json.dumps(exc.report.to_dict(), indent=2,
                                                                         default=str))
            raise
        self.telemetry.end_step(loss=loss, batch=batch)
        return loss

    def progress(self) -> str:
        return self.telemetry.progress()

    def _leak_check(self, failure: OOMMeasurement) -> LeakReport | None:
        detector = self.telemetry.leaks
        if detector is None:
            return None
        report = detector.diagnose_oom(failure.shortfall_bytes)
        if report is not None and detector.report is None:
            detector.report = report  # reported (as the OOM's cause): the window rule stays quiet
        return report

    def _on_event(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "oom":
            self.telemetry.event("oom", **data)
            # an OOM's figures are never learnt (memopt.estimate.calibration learns from clean steps only), and the
            # run's later steps neither: memory the step did not plan for may still be there
            self.telemetry.block_calibration("out-of-memory error")
        elif kind == "foreign_memory":
            self.telemetry.event("foreign_memory", **data)
            self.telemetry.block_calibration("foreign memory")
        elif kind == "leak":
            self.telemetry.event("leak", **data)
        elif kind == "restored":  # a re-plan that failed to apply: the old plan runs again, on a rebuilt step
            self.telemetry.bind(self.oom.step)
        elif kind == "replan":
            plan = data["plan"]
            self.telemetry.bind(self.oom.step)
            self.telemetry.set_plan(plan, reason=f"out of memory (re-plan {data['attempt']}): [{data['from']}] -> "
                                                 f"[{data['to']}]")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.calibrate and self.rank == 0:
            record_from_telemetry(self.telemetry, directory=self.calibration_dir)
        self.telemetry.close()
        if self.oom is not None:
            self.oom.close()

    def __enter__(self) -> RuntimeGuard:
        self.telemetry.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
