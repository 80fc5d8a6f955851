#!/usr/bin/env python
"""Make the wrap-validation plans on the CPU.

    python scripts/make_wrap_plans.py [--only MODEL]
    python scripts/make_wrap_plans.py --autotune llama32_1b:40GiB,bert_large:24GiB

``--autotune`` writes the candidates ``memopt.wrap(..., autotune=True)`` would measure for those cases (the
planner's choice and the fastest plan of each checkpointing mode, memopt.apply.autotune) under
``plans/autotune/<case>/``, so the GPU session measures exactly what wrap would without re-profiling there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import memopt
from harness.wrap_cases import BUDGETS, CASES, HARDWARE, plan_name

OUT = Path(__file__).resolve().parent.parent / "benchmarks" / "wrap" / "plans"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="")
    parser.add_argument("--autotune", default="", help="MODEL:BUDGET,... : write autotune candidates")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.autotune:
        return autotune_candidates(args.autotune.split(","))
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


def autotune_candidates(cases: list[str]) -> int:
    from memopt.plan.evaluated import ALTERNATIVES_WITHIN

    for case in cases:
        model, budget = case.split(":")
        sample = dict(CASES)[model]
        folder = OUT / "autotune" / plan_name(model, budget)
        folder.mkdir(parents=True, exist_ok=True)
        chosen = memopt.plan(model, sample, budget=budget, hardware=HARDWARE, alternatives_within=ALTERNATIVES_WITHIN)
        chosen.save(folder / "0_chosen.json")
        for i, plan in enumerate(chosen.alternatives, start=1):
            plan.save(folder / f"{i}_{plan.strategy.checkpointing.mode}.json")
            print(f"{case} {plan.strategy.checkpointing.mode:9s} {plan.strategy.label():70s} "
                  f"step={plan.step_time_s:.3f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
