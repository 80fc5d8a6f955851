#!/usr/bin/env python
"""Foreign memory on a real GPU (issue 21): another allocation appears in the process at a random step of a
``memopt.wrap`` run under the hard cap; the guard must measure it, re-plan for what is left of the budget and
continue with no step lost, or, when nothing fits in what is left, stop with a message naming it.

    python scripts/guard_foreign_memory_gpu.py --out benchmarks/guard/foreign_memory_h200.json

For each --foreign size (GiB, or "fill": all the cap leaves but 256 MiB), one run: the model (a shipped spec,
--layers blocks, random weights) is wrapped
at --budget with the planner's choice (autotune off, so the first plan is the planner's), trained --steps steps on
fixed batches, and a tensor of that size is allocated (and kept) before step K (seeded random, >= 1; clamped
to what the cap still has room for, so that the allocation itself succeeds). Then a
reference run from the same seed with no foreign memory switches to the final plan at step K
(``reprepare``, as the guard does); the JSON gives, per run: recovered or the stop message, the events (oom,
foreign_memory, replan), the measured foreign bytes against the allocated size, the plans before and after,
the peak allocated/reserved, and the largest parameter difference against the reference (CUDA kernels are
not bitwise deterministic across micro-batch sizes: expect float noise, not a divergence).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
GiB = 2**30


def _events(run: Path) -> list[dict]:
    path = run / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _batches(model_name: str, sample: dict, steps: int, overrides: dict) -> list:
    import torch

    from memopt.models import SampleSpec, make_batch, with_overrides

    spec = with_overrides(model_name, overrides)
    gen = torch.Generator(device="cpu").manual_seed(1234)
    return [{k: v.to("cuda") for k, v in make_batch(spec, SampleSpec.parse(sample, spec), generator=gen).items()}
            for _ in range(steps)]


def _foreign_bytes(wrapped, foreign: str) -> tuple[int, int]:
    """(bytes to allocate, room under the cap now): ``foreign`` in GiB, or "fill" for all the cap has left but
    256 MiB (so that the allocation itself succeeds and no plan fits in what remains); a size beyond the room is
    clamped to it likewise."""
    import torch

    torch.cuda.empty_cache()  # the cap applies to reserved memory: hand cached blocks back first
    total = torch.cuda.mem_get_info()[1]
    cap = int(getattr(wrapped, "cap_fraction", 1.0) * total)
    room = cap - torch.cuda.memory_reserved()
    want = room - (256 << 20) if foreign == "fill" else int(float(foreign) * GiB)
    return max(min(want, room - (256 << 20)), 0), room


def one_run(args: argparse.Namespace, foreign: str, run_dir: Path, seed: int) -> dict:
    import torch

    import memopt
    from memopt.guard.reapply import reprepare
    from memopt.models import build_model, with_overrides

    overrides = {"num_hidden_layers": args.layers}
    spec = with_overrides(args.model, overrides)
    sample = {"batch_size": args.batch, "seq_len": args.seq}
    at_step = random.Random(seed).randrange(1, args.steps)
    batches = _batches(args.model, sample, args.steps, overrides)
    torch.manual_seed(0)
    model = build_model(spec, device="cuda")
    wrapped = memopt.wrap(model, budget=args.budget, sample=sample, lr=1e-5, run_dir=run_dir, autotune=False)
    first = wrapped.plan
    kwargs = wrapped._prepare_kwargs()
    torch.cuda.reset_peak_memory_stats()
    hog = None
    size, room = 0, 0
    losses, stopped, t0 = [], None, time.perf_counter()
    try:
        for i, batch in enumerate(batches):
            if i == at_step:
                size, room = _foreign_bytes(wrapped, foreign)
                hog = torch.empty(size, dtype=torch.uint8, device="cuda")
            losses.append(wrapped.step(batch))
    except memopt.MemoptOOMError as exc:
        stopped = str(exc).splitlines()[0]
    seconds = time.perf_counter() - t0
    final = wrapped.plan
    peak = {"peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved()}
    events = _events(run_dir)
    foreign_events = [e for e in events if e.get("kind") == "foreign_memory"]
    result = {
        "foreign_requested": foreign, "foreign_allocated_bytes": size, "room_under_cap_bytes": room,
        "at_step": at_step, "steps_done": len(losses),
        "recovered": stopped is None and len(losses) == args.steps, "stopped": stopped, "seconds": seconds,
        "first_plan": first.strategy.label(), "first_predicted_total_bytes": first.total_bytes,
        "final_plan": final.strategy.label(), "final_predicted_total_bytes": final.total_bytes,
        "foreign_measured_bytes": foreign_events[0].get("total_bytes") if foreign_events else None,
        "events": [{k: e.get(k) for k in ("kind", "step", "phase", "needed_bytes", "total_bytes", "from", "to",
                                         "predicted_total_bytes")} for e in events
                   if e.get("kind") in ("oom", "foreign_memory", "replan", "stopped")],
        "final_notes": [n for n in final.notes if "foreign" in n or "re-planned" in n], **peak,
    }
    trained = [p.detach().float().cpu() for p in wrapped.model.parameters()]
    wrapped.close()
    wrapped.unwrap()
    del wrapped, model, hog
    gc.collect()
    torch.cuda.empty_cache()
    if result["recovered"]:  # the reference: no foreign memory, no cap, switches plans at the same step
        from memopt.step.prepare import prepare  # the process keeps wrap's cap: the final plan fits under it

        torch.manual_seed(0)
        ref_model = build_model(spec, device="cuda")
        prepared = prepare(ref_model, first.strategy, **{**kwargs, "device": torch.device("cuda")})
        for i, batch in enumerate(batches):
            if i == at_step and final.strategy != first.strategy:
                prepared = reprepare(prepared, final.strategy, **kwargs)
            prepared.step.step(batch)
        diffs = [float((a - b.detach().float().cpu()).abs().max()) for a, b in zip(trained, ref_model.parameters())]
        result["max_param_diff_vs_reference"] = max(diffs)
        prepared.undo()
        del ref_model, prepared
        gc.collect()
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama32_1b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--budget", default="24GiB")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--foreign", nargs="+", default=["4", "8", "fill"],
                        help="GiB allocated outside the plan, one run each; 'fill': all the cap has left but 256 MiB "
                             "(no plan fits: the run must stop naming it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "guard" / "foreign_memory_h200.json"))
    parser.add_argument("--run-dir", default="/tmp/memopt_foreign")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    out = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "model": args.model, "layers": args.layers, "budget": args.budget,
           "sample": {"batch_size": args.batch, "seq_len": args.seq}, "steps": args.steps, "runs": []}
    for i, foreign in enumerate(args.foreign):
        run = one_run(args, foreign, Path(args.run_dir) / f"foreign_{foreign}", args.seed + i)
        out["runs"].append(run)
        print(json.dumps({k: run[k] for k in ("foreign_allocated_bytes", "foreign_measured_bytes", "at_step",
                                              "recovered", "stopped", "first_plan", "final_plan")}), flush=True)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, default=str))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
