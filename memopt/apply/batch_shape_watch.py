"""A batch larger per sample than the one the plan was made for (a longer sequence, a larger image) needs more
activation memory than the plan predicts: on a GPU it runs out of memory under the cap and the guard has to recover,
which is not a fit. More samples of the planned shape are no risk: they become more micro-batches of the planned
size. The watch compares each batch's tensors, past dim 0, with the planned sample's and says once per tensor and
shape what grew and what to plan for instead."""

from __future__ import annotations

import warnings
from typing import Any

from memopt.step.batch_samples import indivisible
from memopt.step.batch_tree import leaves

__all__ = ["ShapeWatch", "planned_sample_shapes"]


def planned_sample_shapes(batch_factory: Any) -> dict[str, tuple[int, ...]]:
    """Per tensor of the planned batch (by its path in the batch), its shape past dim 0; empty when the profile
    cannot make a batch (nothing is watched then)."""
    if batch_factory is None:
        return {}
    try:
        batch = batch_factory(1, "meta")
    except Exception:  # a factory that needs a real device: the watch is advice, never a failure of its own
        return {}
    return _per_sample_shapes(batch)


def _per_sample_shapes(batch: Any) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape past dim 0; the whole shape in an indivisible batch (one sample: a graph's node count
    is what grows)."""
    cut = 0 if indivisible(batch) else 1
    return {path: tuple(t.shape[cut:]) for path, t in leaves(batch) if t.dim() > 0}


class ShapeWatch:
    """Warns when a batch's tensor is larger past dim 0 than planned (each tensor and shape once)."""

    def __init__(self, planned: dict[str, tuple[int, ...]]) -> None:
        self.planned = planned
        self._said: set[tuple[str, tuple[int, ...]]] = set()

    def check(self, batch: Any) -> None:
        if not self.planned:
            return
        grown = []
        shapes = dict(leaves(batch))
        for path, have in _per_sample_shapes(batch).items():
            want = self.planned.get(path)
            if want is not None and len(want) == len(have) and any(h > w for h, w in zip(have, want)):
                grown.append((path, have, tuple(shapes[path].shape), want))
        new = [g for g in grown if g[:2] not in self._said]
        if not new:
            return
        self._said.update(g[:2] for g in new)
        what = "; ".join(f"{path} {shape} (planned per sample {want})" for path, _, shape, want in new)
        warnings.warn(
            f"this batch is larger per sample than the one the plan was made for: {what}; its activations may exceed "
            "the plan (on a GPU, an out-of-memory error that the guard recovers from). Plan for the largest batch "
            "you will feed: sample= that batch, or {'batch_size': ..., 'seq_len': <the longest>} for a Hugging Face "
            "model", stacklevel=3)
