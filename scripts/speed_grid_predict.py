#!/usr/bin/env python
"""memopt's clock on every hand configuration that ``scripts/speed_grid_gpu.py`` measured: the models rebuilt and
profiled on this machine (no GPU), each configuration estimated as the ``Strategy`` it is, beside its measured step.
Each row keeps its time terms, so ``scripts/plan_quality_clock.py fit --extra`` can fit on some cases and hold out
the others:

    python scripts/speed_grid_predict.py GRID.jsonl [MORE.jsonl] --out benchmarks/plan_quality/speed_cases/clock \
        [--hardware h100_80gb]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import speed_grid_gpu as grid  # noqa: E402 - the speed cases
import zoo_matrix_gpu as zoo  # noqa: E402


def strategy_of(row: dict[str, Any], batch_size: int) -> Any:
    """The ``Strategy`` a hand configuration is: bf16 autocast, its checkpointing and micro-batch, its AdamW."""
    from memopt.strategy import Checkpointing, Strategy

    mode = row["checkpointing"]
    ckpt = {"none": Checkpointing(mode="none"), "all": Checkpointing(mode="full"),
            "every2": Checkpointing(mode="full", num_blocks=row["blocks"] // 2),
            "selective": Checkpointing(mode="selective")}[mode]
    mb = row["micro_batch"]
    return Strategy(precision="bf16_autocast", checkpointing=ckpt, optimizer=row["optimizer"], micro_batch_size=mb,
                    grad_accum_steps=batch_size // mb, expandable_segments=row["expandable"])


def predict(rows: list[dict[str, Any]], hardware: str = "h200") -> list[dict[str, Any]]:
    import memopt
    from memopt.estimate.estimator import estimate_strategy

    out = []
    for case_id in dict.fromkeys(r["case"] for r in rows):
        case = next(c for c in grid.CASES if c.id == case_id)
        model = zoo.build(case.row)
        if case.row.kind == "torchvision":
            model = zoo._TorchvisionAdapter.wrap(model)
        profile = memopt.profile(model, zoo.batch_for(case.row, model), hardware=hardware)
        for r in rows:
            if r["case"] != case_id or r["kind"] != "hand" or not r.get("ok"):
                continue
            e = estimate_strategy(profile, strategy_of(r, case.row.batch_size), hardware=hardware)
            d = e.detail
            out.append({"case": case_id, "config": r["id"], "measured_step_s": r["measured_step_s"],
                        "predicted_step_s": e.step_time_s, "error": e.step_time_s / r["measured_step_s"] - 1,
                        "host_s": d.get("host_s"), "gpu_s": d.get("forward_s", 0) + d.get("backward_s", 0),
                        "optimizer_s": d.get("optimizer_s"), "host_bound": bool(d.get("host_bound")),
                        "ops_per_micro_batch": d["time_terms"]["forward"]["launches"]
                        + d["time_terms"]["backward"]["launches"],
                        "micro_batches": d["time_terms"]["micro_batches"], "time_terms": d["time_terms"]})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--hardware", default="h200", help="the GPU the rows ran on (a shipped hardware name)")
    args = ap.parse_args()
    rows = [json.loads(x) for p in args.jsonl for x in Path(p).read_text().splitlines() if x.strip()]
    out = predict(rows, args.hardware)
    errs = [abs(r["error"]) for r in out]
    summary = {"rows": len(out), "median_abs_error": statistics.median(errs) if errs else None,
               "max_abs_error": max(errs) if errs else None}
    lines = ["| case | config | measured s | predicted s | error | host s | GPU s | host-bound |",
             "|---|---|---|---|---|---|---|---|"]
    for r in out:
        lines.append(f"| {r['case']} | {r['config']} | {r['measured_step_s']:.3f} | {r['predicted_step_s']:.3f} | "
                     f"{100 * r['error']:+.1f}% | {r['host_s']:.3f} | {r['gpu_s']:.3f} | {r['host_bound']} |")
    Path(args.out + ".json").write_text(json.dumps({"summary": summary, "rows": out}, indent=1) + "\n")
    Path(args.out + ".md").write_text(json.dumps(summary) + "\n\n" + "\n".join(lines) + "\n")
    print(json.dumps(summary))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
