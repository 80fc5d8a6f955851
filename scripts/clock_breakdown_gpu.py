#!/usr/bin/env python
"""Where the clock misses a row: the plan ``memopt.wrap`` makes for a zoo row (``scripts/zoo_matrix_gpu.py``),
trained without the autotune, its measured step against the clock's parts. One fresh process per row:

    python scripts/clock_breakdown_gpu.py run --out $OUT/breakdown.jsonl --rows ID,ID [--deadline-s 500]
    python scripts/clock_breakdown_gpu.py report $OUT/breakdown.jsonl

Each line: the measured step (median of 3 after 3 warm-ups), the GPU's busy time in one step under
``torch.profiler`` (the union of its kernels' intervals), the kernels it ran and the launches the host issued, and
the prediction's parts: GPU time of forward + backward (all micro-batches) and of the optimizer, host time, the
kernel count the trace made (``time_terms`` launches x micro-batches + the optimizer's). A row whose measured step is
far above its GPU busy time is host-bound; a row whose busy time is far from the predicted GPU time misses on the
device side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def _busy_s(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of ``(start_us, end_us)`` intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total / 1e6


def _dispatched_ops(wrapped: Any, batch: Any) -> dict[str, int]:
    """The aten ops one real step dispatches: those that launch a kernel and those that do not (views, metadata),
    for the host's cost per op of each kind."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from memopt.kernel_ops import FREE_OPS

    counts = {"dispatched_launching_ops": 0, "dispatched_free_ops": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            free = func._overloadpacket.__name__ in FREE_OPS
            counts["dispatched_free_ops" if free else "dispatched_launching_ops"] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        wrapped.step(batch)
    return counts


def measure(row_id: str) -> dict[str, Any]:
    import torch
    import zoo_matrix_gpu as zoo
    from torch.profiler import ProfilerActivity, profile

    import memopt
    from memopt.host_speed import host_scale, probe_op_seconds

    row = next(r for r in zoo.ROWS if r.id == row_id)
    probe = [probe_op_seconds() for _ in range(3)]
    model, batch, calls = zoo.user_loop(row)
    lr = {} if "optimizer" in calls else {"lr": 1e-4}
    wrapped = memopt.wrap(model, budget=row.budget, sample=batch, fidelity=row.fidelity, autotune=False, **lr,
                          **calls)
    pred = wrapped.plan.prediction
    terms = pred["time_terms"]
    m = terms["micro_batches"]
    out: dict[str, Any] = {
        "id": row_id, "plan": wrapped.plan.strategy.label(), "predicted_step_s": float(pred["step_time_s"]),
        "predicted_gpu_s": float(pred["forward_s"] + pred["backward_s"]),
        "predicted_forward_s": float(pred["forward_s"]), "predicted_backward_s": float(pred["backward_s"]),
        "predicted_optimizer_s": float(pred["optimizer_s"]), "predicted_host_s": float(pred["host_s"]),
        "predicted_host_bound": bool(pred["host_bound"]), "micro_batches": m,
        "predicted_kernels": float((terms["forward"]["launches"] + terms["backward"]["launches"]) * m
                                   + terms["optimizer"]["launches"]),
        "predicted_terms": {k: {kk: float(vv) for kk, vv in v.items()} if isinstance(v, dict) else v
                            for k, v in terms.items()},
    }
    for _ in range(3):
        wrapped.step(batch)
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        wrapped.step(batch)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    out["measured_step_s"] = statistics.median(times)
    out["probe_op_s"] = probe
    out["host_scale_used"] = host_scale()
    out.update(_dispatched_ops(wrapped, batch))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wrapped.step(batch)
        torch.cuda.synchronize()
    kernels, launches, spans, by_name = 0, 0, [], {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
            spans.append((e.time_range.start, e.time_range.end))
            us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            name = e.name[:90]
            agg = by_name.setdefault(name, [0.0, 0])
            agg[0] += us / 1e6
            agg[1] += 1
        elif e.name.startswith(("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel")):
            launches += 1
    out["measured_gpu_busy_s"] = _busy_s(spans)
    out["measured_kernels"] = kernels
    out["measured_launches"] = launches
    out["top_kernels"] = [{"name": k, "s": v[0], "count": v[1]}
                          for k, v in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:15]]
    wrapped.close()
    return out


def run(args: argparse.Namespace) -> None:
    start = time.time()
    out = Path(args.out)
    for row_id in args.rows.split(","):
        left = args.deadline_s - (time.time() - start)
        if left < 30:
            print(f"not run (deadline): {row_id}", flush=True)
            continue
        try:
            subprocess.run([sys.executable, __file__, "row", row_id, "--out", str(out)], timeout=left, check=False)
        except subprocess.TimeoutExpired:
            with out.open("a") as f:
                f.write(json.dumps({"id": row_id, "error": "timed out"}) + "\n")
        print(f"[{time.time() - start:5.0f}s] done {row_id}", flush=True)


def row(args: argparse.Namespace) -> None:
    try:
        rec = measure(args.row)
    except Exception as exc:  # one row's failure is a row of the result, not the end of the run
        rec = {"id": args.row, "error": f"{type(exc).__name__}: {str(exc)[:500]}",
               "traceback": traceback.format_exc()[-2000:]}
    with open(args.out, "a") as f:
        f.write(json.dumps(rec) + "\n")
    print(json.dumps({k: v for k, v in rec.items() if k not in ("top_kernels", "predicted_terms")}), flush=True)


def report(args: argparse.Namespace) -> None:
    rows = [json.loads(x) for p in args.files for x in Path(p).read_text().splitlines() if x.strip()]
    print("| row | plan | step pred / meas s | GPU pred / busy s | host pred s | kernels pred / meas | launches |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['id']} | {r['error'][:80]} | | | | | |")
            continue
        gpu = r["predicted_gpu_s"] + r["predicted_optimizer_s"]
        print(f"| {r['id']} | `{r['plan']}` | {r['predicted_step_s']:.3f} / {r['measured_step_s']:.3f} | "
              f"{gpu:.3f} / {r['measured_gpu_busy_s']:.3f} | {r['predicted_host_s']:.3f} | "
              f"{r['predicted_kernels']:.0f} / {r['measured_kernels']} | {r['measured_launches']} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--rows", required=True)
    r.add_argument("--deadline-s", type=float, default=500)
    one = sub.add_parser("row")
    one.add_argument("row")
    one.add_argument("--out", required=True)
    rep = sub.add_parser("report")
    rep.add_argument("files", nargs="+")
    args = ap.parse_args()
    {"run": run, "row": row, "report": report}[args.cmd](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
