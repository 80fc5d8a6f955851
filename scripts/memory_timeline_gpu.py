#!/usr/bin/env python
"""What held the GPU's memory at a zoo row's peak (or at its out-of-memory error), against memopt's prediction.

Runs one row of ``zoo_matrix_gpu.py`` (``memopt.wrap`` then a few steps under memopt's cap) with PyTorch's
allocation history on, finds the moment of the allocated peak (or the failed request) and sums the tensors alive
then by the code that allocated them (``allocation_history.py``, shared with ``wrap_sharded_gpu.py``). Prints one
JSON line per row: the plan, its predicted breakdown, the measured peak, the allocated bytes after ``wrap``
returned and the live sites at the peak.

    python scripts/memory_timeline_gpu.py stablelm3b-8x2048-32GiB swinbase-64x224-16GiB --steps 3 --out tl.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zoo_matrix_gpu as zoo
from allocation_history import by_site, live_at_peak

GiB = 2**30


def run(row_id: str, steps: int) -> dict[str, Any]:
    import torch

    import memopt

    row = next(r for r in zoo.ROWS if r.id == row_id)
    out: dict[str, Any] = {"id": row_id}
    oom: dict[str, Any] = {}

    def observer(device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        snap = torch.cuda.memory._snapshot()
        blocks = [(b["size"], b.get("frames", [])) for seg in snap["segments"] for b in seg["blocks"]
                  if b["state"] == "active_allocated"]
        oom.update(request_gib=alloc / GiB, allocated_gib=sum(s for s, _ in blocks) / GiB, live=by_site(blocks))

    torch._C._cuda_attach_out_of_memory_observer(observer)
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=2_000_000)
    try:
        model, batch, calls = zoo.user_loop(row)
        wrapped = memopt.wrap(model, budget=row.budget, sample=batch, fidelity=row.fidelity, lr=1e-4, **calls)
        out["plan"] = wrapped.plan.strategy.label()
        out["predicted_peak_allocated_gib"] = wrapped.plan.peak_allocated_bytes / GiB
        out["predicted_breakdown_gib"] = {k: round(v / GiB, 3) for k, v in wrapped.plan.prediction["breakdown"].items()}
        out["predicted_peak_at"] = wrapped.plan.prediction.get("peak_at")
        out["allocated_after_wrap_gib"] = torch.cuda.memory_allocated() / GiB
        for _ in range(steps):
            wrapped.step(batch)
        torch.cuda.synchronize()
        out["final_plan"] = wrapped.plan.strategy.label()
        out["measured_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        out["traceback"] = traceback.format_exc()[-1500:]
    if oom:
        out["oom"] = oom
    out["live_at_peak"] = live_at_peak(torch.cuda.memory._snapshot(), torch.cuda.current_device())
    torch.cuda.memory._record_memory_history(enabled=None)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("rows", nargs="+")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="timeline.jsonl")
    args = ap.parse_args()
    for row_id in args.rows:
        result = run(row_id, args.steps)
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")
        print(json.dumps(result, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
