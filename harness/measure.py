"""Measuring one validation row on a real GPU (run in a fresh process per row).

The allocator settings are chosen before CUDA starts, the model is built directly on the GPU from its
config, the strategy is applied by ``prepare`` (the code ``wrap`` uses), and the peak statistics are
reset once, after the model and batch exist and before the first step, as DEVELOPERS.md defines them.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

from harness.rows import Row
from memopt.step.hard_cap import process_device_bytes

__all__ = ["measure_row", "set_allocator_env"]


def set_allocator_env(expandable: bool) -> None:
    """Must run before the process's first CUDA allocation."""
    conf = [c for c in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").split(",")
            if c and not c.startswith("expandable_segments")]
    if expandable:
        conf.append("expandable_segments:True")
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(conf)


def _record_error(result: dict[str, Any], exc: BaseException) -> None:
    result.update({"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000],
                   "traceback": traceback.format_exc()[-3000:]})


def measure_row(row: Row) -> dict[str, Any]:
    """Train ``row.steps`` steps on the GPU and return the measured figures (or the error)."""
    set_allocator_env(row.strategy.expandable_segments)
    import torch

    from memopt.models import SampleSpec, build_model, make_batch, with_overrides
    from memopt.step.prepare import prepare

    result: dict[str, Any] = {"row": row.to_dict()}
    try:
        torch.cuda.init()
        torch.manual_seed(0)
        free0, total = torch.cuda.mem_get_info()
        spec = with_overrides(row.model, row.overrides)
        t0 = time.perf_counter()
        model = build_model(spec, device="cuda")
        sample = SampleSpec.parse(row.sample(), spec)
        batch = make_batch(spec, sample, device="cuda")
        prepared = prepare(model, row.strategy, device_type="cuda", device="cuda")
        result["build_s"] = time.perf_counter() - t0
        if row.cap_bytes is not None:
            torch.cuda.set_per_process_memory_fraction(row.cap_bytes / total)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        result["start_allocated_bytes"] = torch.cuda.memory_allocated()
        step_times, losses, used = [], [], []
        for _ in range(row.steps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            losses.append(prepared.step.step(batch))
            torch.cuda.synchronize()
            step_times.append(time.perf_counter() - t)
            free, _ = torch.cuda.mem_get_info()
            used.append(total - free)
        stats = torch.cuda.memory_stats()
        reserved_now = torch.cuda.memory_reserved()
        result.update({
            "ok": True,
            "measured_peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            "measured_peak_reserved_bytes": torch.cuda.max_memory_reserved(),
            "measured_device_used_bytes": max(used),
            "measured_outside_allocator_bytes": (process_device_bytes() or used[-1]) - reserved_now,
            "device_total_bytes": total,
            "device_used_before_bytes": total - free0,
            "measured_step_s": sorted(step_times[1:])[len(step_times[1:]) // 2] if len(step_times) > 1
            else step_times[0],
            "step_times_s": step_times,
            "losses": losses,
            "num_alloc_retries": stats.get("num_alloc_retries", 0),
            "num_ooms": stats.get("num_ooms", 0),
            "offloaded_bytes": getattr(prepared.step.offload, "bytes_offloaded", None),
        })
    except torch.cuda.OutOfMemoryError as exc:
        result.update({"ok": False, "oom": True, "error": str(exc)[:2000],
                       "measured_peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                       "measured_peak_reserved_bytes": torch.cuda.max_memory_reserved()})
    except Exception as exc:
        result.update({"ok": False, "oom": False, "error": f"{type(exc).__name__}: {exc}"[:2000],
                       "traceback": traceback.format_exc()[-4000:]})
    return result


def measure_wrap(row: Row, plan_path: str) -> dict[str, Any]:
    """``memopt.wrap`` with a plan made on the CPU, under the hard cap, ``row.steps`` steps on the GPU."""
    import json

    import torch

    from memopt.apply.wrap import wrap
    from memopt.models import SampleSpec, build_model, make_batch, with_overrides

    with open(plan_path) as f:
        plan_data = json.load(f)
    result: dict[str, Any] = {"row": row.to_dict(), "plan": plan_path, "plan_fits": plan_data["fits"],
                              "budget_bytes": plan_data["budget_bytes"],
                              "predicted_peak_allocated_bytes": plan_data["peak_allocated_bytes"],
                              "predicted_peak_reserved_bytes": plan_data["peak_reserved_bytes"],
                              "predicted_total_bytes": plan_data["total_bytes"],
                              "predicted_step_s": plan_data["step_time_s"], "strategy": plan_data["strategy_label"]}
    if not plan_data["fits"]:
        result.update({"ok": True, "skipped": "plan does not fit"})
        return result
    try:
        set_allocator_env(plan_data["techniques"]["expandable_segments"])
        torch.manual_seed(0)
        spec = with_overrides(row.model, row.overrides)
        # built on the GPU (fast initialization); plans that store weights in bf16 would rather start on the CPU
        model = build_model(spec, device="cuda")
        batch = make_batch(spec, SampleSpec.parse(row.sample(), spec), device="cpu")
        wrapped = wrap(model, plan=plan_path, lr=1e-5)
        _train_wrapped(wrapped, row, batch, result)
    except torch.cuda.OutOfMemoryError as exc:
        result.update({"ok": True, "fits_under_cap": False, "error": str(exc)[:600],
                       "measured_peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                       "measured_peak_reserved_bytes": torch.cuda.max_memory_reserved()})
    except Exception as exc:
        _record_error(result, exc)
    return result


def _train_wrapped(wrapped: Any, row: Row, batch: dict[str, Any], result: dict[str, Any]) -> None:
    """Reset the peaks, train ``row.steps`` steps and record the figures ``measure_wrap`` reports."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    total = torch.cuda.get_device_properties(0).total_memory
    times, used = [], []
    for _ in range(row.steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        wrapped.step(batch)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        free, _ = torch.cuda.mem_get_info()
        used.append(total - free)
    steady = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
    reserved = torch.cuda.max_memory_reserved()
    own = process_device_bytes()  # this process alone (rows may share the GPU)
    outside = (own if own is not None else used[-1]) - torch.cuda.memory_reserved()
    items = row.batch_size * (row.seq_len or 1)
    result.update({
        "ok": True, "fits_under_cap": True, "cap_fraction": getattr(wrapped, "cap_fraction", None),
        "measured_peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        "measured_peak_reserved_bytes": reserved, "measured_outside_allocator_bytes": outside,
        "measured_total_bytes": reserved + outside, "measured_device_used_bytes": max(used),
        "measured_step_s": steady, "step_times_s": times,
        ("tokens_per_s" if row.seq_len else "samples_per_s"): items / steady,
        # each retry at the cap flushes the cache and synchronizes: a slow row with retries explains itself
        "num_alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0),
    })


def measure_autotune(row: Row, plan_paths: list[str]) -> dict[str, Any]:
    """What ``memopt.wrap(..., autotune=True)`` does on the GPU, with the candidates made on the CPU
    (``scripts/make_wrap_plans.py --autotune``): measure them on the first batch under the hard cap, keep
    the fastest, then train ``row.steps`` steps with it."""
    import torch

    from memopt.apply.autotune import autotune
    from memopt.apply.wrap import wrap
    from memopt.models import SampleSpec, build_model, make_batch, with_overrides
    from memopt.plan.schema import Plan
    from memopt.step.hard_cap import cap_allocator, outside_allocator_bytes

    plans = [Plan.load(p) for p in plan_paths]
    chosen = plans[0]
    result: dict[str, Any] = {"row": row.to_dict(), "plan": plan_paths[0], "plan_fits": chosen.fits,
                              "budget_bytes": chosen.budget_bytes, "strategy": chosen.strategy.label()}
    try:
        set_allocator_env(chosen.strategy.expandable_segments)
        torch.manual_seed(0)
        spec = with_overrides(row.model, row.overrides)
        model = build_model(spec, device="cuda")
        batch = make_batch(spec, SampleSpec.parse(row.sample(), spec), device="cpu")
        outside = max(outside_allocator_bytes(0), int(chosen.prediction.get("runtime_bytes", 0)))
        cap_allocator(chosen.budget_bytes, outside, 0)
        t = time.perf_counter()
        best, trials = autotune(model, plans, batch, {"device_type": "cuda", "device": torch.device("cuda", 0),
                                                      "move_to": torch.device("cuda", 0)})
        result.update({"autotune_s": time.perf_counter() - t, "trials": [x.to_dict() for x in trials],
                       "strategy": best.strategy.label(), "predicted_step_s": best.step_time_s,
                       "predicted_peak_allocated_bytes": best.peak_allocated_bytes,
                       "predicted_peak_reserved_bytes": best.peak_reserved_bytes,
                       "predicted_total_bytes": best.total_bytes})
        wrapped = wrap(model, plan=best, lr=1e-5)
        _train_wrapped(wrapped, row, batch, result)
    except torch.cuda.OutOfMemoryError as exc:
        result.update({"ok": True, "fits_under_cap": False, "error": str(exc)[:600]})
    except Exception as exc:
        _record_error(result, exc)
    return result


def measure_trainer(row: Row, per_device_batch: int, accum: int, cap_bytes: int) -> dict[str, Any]:
    """The Hugging Face Trainer baseline users run today: gradient checkpointing, bf16, fused AdamW, default
    allocator, the given per-device batch with accumulation to the global batch, under the same cap."""
    import tempfile

    import torch

    from memopt.models import SampleSpec, build_model, make_batch, with_overrides

    result: dict[str, Any] = {"row": row.to_dict(), "per_device_batch": per_device_batch, "accum": accum}
    try:
        from transformers import Trainer, TrainerCallback, TrainingArguments

        set_allocator_env(False)
        torch.manual_seed(0)
        spec = with_overrides(row.model, row.overrides)
        model = build_model(spec, device="cuda")
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(cap_bytes / total)
        one = SampleSpec.parse({**row.sample(), "batch_size": 1}, spec)
        g = torch.Generator().manual_seed(0)
        data = [{k: v[0] for k, v in make_batch(spec, one, generator=g).items()}
                for _ in range(per_device_batch * accum * row.steps)]
        times: list[float] = []

        class Timer(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                torch.cuda.synchronize()
                self.t = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                torch.cuda.synchronize()
                times.append(time.perf_counter() - self.t)

        with tempfile.TemporaryDirectory() as tmp:
            args = TrainingArguments(output_dir=tmp, per_device_train_batch_size=per_device_batch,
                                     gradient_accumulation_steps=accum, bf16=True, gradient_checkpointing=True,
                                     gradient_checkpointing_kwargs={"use_reentrant": False},
                                     optim="adamw_torch_fused", max_steps=row.steps, logging_strategy="no",
                                     save_strategy="no", report_to=[], learning_rate=1e-5,
                                     dataloader_num_workers=0, remove_unused_columns=False, disable_tqdm=True)
            trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Timer()])
            torch.cuda.reset_peak_memory_stats()
            trainer.train()
        steady = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
        items = row.batch_size * (row.seq_len or 1)
        result.update({"ok": True, "fits_under_cap": True, "measured_step_s": steady, "step_times_s": times,
                       "measured_peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                       "measured_peak_reserved_bytes": torch.cuda.max_memory_reserved(),
                       ("tokens_per_s" if row.seq_len else "samples_per_s"): items / steady})
    except torch.cuda.OutOfMemoryError as exc:
        result.update({"ok": True, "fits_under_cap": False, "error": str(exc)[:400]})
    except Exception as exc:
        _record_error(result, exc)
    return result
