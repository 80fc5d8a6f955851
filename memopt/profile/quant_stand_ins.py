"""Fake-tensor stand-ins for bitsandbytes' quantized linear layers: the same storage, the same temporaries.

bitsandbytes' kernels cannot run on fake tensors, and its own fake kernels (``bitsandbytes/_ops.py``)
allocate only each op's output, while the CUDA kernels behind some ops allocate more inside (the 4-bit
GEMM dequantizes the whole weight into a temporary first). ``bnb.nn.Params4bit`` cannot even wrap a
fake tensor (``Tensor._make_subclass`` refuses a ``FakeTensor``). So a simulated step swaps every
quantized layer for a stand-in that stores exactly what bitsandbytes stores, and runs a forward and a
backward that allocate exactly what bitsandbytes' **CUDA** path allocates, in the same order, with the
same lifetimes. Mirrored code (bitsandbytes 0.50.2):

``FakeLinear4bit`` (4-bit NF4/FP4, ``bnb.nn.Linear4bit``)
  storage, from ``functional.quantize_4bit`` / ``Params4bit._quantize`` / ``backends/cuda/ops.py``
  ``quantize_4bit``: packed codes uint8 ``((n + 1) // 2, 1)``; ``absmax`` fp32 per 64-value block, or
  with double quantization (``compress_statistics``) uint8 per block plus ``state2`` (fp32 absmax per 256
  blocks, a private copy of the 256-entry fp32 dynamic code) and a 0-dim fp32 ``offset``; a fresh
  16-entry fp32 code per layer (``get_4bit_type``). Six (or three) allocations per layer.
  forward, ``nn/modules.py`` ``Linear4bit.forward``: input cast to the compute dtype (a copy unless it
  already is), bias cast, ``autograd/_functions.py`` ``matmul_4bit``: without a gradient to compute
  (``not (A.requires_grad or bias.requires_grad)``) the GEMM runs outside autograd; otherwise
  ``MatMul4Bit.forward``, which keeps only ``ctx.tensors = (None, B)`` — the packed weight, already
  stored: **no activation is saved** (0.50.2 no longer saves the input). The GEMM is
  ``backends/cuda/ops.py`` ``bitsandbytes::gemm_4bit``: for more than 1536 rows, a K not divisible by
  the block size, or when ``_gemm_4bit_use_custom_cuda`` says so (ported below as
  :func:`gemm_4bit_uses_fused_kernel`; on an H200 it picks the fused kernel only up to 64 rows for
  large weights), ``_dequant_linear_fallback``: fp32 absmax dequantized (``empty_like``), ``+ offset``
  (both alive until the GEMM returns), the weight dequantized into ``torch.empty(shapeB, A.dtype)``,
  ``F.linear``; else the fused ``cgemm_4bit`` kernel (output only). Output cast back to the input dtype.
  backward, ``MatMul4Bit.backward`` (inherited unchanged): ``F.dequantize_4bit(B, state)`` (nested absmax
  fp32 temporary, weight dequantized into ``quant_state.dtype``), ``.to(grad_output.dtype)``, matmul.
``FakeLinear8bitLt`` (LLM.int8, ``bnb.nn.Linear8bitLt`` with ``has_fp16_weights=False``, threshold 0)
  storage, ``Int8Params._quantize``: int8 weight ``(N, K)`` and fp32 row scales ``SCB`` ``(N,)``.
  forward, ``bnb.matmul`` -> ``MatMul8bitLt.forward`` (the CUDA path; on CPU bitsandbytes takes
  ``MatMul8bitFp``, which dequantizes the weight instead): ``A.to(float16)`` (freed after quantizing),
  ``int8_vectorwise_quant`` -> int8 ``(M, K)`` + fp32 ``(M,)``; ``int8_scaled_mm`` (``backends/default``)
  -> ``int8_linear_matmul`` int32 ``(M, N)`` -> ``int8_mm_dequant`` (CUDA: fp16 ``(M, N)``, bias added in
  place, ``.to(A.dtype)``). Saved: ``ctx.tensors = (None, None, A)`` — the input itself, kept as a ctx
  attribute (so saved-tensor hooks, i.e. activation offload, never see it).
  backward (inherited unchanged): ``CB.to(A.dtype, copy=True).mul_(SCB.unsqueeze(1).mul(1/127))``, matmul.

Where a bitsandbytes op allocates nothing but its output on CUDA (``dequantize_4bit``, ``dequantize_blockwise``,
``int8_vectorwise_quant``, ``int8_linear_matmul``, ``int8_mm_dequant`` asked for fp16), the stand-ins call it
and bitsandbytes' registered fake kernel answers: exact, and a trace's cost recorder sees a memory-bound op
moving exactly its inputs and outputs (the int8 GEMM's FLOPs are not counted as matmul FLOPs).

The stand-in classes subclass bitsandbytes' modules, so they are created on first access
(``from memopt.profile.quant_stand_ins import FakeLinear4bit``), and only bitsandbytes' presence is needed.
Which GPU the 4-bit GEMM dispatch assumes is :func:`target_gpu` (default: an H200).

For peft, the stand-ins are ``bnb.nn.Linear4bit`` / ``Linear8bitLt`` subclasses (so peft wraps them in its
bitsandbytes LoRA layers, the code a real QLoRA run executes) and expose ``W_q`` and ``dequantize()`` (the
hook ``peft.utils.integrations.dequantize_module_weight`` uses, here for DoRA), mirroring
``bnb.functional.dequantize_4bit`` and ``int8_vectorwise_dequant``.

The simulated step counts parameters and buffers as the model's storage, so the quantization state of a
stand-in is registered as (non-persistent) buffers.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from math import prod
from typing import Any

import torch
from torch import nn

from memopt.profile.tracker import report_scratch
from memopt.units import allocator_size

__all__ = [
    "BNB_NESTED_BLOCKSIZE",
    "TargetGPU",
    "gemm_4bit_uses_fused_kernel",
    "quant_state_tensors",
    "target_gpu",
    "visible_bnb_kernels",
]

BNB_NESTED_BLOCKSIZE = 256  # double quantization: the block absmax values are quantized in blocks of 256
GEMM_4BIT_CUSTOM_MAX_M = 1536  # backends/cuda/ops.py: past this many rows, dequantize + F.linear
_GEMM_4BIT_CUSTOM_FLOOR_M = 4


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


@functools.cache
def gemm_4bit_uses_fused_kernel(M: int, N: int, K: int, dtype: torch.dtype, blocksize: int = 64, *,
                                major: int = 9, minor: int = 0, num_sms: int = 132) -> bool:
    """Whether bitsandbytes' CUDA ``gemm_4bit`` takes the fused kernel (no dequantized weight temporary).

    A port of the dispatch in ``bitsandbytes/backends/cuda/ops.py`` (0.50.2): the ``gemm_4bit`` kernel's
    ``M > 1536`` and ``K % blocksize`` checks and ``_gemm_4bit_use_custom_cuda`` (CUDA, not ROCm)."""
    if M > GEMM_4BIT_CUSTOM_MAX_M or K % blocksize != 0:
        return False
    if M <= _GEMM_4BIT_CUSTOM_FLOOR_M:
        return True
    n_blocks = (N + 63) // 64
    if dtype == torch.float32 or major < 7:
        return M < 8
    if major == 7 and (minor < 5 or dtype != torch.float16):
        return M < 8
    if (major == 8 and minor == 7) or major == 11:
        return False
    if major == 10:
        if n_blocks >= num_sms * 3:
            return M <= 32
        if n_blocks >= num_sms:
            return False if K >= N else M <= 8
        return False
    is_sm75 = major == 7 and minor == 5
    is_sm80 = major == 8 and minor == 0
    is_sm86 = major == 8 and minor == 6
    is_sm90 = major == 9
    is_sm120 = major == 12 and minor == 0
    is_sm121 = major == 12 and minor == 1
    is_hbm = is_sm80 or is_sm90
    tall_k_2xn = K > N * 2
    if N * K < 4 * 1024 * 1024:
        if K * 2 < N:
            if is_hbm:
                low_wave = n_blocks * 3 < num_sms
                if is_sm80:
                    cap = 1536 if low_wave else 512
                    return cap >= M
                cap = 512 if low_wave else 320
                return cap >= M
            if is_sm75:
                if n_blocks >= num_sms * 3:
                    return M <= 320
                if K >= 1024:
                    return M <= 64
                if K >= 704:
                    return M <= 96
                return M <= 320
            if n_blocks >= num_sms:
                return M <= 320
            return M <= 192 if n_blocks * K > num_sms * 320 else M <= 320
        quarter_wave = n_blocks * 4 <= num_sms
        if is_sm80 and quarter_wave:
            if K >= N:
                cap = 32 if n_blocks * 8 <= num_sms else 128
                return cap >= M
            return M <= 384
        if is_sm75 and n_blocks < num_sms and M > 8:
            return M <= 64
        if quarter_wave:
            cap = 32 if (K < N or is_hbm) else 23
            return cap >= M
        if n_blocks * 2 <= num_sms:
            return M <= 16
        return False
    if M > 512:
        return False
    if M < 8:
        hbm_m67_thresh = 36 if is_sm90 else 48
        if is_hbm and M >= 6 and n_blocks >= hbm_m67_thresh:
            lt_75pct_wave = n_blocks * 4 < num_sms * 3
            lt_60pct_wave = n_blocks * 5 < num_sms * 3
            if K > N and lt_75pct_wave:
                return False
            if K == N:
                if is_sm80 and lt_60pct_wave:
                    return False
                if is_sm90 and lt_75pct_wave and not lt_60pct_wave:
                    return False
        return True
    if is_sm75:
        if n_blocks >= num_sms * 3:
            cap = 128 if K < N else 64
            return cap >= M
        if n_blocks >= num_sms // 2:
            return M <= 64
        return M <= 32
    if is_sm80:
        if n_blocks >= num_sms * 3:
            return M <= 128
        if n_blocks >= num_sms:
            cap = 64 if K < N else 32
            return cap >= M
        if K >= N * 3 and n_blocks * 4 > num_sms:
            return False
        if K == N and n_blocks >= 48 and n_blocks * 5 < num_sms * 3:
            return False
        if n_blocks * 2 < num_sms:
            if K <= N:
                return M <= 128
            if n_blocks * 3 >= num_sms:
                return False
        if n_blocks >= num_sms // 2 and K < N:
            return M <= 128
        return M <= 16
    if is_sm86:
        if n_blocks >= num_sms:
            return M <= 128
        if n_blocks >= num_sms // 2:
            return M <= 64
        return M <= 16
    if is_sm90:
        if n_blocks >= num_sms * 3:
            return M <= 64
        if n_blocks >= num_sms * 2:
            return M <= 48
        if n_blocks >= num_sms:
            return M <= 32
        if n_blocks >= num_sms // 2:
            if K >= N and n_blocks * 4 < num_sms * 3:
                return False
            return M <= 16
        return False
    if is_sm121 and n_blocks >= num_sms:
        return M <= 256
    if is_sm120:
        if n_blocks >= num_sms * 3:
            return M <= 256
        if n_blocks >= num_sms * 2:
            return M <= 128
        if n_blocks * 5 >= num_sms * 4:
            cap = 96 if K >= N else 64
            return cap >= M
        if n_blocks >= num_sms:
            return M <= 64
        if n_blocks >= num_sms // 2:
            cap = 64 if (K * 2 >= N and n_blocks >= 128) else 8
            return cap >= M
        if tall_k_2xn and n_blocks > 64:
            return M <= 16
        return M <= 8
    if n_blocks >= num_sms * 3:
        return M <= 256
    if n_blocks >= num_sms * 2:
        return M <= 128
    if n_blocks * 5 >= num_sms * 4:
        if tall_k_2xn or n_blocks >= 200:
            return M <= 128
        if K >= N:
            cap = 128 if num_sms >= 60 else 32
            return cap >= M
        return M <= 64
    if n_blocks >= num_sms // 2:
        if tall_k_2xn:
            return M <= 64
        if n_blocks >= 64:
            return M <= 8
        return M <= 32
    if K > N and n_blocks <= 48:
        cap = 12 if K >= N * 3 else 10
        return cap >= M
    cap = 16 if (tall_k_2xn or n_blocks < 48) else 8
    return cap >= M


def _bnb() -> Any:
    try:
        import bitsandbytes as bnb
    except Exception as exc:  # pragma: no cover - depends on the environment
        raise ValueError("quantized weights need bitsandbytes: pip install 'memopt[bnb]'") from exc
    return bnb


@contextlib.contextmanager
def _outside_fake_mode() -> Iterator[None]:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        yield


# --------------------------------------------------------------------------------------------------------
# 4-bit
# --------------------------------------------------------------------------------------------------------

def _under_selective_checkpointing() -> bool:
    from torch.utils import checkpoint
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    kinds = tuple(getattr(checkpoint, n) for n in ("_CachingTorchDispatchMode", "_CachedTorchDispatchMode")
                  if hasattr(checkpoint, n))
    return bool(kinds) and any(isinstance(m, kinds) for m in _get_current_dispatch_mode_stack())


def _gemm_4bit_cuda(A: torch.Tensor, B: torch.Tensor, quant_state: Any, bias: torch.Tensor | None) -> torch.Tensor:
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


def _matmul_4bit_class() -> type:
    bnb = _bnb()
    from bitsandbytes.autograd._functions import MatMul4Bit

    class _CudaMatMul4Bit(MatMul4Bit):
        """``MatMul4Bit`` with its forward GEMM allocating as on CUDA; backward is bitsandbytes' own."""

        @staticmethod
        def forward(ctx, A, B, out=None, bias=None, quant_state=None):  # type: ignore[override]
            ctx.is_empty = False
            if A.numel() == 0:
                ctx.is_empty = True
                ctx.A, ctx.B, ctx.bias = A, B, bias
                return torch.empty((*A.shape[:-1], quant_state.shape[0]), dtype=A.dtype, device=A.device)
            B = B.view(-1, 1)
            output = _gemm_4bit_cuda(A, B, quant_state, bias)
            if out is not None:
                out.copy_(output)
                output = out
            ctx.state = quant_state
            ctx.dtype_A, ctx.dtype_B, ctx.dtype_bias = A.dtype, B.dtype, None if bias is None else bias.dtype
            ctx.tensors = (None, B) if any(ctx.needs_input_grad[:2]) else (None, None)
            return output

    _ = bnb
    return _CudaMatMul4Bit


