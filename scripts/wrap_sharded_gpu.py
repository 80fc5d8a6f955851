#!/usr/bin/env python3
"""A sharded / offloaded plan made on the CPU, applied by ``memopt.wrap`` on the GPU under the hard cap.

CPU (the dry run; one GPU that cannot hold the model states, so the planner offloads):

    python scripts/wrap_sharded_gpu.py plan --model llama32_3b --budget 16GiB --batch 8 --seq-len 2048 \
        --host-memory 128GiB --out benchmarks/sharding/plans/llama32_3b_16GiB_offload.json

GPU (each process of the job; ``torchrun --nproc-per-node N`` for a plan over N GPUs):

    torchrun --nproc-per-node 1 scripts/wrap_sharded_gpu.py run --plan PLAN.json --out $OUT/wrap_sharded --steps 3

``run`` caps the allocator at the budget minus the memory outside it (DEVELOPERS.md's hard cap), builds the model,
calls ``memopt.wrap(model, plan=PLAN)``, trains ``--steps`` steps on the global batch and writes, per rank, the
measured peaks and step times next to the plan's predictions.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from allocation_history import live_at_peak  # noqa: E402


def make(args: argparse.Namespace) -> int:
    import memopt
    from memopt.plan.context import resolve_hardware, resolve_policy
    from memopt.plan.sharded import plan_sharded, sharding_settings
    from memopt.units import parse_budget, parse_bytes

    every = list(sharding_settings(args.world_size, 1))
    settings = [s for s in every if args.setting in s.label()]
    if not settings:  # before profiling: the error comes at once
        raise SystemExit(f"no sharding setting's label contains {args.setting!r}; at world size {args.world_size} "
                         f"they are: {', '.join(s.label() for s in every)}")
    hw = resolve_hardware(args.hardware)
    prof = memopt.profile(args.model, sample={"batch_size": args.batch, "seq_len": args.seq_len}, hardware=hw)
    plan, _ = plan_sharded(prof, hw, parse_budget(args.budget, device_total_bytes=hw.memory_bytes),
                           resolve_policy(None), world_size=args.world_size, nodes=1,
                           host_memory_bytes=parse_bytes(args.host_memory), settings=settings)
    plan.save(args.out)
    print(json.dumps({"fits": plan.fits, "strategy": plan.strategy.label(), "total_bytes": plan.total_bytes,
                      "step_time_s": plan.prediction.get("step_time_s")}))
    return 0 if plan.fits else 3


def run(args: argparse.Namespace) -> int:
    from harness.measure import set_allocator_env
    from memopt.plan.schema import Plan

    plan = Plan.load(args.plan)
    set_allocator_env(plan.strategy.expandable_segments)  # before CUDA initializes
    import torch

    import memopt
    from harness.measure_sharded import timed_steps
    from memopt.hardware import load_hardware
    from memopt.models import SampleSpec, build_model, make_batch

    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or plan.strategy.extra("sharding")["engine"] == "fsdp2":
        import torch.distributed as dist

        dist.init_process_group("nccl")
    total = torch.cuda.get_device_properties(local).total_memory
    outside = load_hardware(plan.hardware).runtime_overhead_bytes
    torch.cuda.set_per_process_memory_fraction(max(0.01, (plan.budget_bytes - outside) / total), local)
    if args.ds_zero:  # an experiment: DeepSpeed zero_optimization keys over what memopt generates
        from memopt.distributed import deepspeed_engine

        extra = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.ds_zero)}
        base_config = deepspeed_engine.deepspeed_config

        def patched(*a: object, **kw: object) -> dict:
            cfg = base_config(*a, **kw)
            cfg["zero_optimization"].update(extra)
            return cfg

        deepspeed_engine.deepspeed_config = patched
    model_name = plan.model["name"]
    model = build_model(model_name, device="cpu")
    model.config.use_cache = False
    if args.history:
        # no stacks: recording Python frames crashed DeepSpeed ZeRO-3's recompute on torch 2.11
        # (SystemError: FunctionMeta.apply returned NULL; raw/session8_call4); sizes and streams suffice here
        torch.cuda.memory._record_memory_history(max_entries=4_000_000, context=None)
    t0 = time.perf_counter()
    wrapped = memopt.wrap(model, plan=plan, lr=1e-5, weight_decay=0.0)
    build_s = time.perf_counter() - t0
    spec = SampleSpec.parse(plan.model["sample"], model_name)
    batch = make_batch(model_name, spec, device="cpu", generator=torch.Generator().manual_seed(0))
    torch.cuda.reset_peak_memory_stats()
    losses, times = timed_steps(wrapped.step, batch, args.steps)
    alloc, res = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    from harness.measure_sharded import pools_by_stream
    from memopt.step.hard_cap import process_device_bytes

    own = process_device_bytes(local)
    free, _ = torch.cuda.mem_get_info(local)
    outside_measured = (own if own is not None else total - free) - torch.cuda.memory_reserved(local)
    step_s = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
    row = {"plan": plan.strategy.label(), "rank": rank, "ds_zero_overrides": args.ds_zero,
           "losses": losses, "step_times_s": times, "build_s": build_s,
           "measured_peak_allocated_bytes": alloc, "measured_peak_reserved_bytes": res,
           "predicted_peak_allocated_bytes": plan.peak_allocated_bytes,
           "predicted_peak_reserved_bytes": plan.peak_reserved_bytes, "predicted_step_s": plan.step_time_s,
           "measured_step_s": step_s, "tokens_per_s": batch["input_ids"].numel() / step_s,
           "cap_bytes": plan.budget_bytes - outside,
           "wrap_cap_bytes": int(wrapped.cap_fraction * total) if getattr(wrapped, "cap_fraction", None) else None,
           "fits_under_cap": res <= plan.budget_bytes - outside,
           "num_alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0),
           "measured_outside_allocator_bytes": outside_measured,
           "predicted_runtime_bytes": plan.prediction.get("runtime_bytes"),
           "measured_total_bytes": res + outside_measured, "budget_bytes": plan.budget_bytes,
           "predicted_tokens_per_s": plan.prediction.get("tokens_per_s"),
           **pools_by_stream(torch, local)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.history:
        snap = torch.cuda.memory._snapshot()
        row["live_at_peak"] = live_at_peak(snap, local)
        row["stream_peaks"] = stream_peaks(snap, local, torch.cuda.default_stream(local).cuda_stream)
        torch.cuda.memory._record_memory_history(enabled=None)
    (out / f"rank{rank}.json").write_text(json.dumps(row, indent=2) + "\n")
    print(json.dumps({k: v for k, v in row.items() if k != "losses"}))
    return 0


def stream_peaks(snapshot: dict, device: int, default_stream: int, top: int = 16) -> list[dict]:
    """Per CUDA stream, from the allocator's recorded history: its allocated peak, when it came (event index, and
    the other streams' allocated bytes then) and the sizes live in that stream's pool at its peak (largest first,
    ``top`` of them), plus the bytes its pool mapped at most (expandable segments' ``segment_map``)."""
    events = snapshot["device_traces"][device]
    cur: dict[int, int] = {}
    mapped: dict[int, int] = {}
    best: dict[int, tuple[int, int, int]] = {}  # stream -> (peak, event index, all streams' allocated then)
    mapped_peak: dict[int, int] = {}
    for i, e in enumerate(events):
        st, a = int(e.get("stream", 0)), e["action"]
        if a == "alloc":
            cur[st] = cur.get(st, 0) + e["size"]
            if cur[st] > best.get(st, (-1,))[0]:
                best[st] = (cur[st], i, sum(cur.values()))
        elif a == "free_completed":
            cur[st] = cur.get(st, 0) - e["size"]
        elif a in ("segment_map", "segment_alloc"):
            mapped[st] = mapped.get(st, 0) + e["size"]
            mapped_peak[st] = max(mapped_peak.get(st, 0), mapped[st])
        elif a in ("segment_unmap", "segment_free"):
            mapped[st] = mapped.get(st, 0) - e["size"]
    out = []
    for st, (peak, at, everything) in sorted(best.items(), key=lambda kv: (kv[0] != default_stream, -kv[1][0])):
        live: dict[int, int] = {}
        for e in events[: at + 1]:
            if int(e.get("stream", 0)) != st:
                continue
            if e["action"] == "alloc":
                live[e["addr"]] = e["size"]
            elif e["action"] == "free_completed":
                live.pop(e["addr"], None)
        sizes = sorted(live.values(), reverse=True)
        out.append({"stream": "default" if st == default_stream else str(st), "peak_allocated_bytes": peak,
                    "at_event": at, "all_streams_allocated_then": everything,
                    "mapped_peak_bytes": mapped_peak.get(st, 0),
                    "live_sizes": sizes[:top], "live_count": len(sizes), "events": len(events)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="make the plan on the CPU")
    p.add_argument("--model", default="llama32_3b")
    p.add_argument("--budget", default="16GiB")
    p.add_argument("--hardware", default="h200")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--host-memory", default="128GiB")
    p.add_argument("--setting", default="", help="only the sharding settings whose label contains this "
                   "(e.g. 'zero3 x1 offload(opt=cpu,params=cpu)')")
    p.add_argument("--out", required=True)
    r = sub.add_parser("run", help="apply it with memopt.wrap on the GPU")
    r.add_argument("--plan", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--steps", type=int, default=3)
    r.add_argument("--history", action="store_true",
                   help="record the allocator's history and report what is live at the allocated peak")
    r.add_argument("--ds-zero", action="append", default=[], metavar="KEY=JSON",
                   help="an experiment: override this DeepSpeed zero_optimization key "
                   "(e.g. stage3_max_reuse_distance=0)")
    args = ap.parse_args(argv)
    return make(args) if args.cmd == "plan" else run(args)


if __name__ == "__main__":
    raise SystemExit(main())
