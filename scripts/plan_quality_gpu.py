#!/usr/bin/env python
"""Issue 20's hand grid on one GPU: memopt's default plan for a 1.1B Llama (TinyLlama's shape, from its config) at a
global batch of 16 x 2048 under 24 GiB, against configurations written by hand, one row at a time:

    python scripts/plan_quality_gpu.py run --out $OUT/grid.jsonl [--rows ID,ID] [--steps 8] [--deadline-s 560]
    python scripts/plan_quality_gpu.py report $OUT/grid.jsonl --out benchmarks/plan_quality/tinyllama_24GiB
    python scripts/plan_quality_gpu.py list

Rows run strictly one after another, each in a fresh process (the allocator's segment mode is fixed when CUDA starts
and concurrent rows share the GPU: their step times would not be timing data). ``run`` appends one JSON line per row
and skips rows already in ``--out``, so a run cut by its time limit is continued by running it again.

Rows: ``memopt/default`` and ``memopt/8bit`` (``memopt.wrap`` as a user calls it, autotune included; the time from
``wrap`` to the end of the first step is ``time_to_first_step_s``), and the hand grid: Hugging Face gradient
checkpointing on every block at micro-batch 1, 2, 4 and 8 (accumulating to 16), bf16 autocast over fp32 weights,
fused AdamW or bitsandbytes' 8-bit AdamW, expandable segments on and off, under the same 24 GiB cap
(``torch.cuda.set_per_process_memory_fraction``). The Hugging Face-typical configuration is checkpointing everything
at the largest micro-batch that trains with the default allocator and fused AdamW.

Each line: ``id``, ``config``, ``ok``, ``oom``, ``measured_step_s`` (median of the steps after the first two),
``tokens_per_s``, ``peak_allocated_bytes``, ``peak_reserved_bytes``; memopt rows add ``plan``,
``predicted_step_s``, ``time_to_first_step_s`` and ``autotune`` (its trials). ``report`` writes the issue's row
(``case``, ``unit``, ``memopt_throughput``, ``best_hand_throughput``, ``best_hand_config``, ``hf_typical_throughput``,
``predicted_step_s``, ``measured_step_s``, ``time_to_first_step_s``) as JSON and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BUDGET, BUDGET_BYTES = "24GiB", 24 * 2**30
BATCH, SEQ = 16, 2048
TINYLLAMA = dict(hidden_size=2048, num_hidden_layers=22, intermediate_size=5632, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096)


def rows() -> list[dict[str, Any]]:
    out = [{"id": "memopt/default", "kind": "memopt", "fidelity": "default"},
           {"id": "memopt/8bit", "kind": "memopt", "fidelity": "8bit"}]
    for opt in ("adamw_fused", "adamw8bit"):
        for expandable in (True, False):
            for mb in (1, 2, 4, 8):
                alloc = "expandable" if expandable else "default-alloc"
                out.append({"id": f"hand/ckpt-all/mb={mb}/{alloc}/{opt}", "kind": "hand", "micro_batch": mb,
                            "expandable": expandable, "optimizer": opt})
    return out


def _model_and_batch() -> tuple[Any, dict[str, Any]]:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.AutoConfig.for_model("llama", **TINYLLAMA)
    model = tf.AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, TINYLLAMA["vocab_size"], (BATCH, SEQ), generator=g)
    return model, {"input_ids": ids, "labels": ids.clone()}


def timed(step: Any, steps: int) -> tuple[list[float], list[float]]:
    import torch

    times, losses = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        losses.append(float(step()))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times, losses


def failure(exc: BaseException) -> dict[str, Any]:
    """A row's failure as its result (the grid goes on): an OOM flagged, any other error by its type and message."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return {"oom": True, "error": str(exc).splitlines()[0][:300], "traceback": traceback.format_exc()[-3000:]}
    return {"error": f"{type(exc).__name__}: {str(exc)[:400]}", "traceback": traceback.format_exc()[-3000:]}


def run_memopt(row: dict[str, Any], steps: int, partial: dict[str, Any]) -> dict[str, Any]:
    import torch

    import memopt

    model, batch = _model_and_batch()
    t0 = time.perf_counter()
    wrapped = memopt.wrap(model, budget=BUDGET, sample=batch, fidelity=row["fidelity"], lr=1e-4)
    partial.update(first_plan=wrapped.plan.strategy.label(), first_predicted_step_s=float(wrapped.plan.step_time_s),
                   first_predicted_total_bytes=int(wrapped.plan.total_bytes))
    first = float(wrapped.step(batch))
    torch.cuda.synchronize()
    to_first = time.perf_counter() - t0
    times, losses = timed(lambda: wrapped.step(batch), steps - 1)
    plan = wrapped.plan
    return {"plan": plan.strategy.label(), "predicted_step_s": float(plan.step_time_s),
            "time_to_first_step_s": to_first, "step_times_s": times, "losses": [first, *losses],
            "autotune": [n for n in plan.notes if n.startswith("autotune")]}


