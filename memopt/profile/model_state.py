"""The model state that a variant with extras records: every parameter and buffer of the transformed, block-truncated
model with the (stack, block) it belongs to (:func:`model_state_entries`), and the full model's state laid out from it
by repeating the traced block that stands for each position (:func:`expand_model_state`, :func:`traced_unit`). The
estimate and the optimizer's scaling read the same layout, so it lives on its own beside the tracing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

__all__ = ["expand_model_state", "model_state_entries", "traced_unit"]


def expand_model_state(state: dict[str, Any], traced_blocks: Sequence[int], full_counts: Sequence[int]
                       ) -> tuple[list[tuple[tuple[int, ...], str, bool]], list[tuple[tuple[int, ...], str]]]:
    """The full model's parameters ``(shape, dtype, trainable)`` and buffers ``(shape, dtype)``, in the model's
    order, from a truncated model's state: each traced block's tensors once for every block position it stands
    for (blocks are uniform; the middle one stands for all but the first two and the last)."""

    def expand(entries: list[list[Any]], width: int) -> list[tuple[Any, ...]]:
        out: list[tuple[Any, ...]] = []
        i = 0
        while i < len(entries):
            tag = tuple(entries[i][width:width + 2])
            j = i
            while j < len(entries) and tuple(entries[j][width:width + 2]) == tag:
                j += 1
            stack, unit = tag
            times = 1
            if stack >= 0:
                full, traced = full_counts[stack], traced_blocks[stack]
                times = sum(1 for p in range(full) if traced_unit(p, full, traced) == unit)
            group = [(tuple(e[0]), *e[1:width]) for e in entries[i:j]]
            out += group * times
            i = j
        return out

    params = [(shape, dtype, bool(grad)) for shape, dtype, grad in expand(state["params"], 3)]
    buffers = [(shape, dtype) for shape, dtype in expand(state["buffers"], 2)]
    return params, buffers


def traced_unit(position: int, full: int, traced: int) -> int:
    """Which traced block stands for block ``position`` of a stack of ``full`` blocks."""
    if full <= traced or position < 2:
        return position
    return traced - 1 if position == full - 1 else 2


def model_state_entries(model: nn.Module, stacks: Sequence[Any]) -> dict[str, Any]:
    """Every distinct parameter and buffer of ``model`` (as a simulated step counts them: ``parameters()``, then
    ``buffers()``), each with the (stack, block) it belongs to, (-1, -1) outside the blocks."""
    where: dict[int, tuple[int, int]] = {}
    for s, stack in enumerate(stacks):
        for u, block in enumerate(stack.blocks):
            for t in [*block.parameters(), *block.buffers()]:
                where.setdefault(id(t), (s, u))
    params = [[list(p.shape), str(p.dtype).removeprefix("torch."), bool(p.requires_grad), *where.get(id(p), (-1, -1))]
              for p in model.parameters()]
    buffers = [[list(b.shape), str(b.dtype).removeprefix("torch."), *where.get(id(b), (-1, -1))]
               for b in model.buffers()]
    return {"params": params, "buffers": buffers}
