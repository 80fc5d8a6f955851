"""Recording one step by module where training runs: ``memopt.wrap``'s step and a Hugging Face Trainer's."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from memopt.guard.attribution import StepAttribution

__all__ = ["TrainerStepAttribution", "record_wrapped_step"]


@contextlib.contextmanager
def record_wrapped_step(wrapped: Any, batch: Any) -> Iterator[StepAttribution | None]:
    """Around ``Wrapped.step``: record the step numbered ``wrapped.attribution_step`` (0: the first, where the
    optimizer states appear and where out-of-memory errors usually happen) into the run directory; any other step
    runs untouched."""
    run_dir = getattr(wrapped, "_run_dir", None)
    prepared = getattr(wrapped, "_prepared", None)
    if run_dir is None or prepared is None or wrapped.steps_done != getattr(wrapped, "attribution_step", None):
        yield None
        return
    step = prepared.step
    guard = getattr(wrapped, "guard", None)
    telemetry = getattr(guard, "telemetry", None)
    count = getattr(telemetry, "_plan_count", 0)
    rank = getattr(telemetry, "rank", 0)
    plan = getattr(wrapped, "plan", None)
    rec = StepAttribution(step.model, step.optimizer, device_type=wrapped.device.type, step=wrapped.steps_done,
                          strategy=plan.strategy.label() if plan is not None else "", master=step.master,
                          batch=batch, plan_file="plan.json" if not count else f"plans/plan_{count}.json")
    rec.snapshot_dir = Path(run_dir)
    listeners = getattr(getattr(guard, "oom", None), "phase_listeners", None)
    previous = step.on_phase
    if listeners is not None:
        listeners.append(rec.on_phase)
    else:
        def chained(name: str) -> None:
            rec.on_phase(name)
            if previous is not None:
                previous(name)

        step.on_phase = chained
    try:
        with rec:
            yield rec
    finally:
        if listeners is not None:
            listeners.remove(rec.on_phase)
        else:
            step.on_phase = previous
        if rank == 0 or rank is None:
            rec.write(run_dir)
        else:
            rec.write(run_dir, rank=rank)


# -- one step of a Hugging Face Trainer -------------------------------------------------------------------------
class TrainerStepAttribution:
    """A ``TrainerCallback`` recording one Trainer step by module (``step``: the global step, 0 the first) into
    ``run_dir`` (default ``<output_dir>/memopt``), with the plan beside it, for ``python -m memopt.report``. The
    Trainer signals its step and its optimizer step; forward and backward are told apart by the block markers."""

    def __init__(self, plan: Any, *, run_dir: str | os.PathLike[str] | None = None, step: int = 0) -> None:
        self.plan, self.step = plan, step
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.rec: StepAttribution | None = None
        self.done = False

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                      **kwargs: Any) -> Any:
        if self.done or self.rec is not None or state.global_step != self.step or model is None:
            return control
        run_dir = self.run_dir or Path(args.output_dir) / "memopt"
        run_dir.mkdir(parents=True, exist_ok=True)
        if self.plan is not None and not (run_dir / "plan.json").exists():
            self.plan.save(run_dir / "plan.json")
        opt = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the torch optimizer
        param = next(model.parameters(), None)
        self.rec = StepAttribution(model, opt, device_type=param.device.type if param is not None else "cpu",
                                   step=state.global_step, run_dir=run_dir,
                                   strategy=self.plan.strategy.label() if self.plan is not None else "")
        self.rec.__enter__()
        self.rec.on_phase("forward[0]")
        return control

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.rec is not None:
            self.rec.on_phase("optimizer")
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.close()
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.close()
        return control

    def close(self, exc: BaseException | None = None) -> None:
        """End the recording (``exc``: the step raised it, so nothing is tabulated). The Trainer calls no callback
        when its loop raises, so whoever runs the loop calls this: a recorder left entered is a dispatch mode that
        every later op of the process would pass through."""
        if self.rec is not None:
            rec, self.rec, self.done = self.rec, None, True
            rec.__exit__(type(exc) if exc is not None else None, exc, None)

    def __getattr__(self, name: str) -> Any:  # every other TrainerCallback event: nothing to do
        if name.startswith("on_"):
            return lambda args, state, control, **kwargs: control
        raise AttributeError(name)