def outside_allocator_bytes() -> int:
    """What this process holds on the GPU outside PyTorch's allocator (CUDA context, cuBLAS handle), measured once
    a GEMM has run."""
    import torch

    x = torch.ones(256, 256, device="cuda")
    (x @ x).sum().item()
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def run_hand(row: dict[str, Any], steps: int, partial: dict[str, Any]) -> dict[str, Any]:
    import torch

    model, batch = _model_and_batch()
    # the hard cap of the brief: the budget less what the process holds outside the allocator, as memopt's own
    outside = outside_allocator_bytes()
    partial["outside_allocator_bytes"] = outside
    torch.cuda.set_per_process_memory_fraction((BUDGET_BYTES - outside)
                                               / torch.cuda.get_device_properties(0).total_memory)
    model = model.cuda().train()  # Hugging Face checkpoints only in training mode
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    if row["optimizer"] == "adamw8bit":
        import bitsandbytes as bnb

        opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-4)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    mb = row["micro_batch"]
    ids = batch["input_ids"].pin_memory().cuda(non_blocking=True)

    def step() -> torch.Tensor:
        total = 0.0
        for i in range(0, BATCH, mb):
            x = ids[i:i + mb]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=x, labels=x).loss / (BATCH // mb)
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    times, losses = timed(step, steps)
    return {"step_times_s": times, "losses": losses}


def child(row_id: str, steps: int) -> None:
    import torch

    row = next(r for r in rows() if r["id"] == row_id)
    out: dict[str, Any] = {"id": row_id, "config": row, "ok": False, "oom": False}
    try:
        out.update((run_memopt if row["kind"] == "memopt" else run_hand)(row, steps, out))
        warm = out["step_times_s"][2:] or out["step_times_s"][-1:]
        out["measured_step_s"] = statistics.median(warm)
        out["tokens_per_s"] = BATCH * SEQ / out["measured_step_s"]
        out["ok"] = True
    except Exception as exc:
        out.update(failure(exc))
    out["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    out["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
    print("ROW " + json.dumps(out), flush=True)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    done = {json.loads(line)["id"] for line in out.read_text().splitlines()} if out.exists() else set()
    wanted = set(args.rows.split(",")) if args.rows else None
    start = time.perf_counter()
    for row in rows():
        if row["id"] in done or (wanted is not None and row["id"] not in wanted):
            continue
        left = args.deadline_s - (time.perf_counter() - start)
        if left < 60:
            print(f"deadline: {row['id']} and later rows not run (run again to continue)")
            break
        env = dict(os.environ)
        if row["kind"] == "hand":  # memopt sets the allocator mode itself
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:" + ("True" if row["expandable"] else "False")
        t = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, __file__, "child", row["id"], "--steps", str(args.steps)],
                                  env=env, capture_output=True, text=True, timeout=left)
            line = next((x[4:] for x in proc.stdout.splitlines() if x.startswith("ROW ")), None)
            result = json.loads(line) if line else {"id": row["id"], "config": row, "ok": False, "oom": False,
                                                    "error": (proc.stderr or "no output")[-600:]}
        except subprocess.TimeoutExpired:
            result = {"id": row["id"], "config": row, "ok": False, "oom": False, "error": "deadline"}
        result["process_wall_s"] = time.perf_counter() - t
        with out.open("a") as f:
            f.write(json.dumps(result) + "\n")
        print(f"{row['id']}: {result.get('measured_step_s') or result.get('error', '')}", flush=True)
    return 0


def report(args: argparse.Namespace) -> int:
    rs = [json.loads(line) for line in Path(args.jsonl).read_text().splitlines()]
    ok = [r for r in rs if r.get("ok")]
    hand = [r for r in ok if r["config"]["kind"] == "hand"]
    exact_hand = [r for r in hand if r["config"]["optimizer"] == "adamw_fused"]
    hf = [r for r in exact_hand if not r["config"]["expandable"]]
    hf_typical = max(hf, key=lambda r: r["config"]["micro_batch"]) if hf else None
    out = []
    for fid, pool in (("default", exact_hand), ("8bit", hand)):
        mem = next((r for r in ok if r["id"] == f"memopt/{fid}"), None)
        best = max(pool, key=lambda r: r["tokens_per_s"]) if pool else None
        out.append({"case": f"tinyllama1.1b-16x2048-24GiB/{fid}", "unit": "tokens/s",
                    "memopt_throughput": mem and mem["tokens_per_s"], "memopt_plan": mem and mem["plan"],
                    "best_hand_throughput": best and best["tokens_per_s"], "best_hand_config": best and best["id"],
                    "hf_typical_throughput": hf_typical and hf_typical["tokens_per_s"],
                    "hf_typical_config": hf_typical and hf_typical["id"],
                    "predicted_step_s": mem and mem["predicted_step_s"],
                    "measured_step_s": mem and mem["measured_step_s"],
                    "time_to_first_step_s": mem and mem["time_to_first_step_s"]})
    Path(args.out + ".json").write_text(json.dumps({"cases": out, "rows": rs}, indent=1) + "\n")
    lines = ["| row | tokens/s | step s | peak reserved GiB | note |", "|---|---|---|---|---|"]
    for r in rs:
        lines.append(f"| {r['id']} | {r.get('tokens_per_s', 0):.0f} | {r.get('measured_step_s') or 0:.3f} | "
                     f"{r.get('peak_reserved_bytes', 0) / 2**30:.1f} | {r.get('plan') or r.get('error', '')[:80]} |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print(json.dumps(out, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--rows", default="")
    r.add_argument("--steps", type=int, default=8)
    r.add_argument("--deadline-s", type=float, default=560.0)
    c = sub.add_parser("child")
    c.add_argument("row")
    c.add_argument("--steps", type=int, default=8)
    p = sub.add_parser("report")
    p.add_argument("jsonl")
    p.add_argument("--out", required=True)
    sub.add_parser("list")
    args = ap.parse_args()
    if args.cmd == "run":
        return run(args)
    if args.cmd == "child":
        child(args.row, args.steps)
        return 0
    if args.cmd == "report":
        return report(args)
    for row in rows():
        print(row["id"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
