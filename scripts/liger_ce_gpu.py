#!/usr/bin/env python
"""Issue 20's fused-loss kernels on one GPU: memopt's chunked cross-entropy against Liger-kernel's fused linear
cross-entropy, and the model's own loss, on decoder LLMs with large vocabularies (models no config ships):

    python scripts/liger_ce_gpu.py run --out $OUT/liger.jsonl [--cases ID,ID] [--deadline-s 560]
    python scripts/liger_ce_gpu.py report liger.jsonl --out benchmarks/plan_quality/liger_ce

Per case, one process per row, one after another: ``memopt.wrap`` with the loss kernel pinned (``none``: the
model's own loss; ``memopt``: memopt's chunked loss in 8 chunks; ``liger``: Liger's kernel) and everything else
pinned to one configuration (bf16 autocast over fp32 weights, every block checkpointed, one micro-batch size,
expandable segments, fused AdamW) under a budget large enough that the cap never decides, so that the three rows
differ only in the loss; then ``auto``: ``memopt.wrap`` as a user calls it under the case's budget, the planner
free to choose a kernel. Each line: ``case``, ``id``, ``plan``, predicted and measured step time and allocated
peak, the losses of every step (the same seed and batch in every row: the first losses must agree).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import zoo_matrix_gpu as zoo  # noqa: E402 - the zoo's row builders
from plan_quality_gpu import failure, timed  # noqa: E402 - the same timing and failure record

LLAMA_1B_128K = dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=4096)
QWEN2_05B = dict(hidden_size=896, num_hidden_layers=24, intermediate_size=4864, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=4096)
CASES = {
    "gemma2-2b-8x2048-56GiB": (zoo._llm("gemma2-2b", "gemma2", zoo.GEMMA2_2B, 8, 2048, "56GiB"), 4),
    "llama1b-128k-8x2048-24GiB": (zoo._llm("llama1b-128k", "llama", LLAMA_1B_128K, 8, 2048, "24GiB"), 4),
    "qwen2-0.5b-16x1024-12GiB": (zoo._llm("qwen2-0.5b", "qwen2", QWEN2_05B, 16, 1024, "12GiB"), 8),
}
KERNELS = {"none": {"chunked_ce": 0}, "memopt": {"chunked_ce": 8, "ce_kernel": "memopt"},
           "liger": {"chunked_ce": 8, "ce_kernel": "liger"}}
ROWS = ("none", "memopt", "liger", "auto")


def child(case_id: str, row_id: str, steps: int, out: Path) -> None:
    import torch

    import memopt

    row, mb = CASES[case_id]
    tokens = row.batch_size * row.seq_len
    rec: dict[str, Any] = {"case": case_id, "id": row_id, "ok": False, "oom": False, "unit": "tokens/s"}
    try:
        model = zoo.build(row)
        batch = zoo.batch_for(row, model)
        if row_id == "auto":
            kwargs: dict[str, Any] = {"budget": row.budget}
        else:
            pins = {"precision": "bf16_autocast", "checkpointing": "full", "micro_batch_size": mb,
                    "checkpoint_blocks": row.config["num_hidden_layers"],
                    "expandable_segments": True, "optimizer": "adamw_fused", **KERNELS[row_id]}
            kwargs = {"budget": "130GiB", "pins": pins, "autotune": False}
        t0 = time.perf_counter()
        wrapped = memopt.wrap(model, sample=batch, lr=1e-4, **kwargs)
        first = float(wrapped.step(batch))
        torch.cuda.synchronize()
        rec["time_to_first_step_s"] = time.perf_counter() - t0
        times, losses = timed(lambda: wrapped.step(batch), steps)
        plan = wrapped.plan
        rec.update(ok=True, plan=plan.strategy.label(), budget=kwargs["budget"],
                   predicted_step_s=float(plan.step_time_s),
                   predicted_peak_allocated_bytes=int(plan.peak_allocated_bytes), step_times_s=times,
                   losses=[first, *losses], measured_step_s=statistics.median(times[1:]),
                   notes=[n for n in plan.notes if "Liger" in n or "chunked" in n or n.startswith("autotune")])
        rec["throughput"] = tokens / rec["measured_step_s"]
        wrapped.close()
    except Exception as exc:
        rec.update(failure(exc))
    rec["measured_peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    rec["measured_peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
    with out.open("a") as f:
        f.write(json.dumps(rec) + "\n")
    print(f"{case_id}/{row_id}: {rec.get('plan')} {rec.get('measured_step_s') or rec.get('error', '')}", flush=True)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    done = set()
    if out.exists():
        done = {(r["case"], r["id"]) for r in map(json.loads, out.read_text().splitlines()) if r.get("ok")}
    wanted = args.cases.split(",") if args.cases else list(CASES)
    start = time.perf_counter()
    for case_id in wanted:
        for row_id in args.rows.split(","):
            if (case_id, row_id) in done:
                continue
            left = args.deadline_s - (time.perf_counter() - start)
            if left < 60:
                print(f"deadline: {case_id}/{row_id} and later not run", flush=True)
                return 0
            cmd = [sys.executable, __file__, "child", case_id, row_id, "--out", str(out), "--steps", str(args.steps)]
            try:
                subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=left)
            except subprocess.TimeoutExpired:
                print(f"{case_id}/{row_id}: killed at the deadline", flush=True)
                return 0
    return 0


def report(args: argparse.Namespace) -> int:
    rows = [json.loads(x) for p in args.jsonl for x in Path(p).read_text().splitlines() if x.strip()]
    # a later run's row of the same case and id replaces an earlier one (the run resumes what failed)
    rows = list({(r["case"], r["id"]): r for r in rows}.values())
    rows.sort(key=lambda r: (list(CASES).index(r["case"]), ROWS.index(r["id"])))
    dest = Path(args.out)
    dest.mkdir(parents=True, exist_ok=True)
    lines = ["| case | row | plan | tok/s | step s (pred / meas) | alloc peak GiB (pred / meas, err) | first loss |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r.get("ok"):
            lines.append(f"| {r['case']} | {r['id']} | {r.get('error', 'failed')[:80]} | | | | |")
            continue
        p, m = r["predicted_peak_allocated_bytes"], r["measured_peak_allocated_bytes"]
        lines.append(f"| {r['case']} | {r['id']} | `{r['plan']}` | {r['throughput']:.0f} | "
                     f"{r['predicted_step_s']:.3f} / {r['measured_step_s']:.3f} | "
                     f"{p / 2**30:.2f} / {m / 2**30:.2f} ({(p - m) / m:+.2%}) | {r['losses'][0]:.5f} |")
    (dest / "liger_ce.json").write_text(json.dumps(rows, indent=1) + "\n")
    (dest / "liger_ce.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--cases", default="")
    r.add_argument("--rows", default=",".join(ROWS))
    r.add_argument("--steps", type=int, default=6)
    r.add_argument("--deadline-s", type=float, default=560)
    c = sub.add_parser("child")
    c.add_argument("case")
    c.add_argument("row")
    c.add_argument("--out", required=True)
    c.add_argument("--steps", type=int, default=6)
    p = sub.add_parser("report")
    p.add_argument("jsonl", nargs="+")
    p.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.cmd == "child":
        child(args.case, args.row, args.steps, Path(args.out))
        return 0
    return {"run": run, "report": report}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
