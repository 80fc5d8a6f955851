#!/usr/bin/env python3
"""GPU validation of sharding and offload (issue 5): predicted vs measured per-GPU peaks, OOMs, speed.

Run (repo root, on one H200; see benchmarks/sharding/README.md):

    python3 scripts/validate_sharding_gpu.py --out $OUT/sharding --deadline 500
    python3 scripts/validate_sharding_gpu.py --two-gpu --out $OUT/sharding_x2 --deadline 500   # 2 x H200
    python3 scripts/validate_sharding_gpu.py --report DIR [DIR ...] --out benchmarks/sharding/sharding_h200

Each case runs in a fresh subprocess (``python -m harness.measure_sharded``, or ``torchrun
--nproc-per-node 2`` for the two-GPU cases) so allocator settings and DeepSpeed state do not leak. This
process computes memopt's choice (checkpointing and micro-batch under the cap) and prediction on the CPU
first, then appends one JSON line per case and rank to DIR/results.jsonl. Baselines try their
micro-batches largest first (starting at the largest predicted to need under 1.25x the cap, so a model
error cannot hide a larger batch that fits) and stop at the first that fits; failed attempts are rows too
(``<id>@mb<k>``). ``--deadline`` (seconds from start) stops launching cases that would not finish.
``--plan-only`` prints the cases and predictions without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from harness.sharded_cases import (  # noqa: E402
    ShardedCase,
    choose_memopt_setting,
    diagnostic_fsdp2_cases,
    predict_case,
    report_markdown,
    report_rows,
    single_gpu_cases,
    two_gpu_cases,
)
from memopt.distributed.deepspeed_engine import prepare_deepspeed_build_env  # noqa: E402
from memopt.units import GiB  # noqa: E402

#: seconds a case takes beyond its steps (build, engine init, pinning host buffers), for the deadline
CASE_OVERHEAD_S = 75.0
#: the most one case (one attempt) may run
CASE_TIMEOUT_S = 300.0
BASELINE_START_FACTOR = 1.25


def all_cases(two_gpu: bool, model: str, cap_gib: float | None, diag: bool = False) -> list[ShardedCase]:
    if two_gpu:
        cases = two_gpu_cases(model) if cap_gib is None else two_gpu_cases(model, cap_bytes=int(cap_gib * GiB))
    else:
        cases = single_gpu_cases(model) if cap_gib is None else single_gpu_cases(model, cap_bytes=int(cap_gib * GiB))
    if diag:
        cases += diagnostic_fsdp2_cases(model, world_size=2 if two_gpu else 1)
    # the fastest first, and each baseline next to the memopt case compared with it
    order = ["memopt_zero2_offload_opt", "baseline_zero3_offload", "memopt_zero3_offload_all", "memopt_fsdp2_offload",
             "baseline_fsdp2_offload", "memopt_fsdp2_x2", "memopt_zero3_x2"]
    return sorted(cases, key=lambda c: order.index(c.id) if c.id in order else len(order))


def planned(case: ShardedCase) -> tuple[ShardedCase, dict[str, Any]]:
    """memopt's case with its chosen checkpointing and micro-batch, and its prediction."""
    if case.role == "memopt":
        return choose_memopt_setting(case)
    return case, predict_case(case, with_time=False)


def baseline_attempts(case: ShardedCase) -> list[tuple[ShardedCase, dict[str, Any]]]:
    """The micro-batches a baseline tries, largest first, from the largest predicted under 1.25x the cap."""
    out = []
    for mb in case.micro_batch_candidates or (case.micro_batch,):
        c = case.replace(micro_batch=mb)
        pred = predict_case(c, with_time=False)
        if pred["predicted_peak_reserved_bytes"] <= BASELINE_START_FACTOR * case.cap_bytes or mb == 1:
            out.append((c, pred))
    return out


def prebuild_deepspeed_ops(log: Path, fused_adam: bool = False) -> dict[str, Any]:
    """JIT-build DeepSpeed's CPU Adam (and FusedAdam) once (about two minutes) so no case's time includes it."""
    t = time.perf_counter()
    code = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); print('cpu_adam ok')"
    if fused_adam:  # ZeRO without optimizer offload updates on the GPU with DeepSpeed's FusedAdam
        code += "; from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load(); print('fused ok')"
    env = {**os.environ, "MAX_JOBS": os.environ.get("MAX_JOBS", str(os.cpu_count() or 8))}
    prepare_deepspeed_build_env(env)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    log.write_text(proc.stdout[-20000:] + "\n--- stderr ---\n" + proc.stderr[-20000:])
    return {"prebuild_s": time.perf_counter() - t, "ok": proc.returncode == 0}


