#!/usr/bin/env python
"""The runtime guard on a real GPU, through ``memopt.wrap`` (issue: runtime guard and observability).

    python scripts/guard_gpu_demo.py --out RUN        # on the GPU; then, anywhere:
    python -m memopt.report RUN/oom                    # timelines and the post-mortem of the OOM

oom:  a wrong plan -- the CPU-made plan for qwen25_0_5b at 40 GiB (34 GiB allocated peak) relabelled as a
      24 GiB plan -- is applied unchanged, so the hard cap (24 GiB minus the memory outside the allocator)
      makes the first step run out of memory for real. The guard frees the step, dumps a snapshot, re-plans
      from the measured figures and retries the same batch; five steps must finish with the step count intact.
leak: gpt2_medium trained with its 12 GiB plan while each step also runs an "evaluation" forward pass (of
      --leak-eval-batch samples) without ``torch.no_grad()`` whose loss is kept in a list: the guard must flag
      the leak within 5 steps. (With 4 samples the leak is 1.2 GiB a step and fills the budget in 4 steps,
      before the 5-step window: benchmarks/guard/first_try.)
Each part writes telemetry.jsonl and events.jsonl under RUN/<part> and a summary to RUN/summary_<part>.json.
Run the parts in separate processes (``--parts oom``, then ``--parts leak``): memory a part leaves behind
would otherwise count against the next one's cap.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
GiB = 2**30


def _events(run: Path) -> list[dict]:
    path = run / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def oom_part(out: Path) -> dict:
    import torch

    import memopt
    from memopt.models import SampleSpec, build_model, make_batch

    source = ROOT / "benchmarks" / "wrap" / "plans" / "qwen25_0_5b_40GiB.json"
    data = json.loads(source.read_text())
    data["budget_bytes"] = 24 * GiB  # the wrong plan: says it fits 24 GiB, needs ~35 GiB
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(data, f)
    run = out / "oom"
    torch.manual_seed(0)
    model = build_model("qwen25_0_5b", device="cuda")
    batch = make_batch("qwen25_0_5b", SampleSpec.parse({"batch_size": 8, "seq_len": 2048}, "qwen25_0_5b"))
    wrapped = memopt.wrap(model, plan=f.name, lr=1e-5, run_dir=run)
    losses, times = [], []
    for _ in range(5):
        t = time.perf_counter()
        losses.append(wrapped.step(batch))
        times.append(time.perf_counter() - t)
    wrapped.close()
    events = _events(run)
    return {"steps_done": wrapped.steps_done, "losses": losses, "step_times_s": times,
            "first_strategy": data["strategy_label"], "final_strategy": wrapped.guard.plan.strategy.label(),
            "ooms": sum(e["kind"] == "oom" for e in events), "replans": sum(e["kind"] == "replan" for e in events),
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(), "events": events}


def leak_part(out: Path, eval_batch: int = 1, steps: int = 6) -> dict:
    import torch

    import memopt
    from memopt.models import SampleSpec, build_model, make_batch

    run = out / "leak"
    torch.manual_seed(0)
    model = build_model("gpt2_medium", device="cuda")
    sample = SampleSpec.parse({"batch_size": 16, "seq_len": 1024}, "gpt2_medium")
    wrapped = memopt.wrap(model, plan=str(ROOT / "benchmarks" / "wrap" / "plans" / "gpt2_medium_12GiB.json"),
                          lr=1e-5, run_dir=run)
    kept, flagged_at = [], None
    for k in range(steps):
        batch = make_batch("gpt2_medium", sample, generator=torch.Generator().manual_seed(k))
        wrapped.step(batch)
        ev = {key: v[:eval_batch].cuda() for key, v in batch.items()}
        kept.append(wrapped.model(**ev).loss)  # the classic leak: evaluation without torch.no_grad()
        report = getattr(getattr(wrapped.guard.telemetry, "leaks", None), "report", None)
        if flagged_at is None and report is not None:
            flagged_at = k + 1
    wrapped.close()
    events = _events(run)
    leak_events = [e for e in events if "leak" in e["kind"]]
    return {"steps": steps, "eval_batch": eval_batch, "flagged_after_steps": flagged_at, "leak_events": leak_events,
            "kept_losses": len(kept)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--parts", default="oom,leak")
    parser.add_argument("--leak-eval-batch", type=int, default=1)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {}
    parts = (("oom", oom_part), ("leak", lambda o: leak_part(o, eval_batch=args.leak_eval_batch)))
    for part, fn in parts:
        if part not in args.parts.split(","):
            continue
        try:
            summary[part] = fn(out)
        except Exception as exc:  # report and go on with the next part
            import traceback

            summary[part] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        print(part, json.dumps({k: v for k, v in summary[part].items() if k not in ("events", "traceback")},
                               default=str)[:1500], flush=True)
        if "traceback" in summary[part]:
            print(summary[part]["traceback"])
        import torch

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    (out / f"summary_{'_'.join(summary)}.json").write_text(json.dumps(summary, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
