#!/usr/bin/env python
"""The allocated peak this tree estimates for the recurrent rows of the zoo matrix, under the very strategy each row
trained with on the GPU, beside what the GPU measured (read from a ``zoo_matrix_gpu.py report`` JSON): how the
recurrent kernel's model (``memopt.profile.recurrent_kernels``) does against measurements taken before it existed.
Runs on the CPU.

    python scripts/recurrent_rows_estimate.py benchmarks/any_model/zoo_h200_s16.json \
        --out benchmarks/recurrent/rows_estimate.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import zoo_matrix_gpu as zoo  # noqa: E402

import memopt  # noqa: E402
from memopt.strategy import Strategy  # noqa: E402


def strategy_of(label: str) -> Strategy:
    """The strategy of a plain one-GPU label (precision, no checkpointing, micro-batches, optimizer, allocator)."""
    precision, ckpt, mb, optimizer, *rest = label.split()
    if ckpt != "ac=none":
        raise ValueError(f"only labels without checkpointing are read here: {label!r}")
    size, count = map(int, re.fullmatch(r"mb=(\d+)x(\d+)", mb).groups())
    return Strategy(precision=precision, micro_batch_size=size, grad_accum_steps=count, optimizer=optimizer,
                    expandable_segments="expandable" in rest)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    measured = json.loads(Path(args.report).read_text())["rows"]
    for m in measured:
        row = next((r for r in zoo.ROWS if r.id == m["id"]), None)
        if row is None or row.model_type not in ("gru_lm", "lstm_tagger") or not m.get("measured_peak_allocated_bytes"):
            continue
        with torch.device("meta"):
            model = zoo.build(row)
        prof = memopt.profile(model, zoo.batch_for(row, model), hardware="h200", use_cache=False)
        est = memopt.estimate(prof, strategy_of(m["final_plan"]))
        meas = m["measured_peak_allocated_bytes"]
        rows.append({"id": m["id"], "strategy": m["final_plan"], "measured_peak_allocated_bytes": meas,
                     "measured_in": m.get("source"),
                     "predicted_then_bytes": m["predicted_peak_allocated_bytes"],
                     "predicted_now_bytes": est.peak_allocated_bytes,
                     "error_then": m["predicted_peak_allocated_bytes"] / meas - 1,
                     "error_now": est.peak_allocated_bytes / meas - 1,
                     "predicted_step_then_s": m.get("predicted_step_s"), "predicted_step_now_s": est.step_time_s,
                     "measured_step_s": m.get("measured_step_s")})
        print(json.dumps(rows[-1]), flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
