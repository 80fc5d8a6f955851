"""The measured pieces of a telemetry record, and the evidence the leak detector gets with them.

A record puts the allocator's counters beside the plan's prediction; the state categories (parameters,
gradients, optimizer states) and the graph census (``memopt.guard.census``) are the evidence a leak report
names its cause from. Both cost time on every step, so the categories are counted again only while they may
have changed and the census (``census="auto"``) runs only while memory grows. ``RecordFieldsMixin`` holds
these methods of ``Telemetry``; they read the attributes ``Telemetry.__init__`` sets.
"""

from __future__ import annotations

import itertools
from typing import Any

from memopt.guard.census import live_tensor_census
from memopt.guard.escalation import prediction_is_current
from memopt.guard.memory import MemorySample, state_bytes
from memopt.units import MiB

__all__ = ["RecordFieldsMixin"]


class RecordFieldsMixin:
    """``Telemetry``'s record fields: memory counters, the prediction, the state categories, the census."""

    @staticmethod
    def _memory_fields(s: MemorySample) -> dict[str, Any]:
        outside = s.outside_allocator_bytes
        return {"allocated_bytes": s.allocated_bytes, "reserved_bytes": s.reserved_bytes,
                "fragmentation_bytes": s.fragmentation_bytes, "peak_allocated_bytes": s.peak_allocated_bytes,
                "peak_reserved_bytes": s.peak_reserved_bytes,
                "peak_fragmentation_bytes": s.peak_reserved_bytes - s.peak_allocated_bytes,
                "device_used_bytes": s.device_used_bytes, "device_total_bytes": s.device_total_bytes,
                "process_used_bytes": s.process_used_bytes, "outside_allocator_bytes": outside,
                "measured_total_bytes": s.peak_reserved_bytes + (outside or 0)}

    def _prediction_fields(self) -> dict[str, Any]:
        p = self.plan
        if p is None:
            return {"predicted_peak_allocated_bytes": None, "predicted_peak_reserved_bytes": None,
                    "predicted_total_bytes": None, "budget_bytes": None}
        if not prediction_is_current(p):  # made for another strategy: nothing to compare with
            return {"predicted_peak_allocated_bytes": None, "predicted_peak_reserved_bytes": None,
                    "predicted_total_bytes": None, "predicted_step_time_s": None, "budget_bytes": p.budget_bytes,
                    "prediction_recomputed": False}
        return {"predicted_peak_allocated_bytes": p.peak_allocated_bytes,
                "predicted_peak_reserved_bytes": p.peak_reserved_bytes, "predicted_total_bytes": p.total_bytes,
                "predicted_step_time_s": p.step_time_s, "budget_bytes": p.budget_bytes}

    def _categories(self, *, end: bool = False) -> dict[str, int]:
        """Parameters, gradients and optimizer states in bytes. Counting them walks every tensor (about 10 ms a
        step on bert-large when done at each point), so they are counted at a step's end only while they may
        have changed -- the first steps, while the census is on, or when the step's end moved by 1 MiB or
        more -- and the last count is reused otherwise (and at the step's start)."""
        if self.memory is None or self.model is None:
            return {}
        now = self._points.get("step_end")
        stale = (self._cats is None or self.step_index < 2 or (self.census is not None and self.census.active)
                 or now is None or self._cats_at is None or abs(now - self._cats_at) >= MiB)
        if self._cats is None or (end and stale):
            self._cats, self._cats_at = state_bytes(self.memory, self.model, self.optimizer), now
        return dict(self._cats)

    def _evidence(self, *, end: bool) -> dict[str, Any]:
        ev: dict[str, Any] = {}
        if self.census is not None and self.census.active:
            ev.update(self.census.snapshot(reset_packed=end).to_dict())
            ev["census"] = True
        if self.record_categories:
            cats = self._categories(end=end)
            for k, v in cats.items():
                ev[f"{k}_bytes"] = v
            if end and self._grads_bytes is not None:
                ev["gradients_bytes"] = self._grads_bytes
        if end and self.record_outputs:
            ev["output_bytes"] = self._output_bytes
        return ev

    def _toggle_census(self) -> None:
        """``census="auto"``: on after a step (not the first: optimizer states and gradients appear then) whose
        end grew by the leak threshold, off again after two steps without such growth. (Waiting for two growing
        steps would leave a leak fast enough to fill the budget within 4 steps without evidence of its cause.)"""
        if not self._census_auto or self.census is None or self.leaks is None:
            return
        series = self.leaks.series.get("step_end", [])
        # the first delta (into step 0's end) is the optimizer states and gradients appearing: not counted
        ends = [v for _, v, _ in series[max(1, len(series) - 3):]]
        deltas = [b - a for a, b in itertools.pairwise(ends)]
        if not deltas:
            return
        threshold = self.leaks.threshold_bytes
        if deltas[-1] >= threshold and not self.census.active:
            self.census.install()
        elif self.census.active and len(deltas) >= 2 and max(deltas[-2:]) < threshold:
            self.census.remove()

    def _live_tensors(self) -> list[dict[str, Any]]:
        exclude = [x for x in (self.model, self.optimizer) if x is not None]
        return live_tensor_census(self.memory.device_type, exclude=exclude)
