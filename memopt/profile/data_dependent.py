"""Ops whose output shape depends on tensor values, traced at their largest size.

A fake tensor has shapes but no values, so ``nonzero``, ``masked_select`` and boolean indexing cannot know how many
elements they return, and the fake trace stops there. Models use them for labels that may be missing (a
classification head gathering the labelled rows), routers that pick tokens per expert, and masks of padded
positions. The trace takes the largest output those ops can have (every element selected): the sizes of a batch
where every label is present and every mask is full, which is what the trace's batches are (see the tracker's
scalar reads), and an upper bound of the memory otherwise.
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten

BOUNDED_OPS = frozenset({aten.nonzero.default, aten.masked_select.default, aten.index.Tensor,
                         aten.argwhere.default})


def _is_mask(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _all_positions(mask: torch.Tensor) -> list[torch.Tensor]:
    """The index vectors that every position of ``mask`` selected would give: one per dimension."""
    return [torch.empty(mask.numel(), dtype=torch.long, device=mask.device) for _ in range(mask.dim())]


def largest_output(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The output of ``func`` when every element is selected, or ``NotImplemented`` for an op it does not know."""
    if func in (aten.nonzero.default, aten.argwhere.default):
        x = args[0]
        return torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
    if func is aten.masked_select.default:
        x, mask = args[0], args[1]
        shape = torch.broadcast_shapes(x.shape, mask.shape)
        return torch.empty(shape.numel(), dtype=x.dtype, device=x.device)
    if func is aten.index.Tensor:
        x, indices = args[0], list(args[1])
        if not any(_is_mask(i) for i in indices):
            return NotImplemented
        expanded: list[Any] = []
        for i in indices:
            if _is_mask(i):
                expanded.extend(_all_positions(i))
            else:
                expanded.append(i)
        return func(x, expanded, **kwargs)
    return NotImplemented
