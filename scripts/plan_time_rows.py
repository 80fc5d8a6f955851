#!/usr/bin/env python
"""Wall seconds of ``memopt.plan`` on this machine for ``zoo_matrix_gpu.py`` rows, with the plan it made: a dry run
of each row as a user's first call makes it (no cache), for comparing two trees of memopt on the same machine.

    python scripts/plan_time_rows.py . gru-lm-32x512-8GiB,tuple-gru-lm-16x1024-6GiB > after.jsonl
    python scripts/plan_time_rows.py /path/to/older/checkout gru-lm-32x512-8GiB > before.jsonl
"""
import json
import sys
import time

import torch

root = sys.argv[1]
sys.path[:0] = [root, root + "/scripts"]

import zoo_matrix_gpu as z  # noqa: E402

import memopt  # noqa: E402

out = {}
for rid in sys.argv[2].split(","):
    row = next(r for r in z.ROWS if r.id == rid)
    with torch.device("meta"):
        m = z.build(row)
    b = z.batch_for(row, m)
    t = time.perf_counter()
    plan = memopt.plan(m, b, budget=row.budget, hardware="h200", use_cache=False)
    out[rid] = {"plan_s": round(time.perf_counter() - t, 1), "strategy": plan.strategy.label(),
                "predicted_peak_allocated_bytes": plan.prediction.get("peak_allocated_bytes"),
                "predicted_step_s": plan.step_time_s}
    print(json.dumps({rid: out[rid]}), flush=True)
