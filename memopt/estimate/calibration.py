"""Measured peaks per (model profile, hardware, strategy), cached locally, for the planner's margins.

A run under a plan measures the real peaks (``Telemetry``); an OOM gives a lower bound. Each is stored as a
``CalibrationEntry`` (predicted and measured bytes, keyed by the strategy's label) in
``cache_dir()/calibration/<hardware>__<profile key>.json`` (``memopt.profile.cache_keys.cache_dir``:
``$MEMOPT_CACHE_DIR`` or ``~/.cache/memopt``). ``calibration_for(profile_key, hardware)`` returns them with
ratios measured / predicted; the planner can tighten its margin with ``Calibration.margin_bytes`` when the
predictions came out low (it never loosens them: a plan that over-predicted is only slower than it could be).
Peaks are maxima, so repeated runs of one strategy keep the highest measurement.

What is learnt, and what not:

* only clean steps: ``RuntimeGuard`` records nothing at an OOM and nothing from a run's steps after an OOM, a
  retry or memory the plan does not own (``memopt.guard.foreign``); ``record_calibration(oom=True)`` stores
  nothing;
* bounded: a measurement more than ``MAX_RATIO`` above (or below ``1 / MAX_RATIO`` of) its prediction is not a
  property of the estimator but of something else in the process, and is refused; the margin the planner
  derives never grows by more than ``MAX_RATIO``; at most ``MAX_ENTRIES`` strategies are kept (the newest);
* keyed to the estimator: each file records the digest of the estimator's code (``memopt.estimate.store.
  code_digest``); a file from another estimator is ignored (and replaced by the next clean run);
* shown when used (the plan's notes name the file), ignored with ``calibration="ignore"`` (``memopt.plan``,
  ``memopt.wrap``, ``python -m memopt.plan calibration=ignore``), cleared with ``calibration="clear"`` or
  ``python -m memopt.calibration clear``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memopt.estimate.store import code_digest
from memopt.profile.cache_keys import cache_dir

__all__ = [
    "CALIBRATION_VERSION",
    "Calibration",
    "CalibrationEntry",
    "calibration_for",
    "calibration_path",
    "clear_calibration",
    "record_calibration",
    "record_from_telemetry",
]

CALIBRATION_VERSION = 2
#: a measurement this far from its prediction (either way) is refused; the widened margin is capped by it too
MAX_RATIO = 1.5
#: strategies kept per model and GPU kind (the most recently measured)
MAX_ENTRIES = 64


def estimator_version() -> str:
    return code_digest()


@dataclass
class CalibrationEntry:
    """One strategy's predicted and measured peaks on one GPU kind (bytes)."""

    strategy: str
    predicted_peak_allocated_bytes: int
    predicted_peak_reserved_bytes: int
    predicted_total_bytes: int
    measured_peak_allocated_bytes: int
    measured_peak_reserved_bytes: int
    measured_total_bytes: int | None = None  # peak reserved + outside the allocator (None off a GPU)
    steps: int = 0
    oom: bool = False  # the measurement is a lower bound taken at an out-of-memory error
    updated: float = field(default_factory=time.time)

    @staticmethod
    def _ratio(measured: int | None, predicted: int) -> float | None:
        return measured / predicted if measured and predicted else None

    @property
    def ratio_allocated(self) -> float | None:
        return self._ratio(self.measured_peak_allocated_bytes, self.predicted_peak_allocated_bytes)

    @property
    def ratio_reserved(self) -> float | None:
        return self._ratio(self.measured_peak_reserved_bytes, self.predicted_peak_reserved_bytes)

    @property
    def ratio_total(self) -> float | None:
        """Measured / predicted total (reserved ratio when the total was not measured)."""
        return self._ratio(self.measured_total_bytes, self.predicted_total_bytes) or self.ratio_reserved

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(ratio_allocated=self.ratio_allocated, ratio_reserved=self.ratio_reserved,
                 ratio_total=self.ratio_total)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CalibrationEntry:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class Calibration:
    """Every calibrated strategy of one model profile on one GPU kind."""

    profile_key: str
    hardware: str
    entries: dict[str, CalibrationEntry] = field(default_factory=dict)
    version: int = CALIBRATION_VERSION
    estimator: str = field(default_factory=estimator_version)

    def _max(self, attr: str) -> float | None:
        vals = [getattr(e, attr) for e in self.entries.values() if getattr(e, attr) is not None]
        return max(vals) if vals else None

    @property
    def ratio_allocated(self) -> float | None:
        return self._max("ratio_allocated")

    @property
    def ratio_reserved(self) -> float | None:
        return self._max("ratio_reserved")

    @property
    def ratio_total(self) -> float | None:
        """The worst measured / predicted total over the strategies (the conservative one to plan with)."""
        return self._max("ratio_total")

    def ratio(self, strategy_label: str | None = None) -> float | None:
        """That strategy's own ratio when it was measured, else the worst over all strategies."""
        entry = self.entries.get(strategy_label) if strategy_label else None
        if entry is not None and entry.ratio_total is not None:
            return entry.ratio_total
        return self.ratio_total

    def margin_bytes(self, budget_bytes: int, policy_margin_bytes: int, strategy_label: str | None = None) -> int:
        """A margin under which a plan whose prediction is ``ratio`` x too low still leaves the policy's margin
        free: a plan may then predict at most ``(budget - policy margin) / ratio``. Never below the policy's."""
        r = self.ratio(strategy_label)
        if r is None or r <= 1.0:
            return policy_margin_bytes
        r = min(r, MAX_RATIO)
        return int(budget_bytes - max(budget_bytes - policy_margin_bytes, 0) / r)

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "estimator": self.estimator, "profile_key": self.profile_key,
                "hardware": self.hardware,
                "ratio_allocated": self.ratio_allocated, "ratio_reserved": self.ratio_reserved,
                "ratio_total": self.ratio_total,
                "entries": {k: e.to_dict() for k, e in sorted(self.entries.items())}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        if data.get("version") != CALIBRATION_VERSION:
            raise ValueError(f"calibration version {data.get('version')!r} is not {CALIBRATION_VERSION}")
        if data.get("estimator") != estimator_version():
            raise ValueError("calibration made by another estimator")
        return cls(profile_key=data["profile_key"], hardware=data["hardware"],
                   entries={k: CalibrationEntry.from_dict(v) for k, v in data.get("entries", {}).items()})


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def calibration_path(profile_key: str, hardware: str, *, directory: str | os.PathLike[str] | None = None) -> Path:
    if directory is None:
        directory = cache_dir() / "calibration"
    return Path(directory) / f"{_safe(hardware)}__{_safe(profile_key)}.json"


