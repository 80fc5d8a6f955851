#!/usr/bin/env python
"""Predicted (on this CPU, as a dry run would) vs measured (H200) peaks of the QLoRA / LoRA rows.

    python scripts/gpu_session.py --out RUN --parts quant            # on the GPU
    python scripts/report_quant.py RUN/quant.jsonl --out benchmarks/quant/quant_h200

The GPU rows build the model on the GPU, apply the strategy (quantize the block linears, add adapters) and
reset the peak statistics before the first step, so these peaks are the training steps' (loading is not
in them; see the closing note of the quantization issue).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.predict import estimate_row, simulate_row
from harness.rows import Row

GiB = 2**30


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("measured")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = [json.loads(x) for x in Path(args.measured).read_text().splitlines()]
    lines = ["## QLoRA and LoRA: predicted (CPU) vs measured (H200) peaks", "",
             "simulated: the whole model's training steps run on fake tensors with the strategy applied "
             "(quantized stand-ins, peft adapters), then the caching-allocator replay; composed: the planner's "
             "fast path (block-truncated traces of the transformed model, quantized layers and adapters "
             "included, composed to the full depth; step time from the composed estimate).", "",
             "| row | alloc meas / simulated GiB | err | reserved meas / simulated GiB | err | composed alloc GiB "
             "| err | step s meas / pred |",
             "|---|---|---|---|---|---|---|---|"]
    out, alloc_err, res_err, step_err, comp_err = [], [], [], [], []
    for r in rows:
        if not r.get("ok"):
            lines.append(f"| {r.get('label')} | failed: {str(r.get('error'))[:80]} | | | | |")
            continue
        row = Row.from_dict(r["row"])
        composed = estimate_row(row)
        sim = simulate_row(row)
        ma, mr, ms = r["measured_peak_allocated_bytes"], r["measured_peak_reserved_bytes"], r["measured_step_s"]
        pa, pr = sim["predicted_peak_allocated_bytes"], sim["predicted_peak_reserved_bytes"]
        ca, ps = composed["predicted_peak_allocated_bytes"], composed["predicted_step_s"]
        ea, er, ec, es = (pa - ma) / ma, (pr - mr) / mr, (ca - ma) / ma, (ps - ms) / ms
        alloc_err.append(abs(ea))
        res_err.append(abs(er))
        comp_err.append(abs(ec))
        step_err.append(abs(es))
        out.append({**r, "simulated": sim, "composed": composed, "allocated_error": ea, "reserved_error": er,
                    "composed_allocated_error": ec, "step_time_error": es})
        lines.append(f"| {r['label']} | {ma / GiB:.2f} / {pa / GiB:.2f} | {100 * ea:+.2f}% | {mr / GiB:.2f} / "
                     f"{pr / GiB:.2f} | {100 * er:+.2f}% | {ca / GiB:.2f} | {100 * ec:+.1f}% | {ms:.3f} / {ps:.3f} |")
        print(lines[-1], flush=True)
    summary = {"rows": len(alloc_err),
               "allocated_median_abs_error": statistics.median(alloc_err) if alloc_err else None,
               "allocated_max_abs_error": max(alloc_err) if alloc_err else None,
               "reserved_median_abs_error": statistics.median(res_err) if res_err else None,
               "reserved_max_abs_error": max(res_err) if res_err else None,
               "composed_allocated_median_abs_error": statistics.median(comp_err) if comp_err else None,
               "composed_allocated_max_abs_error": max(comp_err) if comp_err else None,
               "step_time_median_abs_error": statistics.median(step_err) if step_err else None}
    lines += ["", f"Summary: {json.dumps(summary)}", ""]
    target = Path(args.out)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.with_suffix(".md").write_text("\n".join(lines) + "\n")
    target.with_suffix(".json").write_text(json.dumps({"summary": summary, "rows": out}, indent=1, default=str))
    print("\n".join(lines[-2:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
