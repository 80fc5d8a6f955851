#!/usr/bin/env python
"""Table of the checkpoint-loaded rows of ``scripts/qlora_from_checkpoint_gpu.py``: predicted vs measured load peak,
training peak (allocated, reserved), total and step time.

    python scripts/report_checkpoint_rows.py benchmarks/quant/raw/qlora_12gib.json ... \
        --out benchmarks/quant/qlora_8b_h200_rows
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GiB = 1 << 30


def _err(pred: float | None, meas: float | None) -> float | None:
    if pred is None or not meas:
        return None
    return 100.0 * (pred - meas) / meas


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        out.append({
            "plan": r["plan"], "strategy": r["strategy"], "budget_bytes": r["budget_bytes"],
            "plan_fits": r["plan_fits"], "fits_under_cap": r.get("fits_under_cap"),
            "load_peak_error_pct": _err(r["predicted_load_peak_allocated_bytes"],
                                        r.get("measured_load_peak_allocated_bytes")),
            "peak_allocated_error_pct": _err(r["predicted_peak_allocated_bytes"],
                                             r.get("measured_peak_allocated_bytes")),
            "peak_reserved_error_pct": _err(r["predicted_peak_reserved_bytes"], r.get("measured_peak_reserved_bytes")),
            "total_error_pct": _err(r["predicted_total_bytes"], r.get("measured_total_bytes")),
            "step_time_error_pct": _err(r["predicted_step_s"], r.get("measured_step_s")),
            "budget_share": r.get("measured_total_bytes", 0) / r["budget_bytes"],
            **{k: r.get(k) for k in ("predicted_load_peak_allocated_bytes", "measured_load_peak_allocated_bytes",
                                     "predicted_peak_allocated_bytes", "measured_peak_allocated_bytes",
                                     "predicted_peak_reserved_bytes", "measured_peak_reserved_bytes",
                                     "predicted_total_bytes", "measured_total_bytes", "predicted_step_s",
                                     "measured_step_s", "tokens_per_s", "load_s", "trainable_params", "losses")},
        })
    return out


def _fmt(v: float | None, unit: str = "") -> str:
    return "n/a" if v is None else f"{v:+.2f}{unit}"


def table(rows: list[dict]) -> str:
    lines = ["| plan | strategy | budget | load peak pred / meas (GiB) | err | alloc pred / meas (GiB) | err | "
             "reserved err | total / budget | step pred / meas (s) | err | tokens/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['plan']} | {r['strategy']} | {r['budget_bytes'] / GiB:.2f} GiB | "
            f"{r['predicted_load_peak_allocated_bytes'] / GiB:.3f} / "
            f"{(r['measured_load_peak_allocated_bytes'] or 0) / GiB:.3f} | {_fmt(r['load_peak_error_pct'], '%')} | "
            f"{r['predicted_peak_allocated_bytes'] / GiB:.2f} / "
            f"{(r['measured_peak_allocated_bytes'] or 0) / GiB:.2f} | "
            f"{_fmt(r['peak_allocated_error_pct'], '%')} | {_fmt(r['peak_reserved_error_pct'], '%')} | "
            f"{100 * r['budget_share']:.0f}% | {r['predicted_step_s']:.2f} / {(r['measured_step_s'] or 0):.2f} | "
            f"{_fmt(r['step_time_error_pct'], '%')} | {(r['tokens_per_s'] or 0):,.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rows", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="path without suffix: writes .json and .md")
    args = ap.parse_args()
    rows = summarize([json.loads(p.read_text()) for p in args.rows])
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    args.out.with_suffix(".md").write_text(table(rows) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
