"""bitsandbytes' 4-bit GEMM on fake tensors, allocating what its CUDA kernel allocates, for a chosen GPU.

The CUDA ``bitsandbytes::gemm_4bit`` either runs a fused kernel (output only) or dequantizes the weight into a
temporary and calls ``F.linear``; which one depends on the shapes and the GPU
(``memopt.techniques.gemm_4bit_dispatch``). The stand-ins (``memopt.profile.quant_stand_ins``) call
:func:`gemm_4bit_cuda` for their forward; :func:`target_gpu` says which GPU it assumes (default: an H200).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from memopt.profile.tracker import report_scratch
from memopt.techniques.gemm_4bit_dispatch import gemm_4bit_uses_fused_kernel
from memopt.units import allocator_size

__all__ = ["BNB_NESTED_BLOCKSIZE", "TargetGPU", "gemm_4bit_cuda", "target_gpu"]

BNB_NESTED_BLOCKSIZE = 256  # double quantization: the block absmax values are quantized in blocks of 256


@dataclass(frozen=True)
class TargetGPU:
    """What bitsandbytes' 4-bit GEMM dispatch looks at: compute capability and SM count."""

    major: int = 9
    minor: int = 0
    num_sms: int = 132  # H200 / H100 SXM


_TARGET: contextvars.ContextVar[TargetGPU | None] = contextvars.ContextVar("memopt_bnb_target", default=None)


def _target() -> TargetGPU:
    return _TARGET.get() or TargetGPU()


@contextlib.contextmanager
def target_gpu(major: int, minor: int, num_sms: int) -> Iterator[TargetGPU]:
    """Trace for this GPU (default: an H200, sm90 with 132 SMs) while the context is active."""
    token = _TARGET.set(TargetGPU(major, minor, num_sms))
    try:
        yield _target()
    finally:
        _TARGET.reset(token)


def _under_selective_checkpointing() -> bool:
    from torch.utils import checkpoint
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    kinds = tuple(getattr(checkpoint, n) for n in ("_CachingTorchDispatchMode", "_CachedTorchDispatchMode")
                  if hasattr(checkpoint, n))
    return bool(kinds) and any(isinstance(m, kinds) for m in _get_current_dispatch_mode_stack())


def gemm_4bit_cuda(A: torch.Tensor, B: torch.Tensor, quant_state: Any, bias: torch.Tensor | None) -> torch.Tensor:
    """``bitsandbytes::gemm_4bit`` as its CUDA kernel allocates (``backends/cuda/ops.py``).

    Written out op by op (dequantize, then F.linear), so the trace sees the temporaries and counts the GEMM's
    FLOPs; under selective activation checkpointing, as one op (see below)."""
    shape_b = list(quant_state.shape)
    K = A.shape[-1]
    M = A.numel() // K if K else 0
    N = shape_b[0]
    target = _target()
    fused = gemm_4bit_uses_fused_kernel(M, N, K, A.dtype, quant_state.blocksize, major=target.major,
                                        minor=target.minor, num_sms=target.num_sms)
    if _under_selective_checkpointing():
        # Selective checkpointing decides per op: the real run shows it one op, bitsandbytes::gemm_4bit (whose
        # output it recomputes), never the matmul inside. So the stand-in calls that op (bitsandbytes' fake kernel:
        # the output) and reports the kernel's temporaries to the tracker while the output is alive.
        if fused:
            A = A.contiguous()
        out = torch.ops.bitsandbytes.gemm_4bit.default(
            A, B, shape_b, quant_state.state2.absmax if quant_state.nested else quant_state.absmax,
            quant_state.blocksize, quant_state.quant_type, bias=bias,
            absmax_8bit=quant_state.absmax if quant_state.nested else None,
            absmax_code=quant_state.state2.code if quant_state.nested else None,
            absmax_offset=quant_state.offset if quant_state.nested else None)
        if not fused:
            blocks = quant_state.absmax.numel()
            scratch = allocator_size(N * K * A.element_size())
            if quant_state.nested:
                scratch += 2 * allocator_size(blocks * 4)
            report_scratch(scratch, "gemm_4bit.dequantized_weight")
        return out
    if fused:
        # _gemm_4bit_kernel_impl: A.contiguous(), one output tensor. The GEMM is written as F.linear over a
        # zero-stride view (2 bytes of the packed weight, no allocation) so the trace counts its FLOPs.
        A = A.contiguous()
        w = B.reshape(-1)[: A.element_size()].view(A.dtype).reshape(()).expand(N, K)
        return torch.nn.functional.linear(A, w, bias)
    # _dequant_linear_fallback
    absmax = quant_state.absmax
    absmax_dq = None
    if quant_state.nested:
        absmax_dq = torch.ops.bitsandbytes.dequantize_blockwise.default(
            quant_state.absmax, quant_state.state2.absmax, quant_state.state2.code, BNB_NESTED_BLOCKSIZE,
            torch.float32)
        absmax = absmax_dq + quant_state.offset
    b_dq = torch.ops.bitsandbytes.dequantize_4bit.default(B, absmax, quant_state.blocksize, quant_state.quant_type,
                                                          shape_b, A.dtype)
    out = torch.nn.functional.linear(A, b_dq, bias)
    del absmax_dq, absmax, b_dq  # alive until the kernel function returns, as in bitsandbytes
    return out
