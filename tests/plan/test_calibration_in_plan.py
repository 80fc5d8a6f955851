"""memopt.plan reads the calibration memopt.wrap's guard records: a model that measured above its prediction
on a GPU kind is planned with a margin widened by that ratio, and the plan says so."""

from memopt.estimate.calibration import calibration_for, record_calibration
from memopt.models import with_overrides
from memopt.plan.planner import make_plan

SPEC = with_overrides("tiny_llama", {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
                                     "vocab_size": 1024})
SAMPLE = {"batch_size": 4, "seq_len": 64}


def test_calibration_widens_the_margin_and_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMOPT_CACHE_DIR", str(tmp_path))
    first = make_plan(SPEC, SAMPLE, budget="8GB", hardware="h100_80gb")
    assert not any("calibration" in n for n in first.notes)
    key = first.model["profile_key"]
    measured_total = int(first.total_bytes * 1.25)
    record_calibration(key, first.hardware, first.strategy.label(), predicted=first.prediction,
                       measured={"peak_allocated_bytes": first.peak_allocated_bytes,
                                 "peak_reserved_bytes": first.peak_reserved_bytes,
                                 "measured_total_bytes": measured_total})
    cal = calibration_for(key, first.hardware)
    assert cal is not None and abs(cal.ratio_total - measured_total / first.total_bytes) < 1e-9
    second = make_plan(SPEC, SAMPLE, budget="8GB", hardware="h100_80gb")
    notes = [n for n in second.notes if n.startswith("calibration used")]
    assert notes and "25.0% above prediction" in notes[0]
    # hand arithmetic: the predicted total may be at most (budget - policy margin) / ratio
    expected = int(second.budget_bytes - (second.budget_bytes - first.margin_bytes) / cal.ratio_total)
    assert second.margin_bytes == expected > first.margin_bytes
    third = make_plan(SPEC, SAMPLE, budget="8GB", hardware="h100_80gb", use_calibration=False)
    assert third.margin_bytes == first.margin_bytes
    assert not any(n.startswith("calibration used") for n in third.notes)
    assert any(n.startswith("calibration ignored") for n in third.notes)  # said, when there is one


def test_a_calibration_within_prediction_keeps_the_margin(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMOPT_CACHE_DIR", str(tmp_path))
    first = make_plan(SPEC, SAMPLE, budget="8GB", hardware="h100_80gb")
    record_calibration(first.model["profile_key"], first.hardware, first.strategy.label(), predicted=first.prediction,
                       measured={"peak_allocated_bytes": first.peak_allocated_bytes,
                                 "peak_reserved_bytes": first.peak_reserved_bytes,
                                 "measured_total_bytes": int(first.total_bytes * 0.98)})
    second = make_plan(SPEC, SAMPLE, budget="8GB", hardware="h100_80gb")
    assert second.margin_bytes == first.margin_bytes
    assert any(n.startswith("calibration used") and "margin unchanged" in n for n in second.notes)
