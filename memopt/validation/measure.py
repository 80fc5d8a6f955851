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

from memopt.validation.rows import Row

__all__ = ["measure_row", "set_allocator_env"]


def set_allocator_env(expandable: bool) -> None:
    """Must run before the process's first CUDA allocation."""
    conf = [c for c in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").split(",")
            if c and not c.startswith("expandable_segments")]
    if expandable:
        conf.append("expandable_segments:True")
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(conf)


def measure_row(row: Row) -> dict[str, Any]:
    """Train ``row.steps`` steps on the GPU and return the measured figures (or the error)."""
    set_allocator_env(row.strategy.expandable_segments)
    import torch

    from memopt.apply.prepare import prepare
    from memopt.models import SampleSpec, build_model, make_batch, with_overrides

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
            "measured_outside_allocator_bytes": used[-1] - reserved_now,
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
