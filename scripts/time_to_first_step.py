#!/usr/bin/env python
"""The CPU part of ``memopt.wrap``'s time to the first trained step: trace (profile) and plan, with the alternatives
the autotune measures (``make_plan(alternatives_within=)``, no re-plan), for models built from their configs on the
meta device:

    python scripts/time_to_first_step.py --out benchmarks/plan_quality/time_to_first_step_cpu.json

Each phase is timed as ``memopt.wrap`` runs it (``memopt.apply.wrapped.Wrapped._make_plan``),
with an empty profile cache (a first run). The GPU part (applying the plan, the autotune's measured passes, the first
step) is ``scripts/plan_quality_gpu.py``'s ``time_to_first_step_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = {"tinyllama1.1b-16x2048-24GiB": ("llama", "TINYLLAMA", 16, 2048, "24GiB"),
         "pythia410m-16x2048-16GiB": ("gpt_neox", "PYTHIA410", 16, 2048, "16GiB")}


def measure(case: str) -> dict[str, float | str | int]:
    import importlib.util

    import torch
    import transformers as tf

    import memopt
    from memopt.apply.autotune import frontier
    from memopt.plan.evaluated import ALTERNATIVES_WITHIN
    from memopt.plan.planner import make_plan
    from memopt.profile.api import profile_model

    spec = importlib.util.spec_from_file_location("zoo_matrix_gpu", ROOT / "scripts" / "zoo_matrix_gpu.py")
    zoo = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = zoo
    spec.loader.exec_module(zoo)
    model_type, cfg_name, b, s, budget = CASES[case]
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(model_type, **getattr(zoo, cfg_name)))
    ids = torch.randint(0, 1000, (b, s))
    batch = {"input_ids": ids, "labels": ids.clone()}
    hw = memopt.load_hardware("h200")
    t0 = time.perf_counter()
    prof = profile_model(model, batch, hardware=hw, use_cache=True)
    t1 = time.perf_counter()
    chosen = make_plan(model, batch, budget=budget, hardware=hw, profile=prof, alternatives_within=ALTERNATIVES_WITHIN)
    t2 = time.perf_counter()
    others = chosen.alternatives
    t3 = time.perf_counter()
    measured = frontier(chosen, others)
    return {"case": case, "trace_s": t1 - t0, "plan_s": t2 - t1, "alternatives_s": t3 - t2,
            "cpu_total_s": t3 - t0, "alternatives": len(others), "candidates_measured": len(measured),
            "plan": chosen.strategy.label(), "predicted_step_s": chosen.step_time_s,
            "candidates": [p.strategy.label() for p in measured]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "plan_quality" / "time_to_first_step_cpu.json"))
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    os.environ["MEMOPT_CACHE_DIR"] = tempfile.mkdtemp(prefix="memopt_ttfs_")  # a first run: nothing cached
    rows = [measure(c) for c in args.cases.split(",")]
    Path(args.out).write_text(json.dumps({"rows": rows, "cpu_count": os.cpu_count(),
                                          "command": "python scripts/time_to_first_step.py"}, indent=1) + "\n")
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
