#!/usr/bin/env python
"""Re-predict every row of ``benchmarks/plan_quality/clock_rows.json`` on the CPU, fit the clock's hardware
constants, and report old vs new prediction vs measured:

    python scripts/plan_quality_clock.py terms      # rebuild each row's model (meta device), profile, keep its terms
    python scripts/plan_quality_clock.py old-code   # the same with the code before the fit (PYTHONPATH=its tree)
    python scripts/plan_quality_clock.py fit        # fit TimingModel's constants on the terms; table + JSON

``terms`` writes ``benchmarks/plan_quality/clock_terms.json`` (each configuration's ``Estimate.detail["time_terms"]``:
ideal seconds per resource and kernel counts, independent of the fitted constants), so ``fit`` runs in seconds.
``fit`` writes ``clock_fit.json`` and ``clock_fit.md``: the fitted constants, each configuration's recorded prediction
(the planner's when it was measured), the old constants on today's terms, the new prediction and the measurement,
the error distribution before and after, a leave-one-model-out check (the constants fitted without a model's rows,
then predicting them) and whether the clock orders each model's plans as the GPU did.

Configurations are rows grouped by model, sample, strategy and kind of measurement (median of their measurements).
Only rows measured one at a time are fitted (``timing_valid``); the others are reported beside them.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import statistics
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if "MEMOPT_OLD_CODE" not in os.environ:  # old-code: the memopt on PYTHONPATH (the tree before the fit), not this one
    sys.path.insert(0, str(ROOT))

OUT = ROOT / "benchmarks" / "plan_quality"
# the code before this fit: its predictions are re-made by running this script's ``old-code`` step with that code
OLD_COMMIT = "d84af00"


def _model_key(m: dict[str, Any]) -> str:
    return m["row"] if m["kind"] == "zoo" else m["name"] + (json.dumps(m["overrides"], sort_keys=True)
                                                            if m.get("overrides") else "")


# models whose measured rows no longer describe what memopt traces, with the reason: kept, not fitted
SUPERSEDED = {"t5_base": "measured under transformers 5.17, whose strided position bias sent SDPA to its math "
                         "kernel; under the pinned 5.24 T5 runs the memory-efficient kernel "
                         "(benchmarks/validation/t5_replay_by_transformers_version.json)"}


def configurations(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows grouped by what ran: model, sample, strategy, measurement kind and whether it ran alone (a
    superseded model's rows count as not alone: reported, not fitted)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("strategy") is None:
            continue
        key = json.dumps([_model_key(r["model"]), r["sample"], r["strategy"], r["measured_kind"], r["timing_valid"]],
                         sort_keys=True)
        groups.setdefault(key, []).append(r)
    out = []
    for key, rs in groups.items():
        first = rs[0]
        olds = [r["old_predicted_step_s"] for r in rs if r.get("old_predicted_step_s")]
        out.append({"key": key, "terms_key": _terms_key(key), "model_key": _model_key(first["model"]),
                    "model": first["model"],
                    "sample": first["sample"], "hardware": first["hardware"], "strategy": first["strategy"],
                    "measured_kind": first["measured_kind"],
                    "timing_valid": first["timing_valid"] and _model_key(first["model"]) not in SUPERSEDED,
                    "superseded": SUPERSEDED.get(_model_key(first["model"])),
                    "measured_step_s": statistics.median(r["measured_step_s"] for r in rs),
                    "old_recorded_step_s": statistics.median(olds) if olds else None,
                    "n_rows": len(rs), "sources": [r["source"] for r in rs]})
    return out


def _terms_key(key: str) -> str:
    """What a prediction depends on: model, sample, strategy (not how the row was measured)."""
    k = json.loads(key)
    return json.dumps(k[:3], sort_keys=True) if len(k) == 5 else key


def _load_terms(path: Path) -> dict[str, Any]:
    raw = json.loads(path.read_text()) if path.exists() else {}
    return {_terms_key(k): v for k, v in raw.items()}


def _zoo_module() -> Any:
    spec = importlib.util.spec_from_file_location("zoo_matrix_gpu", ROOT / "scripts" / "zoo_matrix_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _profile(model: dict[str, Any], sample: dict[str, Any], hardware: str) -> Any:
    import torch

    import memopt
    from memopt.models import with_overrides

    if model["kind"] == "config":
        return memopt.profile(with_overrides(model["name"], model.get("overrides") or {}), sample=sample,
                              hardware=hardware)
    zoo = _zoo_module()
    row = next(r for r in zoo.ROWS if r.id == model["row"])
    with torch.device("meta"):
        module = zoo.build(row)
    batch = zoo.batch_for(row, module)
    return memopt.profile(module, sample=batch, hardware=hardware)


def compute_terms(configs: list[dict[str, Any]], path: Path, *, keep_terms: bool = True) -> dict[str, Any]:
    """Each configuration's time terms (kept in ``path``; configurations already there are not estimated again).
    ``keep_terms=False``: only the estimate's step time (for the code before this fit, whose terms differ)."""
    import memopt
    from memopt.strategy import Strategy

    done = _load_terms(path)
    by_profile: dict[str, list[dict[str, Any]]] = {}
    for c in configs:
        if ("time_terms" if keep_terms else "step_time_s") not in done.get(c["terms_key"], {}):
            by_profile.setdefault(json.dumps([c["model"], c["sample"], c["hardware"]], sort_keys=True), []).append(c)
    for pkey, cs in by_profile.items():
        model, sample, hardware = json.loads(pkey)
        try:
            prof = _profile(model, sample, hardware)
        except Exception as exc:  # a model this CPU cannot build (e.g. no torchvision) is reported, not fatal
            for c in cs:
                done[c["terms_key"]] = {"error": f"profile: {type(exc).__name__}: {str(exc)[:200]}"}
            continue
        for c in cs:
            try:
                est = memopt.estimate(prof, Strategy.from_dict(c["strategy"]), exact_reserved=False)
                done[c["terms_key"]] = {"step_time_s": est.step_time_s}
                if keep_terms:
                    done[c["terms_key"]]["time_terms"] = est.detail["time_terms"]
            except Exception as exc:
                done[c["terms_key"]] = {"error": f"estimate: {type(exc).__name__}: {str(exc)[:200]}"}
        path.write_text(json.dumps(done, indent=0) + "\n")
        print(f"{model.get('name') or model.get('row')} {sample}: {len(cs)} configurations", flush=True)
    path.write_text(json.dumps(done, indent=0) + "\n")
    return done


