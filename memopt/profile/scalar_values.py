"""The values of the few tiny tensors a traced step reads, where the trace can know them.

A fake tensor has no values, yet models branch on tiny tensors: LayerDrop draws ``torch.rand([])`` and skips the
layer when it is below ``layerdrop``, which is often 0; a constant made with ``torch.tensor`` is compared with a
config value. Treating every such read as True (the tracker's answer for a mask it cannot see) skipped every
layer of a model with LayerDrop, and its trace counted none of their activations.

So tiny tensors carry a real shadow: a uniform random draw reads as the largest value it can take (a sampled skip
``rand < p`` never fires, and the trace is of the step where every layer runs, the largest), a constant reads
as itself, and an op whose inputs all have shadows computes its output's shadow on the CPU. The batch's integer
and boolean tensors (token ids, masks, labels) get the values of a real batch made by the same factory
(:meth:`ScalarShadows.adopt`), so the lengths and flags a model reads from them (XLM's ``lengths.max().item()``,
Longformer's count of global tokens) are the real batch's. A shadow computed from shadows may be as large as a batch
(a mask made float); random draws get one only when tiny. A read of a tensor without a shadow keeps the tracker's
default.

Checks for NaN or infinity over activations (a model's ``assert not torch.isnan(h).any()``, ``torch.isfinite``) read
as they do in a step that trains: finite. Their shadow is a stride-0 view, so it costs nothing however large the
activation.

A router's choice (``topk``, ``argmax`` or ``max`` over logits the trace has no values of) gets a balanced shadow:
row ``r`` picks experts ``r*k .. r*k+k-1`` modulo their number, distinct within a row, every expert as often as any
other. Routing is the one value a memory plan cannot know ahead; balanced is its expectation, and what an eager
expert loop then saves for backward sums to the same bytes under any routing (each routed token once), which is
what transformers' grouped GEMM traces without reading values. The loop's own reads (which experts were hit, how
many tokens each got) then follow from the shadow instead of stopping the trace.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten

def real_values() -> Any:
    """A context where shadow maths runs on plain CPU tensors: outside the fake mode and outside every other
    dispatch mode on the stack (a tracker a caller left entered would count these ops, and answer their reads, as
    its own)."""
    return _disable_current_modes()


MAX_ELEMENTS = 16  # larger random draws are data (dropout noise, masking), not control values
MAX_INDEX_ELEMENTS = 1 << 22  # a batch's ids and masks and what is computed from them alone (masks made float)

_UNIFORM = {aten.rand.default, aten.rand_like.default, aten.uniform_.default, aten.uniform.default}
# factories whose values follow from their arguments alone (a model's default mask: torch.ones(batch, length))
_DETERMINISTIC_FACTORIES = {aten.ones.default, aten.zeros.default, aten.full.default, aten.arange.default,
                            aten.arange.start, aten.arange.start_step, aten.scalar_tensor.default, aten.eye.default}


def _upper(dtype: torch.dtype, high: float = 1.0) -> float:
    """The largest value below ``high`` that ``dtype`` holds: where torch's uniform draws end."""
    if not dtype.is_floating_point:
        return high
    return float(torch.nextafter(torch.tensor(high, dtype=dtype), torch.tensor(-math.inf, dtype=dtype)))


