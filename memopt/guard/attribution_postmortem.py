"""The post-mortem's module line: which module group overran the plan at an out-of-memory error, by how much, the
module and op that failed, and what the guard did about it (from ``attribution_oom.json``, written by
``memopt.guard.attribution.StepAttribution`` when the failing step was recorded)."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

from memopt.guard.attribution import OOM_FILE
from memopt.units import format_bytes

__all__ = ["oom_verdict"]


def oom_verdict(run_dir: str | os.PathLike[str] | None, event: dict[str, Any], events: list[dict[str, Any]],
                plan: dict[str, Any] | None) -> dict[str, Any] | None:
    """For an "oom" event of a run whose failing step was recorded: the module group and category whose live bytes
    at the failure exceeded the plan's most (against the plan's predicted table for that step), by how much, the
    module and op that failed, and what the guard did next. None when the failure was not recorded."""
    if run_dir is None:
        return None
    path = Path(run_dir) / OOM_FILE
    if not path.exists():
        return None
    failures = [f for f in json.loads(path.read_text()) if f.get("step") == event.get("step")]
    if not failures:
        return None
    f = failures[0]
    attr = ((plan or {}).get("prediction") or {}).get("attribution") or {}
    steps = attr.get("steps") or []
    predicted = (steps[0] if event.get("step") == 0 else steps[-1]) if steps else attr
    over: dict[tuple[str, str], int] = defaultdict(int)
    for g, cats in (f.get("by_group") or {}).items():
        for c, v in cats.items():
            over[(g, c)] = v - ((predicted.get("by_group") or {}).get(g, {}).get(c, 0))
    worst = max(over.items(), key=lambda kv: kv[1], default=None)
    action = _guard_action(event, events)
    out = {"failing_module": f["module"], "failing_op": f["op"], "failing_group": f["group"], "action": action}
    if worst is not None and worst[1] > 0:
        (g, c), by = worst
        modules = [(m, v.get(c, 0)) for m, v in (f.get("by_module") or {}).items() if v.get("group") == g]
        top = max(modules, key=lambda mv: mv[1], default=(g, 0))[0]
        measured = (f.get("by_group") or {}).get(g, {}).get(c, 0)
        out.update({"culprit_group": g, "culprit_category": c, "culprit_module": top, "over_bytes": by,
                    "measured_bytes": measured, "predicted_bytes": measured - by})
        text = (f"{c} of {g} (most in {top}) held {format_bytes(measured)} at the failure, "
                f"{format_bytes(by)} more than the plan's {format_bytes(measured - by)} at its peak")
    else:
        text = "no module group held more than the plan's peak for it at the failure"
    text += f"; it failed in {f['module']} ({f['op']}, {f['phase']})"
    if action:
        text += f"; the guard {action}"
    out["text"] = text
    return out


def _guard_action(event: dict[str, Any], events: list[dict[str, Any]]) -> str:
    """What the guard did after this OOM: the next replan or stop event of the run."""
    try:
        i = next(j for j, e in enumerate(events) if e is event)
    except StopIteration:
        return ""
    for e in events[i + 1:]:
        if e.get("kind") == "replan":
            return f"re-planned ({e.get('reason') or e.get('strategy')}) and retried the same batch"
        if e.get("kind") == "stopped":
            return f"stopped the run ({e.get('reason')})"
        if e.get("kind") == "oom":
            break
    return "retried the step"

