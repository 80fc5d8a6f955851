"""Holding a process to its budget on the GPU: allocator settings and the hard cap.

* Expandable segments must be chosen before CUDA's caching allocator starts; if CUDA already holds
  memory, the setting cannot change and memopt says so (the plan then assumed the wrong allocator).
* The cap is ``torch.cuda.set_per_process_memory_fraction((budget - outside) / total)``: what the
  allocator may reserve is the budget minus the memory the process holds outside it (CUDA context,
  handles, paged optimizer states), so a wrong plan fails loudly instead of quietly using more.
"""

from __future__ import annotations

import os
import time
import warnings

import torch

__all__ = ["cap_allocator", "cap_to_plan", "outside_allocator_bytes", "room_taken_bytes", "room_taken_on_device",
           "set_expandable_segments"]

#: below this, what the device holds beyond the plan's runtime at wrap time is the runtime's own variation
ROOM_TAKEN_THRESHOLD = 256 * 2**20


def allocator_mode_in_force() -> bool | None:
    """The allocator's ``expandable_segments`` mode when it can no longer change (CUDA already holds memory, e.g. a
    model moved to the GPU before ``memopt.wrap``), else None (``set_expandable_segments`` can still choose)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized() or torch.cuda.memory_reserved() == 0:
        return None
    conf = [c for c in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").split(",") if c.startswith("expandable")]
    return bool(conf) and conf[-1].split(":", 1)[-1].strip() == "True"


def warn_allocator_mode_fixed(mode: bool) -> None:
    """Say that the plan was made for the allocator mode already in force, not the one memopt would choose."""
    warnings.warn(f"CUDA already holds memory (the model is on the GPU before memopt.wrap), so the allocator's "
                  f"segment mode stays expandable_segments:{mode}; memopt planned for that mode. Call memopt.wrap "
                  "before moving anything to the GPU to let it choose", stacklevel=3)


def _allocator_settings(setting: str) -> None:
    """Change the caching allocator's settings after CUDA started (the accelerator-generic call where this PyTorch
    has it: the CUDA one warns it is deprecated from 2.10)."""
    generic = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if generic is not None:
        generic(setting)
    else:  # pragma: no cover - PyTorch before 2.10
        torch.cuda.memory._set_allocator_settings(setting)


def set_expandable_segments(enabled: bool) -> bool:
    """Choose the allocator's segment mode. Returns False (and warns) when it is too late to change it."""
    if not torch.cuda.is_available():
        return True
    wanted = f"expandable_segments:{'True' if enabled else 'False'}"
    conf = [c for c in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").split(",") if c]
    updated = ",".join([*(c for c in conf if not c.startswith("expandable")), wanted])
    if not torch.cuda.is_initialized():
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = updated
        return True
    if torch.cuda.memory_reserved() == 0:
        _allocator_settings(wanted)
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = updated
        return True
    current = [c for c in conf if c.startswith("expandable_segments")]
    if (current and current[-1] == wanted) or (not current and not enabled):  # in force since CUDA started
        return True
    warnings.warn(
        f"memopt planned with {wanted}, but CUDA already holds memory, so the allocator's segment mode can no "
        "longer change; call memopt.wrap before moving anything to the GPU (or set PYTORCH_CUDA_ALLOC_CONF="
        f"{wanted} before starting Python). The plan's reserved-memory prediction may not hold.",
        stacklevel=3,
    )
    return False


def process_device_bytes(device: int | None = None, *, samples: int = 1, interval_s: float = 0.05) -> int | None:
    """Device memory held by this process alone, or None when NVML cannot say.

    NVML's per-process figure where it lists this process with its usage; where it does not (a process that has just
    made its context, or a container whose process ids differ from the host's), the device's used memory less what
    NVML lists for every other process. Without that second way, a process started beside five others on an H200
    took their 17.5 GB for its own runtime and refused a budget that fit.

    The second way reads two sources at two moments, so a neighbour that starts or grows between them counts as this
    process's: a process that wrapped while six neighbours were starting on an H100 took 7.9 GiB of theirs for its own
    and planned for the 139 MiB left of its 8 GiB. So it reads ``samples`` times, ``interval_s`` apart, and keeps
    the least: this process's own memory does not move while it waits, and a neighbour missing from one listing is
    in the next. The guard's telemetry reads once a step; the cap and the room left read several times, once a wrap.
    """
    try:
        import pynvml

        pynvml.nvmlInit()
        index = torch.cuda.current_device() if device is None else device
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:
        return None
    readings: list[int] = []
    for attempt in range(max(1, samples)):
        if attempt:
            time.sleep(interval_s)
        try:
            procs = list(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
        except Exception:
            return None
        for proc in procs:
            if proc.pid == os.getpid() and proc.usedGpuMemory:
                return int(proc.usedGpuMemory)
        others = [p for p in procs if p.pid != os.getpid()]
        if not others:
            return None  # nobody else listed: the device-wide figure is this process's
        if any(not p.usedGpuMemory for p in others):
            continue  # a neighbour listed without its usage yet: read again
        free, total = torch.cuda.mem_get_info(device)
        readings.append(max(0, total - free - sum(int(p.usedGpuMemory) for p in others)))
    return min(readings) if readings else None


def outside_allocator_bytes(device: int | None = None) -> int:
    """Device memory this process uses outside PyTorch's allocator right now.

    Other processes on the same GPU are not counted (NVML's per-process figure); without NVML the
    device-wide figure is used, which counts them too (measured on an H200: three capped processes on one
    GPU each saw the others' memory as their own and capped themselves 10 GiB too low).
    """
    own = process_device_bytes(device, samples=4)  # once per cap: worth reading past a neighbour's start
    if own is None:
        free, total = torch.cuda.mem_get_info(device)
        own = total - free
    return max(0, own - torch.cuda.memory_reserved(device))


def cap_allocator(budget_bytes: int, outside_bytes: int, device: int | None = None) -> float:
    """Cap what the allocator may reserve at ``budget - outside``; returns the fraction set."""
    total = torch.cuda.get_device_properties(device or torch.cuda.current_device()).total_memory
    allowed = budget_bytes - outside_bytes
    if allowed <= 0:
        raise ValueError(f"the budget ({budget_bytes} B) leaves nothing for tensors once the {outside_bytes} B the "
                         "CUDA runtime holds outside the allocator are counted; raise the budget")
    fraction = min(1.0, allowed / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def cap_to_plan(budget_bytes: int, runtime_bytes: int, device: torch.device) -> float:
    """Start CUDA and cap the allocator for a plan: the budget less what the process holds outside the allocator
    (measured now, and at least the plan's predicted runtime bytes). Returns the fraction set."""
    torch.cuda.init()
    outside = max(outside_allocator_bytes(device.index), runtime_bytes)
    return cap_allocator(budget_bytes, outside, device.index)


def room_taken_bytes(*, outside_bytes: int, runtime_bytes: int, allocated_bytes: int, model_bytes: int,
                     threshold_bytes: int = ROOM_TAKEN_THRESHOLD) -> int:
    """Of the budget, what is gone before the plan applies (0 below ``threshold_bytes``): memory this process holds
    outside the allocator beyond the plan's predicted runtime (a library's own allocations; another process where
    NVML cannot tell processes apart), and memory the allocator holds for tensors that are not the model's (an
    evaluation model, a cache). The cap subtracts the first from the budget whatever the plan says, and the second
    fills the allocator's share: a plan made for the whole budget would not fit under the cap it is given."""
    taken = max(outside_bytes - runtime_bytes, 0) + max(allocated_bytes - model_bytes, 0)
    return taken if taken >= threshold_bytes else 0


def room_taken_on_device(model: torch.nn.Module, runtime_bytes: int, device: torch.device) -> int:
    """``room_taken_bytes`` measured now on ``device`` (starts CUDA)."""
    torch.cuda.init()
    seen: set[int] = set()
    model_bytes = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.device == device and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            model_bytes += t.untyped_storage().nbytes()
    return room_taken_bytes(outside_bytes=outside_allocator_bytes(device.index), runtime_bytes=runtime_bytes,
                            allocated_bytes=int(torch.cuda.memory_allocated(device)), model_bytes=model_bytes)
