"""The memory of low-rank adapters, from the targets' shapes alone (no model, no peft): the adapter parameters that
peft creates for each target, their count and bytes, their gradients, and their optimizer states -- on the device and,
for paged 8-bit AdamW, in paged (unified) memory, which the caching allocator's cap does not see. The estimator and
the tests read these sums; applying the adapters to a model is :mod:`memopt.techniques.adapters`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from memopt.techniques.adapters import AdapterSetting
from memopt.techniques.optimizers import VARIANTS
from memopt.units import allocator_size

__all__ = ["AdapterBytes", "adapter_memory", "adapter_param_count", "adapter_tensor_shapes", "optimizer_state_bytes"]


def adapter_tensor_shapes(shapes: Iterable[tuple[int, int]], setting: AdapterSetting) -> list[tuple[int, ...]]:
    """Shapes of the adapter parameters peft creates for targets of (out_features, in_features):
    ``lora_A`` (r, in), ``lora_B`` (out, r), and for DoRA ``lora_magnitude_vector`` (out,)."""
    out: list[tuple[int, ...]] = []
    for n_out, n_in in shapes:
        out += [(setting.r, n_in), (n_out, setting.r)]
        if setting.kind == "dora":
            out.append((n_out,))
    return out


def adapter_param_count(shapes: Iterable[tuple[int, int]], setting: AdapterSetting) -> int:
    """Trainable parameters: r x (in + out) per target, + out for DoRA's magnitude."""
    total = 0
    for shape in adapter_tensor_shapes(shapes, setting):
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def optimizer_state_bytes(numels: Iterable[int], optimizer: str, param_dtype: torch.dtype = torch.float32,
                          *, rounded: bool = True) -> tuple[int, int]:
    """(device bytes, paged bytes) of the optimizer states of parameters of these sizes: the variant's own byte
    model (``memopt.techniques.optimizers``)."""
    if optimizer not in VARIANTS:
        raise ValueError(f"no state model for optimizer {optimizer!r}")
    return VARIANTS[optimizer].state_bytes(list(numels), param_dtype, rounded)


@dataclass(frozen=True)
class AdapterBytes:
    """Memory of the adapters of one model (bytes, each tensor rounded like the CUDA allocator)."""

    params: int  # the adapter weights
    grads: int  # their gradients (same shapes and dtype), alive from backward to the optimizer step
    optimizer_device: int  # optimizer states in device memory
    optimizer_paged: int  # optimizer states in paged memory: not counted by the allocator cap
    count: int  # trainable parameters

    @property
    def device_total(self) -> int:
        return self.params + self.grads + self.optimizer_device


def adapter_memory(shapes: Iterable[tuple[int, int]], setting: AdapterSetting, *, dtype: torch.dtype = torch.float32,
                   optimizer: str = "adamw_fused", rounded: bool = True) -> AdapterBytes:
    """Adapter parameters, gradients and optimizer states for targets of (out_features, in_features).

    ``dtype``: the adapters' dtype (peft keeps them in fp32 by default, even over a bf16 base)."""
    tensors = adapter_tensor_shapes(list(shapes), setting)
    numels = []
    for shape in tensors:
        n = 1
        for d in shape:
            n *= d
        numels.append(n)
    size = torch.empty((), dtype=dtype).element_size()
    r = allocator_size if rounded else (lambda n: n)
    params = sum(r(n * size) for n in numels)
    device, paged = optimizer_state_bytes(numels, optimizer, dtype, rounded=rounded)
    return AdapterBytes(params=params, grads=params, optimizer_device=device, optimizer_paged=paged,
                        count=sum(numels))
