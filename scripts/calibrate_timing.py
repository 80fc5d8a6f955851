#!/usr/bin/env python
"""Fit the step-time model's efficiencies to step times measured one row at a time on a GPU.

    python scripts/calibrate_timing.py benchmarks/validation/raw/estimator_h200_run1.jsonl \
        benchmarks/wrap/raw/speed.jsonl

Prints the fitted TimingModel (memopt/estimate/timing.py holds the result) and each row's error.
Rows measured while other processes shared the GPU are not valid timing data and must not be passed.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import memopt
from memopt.estimate.timing import TimingModel, host_time, terms_time
from memopt.models import with_overrides
from memopt.validation.rows import Row


def main() -> int:
    rows = []
    for path in sys.argv[1:]:
        for line in Path(path).read_text().splitlines():
            r = json.loads(line)
            if (r.get("ok") and r.get("measured_step_s") and "row" in r and "trainer" not in r["row"]["id"]
                    and not r["row"]["strategy"]["activation_offload"]):
                rows.append(r)
    data = []
    for r in rows:
        row = Row.from_dict(r["row"])
        prof = memopt.profile(with_overrides(row.model, row.overrides), sample=row.sample(), hardware=row.hardware)
        est = memopt.estimate(prof, row.strategy, exact_reserved=False)
        data.append((row.id, est.detail["time_terms"], r["measured_step_s"]))
    best = None
    grid = itertools.product([0.7, 0.8, 0.9, 1.0], [0.5, 0.8, 1.0], [1.0, 1.2, 1.4, 1.6], [0, 1e-6, 2e-6],
                             [0, 10e-6, 15e-6, 20e-6, 25e-6, 30e-6])
    for emm, eat, eme, la, disp in grid:
        tm = TimingModel(matmul_efficiency=emm, attention_efficiency=eat, memory_efficiency=eme, launch_s=la,
                         dispatch_s=disp)
        errs = []
        for _, t, y in data:
            pass_s = max(terms_time(t["pass"], tm), host_time(t["pass"], tm))
            pred = pass_s * t["micro_batches"] + terms_time(t["optimizer"], tm)
            errs.append(abs(pred - y) / y)
        score = statistics.median(errs) + 0.5 * statistics.mean(errs)
        if best is None or score < best[0]:
            best = (score, tm, errs)
    score, tm, errs = best
    print(tm)
    print(f"median |error| {100 * statistics.median(errs):.1f}%, max {100 * max(errs):.1f}% over {len(errs)} rows")
    for (rid, _, y), e in zip(data, errs):
        print(f"  {rid:55s} {100 * e:5.1f}%  (measured {y:.3f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