def calibration_for(profile_key: str, hardware: str, *,
                    directory: str | os.PathLike[str] | None = None) -> Calibration | None:
    """The calibration recorded for this profile on this GPU kind, or None (none yet, or unreadable)."""
    path = calibration_path(profile_key, hardware, directory=directory)
    try:
        return Calibration.from_dict(json.loads(path.read_text()))
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def record_calibration(profile_key: str, hardware: str, strategy: str, *, predicted: dict[str, Any],
                       measured: dict[str, Any], steps: int = 1, oom: bool = False,
                       directory: str | os.PathLike[str] | None = None) -> Calibration:
    """Add one measurement (merged with what is stored: peaks keep their maximum) and save atomically.

    ``predicted``: a plan's prediction (``peak_allocated_bytes``, ``peak_reserved_bytes``, ``total_bytes``);
    ``measured``: ``peak_allocated_bytes``, ``peak_reserved_bytes`` and, on a GPU, ``measured_total_bytes``.
    A stored entry whose prediction differs (another memopt) is replaced rather than merged. An OOM's lower
    bound (``oom=True``) and a measurement outside ``MAX_RATIO`` of its prediction are not stored (returns what
    is stored, or None).
    """
    cal = calibration_for(profile_key, hardware, directory=directory)
    if oom:
        return cal
    predicted_total = int(predicted.get("total_bytes") or 0)
    measured_total = measured.get("measured_total_bytes") or measured.get("peak_reserved_bytes")
    predicted_ref = predicted_total if measured.get("measured_total_bytes") else \
        int(predicted.get("peak_reserved_bytes") or 0)
    if predicted_ref and measured_total and not 1 / MAX_RATIO <= int(measured_total) / predicted_ref <= MAX_RATIO:
        import logging

        logging.getLogger(__name__).warning(
            "calibration: %s measured %d bytes against a prediction of %d; not learnt (more than %.0f%% off: "
            "something other than the plan held memory)", strategy, measured_total, predicted_ref,
            100 * (MAX_RATIO - 1))
        return cal
    cal = cal or Calibration(profile_key, hardware)
    new = CalibrationEntry(strategy=strategy,
                           predicted_peak_allocated_bytes=int(predicted["peak_allocated_bytes"]),
                           predicted_peak_reserved_bytes=int(predicted["peak_reserved_bytes"]),
                           predicted_total_bytes=int(predicted["total_bytes"]),
                           measured_peak_allocated_bytes=int(measured.get("peak_allocated_bytes") or 0),
                           measured_peak_reserved_bytes=int(measured.get("peak_reserved_bytes") or 0),
                           measured_total_bytes=(int(measured["measured_total_bytes"])
                                                 if measured.get("measured_total_bytes") else None),
                           steps=steps, oom=oom)
    old = cal.entries.get(strategy)
    same_prediction = old is not None and (old.predicted_peak_allocated_bytes, old.predicted_peak_reserved_bytes,
                                           old.predicted_total_bytes) == (new.predicted_peak_allocated_bytes,
                                                                          new.predicted_peak_reserved_bytes,
                                                                          new.predicted_total_bytes)
    if same_prediction:
        new.measured_peak_allocated_bytes = max(old.measured_peak_allocated_bytes, new.measured_peak_allocated_bytes)
        new.measured_peak_reserved_bytes = max(old.measured_peak_reserved_bytes, new.measured_peak_reserved_bytes)
        if old.measured_total_bytes is not None:
            new.measured_total_bytes = max(old.measured_total_bytes, new.measured_total_bytes or 0)
        new.steps += old.steps
        new.oom = old.oom or new.oom
    cal.entries[strategy] = new
    if len(cal.entries) > MAX_ENTRIES:
        newest = sorted(cal.entries.values(), key=lambda e: e.updated)[-MAX_ENTRIES:]
        cal.entries = {e.strategy: e for e in newest}
    path = calibration_path(profile_key, hardware, directory=directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(cal.to_dict(), f, indent=2)
    os.replace(tmp, path)
    return cal


def record_from_telemetry(telemetry: Any, *, directory: str | os.PathLike[str] | None = None,
                          force: bool = False) -> Calibration | None:
    """Store what a run's ``Telemetry`` measured for each strategy it ran. Only real GPU figures calibrate
    (a CPU stand-in's bytes say nothing about a GPU) unless ``force``."""
    plan = telemetry.plan
    memory = telemetry.memory
    if plan is None or memory is None or (memory.kind != "cuda" and not force):
        return None
    key = (plan.model or {}).get("profile_key")
    if not key:
        return None
    cal = None
    for label, m in telemetry.measured.items():
        if not m["steps"]:
            continue
        cal = record_calibration(key, plan.hardware, label, predicted=m["prediction"], measured=m,
                                 steps=m["steps"], directory=directory)
    return cal


def clear_calibration(profile_key: str | None = None, hardware: str | None = None, *,
                      directory: str | os.PathLike[str] | None = None) -> int:
    """Delete stored calibrations (of one model profile and/or GPU kind; all without arguments); returns how
    many files were removed."""
    if profile_key is not None and hardware is not None:
        paths = [calibration_path(profile_key, hardware, directory=directory)]
    else:
        folder = calibration_path("x", "x", directory=directory).parent
        paths = sorted(folder.glob("*.json")) if folder.is_dir() else []
        if hardware is not None:
            paths = [p for p in paths if p.name.startswith(f"{_safe(hardware)}__")]
        if profile_key is not None:
            paths = [p for p in paths if p.name.endswith(f"__{_safe(profile_key)}.json")]
    removed = 0
    for p in paths:
        try:
            p.unlink()
            removed += 1
        except FileNotFoundError:
            pass
    return removed
