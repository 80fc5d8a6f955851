#!/usr/bin/env python
"""Issue 20's speed cases on one GPU: memopt's plan against an exhaustive grid of configurations written by hand,
for models no config ships (built by ``scripts/zoo_matrix_gpu.py``'s row builders), under the brief's hard cap:

    python scripts/speed_grid_gpu.py run --out $OUT/grid.jsonl [--cases ID,ID] [--case-deadline-s 170]
    python scripts/speed_grid_gpu.py report grid.jsonl [more.jsonl:CASE,CASE] --out benchmarks/plan_quality/speed_cases
    python scripts/speed_grid_gpu.py list

Per case, three processes strictly one after another (the allocator's segment mode is fixed when CUDA starts, and a
shared GPU makes step times worthless): ``memopt.wrap`` as a user calls it (autotune included; the time from ``wrap``
to the end of the first step is ``time_to_first_step_s``), then the hand grid with expandable segments on, then off.
The grid, in one process per allocator mode: checkpointing none / every block / every second block / selective (the
matmuls' outputs kept, the rest recomputed: ``torch.utils.checkpoint``'s selective contexts on every block) x
micro-batches 1, 2, 4, ... up to the global batch (a mode's larger micro-batches are skipped after its first OOM),
bf16 autocast over fp32 weights, fused AdamW; the fastest configuration of each process is then also timed with
foreach AdamW. Checkpointing is applied the way a user writes it: the model's repeated blocks (its largest
``nn.ModuleList`` of one class) wrapped in non-reentrant ``torch.utils.checkpoint``.

Each line: ``case``, ``id``, ``kind`` (``memopt`` / ``hand``), ``ok``, ``oom``, ``measured_step_s`` (median of the
timed steps), ``throughput`` and ``unit``, peaks; hand rows add ``checkpointing``, ``micro_batch``, ``expandable``,
``optimizer``; memopt rows ``plan``, ``predicted_step_s``, ``time_to_first_step_s`` and the autotune's notes.
``report`` writes issue 20's row per case (``memopt_throughput``, ``best_hand_throughput``, ``best_hand_config``,
``hf_typical_throughput``: checkpointing every block at the largest micro-batch that trains with the default
allocator) as JSON and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import zoo_matrix_gpu as zoo  # noqa: E402 - the zoo's row builders, one definition of each model
from plan_quality_gpu import failure, outside_allocator_bytes, timed  # noqa: E402 - the same timing, failure record and outside-memory probe


@dataclass(frozen=True)
class Case:
    id: str
    row: zoo.ZooRow


def _case(id: str, kind: str, model_type: str, cfg: dict[str, Any], b: int, s: int, budget: str,
          **kw: Any) -> Case:
    return Case(id, zoo.ZooRow(id, kind, model_type, cfg, b, s, budget=budget, **kw))


CASES = [
    _case("pythia410m-16x2048-12GiB", "causal", "gpt_neox", zoo.PYTHIA410, 16, 2048, "12GiB"),
    _case("gemma2-2b-8x2048-56GiB", "causal", "gemma2", zoo.GEMMA2_2B, 8, 2048, "56GiB"),
    _case("stablelm3b-8x2048-56GiB", "causal", "stablelm", zoo.STABLELM_3B, 8, 2048, "56GiB"),
    _case("robertalarge-mlm-64x512-10GiB", "masked", "roberta", zoo.ROBERTA_LARGE, 64, 512, "10GiB"),
    _case("vit632m-128x224-20GiB", "image", "vit", zoo.VIT_HUGE_ISH, 128, 0, "20GiB", image_size=224),
    _case("tied-resmlp-16blk-8x2048-12GiB", "custom", "tied_resmlp", dict(vocab=32000, width=2048, blocks=16),
          8, 2048, "12GiB"),
    # held out of every clock fit: first measured in session 24
    _case("qwen3-0.6b-16x2048-16GiB", "causal", "qwen3", zoo.QWEN3_06B, 16, 2048, "16GiB"),
    _case("granite1b-8x2048-28GiB", "causal", "granite", zoo.GRANITE_1B, 8, 2048, "28GiB"),
    _case("qwen3-0.6b-16x2048-40GiB", "causal", "qwen3", zoo.QWEN3_06B, 16, 2048, "40GiB"),
    _case("granite1b-8x2048-48GiB", "causal", "granite", zoo.GRANITE_1B, 8, 2048, "48GiB"),
]
CHECKPOINTING = ("none", "all", "every2", "selective")


def _unit(row: zoo.ZooRow) -> tuple[str, int]:
    """The throughput unit and the units in one global batch."""
    if row.kind in ("image", "torchvision"):
        return "samples/s", row.batch_size
    return "tokens/s", row.batch_size * row.seq_len


# ---------------------------------------------------------------------------------------------------------------
# hand configurations
# ---------------------------------------------------------------------------------------------------------------

def repeated_blocks(model: Any) -> list[Any]:
    """The model's repeated blocks: its largest ``nn.ModuleList`` whose children share one class."""
    from torch import nn

    best: list[Any] = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > len(best) and len({type(c) for c in m}) == 1:
            best = list(m)
    return best


