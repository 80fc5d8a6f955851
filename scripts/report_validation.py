#!/usr/bin/env python
"""Predict every measured GPU row on the CPU and write the validation report (JSON, markdown, PNG).

    python scripts/report_validation.py benchmarks/validation/raw/estimator_h200_run1.jsonl \
        --out benchmarks/validation/estimator_h200

The predictions are made here, without a GPU, as a user's dry run would make them (``memopt.profile`` +
``memopt.estimate``); the measured figures come from ``scripts/validate_gpu.py`` on the H200.
Rows listed with ``--superseded ID=reason`` are kept in the JSON but left out of the statistics.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.predict import estimate_row
from harness.rows import Row

GiB = 2**30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("raw", nargs="+", help="JSON-lines files written by scripts/validate_gpu.py")
    parser.add_argument("--out", required=True, help="output path without extension")
    parser.add_argument("--superseded", action="append", default=[], help="ROW_ID=reason")
    parser.add_argument("--concurrent", action="append", default=[],
                        help="a raw file whose rows shared the GPU with others: memory is valid, step times are not")
    args = parser.parse_args()
    superseded = dict(s.split("=", 1) for s in args.superseded)
    measured: dict[str, dict] = {}
    for path in [*args.raw, *args.concurrent]:
        for line in Path(path).read_text().splitlines():
            r = json.loads(line)
            r["timing_valid"] = path not in args.concurrent
            measured[r["row"]["id"]] = r  # a later file's measurement of the same row replaces the earlier
    rows = []
    for rid, r in measured.items():
        entry = {"id": rid, "row": r["row"], "ok": r.get("ok", False)}
        if not r.get("ok"):
            entry["error"] = r.get("error", "")[:300]
            rows.append(entry)
            continue
        pred = estimate_row(Row.from_dict(r["row"]))
        entry.update({k: r[k] for k in ("measured_peak_allocated_bytes", "measured_peak_reserved_bytes",
                                        "measured_device_used_bytes", "measured_outside_allocator_bytes",
                                        "measured_step_s")})
        entry.update({k: v for k, v in pred.items() if k != "time_terms"})
        entry["allocated_error"] = (pred["predicted_peak_allocated_bytes"] - r["measured_peak_allocated_bytes"]) \
            / r["measured_peak_allocated_bytes"]
        entry["reserved_error"] = (pred["predicted_peak_reserved_bytes"] - r["measured_peak_reserved_bytes"]) \
            / r["measured_peak_reserved_bytes"]
        entry["step_time_error"] = (pred["predicted_step_s"] - r["measured_step_s"]) / r["measured_step_s"]
        entry["timing_valid"] = r["timing_valid"]
        if rid in superseded:
            entry["superseded"] = superseded[rid]
        rows.append(entry)
        print(f"{rid:40s} alloc {100 * entry['allocated_error']:+7.3f}%  "
              f"reserved {100 * entry['reserved_error']:+7.3f}%"
              f"  step {100 * entry['step_time_error']:+6.1f}%", flush=True)
    counted = [e for e in rows if e.get("ok") and "superseded" not in e]
    stats = {
        "rows": len(counted),
        "allocated_median_abs_error": statistics.median(abs(e["allocated_error"]) for e in counted),
        "allocated_max_abs_error": max(abs(e["allocated_error"]) for e in counted),
        "reserved_median_abs_error": statistics.median(abs(e["reserved_error"]) for e in counted),
        "reserved_max_abs_error": max(abs(e["reserved_error"]) for e in counted),
        "step_time_median_abs_error": statistics.median(abs(e["step_time_error"]) for e in counted
                                                        if e["timing_valid"]),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"statistics": stats, "rows": rows}, indent=1))
    lines = ["| row | measured alloc GiB | predicted | error | measured reserved GiB | predicted | error | "
             "step s measured | predicted |", "|---|---|---|---|---|---|---|---|---|"]
    for e in rows:
        if not e.get("ok"):
            lines.append(f"| {e['id']} | failed: {e.get('error', '')[:80]} | | | | | | | |")
            continue
        mark = " (superseded)" if "superseded" in e else ""
        lines.append(
            f"| {e['id']}{mark} | {e['measured_peak_allocated_bytes'] / GiB:.3f} | "
            f"{e['predicted_peak_allocated_bytes'] / GiB:.3f} | {100 * e['allocated_error']:+.2f}% | "
            f"{e['measured_peak_reserved_bytes'] / GiB:.3f} | {e['predicted_peak_reserved_bytes'] / GiB:.3f} | "
            f"{100 * e['reserved_error']:+.2f}% | {e['measured_step_s']:.3f}{'' if e['timing_valid'] else '*'} | "
            f"{e['predicted_step_s']:.3f} |")
    summary = (f"\n\n{stats['rows']} rows: allocated peak median |error| "
               f"{100 * stats['allocated_median_abs_error']:.3f}%, "
               f"max {100 * stats['allocated_max_abs_error']:.2f}%; reserved median "
               f"{100 * stats['reserved_median_abs_error']:.2f}%, max {100 * stats['reserved_max_abs_error']:.2f}%; "
               f"step time median {100 * stats['step_time_median_abs_error']:.1f}%\n")
    notes = "".join(f"\n- {rid}: {why}" for rid, why in superseded.items())
    summary += ("\n\\* measured with other rows sharing the GPU: memory figures are per process and valid, step times "
                "are not (left out of the step-time statistics)\n")
    out.with_suffix(".md").write_text("\n".join(lines) + summary + (f"\nSuperseded rows:{notes}\n" if notes else ""))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 5))
        for ax, kind in zip(axes, ("allocated", "reserved")):
            xs = [e[f"measured_peak_{kind}_bytes"] / GiB for e in counted]
            ys = [e[f"predicted_peak_{kind}_bytes"] / GiB for e in counted]
            ax.scatter(xs, ys, s=18)
            top = max(xs + ys) * 1.05
            ax.plot([0, top], [0, top], color="grey", lw=0.8)
            ax.set_xlabel(f"measured peak {kind} (GiB)")
            ax.set_ylabel(f"predicted peak {kind} (GiB)")
            ax.set_title(f"{kind}: median |err| {100 * stats[f'{kind}_median_abs_error']:.2f}%, "
                         f"max {100 * stats[f'{kind}_max_abs_error']:.2f}%")
        fig.suptitle("memopt on an H200 (torch 2.11): predicted on a CPU vs measured")
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=110)
    except ImportError:
        print("matplotlib is not installed: no PNG")
    print(json.dumps(stats, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