def launch(case: ShardedCase, prefix: Path, timeout: float) -> list[dict[str, Any]]:
    """Run one case in fresh process(es); the rows its ranks wrote (or one error row)."""
    case_json = json.dumps(case.to_dict())
    if case.world_size == 1:
        cmd = [sys.executable, "-m", "harness.measure_sharded", "--case", case_json, "--out", str(prefix)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={case.world_size}",
               "-m", "harness.measure_sharded", "--case", case_json, "--out", str(prefix)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if case.world_size > 1 and "OMP_NUM_THREADS" not in env:
        # torchrun sets OMP_NUM_THREADS=1 when it is unset, which leaves DeepSpeed's CPUAdam (OpenMP) one core per
        # rank: the two-GPU ZeRO-3 offload baseline measured 6.7 s/step against ~1.9 s predicted (session 5)
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // case.world_size))
    t = time.perf_counter()
    log = prefix.with_suffix(".log")
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout, cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            rc = None
    rows = []
    for r in range(case.world_size):
        p = Path(f"{prefix}.rank{r}.json")
        if p.exists():
            rows.append(json.loads(p.read_text()))
    if not rows:
        tail = log.read_text()[-3000:] if log.exists() else ""
        what = f"timed out after {timeout:.0f} s" if rc is None else f"exited with {rc} before writing a row"
        rows.append({"case": case.to_dict(), "label": case.label(), "rank": 0, "ok": False, "oom": False,
                     "error": f"the case process {what}; log tail: {tail}"})
    for row in rows:
        row["process_wall_s"] = time.perf_counter() - t
    return rows


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    deadline = args.deadline
    cases = all_cases(args.two_gpu, args.model, args.cap_gib, args.diag)
    if args.steps:
        cases = [c.replace(steps=args.steps) for c in cases]
    if args.fsdp_optimizer != "fused":
        cases = [c.replace(fsdp_optimizer=args.fsdp_optimizer) if c.engine == "fsdp2" else c for c in cases]
    if args.cases:
        wanted = set(args.cases.split(","))
        unknown = wanted - {c.id for c in cases}
        if unknown:
            raise SystemExit(f"unknown case ids {sorted(unknown)}; known: {[c.id for c in cases]}")
        cases = [c for c in cases if c.id in wanted]
    results = out / "results.jsonl"
    meta: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "cases": [c.id for c in cases]}
    plans: list[tuple[ShardedCase, list[tuple[ShardedCase, dict[str, Any]]]]] = []
    for case in cases:
        tp = time.perf_counter()
        if case.role == "baseline":
            plans.append((case, baseline_attempts(case)))
        else:
            plans.append((case, [planned(case)]))
        print(f"[plan] {case.id}: {[c.label() for c, _ in plans[-1][1]]} "
              f"(predicted {[round(p['predicted_peak_allocated_bytes'] / GiB, 2) for _, p in plans[-1][1]]} GiB, "
              f"{time.perf_counter() - tp:.1f} s)", flush=True)
    meta["plan_s"] = time.perf_counter() - t0
    if args.plan_only:
        for _case, attempts in plans:
            for c, pred in attempts:
                print(json.dumps({"id": c.id, "label": c.label(), "case": c.to_dict(), **pred}))
        return 0
    if any(c.engine == "deepspeed" for c, _ in plans) and not args.no_prebuild:
        fused = any(c.engine == "deepspeed" and c.offload_optimizer == "none" for c, _ in plans)
        meta["prebuild"] = prebuild_deepspeed_ops(out / "prebuild_cpu_adam.log", fused_adam=fused)
        print(f"[prebuild] {meta['prebuild']}", flush=True)
    for case, attempts in plans:
        for i, (c, pred) in enumerate(attempts):
            left = deadline - (time.perf_counter() - t0) if deadline else CASE_TIMEOUT_S
            need = CASE_OVERHEAD_S + 15.0 * c.steps
            if deadline and left < need:
                row = {"case": c.to_dict(), "label": c.label(), "rank": 0, "ok": False, "oom": False,
                       "skipped": True,
                       "error": f"skipped: {left:.0f} s left before the deadline, ~{need:.0f} s needed"}
                with open(results, "a") as f:
                    f.write(json.dumps({**row, **pred}) + "\n")
                print(f"[skip] {c.id} (mb={c.micro_batch}): {row['error']}", flush=True)
                break
            rows = launch(c, out / f"{c.id}.mb{c.micro_batch}", min(CASE_TIMEOUT_S, left))
            fitted = all(r.get("ok") and r.get("fits_under_cap") for r in rows)
            last = i == len(attempts) - 1
            for r in rows:
                if case.role == "baseline" and not fitted and not last:
                    r["case"] = {**r["case"], "id": f"{c.id}@mb{c.micro_batch}"}
                with open(results, "a") as f:
                    f.write(json.dumps({**r, **pred}) + "\n")
                print(f"[done] {r['case']['id']} rank {r.get('rank')}: ok={r.get('ok')} oom={r.get('oom')} "
                      f"alloc={r.get('measured_peak_allocated_bytes', 0) / GiB:.2f} GiB "
                      f"(pred {pred['predicted_peak_allocated_bytes'] / GiB:.2f}) step={r.get('measured_step_s')} "
                      f"err={str(r.get('error', ''))[:200]}", flush=True)
            if fitted or case.role != "baseline":
                break
    meta["wall_s"] = time.perf_counter() - t0
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return 0


