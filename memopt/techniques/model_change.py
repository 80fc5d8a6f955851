"""What ``memopt.step.prepare`` hands each technique that changes the model: the techniques' side of the apply
protocol.

A technique that changes the model (its weights' dtype, its attention kernel, its blocks' ``forward``, its linears)
answers ``apply(change) -> undo`` in its registry entry (``memopt.techniques.protocol.ModelTechnique``); ``prepare``
calls them in one documented order (``memopt.step.prepare.APPLY_ORDER``) and undoes them newest first. The others
(optimizer, micro-batching, chunked loss, activation offload, allocator mode) change how the step runs, not the
model: the train step and the hard cap read them from the strategy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memopt.blocks import BlockStack
from memopt.strategy import Strategy

if TYPE_CHECKING:  # precision imports this module
    from memopt.techniques.precision import MasterWeights

__all__ = ["ModelChange", "Undo", "no_change"]

Undo = Callable[[], None]


@dataclass
class ModelChange:
    """The model as it passes from one technique to the next, and what they leave for the steps after them."""

    model: nn.Module
    strategy: Strategy
    stacks: list[BlockStack]
    # where the model trains (None: where it is); a quantized model reaches it layer by layer
    move_to: torch.device | None = None
    # a fake-tensor copy being traced: quantized linears are the profile's stand-ins, adapters get fake storage
    fake: bool = False
    quantized_stand_in: Callable[[nn.Linear, Any], nn.Module] | None = None
    # the trainable weights as the user gave them, kept by the precision cast for bf16_master's fp32 masters
    originals: list[nn.Parameter] = field(default_factory=list)
    # bf16_master's fp32 masters, one per original (set once the optimizer's masters exist): the precision's undo
    # gives their trained values back to the originals
    master: MasterWeights | None = None
    # the full-precision linears quantization replaced, by name: the adapters' undo merges into them
    quantized_originals: dict[str, nn.Module] = field(default_factory=dict)


def no_change() -> None:
    """The undo of a technique that left the model as it was."""
