"""Run one example script (``runpy``) with a measuring probe on every Trainer it builds; write what was seen.

    python launch.py --probe OUT.json [--cap-bytes N] -- SCRIPT.py ARGS...

The probe is measurement only and the same for the plain and the memopt runs: a TrainerCallback added when the
Trainer is built, which times each optimizer step, keeps the logged losses, and hooks the model to see what
actually ran (the batch of each forward, autocast on or off and its dtype, which blocks ran their forward twice:
activation checkpointing recomputes them in backward), the optimizer the Trainer made, and on a GPU the peak
memory and the allocator's segment mode. ``--cap-bytes`` caps a plain run's allocator at the budget the memopt run
gets (memopt caps its own): the same budget for both.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch


def _first_dim(args: tuple, kwargs: dict) -> int | None:
    for key in ("input_ids", "pixel_values", "inputs_embeds"):
        value = kwargs.get(key)
        if isinstance(value, torch.Tensor):
            return int(value.shape[0])
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return int(value.shape[0])
    return None


def _traced(args: tuple, kwargs: dict) -> bool:
    """A forward on fake or meta tensors (memopt's trace of a copy of the model), not a training forward."""
    from torch._subclasses.fake_tensor import FakeTensor

    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return isinstance(value, FakeTensor) or value.device.type == "meta"
    return False


class Probe:
    """A TrainerCallback (duck-typed: every event it does not define is a no-op)."""

    def __init__(self, trainer: Any, record: dict[str, Any], cap_bytes: int | None) -> None:
        self.trainer, self.record, self.cap_bytes = trainer, record, cap_bytes
        self.forwards: list[dict[str, Any]] = []
        self.child_calls: dict[str, int] = {}
        self.step_start = 0.0

    def __getattr__(self, name: str) -> Any:
        if name.startswith("on_"):
            return lambda args, state, control, **kwargs: control
        raise AttributeError(name)

    def _hook_model(self, model: torch.nn.Module) -> None:
        def seen(module: Any, args: tuple, kwargs: dict) -> None:
            if _traced(args, kwargs):  # memopt's profile traces a copy of the model, these hooks included
                return
            self.forwards.append({"batch": _first_dim(args, kwargs), "matmul_dtype": None})

        # the model's own forward is where the batch arrives; autocast is entered inside it (accelerate wraps
        # ``forward``), so the precision is read off a linear layer's output in the first block
        model.register_forward_pre_hook(seen, with_kwargs=True)
        from memopt.blocks import find_block_stacks

        stacks = find_block_stacks(model)
        first_linear = next((m for s in stacks[:1] for m in s.blocks[0].modules() if isinstance(m, torch.nn.Linear)),
                            None) or next((m for m in model.modules() if isinstance(m, torch.nn.Linear)), None)

        def matmul(module: Any, args: tuple, output: Any) -> None:
            if self.forwards and self.forwards[-1]["matmul_dtype"] is None and isinstance(output, torch.Tensor):
                self.forwards[-1]["matmul_dtype"] = str(output.dtype).replace("torch.", "")

        if first_linear is not None:
            first_linear.register_forward_hook(matmul)
        self.record["blocks"] = {s.path: len(s) for s in stacks}
        for stack in stacks:
            for i, block in enumerate(stack.blocks):
                for child_name, child in block.named_modules():
                    if not any(True for _ in child.parameters(recurse=False)):
                        continue
                    key = f"{stack.path}.{i}|{child_name}"
                    self.child_calls[key] = 0

                    def count(*_: Any, key: str = key) -> None:
                        self.child_calls[key] += 1

                    child.register_forward_pre_hook(count)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> Any:
        t = self.trainer
        if self.cap_bytes and torch.cuda.is_available() and getattr(t, "memopt_plan", None) is None:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.cap_bytes / total))
            self.record["cap_fraction"] = self.cap_bytes / total
        self._hook_model(t.model)
        inner = getattr(t.optimizer, "optimizer", t.optimizer)
        defaults = dict(getattr(inner, "defaults", {}))
        self.record["trainer"] = {
            "per_device_train_batch_size": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "bf16": bool(args.bf16), "fp16": bool(args.fp16), "optim": str(getattr(args.optim, "value", args.optim)),
            "gradient_checkpointing": bool(args.gradient_checkpointing),
            "accelerator_mixed_precision": str(t.accelerator.mixed_precision),
            "optimizer_class": type(inner).__name__,
            "optimizer_fused": bool(defaults.get("fused")), "optimizer_foreach": defaults.get("foreach"),
        }
        plan = getattr(t, "memopt_plan", None)
        if plan is not None:
            self.record["plan"] = plan.to_dict()
            self.record["strategy"] = plan.strategy.to_dict()
            self.record["memopt_checkpointing"] = t.memopt_checkpointing.setting.label()
        if torch.cuda.is_available():
            from memopt.step.hard_cap import allocator_mode_in_force

            torch.cuda.reset_peak_memory_stats()
            self.record["expandable_segments_in_force"] = allocator_mode_in_force()
        self.record["steps"] = []
        return control

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.step_start = time.perf_counter()
        self._forwards_before = len(self.forwards)
        self._children_before = dict(self.child_calls)
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        forwards = self.forwards[self._forwards_before:]
        calls = {k: v - self._children_before.get(k, 0) for k, v in self.child_calls.items()}
        # a block each of whose layers (those that ran) ran more often than the model's forward: recomputed in
        # backward (checkpointed)
        per_block: dict[str, int] = {}
        for key, n in calls.items():
            block = key.split("|", 1)[0]
            if n > 0:
                per_block[block] = min(per_block.get(block, n), n)
        recomputed = sorted(b for b, n in per_block.items() if n > len(forwards))
        row: dict[str, Any] = {"step": state.global_step, "seconds": time.perf_counter() - self.step_start,
                               "forwards": forwards, "recomputed_blocks": recomputed}
        plan = getattr(self.trainer, "memopt_plan", None)
        if plan is not None:  # the plan in force: memopt's guard may have re-planned during the step
            row["strategy"] = plan.strategy.to_dict()
        if torch.cuda.is_available():
            row["max_allocated_bytes"] = torch.cuda.max_memory_allocated()
            row["max_reserved_bytes"] = torch.cuda.max_memory_reserved()
        self.record["steps"].append(row)
        return control

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> Any:
        if logs and "loss" in logs:
            self.record.setdefault("losses", []).append({"step": state.global_step, "loss": float(logs["loss"])})
        return control


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--probe", required=True, type=Path)
    parser.add_argument("--cap-bytes", type=int, default=None)
    parser.add_argument("script", type=Path)
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    ns = parser.parse_args()
    record: dict[str, Any] = {"script": str(ns.script), "argv": ns.script_args, "ok": False,
                              "memopt_env": {k: v for k, v in os.environ.items() if k.startswith("MEMOPT_")}}
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from torchvision_shim import allow_torchvision_without_ops

    record["torchvision_without_ops"] = allow_torchvision_without_ops()
    import transformers

    original_init = transformers.Trainer.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self.add_callback(Probe(self, record, ns.cap_bytes))

    transformers.Trainer.__init__ = init
    sys.argv = [str(ns.script), *[a for a in ns.script_args if a != "--"]]
    started = time.perf_counter()
    try:
        runpy.run_path(str(ns.script), run_name="__main__")
        record["ok"] = True
    except BaseException as exc:  # recorded, then the run fails as it would have
        record["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500]
        record["oom"] = isinstance(exc, torch.OutOfMemoryError)
        record["traceback"] = traceback.format_exc()[-4000:]
        raise
    finally:
        record["wall_seconds"] = time.perf_counter() - started
        ns.probe.parent.mkdir(parents=True, exist_ok=True)
        ns.probe.write_text(json.dumps(record, indent=1, default=str))


if __name__ == "__main__":
    main()
