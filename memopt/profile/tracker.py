"""Counting the bytes a piece of PyTorch code allocates, as the CUDA caching allocator counts them.

``MemoryTracker`` is a ``TorchDispatchMode``: every op's outputs are checked for storages it has not
seen; each new storage is counted once (rounded up to 512 bytes, like the allocator) until its last
reference dies. It works on real tensors and on fake ones (``FakeTensorMode``), so the same code
measures a CUDA run and simulates one on a CPU.

Kernels that allocate scratch space inside themselves (flash-attention's backward, cuBLAS'
workspace) are invisible to a dispatch mode: ``transient`` and ``persistent`` let the code that
knows about them (``cuda_semantics``) add those bytes at the right moment.

Known limitations: a storage resized in place keeps the size it had when first seen; memory that a
library allocates outside PyTorch (NCCL, bitsandbytes' paged buffers) is not seen.
"""

from __future__ import annotations

import contextvars
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memopt.categories import MemoryCategory
from memopt.profile.data_dependent import BOUNDED_OPS, sized_output
from memopt.profile.operand_checks import check_operands
from memopt.profile.scalar_values import MAX_INDEX_ELEMENTS, ScalarShadows
from memopt.units import allocator_size

__all__ = ["MemoryTracker", "TrackedRun", "UnsupportedLayout", "current_tracker", "dense_only", "report_scratch"]


class UnsupportedLayout(ValueError):
    """A sparse (or other non-strided) tensor in the step: memopt's byte accounting knows strided storages only."""


def dense_only(t: torch.Tensor, what: str) -> None:
    """UnsupportedLayout naming ``what`` made ``t`` when it is not a strided tensor (a sparse gradient of
    ``nn.Embedding(sparse=True)``, a sparse adjacency matrix in the batch)."""
    if t.layout != torch.strided:
        raise UnsupportedLayout(
            f"{what} is a {str(t.layout).removeprefix('torch.')} tensor, and memopt can plan only dense (strided) "
            "tensors: build embeddings with sparse=False (nn.Embedding/nn.EmbeddingBag), or pass dense inputs")

_CURRENT: contextvars.ContextVar[MemoryTracker | None] = contextvars.ContextVar("memopt_tracker", default=None)


def current_tracker() -> MemoryTracker | None:
    """The innermost active tracker (kernels emulating CUDA report their scratch space to it)."""
    return _CURRENT.get()


def report_scratch(nbytes: int, label: str) -> None:
    """Tell the active tracker, if any, that a kernel briefly holds ``nbytes`` more than its outputs."""
    tracker = _CURRENT.get()
    if tracker is not None:
        tracker.transient(nbytes, label)

_SCALAR_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default}


def _valueless(args: Any) -> bool:
    """Whether a fake tensor among ``args`` has no known values (the fake mode computes on those that do)."""
    return any(type(t).__name__ == "FakeTensor" and getattr(t, "constant", None) is None
               for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor))


