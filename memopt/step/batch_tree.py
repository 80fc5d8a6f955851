"""Walking a batch's containers: what counts as a batch, its tensors, the same batch with its tensors mapped.

A batch is a tensor, or a tuple, list, dict or dataclass of batches, nested to any depth; anything else inside it
(an int, a string, ``None``) is a leaf passed through unchanged. A rebuilt container keeps its type (a namedtuple,
a ``BatchEncoding``, a dataclass). Every other part of the batch contract (``memopt.step.batch`` and the modules it
draws on) reaches the tensors through these walkers only, so they all agree on what a batch holds and in which
order (``leaves``' order is the order ``memopt.step.batch_like`` fills them in).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["fields", "is_batch", "is_dataclass_batch", "is_fake", "is_namedtuple", "leaves", "rebuilt", "structure",
           "tensors", "tree_map"]


def is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def is_dataclass_batch(x: Any) -> bool:
    """A dataclass instance holding the batch's tensors in its fields (``Batch(x=..., y=...)``)."""
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def is_fake(t: Any) -> bool:
    """A FakeTensor (the profile's trace of the step): it has no values to read, pin or count."""
    return type(t).__name__ == "FakeTensor"


def fields(batch: Any) -> list[str]:
    """A dataclass batch's fields that its constructor takes (the others are derived from them)."""
    return [f.name for f in dataclasses.fields(batch) if f.init]


def is_batch(x: Any) -> bool:
    """Whether ``x`` is a structure memopt trains on: a tensor, mapping, list, tuple or dataclass instance."""
    return isinstance(x, (torch.Tensor, Mapping, list, tuple)) or is_dataclass_batch(x)


def rebuilt(batch: Mapping, items: dict[Any, Any]) -> Mapping:
    """``items`` in ``batch``'s mapping type (a BatchEncoding or OrderedDict stays one), or a dict where that type
    cannot be built from a dict."""
    try:
        return type(batch)(items)
    except TypeError:
        return items


def tree_map(fn: Callable[[torch.Tensor], Any], batch: Any, *, records: Callable[[list], Any] | None = None,
             record_ids: frozenset[int] = frozenset()) -> Any:
    """``batch`` with every tensor leaf replaced by ``fn(leaf)``; containers keep their types. A list whose ``id`` is
    in ``record_ids`` (per-sample records: ``memopt.step.batch_samples.record_lists``) is replaced by
    ``records(list)`` as a whole, where ``records`` is given."""
    def walk(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            return fn(node)
        if isinstance(node, Mapping):
            return rebuilt(node, {k: walk(v) for k, v in node.items()})
        if is_namedtuple(node):
            return type(node)(*(walk(v) for v in node))
        if records is not None and id(node) in record_ids:
            return records(node)
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v) for v in node)
        if is_dataclass_batch(node):
            return dataclasses.replace(node, **{k: walk(getattr(node, k)) for k in fields(node)})
        return node

    return walk(batch)


def leaves(batch: Any, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor: ``x``, ``[0]``, ``inputs[1].mask``."""
    if isinstance(batch, torch.Tensor):
        return [(path or "batch", batch)]
    if isinstance(batch, Mapping):
        return [leaf for k, v in batch.items() for leaf in leaves(v, f"{path}.{k}" if path else str(k))]
    if isinstance(batch, (list, tuple)):
        return [leaf for i, v in enumerate(batch) for leaf in leaves(v, f"{path}[{i}]")]
    if is_dataclass_batch(batch):
        return [leaf for k in fields(batch) for leaf in leaves(getattr(batch, k), f"{path}.{k}" if path else k)]
    return []


def tensors(batch: Any) -> list[torch.Tensor]:
    """Every tensor in the batch."""
    return [t for _, t in leaves(batch)]


def structure(batch: Any) -> Any:
    """A JSON-able description of the batch: its containers, and each tensor's shape and dtype (the profile's
    cache key and the recipe for fake batches of another size)."""
    if isinstance(batch, torch.Tensor):
        return {"shape": list(batch.shape), "dtype": str(batch.dtype).replace("torch.", "")}
    if isinstance(batch, Mapping):
        return {"dict": {str(k): structure(v) for k, v in batch.items()}}
    if isinstance(batch, (list, tuple)):
        return {"list" if isinstance(batch, list) else "tuple": [structure(v) for v in batch]}
    if is_dataclass_batch(batch):
        return {"dataclass": f"{type(batch).__module__}.{type(batch).__qualname__}",
                "fields": {k: structure(getattr(batch, k)) for k in fields(batch)}}
    return {"value": repr(batch)}
