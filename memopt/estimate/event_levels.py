"""The allocated bytes of a composed event stream (``compose_stream.event_stream``) over time: the level after each
event, what is live at one event, where the second step begins, and a step's timeline thinned to a plot's points."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from memopt.profile.tracker import ALLOC
from memopt.units import allocator_size

__all__ = ["TIMELINE_POINTS", "downsample", "first_step_length", "level_at", "levels", "live_at", "step_timeline"]

TIMELINE_POINTS = 400


def levels(events: list[tuple[int, int, int]], start: int) -> Iterator[int]:
    """Allocated bytes after each event. A free takes away what its key allocated: the stream resolves a traced
    free to a fresh key, whose size (at this micro-batch) can differ from the traced free's own."""
    live: dict[int, int] = {}
    level = start
    for kind, key, size in events:
        if kind == ALLOC:
            live[key] = allocator_size(size)
            level += live[key]
        else:
            level -= live.pop(key, 0)
        yield level


def level_at(events: list[tuple[int, int, int]], n: int, start: int) -> int:
    *_, last = levels(events[:n], start) if n else iter([start])
    return last


def first_step_length(events: list[tuple[int, int, int]], origins: dict[int, Any], layout: Any) -> int | None:
    """Where the second step begins: the first forward allocation after the first step's optimizer events."""
    forward = set(layout.forward)
    seen_optimizer = False
    for i, (kind, key, _) in enumerate(events):
        if kind != ALLOC:
            continue
        inst = origins[key][0]
        if inst is None:
            seen_optimizer = True
        elif seen_optimizer and inst in forward:
            return i
    return None


def live_at(events: list[tuple[int, int, int]], at: int) -> dict[int, int]:
    live: dict[int, int] = {}
    for kind, key, size in events[:at + 1]:
        if kind == ALLOC:
            live[key] = allocator_size(size)
        else:
            live.pop(key, None)
    return live


def step_timeline(events: list[tuple[int, int, int]], origins: dict[int, Any], layout: Any, start: int
              ) -> dict[str, Any]:
    """Allocated bytes over one step (the second), at most ``TIMELINE_POINTS`` points (each the highest of its
    stretch of events), and where the forward, backward and optimizer phases begin (fractions of the step)."""
    forward = set(layout.forward)
    phase = "forward"
    points: list[int] = []
    phases: list[tuple[str, int]] = []
    for i, ((kind, key, _size), level) in enumerate(zip(events, levels(events, start))):
        if kind == ALLOC:
            inst = origins[key][0]
            now = "optimizer" if inst is None else "forward" if inst in forward else "backward"
            if now != phase or not phases:
                phase = now
                phases.append((now, i))
        points.append(level)
    return downsample(points, phases)


def downsample(values: list[int], phases: list[tuple[str, int]], points: int = TIMELINE_POINTS) -> dict[str, Any]:
    """``{"x": fractions of the step, "bytes": each stretch's highest level, "phases": [[name, start], ...]}``."""
    n = len(values)
    if n == 0:
        return {"x": [], "bytes": [], "phases": []}
    width = max(1, -(-n // points))
    xs, ys = [], []
    for lo in range(0, n, width):
        chunk = values[lo:lo + width]
        xs.append(lo / n)
        ys.append(max(chunk))
    merged: list[list[Any]] = []
    for name, i in phases:
        if merged and merged[-1][0] == name:
            continue
        merged.append([name, i / n])
    return {"x": xs, "bytes": ys, "phases": merged}
