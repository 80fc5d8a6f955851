#!/usr/bin/env python3
"""``memopt.wrap(model, budget=..., sample=...)`` on ONE GPU where only offload fits, in a plain ``python`` process.

No ``torchrun``, no ``init_process_group``: wrap makes the plan on the GPU (the planner offloads the model states
to the host), starts its one-process group and applies the plan's DeepSpeed / FSDP2 engine. Writes one JSON row
per case: the plan, predicted vs measured peaks (allocated, reserved), the total the process held, step times.

    python scripts/one_gpu_offload_gpu.py --model llama32_1b --budget 8GiB --batch 4 --seq-len 1024 \
        --steps 6 --out $OUT/one_gpu_offload.json

Without CUDA it says so and exits 2 (there is nothing to measure on a CPU; tests/apply/test_one_gpu_offload.py
covers the same path with gloo).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama32_1b")
    ap.add_argument("--budget", default="8GiB")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this script measures on a GPU", file=sys.stderr)
        return 2
    import memopt
    from memopt.models import build_model, load_model_spec, make_batch
    from memopt.step.hard_cap import process_device_bytes

    spec = load_model_spec(args.model)
    sample = {"batch_size": args.batch, "seq_len": args.seq_len}
    torch.manual_seed(0)
    model = build_model(spec, device="cpu")  # weights in host memory: the GPU never holds them all in fp32
    t0 = time.perf_counter()
    wrapped = memopt.wrap(model, budget=args.budget, sample=sample, lr=1e-5)
    setup_s = time.perf_counter() - t0
    plan = wrapped.plan
    row = {"model": args.model, "budget": args.budget, "sample": sample, "strategy": plan.strategy.label(),
           "offload": plan.strategy.extra("sharding") is not None, "setup_s": setup_s,
           "predicted_peak_allocated_bytes": plan.prediction.get("peak_allocated_bytes"),
           "predicted_peak_reserved_bytes": plan.prediction.get("peak_reserved_bytes"),
           "predicted_total_bytes": plan.total_bytes, "predicted_step_time_s": plan.step_time_s,
           "budget_bytes": plan.budget_bytes, "started_group": getattr(wrapped._sharded, "started_group", None),
           "step_s": [], "losses": [], "crashed": False, "first_try_oom": False}
    g = torch.Generator(device="cpu").manual_seed(1)
    try:
        for i in range(args.steps):
            batch = make_batch(spec, sample, generator=g)
            torch.cuda.synchronize()
            start = time.perf_counter()
            row["losses"].append(wrapped.step(batch))
            torch.cuda.synchronize()
            row["step_s"].append(time.perf_counter() - start)
            if i == 0:
                torch.cuda.reset_peak_memory_stats()  # measured after the first step, as the validation rows are
    except torch.OutOfMemoryError as exc:
        row["first_try_oom"] = True
        row["error"] = str(exc)[:300]
    except Exception as exc:  # a crash is a result of this benchmark, written like the others
        row["crashed"] = True
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    row["measured_peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    row["measured_peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
    row["measured_total_bytes"] = process_device_bytes()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(row, indent=1))
    print(json.dumps({k: v for k, v in row.items() if k not in ("losses",)}))
    return 1 if row["crashed"] or row["first_try_oom"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