def predict(terms: dict[str, Any], tm: Any) -> float:
    from memopt.estimate.timing import step_time

    return step_time(terms, tm)[0]


def _errors(data: list[tuple[dict, float]], tm: Any) -> list[float]:
    return [(predict(t, tm) - y) / y for t, y in data]


def _score(errs: list[float]) -> float:
    a = [abs(e) for e in errs]
    return statistics.median(a) + 0.5 * statistics.mean(a) + 0.25 * max(a)


# the constants fitted, each with the range it may take and a start; the others stay as DEFAULT_TIMING has them
FITTED = {"matmul_efficiency": (0.4, 1.0, 0.8), "attention_efficiency": (0.3, 1.0, 0.7),
          "memory_efficiency": (0.2, 1.5, 0.7), "launch_s": (0.0, 10e-6, 2e-6), "dispatch_s": (0.0, 60e-6, 8e-6),
          "sac_dispatch_s": (0.0, 200e-6, 20e-6), "ckpt_dispatch_s": (0.0, 200e-6, 20e-6),
          "micro_batch_s": (0.0, 20e-3, 1e-3),
          "offload_efficiency": (0.1, 1.0, 0.5), "overlap_loss": (0.0, 1.0, 0.3)}
STEPS = (0.5, 0.7, 0.85, 0.95, 1.05, 1.15, 1.4, 2.0)


