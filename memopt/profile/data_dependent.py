"""Ops whose output shape depends on tensor values: sized from the values' shadows, or traced at their largest.

A fake tensor has shapes but no values, so ``nonzero``, ``masked_select`` and boolean indexing cannot know how many
elements they return, and the fake trace stops there. Models use them for labels that may be missing (a
classification head gathering the labelled rows), routers that pick tokens per expert, and masks of padded
positions. Where the selecting tensor has a shadow (its real values: the batch's ids, masks and labels, and what is
computed from them and from the balanced routing of ``memopt.profile.scalar_values``) the output has its real size.
Otherwise the trace takes the largest output the op can have (every element selected): the sizes of a batch where
every label is present and every mask is full, which is what the trace's batches are (see the tracker's scalar
reads), and an upper bound of the memory otherwise. The indices of that largest ``nonzero`` are known (every
position, in order), so they get a shadow too: a loop over the hit experts can read each one's number.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from memopt.profile.scalar_values import real_values

aten = torch.ops.aten

BOUNDED_OPS = frozenset({aten.nonzero.default, aten.masked_select.default, aten.index.Tensor,
                         aten.argwhere.default, aten._pack_padded_sequence.default})

Shadow = Callable[[Any], "torch.Tensor | None"]


def _is_mask(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _selected(mask: torch.Tensor, shadow: Shadow) -> int | None:
    """How many positions ``mask`` selects, where its shadow says."""
    real = shadow(mask)
    if real is None:
        return None
    with real_values():
        return int(real.bool().sum())


def _positions(mask: torch.Tensor, shadow: Shadow) -> tuple[list[torch.Tensor], bool]:
    """Index vectors, one per dimension of ``mask``, as long as the positions it selects (all of them where its
    values are unknown), and whether that length is exact."""
    count = _selected(mask, shadow)
    n = mask.numel() if count is None else count
    return [torch.empty(n, dtype=torch.long, device=mask.device) for _ in range(mask.dim())], count is not None


def sized_output(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], shadow: Shadow,
                 max_shadow_elements: int) -> tuple[Any, bool, tuple[torch.Tensor, torch.Tensor] | None]:
    """``(output, exact, shadow)`` for a value-dependent op: the output at its real size where the selecting
    tensor's values are known (``exact``), else at its largest; ``shadow`` is ``(tensor, values)`` for an output
    whose values are known (the largest ``nonzero``'s indices, a packed sequence's ``batch_sizes``), else None.
    ``output`` is ``NotImplemented`` for an op this module does not know."""
    if func in (aten.nonzero.default, aten.argwhere.default):
        x = args[0]
        count = _selected(x, shadow)
        if count is not None:
            return torch.empty((count, x.dim()), dtype=torch.long, device=x.device), True, None
        known = None
        if x.numel() * x.dim() <= max_shadow_elements:
            with real_values():
                known = torch.ones(tuple(x.shape), dtype=torch.bool).nonzero()
        out = torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
        return out, False, (out, known) if known is not None else None
    if func is aten._pack_padded_sequence.default:
        return _packed(args, kwargs, shadow)
    if func is aten.masked_select.default:
        x, mask = args[0], args[1]
        shape = torch.broadcast_shapes(x.shape, mask.shape)
        real = shadow(mask)
        count = None
        if real is not None:
            with real_values():
                count = int(torch.broadcast_to(real.bool(), tuple(shape)).sum())
        n = shape.numel() if count is None else count
        return torch.empty(n, dtype=x.dtype, device=x.device), count is not None, None
    if func is aten.index.Tensor:
        x, indices = args[0], list(args[1])
        if not any(_is_mask(i) for i in indices):
            return NotImplemented, False, None
        expanded: list[Any] = []
        exact = True
        for i in indices:
            if _is_mask(i):
                vectors, known = _positions(i, shadow)
                expanded.extend(vectors)
                exact = exact and known
            else:
                expanded.append(i)
        return func(x, expanded, **kwargs), exact, None
    return NotImplemented, False, None


def _packed(args: tuple[Any, ...], kwargs: dict[str, Any], shadow: Shadow) -> tuple[Any, bool, Any]:
    """``pack_padded_sequence``: the packed rows (one per real time step of each sequence) and ``batch_sizes`` (the
    sequences still running at each step, a real CPU tensor, as the recurrent kernels read its values), from the
    lengths' shadow, else every sequence at full length."""
    x, lengths = args[0], args[1]
    batch_first = bool(args[2]) if len(args) > 2 else bool(kwargs.get("batch_first", False))
    steps, batch = (x.shape[1], x.shape[0]) if batch_first else (x.shape[0], x.shape[1])
    real = shadow(lengths)
    with real_values():
        lens = [int(v) for v in real.tolist()] if real is not None else []
    if len(lens) != batch or not all(0 < n <= steps for n in lens):
        # no values, or a batch made from the sample's structure alone (its integers are zeros, lengths the real
        # op refuses): every sequence at full length
        real, lens = None, [steps] * batch
    with real_values():
        sizes = torch.tensor([sum(1 for n in lens if n > t) for t in range(max(lens, default=0))], dtype=torch.long)
    data = torch.empty((sum(lens), *x.shape[2:]), dtype=x.dtype, device=x.device)
    # a real tensor: the recurrent kernels read batch_sizes through its data pointer, which a fake tensor has not;
    # it is its own shadow, for the Python reads of it (nn.LSTM's max_batch_size)
    return (data, sizes), real is not None, (sizes, sizes)
