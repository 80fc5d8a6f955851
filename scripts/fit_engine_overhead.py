#!/usr/bin/env python3
"""Fit DeepSpeed's fixed work per micro-batch (``TimingParams``' engine overhead) to the H200 rows that
``memopt.wrap`` applied, per ZeRO stage, and check each fit by leaving one model out.

    python scripts/fit_engine_overhead.py --out benchmarks/sharding/engine_overhead_fit

For every row: its plan's strategy (checkpointing as the row ran), today's step-time model without the engine
overhead (``rest``) and the allocator retries the capped plan predicts; the measured mean of the steps after the
first, less those, per micro-batch, is the overhead the row shows. Two forms are fitted by least squares: per
parameter tensor (``c * tensors``) and per tensor plus per parameter (``c * tensors + d * params``).
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

RAW = "benchmarks/sharding/raw"
PLANS = "benchmarks/sharding/plans"
#: (row, plan it was made from). A row's own label fixes the checkpointing; the plan gives the rest of the strategy.
ROWS = [
    (f"{RAW}/session6_wrap/rank0.json", f"{PLANS}/llama32_3b_16GiB_offload.json"),
    ("benchmarks/wrap/raw/session8/l3b16/rank0.json", f"{PLANS}/llama32_3b_16GiB_offload.json"),
    (f"{RAW}/session9/z2_3b/rank0.json", f"{PLANS}/s9_llama32_3b_16GiB_offload.json"),
    (f"{RAW}/session9/z2_1b/rank0.json", f"{PLANS}/s9_llama32_1b_12GiB_offload.json"),
    # these two ran from plans since re-made for one GPU without sharding: the same engine settings as the 1B plan
    (f"{RAW}/session8_call2/llama_hist/rank0.json", f"{PLANS}/s9_llama32_1b_12GiB_offload.json"),
    (f"{RAW}/session8_call2/qwen_hist/rank0.json", f"{PLANS}/s9_llama32_1b_12GiB_offload.json:qwen25_0_5b"),
    (f"{RAW}/session8_call5/z3/rank0.json", f"{PLANS}/llama32_3b_16GiB_zero3_offload.json"),
    (f"{RAW}/session9/z3_3b/rank0.json", f"{PLANS}/s9_llama32_3b_16GiB_zero3_offload.json"),
    (f"{RAW}/session9/z3_3b_reuse0/rank0.json", f"{PLANS}/s9_llama32_3b_16GiB_zero3_offload.json"),
    (f"{RAW}/session9/z3_1b/rank0.json", f"{PLANS}/s9_llama32_1b_12GiB_zero3_offload.json"),
    (f"{RAW}/session9/q15/rank0.json", f"{PLANS}/s9_qwen2_1_5b_12GiB.json"),
    (f"{RAW}/session9/q15_reuse0/rank0.json", f"{PLANS}/s9_qwen2_1_5b_12GiB.json"),
]


def _checkpointing(label: str) -> Any:
    from memopt.strategy import Checkpointing

    ac = next(t for t in label.split() if t.startswith("ac="))[3:]
    mode, _, n = ac.partition("[")
    return Checkpointing(mode=mode, num_blocks=int(n.rstrip("]")) if n else None)


def observe(row_path: str, plan_path: str) -> dict[str, Any]:
    import memopt
    from memopt.distributed.engine_bytes import EngineRun
    from memopt.distributed.estimate import sharded_time
    from memopt.hardware import load_hardware
    from memopt.plan.schema import Plan
    from memopt.plan.sharded import predict_strategy
    from memopt.profile.engine_facts import facts_of_profile
    from memopt.techniques.sharding import ShardingSetting

    row = json.loads(Path(row_path).read_text())
    plan_path, _, model = plan_path.partition(":")  # PLAN:MODEL: that plan's engine settings for another model
    plan = Plan.load(plan_path)
    name = model or plan.model["name"]
    strategy = plan.strategy.replace(checkpointing=_checkpointing(row["plan"]))
    assert strategy.label() == row["plan"], (strategy.label(), row["plan"])
    hw = load_hardware(plan.hardware)
    prof = memopt.profile(name, sample=plan.model["sample"], hardware=hw)
    setting = ShardingSetting.from_any(strategy.extra("sharding"))
    facts = facts_of_profile(prof)
    m = strategy.grad_accum_steps
    t = sharded_time(prof, strategy, EngineRun.of(setting, m), facts, hw)
    pred = predict_strategy(prof, hw, strategy, plan.budget_bytes, margin=0)  # the run's cap: no planning margin
    retry_s = pred.get("capped", {}).get("retry_s", 0.0)
    rest = pred["step_time_s"] - retry_s - t.engine_overhead_s  # the step without the engine's fixed work
    steady = row["step_times_s"][1:]
    return {"row": row_path, "model": name, "stage": setting.stage, "micro_batches": m,
            "tensors": facts.num_tensors, "params": facts.num_params, "measured_mean_s": statistics.fmean(steady),
            "rest_s": rest, "retry_s": retry_s, "per_micro_batch_s": (statistics.fmean(steady) - rest - retry_s) / m}


def _fit(obs: list[dict[str, Any]], per_param: bool) -> tuple[float, float]:
    """Least squares of the per-micro-batch overhead on tensors (and parameters, in 1e9)."""
    import numpy as np

    a = np.array([[o["tensors"], o["params"] / 1e9] if per_param else [o["tensors"]] for o in obs], dtype=float)
    y = np.array([o["per_micro_batch_s"] for o in obs])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    return float(coef[0]), float(coef[1]) if per_param else 0.0


def _predict(o: dict[str, Any], c: float, d: float) -> float:
    return o["rest_s"] + o["retry_s"] + o["micro_batches"] * (c * o["tensors"] + d * o["params"] / 1e9)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output path prefix (.json and .md)")
    args = ap.parse_args(argv)
    obs = [observe(r, p) for r, p in ROWS]
    result: dict[str, Any] = {"rows": obs, "fits": {}}
    lines = ["| stage | form | fit | model left out | its rows' step error (left out) |", "|---|---|---|---|---|"]
    for stage in sorted({o["stage"] for o in obs}):
        group = [o for o in obs if o["stage"] == stage]
        for per_param in (False, True):
            c, d = _fit(group, per_param)
            form = "c*tensors + d*params" if per_param else "c*tensors"
            errs = [_predict(o, c, d) / o["measured_mean_s"] - 1 for o in group]
            result["fits"][f"stage{stage}_{'tp' if per_param else 't'}"] = {
                "c_s_per_tensor": c, "d_s_per_1e9_params": d, "in_sample_errors": errs}
            lines.append(f"| {stage} | {form} | c={c * 1e3:.3f} ms, d={d:.3f} s/1e9 | (none: in-sample) | "
                         + ", ".join(f"{100 * e:+.0f}%" for e in errs) + " |")
            for model in sorted({o["model"] for o in group}):
                rest = [o for o in group if o["model"] != model]
                if len({o["model"] for o in rest}) < (2 if per_param else 1):
                    continue
                c2, d2 = _fit(rest, per_param)
                left = [_predict(o, c2, d2) / o["measured_mean_s"] - 1 for o in group if o["model"] == model]
                lines.append(f"| {stage} | {form} | c={c2 * 1e3:.3f} ms, d={d2:.3f} s/1e9 | {model} | "
                             + ", ".join(f"{100 * e:+.0f}%" for e in left) + " |")
    rows = ["| row | stage | micro-batches | tensors | params | measured s | rest s | retries s | overhead/mb s |",
            "|---|---|---|---|---|---|---|---|---|"]
    rows += [f"| {o['row'].split('raw/')[-1]} | {o['stage']} | {o['micro_batches']} | {o['tensors']} | "
             f"{o['params'] / 1e9:.2f}e9 | {o['measured_mean_s']:.2f} | {o['rest_s']:.2f} | {o['retry_s']:.2f} | "
             f"{o['per_micro_batch_s']:.3f} |" for o in obs]
    text = "\n".join(rows) + "\n\n" + "\n".join(lines) + "\n"
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
