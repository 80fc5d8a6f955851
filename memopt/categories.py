"""Memory categories used in every breakdown (estimate, plan, telemetry, reports)."""

from __future__ import annotations

from enum import Enum

__all__ = ["MemoryCategory"]


class MemoryCategory(str, Enum):
    """Where a byte of GPU memory goes during a training step."""

    PARAMETERS = "parameters"  # model weights as stored on the GPU (any dtype, quantized included)
    GRADIENTS = "gradients"  # .grad of trainable parameters (live at the peak)
    OPTIMIZER_STATES = "optimizer_states"  # Adam moments, master weights, step counters, 8-bit blocks
    ACTIVATIONS = "activations"  # tensors saved for backward, inputs, outputs and logits alive at the peak
    # everything else alive at the peak: transient buffers, workspaces, grads of activations
    TEMPORARIES = "temporaries"
    ALLOCATOR_OVERHEAD = "allocator_overhead"  # reserved minus allocated: caching allocator rounding and fragmentation
    RUNTIME = "runtime"  # outside PyTorch's allocator: CUDA context, cuBLAS/cuDNN handles, NCCL, paged memory

    def __str__(self) -> str:  # "activations", not "MemoryCategory.ACTIVATIONS"
        return self.value
