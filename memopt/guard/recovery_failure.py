"""A failed attempt of ``OOMGuard.run``: what it measured, and what it held, freed before the retry.

Items 1 and 2 of ``memopt.guard.recovery``: the error measured (allocator counters, the size it tried to
allocate, the phase, the plan's prediction; a memory snapshot when history recording is on), another rank's
failure read from the gathered status rows, memory the plan does not own, and the step's tensors freed.
``FailedAttemptMixin`` holds these methods of ``OOMGuard``; they read the attributes ``OOMGuard.__init__`` sets.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from memopt.guard.escalation import prediction_is_current
from memopt.guard.memory import state_bytes
from memopt.guard.oom import OOMMeasurement, parse_oom_message, release_cache
from memopt.guard.recovery_ranks import STATUS_OOM
from memopt.plan.schema import Plan
from memopt.step.train_step import discard_accumulation
from memopt.units import format_bytes

__all__ = ["FailedAttemptMixin"]

# one logger for the OOM recovery, whichever of its modules logs
log = logging.getLogger("memopt.guard.recovery")


class FailedAttemptMixin:
    """``OOMGuard``'s measurement of a failed attempt and its cleanup."""

    def _find_foreign(self, failure: OOMMeasurement, batch: Any) -> None:
        """Measure memory the plan does not own (the failed step is freed by now); on every rank alike."""
        if self.foreign_threshold_bytes is None or self.foreign_threshold_bytes <= 0:
            return
        from memopt.guard.foreign import measure_foreign  # lazy: keeps memopt.guard.foreign out of import memopt

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
        failed = [row for row in rows if row[0] == STATUS_OOM]
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
        discard_accumulation(self.step)
        release_cache(empty_cache=self.empty_cache)
        if self.memory is not None:
            self.memory.empty_cache()


def _prediction(plan: Plan) -> dict[str, Any]:
    """The failing plan's prediction for an OOM record; empty when it was not made for the running strategy
    (after ``step_down``): a stale figure would make the measured/predicted ratio meaningless."""
    if not prediction_is_current(plan):
        return {"not_recomputed_for": plan.strategy.label(), "estimated_for": plan.prediction.get("estimated_for")}
    p = plan.prediction
    return {"peak_allocated_bytes": p.get("peak_allocated_bytes"), "peak_reserved_bytes": p.get("peak_reserved_bytes"),
            "runtime_bytes": p.get("runtime_bytes"), "total_bytes": p.get("total_bytes"),
            "breakdown": dict(p.get("breakdown") or {}), "peak_at": p.get("peak_at")}

