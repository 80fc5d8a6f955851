"""OOM recovery around one training step: free, re-plan, re-apply, retry the same batch.

``OOMGuard.run(batch)`` runs one optimizer step (``TrainStep.step``). When a CUDA out-of-memory error is
raised inside it:

1. the error is measured (allocator counters at the failure, the size it tried to allocate, the phase it
   happened in) and, when ``torch.cuda.memory._record_memory_history`` is on, a memory snapshot is dumped to
   ``RUN_DIR/snapshots/`` (open it in https://pytorch.org/memory_viz);
2. the step's tensors are freed: the exception and its frames are dropped, every gradient is set to None,
   activation offload's pending copies are released, ``gc.collect()`` and ``torch.cuda.empty_cache()``;
3. whatever the failed attempt changed is put back (see *Atomicity* in ``memopt.guard.transaction``), and
   the random number generators are reset to where the step began, so the retry draws the same dropout masks;
4. the plan is escalated (``escalate(plan, measured, attempt) -> Plan``) and applied (``apply(strategy)``
   returns the new train step: the model is re-prepared; the optimizer state carries over);
5. the SAME batch is retried: no data is skipped or counted twice, the step counter advances once.

After ``max_escalations`` re-plans in a run (default 3), or when no smaller plan exists, it stops with
``MemoptOOMError``, whose ``report`` lists every failure and re-plan.

The parts live in their own modules: ``memopt.guard.oom`` (recognising and measuring the error, the errors
raised), ``memopt.guard.recovery_failure`` (measuring a failed attempt, freeing what it held),
``memopt.guard.escalation`` (the smaller plan), ``memopt.guard.reapply`` (applying it to a prepared model),
``memopt.guard.transaction`` (the all-or-nothing optimizer step) and ``memopt.guard.recovery_ranks`` (the
collectives that make ranks retry together).

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

Distributed
-----------
Under ``torch.distributed`` the ranks retry together: every attempt ends in the same collectives on every
rank, so one rank's OOM never leaves the others waiting, and rank 0 escalates and broadcasts the new plan
(``memopt.guard.recovery_ranks`` gives the protocol, and what it does not cover).

Under a Hugging Face ``Trainer`` the same idea runs in ``memopt.integrations.trainer_recovery``: the Trainer gets
one accumulation step over its process's global batch and memopt's ``training_step`` runs the plan's
micro-batches inside it, so after an OOM in forward or backward the gradients are cleared (the Trainer step
started without any), the plan escalated and the same batch retried. (A callback alone cannot do it: with the
Trainer's own gradient accumulation, an OOM in micro-batch j > 0 leaves the gradients of micro-batches 0..j-1
mixed with part of j's, and the earlier micro-batches are no longer at hand.) An OOM inside the Trainer's own
optimizer step stays outside the retry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from memopt.guard.escalation import (
    ApplyFn,
    EscalateFn,
    EscalationFailed,
    FunctionReplanner,
    Replanner,
    Steppable,
    replan_prediction,
    step_down,
)
from memopt.guard.leaks import LeakReport
from memopt.guard.memory import MemorySource
from memopt.guard.oom import (
    MemoptLeakError,
    MemoptOOMError,
    OOMMeasurement,
    RecoveryReport,
    is_oom,
    leak_message,
)
from memopt.guard.reapply import switch_micro_batch
from memopt.guard.recovery_failure import FailedAttemptMixin
from memopt.guard.recovery_ranks import (
    LOCATIONS,
    STATUS_ERROR,
    STATUS_OK,
    STATUS_OOM,
    Attempt,
    PeerFailure,
    RankAgreementMixin,
)
from memopt.guard.transaction import StepTransaction
from memopt.plan.schema import Plan
from memopt.step.train_step import SchedulerStepFailed
from memopt.units import format_bytes

__all__ = ["OOMGuard"]

log = logging.getLogger(__name__)


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


# -- the guard ---------------------------------------------------------------------------------------
class OOMGuard(RankAgreementMixin, FailedAttemptMixin):
    """Runs train steps and recovers from out-of-memory errors inside them (see the module docstring).

    ``step``: the train step (``TrainStep`` or a ``Steppable``); ``plan``: the plan it runs under;
    ``replanner`` (or ``escalate`` + ``apply``): how to make and apply a smaller plan (defaults:
    ``step_down`` and ``switch_micro_batch``); ``memory``: where measurements come from; ``run_dir``: where
    memory snapshots go; ``transaction``: "auto" | "always" | "never" (pre-step copies, see memopt.guard.transaction);
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
        # lazy: keeps memopt.guard.foreign out of import memopt
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
        self._attempt = Attempt()
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
            gathered = self._agree([STATUS_OK, 0, 1, 0, 0, 0])
            if any(row[0] != STATUS_OK for row in gathered):
                raise PeerFailure()

    def _at_risk(self) -> bool:
        peak_at = str(self.plan.prediction.get("peak_at") or "")
        return self.optimizer_oom_seen or "optimizer" in peak_at

    # -- one step ------------------------------------------------------------------------------------
    def run(self, batch: Any) -> float:
        """One optimizer step over ``batch``, retried under a smaller plan after an OOM. A step that is abandoned
        (recovery gave up, a leak, an error, an interrupt) leaves the random generators where it began, so that the
        same batch stepped again draws the same dropout masks, as the guard's own retries do."""
        rng = _rng_state() if self.restore_rng else None
        try:
            return self._run(batch, rng)
        except SchedulerStepFailed:
            raise  # the weights moved before the scheduler raised: the step was taken, its draws with it
        except BaseException:
            if rng is not None:
                _set_rng_state(rng)
            raise

    def _run(self, batch: Any, rng: tuple[torch.Tensor, list[torch.Tensor] | None] | None) -> float:
        attempt = 0
        while True:
            attempt += 1
            self._attempt = Attempt()
            self.transaction.begin(at_risk=self._at_risk())
            if self.memory is not None:
                self.memory.reset_peak()
            failure: OOMMeasurement | None = None
            status, location, loss = STATUS_OK, "completed", float("nan")
            try:
                loss = self.step.step(batch)
            except PeerFailure:
                location = "peer"
            except Exception as exc:
                if not self.is_oom(exc):
                    self._share_error()
                    raise
                status = STATUS_OOM
                location = self.transaction.classify(exc.__traceback__)
                failure = self._measure(exc, attempt, location)
                del exc
            can_restore = self.transaction.can_restore(location)
            rows = self._outcome(status, location, can_restore, failure)
            failed = [r for r, row in enumerate(rows) if row[0] == STATUS_OOM]
            if any(row[0] == STATUS_ERROR for row in rows):
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
            if any(LOCATIONS[row[1]] in ("optimizer", "after_optimizer") for row in rows):
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
                    # lazy: keeps memopt.guard.foreign out of import memopt
                    from memopt.guard.foreign import foreign_message

                    self.report.final = foreign_message(failure, self.plan, self.report.final)
                raise MemoptOOMError(self.report.final, self.report)
            self.escalations += 1
            new_plan = self._escalate(self._worst(failure, rows, attempt, location))
            old = self.plan
            self._apply(new_plan)
            self.plan = new_plan
            replan = {"attempt": self.escalations, "step": self.steps, "from": old.strategy.label(),
                      "to": new_plan.strategy.label(), **replan_prediction(new_plan)}
            self.report.replans.append(replan)
            self._event("replan", {**replan, "plan": new_plan})
            if rng is not None:
                _set_rng_state(rng)
            if self.on_retry is not None:
                self.on_retry(batch)

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
                # lazy: keeps memopt.guard.foreign out of import memopt
                from memopt.guard.foreign import foreign_message

                self.report.final = foreign_message(failure, self.plan, f"no smaller plan: {error}")
            raise MemoptOOMError(self.report.final, self.report)
        return plan

    def _apply(self, new_plan: Plan) -> None:
        """Apply ``new_plan``; when that fails, the replanner has put the old plan back (``reprepare`` is all or
        nothing), and the guard trains on with the step it rebuilt. An OOM on the way is raised as
        ``MemoptOOMError`` (the state is intact), anything else as it is."""
        try:
            step = self.replanner.apply(new_plan.strategy)
        except BaseException as exc:
            self.escalations -= 1  # no re-plan took effect
            restored = getattr(self.replanner, "step", None)  # the old plan, prepared again
            if restored is not None and restored is not self.step:
                self._swap(restored)
                self._event("restored", {"plan": self.plan})
            if not (isinstance(exc, Exception) and self.is_oom(exc)):
                raise
            reason = (str(exc).strip().splitlines() or [""])[0]
            self.report.final = (f"out of memory while applying the smaller plan [{new_plan.strategy.label()}] "
                                 f"({reason}); the plan [{self.plan.strategy.label()}], the model and the optimizer "
                                 "state are as they were before the step: free memory and step the same batch again")
            raise MemoptOOMError(self.report.final, self.report) from exc
        self._swap(step)

    def _swap(self, step: Steppable) -> None:
        if step is not self.step:
            self.step.on_phase = self._user_on_phase
            self.transaction.unbind()
            self.step = step
            self._user_on_phase = getattr(step, "on_phase", None)
            if self._user_on_phase == self._on_phase:
                self._user_on_phase = None
        self._hook(self.step)

    def _event(self, kind: str, data: dict[str, Any]) -> None:
        if self.on_event is not None:
            self.on_event(kind, data)

    def close(self) -> None:
        self.transaction.unbind()
        self.step.on_phase = self._user_on_phase
