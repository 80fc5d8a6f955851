"""Recognising and measuring a CUDA out-of-memory error, and the errors memopt raises when it cannot recover.

``is_oom`` tells a device out-of-memory error from other errors; ``parse_oom_message`` reads the figures in
PyTorch's message; ``OOMMeasurement`` is what is known about one failed attempt (allocator counters at the
failure, the size it tried to allocate, the phase it happened in) and ``RecoveryReport`` every OOM, rollback
and re-plan of a run. ``MemoptOOMError`` (and ``MemoptLeakError``, when a leak explains the OOM) carries that
report. ``release_cache`` collects what a failed attempt left and hands the allocator's free blocks back.
"""

from __future__ import annotations

import dataclasses
import gc
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from memopt.units import format_bytes

__all__ = [
    "MemoptLeakError",
    "MemoptOOMError",
    "OOMMeasurement",
    "RecoveryReport",
    "is_oom",
    "parse_oom_message",
    "release_cache",
]


# -- measurements and reports ----------------------------------------------------------------------
_UNITS = {"B": 1, "bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_SIZE = r"([0-9]+(?:\.[0-9]+)?) ?(bytes|B|KiB|MiB|GiB|TiB)"


def _size(m: re.Match | None) -> int | None:
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None


def parse_oom_message(message: str) -> dict[str, int | None]:
    """Figures in PyTorch's CUDA OOM message ("Tried to allocate 20.00 MiB. GPU 0 has a total capacity of
    79.19 GiB of which 3.06 MiB is free. ... this process has 79.18 GiB memory in use. Of the allocated memory
    78.12 GiB is allocated by PyTorch, and 512.00 MiB is reserved by PyTorch but unallocated.")."""
    return {
        "requested_bytes": _size(re.search(r"Tried to allocate " + _SIZE, message)),
        "device_total_bytes": _size(re.search(r"total capacity of " + _SIZE, message)),
        "device_free_bytes": _size(re.search(r"of which " + _SIZE + r" is free", message)),
        "process_bytes": _size(re.search(r"this process has " + _SIZE + r" memory in use", message)),
        "allocated_bytes": _size(re.search(_SIZE + r" is allocated by PyTorch", message)),
        "reserved_unallocated_bytes": _size(re.search(_SIZE + r" is reserved by PyTorch but unallocated", message)),
    }


_OOM_TEXT = ("CUDA out of memory", "out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED",
             "HIP out of memory")


def release_cache(*, empty_cache: bool = True) -> None:
    """Free what nothing references any more, then hand the allocator's free blocks back, so that a retry finds
    contiguous memory. Call it after the failed attempt's exception handler has ended: until then its frames hold
    the attempt's temporaries, whose blocks would stay cached as holes."""
    gc.collect()
    if empty_cache and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    """A device out-of-memory error (``torch.OutOfMemoryError``, or a library's allocation failure)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(t in str(exc) for t in _OOM_TEXT)


@dataclass
class OOMMeasurement:
    """What is known about one failed attempt (figures in bytes; None where unknown)."""

    step: int
    attempt: int  # the attempt of this step that failed (1 = first try)
    phase: str  # the train step's phase: "forward[0]", "backward[1]", "optimizer", "zero_grad", or "peer"
    location: str  # before_optimizer | optimizer_state_init | optimizer | after_optimizer | completed | peer
    message: str
    strategy: str
    rank: int = 0
    failed_ranks: list[int] = field(default_factory=list)
    requested_bytes: int | None = None
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    device_used_bytes: int | None = None
    device_total_bytes: int | None = None
    categories_bytes: dict[str, int] = field(default_factory=dict)
    predicted: dict[str, Any] = field(default_factory=dict)  # the failing plan's prediction
    budget_bytes: int | None = None
    snapshot_path: str | None = None
    foreign_bytes: int | None = None  # memory the plan does not own, measured after freeing (memopt.guard.foreign)
    foreign: dict[str, Any] | None = None  # ForeignMemory.to_dict() plus a description

    @property
    def needed_bytes(self) -> int | None:
        """A lower bound of the device memory the step needs: what was reserved plus what it asked for,
        plus what lives outside the allocator."""
        if self.reserved_bytes is None and self.peak_reserved_bytes is None:
            return None
        reserved = self.reserved_bytes or 0
        base = max(self.peak_reserved_bytes or 0, reserved + (self.requested_bytes or 0))
        outside = 0
        if self.device_used_bytes is not None:
            outside = max(self.device_used_bytes - reserved, 0)
        return base + outside

    @property
    def ratio(self) -> float | None:
        """needed / predicted total: how far the plan under-predicted, at least (foreign memory is not the plan's
        under-prediction, so it is left out)."""
        needed, predicted = self.needed_bytes, self.predicted.get("total_bytes")
        if not needed or not predicted:
            return None
        return max(needed - (self.foreign_bytes or 0), 0) / predicted

    @property
    def shortfall_bytes(self) -> int:
        """What the failed step lacked, at least: the allocation that failed, or its need beyond the budget."""
        over = 0
        if self.needed_bytes is not None and self.budget_bytes is not None:
            over = self.needed_bytes - self.budget_bytes
        return max(self.requested_bytes or 0, over, 0)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["needed_bytes"] = self.needed_bytes
        d["ratio"] = self.ratio
        return d


@dataclass
class RecoveryReport:
    """Every OOM, rollback and re-plan of a run."""

    failures: list[OOMMeasurement] = field(default_factory=list)
    replans: list[dict[str, Any]] = field(default_factory=list)
    final: str = ""
    leak: dict[str, Any] | None = None  # the leak diagnosed at an OOM (LeakReport.to_dict()), if any

    def to_dict(self) -> dict[str, Any]:
        return {"failures": [f.to_dict() for f in self.failures], "replans": self.replans, "final": self.final,
                "leak": self.leak}

    def summary(self, *, include_final: bool = True) -> str:
        lines = [self.final] if self.final and include_final else []
        for f in self.failures:
            need = f" (needs >= {format_bytes(f.needed_bytes)})" if f.needed_bytes else ""
            lines.append(f"step {f.step} attempt {f.attempt}: OOM in {f.phase} under [{f.strategy}] on rank "
                         f"{f.rank}{need}")
        for r in self.replans:
            lines.append(f"re-plan {r['attempt']}: [{r['from']}] -> [{r['to']}]")
        return "\n".join(lines)


class MemoptOOMError(RuntimeError):
    """Training ran out of memory and memopt could not (or may not) recover; ``report`` says what happened."""

    def __init__(self, message: str, report: RecoveryReport) -> None:
        super().__init__(message + ("\n" + report.summary(include_final=False) if report.failures else ""))
        self.report = report


class MemoptLeakError(MemoptOOMError):
    """Out of memory because memory leaks, not because of the plan: no re-plan was tried. ``leak`` is the
    diagnosis (``LeakReport.to_dict()``: growth per step, steps, cause, fix); ``report`` as for the base."""

    def __init__(self, message: str, report: RecoveryReport) -> None:
        super().__init__(message, report)
        self.leak = report.leak


def leak_message(leak: dict[str, Any], failure: OOMMeasurement) -> str:
    """The sentence a ``MemoptLeakError`` starts with."""
    rate, n = leak["growth_bytes_per_step"], leak["window"]
    return (f"out of memory at step {failure.step}, most likely from a memory leak rather than from the plan: "
            f"likely leak: {format_bytes(rate)}/step over {n} steps (allocated memory at "
            f"{str(leak['point']).replace('_', ' ')}), cause {leak['cause']} ({leak['category']}): "
            f"{leak['fix']}. memopt did not re-plan: a smaller plan cannot hold a leak, it would only postpone the "
            f"next out-of-memory error. The failed step was undone (parameters, optimizer state and step count are "
            f"those after {failure.step} completed step(s)); free what is kept and call step(batch) again with the "
            "same batch. To re-plan anyway: RuntimeGuard(diagnose_leaks=False) (under memopt.wrap: "
            "wrapped.guard.oom.leak_check = None)")
