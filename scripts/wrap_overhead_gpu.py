#!/usr/bin/env python
"""Where memopt.wrap's step time goes beyond the bare train step, on the GPU: one process, one prepared model,
three ways of stepping it interleaved over rounds (same allocator state, same kernels):

  guarded    ``wrapped.step(cpu_batch)``: the runtime guard (telemetry, leak checks) + staging the host batch
  bare_cpu   ``wrapped._prepared.step.step(cpu_batch)``: no guard, the host batch staged by the train step
  bare_gpu   ``wrapped._prepared.step.step(gpu_batch)``: no guard, the batch already on the GPU (as the grid rows)

    python scripts/wrap_overhead_gpu.py --plan benchmarks/wrap/plans/autotune/bert_large_24GiB/1_none.json \\
        --out OUT/overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()

    from memopt.plan import Plan
    from memopt.step.hard_cap import set_expandable_segments

    plan = Plan.load(args.plan)
    set_expandable_segments(plan.strategy.expandable_segments)
    import torch

    import memopt
    from memopt.models import SampleSpec, build_model, make_batch

    spec = plan.model["name"]
    torch.manual_seed(0)
    model = build_model(spec, device="cuda")
    cpu_batch = make_batch(spec, SampleSpec.parse(plan.model["sample"], spec), device="cpu")
    gpu_batch = {k: v.to("cuda") for k, v in cpu_batch.items()}
    w = memopt.wrap(model, plan=plan, lr=1e-5)
    ways = {"guarded": lambda: w.step(cpu_batch), "bare_cpu": lambda: w._prepared.step.step(cpu_batch),
            "bare_gpu": lambda: w._prepared.step.step(gpu_batch)}
    for fn in ways.values():  # warm every path
        fn()
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(args.rounds):
        for name, fn in ways.items():
            for _ in range(args.steps):
                torch.cuda.synchronize()
                t = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t)
    out = {"plan": str(args.plan), "strategy": plan.strategy.label(),
           "median_s": {k: statistics.median(v) for k, v in times.items()},
           "min_s": {k: min(v) for k, v in times.items()}, "step_times_s": times}
    print(json.dumps({k: out[k] for k in ("strategy", "median_s", "min_s")}, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