def _tensor_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors among an aten op's arguments: an aten schema nests at most one list deep (``cat``'s tensors,
    ``index``'s optional indices), so this is ``tree_flatten``'s answer without its per-op cost."""
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(x for x in a if isinstance(x, torch.Tensor))
    return found


def _unaliased(result: torch.Tensor, inputs: list[torch.Tensor]) -> torch.Tensor:
    """``result`` as an output's own shadow: copied where it shares memory with an input's shadow (a view, which a
    later in-place op on either would otherwise change in both), kept where it is new or is the written input
    itself (an in-place op's result is its first argument's shadow, already updated)."""
    if any(result is s for s in inputs):
        return result
    ptr = result.untyped_storage().data_ptr()
    if ptr and all(s.untyped_storage().data_ptr() != ptr for s in inputs):
        return result
    return result.clone()


@functools.cache
def _writes_first_argument(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write


class ScalarShadows:
    """Real CPU copies of tiny fake tensors whose values follow from constants and uniform draws."""

    def __init__(self) -> None:
        self._shadow: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def value(self, t: Any) -> torch.Tensor | None:
        if not isinstance(t, torch.Tensor):
            return None
        found = self._shadow.get(t)
        if found is not None:
            return found
        constant = getattr(t, "constant", None)  # FakeTensorMode keeps small torch.tensor(...) constants
        return constant if isinstance(constant, torch.Tensor) else None

    @staticmethod
    def read(func: Any, shadow: torch.Tensor) -> Any:
        """``func`` (a scalar read: ``.item()``, ``bool()``) applied to a shadow, outside the fake mode."""
        with real_values():
            return func(shadow)

    def adopt(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        """``real`` (a CPU tensor of the same shape and dtype) holds the values of the integer or boolean batch
        tensor ``fake``."""
        if (fake.shape == real.shape and fake.dtype == real.dtype and not fake.dtype.is_floating_point
                and not fake.dtype.is_complex and fake.numel() <= MAX_INDEX_ELEMENTS):
            self._shadow[fake] = real

    def observe(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        # called for every op of every trace: the cheap refusals come before the mode stack is left
        if isinstance(out, (tuple, list)):
            self._observe_many(func, args, kwargs, out)
            return
        if not isinstance(out, torch.Tensor):
            return
        if func in _FINITE_CHECKS and out.dtype == torch.bool:
            answer = self._finite_answer(func, args)
            if answer is not None:  # a stride-0 view: as large as the activation it checks, at no cost
                with real_values():
                    self._shadow[out] = torch.tensor(answer).expand(tuple(out.shape))
                return
        if out.numel() > MAX_INDEX_ELEMENTS:
            return
        if func in _CHOICES and self.value(args[0]) is None:
            with real_values():
                self._shadow[out] = _balanced_choice(func, args, kwargs, out)
            return
        if func in _UNIFORM:
            if out.numel() > MAX_ELEMENTS:
                return
            high = kwargs.get("to", args[2] if func in (aten.uniform_.default, aten.uniform.default)
                              and len(args) > 2 else 1.0)
            with real_values():
                self._shadow[out] = torch.full(tuple(out.shape), _upper(out.dtype, float(high)), dtype=out.dtype)
            return
        tensors = _tensor_arguments(args, kwargs)
        if not tensors and func not in _DETERMINISTIC_FACTORIES:
            return
        shadows = [self.value(a) for a in tensors]
        if any(s is None for s in shadows):
            if _writes_first_argument(func) and args and isinstance(args[0], torch.Tensor):
                self._shadow.pop(args[0], None)  # written with values it cannot know: its shadow is stale
            return
        with real_values():
            result = _run_real(func, args, kwargs, tensors, shadows)
            if isinstance(result, torch.Tensor):
                self._shadow[out] = _unaliased(result, shadows)

    def _finite_answer(self, func: Any, args: tuple[Any, ...]) -> bool | None:
        """What a check for NaN or infinity over a floating tensor without values answers in a training step whose
        activations are finite (a model's NaN guard, ``torch.isfinite``'s ``x == x`` and ``|x| != inf``): the
        trace is of the step that trains, not of the one that raises or repairs; None where this is no such check."""
        first = args[0] if args else None
        if not isinstance(first, torch.Tensor) or not first.dtype.is_floating_point or self.value(first) is not None:
            return None
        if func in (aten.eq.Tensor, aten.ne.Tensor):
            return (func is aten.eq.Tensor) if len(args) > 1 and args[1] is first else None
        if func in (aten.eq.Scalar, aten.ne.Scalar):
            other = args[1] if len(args) > 1 else None
            if not isinstance(other, (int, float)) or math.isfinite(other):
                return None
            return func is aten.ne.Scalar  # no value equals infinity or NaN
        return _FINITE_CHECKS[func]

    def _observe_many(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], outs: Any) -> None:
        """Shadows for an op with several outputs: ``unbind`` and ``split`` of a shadowed tensor (iterating over
        the hit experts), ``sort`` of routed indices; a router's ``topk``/``max`` gets balanced indices."""
        tensors = _tensor_arguments(args, kwargs)
        if not tensors or any(o.numel() > MAX_INDEX_ELEMENTS for o in outs if isinstance(o, torch.Tensor)):
            return
        with real_values():
            if func in _CHOICES and self.value(args[0]) is None:
                self._shadow[outs[1]] = _balanced_choice(func, args, kwargs, outs[1])
                return
            shadows = [self.value(a) for a in tensors]
            if any(v is None for v in shadows):
                return
            results = _run_real(func, args, kwargs, tensors, shadows)
            if not isinstance(results, (tuple, list)) or len(results) != len(outs):
                return
            for o, r in zip(outs, results):
                if isinstance(o, torch.Tensor) and isinstance(r, torch.Tensor):
                    self._shadow[o] = r.clone()


