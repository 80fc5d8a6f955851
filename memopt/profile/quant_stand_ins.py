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
  the block size, or when ``_gemm_4bit_use_custom_cuda`` says so (ported as
  ``memopt.techniques.gemm_4bit_dispatch.gemm_4bit_uses_fused_kernel``; on an H200 it picks the fused
  kernel only up to 64 rows for large weights), ``_dequant_linear_fallback``: fp32 absmax dequantized
  (``empty_like``), ``+ offset`` (both alive until the GEMM returns), the weight dequantized into
  ``torch.empty(shapeB, A.dtype)``, ``F.linear``; else the fused ``cgemm_4bit`` kernel (output only).
  Output cast back to the input dtype.
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
The 4-bit GEMM itself is ``memopt.profile.quant_gemm_4bit``; which GPU its dispatch assumes is
``memopt.profile.quant_gemm_4bit.target_gpu`` (default: an H200).

For peft, the stand-ins are ``bnb.nn.Linear4bit`` / ``Linear8bitLt`` subclasses (so peft wraps them in its
bitsandbytes LoRA layers, the code a real QLoRA run executes) and expose ``W_q`` and ``dequantize()`` (the
hook ``peft.utils.integrations.dequantize_module_weight`` uses, here for DoRA), mirroring
``bnb.functional.dequantize_4bit`` and ``int8_vectorwise_dequant``.

The simulated step counts parameters and buffers as the model's storage, so the quantization state of a
stand-in is registered as (non-persistent) buffers.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from math import prod
from typing import Any

import torch
from torch import nn

from memopt.profile.quant_gemm_4bit import BNB_NESTED_BLOCKSIZE, gemm_4bit_cuda
from memopt.techniques.bitsandbytes_import import bitsandbytes

__all__ = ["quant_state_tensors", "stand_in_linear", "visible_bnb_kernels"]


@contextlib.contextmanager
def _outside_fake_mode() -> Iterator[None]:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        yield


# --------------------------------------------------------------------------------------------------------
# 4-bit
# --------------------------------------------------------------------------------------------------------

def _matmul_4bit_class() -> type:
    bnb = bitsandbytes()
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
            output = gemm_4bit_cuda(A, B, quant_state, bias)
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
    bnb = bitsandbytes()
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
            return bitsandbytes().functional.dequantize_4bit(self.weight, self.weight.quant_state)

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
                out = gemm_4bit_cuda(x, self.weight.view(-1, 1), quant_state, bias)
            else:
                out = _cuda_matmul_4bit().apply(x, self.weight, None, bias, quant_state)
            return out.to(inp_dtype)

        def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
            nn.Module._save_to_state_dict(self, destination, prefix, keep_vars)

    FakeLinear4bit.__module__ = __name__
    return FakeLinear4bit


def _linear8bit_class() -> type:
    bnb = bitsandbytes()
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


def stand_in_linear(linear: nn.Linear, setting: Any) -> nn.Module:
    """The stand-in of ``linear`` quantized under ``setting`` (a ``QuantSetting``: 4-bit or 8-bit)."""
    if setting.bits == 4:
        return __getattr__("FakeLinear4bit").from_linear(
            linear, compute_dtype=setting.torch_compute_dtype, double_quant=setting.double_quant,
            quant_type=setting.quant_type, blocksize=setting.blocksize)
    return __getattr__("FakeLinear8bitLt").from_linear(linear)


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
    bitsandbytes()
    from bitsandbytes.backends.default import ops as default_ops

    table = {torch.ops.bitsandbytes.gemm_4bit.default: default_ops._gemm_4bit_default_impl}
    with _VisibleKernels(table):
        yield
