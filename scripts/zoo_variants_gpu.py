#!/usr/bin/env python
"""One zoo row under pinned variants of its plan: which technique carries the allocated-peak error.

Each variant runs in a fresh process: ``memopt.wrap`` with the row's model and batch, the variant's pins and budget,
then ``--steps`` steps; the line written holds the plan, the predicted and the measured allocated peak (after the
first two steps) and its error. A row whose error moves with one pin localises the miss to that technique.

    python scripts/zoo_variants_gpu.py gptbigcode1b-8x2048-20GiB --budget 40GiB --out v.jsonl \\
        --variant 'offload:{"checkpointing":"full","checkpoint_blocks":3,"activation_offload":true}' \\
        --variant 'no-offload:{"checkpointing":"full","checkpoint_blocks":3,"activation_offload":false}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zoo_matrix_gpu as zoo


def run_variant(row_id: str, budget: str, pins: dict[str, Any], steps: int) -> dict[str, Any]:
    import torch

    import memopt

    row = next(r for r in zoo.ROWS if r.id == row_id)
    model, batch, calls = zoo.user_loop(row)
    wrapped = memopt.wrap(model, budget=budget, sample=batch, fidelity=row.fidelity, lr=1e-4, pins=pins,
                          autotune=False, **calls)
    plan = wrapped.plan
    out: dict[str, Any] = {"plan": plan.strategy.label(),
                           "predicted_peak_allocated_bytes": int(plan.peak_allocated_bytes),
                           "breakdown": plan.prediction.get("breakdown"), "peak_at": plan.prediction.get("peak_at"),
                           "predicted_step_s": float(plan.step_time_s)}
    times = []
    for i in range(steps):
        if i == 2:
            torch.cuda.synchronize()
            out["first_steps_peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t = time.perf_counter()
        wrapped.step(batch)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    out["measured_step_s"] = statistics.median(times[2:]) if len(times) > 2 else None
    out["measured_peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    out["allocated_error"] = out["predicted_peak_allocated_bytes"] / out["measured_peak_allocated_bytes"] - 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("row")
    ap.add_argument("--budget", required=True)
    ap.add_argument("--variant", action="append", default=[], help="NAME:{json pins}")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", required=True)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:  # the child: one variant, one JSON line on stdout
        name, pins = args.one.split(":", 1)
        try:
            res = run_variant(args.row, args.budget, json.loads(pins), args.steps)
        except Exception as e:  # the error is the result
            res = {"error": f"{type(e).__name__}: {e}"[:800]}
        print("RESULT " + json.dumps({"row": args.row, "variant": name, "budget": args.budget, **res}), flush=True)
        return 0
    for v in args.variant:
        t = time.perf_counter()
        p = subprocess.run([sys.executable, __file__, args.row, "--budget", args.budget, "--steps", str(args.steps),
                            "--out", args.out, "--one", v], capture_output=True, text=True)
        lines = [x[7:] for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        res = json.loads(lines[-1]) if lines else {"row": args.row, "variant": v.split(":", 1)[0],
                                                   "error": (p.stderr or "")[-800:]}
        res["wall_s"] = round(time.perf_counter() - t, 1)
        with open(args.out, "a") as f:
            f.write(json.dumps(res) + "\n")
        print(json.dumps({k: res.get(k) for k in ("variant", "plan", "allocated_error", "error")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
