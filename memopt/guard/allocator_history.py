"""The CUDA caching allocator's own record of a step: its allocated bytes now, and its event history over one
step (``torch.cuda.memory._record_memory_history``) as a timeline and a snapshot file."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from memopt.estimate.event_levels import downsample

__all__ = ["AllocatorHistory", "cuda_allocated_bytes"]


def cuda_allocated_bytes() -> int:
    """The caching allocator's allocated bytes now, on the current device."""
    nested = getattr(torch._C, "_cuda_memoryStats", None)
    if nested is None:  # pragma: no cover - other PyTorch builds
        return int(torch.cuda.memory_allocated())
    return int(nested(torch.cuda.current_device())["allocated_bytes"]["all"]["current"])


class AllocatorHistory:
    """The CUDA caching allocator's own history over the step (``torch.cuda.memory._record_memory_history``), when
    nobody else records it: the allocator's allocated bytes event by event (kernel scratch included), beside the
    per-tensor figures, and a snapshot to open in https://pytorch.org/memory_viz."""

    def __init__(self) -> None:
        self.on = False
        self.start = 0

    def begin(self) -> None:
        try:
            if any(torch.cuda.memory._snapshot()["device_traces"]):
                return  # someone records already: leave their history alone
            torch.cuda.memory._record_memory_history("all", context=None, stacks="python", max_entries=2_000_000)
            self.on = True
            self.start = cuda_allocated_bytes()
        except (AttributeError, RuntimeError, TypeError):
            self.on = False

    def end(self, snapshot_path: Path | None) -> dict[str, Any] | None:
        if not self.on:
            return None
        try:
            snap = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(None)
            self.on = False
        trace = snap["device_traces"][torch.cuda.current_device()]
        level, levels = self.start, []
        for e in trace:
            if e["action"] == "alloc":
                level += e["size"]
            elif e["action"] == "free_completed":
                level -= e["size"]
            else:
                continue
            levels.append(level)
        if snapshot_path is not None:
            snapshot_path.parent.mkdir(parents=True, exist_ok=True)
            with open(snapshot_path, "wb") as f:
                pickle.dump(snap, f)
        return {"timeline": downsample(levels, []), "peak_allocated_bytes": max(levels, default=self.start),
                "snapshot": snapshot_path.name if snapshot_path is not None else None}
