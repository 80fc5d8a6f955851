#!/usr/bin/env python
"""An 8B-class model loaded from a safetensors checkpoint and fine-tuned under the hard cap (issue 6), on the GPU.

The plans are made on the CPU by the planner (``python -m memopt.plan ... save_plan=...``, see
benchmarks/quant/README.md); here each is applied unchanged by ``memopt.wrap(spec, checkpoint=..., plan=...)``:
the allocator is capped at the budget minus what the process holds outside it, then the weights load straight
onto the GPU (quantized as they load for QLoRA), then 5 optimizer steps. One fresh process per plan.

    python scripts/qlora_from_checkpoint_gpu.py make-checkpoint --spec llama3_8b --dir /tmp/ckpt
    python scripts/qlora_from_checkpoint_gpu.py run --plan benchmarks/quant/plans/llama3_8b_qlora_12gib.json \\
        --dir /tmp/ckpt --out OUT/qlora_12gib.json

The checkpoint holds random weights (nothing can be downloaded): N(0, 0.02) for matrices, ones for norms, in
bf16, as sharded safetensors files of about 2 GB (what Hugging Face writes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs only check the script (tiny models)


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def make_checkpoint(spec: str, out_dir: Path, shard_bytes: int = 2 * 10**9) -> list[Path]:
    from safetensors.torch import save_file

    from memopt.techniques.quantized_load import model_skeleton

    out_dir.mkdir(parents=True, exist_ok=True)
    skeleton = model_skeleton(spec)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    size, paths = 0, []

    def flush() -> None:
        nonlocal shard, size
        if shard:
            path = out_dir / f"model-{len(paths):05d}.safetensors"
            save_file(shard, str(path))
            paths.append(path)
            shard, size = {}, 0

    for name, p in skeleton.named_parameters():
        if p.dim() == 1:
            t = torch.ones(p.shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(p.shape, device=DEVICE, dtype=torch.bfloat16, generator=gen) * 0.02).cpu()
        shard[name] = t
        size += t.numel() * 2
        if size >= shard_bytes:
            flush()
    flush()
    return paths


def run(plan_path: Path, ckpt_dir: Path, steps: int, cap: bool = True) -> dict:
    import memopt
    from memopt.models import SampleSpec, make_batch
    from memopt.plan import Plan
    from memopt.step.hard_cap import outside_allocator_bytes
    from memopt.techniques.precision import weight_dtype
    from memopt.techniques.quantized_load import load_peak_bytes, model_skeleton

    plan = Plan.load(plan_path)
    spec = plan.model["name"]
    shards = sorted(ckpt_dir.glob("*.safetensors"))
    q = plan.strategy.extra("quantization")
    predicted_load = load_peak_bytes(model_skeleton(spec), q, dtype=weight_dtype(plan.strategy.precision))
    t0 = time.perf_counter()
    row: dict = {"plan": plan_path.name, "model": spec, "strategy": plan.strategy.label(),
                 "budget_bytes": plan.budget_bytes, "plan_fits": plan.fits,
                 "predicted_load_peak_allocated_bytes": predicted_load,
                 "predicted_peak_allocated_bytes": plan.peak_allocated_bytes,
                 "predicted_peak_reserved_bytes": plan.peak_reserved_bytes,
                 "predicted_total_bytes": plan.total_bytes, "predicted_step_s": plan.step_time_s}
    try:
        w = memopt.wrap(spec, checkpoint=shards, plan=plan, lr=1e-4, enforce_budget=cap)
        row["capped"] = cap
        row["load_s"] = time.perf_counter() - t0
        row["measured_load_peak_allocated_bytes"] = w.load_peak_allocated_bytes
        row["cap_fraction"] = getattr(w, "cap_fraction", None)
        sample = SampleSpec.parse(plan.model["sample"], spec)
        gen = torch.Generator(device=DEVICE).manual_seed(0)
        batches = [make_batch(spec, sample, device=DEVICE, generator=gen) for _ in range(2)]
        times, losses = [], []
        for i in range(steps):
            _sync()
            t = time.perf_counter()
            losses.append(w.step(batches[i % 2]))
            _sync()
            times.append(time.perf_counter() - t)
        row["fits_under_cap"] = True
        row["losses"] = losses
        row["measured_step_s"] = statistics.median(times[1:]) if len(times) > 1 else times[0]
        row["first_step_s"] = times[0]
        row["tokens_per_s"] = plan.global_batch * int(plan.model["sample"]["seq_len"]) / row["measured_step_s"]
        row["trainable_params"] = sum(p.numel() for p in w.model.parameters() if p.requires_grad)
        # what trained: the guard recovers from an OOM by re-planning, so "strategy" (the plan as loaded) is not
        # always what ran (session 5's unchunked diagnostic rows stepped down to 2 x 4 unrecorded)
        row["final_strategy"] = w.plan.strategy.label()
        if w.guard is not None:
            events = w.guard.telemetry.events
            row["ooms"] = [{k: e.get(k) for k in ("phase", "strategy")} for e in events if e["kind"] == "oom"]
            row["replans"] = [e.get("strategy") for e in events if e["kind"] == "replan"]
        w.close()
    except torch.OutOfMemoryError as exc:
        row["fits_under_cap"] = False
        row["error"] = str(exc)[:500]
    if DEVICE != "cuda":
        return row
    row["measured_peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    row["measured_peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
    # cudaMalloc retries (the allocator freed its cache and tried again): each costs a device sync
    row["num_alloc_retries"] = int(torch.cuda.memory_stats().get("num_alloc_retries", 0))
    row["outside_allocator_bytes"] = outside_allocator_bytes()
    row["measured_total_bytes"] = row["measured_peak_reserved_bytes"] + row["outside_allocator_bytes"]
    free, total = torch.cuda.mem_get_info()
    row["device_used_at_end_bytes"] = total - free
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["make-checkpoint", "run"])
    ap.add_argument("--spec", default="llama3_8b")
    ap.add_argument("--dir", type=Path, required=True, help="where the checkpoint shards are (or go)")
    ap.add_argument("--plan", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-cap", action="store_true", help="do not cap the allocator (time without memory pressure)")
    args = ap.parse_args()
    if args.what == "make-checkpoint":
        t = time.perf_counter()
        paths = make_checkpoint(args.spec, args.dir)
        print(f"{len(paths)} shards in {time.perf_counter() - t:.1f} s")
        return
    row = run(args.plan, args.dir, args.steps, cap=not args.no_cap)
    print(json.dumps(row, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
