#!/usr/bin/env python3
"""Tables of sharded / offloaded plans applied by ``memopt.wrap`` on the GPU (``scripts/wrap_sharded_gpu.py run``)
and of hand-written baselines (``scripts/validate_sharding_gpu.py``), each re-predicted by today's estimator.

    python scripts/report_wrap_sharded.py --out benchmarks/sharding/sharding_h200_s8 \\
        --plan-row benchmarks/sharding/plans/P.json=RUN/rank0.json ... \\
        --case-row RUN/baseline_fsdp2_x2.mb4.rank0.json ... \\
        --speed ROW_LABEL=BASELINE_LABEL ...

Each row: the plan or case, per-GPU allocated and reserved peaks (measured, predicted when it ran, predicted now),
the memory outside the allocator, the measured total against the budget, step time and throughput. ``--speed``
pairs give the throughput ratio of a row to a baseline (labels are the rows' ``id``: the file's parent folder).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GB = 10**9


def plan_row(plan_path: Path, row_path: Path) -> dict[str, Any]:
    import memopt
    from memopt.hardware import load_hardware
    from memopt.plan.schema import Plan
    from memopt.plan.sharded import predict_strategy

    plan = Plan.load(plan_path)
    row = json.loads(row_path.read_text())
    hw = load_hardware(plan.hardware)
    prof = memopt.profile(plan.model["name"], sample=plan.model["sample"], hardware=hw)
    now = predict_strategy(prof, hw, plan.strategy, plan.budget_bytes, margin=0)  # the run's cap, no margin
    uncapped_reserved = now.get("capped", {}).get("uncapped_reserved_bytes", now["peak_reserved_bytes"])
    return {"id": row_path.parent.name, "kind": "memopt.wrap", "setting": plan.strategy.label(),
            "budget_bytes": plan.budget_bytes, "predicted_then_allocated_bytes": row["predicted_peak_allocated_bytes"],
            "predicted_now_allocated_bytes": now["peak_allocated_bytes"],
            "predicted_now_reserved_bytes": uncapped_reserved,  # the pools, as a run without the cap would hold
            "predicted_now_runtime_bytes": now["runtime_bytes"],
            **_measured(row), "predicted_step_s": row["predicted_step_s"], "predicted_now_step_s": now["step_time_s"]}


def case_row(row_path: Path) -> dict[str, Any]:
    from harness import sharded_cases as sc

    row = json.loads(row_path.read_text())
    case = sc.ShardedCase.from_dict(row["case"])
    now = sc.predict_case(case, with_time=False)
    from memopt.hardware import load_hardware

    outside = load_hardware(case.hardware).runtime_overhead_bytes
    return {"id": row_path.parent.name, "kind": case.role, "setting": row["label"],
            "budget_bytes": case.cap_bytes + outside, "predicted_then_allocated_bytes": None,
            "predicted_now_allocated_bytes": now["predicted_peak_allocated_bytes"],
            "predicted_now_reserved_bytes": now["predicted_peak_reserved_bytes"],
            "predicted_now_runtime_bytes": now["predicted_runtime_bytes"], **_measured(row), "predicted_step_s": None}


def _measured(row: dict[str, Any]) -> dict[str, Any]:
    res = row["measured_peak_reserved_bytes"]
    out = row.get("measured_outside_allocator_bytes")
    return {"measured_allocated_bytes": row["measured_peak_allocated_bytes"], "measured_reserved_bytes": res,
            "measured_outside_allocator_bytes": out, "measured_total_bytes": res + (out or 0),
            "num_alloc_retries": row.get("num_alloc_retries"), "measured_step_s": row["measured_step_s"],
            "tokens_per_s": row.get("tokens_per_s"), "reserved_by_stream": row.get("reserved_by_stream"),
            # with the allocator history: the pools' peaks summed (what the run would reserve without a cap)
            "measured_pools_bytes": sum(p["mapped_peak_bytes"] for p in row["stream_peaks"])
            if row.get("stream_peaks") else None}


def _err(pred: int | None, meas: int) -> float | None:
    return None if pred is None else (pred - meas) / meas


def render(rows: list[dict[str, Any]], speed: list[dict[str, Any]]) -> str:
    def gb(n: int | None) -> str:
        return "-" if n is None else f"{n / GB:.2f}"

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:+.1f}%"

    lines = ["| row | setting | alloc meas / now (then) GB | err now | reserved meas / now GB | pools meas GB | "
             "retries | outside meas / now GB | total / budget | step s meas / now (then) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        alloc = f"{gb(r['measured_allocated_bytes'])} / {gb(r['predicted_now_allocated_bytes'])}"
        reserved = f"{gb(r['measured_reserved_bytes'])} / {gb(r['predicted_now_reserved_bytes'])}"
        lines.append(
            f"| {r['id']} | {r['setting']} | {alloc} ({gb(r['predicted_then_allocated_bytes'])}) | "
            f"{pct(r['alloc_err_now'])} | {reserved} | {gb(r.get('measured_pools_bytes'))} | "
            f"{r['num_alloc_retries']} | "
            f"{gb(r['measured_outside_allocator_bytes'])} / {gb(r['predicted_now_runtime_bytes'])} | "
            f"{r['measured_total_bytes'] / r['budget_bytes']:.1%} | {r['measured_step_s']:.3f}"
            + (f" / {r['predicted_now_step_s']:.3f} ({r['predicted_step_s']:.3f})" if r["predicted_step_s"] else "")
            + " |")
    errs = [abs(r["alloc_err_now"]) for r in rows]
    lines += ["", f"Allocated peak, predicted now vs measured: median |error| {100 * statistics.median(errs):.1f}%, "
              f"max {100 * max(errs):.1f}% over {len(rows)} rows."]
    pools = [r for r in rows if r.get("measured_pools_bytes")]
    if pools:
        perr = [abs(r["predicted_now_reserved_bytes"] / r["measured_pools_bytes"] - 1) for r in pools]
        lines.append(f"Reserved without a cap (the pools' peaks from the allocator history) vs predicted now: max "
                     f"|error| {100 * max(perr):.1f}% over {len(pools)} rows. Under the cap, after retries, reserved "
                     "is what the cap left.")
    for s in speed:
        lines.append(f"- speed: {s['id']} {s['step_s']:.3f} s vs {s['baseline']} {s['baseline_step_s']:.3f} s: "
                     f"**{s['speedup']:.2f}x**")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output path prefix (.json and .md are written)")
    ap.add_argument("--plan-row", action="append", default=[], metavar="PLAN=ROW")
    ap.add_argument("--case-row", action="append", default=[], metavar="ROW")
    ap.add_argument("--speed", action="append", default=[], metavar="ROW_ID=BASELINE_ID")
    ap.add_argument("--budget", action="append", default=[], metavar="ROW_ID=SIZE",
                    help="a baseline row's budget (e.g. 12GiB), when its cap is not the budget less the CUDA runtime")
    args = ap.parse_args(argv)
    rows = [plan_row(Path(p), Path(r)) for p, r in (x.split("=", 1) for x in args.plan_row)]
    rows += [case_row(Path(r)) for r in args.case_row]
    for r in rows:
        r["alloc_err_now"] = _err(r["predicted_now_allocated_bytes"], r["measured_allocated_bytes"])
    by_id = {r["id"]: r for r in rows}
    from memopt.units import parse_bytes

    for pair in args.budget:
        a, b = pair.split("=", 1)
        by_id[a]["budget_bytes"] = parse_bytes(b)
    speed = []
    for pair in args.speed:
        a, b = pair.split("=", 1)
        speed.append({"id": a, "baseline": b, "step_s": by_id[a]["measured_step_s"],
                      "baseline_step_s": by_id[b]["measured_step_s"],
                      "speedup": by_id[b]["measured_step_s"] / by_id[a]["measured_step_s"]})
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"rows": rows, "speed": speed}, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(rows, speed))
    print(render(rows, speed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
