"""Per-step memory telemetry: what the step used, beside what the plan predicted.

Every step appends one JSON object to ``RUN_DIR/telemetry.jsonl`` (``telemetry.rank<r>.jsonl`` on other
ranks); bytes are ints and their keys end in ``_bytes``:

=================================== ==================================================================
step, attempts, strategy            the step's index (0-based), tries it took (1 without an OOM), the
                                    strategy label it finished under
step_time_s, loss, time             wall time of the step (all attempts), its loss, a Unix timestamp
allocated_bytes, reserved_bytes     at the end of the step
fragmentation_bytes                 reserved - allocated at the end of the step
peak_allocated_bytes,               highest since the start of the step (peaks are reset every step and
peak_reserved_bytes                 every retry)
peak_fragmentation_bytes            peak reserved - peak allocated
device_used_bytes,                  the driver's view (``torch.cuda.mem_get_info``: every process on the
device_total_bytes                  device); null where unknown (CPU)
process_used_bytes                  this process's share of it (NVML), null where no other process is listed
outside_allocator_bytes             this process's used - reserved: CUDA context, handles, NCCL (null on CPU)
measured_total_bytes                peak reserved + outside the allocator: comparable to the plan's total
predicted_peak_allocated_bytes,     the plan's prediction (null without a plan)
predicted_peak_reserved_bytes,
predicted_total_bytes, budget_bytes   null too after a re-plan that did not re-estimate (``step_down``
                                    without a profile); ``prediction_recomputed`` is then false
points_bytes                        allocated at named points: step_start, optimizer (before the optimizer
                                    step), step_end; the batch's own bytes are not counted
categories_bytes                    parameters and optimizer states (end of step), gradients (before the
                                    optimizer step), measured on the live tensors
saved_tensors                       the graph census (``memopt.guard.census``), when on
output_bytes                        bytes of the model's outputs over the step's forward passes
modules_bytes                       bytes each top module's forward left allocated (``record_modules``)
=================================== ==================================================================

Other happenings (OOMs, re-plans, leaks) go to ``RUN_DIR/events.jsonl``; the plan to ``RUN_DIR/plan.json``
and each re-plan to ``RUN_DIR/plans/plan_<n>.json``. ``progress()`` is a short string for a progress bar.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memopt.guard.census import GraphCensus
from memopt.guard.escalation import replan_prediction
from memopt.guard.leaks import LeakDetector
from memopt.guard.memory import (
    CudaMemorySource,
    MemorySample,
    MemorySource,
    SimulatedMemorySource,
    TrackedMemorySource,
    default_memory_source,
    gradient_bytes,
)
from memopt.guard.telemetry_fields import RecordFieldsMixin
from memopt.guard.telemetry_files import RunFilesMixin
from memopt.guard.telemetry_hooks import ForwardHooksMixin
from memopt.plan.schema import Plan
from memopt.units import GiB, MiB

__all__ = [
    "CudaMemorySource",
    "MemorySample",
    "MemorySource",
    "SimulatedMemorySource",
    "Telemetry",
    "TrackedMemorySource",
    "format_progress",
]


def format_progress(measured_bytes: int | None, limit_bytes: int | None = None,
                    predicted_bytes: int | None = None) -> str:
    """``mem 31.2/40.0 GiB (pred 30.9)``: the unit follows the limit (or the measurement)."""
    if measured_bytes is None:
        return "mem n/a"
    ref = limit_bytes or measured_bytes
    unit, name = (GiB, "GiB") if ref >= GiB else (MiB, "MiB")
    text = f"mem {measured_bytes / unit:.1f}"
    text += f"/{limit_bytes / unit:.1f} {name}" if limit_bytes else f" {name}"
    if predicted_bytes is not None:
        text += f" (pred {predicted_bytes / unit:.1f})"
    return text




class Telemetry(ForwardHooksMixin, RecordFieldsMixin, RunFilesMixin):
    """Records one line per training step (see the module docstring).

    Typical use, with a ``TrainStep`` (``memopt.guard.RuntimeGuard`` does all of this)::

        tel = Telemetry(plan=plan, run_dir="runs/x")   # CUDA counters when a GPU is present
        tel.attach(prepared.step)
        for batch in loader:
            tel.begin_step(batch)
            loss = prepared.step.step(batch)
            tel.end_step(loss=loss, batch=batch)
            bar.set_postfix_str(tel.progress())
        tel.close()

    A hand-written loop calls ``begin_step``/``mark("optimizer")``/``end_step`` itself.
    """

    FILE = "telemetry.jsonl"
    EVENTS = "events.jsonl"

    def __init__(self, memory: MemorySource | None = None, *, plan: Plan | None = None,
                 run_dir: str | os.PathLike[str] | None = None, leaks: LeakDetector | bool = True,
                 leak_threshold_bytes: int = 32 * MiB, leak_window: int = 5, census: bool | str = "auto",
                 record_categories: bool = True, record_outputs: bool = True, record_modules: bool = False,
                 model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None, rank: int = 0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.memory = memory if memory is not None else default_memory_source()
        self.plan = plan
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.rank = rank
        self.clock = clock
        self.record_categories = record_categories
        self.record_outputs = record_outputs
        self.record_modules = record_modules
        self.model = model
        self.optimizer = optimizer
        device_type = self.memory.device_type if self.memory is not None else "cpu"
        # the graph census costs a Python call per saved tensor (~15-45 us: ~12% of a small model's step on an
        # H200), so by default ("auto") it runs only while memory is growing from step to step
        self.census = GraphCensus(device_type) if census and self.memory is not None else None
        self._cats: dict[str, int] | None = None  # the last count of the state categories (see _categories)
        self._cats_at: int | None = None
        self._census_auto = census == "auto"
        if leaks is True and self.memory is not None:
            leaks = LeakDetector(threshold_bytes=leak_threshold_bytes, window=leak_window)
        self.leaks: LeakDetector | None = leaks if isinstance(leaks, LeakDetector) else None
        if self.leaks is not None:
            if self.leaks.census_fn is None:
                self.leaks.census_fn = self._live_tensors
            user_cb = self.leaks.on_leak
            self.leaks.on_leak = lambda r: self._on_leak(r, user_cb)
        self.records: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.step_index = 0
        self.last: dict[str, Any] | None = None
        self._hooks: list[Any] = []
        self._phase = ""
        self._points: dict[str, int] = {}
        self._batch_bytes = 0
        self._grads_bytes: int | None = None
        self._output_bytes = 0
        self._module_bytes: dict[str, int] = {}
        self._module_stack: list[int] = []
        self._t0: float | None = None
        self._attempts = 1
        self._files: dict[str, Any] = {}
        self._plan_count = 0
        self._started = False
        self.measured: dict[str, dict[str, Any]] = {}  # strategy label -> max measured + prediction (calibration)
        self.calibration_blocked: str | None = None  # why the run's later steps are not learnt (OOM, foreign memory)

    # -- wiring ------------------------------------------------------------------------------------
    def attach(self, step: Any, *, chain_phases: bool = True) -> Telemetry:
        """Read the model and optimizer of a ``TrainStep`` and (by default) listen to its phases."""
        self.bind(step)
        if chain_phases:
            previous = step.on_phase

            def on_phase(name: str) -> None:
                self.on_phase(name)
                if previous is not None:
                    previous(name)

            step.on_phase = on_phase
        return self

    def bind(self, step: Any) -> None:
        """Follow a (new) train step: its model, optimizer and master weights."""
        model = getattr(step, "model", None)
        if model is not self.model:
            self._remove_hooks()
            self.model = model
        self.optimizer = getattr(step, "optimizer", self.optimizer)
        self._install_hooks()

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        if self.census is not None and not self._census_auto:
            self.census.install()
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if self.plan is not None and self.rank == 0:
                self.plan.save(self.run_dir / "plan.json")

    def set_plan(self, plan: Plan, *, reason: str | None = None) -> Path | None:
        """A new plan from now on (after an escalation); saved as ``plans/plan_<n>.json``."""
        self.plan = plan
        self._plan_count += 1
        path = None
        if self.run_dir is not None and self.rank == 0:
            path = plan.save(self.run_dir / "plans" / f"plan_{self._plan_count}.json")
        self.event("replan", strategy=plan.strategy.label(), reason=reason,
                   plan_file=str(path.relative_to(self.run_dir)) if path is not None else None,
                   **replan_prediction(plan))
        return path

    # -- the step ----------------------------------------------------------------------------------
    def on_phase(self, name: str) -> None:
        self._phase = name
        if name == "optimizer":
            self.mark("optimizer")

    def begin_step(self, batch: Any = None) -> None:
        self.start()
        self._t0 = self.clock()
        self._attempts = 1
        self._reset_step_state(batch)
        if self.memory is None:
            return
        self.memory.reset_peak()
        value = self.memory.allocated_bytes() - self._batch_bytes
        self._points["step_start"] = value
        if self.leaks is not None:
            self.leaks.observe(self.step_index, "step_start", value, self._evidence(end=False))

    def _reset_step_state(self, batch: Any) -> None:
        self._points = {}
        self._grads_bytes = None
        self._output_bytes = 0
        self._module_bytes = {}
        self._module_stack = []
        self._phase = ""
        self._batch_bytes = self.memory.tensor_bytes(batch) if (self.memory is not None and batch is not None) else 0

    def retry(self, batch: Any = None) -> None:
        """The step starts again (after an OOM): per-attempt figures restart, the clock does not."""
        self._attempts += 1
        points = {k: v for k, v in self._points.items() if k == "step_start"}
        self._reset_step_state(batch)
        self._points = points
        if self.memory is not None:
            self.memory.reset_peak()

    def mark(self, point: str) -> None:
        """Allocated bytes at a named point of the step (``optimizer``: also the gradients' bytes)."""
        if self.memory is None:
            return
        self._points[point] = self.memory.allocated_bytes() - self._batch_bytes
        if point == "optimizer" and self.record_categories and self.memory is not None and self.model is not None:
            self._grads_bytes = gradient_bytes(self.memory, self.model, self.optimizer)

    def end_step(self, *, loss: float | None = None, batch: Any = None, **extra: Any) -> dict[str, Any]:
        """Close the step: write its record, run the leak check; returns the record."""
        if self._t0 is None:
            self.begin_step(batch)
        elapsed = self.clock() - self._t0
        rec: dict[str, Any] = {"step": self.step_index, "attempts": self._attempts, "time": time.time(),
                               "step_time_s": elapsed, "loss": _finite(loss)}
        if self.plan is not None:
            rec["strategy"] = self.plan.strategy.label()
        sample = self.memory.sample() if self.memory is not None else None
        if sample is not None:
            if batch is not None and not self._batch_bytes:
                self._batch_bytes = self.memory.tensor_bytes(batch)
            self._points["step_end"] = sample.allocated_bytes - self._batch_bytes
            rec.update(self._memory_fields(sample))
        rec.update(self._prediction_fields())
        if sample is not None:
            rec["points_bytes"] = dict(self._points)
            rec["batch_bytes"] = self._batch_bytes
            evidence = self._evidence(end=True)
            if self.record_categories:
                rec["categories_bytes"] = {k: evidence[f"{k}_bytes"] for k in
                                           ("parameters", "gradients", "optimizer_states") if f"{k}_bytes" in evidence}
            if "saved_unused_bytes" in evidence:
                rec["saved_tensors"] = {k: evidence[k] for k in ("saved_unused_bytes", "saved_retained_bytes",
                                                                 "saved_packed_bytes")}
            if self.record_outputs:
                rec["output_bytes"] = self._output_bytes
            if self.record_modules and self._module_bytes:
                rec["modules_bytes"] = dict(self._module_bytes)
        rec.update(extra)
        self._write(self._file_name(self.FILE), rec)
        self.records.append(rec)
        self.last = rec
        self._update_measured(rec)
        if sample is not None and self.leaks is not None:
            if "optimizer" in self._points:
                self.leaks.observe(self.step_index, "optimizer", self._points["optimizer"], evidence)
            self.leaks.observe(self.step_index, "step_end", self._points["step_end"], evidence)
        self._toggle_census()
        self.step_index += 1
        self._t0 = None
        return rec

    # -- calibration -------------------------------------------------------------------------------
    def block_calibration(self, reason: str) -> None:
        """Learn nothing more from this run (calibration takes clean steps only: no OOM, no retry, no memory the
        plan does not own); what clean steps measured before stays."""
        if self.calibration_blocked is None:
            self.calibration_blocked = reason

    def _update_measured(self, rec: dict[str, Any]) -> None:
        if self.plan is None or rec.get("peak_allocated_bytes") is None or rec.get("prediction_recomputed") is False:
            return  # calibration compares with a prediction made for this strategy only
        if (rec.get("attempts") or 1) > 1 or self.calibration_blocked is not None:
            return  # not a clean step
        label = self.plan.strategy.label()
        m = self.measured.setdefault(label, {"steps": 0, "peak_allocated_bytes": 0, "peak_reserved_bytes": 0,
                                             "measured_total_bytes": 0, "prediction": self.plan.prediction,
                                             "device_used_known": rec.get("device_used_bytes") is not None})
        m["steps"] += 1
        for k in ("peak_allocated_bytes", "peak_reserved_bytes", "measured_total_bytes"):
            m[k] = max(m[k], int(rec[k]))

    # -- progress ----------------------------------------------------------------------------------
    def progress(self) -> str:
        """``mem 31.2/40.0 GiB (pred 30.9)`` for the last step (measured total vs budget and prediction)."""
        rec = self.last
        if rec is None or rec.get("peak_reserved_bytes") is None:
            return "mem n/a"
        on_device = rec.get("device_used_bytes") is not None
        measured = rec["measured_total_bytes"] if on_device else rec["peak_reserved_bytes"]
        limit = rec.get("budget_bytes") or rec.get("device_total_bytes")
        pred = rec.get("predicted_total_bytes") if on_device else rec.get("predicted_peak_reserved_bytes")
        return format_progress(measured, limit, pred)

    def close(self) -> None:
        self._remove_hooks()
        if self.census is not None:
            self.census.remove()
        self._started = False
        for f in self._files.values():
            f.close()
        self._files = {}

    def __enter__(self) -> Telemetry:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _finite(x: Any) -> float | None:
    if x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if v == v and abs(v) != float("inf") else None
