#!/usr/bin/env python
"""Does a zoo row's plan depend on the machine that makes it? Prints the profile's traces and pinned estimates.

Run on a CPU machine and a GPU machine and compare: the versions, each traced variant's micro-batch range and
attention backends, and the allocated peak memopt predicts for pinned strategies, for the model built with its
weights and on the meta device.

    python scripts/trace_env_probe.py opt350m-16x2048-12GiB --pins '[{"checkpointing": "none", "micro_batch_size": 4}]'
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import transformers
import zoo_matrix_gpu as zoo

import memopt


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("rows")
    ap.add_argument("--pins", default='[{"checkpointing": "none", "micro_batch_size": 2}]')
    ap.add_argument("--meta", action="store_true", help="also build the model on the meta device")
    args = ap.parse_args()
    print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                      "cuda": torch.cuda.is_available()}), flush=True)
    for row_id in args.rows.split(","):
        row = next(r for r in zoo.ROWS if r.id == row_id)
        for meta in ([False, True] if args.meta else [False]):
            torch.manual_seed(0)
            if meta:
                with torch.device("meta"):
                    model = zoo.build(row)
            else:
                model = zoo.build(row)
            batch = zoo.batch_for(row, model)
            prof = memopt.profile(model, sample=batch, hardware="h200", use_cache=False)
            for key, trace in sorted(prof.variants.items(), key=lambda kv: kv[0].label()):
                print(row_id, "meta" if meta else "real", key.label(), trace.lo, trace.hi, trace.min_b,
                      trace.attention_backends, flush=True)
            for pins in json.loads(args.pins):
                pins = {"precision": "bf16_autocast", **pins}
                plan = memopt.plan(model, sample=batch, budget="140GB", hardware="h200", pins=pins, profile=prof)
                print(row_id, "meta" if meta else "real", json.dumps(pins), plan.strategy.label(),
                      f"{plan.peak_allocated_bytes / 2**30:.3f} GiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