def _selective_context() -> Any:
    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    keep = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten._scaled_dot_product_efficient_attention.default,
            torch.ops.aten._scaled_dot_product_flash_attention.default,
            torch.ops.aten._scaled_dot_product_cudnn_attention.default}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_checkpointing(blocks: list[Any], mode: str) -> None:
    """Checkpoint the chosen blocks as a user does: each block's forward through non-reentrant
    ``torch.utils.checkpoint``. ``mode`` "none" restores every block's own forward."""
    from torch.utils.checkpoint import checkpoint

    for i, block in enumerate(blocks):
        block.__dict__.pop("forward", None)  # the class's forward again
        chosen = mode == "all" or mode == "selective" or (mode == "every2" and i % 2 == 0)
        if mode == "none" or not chosen:
            continue
        inner = block.forward
        kw: dict[str, Any] = {"use_reentrant": False}
        if mode == "selective":
            kw["context_fn"] = _selective_context

        def forward(*args: Any, _inner: Any = inner, _kw: dict[str, Any] = kw, **kwargs: Any) -> Any:
            return checkpoint(_inner, *args, **_kw, **kwargs)

        block.forward = forward


def _split(batch: Any, mb: int) -> list[Any]:
    n = next(v for v in batch.values() if hasattr(v, "shape")).shape[0]
    return [{k: (v[i:i + mb] if hasattr(v, "shape") else v) for k, v in batch.items()} for i in range(0, n, mb)]


def _loss(model: Any, row: zoo.ZooRow, mb: dict[str, Any]) -> Any:
    import torch

    out = model(**mb)
    if row.kind == "torchvision":
        return torch.nn.functional.cross_entropy(out.float(), mb["labels"])
    return out["loss"]


def _free(*objs: Any) -> None:
    import gc

    import torch

    del objs
    gc.collect()
    torch.cuda.empty_cache()