def fit(data: list[tuple[dict, float]], start: Any = None, rounds: int = 6, only: set[str] | None = None) -> Any:
    """Coordinate search: each constant in turn multiplied by STEPS (or set to 0), kept where the score improves,
    within its range; rounds until nothing improves. ``only``: fit these constants, from DEFAULT_TIMING's values
    for the others (a new term added to a calibrated clock)."""
    from memopt.estimate.timing import DEFAULT_TIMING

    names = {k: v for k, v in FITTED.items() if only is None or k in only}
    tm = start or replace(DEFAULT_TIMING, **{k: v[2] for k, v in names.items()})
    best = _score(_errors(data, tm))
    for _ in range(rounds):
        improved = False
        for name, (lo, hi, _) in names.items():
            cur = getattr(tm, name)
            for v in [cur * f for f in STEPS] + ([0.0] if lo == 0.0 else []):
                if not lo <= v <= hi or v == cur:
                    continue
                cand = replace(tm, **{name: v})
                sc = _score(_errors(data, cand))
                if sc < best - 1e-12:
                    tm, best, cur, improved = cand, sc, v, True
        if not improved:
            break
    return tm


def _stats(errs: list[float]) -> dict[str, float]:
    a = [abs(e) for e in errs]
    return {"n": len(a), "median_abs_pct": 100 * statistics.median(a), "mean_abs_pct": 100 * statistics.mean(a),
            "max_abs_pct": 100 * max(a)} if a else {"n": 0}


def ranking(configs: list[dict[str, Any]], field: str, min_gap: float = 0.05) -> dict[str, Any]:
    """Pairwise agreement of predicted and measured order among each model's plans (same sample, measured alone),
    over pairs whose measurements differ by more than ``min_gap`` (closer pairs are run-to-run noise)."""
    by_model: dict[str, list[dict[str, Any]]] = {}
    for c in configs:
        if c["timing_valid"] and c.get(field) is not None:
            by_model.setdefault(json.dumps([c["model_key"], c["sample"]]), []).append(c)
    agree = total = 0
    per_model = {}
    for key, cs in by_model.items():
        a = t = 0
        for x, y in itertools.combinations(cs, 2):
            mx, my = x["measured_step_s"], y["measured_step_s"]
            if abs(mx - my) / min(mx, my) <= min_gap:
                continue
            t += 1
            a += (mx < my) == (x[field] < y[field])
        if t:
            per_model[key] = {"pairs": t, "agree": a}
            agree, total = agree + a, total + t
    return {"pairs": total, "agree": agree, "fraction": agree / total if total else None, "per_model": per_model}


