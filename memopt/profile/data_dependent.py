"""Ops whose output shape depends on tensor values: sized from the values' shadows, or traced at their largest.

A fake tensor has shapes but no values, so ``nonzero``, ``masked_select``, boolean indexing, ``unique``,
``unique_consecutive``, ``bincount`` and ``repeat_interleave`` (with a tensor of repeats) cannot know how many elements
they return, and the fake trace stops there. Models use them for labels that may be missing (a classification head
gathering the labelled rows), routers that pick tokens per expert, masks of padded positions, a check that every row
holds as many end-of-sequence tokens (BART's classification head: ``unique_consecutive`` of their counts) and
class-balanced losses (``bincount`` of the labels). Where the tensor the size depends on has a shadow (its real values:
the batch's ids, masks and labels, and what is computed from them and from the balanced routing of
``memopt.profile.scalar_values``) the output has its real size. Otherwise the trace takes the largest output the op
can have (every element selected, every value distinct): the sizes of a batch where every label is present and every
mask is full, which is what the trace's batches are (see the tracker's scalar reads), and an upper bound of the memory
otherwise. The indices of that largest ``nonzero`` are known (every position, in order), so they get a shadow too: a
loop over the hit experts can read each one's number.

``bincount`` (largest value + 1 bins) and ``repeat_interleave`` (the sum of the repeats) have no largest output
over values nobody knows, except for 8- and 16-bit integers, whose largest value bounds them: elsewhere the trace
stops with :class:`UnboundedOutput`, which says what would make the size known.

CTC's ``_ctc_loss`` keeps ``log_alpha`` (batch, time, 2 * longest target + 1) for its backward: the longest target
is the target lengths' largest value, from their shadow (a CTC head computes them from the batch's labels), else
bounded by the targets themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from memopt.profile.scalar_values import real_values

aten = torch.ops.aten

# the unique family: (values, inverse, counts), or (values, inverse) for the legacy ``_unique``
_UNIQUE_OPS = frozenset({aten._unique.default, aten._unique2.default, aten.unique_dim.default,
                         aten.unique_consecutive.default, aten.unique_dim_consecutive.default})
_CONSECUTIVE = frozenset({aten.unique_consecutive.default, aten.unique_dim_consecutive.default})

# CTC's forward keeps log_alpha, (batch, time, 2 * longest target + 1): its size is the target lengths' largest value
_CTC_OPS = frozenset({aten._ctc_loss.default, aten._ctc_loss.Tensor})

BOUNDED_OPS = frozenset({aten.nonzero.default, aten.masked_select.default, aten.index.Tensor,
                         aten.argwhere.default, aten._pack_padded_sequence.default, aten.bincount.default,
                         aten.repeat_interleave.Tensor, *_UNIQUE_OPS, *_CTC_OPS})


class UnboundedOutput(RuntimeError):
    """An op's output size depends on values the trace has not, and no value of its input's dtype bounds it: the
    step cannot be traced (the profile reports it as the step's failure, with what would make the size known)."""

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
    if func in _UNIQUE_OPS:
        return _unique(func, _arguments(func, args, kwargs), shadow)
    if func is aten.bincount.default:
        return _bincount(_arguments(func, args, kwargs), shadow)
    if func is aten.repeat_interleave.Tensor:
        return _repeated(_arguments(func, args, kwargs), shadow)
    if func in _CTC_OPS:
        return _ctc(_arguments(func, args, kwargs), shadow)
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


def _arguments(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The op's arguments by their schema's names, the defaults filled in."""
    named: dict[str, Any] = {}
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args):
            named[arg.name] = args[i]
        elif arg.name in kwargs:
            named[arg.name] = kwargs[arg.name]
        else:
            named[arg.name] = arg.default_value if arg.has_default_value() else None
    return named


def _on_shadows(func: Any, named: dict[str, Any], shadow: Shadow, sized_by: str) -> Any:
    """``func`` run on the CPU with the shadow of its argument ``sized_by`` (the tensor its output size depends on)
    and zeros of the other tensor arguments' shapes (they set the output's dtype, not its size); None where that
    argument has no shadow."""
    real = shadow(named[sized_by])
    if real is None:
        return None
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    with real_values():
        for arg in func._schema.arguments:
            v = named[arg.name]
            v = real if arg.name == sized_by else torch.zeros(tuple(v.shape), dtype=v.dtype) \
                if isinstance(v, torch.Tensor) else v
            if arg.kwarg_only:
                kwargs[arg.name] = v
            else:
                args.append(v)
        return func(*args, **kwargs)


def _like(real: Any, device: torch.device) -> Any:
    """Empty tensors (fake ones, in the trace) of the shapes and dtypes of ``real``'s, on ``device``."""
    if isinstance(real, (tuple, list)):
        return tuple(torch.empty(tuple(r.shape), dtype=r.dtype, device=device) for r in real)
    return torch.empty(tuple(real.shape), dtype=real.dtype, device=device)


def _dtype_range(t: torch.Tensor) -> tuple[int, int] | None:
    """The smallest and largest values a tensor of ``t``'s dtype holds, for bool and the 8- and 16-bit integers: few
    enough to bound a size computed from values by; None for wider dtypes, whose bounds no memory plan could use."""
    if t.dtype == torch.bool:
        return 0, 1
    if t.dtype in (torch.uint8, torch.int8, torch.int16):
        info = torch.iinfo(t.dtype)
        return int(info.min), int(info.max)
    return None


def _unique(func: Any, named: dict[str, Any], shadow: Shadow) -> tuple[Any, bool, None]:
    """The unique family: its outputs at their real size where the input has a shadow, else with every element (or
    every slice along ``dim``) distinct; a sorted set of 8- or 16-bit values (bool too) holds at most as many
    values as the dtype has, a run-length one as many as there are elements."""
    x = named["self"]
    real = _on_shadows(func, named, shadow, "self")
    if real is not None:
        return _like(real, x.device), True, None
    dim = named.get("dim")
    if dim is None:
        n = x.numel()
        held = _dtype_range(x)
        if held is not None and func not in _CONSECUTIVE:
            n = min(n, held[1] - held[0] + 1)
        values = torch.empty(n, dtype=x.dtype, device=x.device)
        inverse = torch.empty(tuple(x.shape) if named["return_inverse"] else (0,), dtype=torch.long, device=x.device)
        counts = torch.empty(n if named.get("return_counts") else 0, dtype=torch.long, device=x.device)
    else:
        # along a dim the kernels return the inverse and the counts whatever is asked (one per slice)
        n = x.shape[dim % max(x.dim(), 1)]
        values = torch.empty(tuple(x.shape), dtype=x.dtype, device=x.device)
        inverse = torch.empty(n, dtype=torch.long, device=x.device)
        counts = torch.empty(n, dtype=torch.long, device=x.device)
    outputs = (values, inverse) if func is aten._unique.default else (values, inverse, counts)
    return outputs, False, None


def _bincount(named: dict[str, Any], shadow: Shadow) -> tuple[Any, bool, None]:
    """``bincount``: ``max(minlength, largest value + 1)`` bins, the largest value from the input's shadow, else
    from its dtype where that is 8 or 16 bits wide; no bound otherwise (:class:`UnboundedOutput`)."""
    x, weights = named["self"], named["weights"]
    real = _on_shadows(aten.bincount.default, named, shadow, "self")
    if real is not None:
        return _like(real, x.device), True, None
    held = _dtype_range(x)
    if held is None:
        # kept under the 300 characters of the step failure a plan reports (memopt.profile.step_failures)
        raise UnboundedOutput(
            f"torch.bincount of {str(x.dtype).removeprefix('torch.')} values the trace cannot know: its size (largest "
            "value + 1) has no bound before the step runs; bincount the batch's labels or ids (or values computed from "
            "them alone), or count into fixed bins: F.one_hot(x, num_classes).sum(0)")
    with real_values():  # the dtype of the counts (int64, or the weights' float type) from the kernel itself
        dtype = torch.bincount(torch.zeros(1, dtype=torch.long),
                               None if weights is None else torch.zeros(1, dtype=weights.dtype)).dtype
    return torch.empty(max(int(named["minlength"]), held[1] + 1), dtype=dtype, device=x.device), False, None


def _repeated(named: dict[str, Any], shadow: Shadow) -> tuple[Any, bool, None]:
    """``repeat_interleave`` of a tensor of repeats: ``repeats.sum()`` indices, from the repeats' shadow, else each
    repeat at its dtype's largest value where that is 8 or 16 bits wide; with ``output_size`` the fake op sizes it
    itself; no bound otherwise (:class:`UnboundedOutput`)."""
    repeats = named["repeats"]
    if named.get("output_size") is not None:
        return NotImplemented, False, None
    real = _on_shadows(aten.repeat_interleave.Tensor, named, shadow, "repeats")
    if real is not None:
        return _like(real, repeats.device), True, None
    held = _dtype_range(repeats)
    if held is None:
        raise UnboundedOutput(
            "torch.repeat_interleave with repeats the trace cannot know: its size (repeats.sum()) has no bound before "
            "the step runs; pass output_size= (the largest total your batches need), or repeats computed from the "
            "batch's own integers alone")
    return torch.empty(held[1] * repeats.numel(), dtype=repeats.dtype, device=repeats.device), False, None


def _ctc(named: dict[str, Any], shadow: Shadow) -> tuple[Any, bool, None]:
    """``_ctc_loss``: ``(neg_log_likelihood (batch,), log_alpha (batch, time, 2 * longest target + 1))``, as the CPU
    and CUDA kernels allocate them; the longest target from the target lengths (a list, or a tensor's shadow), else
    the targets' own bound: their width (a padded ``(batch, longest)`` tensor) or every target in one (concatenated
    ones)."""
    log_probs, targets, lengths = named["log_probs"], named["targets"], named["target_lengths"]
    exact = True
    if isinstance(lengths, torch.Tensor):
        real = shadow(lengths)
        if real is None:
            exact = False
            longest = int(targets.shape[1]) if targets.dim() == 2 else int(targets.numel())
        else:
            with real_values():
                longest = int(real.max()) if real.numel() else 0
    else:
        longest = max((int(n) for n in lengths), default=0)
    batch, steps = int(log_probs.shape[1]), int(log_probs.shape[0])
    nll = torch.empty(batch, dtype=log_probs.dtype, device=log_probs.device)
    alpha = torch.empty((batch, steps, 2 * longest + 1), dtype=log_probs.dtype, device=log_probs.device)
    return (nll, alpha), exact, None
