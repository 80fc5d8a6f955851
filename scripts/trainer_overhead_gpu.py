#!/usr/bin/env python
"""Issue 20's "no overhead of its own" through a Hugging Face ``Trainer``: the same configuration written by hand
against ``memopt.wrap(trainer)`` applying it, step time per optimizer step, one fresh process per run, the runs
interleaved over rounds.

    python scripts/trainer_overhead_gpu.py --out OUT/trainer_overhead.json             # a GPU
    python scripts/trainer_overhead_gpu.py --size tiny --steps 6 --out /tmp/tro.json    # the CPU (a smoke run)
    add --rows variable: rows of uneven length, padded by the collator (the Trainer-path padding cut per micro-batch)

Runs (each its own process, so the allocator settings and the cap are the process's own):
  hand            per_device_train_batch_size=1 x gradient_accumulation_steps=G, the Trainer's own gradient
                  checkpointing (non-reentrant), bf16, fused AdamW: what a user writes
  memopt          ``memopt.wrap(trainer, budget, pins=<that configuration>)``, recovery on (the default): the
                  Trainer gets the global batch and memopt's training_step splits it
  memopt_norecover  the same with ``guard=False`` (no recovery): the Trainer's own gradient accumulation
``--old PATH`` adds ``memopt_old`` (the default run with another checkout of memopt on PYTHONPATH) to compare commits
in the same session. The model is a Llama built from a config (random weights); the data are random token rows.
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

ROOT = Path(__file__).resolve().parent.parent

SIZES = {
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 4, "vocab_size": 1000, "seq": 64, "global": 8},
    "real": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16, "num_attention_heads": 32,
             "num_key_value_heads": 8, "vocab_size": 32000, "seq": 2048, "global": 16},
}


def _pad_right(rows: list[dict]) -> dict:
    """A collator padding a list of rows to its longest on the right (ids 0, mask 0, labels -100), as
    ``DataCollatorForSeq2Seq`` does, without a tokenizer."""
    import torch

    width = max(len(r["input_ids"]) for r in rows)

    def padded(key: str, fill: int) -> torch.Tensor:
        return torch.stack([torch.cat([r[key], r[key].new_full((width - len(r[key]),), fill)]) for r in rows])

    return {"input_ids": padded("input_ids", 0), "attention_mask": padded("attention_mask", 0),
            "labels": padded("labels", -100)}


def one_run(kind: str, size_name: str, steps: int, budget: str, rows: str = "fixed") -> dict:
    """Train ``steps`` steps in this process; the per-step times after two warm-up steps. ``rows``: "fixed" (every
    row the full length) or "variable" (lengths uniform from an eighth of it to all of it, padded on the right)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    size = dict(SIZES[size_name])
    seq, global_batch = size.pop("seq"), size.pop("global")
    cuda = torch.cuda.is_available()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=seq, **size))
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(global_batch * steps):
        n = seq if rows == "fixed" else int(torch.randint(seq // 8, seq + 1, (1,), generator=g))
        ids = torch.randint(3, size["vocab_size"], (n,), generator=g)
        data.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            self.ends.append(time.perf_counter())

    clock = Clock()
    hand = kind == "hand"
    args = TrainingArguments(
        output_dir=f"/tmp/trainer_overhead_{kind}", per_device_train_batch_size=1,
        gradient_accumulation_steps=global_batch, gradient_checkpointing=hand,
        gradient_checkpointing_kwargs={"use_reentrant": False} if hand else None, bf16=hand and cuda,
        optim="adamw_torch_fused" if cuda else "adamw_torch", max_steps=steps, learning_rate=1e-4,
        lr_scheduler_type="constant", report_to=[], save_strategy="no", logging_strategy="no", seed=0,
        disable_tqdm=True, use_cpu=not cuda, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[clock], data_collator=_pad_right)
    out: dict = {"kind": kind, "size": size_name, "rows": rows, "seq": seq, "global_batch": global_batch}
    if not hand:
        import memopt

        pins = {"checkpointing": "full", "checkpoint_blocks": size["num_hidden_layers"], "micro_batch_size": 1,
                "precision": "bf16_autocast" if cuda else "fp32", "optimizer": "adamw_fused" if cuda else "adamw",
                "expandable_segments": True}
        start = time.perf_counter()
        trainer = memopt.wrap(trainer, budget=budget, hardware=None if cuda else "h100_80gb", pins=pins,
                              guard=kind != "memopt_norecover")
        out["wrap_s"] = time.perf_counter() - start
        out["plan"] = trainer.memopt_plan.strategy.label()
        out["predicted_step_s"] = trainer.memopt_plan.step_time_s
        out["args"] = {k: getattr(trainer.args, k) for k in ("per_device_train_batch_size",
                                                             "gradient_accumulation_steps", "bf16")}
    out["memopt_module"] = sys.modules["memopt"].__file__ if "memopt" in sys.modules else None
    trainer.train()
    if not hand:  # the Trainer path's padding verdict is noted at the first split batch
        out["notes"] = [n for n in trainer.memopt_plan.notes if "padding" in n]
    steps_s = [b - a for a, b in zip(clock.ends, clock.ends[1:])][1:]  # the first two steps warm up
    out.update(step_s=steps_s, median_step_s=statistics.median(steps_s), min_step_s=min(steps_s))
    if cuda:
        out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        out["allocator"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="real", choices=sorted(SIZES))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget", default="40GiB")
    ap.add_argument("--kinds", default="hand,memopt,memopt_norecover")
    ap.add_argument("--rows", default="fixed", choices=["fixed", "variable"])
    ap.add_argument("--old", type=Path, default=None, help="another memopt checkout: adds the run memopt_old")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child process: its run kind
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one, args.size, args.steps, args.budget, args.rows)))
        return
    kinds = args.kinds.split(",") + (["memopt_old"] if args.old else [])
    rows = []
    for r in range(args.rounds):
        for kind in kinds:
            env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
            path = args.old if kind == "memopt_old" else ROOT
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH", "")]))
            cmd = [sys.executable, str(Path(__file__).resolve()), "--size", args.size, "--steps", str(args.steps),
                   "--budget", args.budget, "--rows", args.rows, "--out", str(args.out), "--one",
                   "memopt" if kind == "memopt_old" else kind]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=path)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
            row = json.loads(lines[-1]) if done.returncode == 0 and lines else {"error": done.stderr[-3000:]}
            row.update(kind=kind, round=r)
            rows.append(row)
            print(kind, r, row.get("median_step_s"), row.get("plan", ""), row.get("error", "")[-300:], flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(rows, indent=1))  # after each run: a time limit keeps what was done
    by_kind: dict[str, list[float]] = {}
    for row in rows:
        if "median_step_s" in row:
            by_kind.setdefault(row["kind"], []).append(row["median_step_s"])
    hand = min(by_kind.get("hand", [float("nan")]))
    for kind, values in by_kind.items():
        print(f"{args.rows} {kind:18s} best median step {min(values):.4f} s  vs hand {min(values) / hand:.3f}x")


if __name__ == "__main__":
    main()
