"""``python -m memopt.train``: a recipe end to end — build the model from its config, generate data, plan,
wrap, train with a progress bar that shows memory, save a checkpoint.

    python -m memopt.train --model tiny_llama --budget 4GB --steps 20 --batch-size 8 --seq-len 64
    python -m memopt.train --model llama32_1b --budget 40GB --steps 100 --batch-size 8 --seq-len 2048

Data: random token sequences (or images) from a seeded generator, the same every run, so a resumed run
continues at the same sample (``--resume`` takes the checkpoint's step and data position). Runs on a CPU
too (plan for a named GPU with ``--hardware``; the budget is then not enforced).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import memopt
from memopt.models import SampleSpec, build_model, load_model_spec, make_batch
from memopt.units import format_bytes

__all__ = ["main", "train"]


def _batches(spec: Any, sample: Any, seed: int, start: int):
    import torch

    step = start
    while True:
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        yield step, make_batch(spec, sample, generator=g)
        step += 1


def train(model_name: str, *, budget: str, steps: int, batch_size: int, seq_len: int | None, image_size: int | None,
          hardware: str, run_dir: Path, lr: float, seed: int, resume: bool, fidelity: str,
          plan_path: str | None) -> dict[str, Any]:
    import torch
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    spec = load_model_spec(model_name)
    shapes: dict[str, Any] = {"batch_size": batch_size}
    if seq_len is not None:
        shapes["seq_len"] = seq_len
    if image_size is not None:
        shapes["image_size"] = image_size
    sample = SampleSpec.parse(shapes, spec)
    torch.manual_seed(seed)
    model = build_model(spec, device="cpu")
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt = run_dir / "checkpoint.pt"
    wrapped = memopt.wrap(model, budget=budget if plan_path is None else None, plan=plan_path,
                          sample=sample.to_dict(), hardware=hardware, fidelity=fidelity, lr=lr,
                          run_dir=run_dir)  # telemetry and one step by module, for python -m memopt.report
    wrapped.plan.save(run_dir / "plan.json")
    start = 0
    if resume and ckpt.exists():
        wrapped.load_state_dict(torch.load(ckpt, weights_only=False))
        start = wrapped.steps_done
    cuda = torch.cuda.is_available()
    log = (run_dir / "train_log.jsonl").open("a")
    losses = []
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.fields[info]}"), TimeRemainingColumn()) as bar:
        task = bar.add_task("training", total=steps, completed=start, info="")
        for step, batch in _batches(spec, sample, seed, start):
            if step >= steps:
                break
            t = time.perf_counter()
            loss = wrapped.step(batch)
            dt = time.perf_counter() - t
            losses.append(loss)
            record = {"step": step + 1, "loss": loss, "step_s": dt}
            if cuda:
                record.update({"allocated_bytes": torch.cuda.memory_allocated(),
                               "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                               "peak_reserved_bytes": torch.cuda.max_memory_reserved()})
                mem = (f"mem {format_bytes(record['peak_reserved_bytes'])} of {format_bytes(wrapped.plan.budget_bytes)}"
                       f" (planned {format_bytes(wrapped.plan.peak_reserved_bytes)})")
            else:
                mem = f"planned {format_bytes(wrapped.plan.total_bytes)} of {format_bytes(wrapped.plan.budget_bytes)}"
            log.write(json.dumps(record) + "\n")
            bar.update(task, completed=step + 1, info=f"loss {loss:.4f} | {mem}")
    log.close()
    wrapped.close()  # flush the guard's telemetry, which `python -m memopt.report RUN_DIR` renders
    wrapped.save(ckpt)
    return {"plan": wrapped.plan.strategy.label(), "steps_done": wrapped.steps_done, "losses": losses,
            "checkpoint": str(ckpt)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memopt.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny_llama", help="a shipped model config (configs/model/)")
    parser.add_argument("--budget", default="4GB")
    parser.add_argument("--plan", default=None, help="a saved plan to apply instead of planning")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--image-size", type=int, default=None)
    parser.add_argument("--hardware", default="auto", help="'auto' (the local GPU) or a configs/hardware name")
    parser.add_argument("--fidelity", default="default")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", default="runs/train")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    if args.steps < 1:
        print(f"error: --steps must be a positive integer, got {args.steps} (e.g. --steps 20)", file=sys.stderr)
        return 2
    try:
        import torch

        hardware = args.hardware
        if hardware == "auto" and not torch.cuda.is_available():
            hardware = "h100_80gb"
            print("no GPU here: planning for h100_80gb and training on the CPU (the budget is not enforced)")
        seq_len = args.seq_len
        if seq_len is None and args.image_size is None:
            spec = load_model_spec(args.model)
            seq_len = None if not spec.is_token_model else 64
        result = train(args.model, budget=args.budget, steps=args.steps, batch_size=args.batch_size, seq_len=seq_len,
                       image_size=args.image_size, hardware=hardware, run_dir=Path(args.run_dir), lr=args.lr,
                       seed=args.seed, resume=args.resume, fidelity=args.fidelity, plan_path=args.plan)
    except (ValueError, OSError) as exc:  # bad input, or a run directory that cannot be written
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in result.items() if k != "losses"}, indent=1))
    print(f"loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}" if result["losses"] else "no steps to run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
