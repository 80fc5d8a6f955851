"""Trace-free lower bounds of a candidate's footprint: what its model states alone must take.

At the first optimizer step every trained parameter's gradient and optimizer state exist next to the weights, so
the allocated peak of any strategy is at least

    weights (in the strategy's weight dtype, or at the quantized width) + buffers
    + per trained parameter: its gradient, its optimizer state and (``bf16_master``) its fp32 master copy

and its total adds the memory the CUDA runtime holds outside the allocator. Each term is counted at the least the
technique can take (an 8-bit optimizer at one byte per state, SGD and a user's optimizer at none,
adapters' own parameters at none), so the floor needs no trace and never exceeds the estimate
(``tests/plan/test_planner_speed.py`` checks it against every candidate of a model).

The planner uses it twice: the search skips candidates whose floor exceeds the budget, and the infeasibility
report skips a policy whose smallest floor does (a 70B model's full fine-tuning on one 80 GB GPU needs no trace
to be ruled out), reporting the floor as a lower bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from memopt.estimate.estimator import OFFLOAD_RUNTIME_BYTES
from memopt.hardware import HardwareSpec
from memopt.profile.profile import Profile, is_float_dtype
from memopt.strategy import Strategy
from memopt.techniques.optimizers import VARIANTS
from memopt.techniques.precision import stored_dtype, weight_dtype
from memopt.units import allocator_size

__all__ = ["FLOOR_REASON", "StateFloor", "state_floor"]

FLOOR_REASON = "model states alone exceed the budget"



@dataclass(frozen=True)
class StateFloor:
    """The bytes a strategy's model states take at the least, by category."""

    weights_bytes: int  # parameters and buffers
    gradients_bytes: int
    optimizer_bytes: int  # states and fp32 master copies
    runtime_bytes: int  # outside the allocator

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.gradients_bytes + self.optimizer_bytes + self.runtime_bytes

    def prediction(self) -> dict[str, Any]:
        """The floor in the shape of an estimate's ``to_dict()``, marked as a lower bound (no step time)."""
        allocated = self.total_bytes - self.runtime_bytes
        return {"peak_allocated_bytes": allocated, "peak_reserved_bytes": allocated,
                "runtime_bytes": self.runtime_bytes, "total_bytes": self.total_bytes, "step_time_s": 0.0,
                "lower_bound": True,
                "breakdown": {"parameters": self.weights_bytes, "gradients": self.gradients_bytes,
                              "optimizer_states": self.optimizer_bytes, "runtime": self.runtime_bytes}}


def state_floor(profile: Profile, s: Strategy, hw: HardwareSpec, cache: dict | None = None) -> StateFloor:
    """The least ``s``'s model states take (see the module doc); ``cache``: a dict shared over calls."""
    q = s.extra("quantization")
    bits = int(dict(q).get("bits", 4)) if q is not None else 0
    frozen_base = bits or s.extra("adapters") is not None  # only the adapters train (their bytes counted as 0)
    key = (s.precision, s.optimizer, s.activation_offload, bits, bool(frozen_base))
    if cache is not None and key in cache:
        return cache[key]
    wd = weight_dtype(s.precision)
    weights = profile.param_bytes(wd)
    if bits:
        weights = min(weights, sum(n for n, _, _ in profile.param_sizes) * bits // 8)
    weights += profile.buffer_bytes(wd)
    grads = states = paged = 0
    if not frozen_base:
        # the optimizer steps the weights in the dtype they are stored in (``stored_dtype``: the model's own, or
        # bf16 under bf16_pure), or bf16_master's fp32 copies: the trained numels by bytes per element
        trained: dict[int, list[int]] = {}
        for n, dtype, trains in profile.param_sizes:
            if trains and is_float_dtype(dtype):
                item = 4 if s.precision == "bf16_master" else stored_dtype(wd, getattr(torch, dtype)).itemsize
                trained.setdefault(item, []).append(n)
        grads = sum(allocator_size(n * item) for item, numels in trained.items() for n in numels)
        # the user's own optimizer: nothing assumed; a paged variant's states live in unified memory, outside the
        # allocator, and count in the runtime bytes
        known = VARIANTS.get(s.optimizer)
        optimizer_floor = 0 if known is None else sum(known.floor_bytes(numels, item)
                                                      for item, numels in trained.items())
        paged = optimizer_floor if known is not None and known.paged else 0
        states = optimizer_floor - paged
        if s.precision == "bf16_master":
            states += grads  # the fp32 master copies
    runtime = hw.runtime_overhead_bytes + (OFFLOAD_RUNTIME_BYTES if s.activation_offload else 0) + paged
    floor = StateFloor(weights, grads, states, runtime)
    if cache is not None:
        cache[key] = floor
    return floor