def _is_fake_bool(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.bool and type(t).__name__ == "FakeTensor"


def _is_fake_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype.is_floating_point and type(t).__name__ == "FakeTensor"


FLOAT_READ_STAND_IN = 1.0  # what ``.item()`` of a floating tensor without known values reads as in a trace


# Event kinds in the log. An event is a tuple (kind, key, requested_bytes, phase_index, label_index);
# requested bytes are the storage's own size (the allocator rounds them: ``allocator_size``).
ALLOC, FREE = 1, -1


@dataclass
class TrackedRun:
    """The log of one tracked region: allocation and free events in order, plus phase marks."""

    events: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    phases: list[str] = field(default_factory=list)
    categories: dict[int, MemoryCategory] = field(default_factory=dict)  # key -> category, where known
    persistent_keys: set[int] = field(default_factory=set)  # process-lifetime buffers (cuBLAS workspaces)
    # key -> the module that was running when it was allocated (only with ``MemoryTracker.module_fn`` set)
    alloc_module: dict[int, str] = field(default_factory=dict)
    # ops whose output size depends on values, traced at their largest (``memopt.profile.data_dependent``)
    bounded_ops: set[str] = field(default_factory=set)
    value_reads: int = 0  # reads of floating values the trace could not know (FLOAT_READ_STAND_IN instead)

    def peak(self, start_bytes: int = 0) -> tuple[int, int]:
        """(peak bytes, index of the event at which it is reached) replaying the log from ``start_bytes``."""
        cur = best = start_bytes
        at = -1
        for i, (kind, _key, size, _phase, _label) in enumerate(self.events):
            size = allocator_size(size)
            cur += size if kind == ALLOC else -size
            if cur > best:
                best, at = cur, i
        return best, at


def _free_in(tracker: weakref.ref[MemoryTracker], sid: int) -> None:
    live = tracker()
    if live is not None:
        live._free_storage(sid)


class MemoryTracker(TorchDispatchMode):
    """Tracks live bytes of storages on one device type ('cuda', or 'cpu' when emulating a GPU)."""

    def __init__(self, device_type: str, *, record: bool = True) -> None:
        super().__init__()
        self.device_type = device_type
        self.record = record
        self.current_bytes = 0
        self.peak_bytes = 0
        self.run = TrackedRun()
        self.shadows = ScalarShadows()
        self._live: dict[int, int] = {}  # id(storage) -> key (keys are unique over the run; ids are reused)
        self._next_key = 1
        self._sizes: dict[int, int] = {}  # key -> rounded bytes
        self._raw: dict[int, int] = {}  # key -> requested bytes
        self._label_index: dict[str, int] = {}
        self._phase = 0
        self._next_synthetic = -1
        self.op_hooks: list = []  # callables (func, args, out) run after each op (cuda_semantics uses one)
        # attribution (memopt.profile.attribution): returns the running module's path, recorded per allocation
        self.module_fn: Any = None
        self.set_phase("setup")

    # -- bookkeeping -------------------------------------------------------------------------
    def _label(self, label: str) -> int:
        idx = self._label_index.get(label)
        if idx is None:
            idx = len(self.run.labels)
            self._label_index[label] = idx
            self.run.labels.append(label)
        return idx

    def set_phase(self, name: str) -> None:
        """Mark where a phase (forward, backward, optimizer step, ...) begins."""
        self.run.phases.append(name)
        self._phase = len(self.run.phases) - 1

    def _alloc(self, key: int, nbytes: int, label: int) -> None:
        size = allocator_size(nbytes)
        self._sizes[key] = size
        self._raw[key] = nbytes
        self.current_bytes += size
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
        if self.record:
            self.run.events.append((ALLOC, key, nbytes, self._phase, label))
            if self.module_fn is not None:
                self.run.alloc_module[key] = self.module_fn()

    def _free(self, key: int) -> None:
        size = self._sizes.pop(key, None)
        if size is None:
            return
        nbytes = self._raw.pop(key)
        self.current_bytes -= size
        if self.record:
            self.run.events.append((FREE, key, nbytes, self._phase, 0))

    def _track_storage(self, storage: torch.UntypedStorage, label: int) -> int | None:
        sid = id(storage)
        if sid in self._live:
            return None
        nbytes = storage.nbytes()
        if nbytes <= 0:
            return None
        key = self._next_key
        self._next_key += 1
        self._live[sid] = key
        self._alloc(key, nbytes, label)
        # The finalizer must not hold the tracker: storages that outlive it (a real model's parameters and
        # optimizer states) would keep it, its owner and through that the model alive for the process's life.
        weakref.finalize(storage, _free_in, weakref.ref(self), sid)
        return key

    def _free_storage(self, sid: int) -> None:
        key = self._live.pop(sid, None)
        if key is not None:
            self._free(key)

    def key_of(self, tensor: torch.Tensor) -> int | None:
        """The run's key of a tracked tensor's storage (None if it is not tracked)."""
        return self._live.get(id(tensor.untyped_storage()))

    # -- public API --------------------------------------------------------------------------
    def track(self, tensor: torch.Tensor, category: MemoryCategory | None = None, label: str = "external") -> None:
        """Count a tensor created outside the tracked region (a parameter, an input batch)."""
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != self.device_type:
            return
        self._track_storage(tensor.untyped_storage(), self._label(label))
        key = self.key_of(tensor)
        if category is not None and key is not None:
            self.run.categories[key] = category

    def categorize(self, tensor: torch.Tensor, category: MemoryCategory) -> None:
        """Attach a category to an already-tracked tensor's storage (e.g. a parameter's .grad)."""
        if isinstance(tensor, torch.Tensor) and tensor.device.type == self.device_type:
            key = self.key_of(tensor)
            if key is not None:
                self.run.categories[key] = category

    def transient(self, nbytes: int, label: str) -> None:
        """A scratch buffer that a kernel allocates and frees inside itself."""
        if nbytes <= 0:
            return
        key = self._next_synthetic
        self._next_synthetic -= 1
        self._alloc(key, nbytes, self._label(label))
        self._free(key)

    def persistent(self, nbytes: int, label: str, category: MemoryCategory = MemoryCategory.TEMPORARIES) -> int:
        """A buffer that stays allocated (a cuBLAS workspace); returns a key for ``release``."""
        key = self._next_synthetic
        self._next_synthetic -= 1
        if nbytes > 0:
            self._alloc(key, nbytes, self._label(label))
            self.run.categories[key] = category
            self.run.persistent_keys.add(key)
        return key

    def release(self, key: int) -> None:
        self._free(key)

    def live_bytes_of(self, tensors: Any) -> int:
        """Sum of the tracked sizes of the distinct storages behind ``tensors``."""
        seen: set[int] = set()
        total = 0
        for t in tree_flatten(tensors)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == self.device_type:
                key = self.key_of(t)
                if key is not None and key not in seen:
                    seen.add(key)
                    total += self._sizes[key]
        return total

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes

    def __enter__(self) -> MemoryTracker:
        self._token = _CURRENT.set(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _CURRENT.reset(self._token)
        return super().__exit__(*exc)

    # -- dispatch ----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func in _SCALAR_READS and args:
            known = self.shadows.value(args[0])
            if known is not None:  # a constant or a uniform draw (memopt.profile.scalar_values)
                return self.shadows.read(func, known)
            if _is_fake_bool(args[0]):
                # A fake tensor has no values. Models read booleans to take fast paths ("is the padding
                # mask all ones?", "are these sequences packed?"): the trace assumes unpadded, unpacked
                # batches, where every such check holds.
                return True
            if _is_fake_float(args[0]):
                # a loss or a norm read to be logged or printed (``loss.item()`` in a training step): its value
                # changes no memory, and the trace cannot know it; a stand-in, said in the profile's notes
                self.run.value_reads += 1
                return True if func is torch.ops.aten.is_nonzero.default else FLOAT_READ_STAND_IN
        # an op whose output size depends on values it cannot see is given its largest output before the fake
        # mode raises (or, under a symbolic shape environment, returns sizes no byte count can use)
        out = NotImplemented
        if func in BOUNDED_OPS and _valueless(args):
            out, exact, known = sized_output(func, args, kwargs or {}, self.shadows.value, MAX_INDEX_ELEMENTS)
            if out is not NotImplemented:
                if not exact:
                    self.run.bounded_ops.add(func.__name__)
                if known is not None:
                    self.shadows.adopt(*known)
        if out is NotImplemented:
            check_operands(func, args)  # the dtype checks of the GPU's kernels, which meta functions skip
            out = func(*args, **(kwargs or {}))
        self.shadows.observe(func, args, kwargs or {}, out)
        label = None
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == self.device_type:
                if t.layout != torch.strided:
                    where = self.module_fn() if self.module_fn is not None else ""
                    dense_only(t, f"the output of {func.__name__}" + (f" in {where}" if where else ""))
                if label is None:
                    label = self._label(func.__name__)
                self._track_storage(t.untyped_storage(), label)
        for hook in self.op_hooks:
            hook(func, args, out)
        return out

