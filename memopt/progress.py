"""What memopt is doing before training starts, one line at a time on the terminal.

``memopt.wrap`` profiles the model (fake-tensor traces), plans and, on a GPU, measures a few candidates before the
first step trains: seconds to minutes in which a user otherwise sees nothing. Each stage writes a line to standard
error as it starts, with the seconds since the work began::

    memopt [  0.0s] profiling GRULM (fake-tensor traces of the training step)
    memopt [  0.4s] traced fp32/ac=none/attn=auto/ce=0/offload=0 in 0.3 s
    memopt [  1.1s] planned: bf16_autocast ac=none mb=16x2 adamw_fused expandable (predicted 5.8 GiB, 0.27 s/step)
    memopt [  3.0s] first step trained

Shown when standard error is a terminal; ``MEMOPT_PROGRESS=1`` shows it anywhere (a log file, a notebook),
``MEMOPT_PROGRESS=0`` never. Lines go through ``print`` to ``sys.stderr`` as it is at the time of the call, so a
test or a notebook that replaces it sees them.
"""

from __future__ import annotations

import os
import sys
import time

__all__ = ["done", "enabled", "report", "start"]

_clock: list[float] = []  # when the work in progress began


def enabled() -> bool:
    """Whether progress lines are shown (``MEMOPT_PROGRESS``, else whether standard error is a terminal)."""
    setting = os.environ.get("MEMOPT_PROGRESS", "").strip()
    if setting in ("0", "1"):
        return setting == "1"
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def start(message: str) -> None:
    """The work begins: the lines' clock starts (again, if work that failed left it running)."""
    _clock[:] = [time.perf_counter()]
    report(message)


def report(message: str) -> None:
    """One line of progress: only inside work that :func:`start` began (a profile or a plan made on its own, as the
    dry run makes them, stays quiet) and only when :func:`enabled` says so."""
    if not _clock or not enabled():
        return
    print(f"memopt [{time.perf_counter() - _clock[0]:6.1f}s] {message}", file=sys.stderr, flush=True)


def done(message: str) -> None:
    """The work is over: its last line, and the clock stops."""
    if _clock:
        report(message)
        _clock.clear()
