"""Whether the batch's dim 0 is the samples, for models whose layers say where their batch axis is.

Micro-batching splits every tensor of the batch along dim 0 and is exact only when dim 0 holds independent samples.
A recurrent layer or ``nn.MultiheadAttention`` built with ``batch_first=False`` (PyTorch's default for both) takes
``(sequence, batch, features)``; a loop that feeds it sequence-first batches puts the time steps on dim 0, and a
micro-batch would then be a slice of time steps: the recurrence restarts and attention sees part of the sequence,
so the loss changes silently. Such a model may also transpose a batch-first input itself, so the layer's flag alone
says nothing; what does is how the layer's batch axis grows with the number of samples fed. One forward of a fake
copy (no memory, no values) at 1 and at 2 samples: a layer whose batch axis does not double is not fed samples along
the batch's dim 0, and micro-batching is refused with that reason. Only models that have such layers pay for it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memopt.profile.fake_model import fake_copy
from memopt.profile.hf_compat import grouped_mm_in_any_float, real_code_paths
from memopt.profile.process_caches import caches_kept_real
from memopt.profile.tracker import MemoryTracker
from memopt.step.batch import compute_loss

__all__ = ["axis_layers", "sample_axis_refusal"]

_AXIS_LAYERS = (nn.RNNBase, nn.MultiheadAttention)


def axis_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers whose input layout names a batch axis (``batch_first``): recurrent layers and multi-head
    attention."""
    return [(name or "(root)", m) for name, m in model.named_modules() if isinstance(m, _AXIS_LAYERS)]


def _batch_axis_size(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The size of the batch axis of the layer's input as the layer reads it; None for an unbatched or packed
    input (a ``PackedSequence`` carries its own batch sizes)."""
    x = args[0] if args else kwargs.get("input", kwargs.get("query"))
    if not isinstance(x, torch.Tensor) or x.dim() < 3:
        return None
    return int(x.shape[0] if getattr(module, "batch_first", False) else x.shape[1])


def _seen_sizes(model: nn.Module, batch_factory: Any, loss_fn: Any, samples: int) -> dict[str, int]:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    clone = fake_copy(model, mode, "cpu")
    clone.train()
    seen: dict[str, int] = {}
    hooks = []
    for name, layer in axis_layers(clone):
        def record(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], name: str = name) -> None:
            size = _batch_axis_size(m, args, kwargs)
            if size is not None:
                seen.setdefault(name, size)
        hooks.append(layer.register_forward_pre_hook(record, with_kwargs=True))
    try:
        # the tracker answers the boolean checks models make on masks (fake tensors have no values)
        with (caches_kept_real(model), mode, real_code_paths(), grouped_mm_in_any_float(), torch.no_grad(),
              MemoryTracker("cpu", record=False)):
            compute_loss(clone, batch_factory(samples, "cpu"), loss_fn)
    finally:
        for h in hooks:
            h.remove()
    return seen


def sample_axis_refusal(model: nn.Module, batch_factory: Any, loss_fn: Any = None) -> str | None:
    """Why splitting the batch along dim 0 would cut something other than samples for ``model`` (None: every
    layer that names a batch axis sees it grow with the samples, or the model has no such layer, or the check could
    not run). ``batch_factory(b, device)`` makes a batch of ``b`` samples."""
    if not axis_layers(model):
        return None
    try:
        one = _seen_sizes(model, batch_factory, loss_fn, 1)
        two = _seen_sizes(model, batch_factory, loss_fn, 2)
    except Exception:  # the trace itself will report a model that cannot run; this check only refuses
        return None
    layers = dict(axis_layers(model))
    for name in one:
        if name in two and two[name] != 2 * one[name]:
            layer = layers[name]
            axis = 0 if getattr(layer, "batch_first", False) else 1
            return (f"its {type(layer).__name__} {name} (batch_first={getattr(layer, 'batch_first', False)}) reads "
                    f"its batch from dim {axis} of its input, which holds {one[name]} rows for 1 sample and "
                    f"{two[name]} for 2: the batch's dim 0 is not the samples (a sequence-first batch?), so a "
                    "micro-batch would be a slice of every sequence; pass batches with the samples along dim 0 "
                    "(batch_first=True) to allow micro-batching")
    return None
