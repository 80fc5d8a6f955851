"""CI replays the committed H200 measurements: the current estimator re-predicts every row on this CPU, and
accuracy may not regress past the targets (allocated peak: median |error| <= 1%, each row <= 3%).

Rows are in benchmarks/validation/estimator_h200.json (scripts/validate_gpu.py measured them;
scripts/report_validation.py wrote the file). A row whose gap is known and open is listed in KNOWN_GAPS with
the reason: it is replayed and reported, and fails the test if it gets worse; it does not count toward the
median, and the issue that asks for the target stays open until it is closed.
"""

import json
import statistics
from pathlib import Path

import pytest

from harness.predict import estimate_row
from harness.rows import Row

REPORT = Path(__file__).resolve().parents[2] / "benchmarks" / "validation" / "estimator_h200.json"
ROWS = [r for r in json.loads(REPORT.read_text())["rows"] if r.get("ok") and "superseded" not in r] \
    if REPORT.exists() else []
MAX_ERROR = 0.03
# row id -> the |error| it must not exceed (none open). T5 with full checkpointing was 6.66% low until the
# CUDA softmax backward's scratch buffer (grad * output, as large as the gradient) was traced: the op log in
# benchmarks/probe/ops_t5_full_ac.json.gz showed it at the peak of the recomputed encoder block's backward.
KNOWN_GAPS: dict[str, float] = {}


@pytest.mark.slow
def test_replay_every_row():
    errors: dict[str, float] = {}
    problems = []
    for entry in ROWS:
        pred = estimate_row(Row.from_dict(entry["row"]))
        measured = entry["measured_peak_allocated_bytes"]
        error = (pred["predicted_peak_allocated_bytes"] - measured) / measured
        errors[entry["id"]] = error
        if abs(error) > KNOWN_GAPS.get(entry["id"], MAX_ERROR):
            problems.append(f"{entry['id']}: {100 * error:+.2f}% (predicted {pred['predicted_peak_allocated_bytes']}, "
                            f"measured {measured})")
        if pred["predicted_peak_reserved_bytes"] < pred["predicted_peak_allocated_bytes"]:
            problems.append(f"{entry['id']}: predicted reserved below allocated")
    counted = [abs(e) for rid, e in errors.items() if rid not in KNOWN_GAPS]
    median = statistics.median(counted)
    if median > 0.01:
        problems.append(f"median |error| {100 * median:.3f}% > 1%")
    assert not problems, "\n".join(problems)


def test_report_is_committed():
    assert REPORT.exists(), "benchmarks/validation/estimator_h200.json is missing: run scripts/report_validation.py"
    assert len(ROWS) >= 18
