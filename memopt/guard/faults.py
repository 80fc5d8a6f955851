"""Fault injection for drills and tests: an out-of-memory error exactly where you want it.

``FaultInjector`` is a ``TorchDispatchMode``: inside it, every ATen op is counted per phase of the train
step (it listens to ``TrainStep.on_phase``: "forward[i]", "backward[i]", "optimizer", "zero_grad"), and the
chosen op of the chosen phase of the chosen step attempt raises ``torch.OutOfMemoryError`` instead of
running, as a real allocation failure would (the error comes from inside the op, so whatever ran before it
in the phase has happened: activations saved, gradients accumulated, states partly updated). Backward ops
run under the mode too (autograd carries dispatch modes into its threads).

``MemoryCap`` is a memory limit on any device, the CPU included: after each op it reads a ``MemorySource``
(``TrackedMemorySource`` counts the real bytes of live tensors) and raises ``torch.OutOfMemoryError`` when the
op took allocated memory above the cap, as a GPU's allocator would (its output is dropped with the error).
A leak then runs out of memory after as many steps as it would on a GPU.

``occupy(nbytes)`` holds device memory until released, to provoke a real OOM on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["FaultInjector", "MemoryCap", "occupy"]


class FaultInjector(TorchDispatchMode):
    """Raise an OOM at op ``after_ops`` (0 = the first) of ``phase`` ("forward", "backward", "optimizer",
    "zero_grad", or an exact name such as "forward[1]") in step attempt ``at_attempt`` (0-based; every call of
    the train step counts, retries included), ``times`` attempts in a row. ``on_phase`` must receive the train
    step's phases (``OOMGuard.phase_listeners`` or a ``TrainStep.on_phase`` chain)."""

    def __init__(self, *, at_attempt: int, phase: str, after_ops: int = 0, times: int = 1,
                 requested_bytes: int = 64 << 20, enabled: bool = True) -> None:
        super().__init__()
        self.at_attempt = at_attempt
        self.phase = phase
        self.after_ops = after_ops
        self.times = times
        self.requested_bytes = requested_bytes
        self.enabled = enabled
        self.attempt = -1
        self.current = ""
        self.ops_in_phase = 0
        self.fired: list[tuple[int, str, str]] = []  # (attempt, phase, op)

    def on_phase(self, name: str) -> None:
        if name == "forward[0]":
            self.attempt += 1
        self.current = name
        self.ops_in_phase = 0

    def _armed(self) -> bool:
        if not self.enabled or not self.at_attempt <= self.attempt < self.at_attempt + self.times:
            return False
        if any(a == self.attempt for a, _, _ in self.fired):
            return False
        name = self.current
        return name == self.phase or name.split("[")[0] == self.phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if self._armed():
            if self.ops_in_phase >= self.after_ops:
                self.fired.append((self.attempt, self.current, str(func)))
                mib = self.requested_bytes / (1 << 20)
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate {mib:.2f} MiB. (injected by memopt FaultInjector in "
                    f"{self.current}, attempt {self.attempt}, op {func})")
            self.ops_in_phase += 1
        return func(*args, **(kwargs or {}))


class MemoryCap(TorchDispatchMode):
    """Raise an OOM from the op that takes ``source.allocated_bytes()`` above ``cap_bytes``. ``phases``: only
    in these phases of the train step (base names such as "forward"; ``on_phase`` must receive the phases),
    None for everywhere. ``fired`` lists (phase, op, allocated bytes) of every error raised."""

    def __init__(self, source: Any, cap_bytes: int, *, phases: tuple[str, ...] | None = None,
                 enabled: bool = True) -> None:
        super().__init__()
        if cap_bytes <= 0:
            raise ValueError(f"MemoryCap needs a positive cap in bytes, got {cap_bytes}")
        self.source = source
        self.cap_bytes = int(cap_bytes)
        self.phases = phases
        self.enabled = enabled
        self.current = ""
        self.fired: list[tuple[str, str, int]] = []

    def on_phase(self, name: str) -> None:
        self.current = name

    def _armed(self) -> bool:
        return self.enabled and (self.phases is None or self.current.split("[")[0] in self.phases)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if not self._armed():
            return func(*args, **(kwargs or {}))
        before = self.source.allocated_bytes()
        out = func(*args, **(kwargs or {}))
        after = self.source.allocated_bytes()
        if after > self.cap_bytes and after > before:
            del out
            self.fired.append((self.current, str(func), after))
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {after - before} bytes. (memopt MemoryCap: "
                f"{after} bytes allocated against a cap of {self.cap_bytes} in {self.current or 'no phase'}, "
                f"op {func})")
        return out


@contextlib.contextmanager
def occupy(nbytes: int, device: Any = None) -> Iterator[torch.Tensor | None]:
    """Hold ``nbytes`` of device memory (a CUDA tensor) inside the block, to make a real OOM likely."""
    if nbytes <= 0:
        yield None
        return
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    hog = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    try:
        yield hog
    finally:
        del hog
