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
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten

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
        with unset_fake_temporarily():
            return func(shadow)

    def adopt(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        """``real`` (a CPU tensor of the same shape and dtype) holds the values of the integer or boolean batch
        tensor ``fake``."""
        if (fake.shape == real.shape and fake.dtype == real.dtype and not fake.dtype.is_floating_point
                and not fake.dtype.is_complex and fake.numel() <= MAX_INDEX_ELEMENTS):
            self._shadow[fake] = real

    def observe(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if not isinstance(out, torch.Tensor) or out.numel() > MAX_INDEX_ELEMENTS:
            return
        with unset_fake_temporarily():
            if func in _UNIFORM:
                if out.numel() > MAX_ELEMENTS:
                    return
                high = kwargs.get("to", args[2] if func in (aten.uniform_.default, aten.uniform.default)
                                  and len(args) > 2 else 1.0)
                self._shadow[out] = torch.full(tuple(out.shape), _upper(out.dtype, float(high)), dtype=out.dtype)
                return
            tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            if not tensors and func not in _DETERMINISTIC_FACTORIES:
                return
            shadows = [self.value(a) for a in tensors]
            if any(s is None for s in shadows):
                if _writes_first_argument(func) and args and isinstance(args[0], torch.Tensor):
                    self._shadow.pop(args[0], None)  # written with values it cannot know: its shadow is stale
                return
            by_id = {id(a): s for a, s in zip(tensors, shadows)}

            def real(a: Any) -> Any:
                if isinstance(a, torch.Tensor):
                    return by_id[id(a)]
                if isinstance(a, torch.device):
                    return torch.device("cpu")
                return a

            real_kwargs = {k: v for k, v in kwargs.items() if k != "device"}
            try:
                result = func(*tree_map(real, args), **tree_map(real, real_kwargs))
            except Exception:  # an op the CPU cannot run on these values: the read keeps its default
                return
            if isinstance(result, torch.Tensor):
                self._shadow[out] = result.clone()