def rebuild_results(run_dir: Path) -> int:
    """``results.jsonl`` of a run from its per-rank files: each row with today's CPU prediction of the case as it
    ran (checkpointing and micro-batch from the row, not re-chosen), marked ``rebuilt_from``. For runs whose own
    file did not come back, and to hold older rows against the current estimator."""
    lines, preds = [], {}
    for f in sorted(run_dir.glob("*.mb*.rank*.json")):
        row = json.loads(f.read_text())
        case = ShardedCase.from_dict({**row["case"], "id": row["case"]["id"].split("@")[0]})
        key = json.dumps(case.to_dict(), sort_keys=True)
        if key not in preds:  # every rank of a case shares its prediction
            preds[key] = predict_case(case, with_time=True)
        lines.append(json.dumps({**row, **preds[key], "rebuilt_from": f.name}))
    (run_dir / "results.jsonl").write_text("\n".join(lines) + "\n")
    return len(lines)


def load_rows(dirs: list[str]) -> list[dict[str, Any]]:
    rows = []
    for d in dirs:
        p = Path(d) / "results.jsonl" if Path(d).is_dir() else Path(d)
        if not p.exists():
            raise SystemExit(f"no results at {p}: pass the --out directory of a GPU run")
        rows += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return rows


def report(dirs: list[str], out_prefix: str) -> dict[str, Any]:
    rep = report_rows(load_rows(dirs))
    Path(out_prefix).parent.mkdir(parents=True, exist_ok=True)
    Path(out_prefix + ".json").write_text(json.dumps(rep, indent=2) + "\n")
    Path(out_prefix + ".md").write_text(report_markdown(rep))
    return rep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="run: the results directory; --report: the output path prefix")
    ap.add_argument("--cases", default="", help="comma-separated case ids (default: all)")
    ap.add_argument("--rebuild", action="store_true",
                    help="write --out's results.jsonl from its per-rank files (when the run's own was lost)")
    ap.add_argument("--deadline", type=float, default=0.0, help="seconds from start after which no case starts")
    ap.add_argument("--two-gpu", action="store_true", help="the 2-GPU cases (torchrun --nproc-per-node 2)")
    ap.add_argument("--model", default="llama32_3b")
    ap.add_argument("--diag", action="store_true", help="also the fixed FSDP2 diagnostic cases (reserved per stream)")
    ap.add_argument("--steps", type=int, default=0, help="steps per case (default: the case's own, 3)")
    ap.add_argument("--cap-gib", type=float, default=None, help="per-GPU hard cap (default: 16 / 48 GiB)")
    ap.add_argument("--fsdp-optimizer", choices=("fused", "foreach"), default="fused",
                    help="torch AdamW implementation on FSDP2's CPU shards (foreach if fused fails on DTensor)")
    ap.add_argument("--plan-only", action="store_true", help="print cases and predictions; no GPU needed")
    ap.add_argument("--no-prebuild", action="store_true", help="skip the DeepSpeed CPU Adam JIT build step")
    ap.add_argument("--report", nargs="+", metavar="DIR", help="write the report of these run directories")
    args = ap.parse_args(argv)
    if args.rebuild:
        n = rebuild_results(Path(args.out))
        print(f"{n} rows written to {Path(args.out) / 'results.jsonl'}")
        return 0
    if args.report:
        rep = report(args.report, args.out)
        print(json.dumps(rep["summary"], indent=2))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
