#!/usr/bin/env python
"""OOM recovery under a Hugging Face ``Trainer`` on a real GPU (issue: runtime guard; the Trainer recovers too).

    python scripts/guard_trainer_gpu.py plan --out benchmarks/guard/trainer/plans      # CPU: the Trainer's plan
    python scripts/guard_trainer_gpu.py run --plans benchmarks/guard/trainer/plans --out RUN --parts forward
    python scripts/guard_trainer_gpu.py run --plans benchmarks/guard/trainer/plans --out RUN --parts optimizer
    python scripts/guard_trainer_gpu.py run ... --parts optimizer --reference [--tag 2]
    python scripts/guard_trainer_gpu.py compare --out RUN faulty reference

forward:   ``memopt.wrap(trainer, plan=...)`` with a wrong plan: the plan memopt made on the CPU for Qwen2.5-0.5B
           at 40 GiB (global batch 8 x 2048) relabelled as a 24 GiB plan, so the hard cap (24 GiB minus the memory
           outside the allocator) is too small for it and the first step runs out of memory for real inside
           ``training_step``. Recovery frees the step, steps the plan down (no profile: a smaller micro-batch,
           then checkpointing) and retries the same batch; every step must finish with the step count intact.
optimizer: a real OOM inside the Trainer's optimizer step. AdamW's CUDA default (foreach) needs a temporary as
           large as a parameter group's states; from step 1 on, the memory left under the cap before the step is
           held down (``memopt.guard.faults.occupy``) to less than that but more than the one-tensor-at-a-time
           loop needs. The step is undone from its pre-step copy (``transaction="always"``), switched to the loop
           and re-run over the same gradients. A second run without the hold, switching to the loop at the same
           step, is the reference: the parameters must match.
Run the parts in separate processes: each one caps the allocator.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
GiB = 2**30
MODEL = "qwen25_0_5b"


def _dataset(n: int, seq: int, vocab: int = 32000) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(0)
    return [{"input_ids": (ids := torch.randint(3, vocab, (seq,), generator=g)), "labels": ids.clone()}
            for _ in range(n)]


def _trainer(out: Path, *, seq: int, per_device: int, steps: int, optim: str, device: str):
    import torch
    from transformers import Trainer, TrainingArguments

    from memopt.models import build_model

    torch.manual_seed(0)
    model = build_model(MODEL, device=device)
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=per_device,
                             gradient_accumulation_steps=1, max_steps=steps, learning_rate=1e-5,
                             lr_scheduler_type="constant", optim=optim, bf16=True, report_to=[], save_strategy="no",
                             logging_strategy="no", seed=0, data_seed=0, disable_tqdm=True,
                             use_cpu=device == "cpu", weight_decay=0.1)
    return Trainer(model=model, args=args, train_dataset=_dataset(per_device * steps, seq))


def plan_main(out: Path) -> None:
    """The plans of both parts, made on the CPU as a user's dry run would."""
    import memopt

    out.mkdir(parents=True, exist_ok=True)
    for name, budget, seq, optim in (("forward_40GiB", "40GiB", 2048, "adamw_torch_fused"),
                                     ("optimizer_24GiB", "24GiB", 512, "adamw_torch")):
        trainer = _trainer(out / "tmp", seq=seq, per_device=8, steps=4, optim=optim, device="cpu")
        wrapped = memopt.wrap(trainer, budget=budget, hardware="h200",
                              pins={"optimizer": "adamw_fused" if "fused" in optim else "adamw_foreach"})
        wrapped.memopt_plan.save(out / f"{name}.json")
        print(name, wrapped.memopt_plan.strategy.label(), f"{wrapped.memopt_plan.total_bytes / GiB:.2f} GiB")


def _params(model) -> dict:
    return {k: v.detach().float().cpu() for k, v in model.named_parameters()}


def forward_part(plans: Path, out: Path) -> dict:
    import torch

    import memopt

    data = json.loads((plans / "forward_40GiB.json").read_text())
    data["budget_bytes"] = 24 * GiB  # the wrong plan: says it fits 24 GiB
    wrong = out / "forward_24GiB_wrong.json"
    wrong.write_text(json.dumps(data))
    trainer = memopt.wrap(_trainer(out / "forward", seq=2048, per_device=8, steps=5, optim="adamw_torch_fused",
                                   device="cuda"), plan=str(wrong))
    t0 = time.perf_counter()
    trainer.train()
    report = trainer.memopt_recovery.report
    return {"steps_done": trainer.state.global_step, "train_s": time.perf_counter() - t0,
            "first_strategy": data["strategy_label"], "final_strategy": trainer.memopt_plan.strategy.label(),
            "failures": [f.to_dict() for f in report.failures], "replans": report.replans,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
            "cap_fraction": trainer.memopt_callback.cap_fraction}