def run_fit(configs: list[dict[str, Any]], terms: dict[str, Any], old: dict[str, Any],
            extra: list[dict[str, Any]] | None = None, extra_fit_cases: set[str] | None = None,
            only: set[str] | None = None) -> dict[str, Any]:
    """``extra``: rows of ``scripts/speed_grid_predict.py`` (one GPU session's hand grid); those of
    ``extra_fit_cases`` join the fit, the others are predicted by the fitted constants only (held out)."""
    from memopt.estimate.timing import step_time

    extra = extra or []
    extra_fit_cases = extra_fit_cases or set()
    usable = [c for c in configs if "time_terms" in terms.get(c["terms_key"], {})]
    valid = [(terms[c["terms_key"]]["time_terms"], c["measured_step_s"]) for c in usable if c["timing_valid"]]
    fitted_extra = [(r["time_terms"], r["measured_step_s"]) for r in extra if r["case"] in extra_fit_cases]
    tm = fit(valid + fitted_extra, only=only)
    # leave one model out: constants fitted without the model's rows predict them
    held: dict[str, float] = {}
    for model in sorted({c["model_key"] for c in usable if c["timing_valid"]}):
        train = [(terms[c["terms_key"]]["time_terms"], c["measured_step_s"]) for c in usable
                 if c["timing_valid"] and c["model_key"] != model]
        tm_cv = fit(train, start=tm, rounds=2, only=only)
        for c in usable:
            if c["timing_valid"] and c["model_key"] == model:
                held[c["key"]] = predict(terms[c["terms_key"]]["time_terms"], tm_cv)
    for c in usable:
        t = terms[c["terms_key"]]["time_terms"]
        c["old_code_step_s"] = old.get(c["terms_key"], {}).get("step_time_s")
        c["new_step_s"], parts = step_time(t, tm)
        c["host_bound"] = bool(parts["host_bound"])
        c["held_out_step_s"] = held.get(c["key"])
        c["strategy_label"] = _label(c["strategy"])

    def errs(field: str, valid_only: bool) -> list[float]:
        return [(c[field] - c["measured_step_s"]) / c["measured_step_s"] for c in usable
                if c.get(field) is not None and bool(c["timing_valid"]) == valid_only]
    fields = ("old_recorded_step_s", "old_code_step_s", "new_step_s", "held_out_step_s")
    summary = {f"{name}/{field}": _stats(errs(field, v)) for name, v in (("alone", True), ("shared_gpu", False))
               for field in fields}
    for r in extra:
        r["new_step_s"] = predict(r["time_terms"], tm)
    for name, group in (("speed_cases_fitted", [r for r in extra if r["case"] in extra_fit_cases]),
                        ("speed_cases_held_out", [r for r in extra if r["case"] not in extra_fit_cases])):
        summary[f"{name}/new_step_s"] = _stats([(r["new_step_s"] - r["measured_step_s"]) / r["measured_step_s"]
                                                for r in group])
        summary[f"{name}/recorded_code_step_s"] = _stats([(r["predicted_step_s"] - r["measured_step_s"])
                                                          / r["measured_step_s"] for r in group])
    rank = {field: ranking(usable, field) for field in fields[1:]}
    failed = [{"model": c["model_key"], "strategy": _label(c["strategy"]),
               "error": terms.get(c["terms_key"], {}).get("error")} for c in configs if c not in usable]
    return {"timing_model": asdict(tm), "errors": summary, "ranking": rank,
            "configurations": [{k: v for k, v in c.items() if k not in ("key", "terms_key")} for c in usable],
            "not_estimated": failed,
            "speed_cases": [{k: v for k, v in r.items() if k != "time_terms"} for r in extra],
            "speed_cases_fitted": sorted(extra_fit_cases),
            "command": "python scripts/plan_quality_rows.py && python scripts/plan_quality_clock.py terms && "
                       f"mkdir -p /tmp/old && git archive {OLD_COMMIT} | tar -x -C /tmp/old && "
                       "MEMOPT_OLD_CODE=1 PYTHONPATH=/tmp/old MEMOPT_CACHE_DIR=/tmp/old_cache "
                       "python scripts/plan_quality_clock.py old-code && python scripts/plan_quality_clock.py fit"}


def _label(s: dict[str, Any]) -> str:
    from memopt.strategy import Strategy

    return Strategy.from_dict(s).label()