def run_hand_grid(case: Case, expandable: bool, steps: int, deadline_s: float, out: Path) -> None:
    import torch

    row = case.row
    unit, per_step = _unit(row)
    outside = outside_allocator_bytes()
    from memopt.units import parse_budget

    budget = parse_budget(row.budget)
    torch.cuda.set_per_process_memory_fraction((budget - outside) / torch.cuda.get_device_properties(0).total_memory)
    model = zoo.build(row)
    if row.kind == "torchvision":
        model = zoo._TorchvisionAdapter.wrap(model)
    batch = zoo.batch_for(row, model)
    model = model.cuda().train()
    if hasattr(model, "config"):
        model.config.use_cache = False
    batch = {k: v.cuda() if hasattr(v, "cuda") else v for k, v in batch.items()}
    blocks = repeated_blocks(model)
    alloc = "expandable" if expandable else "default-alloc"
    start = time.perf_counter()
    mbs = [m for m in (1, 2, 4, 8, 16, 32, 64, 128, 256) if m <= row.batch_size and row.batch_size % m == 0]
    best: tuple[float, str, int] | None = None

    def one(mode: str, mb: int, optimizer: str) -> dict[str, Any]:
        nonlocal best
        apply_checkpointing(blocks, mode)
        rec: dict[str, Any] = {"case": case.id, "kind": "hand", "id": f"{mode}/mb={mb}/{alloc}/{optimizer}",
                               "checkpointing": mode, "micro_batch": mb, "expandable": expandable,
                               "optimizer": optimizer, "blocks": len(blocks), "unit": unit, "ok": False,
                               "oom": False, "outside_allocator_bytes": outside, "budget_bytes": budget}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=optimizer == "adamw_fused",
                                foreach=optimizer == "adamw_foreach" or None)
        parts = _split(batch, mb)
        torch.cuda.reset_peak_memory_stats()

        def step() -> Any:
            total = 0.0
            for part in parts:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = _loss(model, row, part) / len(parts)
                loss.backward()
                total += loss.detach()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return total

        try:
            times, losses = timed(step, steps)
            rec.update(ok=True, step_times_s=times, losses=losses, measured_step_s=statistics.median(times[1:]))
            rec["throughput"] = per_step / rec["measured_step_s"]
            if best is None or rec["measured_step_s"] < best[0]:
                best = (rec["measured_step_s"], mode, mb)
        except Exception as exc:
            rec.update(failure(exc))
        rec["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
        rec["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
        opt.zero_grad(set_to_none=True)
        _free(opt)
        with out.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"{case.id} {rec['id']}: {rec.get('measured_step_s') or rec.get('error', '')}", flush=True)
        return rec

    for mode in CHECKPOINTING:
        for mb in mbs:
            if time.perf_counter() - start > deadline_s:
                print(f"{case.id}: grid deadline at {mode}/mb={mb}", flush=True)
                return
            if not one(mode, mb, "adamw_fused")["ok"]:
                break  # larger micro-batches of this mode need more memory still
    if best is not None and time.perf_counter() - start < deadline_s:
        one(best[1], best[2], "adamw_foreach")


def run_memopt(case: Case, steps: int, out: Path) -> None:
    import torch

    import memopt

    row = case.row
    unit, per_step = _unit(row)
    rec: dict[str, Any] = {"case": case.id, "kind": "memopt", "id": "memopt", "unit": unit, "ok": False,
                           "oom": False}
    try:
        model = zoo.build(row)
        if row.kind == "torchvision":
            model = zoo._TorchvisionAdapter.wrap(model)
        batch = zoo.batch_for(row, model)
        t0 = time.perf_counter()
        wrapped = memopt.wrap(model, budget=row.budget, sample=batch, lr=1e-4,
                              loss_fn=zoo._torchvision_loss if row.kind == "torchvision" else None)
        rec["first_plan"] = wrapped.plan.strategy.label()
        first = float(wrapped.step(batch))
        torch.cuda.synchronize()
        rec["time_to_first_step_s"] = time.perf_counter() - t0
        times, losses = timed(lambda: wrapped.step(batch), steps)
        plan = wrapped.plan
        rec.update(ok=True, plan=plan.strategy.label(), predicted_step_s=float(plan.step_time_s),
                   predicted_peak_allocated_bytes=int(plan.peak_allocated_bytes), step_times_s=times,
                   losses=[first, *losses], measured_step_s=statistics.median(times[1:]),
                   autotune=[n for n in plan.notes if n.startswith("autotune")], search=plan.search)
        rec["throughput"] = per_step / rec["measured_step_s"]
        wrapped.close()
    except Exception as exc:
        rec.update(failure(exc))
    stats = torch.cuda.memory_stats()
    rec["num_ooms"] = int(stats.get("num_ooms", 0))
    rec["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    rec["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
    with out.open("a") as f:
        f.write(json.dumps(rec) + "\n")
    print(f"{case.id} memopt: {rec.get('plan')} {rec.get('measured_step_s') or rec.get('error', '')}", flush=True)


# ---------------------------------------------------------------------------------------------------------------
# driver and report
# ---------------------------------------------------------------------------------------------------------------

def _done(out: Path) -> set[tuple[str, str]]:
    if not out.exists():
        return set()
    rows = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
    return {(r["case"], r.get("part", "memopt" if r["kind"] == "memopt" else
                              "expandable" if r.get("expandable") else "default-alloc")) for r in rows}


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    wanted = set(args.cases.split(",")) if args.cases else None
    start = time.perf_counter()
    for case in CASES:
        if wanted is not None and case.id not in wanted:
            continue
        for part in ("memopt", "expandable", "default-alloc"):
            if (case.id, part) in _done(out) or part not in args.parts.split(","):
                continue
            left = args.deadline_s - (time.perf_counter() - start)
            if left < 40:
                print(f"deadline: {case.id}/{part} and later not run (run again to continue)", flush=True)
                return 0
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            if part != "memopt":  # memopt sets the allocator mode itself
                env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:" + ("True" if part == "expandable" else
                                                                           "False")
            cmd = [sys.executable, __file__, "child", case.id, part, "--out", str(out), "--steps", str(args.steps),
                   "--case-deadline-s", str(min(args.case_deadline_s, left - 30))]
            try:
                proc = subprocess.run(cmd, env=env, timeout=left)
                if proc.returncode != 0 and (case.id, part) not in _done(out):
                    with out.open("a") as f:
                        f.write(json.dumps({"case": case.id, "part": part, "kind": part, "id": part, "ok": False,
                                            "error": f"process ended with {proc.returncode}"}) + "\n")
            except subprocess.TimeoutExpired:
                print(f"{case.id}/{part}: killed at the deadline", flush=True)
                return 0
    return 0


def child(args: argparse.Namespace) -> None:
    case = next(c for c in CASES if c.id == args.case)
    out = Path(args.out)
    if args.part == "memopt":
        run_memopt(case, args.steps, out)
    else:
        run_hand_grid(case, args.part == "expandable", args.steps, args.case_deadline_s, out)


def report(args: argparse.Namespace) -> int:
    rows = []
    for spec in args.jsonl:  # PATH or PATH:CASE,CASE (one run's rows of those cases only)
        path, _, only = spec.partition(":")
        keep = set(only.split(",")) if only else None
        rows += [r for x in Path(path).read_text().splitlines() if x.strip()
                 for r in [json.loads(x)] if keep is None or r["case"] in keep]
    cases = []
    lines = ["| case | memopt plan | memopt | best hand (config) | vs best | HF-typical (config) | vs HF | "
             "pred / meas step s | first step s |", "|---|---|---|---|---|---|---|---|---|"]
    for case in dict.fromkeys(r["case"] for r in rows):
        rs = [r for r in rows if r["case"] == case]
        hand = [r for r in rs if r["kind"] == "hand" and r.get("ok")]
        mem = next((r for r in rs if r["kind"] == "memopt"), None)
        best = max(hand, key=lambda r: r["throughput"], default=None)
        hf_pool = [r for r in hand if r["checkpointing"] == "all" and not r["expandable"]
                   and r["optimizer"] == "adamw_fused"]
        hf = max(hf_pool, key=lambda r: r["micro_batch"], default=None)
        m_tp = mem.get("throughput") if mem else None
        c = {"case": case, "unit": rs[0].get("unit"), "memopt_throughput": m_tp,
             "memopt_plan": mem and mem.get("plan"), "memopt_error": mem and mem.get("error"),
             "best_hand_throughput": best and best["throughput"], "best_hand_config": best and best["id"],
             "hf_typical_throughput": hf and hf["throughput"], "hf_typical_config": hf and hf["id"],
             "predicted_step_s": mem and mem.get("predicted_step_s"),
             "measured_step_s": mem and mem.get("measured_step_s"),
             "time_to_first_step_s": mem and mem.get("time_to_first_step_s"),
             "hand_configs_measured": len([r for r in rs if r["kind"] == "hand"])}
        c["vs_best_hand"] = m_tp / c["best_hand_throughput"] if m_tp and best else None
        c["vs_hf_typical"] = m_tp / c["hf_typical_throughput"] if m_tp and hf else None
        cases.append(c)

        def f(v: float | None, fmt: str = "{:.0f}") -> str:
            return "n/a" if v is None else fmt.format(v)

        lines.append(f"| {case} | `{c['memopt_plan'] or c['memopt_error']}` | {f(m_tp)} | "
                     f"{f(c['best_hand_throughput'])} ({c['best_hand_config']}) | {f(c['vs_best_hand'], '{:.2f}x')} | "
                     f"{f(c['hf_typical_throughput'])} ({c['hf_typical_config']}) | {f(c['vs_hf_typical'], '{:.2f}x')}"
                     f" | {f(c['predicted_step_s'], '{:.3f}')} / {f(c['measured_step_s'], '{:.3f}')} | "
                     f"{f(c['time_to_first_step_s'], '{:.1f}')} |")
    grid = ["", "| case | config | step s | throughput | peak reserved GiB | result |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "hand":
            grid.append(f"| {r['case']} | {r['id']} | {r.get('measured_step_s') or 0:.3f} | "
                        f"{r.get('throughput') or 0:.0f} | {r.get('peak_reserved_bytes', 0) / 2**30:.2f} | "
                        f"{'ok' if r.get('ok') else ('OOM' if r.get('oom') else r.get('error', '')[:60])} |")
    Path(args.out + ".json").write_text(json.dumps({"cases": cases, "rows": rows}, indent=1) + "\n")
    Path(args.out + ".md").write_text("\n".join(lines + grid) + "\n")
    print("\n".join(lines))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--cases", default="")
    r.add_argument("--steps", type=int, default=4)
    r.add_argument("--deadline-s", type=float, default=560.0)
    r.add_argument("--case-deadline-s", type=float, default=170.0, help="per hand-grid process")
    r.add_argument("--parts", default="memopt,expandable,default-alloc", help="which of a case's processes run")
    c = sub.add_parser("child")
    c.add_argument("case")
    c.add_argument("part", choices=("memopt", "expandable", "default-alloc"))
    c.add_argument("--out", required=True)
    c.add_argument("--steps", type=int, default=4)
    c.add_argument("--case-deadline-s", type=float, default=170.0)
    p = sub.add_parser("report")
    p.add_argument("jsonl", nargs="+", help="PATH, or PATH:CASE,CASE to take only those cases from it")
    p.add_argument("--out", required=True)
    sub.add_parser("list")
    args = ap.parse_args()
    if args.cmd == "run":
        return run(args)
    if args.cmd == "child":
        child(args)
        return 0
    if args.cmd == "report":
        return report(args)
    for case in CASES:
        print(case.id)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