def optimizer_part(plans: Path, out: Path, *, reference: bool, tag: str = "") -> dict:
    import torch
    from transformers import TrainerCallback

    import memopt
    from memopt.guard.faults import occupy

    plan = str(plans / "optimizer_24GiB.json")
    trainer = memopt.wrap(_trainer(out / "optimizer", seq=512, per_device=8, steps=4, optim="adamw_torch",
                                   device="cuda"), plan=plan, transaction="always")
    held: dict = {}

    class Hold(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if state.global_step != 1:
                return
            if reference:
                for g in trainer.optimizer.param_groups:
                    g["foreach"] = False
                return
            # what the two implementations need on top of parameters, gradients and states (fp32 here):
            # foreach, a temporary as large as the largest group's states (exp_avg_sq's square roots);
            # the loop, the largest parameter's square root and quotient
            groups = trainer.optimizer.param_groups
            foreach_need = max(sum(p.numel() for p in g["params"]) for g in groups) * 4
            loop_need = 2 * max(p.numel() for g in groups for p in g["params"]) * 4
            torch.cuda.empty_cache()
            # the loop's blocks come from fresh memory: the holes of partly used segments may be too small
            holes = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
            leave = loop_need + holes + 64 * 2**20
            if leave >= foreach_need:
                raise RuntimeError(f"cannot separate the implementations: leave {leave} >= foreach {foreach_need}")
            cap = int(torch.cuda.get_device_properties(0).total_memory * trainer.memopt_callback.cap_fraction)
            held.update(foreach_need_bytes=foreach_need, loop_need_bytes=loop_need, left_bytes=leave,
                        holes_bytes=holes)
            held["bytes"] = max(min(cap - torch.cuda.memory_reserved(), cap - torch.cuda.memory_allocated() - leave),
                                0)
            held["ctx"] = occupy(held["bytes"])
            held["ctx"].__enter__()

        def on_optimizer_step(self, args, state, control, **kwargs):
            if "ctx" in held:
                held.pop("ctx").__exit__(None, None, None)

    trainer.add_callback(Hold())
    trainer.train()
    report = trainer.memopt_recovery.report
    torch.save(_params(trainer.model), out / f"optimizer_params_{'reference' if reference else 'faulty'}{tag}.pt")
    groups = trainer.optimizer.param_groups
    return {"reference": reference, "steps_done": trainer.state.global_step, "held_bytes": held.get("bytes"),
            **{k: v for k, v in held.items() if k.endswith("_bytes")},
            "failures": [f.to_dict() for f in report.failures], "replans": report.replans,
            "foreach_after": [g.get("foreach") for g in groups],
            "snapshot_bytes": trainer.memopt_recovery.optimizer_step.transaction.snapshot_bytes,
            "plan_optimizer_after": trainer.memopt_plan.strategy.optimizer,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated()}


def compare_params(out: Path, first: str, second: str) -> dict:
    import torch

    a = torch.load(out / f"optimizer_params_{first}.pt")
    b = torch.load(out / f"optimizer_params_{second}.pt")
    diffs = {k: float((a[k] - b[k]).abs().max()) for k in a}
    return {"runs": [first, second], "max_abs_diff": max(diffs.values()),
            "equal_tensors": sum(torch.equal(a[k], b[k]) for k in a), "tensors": len(a)}


def main() -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("--plans", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--parts", default="forward")
    r.add_argument("--reference", action="store_true", help="optimizer part: the run without the hold")
    r.add_argument("--tag", default="", help="optimizer part: a suffix for the saved parameters' file")
    c = sub.add_parser("compare")
    c.add_argument("--out", required=True)
    c.add_argument("runs", nargs=2, help="two saved runs, e.g. faulty reference (reference2 for run-to-run noise)")
    args = parser.parse_args()
    if args.cmd == "plan":
        plan_main(Path(args.out))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.cmd == "compare":
        result = compare_params(out, *args.runs)
        (out / f"optimizer_compare_{'_'.join(args.runs)}.json").write_text(json.dumps(result, indent=1))
        print(result)
        return 0
    from memopt.plan.schema import Plan
    from memopt.step.hard_cap import set_expandable_segments

    # both plans chose expandable segments: set before CUDA starts (the Trainer moves the model at its init)
    set_expandable_segments(Plan.load(Path(args.plans) / "forward_40GiB.json").strategy.expandable_segments)
    for part in args.parts.split(","):
        try:
            if part == "forward":
                result = forward_part(Path(args.plans), out)
            else:
                result = optimizer_part(Path(args.plans), out, reference=args.reference, tag=args.tag)
        except Exception as exc:
            import traceback

            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        name = part + ("_reference" if args.reference and part == "optimizer" else "") + args.tag
        (out / f"trainer_{name}.json").write_text(json.dumps(result, indent=1, default=str))
        print(name, json.dumps(result, default=str)[:2000], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