def _run_real(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], tensors: list[torch.Tensor],
              shadows: list[torch.Tensor]) -> Any:
    """``func`` on the CPU with each of its tensor arguments (``tensors``) replaced by its shadow; None where the CPU
    cannot run it on these values (a read then keeps its default)."""
    by_id = {id(a): v for a, v in zip(tensors, shadows)}

    def real(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return by_id[id(a)]
        if isinstance(a, torch.device):
            return torch.device("cpu")
        return a

    real_kwargs = {k: v for k, v in kwargs.items() if k != "device"}
    try:
        return func(*tree_map(real, args), **tree_map(real, real_kwargs))
    except Exception:
        return None


# checks for NaN and infinity, and their answer over finite values (None: it depends on the arguments)
_FINITE_CHECKS = {aten.isnan.default: False, aten.isinf.default: False, aten.isposinf.default: False,
                  aten.isneginf.default: False, aten.eq.Tensor: None, aten.ne.Tensor: None, aten.eq.Scalar: None,
                  aten.ne.Scalar: None}

# a router's choice over logits: the indices output is balanced (module docstring)
_CHOICES = {aten.topk.default, aten.argmax.default, aten.argmin.default, aten.max.dim, aten.min.dim}


def _balanced_choice(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], indices: torch.Tensor) -> torch.Tensor:
    """Indices for ``func`` over values nobody knows: row ``r`` of the chosen dim picks ``r*k + j`` modulo its size."""
    x = args[0]
    if func is aten.topk.default:
        dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
    elif func in (aten.max.dim, aten.min.dim):
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    else:
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if dim is None or x.dim() == 0:  # argmax over every element: one flat index
        return torch.zeros(tuple(indices.shape), dtype=torch.long)
    dim = dim % x.dim()
    n = x.shape[dim]
    moved = list(indices.shape)
    keepdim = indices.dim() == x.dim()
    k = indices.shape[dim] if keepdim else 1
    if keepdim:
        moved.append(moved.pop(dim))
    else:
        moved.append(1)
    rows = max(1, indices.numel() // k)
    flat = (torch.arange(rows).unsqueeze(1) * k + torch.arange(k).unsqueeze(0)) % n
    out = flat.reshape(moved)
    out = out.movedim(-1, dim) if keepdim else out.squeeze(-1)
    return out.contiguous()


class ShadowFormatting(TorchFunctionMode):
    """Formats a 0-dim tensor with a shadow as its value, as a real tensor formats: a model that names a submodule
    from a tensor (``self[f"expert_{idx}"]``) finds it. Other calls pass through untouched."""

    def __init__(self, shadows: ScalarShadows) -> None:
        super().__init__()
        self.shadows = shadows

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.__format__ and args and args[0].dim() == 0:
            known = self.shadows.value(args[0])
            if known is not None:
                with real_values():
                    return known.item().__format__(*args[1:])
        return func(*args, **(kwargs or {}))