@functools.cache
def _cuda_matmul_4bit() -> type:
    return _matmul_4bit_class()


def _linear4bit_class() -> type:
    bnb = _bnb()
    from bitsandbytes.functional import QuantState

    class FakeLinear4bit(bnb.nn.Linear4bit):
        """A ``bnb.nn.Linear4bit`` whose storage is fake tensors and whose forward allocates as on CUDA."""

        @classmethod
        def from_linear(cls, linear: nn.Linear, *, compute_dtype: torch.dtype, double_quant: bool = True,
                        quant_type: str = "nf4", blocksize: int = 64,
                        storage_dtype: torch.dtype | None = None) -> FakeLinear4bit:
            """The stand-in for ``linear`` quantized (weights never read: only shapes and the device)."""
            device = linear.weight.device
            n_out, n_in = linear.out_features, linear.in_features
            with _outside_fake_mode():  # bitsandbytes wraps the placeholder weight in a Params4bit
                self = cls(n_in, n_out, bias=False, compute_dtype=compute_dtype, compress_statistics=double_quant,
                           quant_type=quant_type, device="meta")
            n = n_out * n_in
            blocks = -(-n // blocksize)
            packed = torch.empty(((n + 1) // 2, 1), dtype=torch.uint8, device=device)
            code = torch.empty(16, dtype=torch.float32, device=device)
            dtype = storage_dtype or compute_dtype
            if double_quant:
                nested_blocks = -(-blocks // BNB_NESTED_BLOCKSIZE)
                state2 = QuantState(absmax=torch.empty(nested_blocks, dtype=torch.float32, device=device),
                                    code=torch.empty(256, dtype=torch.float32, device=device),
                                    blocksize=BNB_NESTED_BLOCKSIZE, dtype=torch.float32)
                qs = QuantState(absmax=torch.empty(blocks, dtype=torch.uint8, device=device),
                                shape=torch.Size([n_out, n_in]), dtype=dtype, blocksize=blocksize, code=code,
                                quant_type=quant_type, offset=torch.empty((), dtype=torch.float32, device=device),
                                state2=state2)
            else:
                qs = QuantState(absmax=torch.empty(blocks, dtype=torch.float32, device=device),
                                shape=torch.Size([n_out, n_in]), dtype=dtype, blocksize=blocksize, code=code,
                                quant_type=quant_type)
            weight = nn.Parameter(packed, requires_grad=False)
            # what peft reads from a Params4bit
            weight.quant_state = qs
            weight.compress_statistics = double_quant
            weight.quant_type = quant_type
            weight.blocksize = blocksize
            weight.quant_storage = torch.uint8
            weight.bnb_quantized = True
            self.weight = weight
            self.quant_state = qs
            self.bias = linear.bias
            for name, t in (("absmax", qs.absmax), ("code", qs.code), ("offset", qs.offset),
                            ("nested_absmax", qs.state2.absmax if qs.nested else None),
                            ("nested_code", qs.state2.code if qs.nested else None)):
                if t is not None:
                    self.register_buffer(f"quant_{name}", t, persistent=False)
            return self

        @property
        def W_q(self) -> torch.Tensor:  # the attribute name peft looks for
            return self.weight

        def dequantize(self) -> torch.Tensor:
            """``bnb.functional.dequantize_4bit(weight, quant_state)`` (peft's DoRA calls it every forward)."""
            return _bnb().functional.dequantize_4bit(self.weight, self.weight.quant_state)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # nn/modules.py Linear4bit.forward (the CPU inference repacking branch does not apply on a GPU)
            quant_state = self.weight.quant_state
            if not self.compute_type_is_set:
                self.set_compute_type(x)
                self.compute_type_is_set = True
            inp_dtype = x.dtype
            if self.compute_dtype is not None:
                x = x.to(self.compute_dtype)
            bias = self.bias
            if bias is not None:
                if bias.dtype != x.dtype:
                    bias.data = bias.data.to(x.dtype)
                bias = bias.to(self.compute_dtype)
            # autograd/_functions.py matmul_4bit
            needs_grad = torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
            if not needs_grad:
                out = _gemm_4bit_cuda(x, self.weight.view(-1, 1), quant_state, bias)
            else:
                out = _cuda_matmul_4bit().apply(x, self.weight, None, bias, quant_state)
            return out.to(inp_dtype)

        def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
            nn.Module._save_to_state_dict(self, destination, prefix, keep_vars)

    FakeLinear4bit.__module__ = __name__
    return FakeLinear4bit


def _linear8bit_class() -> type:
    bnb = _bnb()
    from bitsandbytes.autograd._functions import MatMul8bitLt

    class _CudaMatMul8bitLt(MatMul8bitLt):
        """``MatMul8bitLt`` (threshold 0, frozen int8 weights) allocating as on CUDA; backward unchanged."""

        @staticmethod
        def forward(ctx, A, B, out=None, bias=None, state=None):  # type: ignore[override]
            ctx.is_empty = False
            if prod(A.shape) == 0:
                ctx.is_empty = True
                ctx.A, ctx.B, ctx.bias = A, B, bias
                return torch.empty(A.shape[:-1] + B.shape[:1], dtype=A.dtype, device=A.device)
            input_shape = A.shape
            if len(A.shape) == 3:
                A = A.reshape(-1, A.shape[-1])
            CA, SCA, _ = torch.ops.bitsandbytes.int8_vectorwise_quant.default(A.to(torch.float16), 0.0)
            # backends/default int8_scaled_mm -> CUDA int8_linear_matmul (int32) -> CUDA int8_mm_dequant
            out_i32 = torch.ops.bitsandbytes.int8_linear_matmul.default(CA, state.CB)
            out16 = torch.ops.bitsandbytes.int8_mm_dequant.default(out_i32, SCA, state.SCB, dtype=torch.float16)
            if bias is not None:
                out16.add_(bias)  # fused for fp16 bias, added in place otherwise: no allocation either way
            output = out16.to(A.dtype)
            del out_i32, out16, CA, SCA
            ctx.state = state
            ctx.grad_shape = input_shape
            ctx.dtype_A = A.dtype
            ctx.dtype_bias = None if bias is None else bias.dtype
            if any(ctx.needs_input_grad[:2]):
                ctx.tensors = (None, None, A)
                ctx.tensor_states = (None, state.idx)
            else:
                ctx.tensors = [None, None, None]
                ctx.tensor_states = (None, None)
                ctx.save_for_backward(None, None)
            if len(input_shape) == 3:
                return output.reshape((*input_shape[:-1], state.CB.shape[0]))
            return output

    class FakeLinear8bitLt(bnb.nn.Linear8bitLt):
        """A ``bnb.nn.Linear8bitLt`` (frozen int8 weights) on fake tensors, allocating as on CUDA."""

        @classmethod
        def from_linear(cls, linear: nn.Linear) -> FakeLinear8bitLt:
            device = linear.weight.device
            with _outside_fake_mode():  # bitsandbytes wraps the placeholder weight in an Int8Params
                self = cls(linear.in_features, linear.out_features, bias=False, has_fp16_weights=False,
                           threshold=0.0, device="meta")
            cb = torch.empty((linear.out_features, linear.in_features), dtype=torch.int8, device=device)
            scb = torch.empty((linear.out_features,), dtype=torch.float32, device=device)
            weight = nn.Parameter(cb, requires_grad=False)
            weight.CB, weight.SCB, weight.has_fp16_weights = None, None, False
            self.weight = weight
            self.state.CB, self.state.SCB = cb, scb
            self.bias = linear.bias
            self.register_buffer("quant_scb", scb, persistent=False)
            return self

        @property
        def W_q(self) -> torch.Tensor:
            return self.weight

        def dequantize(self) -> torch.Tensor:
            """peft's ``dequantize_bnb_weight`` for 8 bits: ``int8_vectorwise_dequant`` (default kernel)."""
            return self.state.CB * self.state.SCB.view(-1, 1) * 7.874015718698502e-3

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # nn/modules.py Linear8bitLt.forward, then bnb.matmul -> MatMul8bitLt (the CUDA path)
            self.state.is_training = self.training
            if self.bias is not None and self.bias.dtype != x.dtype:
                self.bias.data = self.bias.data.to(x.dtype)
            return _CudaMatMul8bitLt.apply(x, self.weight, None, self.bias, self.state)

        def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
            nn.Module._save_to_state_dict(self, destination, prefix, keep_vars)

        def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
            nn.Module._load_from_state_dict(self, *args, **kwargs)

    FakeLinear8bitLt.__module__ = __name__
    return FakeLinear8bitLt


_CLASSES: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    # the stand-in classes subclass bitsandbytes' modules, so they are built on first use
    if name == "FakeLinear4bit":
        if name not in _CLASSES:
            _CLASSES[name] = _linear4bit_class()
        return _CLASSES[name]
    if name == "FakeLinear8bitLt":
        if name not in _CLASSES:
            _CLASSES[name] = _linear8bit_class()
        return _CLASSES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------------------------------------
# measuring real runs
# --------------------------------------------------------------------------------------------------------

def quant_state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The quantization-state tensors of real bitsandbytes layers (absmax, codes, offsets, row scales): they
    are neither parameters nor buffers, so a tracker must be told about them. Stand-ins register theirs as
    buffers already and are skipped."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            out.append(t)

    for module in model.modules():
        if any(n.startswith("quant_") for n, _ in module.named_buffers(recurse=False)):
            continue
        qs = getattr(getattr(module, "weight", None), "quant_state", None)
        if qs is not None and type(module).__name__ == "Linear4bit":
            for t in (qs.absmax, qs.code, qs.offset):
                add(t)
            if qs.nested:
                add(qs.state2.absmax)
                add(qs.state2.code)
        state = getattr(module, "state", None)
        if type(module).__name__ == "Linear8bitLt" and state is not None:
            add(state.SCB if state.SCB is not None else getattr(module.weight, "SCB", None))
    return out


class _VisibleKernels(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self, table: dict[Any, Any]) -> None:
        super().__init__()
        self.table = table

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        impl = self.table.get(func)
        if impl is not None:
            return impl(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def visible_bnb_kernels() -> Iterator[None]:
    """Run bitsandbytes' pure-PyTorch kernels (``backends/default/ops.py``) as ordinary Python, so a
    ``MemoryTracker`` entered *before* this context sees the tensors they allocate inside.

    A custom op is one dispatch event: a tracker sees its outputs but not the temporaries of its kernel (the
    4-bit GEMM's dequantized weight). Within this context ``bitsandbytes::gemm_4bit`` runs
    ``_gemm_4bit_default_impl`` — the very function bitsandbytes registers as its CPU kernel — op by op."""
    _bnb()
    from bitsandbytes.backends.default import ops as default_ops

    table = {torch.ops.bitsandbytes.gemm_4bit.default: default_ops._gemm_4bit_default_impl}
    with _VisibleKernels(table):
        yield
