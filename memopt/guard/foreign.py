"""Memory the plan does not own: found at an out-of-memory error, planned around, named when nothing fits.

A plan accounts for the model states (parameters, gradients, optimizer states, master weights), the step's
activations and temporaries, and the CUDA runtime. Anything else on the device -- a cache another library
filled, an evaluation model, a second process, fragmentation the plan did not predict -- is *foreign*: a
smaller plan of the same budget cannot absorb it, and re-planning with a margin inflated by it (the
measured/predicted ratio of a step that also carried it) only asks for ever smaller plans that still fail.

At an OOM, once the failed step has been freed (its gradients dropped, the cache emptied), the guard measures
what is left (:func:`measure_foreign`): allocated bytes beyond what the plan's own live states and the batch
hold, plus the part of the budget the device can no longer give because memory outside this process's
allocator (another process, a library allocating on its own) holds it. When that exceeds
``threshold_bytes``, the OOM's ``foreign_bytes`` is set, a "foreign_memory" event says so, the escalation plans
for ``budget - foreign`` (:func:`remaining_budget`) with the failing plan's own under-prediction measured
without the foreign part, and if nothing fits in what is left the run stops with a message that names the
foreign memory and its size (:func:`foreign_message`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from memopt.guard.memory import MemorySource, state_bytes
from memopt.units import MiB, format_bytes

__all__ = ["DEFAULT_FOREIGN_THRESHOLD", "ForeignMemory", "foreign_message", "measure_foreign", "remaining_budget"]

#: below this, what is left after freeing a failed step is the step's own small change: cuBLAS workspaces (32 MiB
#: per handle, allocated through PyTorch's allocator), a scaler's tensors, allocator rounding
DEFAULT_FOREIGN_THRESHOLD = 256 * MiB


@dataclass(frozen=True)
class ForeignMemory:
    """Device memory in use that the plan did not make (bytes)."""

    inside_allocator_bytes: int  # allocated through PyTorch by something other than the plan
    outside_allocator_bytes: int  # of the budget the device cannot give: used outside this process's allocator
    own_bytes: int  # what the plan's live states and the batch hold (counted, not foreign)
    allocated_bytes: int  # allocated when measured (after the failed step was freed)
    budget_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.inside_allocator_bytes + self.outside_allocator_bytes

    @property
    def remaining_bytes(self) -> int:
        return max(self.budget_bytes - self.total_bytes, 0)

    def describe(self) -> str:
        parts = []
        if self.inside_allocator_bytes:
            parts.append(f"{format_bytes(self.inside_allocator_bytes)} allocated through PyTorch by something other "
                         "than the plan")
        if self.outside_allocator_bytes:
            parts.append(f"{format_bytes(self.outside_allocator_bytes)} of the budget held on the device outside "
                         "PyTorch's allocator (other processes or libraries), beyond the CUDA runtime")
        return f"{format_bytes(self.total_bytes)} of foreign memory (" + "; ".join(parts) + ")"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total_bytes": self.total_bytes, "remaining_bytes": self.remaining_bytes}


def _own_bytes(memory: MemorySource, step: Any, batch: Any) -> int:
    model = getattr(step, "model", None)
    optimizer = getattr(step, "optimizer", None)
    own = sum(state_bytes(memory, model, optimizer).values())
    master = getattr(step, "master", None)
    if master is not None and optimizer is not None:
        stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
        extra = [m for m in getattr(master, "masters", []) if id(m) not in stepped]
        own += memory.tensor_bytes(extra)
    if batch is not None:
        own += memory.tensor_bytes(batch)
    return own


def measure_foreign(memory: MemorySource | None, step: Any, plan: Any, batch: Any = None, *,
                    threshold_bytes: int = DEFAULT_FOREIGN_THRESHOLD) -> ForeignMemory | None:
    """What of the device the plan does not own, measured now (call it after the failed step was freed), or
    None when that is below ``threshold_bytes`` or cannot be measured."""
    if memory is None or plan is None:
        return None
    sample = memory.sample()
    own = _own_bytes(memory, step, batch)
    inside = max(sample.allocated_bytes - own, 0)
    outside = 0
    if sample.device_used_bytes is not None and sample.device_total_bytes is not None:
        # memory outside this process's allocator (other processes, libraries that allocate on their own) takes
        # from the budget only where the device no longer has the budget to give: what the process could still
        # hold is the device's free memory, what it reserves, and the runtime the plan predicted
        runtime = int((plan.prediction or {}).get("runtime_bytes") or 0)
        free = sample.device_total_bytes - sample.device_used_bytes
        outside = max(int(plan.budget_bytes) - (free + sample.reserved_bytes + runtime), 0)
    found = ForeignMemory(inside_allocator_bytes=inside, outside_allocator_bytes=outside, own_bytes=own,
                          allocated_bytes=sample.allocated_bytes, budget_bytes=int(plan.budget_bytes))
    return found if found.total_bytes >= threshold_bytes else None


def remaining_budget(plan: Any, measured: Any) -> int:
    """The budget a re-plan may use: the plan's budget less the foreign memory the OOM found (if any)."""
    foreign = int(getattr(measured, "foreign_bytes", None) or 0)
    return max(int(plan.budget_bytes) - foreign, 0)


def foreign_message(measured: Any, plan: Any, reason: str) -> str:
    """The sentence a run stops with when no plan fits in what foreign memory leaves of the budget."""
    foreign = int(getattr(measured, "foreign_bytes", None) or 0)
    detail = (getattr(measured, "foreign", None) or {}).get("description") or \
        f"{format_bytes(foreign)} of foreign memory"
    left = remaining_budget(plan, measured)
    return (f"out of memory at step {measured.step}: {detail} is on the device, outside the plan's accounting "
            f"(something other than the plan allocated it: a cache, another model, another library or process); it "
            f"leaves {format_bytes(left)} of the {format_bytes(plan.budget_bytes)} budget, and no plan fits in that "
            f"({reason}). Free that memory (or raise the budget) and call step(batch) again with the same batch")
