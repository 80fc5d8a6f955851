"""Where a running step's memory figures come from: a ``MemorySource``.

* ``CudaMemorySource``: the CUDA caching allocator's counters (``memory_allocated``/``memory_reserved`` and
  their peaks since the last reset) and the driver's view of the device (``mem_get_info``).
* ``TrackedMemorySource``: a CPU stand-in that counts the real bytes of live tensors with memopt's
  ``MemoryTracker`` (a ``TorchDispatchMode``). The CPU has no caching allocator, so "reserved" is modelled
  as the high-water mark of allocated bytes rounded up to 2 MiB (it only shrinks on ``empty_cache``).
  Used by the CPU tests: a leak in a training loop on the CPU is seen exactly as on a GPU.
* ``SimulatedMemorySource``: figures set by hand (tests, dry runs).

Every figure is an ``int`` of bytes; a figure a source cannot know is ``None``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from memopt.profile.tracker import MemoryTracker
from memopt.step.hard_cap import process_device_bytes
from memopt.units import MiB, allocator_size, round_up

__all__ = [
    "CudaMemorySource",
    "MemorySample",
    "MemorySource",
    "SimulatedMemorySource",
    "TrackedMemorySource",
    "default_memory_source",
    "iter_tensors",
    "state_bytes",
]


@dataclass(frozen=True)
class MemorySample:
    """One reading of a device's memory."""

    allocated_bytes: int
    reserved_bytes: int
    peak_allocated_bytes: int  # since the last reset_peak()
    peak_reserved_bytes: int
    device_used_bytes: int | None = None  # the whole device as the driver sees it (all processes)
    device_total_bytes: int | None = None
    process_used_bytes: int | None = None  # this process's share of it (NVML), where others share the device

    @property
    def fragmentation_bytes(self) -> int:
        """Reserved but not allocated: the caching allocator's rounding and free blocks it keeps."""
        return self.reserved_bytes - self.allocated_bytes

    @property
    def outside_allocator_bytes(self) -> int | None:
        """This process's device memory outside PyTorch's allocator (CUDA context, handles, NCCL); where its own
        share is not known, the device's (other processes included)."""
        used = self.process_used_bytes if self.process_used_bytes is not None else self.device_used_bytes
        if used is None:
            return None
        return max(used - self.reserved_bytes, 0)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@runtime_checkable
class MemorySource(Protocol):
    """Reads one device's memory. ``kind`` is "cuda" for real GPU figures (only those calibrate a plan)."""

    kind: str
    device_type: str

    def sample(self) -> MemorySample: ...

    def allocated_bytes(self) -> int:
        """Allocated bytes now (the cheapest reading; used at many points of a step)."""
        ...

    def reset_peak(self) -> None: ...

    def tensor_bytes(self, tensors: Any) -> int:
        """Bytes the device holds for the distinct storages behind ``tensors`` (any pytree), as counted here."""
        ...

    def empty_cache(self) -> None: ...


