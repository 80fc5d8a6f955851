"""Calibration learns from clean steps only, is bounded, keyed to the estimator, and easy to ignore or clear:
a run with an OOM and foreign memory cannot poison the next plan."""

from __future__ import annotations

import json

from memopt.calibration.__main__ import main as calibration_cli
from memopt.estimate.calibration import MAX_RATIO, calibration_for, calibration_path, record_calibration
from memopt.guard.memory import SimulatedMemorySource
from memopt.guard.runtime import RuntimeGuard
from memopt.models import with_overrides
from memopt.plan.planner import make_plan
from memopt.units import MiB

SPEC = with_overrides("tiny_llama", {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
                                     "vocab_size": 1024})
SAMPLE = {"batch_size": 4, "seq_len": 64}


class _GpuLikeSource(SimulatedMemorySource):
    """Figures set by hand, but calibrating as a GPU's do (only ``kind == 'cuda'`` sources are learnt)."""

    kind = "cuda"


class _Step:
    """A steppable whose memory figures the test sets (the guard only needs model, optimizer, on_phase)."""

    def __init__(self, memory: SimulatedMemorySource, peaks: list[int]) -> None:
        import torch

        self.model = torch.nn.Linear(2, 2)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.on_phase = None
        self.memory, self.peaks = memory, list(peaks)

    def step(self, batch):
        peak = self.peaks.pop(0)
        self.memory.set(allocated=peak, reserved=peak)
        return 1.0


def test_a_poisoned_run_leaves_the_next_plan_unchanged(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMOPT_CACHE_DIR", str(tmp_path))
    clean = make_plan(SPEC, SAMPLE, budget="8GB", hardware="h100_80gb")
    key, hw, label = clean.model["profile_key"], clean.hardware, clean.strategy.label()
    pred = clean.prediction
    # 1. an OOM's lower bound is not learnt (it carried 4 GB the plan did not own)
    huge = {"peak_allocated_bytes": 5 * pred["peak_allocated_bytes"], "peak_reserved_bytes": 4 << 30,
            "measured_total_bytes": 4 << 30}
    assert record_calibration(key, hw, label, predicted=pred, measured=huge, oom=True) is None
    # 2. a measurement beyond MAX_RATIO of its prediction is refused (something else held memory)
    assert record_calibration(key, hw, label, predicted=pred, measured=huge) is None
    assert calibration_for(key, hw) is None
    # 3. a guarded run: one clean step at the prediction, then an OOM; the steps after it are not learnt
    mem = _GpuLikeSource(device_total_bytes=80 << 30, outside_allocator_bytes=int(pred["runtime_bytes"]))
    total = int(pred["total_bytes"])
    step = _Step(mem, [total - int(pred["runtime_bytes"])] + [int(1.4 * total)] * 3)
    guard = RuntimeGuard(step, clean, memory=mem, leaks=False, census=False, calibrate=True)
    guard.step({"x": 1})
    guard._on_event("oom", {"step": 1, "phase": "forward[0]", "needed_bytes": 4 << 30})
    guard.step({"x": 2})
    guard.step({"x": 3})
    guard.close()
    cal = calibration_for(key, hw)
    assert cal is not None and cal.entries[label].steps == 1  # the clean step only
    assert cal.ratio_total <= 1.0
    after = make_plan(SPEC, SAMPLE, budget="8GB", hardware="h100_80gb")
    assert after.margin_bytes == clean.margin_bytes and after.strategy == clean.strategy
    assert any("stayed within their predictions; margin unchanged" in n for n in after.notes)  # shown when used


def test_another_estimators_calibration_is_ignored_and_the_margin_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMOPT_CACHE_DIR", str(tmp_path))
    clean = make_plan(SPEC, SAMPLE, budget="8GB", hardware="h100_80gb")
    key, hw, label = clean.model["profile_key"], clean.hardware, clean.strategy.label()
    pred = clean.prediction
    over = {"peak_allocated_bytes": pred["peak_allocated_bytes"], "peak_reserved_bytes": pred["peak_reserved_bytes"],
            "measured_total_bytes": int(pred["total_bytes"] * 1.3)}
    record_calibration(key, hw, label, predicted=pred, measured=over)
    cal = calibration_for(key, hw)
    assert abs(cal.ratio_total - 1.3) < 1e-3
    # bounded: however far a stored ratio says, the margin never assumes more than MAX_RATIO
    budget, base = 8 * 10**9, 256 * MiB
    cal.entries[label].measured_total_bytes = int(pred["total_bytes"] * 10)
    assert cal.margin_bytes(budget, base) == int(budget - (budget - base) / MAX_RATIO)
    # keyed to the estimator: a file written by another estimator is not read
    path = calibration_path(key, hw)
    data = json.loads(path.read_text())
    data["estimator"] = "another-estimator"
    path.write_text(json.dumps(data))
    assert calibration_for(key, hw) is None
    plan = make_plan(SPEC, SAMPLE, budget="8GB", hardware="h100_80gb")
    assert plan.margin_bytes == clean.margin_bytes and not any("calibration" in n for n in plan.notes)


def test_calibration_is_ignored_or_cleared_from_the_api_and_the_command_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEMOPT_CACHE_DIR", str(tmp_path))
    clean = make_plan(SPEC, SAMPLE, budget="8GB", hardware="h100_80gb")
    key, hw, label = clean.model["profile_key"], clean.hardware, clean.strategy.label()
    pred = clean.prediction
    over = {"peak_allocated_bytes": pred["peak_allocated_bytes"], "peak_reserved_bytes": pred["peak_reserved_bytes"],
            "measured_total_bytes": int(pred["total_bytes"] * 1.2)}
    record_calibration(key, hw, label, predicted=pred, measured=over)
    widened = make_plan(SPEC, SAMPLE, budget="8GB", hardware="h100_80gb")
    assert widened.margin_bytes > clean.margin_bytes
    ignored = make_plan(SPEC, SAMPLE, budget="8GB", hardware="h100_80gb", calibration="ignore")
    assert ignored.margin_bytes == clean.margin_bytes and any("calibration ignored" in n for n in ignored.notes)
    assert calibration_cli(["list"]) == 0 and key in capsys.readouterr().out
    assert calibration_cli(["clear", "--hardware", hw]) == 0
    assert calibration_for(key, hw) is None
    record_calibration(key, hw, label, predicted=pred, measured=over)
    cleared = make_plan(SPEC, SAMPLE, budget="8GB", hardware="h100_80gb", calibration="clear")
    assert cleared.margin_bytes == clean.margin_bytes and calibration_for(key, hw) is None
    assert any("calibration cleared (1 file(s) removed)" in n for n in cleared.notes)
    assert calibration_cli(["bogus"]) == 2
