#!/usr/bin/env python
"""What held the GPU's memory at a zoo row's peak (or at its out-of-memory error), against memopt's prediction.

Runs one row of ``zoo_matrix_gpu.py`` (``memopt.wrap`` then a few steps under memopt's cap) with PyTorch's
allocation history on, finds the moment of the allocated peak (or the failed request) and groups the tensors alive
then by the first frame outside PyTorch that allocated them. Prints one JSON line per row: the plan, its predicted
breakdown, the measured peak, the allocated bytes after ``wrap`` returned and the live groups at the peak.

    python scripts/memory_timeline_gpu.py stablelm3b-8x2048-32GiB swinbase-64x224-16GiB --steps 3 --out tl.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zoo_matrix_gpu as zoo

GiB = 2**30


def _site(frames: list[dict[str, Any]]) -> str:
    """The allocating call as the user's code sees it: the first two frames outside torch's own files."""
    outside = [f for f in frames if "/torch/" not in f.get("filename", "") and f.get("filename", "") != "??"]
    return " < ".join(f"{Path(f['filename']).name}:{f['line']}({f['name']})" for f in outside[:2]) or "torch"


def _grouped(blocks: list[tuple[int, list[dict[str, Any]]]], top: int = 25) -> list[dict[str, Any]]:
    sums: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, frames in blocks:
        s = sums[_site(frames)]
        s[0] += size
        s[1] += 1
    rows = sorted(sums.items(), key=lambda kv: -kv[1][0])
    return [{"site": k, "gib": round(v[0] / GiB, 3), "tensors": v[1]} for k, v in rows[:top]]


def _live_at_peak(snapshot: dict[str, Any]) -> tuple[int, list[tuple[int, list[dict[str, Any]]]]]:
    """Replays the device trace: the allocated bytes at their maximum and the blocks alive then."""
    events = snapshot["device_traces"][0] if snapshot.get("device_traces") else []
    total, best, best_i = 0, 0, -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            total += e["size"]
        elif e["action"] == "free_requested":
            total -= e["size"]
        if total > best:
            best, best_i = total, i
    live: dict[int, tuple[int, list[dict[str, Any]]]] = {}
    for e in events[: best_i + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames", []))
        elif e["action"] == "free_requested":
            live.pop(e["addr"], None)
    return best, list(live.values())


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
        oom.update(request_gib=alloc / GiB, allocated_gib=sum(s for s, _ in blocks) / GiB, live=_grouped(blocks))

    torch._C._cuda_attach_out_of_memory_observer(observer)
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=2_000_000)
    try:
        model = zoo.build(row)
        if row.kind == "torchvision":
            model = zoo._TorchvisionAdapter.wrap(model)
        batch = zoo.batch_for(row, model)
        calls: dict[str, Any] = {"loss_fn": zoo._torchvision_loss if row.kind == "torchvision" else None}
        if row.extra.get("tuple"):
            model, batch, calls = zoo._as_tuple_loop(row, model, batch)
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
    snap = torch.cuda.memory._snapshot()
    peak, live = _live_at_peak(snap)
    out["replayed_peak_gib"] = peak / GiB
    out["live_at_peak"] = _grouped(live)
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
