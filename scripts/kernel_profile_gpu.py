#!/usr/bin/env python
"""Where one training step of a speed case spends its GPU time: one hand configuration of
``scripts/speed_grid_gpu.py`` (checkpointing mode, micro-batch) profiled with ``torch.profiler`` after two warm-up
steps, written as one JSON line (wall time, GPU busy time, kernel count, the top kernels by GPU time):

    python scripts/kernel_profile_gpu.py CASE MODE MB [MODE MB ...] --out $OUT/kernels.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import speed_grid_gpu as grid  # noqa: E402 - the speed cases and their hand configurations
import zoo_matrix_gpu as zoo  # noqa: E402


def profile_config(case: grid.Case, model: Any, batch: dict[str, Any], blocks: list[Any], mode: str,
                   mb: int) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    grid.apply_checkpointing(blocks, mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    parts = grid._split(batch, mb)

    def step() -> None:
        for part in parts:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = grid._loss(model, case.row, part) / len(parts)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    step()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    busy = 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            kernels[e.name][0] += us
            kernels[e.name][1] += 1
            busy += us
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:20]
    torch.cuda.empty_cache()
    return {"case": case.id, "checkpointing": mode, "micro_batch": mb, "wall_s": wall, "gpu_busy_s": busy / 1e6,
            "kernels": int(sum(v[1] for v in kernels.values())),
            "top": [{"name": k[:120], "s": v[0] / 1e6, "count": int(v[1])} for k, v in top]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case")
    ap.add_argument("configs", nargs="+", help="MODE MB pairs")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    case = next(c for c in grid.CASES if c.id == args.case)
    model = zoo.build(case.row)
    batch = zoo.batch_for(case.row, model)
    model = model.cuda().train()
    if hasattr(model, "config"):
        model.config.use_cache = False
    batch = {k: v.cuda() if hasattr(v, "cuda") else v for k, v in batch.items()}
    blocks = grid.repeated_blocks(model)
    pairs = list(zip(args.configs[::2], map(int, args.configs[1::2])))
    for mode, mb in pairs:
        rec = profile_config(case, model, batch, blocks, mode, mb)
        with open(args.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(json.dumps({k: v for k, v in rec.items() if k != "top"}), flush=True)
        for k in rec["top"][:12]:
            print(f"   {k['s']:.4f} s  x{k['count']:5d}  {k['name']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
