"""The plan's margin widened by what earlier runs of the model measured (``memopt.estimate.calibration``)."""

from __future__ import annotations

import dataclasses

from memopt.estimate.calibration import calibration_for, calibration_path, clear_calibration
from memopt.hardware import HardwareSpec
from memopt.plan.policy import Policy
from memopt.profile.profile import Profile
from memopt.units import format_bytes

__all__ = ["CALIBRATION_MODES", "calibrated"]


CALIBRATION_MODES = ("use", "ignore", "clear")


def calibrated(pol: Policy, prof: Profile, hw: HardwareSpec, budget_bytes: int, notes: list[str],
               mode: str = "use") -> Policy:
    """The policy with its margin widened by this model's measured / predicted ratio on this GPU kind, if any
    (``mode`` "ignore": unchanged; "clear": the stored calibration is deleted first)."""
    if mode == "clear":
        removed = clear_calibration(prof.key, hw.name)
        notes.append(f"calibration cleared ({removed} file(s) removed); planned without it")
        return pol
    if mode == "ignore":
        if calibration_for(prof.key, hw.name) is not None:
            notes.append("calibration ignored (calibration='ignore'): the margin is the policy's")
        return pol
    cal = calibration_for(prof.key, hw.name)
    if cal is None or not cal.entries:
        return pol
    base = pol.margin(budget_bytes)
    margin = cal.margin_bytes(budget_bytes, base)
    ratio = cal.ratio_total
    if margin <= base:
        notes.append(f"calibration used ({calibration_path(prof.key, hw.name)}): {len(cal.entries)} measured "
                     f"plan(s) of this model on {hw.name} stayed within their predictions; margin unchanged")
        return pol
    notes.append(f"calibration used ({calibration_path(prof.key, hw.name)}): measured totals ran up to "
                 f"{100 * (ratio - 1):.1f}% above prediction for this model on {hw.name}; margin widened from "
                 f"{format_bytes(base)} to {format_bytes(margin)}")
    return dataclasses.replace(pol, margin_bytes=margin, margin_fraction=0.0)