def write_md(result: dict[str, Any], path: Path) -> None:
    tm = result["timing_model"]
    lines = ["# The step-time clock against H200 measurements", "", f"Command: `{result['command']}`", "",
             "Fitted constants (`memopt/estimate/timing.py` DEFAULT_TIMING): " + ", ".join(
                 f"{k}={v:g}" for k, v in tm.items() if k not in ("bnb4_call_s", "alloc_retry_s")), "",
             "| rows | prediction | n | median abs % | mean abs % | max abs % |", "|---|---|---|---|---|---|"]
    for key, s in result["errors"].items():
        if s.get("n"):
            lines.append(f"| {key.split('/')[0]} | {key.split('/')[1]} | {s['n']} | {s['median_abs_pct']:.1f} | "
                         f"{s['mean_abs_pct']:.1f} | {s['max_abs_pct']:.1f} |")
    lines += ["", "Ranking (pairs of one model's plans measured alone, measured more than 5% apart):", ""]
    for field, r in result["ranking"].items():
        lines.append(f"- {field}: {r['agree']} of {r['pairs']} pairs ordered as measured")
    lines += ["", "| model | sample | strategy | kind | alone | measured s | recorded s | old code s | new s | "
              "held-out s | new err % | host-bound |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in sorted(result["configurations"], key=lambda c: (c["model_key"], json.dumps(c["sample"]),
                                                              c["strategy_label"])):
        def f(x: Any) -> str:
            return "—" if x is None else f"{x:.3f}"
        err = 100 * (c["new_step_s"] - c["measured_step_s"]) / c["measured_step_s"]
        lines.append(f"| {c['model_key']} | {c['sample']} | {c['strategy_label']} | {c['measured_kind']} | "
                     f"{'yes' if c['timing_valid'] else 'no'} | {f(c['measured_step_s'])} | "
                     f"{f(c['old_recorded_step_s'])} | {f(c['old_code_step_s'])} | {f(c['new_step_s'])} | "
                     f"{f(c['held_out_step_s'])} | {err:+.0f} | {'yes' if c['host_bound'] else ''} |")
    if result.get("speed_cases"):
        fitted = set(result.get("speed_cases_fitted", []))
        lines += ["", "Speed-case hand grid (`scripts/speed_grid_gpu.py`, `scripts/speed_grid_predict.py`): cases "
                  f"in the fit: {', '.join(sorted(fitted)) or 'none'}; the others held out.", "",
                  "| case | config | in fit | measured s | code before s | new s | new err % |",
                  "|---|---|---|---|---|---|---|"]
        for r in result["speed_cases"]:
            err = 100 * (r["new_step_s"] - r["measured_step_s"]) / r["measured_step_s"]
            lines.append(f"| {r['case']} | {r['config']} | {'yes' if r['case'] in fitted else 'no'} | "
                         f"{r['measured_step_s']:.3f} | {r['predicted_step_s']:.3f} | {r['new_step_s']:.3f} | "
                         f"{err:+.0f} |")
    if result["not_estimated"]:
        lines += ["", "Not estimated on this CPU:", ""] + [f"- {x['model']} {x['strategy']}: {x['error']}"
                                                          for x in result["not_estimated"]]
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["terms", "old-code", "fit"])
    ap.add_argument("--rows", default=str(OUT / "clock_rows.json"))
    ap.add_argument("--terms", default=str(OUT / "clock_terms.json"))
    ap.add_argument("--old", default=str(OUT / "clock_old_code.json"))
    ap.add_argument("--out", default=str(OUT / "clock_fit"))
    ap.add_argument("--extra", nargs="*", default=[], help="scripts/speed_grid_predict.py outputs (.json)")
    ap.add_argument("--extra-fit-cases", default="", help="their cases that join the fit; the rest are held out")
    ap.add_argument("--only", default="", help="constants to fit (comma-separated); the others keep DEFAULT_TIMING's")
    args = ap.parse_args()
    configs = configurations(json.loads(Path(args.rows).read_text())["rows"])
    if args.what == "terms":
        compute_terms(configs, Path(args.terms))
        return 0
    if args.what == "old-code":
        compute_terms(configs, Path(args.old), keep_terms=False)
        return 0
    extra = [r for p in args.extra for r in json.loads(Path(p).read_text())["rows"]]
    only = set(filter(None, args.only.split(","))) or None
    result = run_fit(configs, _load_terms(Path(args.terms)), _load_terms(Path(args.old)), extra,
                     set(filter(None, args.extra_fit_cases.split(","))), only)
    Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    write_md(result, Path(args.out + ".md"))
    for key, s in result["errors"].items():
        if s.get("n"):
            print(f"{key:40s} n={s['n']:3d} median {s['median_abs_pct']:5.1f}%  max {s['max_abs_pct']:6.1f}%")
    print({k: v for k, v in result["timing_model"].items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
