"""The checks and choices ``memopt.wrap`` makes before planning: the optimizer argument, what the target is, a
model it cannot train as planned."""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from memopt.techniques.micro_batching import micro_batch_refusal

__all__ = ["check_model", "is_trainer", "micro_batch_warning"]


def is_trainer(obj: Any) -> bool:
    return hasattr(obj, "args") and hasattr(obj, "model") and hasattr(obj, "create_optimizer")


def check_model(model: nn.Module, *, weights_pending: bool = False) -> None:
    if type(model).__name__ == "OptimizedModule" or hasattr(model, "_orig_mod"):
        raise ValueError("memopt.wrap does not support torch.compile'd models: compiled graphs allocate memory "
                         "that memopt's plan does not account for. Wrap the uncompiled model")
    if not weights_pending and any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError("the model has parameters on the meta device (no weights): load or initialize the weights "
                         "first, pass checkpoint=<safetensors file(s)> to load them under the plan, or use "
                         "memopt.plan(...) for a dry run without weights")


def micro_batch_warning(model: nn.Module, micro: int, global_batch: int, profiled: str | None = None) -> None:
    """A plan that micro-batches a model the planner would not split (only when the user pinned the micro-batch):
    BatchNorm, or ``profiled``, the profile's reason (a batch whose dim 0 is not the samples), changes training:
    say so where the user runs it."""
    reason = micro_batch_refusal(model) or profiled
    if reason is not None and micro < global_batch:
        warnings.warn(f"the plan splits each batch of {global_batch} into micro-batches of {micro}, but {reason}; "
                      f"pin micro_batch_size={global_batch} (or leave it unpinned) to keep training exact",
                      stacklevel=3)
