#!/usr/bin/env python
"""The clock on a GPU kind other than the one it was fitted on: every configuration that ``scripts/speed_grid_gpu.py``
measured there, predicted on the CPU with the H200's constants and with the kind's own (``extra.timing`` in its
hardware config), and the constants that config overrides fitted again with each model left out:

    python scripts/clock_gpu_kind_check.py GRID.jsonl [MORE.jsonl] --hardware h100_80gb \\
        --fit memory_efficiency --out benchmarks/plan_quality/h100_s24/clock

Two sets of rows: the hand grid (what the constants are fitted on) and memopt's own plans (the plan ``memopt.wrap``
chose and the autotune's candidates, each with the step it measured): strategies with chunked loss and activation
offload that no hand row has, so a check the fit never saw.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import plan_quality_clock as pq  # noqa: E402 - the fit
import speed_grid_gpu as grid  # noqa: E402 - the speed cases
import speed_grid_predict as hand  # noqa: E402 - a hand configuration as a Strategy
import zoo_matrix_gpu as zoo  # noqa: E402
from plan_quality_rows import parse_label  # noqa: E402

CANDIDATE = re.compile(r"(bf16_autocast [^:]+?): ([\d.]+) s \(predicted ([\d.]+) s\)")


def memopt_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """memopt's plans with a measured step: the chosen plan (its median step) and each autotune candidate (the step
    the autotune timed on the first batch)."""
    out = []
    for r in rows:
        if r["kind"] != "memopt" or not r.get("ok"):
            continue
        out.append({"case": r["case"], "label": r["plan"], "measured_step_s": r["measured_step_s"],
                    "recorded_predicted_step_s": r["predicted_step_s"], "source": "plan"})
        for note in r.get("autotune") or []:
            for label, measured, predicted in CANDIDATE.findall(note.split(" and chose ", 1)[-1]):
                out.append({"case": r["case"], "label": label, "measured_step_s": float(measured),
                            "recorded_predicted_step_s": float(predicted), "source": "autotune"})
    return out


def predict_memopt(rows: list[dict[str, Any]], hardware: str) -> list[dict[str, Any]]:
    import memopt
    from memopt.estimate.estimator import estimate_strategy
    from memopt.strategy import Strategy

    out = []
    for case_id in dict.fromkeys(r["case"] for r in rows):
        case = next(c for c in grid.CASES if c.id == case_id)
        model = zoo.build(case.row)
        profile = memopt.profile(model, zoo.batch_for(case.row, model), hardware=hardware)
        for r in rows:
            if r["case"] != case_id:
                continue
            s = parse_label(r["label"])
            if s is None:
                continue
            e = estimate_strategy(profile, Strategy.from_dict(s), hardware=hardware)
            out.append({**r, "time_terms": e.detail["time_terms"]})
    return out


def _stats(errs: list[float]) -> dict[str, float]:
    a = [abs(e) for e in errs]
    return {"n": len(a), "median_abs_pct": round(100 * statistics.median(a), 1),
            "max_abs_pct": round(100 * max(a), 1), "mean_signed_pct": round(100 * statistics.mean(errs), 1)}


def _ordered(data: list[tuple[str, dict, float]], tm: Any) -> list[int]:
    """[pairs the clock orders as measured, pairs] within each case (``plan_quality_clock.ranking``)."""
    configs = [{"model_key": case, "sample": case, "timing_valid": True, "measured_step_s": y,
                "predicted": pq.predict(t, tm)} for case, t, y in data]
    r = pq.ranking(configs, "predicted")
    return [r["agree"], r["pairs"]]


def main() -> int:
    from memopt.estimate.timing import DEFAULT_TIMING, timing_for
    from memopt.hardware import load_hardware

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl", nargs="+")
    ap.add_argument("--hardware", required=True)
    ap.add_argument("--fit", default="memory_efficiency", help="the constants the kind's config overrides")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = [json.loads(x) for p in args.jsonl for x in Path(p).read_text().splitlines() if x.strip()]
    hand_rows = hand.predict(rows, args.hardware)
    plan_rows = predict_memopt(memopt_rows(rows), args.hardware)
    kind = timing_for(load_hardware(args.hardware))
    only = set(args.fit.split(","))
    data = [(r["time_terms"], r["measured_step_s"]) for r in hand_rows]
    cased = [(r["case"], r["time_terms"], r["measured_step_s"]) for r in hand_rows]
    models = sorted({r["case"].split("-")[0] for r in hand_rows})
    result: dict[str, Any] = {"hardware": args.hardware, "fitted": sorted(only),
                              "constants": {k: getattr(kind, k) for k in sorted(only)},
                              "h200_constants": {k: getattr(DEFAULT_TIMING, k) for k in sorted(only)},
                              "fit_on_these_rows": {k: getattr(pq.fit(data, start=DEFAULT_TIMING, only=only), k)
                                                    for k in sorted(only)}}
    sets: dict[str, Any] = {}
    for name, tm in (("h200_constants", DEFAULT_TIMING), ("kind_constants", kind)):
        sets[f"hand/{name}"] = {**_stats([(pq.predict(t, tm) - y) / y for t, y in data]),
                                "ordered_pairs": _ordered(cased, tm)}
        plan_data = [(r["time_terms"], r["measured_step_s"]) for r in plan_rows]
        sets[f"memopt_plans/{name}"] = _stats([(pq.predict(t, tm) - y) / y for t, y in plan_data])
    for held in models:  # each model predicted by the constants fitted on the others
        train = [(r["time_terms"], r["measured_step_s"]) for r in hand_rows if not r["case"].startswith(held)]
        test = [(r["time_terms"], r["measured_step_s"]) for r in hand_rows if r["case"].startswith(held)]
        test_cased = [(r["case"], r["time_terms"], r["measured_step_s"]) for r in hand_rows
                      if r["case"].startswith(held)]
        tm = pq.fit(train, start=DEFAULT_TIMING, only=only)
        sets[f"hand/{held}_left_out"] = {**_stats([(pq.predict(t, tm) - y) / y for t, y in test]),
                                         "ordered_pairs": _ordered(test_cased, tm),
                                         "fitted": {k: getattr(tm, k) for k in sorted(only)}}
    result["sets"] = sets
    table = []
    for r in hand_rows + plan_rows:
        label = r.get("config") or r["label"]
        old = pq.predict(r["time_terms"], DEFAULT_TIMING)
        new = pq.predict(r["time_terms"], kind)
        table.append({"case": r["case"], "config": label, "source": r.get("source", "hand"),
                      "measured_step_s": r["measured_step_s"], "h200_constants_s": old, "kind_constants_s": new,
                      "recorded_predicted_step_s": r.get("recorded_predicted_step_s")})
    result["rows"] = table
    Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# The clock on {args.hardware}: H200 constants vs the kind's (`{args.fit}`)", "",
             "| set | n | median abs | max abs | mean signed | pairs ordered as measured |",
             "|---|---|---|---|---|---|"]
    for name, s in sets.items():
        pairs = s.get("ordered_pairs")
        lines.append(f"| {name} | {s['n']} | {s['median_abs_pct']}% | {s['max_abs_pct']}% | "
                     f"{s['mean_signed_pct']:+}% | {f'{pairs[0]}/{pairs[1]}' if pairs else ''} |")
    lines += ["", "| case | config | source | measured s | H200 constants s | kind's constants s | recorded s |",
              "|---|---|---|---|---|---|---|"]
    for t in table:
        rec = t["recorded_predicted_step_s"]
        lines.append(f"| {t['case']} | {t['config']} | {t['source']} | {t['measured_step_s']:.3f} | "
                     f"{t['h200_constants_s']:.3f} | {t['kind_constants_s']:.3f} | "
                     f"{'' if rec is None else f'{rec:.3f}'} |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:4 + len(sets)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
