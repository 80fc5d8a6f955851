"""What a plan's sample holds per sample, and what of a batch is larger. A plan's activations are predicted for the
sample it was made for: a batch larger per sample (a longer sequence, a larger image) needs more memory than the plan
says, while more samples of the planned shape only become more micro-batches. A profile knows its sample through its
batch maker; a saved plan through what it recorded (``Plan.model["sample"]``): each tensor's shape for a batch
planned by its structure, the shapes (``batch_size``, ``seq_len``, ...) for a Hugging Face model, whose batch the
same maker as the profile's makes again."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from memopt.profile.batch_factories import batch_factory_for, is_shapes
from memopt.step.batch_samples import indivisible
from memopt.step.batch_tree import leaves

__all__ = ["SHAPE_KEYS", "grown_shapes", "grown_spec", "per_sample_shapes", "planned_sample_shapes",
           "saved_sample_shapes"]

#: the per-sample sizes of a shapes sample that make a batch larger per sample
SHAPE_KEYS = ("seq_len", "decoder_seq_len", "image_size")

Shapes = dict[str, tuple[int, ...]]


def per_sample_shapes(batch: Any) -> Shapes:
    """Each tensor's shape past dim 0; the whole shape in an indivisible batch (one sample: a graph's node count
    is what grows)."""
    cut = 0 if indivisible(batch) else 1
    return {path: tuple(t.shape[cut:]) for path, t in leaves(batch) if t.dim() > 0}


def planned_sample_shapes(batch_factory: Any) -> Shapes:
    """Per tensor of the planned batch (by its path in the batch), its shape past dim 0; empty when the profile
    cannot make a batch (nothing is watched then)."""
    if batch_factory is None:
        return {}
    try:
        batch = batch_factory(1, "meta")
    except Exception:  # a factory that needs a real device: the watch is advice, never a failure of its own
        return {}
    return per_sample_shapes(batch)


def saved_sample_shapes(sample: Any, model: Any) -> Shapes:
    """The per-sample shapes a saved plan's recorded ``sample`` stands for; empty when it recorded none that
    ``model`` can make again."""
    if not isinstance(sample, Mapping):
        return {}
    recorded = sample.get("tensors")
    if isinstance(recorded, Mapping):
        cut = 0 if sample.get("indivisible") else 1
        return {path: tuple(shape[cut:]) for path, (shape, _dtype) in recorded.items() if len(shape) > cut}
    if not isinstance(model, nn.Module) or (sample.get("seq_len") is None and sample.get("image_size") is None):
        return {}
    try:
        factory, _, _ = batch_factory_for(None, dict(sample), model)
    except ValueError:  # not a model memopt makes batches for: nothing to compare with
        return {}
    return planned_sample_shapes(factory)


def grown_shapes(planned: Shapes, batch: Any) -> list[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """(path, per-sample shape, whole shape, planned per-sample shape) of each tensor of ``batch`` larger past dim 0
    than planned."""
    if not planned:
        return []
    shapes = dict(leaves(batch))
    grown = []
    for path, have in per_sample_shapes(batch).items():
        want = planned.get(path)
        if want is not None and len(want) == len(have) and any(h > w for h, w in zip(have, want)):
            grown.append((path, have, tuple(shapes[path].shape), want))
    return grown


def grown_spec(planned: Any, sample: Any) -> list[str]:
    """``key=have (planned want)`` for each per-sample size of a shapes ``sample`` above a saved plan's."""
    if not (isinstance(planned, Mapping) and isinstance(sample, Mapping) and is_shapes(dict(sample))):
        return []
    out = []
    for key in SHAPE_KEYS:
        have, want = sample.get(key), planned.get(key)
        if isinstance(have, int) and isinstance(want, int) and not isinstance(have, bool) and have > want:
            out.append(f"{key}={have} (planned {want})")
    return out
