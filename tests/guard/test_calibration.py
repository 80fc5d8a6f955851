"""Calibration: measured/predicted peaks cached per (profile, hardware, strategy)."""

from __future__ import annotations

import json

import pytest

from memopt.estimate.calibration import (
    CALIBRATION_VERSION,
    calibration_for,
    calibration_path,
    record_calibration,
    record_from_telemetry,
)
from memopt.guard.memory import SimulatedMemorySource
from memopt.guard.telemetry import Telemetry
from memopt.strategy import Strategy
from memopt.units import GiB, MiB

from ._helpers import fake_plan

PRED = {"peak_allocated_bytes": 1000 * MiB, "peak_reserved_bytes": 1100 * MiB, "total_bytes": 1600 * MiB}


def test_record_merge_and_lookup(tmp_path):
    assert calibration_for("key1", "h200", directory=tmp_path) is None
    record_calibration("key1", "h200", "fp32 mb=2", predicted=PRED, directory=tmp_path, steps=10,
                       measured={"peak_allocated_bytes": 1050 * MiB, "peak_reserved_bytes": 1150 * MiB,
                                 "measured_total_bytes": 1700 * MiB})
    record_calibration("key1", "h200", "fp32 mb=2", predicted=PRED, directory=tmp_path, steps=5,
                       measured={"peak_allocated_bytes": 1020 * MiB, "peak_reserved_bytes": 1210 * MiB,
                                 "measured_total_bytes": 1650 * MiB})
    record_calibration("key1", "h200", "fp32 mb=1", predicted=PRED, directory=tmp_path, steps=3,
                       measured={"peak_allocated_bytes": 900 * MiB, "peak_reserved_bytes": 1000 * MiB,
                                 "measured_total_bytes": 1500 * MiB})
    cal = calibration_for("key1", "h200", directory=tmp_path)
    e = cal.entries["fp32 mb=2"]
    assert (e.measured_peak_allocated_bytes, e.measured_peak_reserved_bytes, e.measured_total_bytes, e.steps) == \
        (1050 * MiB, 1210 * MiB, 1700 * MiB, 15)  # maxima, steps summed
    assert cal.ratio("fp32 mb=2") == pytest.approx(1700 / 1600)
    assert cal.ratio("fp32 mb=1") == pytest.approx(1500 / 1600)
    assert cal.ratio_total == pytest.approx(1700 / 1600)  # the worst strategy
    assert cal.ratio("unmeasured") == pytest.approx(1700 / 1600)
    # the margin under which a 1700/1600 under-prediction still fits; never below the policy's own
    budget, margin = 40 * GiB, 1 * GiB
    m = cal.margin_bytes(budget, margin)
    assert (budget - m) * (1700 / 1600) == pytest.approx(budget - margin, rel=1e-6)
    assert cal.margin_bytes(budget, margin, "fp32 mb=1") == margin
    assert calibration_for("key1", "a100", directory=tmp_path) is None


def test_a_new_prediction_replaces_the_entry_and_the_cache_dir_is_memopts(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMOPT_CACHE_DIR", str(tmp_path))
    assert calibration_path("k", "H200 SXM").parent == tmp_path / "calibration"
    record_calibration("k", "H200 SXM", "s", predicted=PRED, steps=2,
                       measured={"peak_allocated_bytes": 2000 * MiB, "peak_reserved_bytes": 2000 * MiB})
    record_calibration("k", "H200 SXM", "s", predicted={**PRED, "total_bytes": 1700 * MiB}, steps=1,
                       measured={"peak_allocated_bytes": 1000 * MiB, "peak_reserved_bytes": 1000 * MiB})
    cal = calibration_for("k", "H200 SXM")
    assert cal.entries["s"].steps == 1 and cal.entries["s"].measured_peak_allocated_bytes == 1000 * MiB
    assert json.loads(calibration_path("k", "H200 SXM").read_text())["version"] == CALIBRATION_VERSION
    # without a measured total the reserved ratio stands in
    assert cal.ratio("s") == pytest.approx(1000 / 1100)


def test_record_from_telemetry_only_for_gpu_figures(tmp_path):
    plan = fake_plan(Strategy(micro_batch_size=2))
    mem = SimulatedMemorySource()
    tel = Telemetry(mem, plan=plan, leaks=False)
    tel.begin_step()
    mem.set(allocated=300 * MiB, reserved=320 * MiB)
    tel.end_step(loss=1.0)
    tel.close()
    assert record_from_telemetry(tel, directory=tmp_path) is None  # not a CUDA source
    cal = record_from_telemetry(tel, directory=tmp_path, force=True)
    entry = cal.entries[plan.strategy.label()]
    assert entry.measured_peak_allocated_bytes == 300 * MiB and entry.steps == 1
    assert cal.profile_key == "tinykey" and cal.hardware == "h100_80gb"