def iter_tensors(obj: Any, _depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors inside nested mappings (a Hugging Face ``ModelOutput`` too), lists, tuples and sets."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif _depth > 8:
        return
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from iter_tensors(v, _depth + 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            yield from iter_tensors(v, _depth + 1)


def _distinct_storages(tensors: Any, device_type: str) -> Iterable[torch.UntypedStorage]:
    seen: set[int] = set()
    for t in iter_tensors(tensors):
        if isinstance(t, torch.Tensor) and t.device.type == device_type:
            try:
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
            except (RuntimeError, NotImplementedError):  # fake or sparse tensors
                continue
            if ptr and ptr not in seen:
                seen.add(ptr)
                yield storage


class CudaMemorySource:
    """The CUDA caching allocator's counters for one device."""

    kind = "cuda"
    device_type = "cuda"

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaMemorySource needs a CUDA device; on the CPU use TrackedMemorySource or "
                               "SimulatedMemorySource")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())

    def _stats(self) -> dict[str, Any]:
        """The allocator's counters as the nested dict PyTorch builds in C++. ``torch.cuda.memory_allocated`` and
        its siblings each flatten the whole dict in Python first: 113 us a call against 9.5 us for this one
        (measured on the H200, torch 2.11), and the guard reads them several times per micro-batch."""
        nested = getattr(torch._C, "_cuda_memoryStats", None)
        if nested is None:  # pragma: no cover - other PyTorch builds
            return torch.cuda.memory_stats_as_nested_dict(self.device)
        return nested(self.device.index)

    def sample(self) -> MemorySample:
        free, total = torch.cuda.mem_get_info(self.device)
        s = self._stats()
        allocated, reserved = s["allocated_bytes"]["all"], s["reserved_bytes"]["all"]
        # this process's own share: beside other jobs on the device, their memory is not this plan's runtime
        # (a calibration from the device-wide figure was refused as "more than 50% off", or learnt it)
        return MemorySample(allocated_bytes=int(allocated["current"]), reserved_bytes=int(reserved["current"]),
                            peak_allocated_bytes=int(allocated["peak"]), peak_reserved_bytes=int(reserved["peak"]),
                            device_used_bytes=int(total - free), device_total_bytes=int(total),
                            process_used_bytes=process_device_bytes(self.device.index))

    def allocated_bytes(self) -> int:
        return int(self._stats()["allocated_bytes"]["all"]["current"])

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def tensor_bytes(self, tensors: Any) -> int:
        return sum(allocator_size(s.nbytes()) for s in _distinct_storages(tensors, "cuda")
                   if s.device == self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


class TrackedMemorySource:
    """Real bytes of live CPU tensors, counted by a ``MemoryTracker`` (use it as a context manager around
    the training loop; tensors made before it, such as the parameters, are added with ``track``)."""

    kind = "tracked"

    def __init__(self, device_type: str = "cpu", *, page_bytes: int = 2 * MiB) -> None:
        self.device_type = device_type
        self.tracker = MemoryTracker(device_type, record=False)
        self.page_bytes = page_bytes
        self._reserved = 0
        self._peak_reserved = 0
        self._active = False

    def __enter__(self) -> TrackedMemorySource:
        self.tracker.__enter__()
        self._active = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self._active = False
        self.tracker.__exit__(*exc)

    def track(self, *objs: Any) -> None:
        """Count tensors (or a module's parameters and buffers) made outside the tracked region."""
        for obj in objs:
            if isinstance(obj, torch.nn.Module):
                for t in list(obj.parameters()) + list(obj.buffers()):
                    self.tracker.track(t, label="external")
            else:
                for t in iter_tensors(obj):
                    self.tracker.track(t, label="external")

    def _update_reserved(self) -> None:
        self._reserved = max(self._reserved, round_up(self.tracker.peak_bytes, self.page_bytes))
        self._peak_reserved = max(self._peak_reserved, self._reserved)

    def sample(self) -> MemorySample:
        self._update_reserved()
        return MemorySample(allocated_bytes=self.tracker.current_bytes, reserved_bytes=self._reserved,
                            peak_allocated_bytes=self.tracker.peak_bytes, peak_reserved_bytes=self._peak_reserved)

    def allocated_bytes(self) -> int:
        return self.tracker.current_bytes

    def reset_peak(self) -> None:
        self._update_reserved()
        self.tracker.reset_peak()
        self._peak_reserved = self._reserved

    def tensor_bytes(self, tensors: Any) -> int:
        return self.tracker.live_bytes_of(list(iter_tensors(tensors)))

    def empty_cache(self) -> None:
        self._reserved = round_up(self.tracker.current_bytes, self.page_bytes)


class SimulatedMemorySource:
    """Figures set by the caller: ``set(allocated=..., reserved=...)``; peaks follow the values set."""

    kind = "simulated"

    def __init__(self, *, device_type: str = "cpu", device_total_bytes: int | None = None,
                 outside_allocator_bytes: int = 0, other_processes_bytes: int = 0) -> None:
        self.device_type = device_type
        self.device_total_bytes = device_total_bytes
        self.outside_allocator_bytes = outside_allocator_bytes
        self.other_processes_bytes = other_processes_bytes  # what other jobs on the device hold
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0

    def set(self, *, allocated: int | None = None, reserved: int | None = None) -> None:
        if allocated is not None:
            self.allocated = allocated
        if reserved is not None:
            self.reserved = reserved
        self.reserved = max(self.reserved, self.allocated)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def sample(self) -> MemorySample:
        own = None if self.device_total_bytes is None else self.reserved + self.outside_allocator_bytes
        return MemorySample(allocated_bytes=self.allocated, reserved_bytes=self.reserved,
                            peak_allocated_bytes=self.peak_allocated, peak_reserved_bytes=self.peak_reserved,
                            device_used_bytes=None if own is None else own + self.other_processes_bytes,
                            device_total_bytes=self.device_total_bytes,
                            process_used_bytes=own if self.other_processes_bytes else None)

    def allocated_bytes(self) -> int:
        return self.allocated

    def reset_peak(self) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def tensor_bytes(self, tensors: Any) -> int:
        return sum(allocator_size(s.nbytes()) for s in _distinct_storages(tensors, self.device_type))

    def empty_cache(self) -> None:
        self.reserved = self.allocated


def default_memory_source(device: torch.device | str | None = None) -> MemorySource | None:
    """CUDA counters when ``device`` (or, without one, this process) has a GPU; None otherwise."""
    dev = torch.device(device) if device is not None else None
    if (dev is None or dev.type == "cuda") and torch.cuda.is_available():
        return CudaMemorySource(dev)
    return None


def state_bytes(memory: MemorySource, model: torch.nn.Module | None,
                optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Bytes of the parameters, gradients and optimizer states as they are now (fp32 master copies that the
    optimizer steps count as optimizer states, their gradients as gradients)."""
    params, grads, states = _state_tensors(model, optimizer)
    return {"parameters": memory.tensor_bytes(params), "gradients": memory.tensor_bytes(grads),
            "optimizer_states": memory.tensor_bytes(states)}


def gradient_bytes(memory: MemorySource, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None) -> int:
    """The ``gradients`` entry of :func:`state_bytes` alone (a third of its work)."""
    return memory.tensor_bytes(_state_tensors(model, optimizer)[1])


def _state_tensors(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None
                   ) -> tuple[list[Any], list[Any], list[Any]]:
    params = list(model.parameters()) if model is not None else []
    ids = {id(p) for p in params}
    grads = [p.grad for p in params if p.grad is not None]
    states: list[Any] = []
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in ids:
                    states.append(p)
                    if p.grad is not None:
                        grads.append(p.grad)
        states.extend(optimizer.state.values())
    return params, grads, states
