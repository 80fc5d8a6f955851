"""A batch larger per sample than the one the plan was made for (a longer sequence, a larger image) needs more
activation memory than the plan predicts: on a GPU it runs out of memory under the cap and the guard has to recover,
which is not a fit. More samples of the planned shape are no risk: they become more micro-batches of the planned
size. The watch compares each batch's tensors, past dim 0, with the planned sample's and says once per tensor and
shape what grew and what to plan for instead. The planned sample is the profile's where wrap planned, else what a
saved plan recorded (``memopt.plan.sample_match``)."""

from __future__ import annotations

import warnings
from typing import Any

from memopt.plan.sample_match import grown_shapes, planned_sample_shapes, saved_sample_shapes

__all__ = ["ShapeWatch", "planned_sample_shapes", "watch_for"]


class ShapeWatch:
    """Warns when a batch's tensor is larger past dim 0 than planned (each tensor and shape once)."""

    def __init__(self, planned: dict[str, tuple[int, ...]]) -> None:
        self.planned = planned
        self._said: set[tuple[str, tuple[int, ...]]] = set()

    def check(self, batch: Any) -> None:
        new = [g for g in grown_shapes(self.planned, batch) if g[:2] not in self._said]
        if not new:
            return
        self._said.update(g[:2] for g in new)
        what = "; ".join(f"{path} {shape} (planned per sample {want})" for path, _, shape, want in new)
        warnings.warn(
            f"this batch is larger per sample than the one the plan was made for: {what}; its activations may exceed "
            "the plan (on a GPU, an out-of-memory error that the guard recovers from). Plan for the largest batch "
            "you will feed: sample= that batch, or {'batch_size': ..., 'seq_len': <the longest>} for a Hugging Face "
            "model", stacklevel=3)


def watch_for(profile: Any, plan: Any, model: Any) -> ShapeWatch:
    """The watch of a wrapped model: the planned sample of the profile wrap made, else of the saved plan applied."""
    if profile is not None:
        return ShapeWatch(planned_sample_shapes(profile.batch_factory))
    return ShapeWatch(saved_sample_shapes((getattr(plan, "model", None) or {}).get("sample"), model))
