"""Micro-batching: the global batch split along dim 0 into ``micro_batch_size`` samples per forward and backward,
the gradients accumulated exactly (``memopt.step.train_step``). The split is exact only where a sample's loss and
gradients do not depend on the other samples of its forward: BatchNorm in training normalizes with the statistics of
the batch it sees, so on a micro-batch it computes other activations and updates its running statistics more often.
Such a model is not micro-batched unless the user pins a micro-batch size (the plan and ``memopt.wrap`` say so). The
same goes for a parameter with a post-accumulate-grad hook: it sees ``.grad`` after each micro-batch's backward, a
partial sum, where the unwrapped loop's hook sees the whole batch's gradient once.

A BatchNorm layer that sees one value per channel of each sample (``BatchNorm1d`` over ``(batch, features)``, a
``1x1`` map) cannot train on a micro-batch of one sample at all (torch refuses statistics of one value):
:func:`batch_statistics_guard` names the layer when a traced step would, and the plan refuses that micro-batch size
with the reason (:class:`MicroBatchTooSmall`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from memopt.blocks import hookable

__all__ = ["MicroBatchTooSmall", "batch_coupled_modules", "batch_statistics_guard", "micro_batch_refusal",
           "post_accumulate_hooked"]


class MicroBatchTooSmall(ValueError):
    """A training forward at this micro-batch size would give a BatchNorm layer one value per channel."""


def batch_coupled_modules(model: nn.Module) -> list[str]:
    """The modules whose training forward mixes the samples of a batch: BatchNorm and its subclasses, except a
    layer frozen in eval mode inside a model in training mode (fine-tuning with frozen statistics: it normalizes
    each sample with its running statistics). A model wholly in eval mode is taken to train in training mode."""
    def coupled(m: nn.Module) -> bool:
        return m.training or not model.training or getattr(m, "running_mean", None) is None

    return [name or "(root)" for name, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and coupled(m)]


def micro_batch_refusal(model: nn.Module) -> str | None:
    """Why splitting a batch into micro-batches would not be exact for ``model`` (None: it would be)."""
    names = batch_coupled_modules(model)
    if names:
        return (f"its BatchNorm layers ({_shown(names)}) normalize with the statistics of the batch they see, so "
                "micro-batches would change training")
    hooked = post_accumulate_hooked(model)
    if hooked:
        return (f"its parameters {_shown(hooked)} carry post-accumulate-grad hooks (register_post_accumulate_grad_hook:"
                " per-parameter clipping, an optimizer step in backward), which would run once per micro-batch on a "
                "part of the gradient instead of once on the whole")
    return None


def post_accumulate_hooked(model: nn.Module) -> list[str]:
    """The parameters of ``model`` that carry a post-accumulate-grad hook: it runs each time a backward has
    accumulated into ``.grad``, so once per micro-batch, on a partial sum."""
    return [name for name, p in model.named_parameters() if getattr(p, "_post_accumulate_grad_hooks", None)]


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


@contextmanager
def batch_statistics_guard(model: nn.Module) -> Iterator[None]:
    """While active, a training forward that would give one of ``model``'s BatchNorm layers a single value per
    channel raises :class:`MicroBatchTooSmall` naming the layer and the micro-batch size (instead of torch's
    anonymous "Expected more than 1 value per channel"); works on fake tensors (only shapes are read)."""

    def guard(name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0] if args else None
            batch_stats = module.training or getattr(module, "running_mean", None) is None
            if not batch_stats or not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[0] < 1:
                return
            per_sample = math.prod(x.shape[2:])
            if x.shape[0] * per_sample == 1:
                raise MicroBatchTooSmall(
                    f"a micro-batch of {x.shape[0]} sample cannot train this model: its BatchNorm layer {name} gets "
                    f"an input of shape {tuple(x.shape)}, one value per channel, and training normalizes over the "
                    f"values of each channel; each micro-batch needs at least 2 samples")
        return hook

    handles = [m.register_forward_pre_hook(guard(name or "(root)")) for name, m in model.named_modules()
               if isinstance(m, nn.modules.batchnorm._BatchNorm) and hookable(m)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
