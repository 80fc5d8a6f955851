"""Cheap evidence about autograd graphs that outlive their step (what tells memory leaks apart).

``GraphCensus`` installs a pair of saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``) for as
long as it is active. Each tensor autograd saves for backward is wrapped in a small handle that records its
size and whether backward has unpacked it; the handle dies with the graph node that holds it. So at any
moment the census knows the saved tensors still alive, split in two:

* never unpacked: a graph whose forward ran but whose backward never did. At a step boundary that is a
  forward pass whose output was kept but never backpropagated (an evaluation without ``torch.no_grad``
  whose loss or outputs are stored).
* unpacked and still alive: a graph that backward already went through but that keeps its saved tensors,
  which only ``retain_graph=True`` does (with something still referencing the graph).

It also counts the bytes saved per step (the activations of the step's forward passes). The cost is one
Python call per saved tensor (a few hundred per layer stack and micro-batch) and nothing per step.

Hooks nest: an inner pair (activation offload, non-reentrant checkpointing) takes over inside its region,
where the census sees nothing. The handle stores ``tensor.detach()`` (same storage and version counter, no
``grad_fn``), so it adds no reference cycle and no memory.

``live_tensor_census`` is the expensive complement used once, when a leak is reported: it walks ``gc`` for
live tensors that are not parameters, gradients or optimizer states and groups them by shape and dtype.
"""

from __future__ import annotations

import gc
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from memopt.techniques.activation_offload import is_parameter_like
from memopt.units import allocator_size

__all__ = ["CensusSnapshot", "GraphCensus", "live_tensor_census"]


class _Saved:
    __slots__ = ("__weakref__", "nbytes", "ptr", "t", "unpacked")

    def __init__(self, t: torch.Tensor, ptr: int, nbytes: int) -> None:
        self.t = t
        self.ptr = ptr
        self.nbytes = nbytes
        self.unpacked = False


@dataclass(frozen=True)
class CensusSnapshot:
    """Saved tensors alive at one moment (distinct storages, allocator-rounded bytes)."""

    unused_bytes: int  # saved by a forward whose backward never ran
    retained_bytes: int  # already used by a backward and still alive (retain_graph)
    unused_tensors: int
    retained_tensors: int
    packed_bytes: int  # saved since the previous snapshot: the activations of that stretch's forwards

    def to_dict(self) -> dict[str, int]:
        return {"saved_unused_bytes": self.unused_bytes, "saved_retained_bytes": self.retained_bytes,
                "saved_unused_tensors": self.unused_tensors, "saved_retained_tensors": self.retained_tensors,
                "saved_packed_bytes": self.packed_bytes}


class GraphCensus:
    """Saved-tensor hooks that keep count of autograd graphs (see the module docstring)."""

    def __init__(self, device_type: str = "cuda") -> None:
        self.device_type = device_type
        self._live: weakref.WeakSet[_Saved] = weakref.WeakSet()
        self._packed_bytes = 0
        self._packed_ptrs: set[int] = set()
        self._ctx: Any = None
        self.active = False
        self.error: str | None = None

    # -- hooks -----------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        # plain tensors only: fake tensors (a profile traced meanwhile), DTensors and other subclasses pass as is
        if type(t) is not torch.Tensor or t.device.type != self.device_type or is_parameter_like(t):
            return t
        try:
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), allocator_size(storage.nbytes())
        except (RuntimeError, NotImplementedError):
            return t
        handle = _Saved(t.detach(), ptr, nbytes)
        self._live.add(handle)
        if ptr not in self._packed_ptrs:
            self._packed_ptrs.add(ptr)
            self._packed_bytes += nbytes
        return handle

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, _Saved):
            packed.unpacked = True
            return packed.t
        return packed

    # -- lifetime --------------------------------------------------------------------------------
    def install(self) -> bool:
        """Push the hooks (on this thread); False, with ``error`` set, where autograd refuses them."""
        if self.active:
            return True
        try:
            ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            ctx.__enter__()
        except RuntimeError as exc:  # hooks disabled (e.g. under torch.compile's functionalization)
            self.error = str(exc)
            return False
        self._ctx, self.active = ctx, True
        return True

    def remove(self) -> None:
        if self.active:
            self._ctx.__exit__(None, None, None)
            self._ctx, self.active = None, False

    def __enter__(self) -> GraphCensus:
        self.install()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    # -- readings --------------------------------------------------------------------------------
    def snapshot(self, *, reset_packed: bool = True) -> CensusSnapshot:
        unused = retained = n_unused = n_retained = 0
        seen: set[int] = set()
        for h in list(self._live):
            if h.ptr in seen:
                continue
            seen.add(h.ptr)
            if h.unpacked:
                retained += h.nbytes
                n_retained += 1
            else:
                unused += h.nbytes
                n_unused += 1
        snap = CensusSnapshot(unused_bytes=unused, retained_bytes=retained, unused_tensors=n_unused,
                              retained_tensors=n_retained, packed_bytes=self._packed_bytes)
        if reset_packed:
            self._packed_bytes = 0
            self._packed_ptrs.clear()
        return snap


def live_tensor_census(device_type: str, *, exclude: Any = (), top: int = 8) -> list[dict[str, Any]]:
    """Live tensors on ``device_type`` found through ``gc``, minus the storages of ``exclude`` (parameters,
    gradients, optimizer states), grouped by (shape, dtype, has grad_fn), largest total first.

    Walks every object the garbage collector tracks: tens to hundreds of milliseconds in a big process,
    so it runs once, when a leak is reported.
    """
    excluded: set[int] = set()
    for t in _tensors_in(exclude):
        try:
            excluded.add(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            pass
    groups: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    seen: set[int] = set()
    for obj in gc.get_objects():
        try:
            cls = type(obj)  # not isinstance: that reads __class__, which some deprecated objects warn about
            if not issubclass(cls, torch.Tensor) or issubclass(cls, torch.nn.Parameter):
                continue
            if obj.device.type != device_type:
                continue
            storage = obj.untyped_storage()
            ptr = storage.data_ptr()
        except Exception:  # tensor subclasses without storage, half-built objects
            continue
        if not ptr or ptr in excluded or ptr in seen:
            continue
        seen.add(ptr)
        key = (tuple(obj.shape), str(obj.dtype).replace("torch.", ""), obj.grad_fn is not None)
        groups[key][0] += 1
        groups[key][1] += allocator_size(storage.nbytes())
    rows = [{"shape": list(k[0]), "dtype": k[1], "has_grad_fn": k[2], "count": v[0], "bytes": v[1]}
            for k, v in groups.items()]
    rows.sort(key=lambda r: -r["bytes"])
    return rows[:top]


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            out.append(o)
            if isinstance(o, torch.nn.Parameter) and o.grad is not None:
                out.append(o.grad)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set)):
            stack.extend(o)
        elif isinstance(o, torch.optim.Optimizer):
            stack.extend(o.state.values())
            for g in o.param_groups:
                stack.extend(g["params"])
        elif isinstance(o, torch.nn.Module):
            stack.extend(o.parameters())
            stack.extend(o.buffers())
    return out
