"""Batches made like the user's: the same structure, dtypes and per-sample shapes, at another number of samples.

The profile traces the step at several micro-batch sizes from one sample batch, on fake or meta tensors, so it
needs batches of any size that the model takes as it takes the real one. Their values matter where the model reads
them: integer tensors are filled with the real batch's largest value (valid class ids and token ids, never the
-100 that would leave a label without loss, the longest of a batch's lengths), so the traced step takes the paths
and shapes the real one does.
"""

from __future__ import annotations

from typing import Any

import torch

from memopt.step.batch_samples import record_ids
from memopt.step.batch_tree import is_fake, tensors, tree_map

__all__ = ["integer_maxima", "like"]


def integer_maxima(batch: Any) -> list[int | None]:
    """For each tensor of the batch (``leaves`` order), the largest value of an integer one that holds values, else
    None: what ``like`` fills it with."""
    def top(t: torch.Tensor) -> int | None:
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool or t.numel() == 0:
            return None
        if t.device.type == "meta" or is_fake(t):
            return None
        return int(t.max())

    return [top(t) for t in tensors(batch)]


def like(batch: Any, size: int | None, device: str | torch.device, fill: list[int | None] | None = None) -> Any:
    """A batch of ``size`` samples (None: the whole of ``batch``, every shape kept) with ``batch``'s structure,
    dtypes and per-sample shapes, created on ``device``: random floats; each integer tensor filled with its ``fill``
    value (``integer_maxima`` of the real batch: valid class ids and never -100, so every label carries loss, and the
    longest of a batch's lengths, so a model that trims its padding to ``lengths.max()`` is traced at the batch's
    length), or zeros without one; booleans false."""
    fills = iter(fill or [])

    def made(t: torch.Tensor, shape: tuple[int, ...], value: int | None) -> torch.Tensor:
        if t.is_floating_point():
            return torch.randn(shape, device=device).to(t.dtype)
        if value is not None:
            return torch.full(shape, value, dtype=t.dtype, device=device)
        return torch.zeros(shape, dtype=t.dtype, device=device)

    def make(t: torch.Tensor) -> torch.Tensor:
        shape = tuple(t.shape) if size is None else (size, *t.shape[1:]) if t.dim() > 0 else ()
        return made(t, shape, next(fills, None))

    def records(given: list) -> list:
        # one record per sample, each as the given ones (in turn), its tensors at their own shapes
        values = [[next(fills, None) for _ in tensors(r)] for r in given]
        out = []
        for i in range(len(given) if size is None else size):
            at = iter(values[i % len(given)])
            out.append(tree_map(lambda t: made(t, tuple(t.shape), next(at, None)), given[i % len(given)]))
        return out

    return tree_map(make, batch, records=records, record_ids=record_ids(batch))
