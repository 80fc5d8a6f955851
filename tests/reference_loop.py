"""The unwrapped training loop that memopt's steps are compared with: one forward and backward over the whole batch,
then the optimizer step."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn


def losses_of_plain_loop(model: nn.Module, batches: Iterable[Any], loss_of: Callable[[nn.Module, Any], torch.Tensor],
                         optimizer: torch.optim.Optimizer) -> list[float]:
    """Each batch's loss, training ``model`` with ``optimizer`` one whole batch at a time."""
    losses = []
    for batch in batches:
        loss = loss_of(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses
