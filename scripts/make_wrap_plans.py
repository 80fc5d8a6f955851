#!/usr/bin/env python
"""Make the wrap-validation plans on the CPU: python scripts/make_wrap_plans.py [--only MODEL]"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import memopt
from memopt.validation.wrap_cases import BUDGETS, CASES, HARDWARE, plan_name

OUT = Path(__file__).resolve().parent.parent / "benchmarks" / "wrap" / "plans"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    for model, sample in CASES:
        if args.only and args.only not in model:
            continue
        for budget in BUDGETS:
            t = time.time()
            plan = memopt.plan(model, sample, budget=budget, hardware=HARDWARE)
            path = plan.save(OUT / f"{plan_name(model, budget)}.json")
            print(f"{model:12s} {budget:6s} fits={plan.fits} {plan.strategy.label():70s} "
                  f"total={plan.total_bytes / 2**30:6.2f} GiB step={plan.step_time_s:.3f}s "
                  f"({time.time() - t:.0f}s) -> {path.name}", flush=True)
            if not plan.fits:
                print("   ", json.dumps(plan.infeasible))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
