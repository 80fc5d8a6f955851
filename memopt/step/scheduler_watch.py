"""A scheduler passed as ``memopt.wrap(..., lr_scheduler=sched)`` that the script steps as well.

memopt steps ``sched`` after each optimizer step. A loop moved onto ``wrapped.step`` that still calls
``sched.step()``, as its plain form did, runs the schedule twice per step, and nothing else would show it. So the
position of the schedule after memopt's step is kept, and the next step compares: a counter that moved forward in
between was stepped by someone else (a warning, once). A position loaded by ``wrapped.load`` is memopt's own
(``SchedulerWatch.forget``); one set back (a rollback to an earlier checkpoint) is no step.
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["SchedulerWatch", "scheduler_position"]


def scheduler_position(scheduler: Any) -> list[int | None]:
    """``last_epoch`` of ``scheduler`` and of every scheduler it drives (``SequentialLR``'s and
    ``ChainedScheduler``'s ``_schedulers``; a ``ChainedScheduler`` has none of its own): each ``step()`` of the
    whole moves one of them forward."""
    position = [getattr(scheduler, "last_epoch", None)]
    for inner in getattr(scheduler, "_schedulers", None) or ():
        position += scheduler_position(inner)
    return position


def _moved_forward(now: list[int | None], then: list[int | None]) -> bool:
    return len(now) == len(then) and any(
        isinstance(a, int) and isinstance(b, int) and a > b for a, b in zip(now, then))


class SchedulerWatch:
    """The schedule's position after memopt's last step of it, and whether the warning was given."""

    def __init__(self) -> None:
        self._after_own: list[int | None] | None = None
        self._warned = False

    def before_step(self, scheduler: Any) -> None:
        """Warn (once) when ``scheduler`` moved forward since memopt last stepped it."""
        if self._after_own is None or self._warned:
            return
        now = scheduler_position(scheduler)
        if _moved_forward(now, self._after_own):
            self._warned = True
            moved = f" (last_epoch {self._after_own[0]} -> {now[0]})" if isinstance(now[0], int) else ""
            warnings.warn(f"the lr_scheduler passed to memopt.wrap, which memopt steps after each optimizer step, "
                          f"was also stepped outside it since memopt's last step{moved}, so the schedule runs "
                          "faster than the loop's: stop calling sched.step() in "
                          "the loop, or leave lr_scheduler= out of memopt.wrap and step a scheduler built on "
                          "wrapped.optimizer yourself", UserWarning, stacklevel=2)

    def after_step(self, scheduler: Any) -> None:
        self._after_own = scheduler_position(scheduler)

    def forget(self) -> None:
        """The schedule's position was set by memopt (a checkpoint loaded): nothing stepped it in between."""
        self._after_own = None
