"""OOM in the Hugging Face ``Trainer``'s optimizer step: the step is all-or-nothing and retried.

The Trainer calls ``self.optimizer.step()`` after clipping and before the scheduler's step, outside
``training_step``. ``TransactionalOptimizerStep`` replaces the step of the torch optimizer underneath (the
``AcceleratedOptimizer``'s ``.optimizer``; a GradScaler and accelerate's own patch call through it) and runs it
under a ``memopt.guard.transaction.StepTransaction``:

* before the update, parameters and optimizer states are copied to pinned host memory when the step is at risk:
  the first step (the optimizer's states are created then, the step's largest allocation), a plan whose
  predicted peak is inside the optimizer step, or any step after an optimizer-step OOM in this run; or always
  (``mode="always"``); never (``mode="never"``);
* after an out-of-memory error inside the step, what the step changed is restored (the copies; or, when the
  error came from creating the first parameter group's states, just those new states), the cached blocks are
  freed, and the same step is run again over the same gradients, which the failed attempt left untouched.
  A ``foreach`` implementation (one temporary per parameter group, as large as the group's states) switches to
  the one-tensor-at-a-time loop first: the same update with temporaries of one parameter. A fused step has no
  such temporaries; it is retried as it is, once, in the memory the freed cache gave back;
* the clipping, the learning-rate scheduler and the Trainer's step count are outside the optimizer step: the
  scheduler and the step count advance once, after the step that succeeded; the gradients were clipped once.

When the step cannot be restored (an OOM past the first group's state creation without a pre-step copy), the
error says so: the parameters are partly updated, and the run should resume from its last checkpoint, which
nothing here touched; from then on every step is copied first.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from memopt.guard.oom import (
    MemoptOOMError,
    OOMMeasurement,
    RecoveryReport,
    parse_oom_message,
    release_cache,
)
from memopt.guard.transaction import StepTransaction

__all__ = ["TransactionalOptimizerStep", "torch_optimizer"]


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` inside accelerate's ``AcceleratedOptimizer`` (or the optimizer itself)."""
    inner = optimizer  # AcceleratedOptimizer subclasses Optimizer without its state: unwrap while one is inside
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = inner.optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        raise ValueError(f"cannot find a torch.optim.Optimizer inside {type(optimizer).__name__}; memopt's Trainer "
                         "recovery needs one (pass recover=False to memopt.wrap(trainer) to train without it)")
    return inner


class TransactionalOptimizerStep:
    """The torch optimizer's ``step``, all-or-nothing under an OOM and retried (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, report: RecoveryReport, mode: str = "auto",
                 plan_at_risk: bool = False, max_retries: int = 2, step_of: Any = None,
                 on_switch: Any = None) -> None:
        self.optimizer = optimizer
        self.report = report
        self.transaction = StepTransaction(mode)
        self.transaction.bind(types.SimpleNamespace(optimizer=optimizer))
        self.plan_at_risk = plan_at_risk
        self.max_retries = max_retries
        self.step_of = step_of or (lambda: 0)  # the Trainer's global step, for the report
        self.on_switch = on_switch  # called with the new optimizer name after a switch to the loop
        self.oom_seen = False
        self.steps = 0
        self._own = optimizer.__dict__.get("step")  # a patch installed before ours (accelerate's), if any
        self._original = optimizer.step
        optimizer.step = self  # type: ignore[method-assign]

    def uninstall(self) -> None:
        if self.optimizer.__dict__.get("step") is self:
            if self._own is None:
                del self.optimizer.step
            else:
                self.optimizer.step = self._own  # type: ignore[method-assign]
        self.transaction.unbind()

    def at_risk(self) -> bool:
        return self.oom_seen or self.plan_at_risk or not self.optimizer.state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        attempt = 1
        while True:
            self.transaction.begin(at_risk=self.at_risk())
            try:
                out = self._original(*args, **kwargs)
            except torch.OutOfMemoryError as exc:
                self._recover(exc, attempt)
            else:
                self.transaction.commit()
                self.steps += 1
                return out
            # outside the handler: the failed attempt's frames, and the temporaries they held, are gone now
            release_cache()
            attempt += 1

    def _recover(self, exc: torch.OutOfMemoryError, attempt: int) -> None:
        tx = self.transaction
        location = tx.classify(exc.__traceback__)
        restorable = tx.can_restore(location)
        if restorable:
            tx.rollback(location)
        tx.commit()
        self.oom_seen = True
        figures = parse_oom_message(str(exc))
        self.report.failures.append(OOMMeasurement(
            step=int(self.step_of()), attempt=attempt, phase="optimizer", location=location,
            message=str(exc)[:300], strategy=self._implementation(), requested_bytes=figures["requested_bytes"],
            allocated_bytes=figures["allocated_bytes"]))
        if not restorable:
            self.report.final = "out of memory inside the optimizer step, without a pre-step copy"
            raise MemoptOOMError(
                "out of memory inside the optimizer step after some parameters were updated: they are partly "
                "updated. Resume from the last checkpoint (memopt did not touch it); every later optimizer step "
                "is copied first, or pass transaction='always' to copy every step", self.report) from exc
        if attempt > self.max_retries:
            self.report.final = f"the optimizer step ran out of memory {attempt} times"
            raise MemoptOOMError(
                f"out of memory {attempt} times in the optimizer step; parameters and optimizer states are as "
                "before the step. The optimizer step does not fit beside the model states: re-plan with more headroom "
                "(a larger margin, or a smaller budget than the card's), or allow 8-bit optimizer states or "
                "offload", self.report) from exc
        before = self._implementation()
        if self._to_loop():
            self.report.replans.append({"attempt": attempt, "step": int(self.step_of()), "from": before,
                                        "to": self._implementation(), "where": "optimizer"})
            if self.on_switch is not None:
                self.on_switch("adamw" if "adam" in type(self.optimizer).__name__.lower() else None)

    def _implementation(self) -> str:
        groups = self.optimizer.param_groups
        kind = "fused" if any(g.get("fused") for g in groups) else (
            "foreach" if any(_runs_foreach(g) for g in groups) else "loop")
        return f"{type(self.optimizer).__name__} ({kind})"

    def _to_loop(self) -> bool:
        """Switch foreach groups to the one-tensor-at-a-time loop (same update); whether anything changed."""
        changed = False
        for g in self.optimizer.param_groups:
            if _runs_foreach(g):
                g["foreach"] = False
                changed = True
        return changed


def _runs_foreach(group: dict[str, Any]) -> bool:
    """``foreach=None`` is torch's default: foreach when the group's tensors are on CUDA."""
    if "foreach" not in group or group.get("fused") or group["foreach"] is False:
        return False
    return bool(group["foreach"]) or any(p.is_cuda for p in group["params"])

