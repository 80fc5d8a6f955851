"""The peak of a real training step on the CPU, in live-tensor bytes: the truth the estimator is checked against.

``real_step_peaks`` tracks what exists before the step (weights, buffers, quantization state, the batch) with
``memopt.profile.tracker.MemoryTracker`` and returns the peak of each of ``num_steps`` optimizer steps, the
first (where optimizer states appear) included. The same protocol as the fake-tensor ``simulate_step``, on real
tensors, so that a test compares like with like.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch

from memopt.profile.tracker import MemoryTracker

__all__ = ["real_step_peaks"]


def real_step_peaks(step: Callable[[], Any], tracked: Iterable[torch.Tensor], *, num_steps: int = 2,
                    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
                    device: str = "cpu") -> list[int]:
    """Peak tracked bytes of each of ``num_steps`` calls of ``step``; ``tracked`` are the tensors alive before it;
    ``context`` wraps the steps (e.g. bitsandbytes' op-by-op CPU kernels, so their temporaries are seen)."""
    tracker = MemoryTracker(device)
    peaks: list[int] = []
    with tracker:
        for t in tracked:
            tracker.track(t)
        with context():
            for _ in range(num_steps):
                tracker.reset_peak()
                step()
                peaks.append(tracker.peak_bytes)
    return peaks
