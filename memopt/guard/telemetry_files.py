"""Where telemetry goes: one JSON line per record in ``RUN_DIR``, a file per kind and per rank.

Step records go to ``telemetry.jsonl`` and events (OOMs, re-plans, leaks) to ``events.jsonl``; ranks other
than 0 write ``<name>.rank<r>.jsonl`` so that ranks never share a file. Every line is flushed as written, so
a run that dies keeps what it measured. ``RunFilesMixin`` holds these methods of ``Telemetry``; they read
the attributes ``Telemetry.__init__`` sets.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from memopt.guard.leaks import LeakReport

__all__ = ["RunFilesMixin"]


class RunFilesMixin:
    """``Telemetry``'s events and the JSONL files its records and events are written to."""

    def event(self, kind: str, **data: Any) -> dict[str, Any]:
        rec = {"kind": kind, "step": self.step_index, "time": time.time(), **data}
        self.events.append(rec)
        self._write(self._file_name(self.EVENTS), rec)
        return rec

    def _on_leak(self, report: LeakReport, user_cb: Callable[[LeakReport], None] | None) -> None:
        self.event("leak", **report.to_dict())
        if user_cb is not None:
            user_cb(report)

    def _file_name(self, name: str) -> str:
        if self.rank == 0:
            return name
        stem, ext = name.rsplit(".", 1)
        return f"{stem}.rank{self.rank}.{ext}"

    def _write(self, name: str, rec: dict[str, Any]) -> None:
        if self.run_dir is None:
            return
        f = self._files.get(name)
        if f is None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            f = self._files[name] = open(self.run_dir / name, "a", encoding="utf-8")  # noqa: SIM115
        f.write(json.dumps(rec, default=_json_default) + "\n")
        f.flush()


def _json_default(o: Any) -> Any:
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    return str(o)
