#!/usr/bin/env python
"""Report the GPU session's wrap and speed rows (written by scripts/gpu_session.py).

    python scripts/report_wrap.py RUN_DIR --out benchmarks/wrap/wrap_h200

wrap: for each architecture x budget, the CPU-made plan applied by memopt.wrap under the hard cap:
plan_fits, fits_under_cap, predicted vs measured peaks, step time, throughput, the share of the budget used.
speed: the plan against the hand-tuned grid and the Hugging Face Trainer baseline at the same budget and
global batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

GiB = 2**30


def _load(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _micro_batch(r: dict) -> int | None:
    if "per_device_batch" in r:
        return r["per_device_batch"]
    strategy = (r.get("row") or {}).get("strategy") or {}
    if isinstance(r.get("strategy"), str) and "mb=" in r["strategy"]:  # a plan's label: "... mb=8x1 ..."
        return int(r["strategy"].split("mb=", 1)[1].split("x", 1)[0])
    return strategy.get("micro_batch_size")


def _speed_case(case: str, rows: list[dict], lines: list[str]) -> dict | None:
    """One speed case: the table, and the plan against the best grid row and the Trainer baseline."""
    lines += [f"## Speed: {case}, same budget and global batch, one configuration at a time", "",
              "| configuration | trained | step s | throughput |", "|---|---|---|---|"]
    best_grid, trainer, plan, tuned, largest = None, None, None, None, 0
    for r in rows:
        label = r.get("label", "")
        if label.startswith("speed2/"):  # speed2/<case>/<role>[/pd=K]/r<k>: a round of the interleaved run
            label = label.rsplit("/r", 1)[0].replace("/grid_best", "/grid/best")
        oom = bool(r.get("oom")) or r.get("fits_under_cap") is False
        ok = r.get("ok") and r.get("fits_under_cap", r.get("ok")) and not oom
        row = r.get("row", {})
        tokens = row.get("batch_size", 0) * (row.get("seq_len") or 1)
        tput = r.get("tokens_per_s") or (tokens / r["measured_step_s"] if r.get("measured_step_s") else 0)
        trained = "yes" if ok else "no (OOM)" if oom else "error"
        lines.append(f"| {label} | {trained} | {r.get('measured_step_s', 0):.3f} | {tput:,.0f} |")
        if not ok:
            continue
        if "/grid/" in label or label.endswith(("/plan", "/plan+autotune")):
            largest = max(largest, _micro_batch(r) or 0)
        if "/grid/" in label and (best_grid is None or r["measured_step_s"] < best_grid["measured_step_s"]):
            best_grid = r
        # several rounds of one configuration (speed2): each configuration counts with its fastest round
        if "/trainer/" in label and (trainer is None or r["measured_step_s"] < trainer["measured_step_s"]):
            trainer = r
        if label.endswith("/plan") and (plan is None or r["measured_step_s"] < plan["measured_step_s"]):
            plan = r
        if label.endswith("/plan+autotune") and (tuned is None or r["measured_step_s"] < tuned["measured_step_s"]):
            tuned = r
    if not plan and not tuned:
        return None
    comp: dict = {}
    if plan is None:  # only the autotuned plan ran: it is the plan of record
        plan = tuned
    comp.update({"plan_step_s": plan["measured_step_s"], "plan_strategy": plan.get("strategy")})
    if best_grid:
        comp["best_grid"] = best_grid["label"]
        comp["plan_vs_best_grid"] = best_grid["measured_step_s"] / plan["measured_step_s"]
        comp["largest_micro_batch_trained"] = largest  # grid rows and the plan
    if trainer:
        comp["trainer"] = trainer["label"]
        comp["plan_vs_trainer"] = trainer["measured_step_s"] / plan["measured_step_s"]
        comp["trainer_per_device_batch"] = trainer.get("per_device_batch")
        if largest and trainer.get("per_device_batch"):
            comp["largest_micro_batch_vs_trainer"] = largest / trainer["per_device_batch"]
    if tuned:
        comp["autotune_strategy"] = tuned.get("strategy")
        comp["autotune_step_s"] = tuned["measured_step_s"]
        comp["autotune_s"] = tuned.get("autotune_s")
        if best_grid:
            comp["autotune_vs_best_grid"] = best_grid["measured_step_s"] / tuned["measured_step_s"]
        if trainer:
            comp["autotune_vs_trainer"] = trainer["measured_step_s"] / tuned["measured_step_s"]
        lines += ["", "autotune trials (first batch, forward+backward passes + predicted optimizer time):", ""]
        lines += [f"- {t['strategy']}: " + (f"{t['score_s']:.3f} s (predicted step {t['predicted_step_s']:.3f} s)"
                                            if t.get("score_s") is not None else str(t.get("error")))
                  for t in tuned.get("trials", [])]
    lines += ["", f"Speed: {json.dumps(comp)}", ""]
    return comp


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    run = Path(args.run_dir)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    wrap = _load(run / "wrap.jsonl")
    speed = [r for p in sorted(run.glob("speed*.jsonl")) for r in _load(p)]
    lines = ["## memopt.wrap under the hard cap (H200, plans made on a CPU)", "",
             "| case | plan | plan fits | trained under cap | alloc meas/pred GiB | err | reserved meas/pred GiB | "
             "total / budget | step s meas/pred | throughput |", "|---|---|---|---|---|---|---|---|---|---|"]
    alloc_err, step_err, ooms, used = [], [], 0, []
    for r in wrap:
        label = r.get("label", r.get("row", {}).get("id"))
        if not r.get("plan_fits", True) or r.get("skipped"):
            lines.append(f"| {label} | {r.get('strategy', '')} | no | - | - | - | - | - | - | - |")
            continue
        if not r.get("ok"):
            lines.append(f"| {label} | failed: {r.get('error', '')[:80]} | | | | | | | | |")
            continue
        if not r.get("fits_under_cap"):
            ooms += 1
            lines.append(f"| {label} | {r['strategy']} | yes | **OOM** | | | | | | |")
            continue
        measured = r["measured_peak_allocated_bytes"]
        ea = (r["predicted_peak_allocated_bytes"] - measured) / measured
        es = (r["predicted_step_s"] - r["measured_step_s"]) / r["measured_step_s"]
        share = r["measured_total_bytes"] / r["budget_bytes"]
        alloc_err.append(abs(ea))
        step_err.append(abs(es))
        used.append(share)
        tput = r.get("tokens_per_s") or r.get("samples_per_s")
        unit = "tok/s" if "tokens_per_s" in r else "samples/s"
        lines.append(
            f"| {label} | {r['strategy']} | yes | yes | {r['measured_peak_allocated_bytes'] / GiB:.2f} / "
            f"{r['predicted_peak_allocated_bytes'] / GiB:.2f} | {100 * ea:+.2f}% | "
            f"{r['measured_peak_reserved_bytes'] / GiB:.2f} / {r['predicted_peak_reserved_bytes'] / GiB:.2f} | "
            f"{100 * share:.0f}% | {r['measured_step_s']:.3f} / {r['predicted_step_s']:.3f} | {tput:,.0f} {unit} |")
    summary = {"rows_trained": len(alloc_err), "ooms_among_fitting_plans": ooms,
               "allocated_median_abs_error": statistics.median(alloc_err) if alloc_err else None,
               "allocated_max_abs_error": max(alloc_err) if alloc_err else None,
               "step_time_median_abs_error": statistics.median(step_err) if step_err else None,
               "budget_share_min": min(used) if used else None}
    lines += ["", f"Summary: {json.dumps(summary)}", ""]
    cases: dict[str, list[dict]] = {}
    for r in speed:
        head, case = r.get("label", "").split("/")[:2]
        cases.setdefault(case if head == "speed" else f"{case} ({head}: interleaved rounds in one run)", []).append(r)
    summary["speed"] = {}
    for case, rows in cases.items():
        comp = _speed_case(case, rows, lines)
        if comp:
            summary["speed"][case] = comp
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"summary": summary, "wrap": wrap, "speed": speed}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
