"""The estimator's pieces for quantized frozen weights: storage bytes with block scales and double
quantization, dequantization temporaries, bytes moved and time. Pure maths, no bitsandbytes;
``memopt.profile.quant_stand_ins`` holds the fake-tensor stand-ins the profiler traces, with the bitsandbytes code
paths they mirror."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from memopt.techniques.gemm_4bit_dispatch import gemm_4bit_uses_fused_kernel
from memopt.techniques.quantization import QuantSetting
from memopt.units import allocator_size

__all__ = [
    "QuantizedBytes",
    "dequant_temporaries",
    "dequant_time_s",
    "dequant_traffic_bytes",
    "quantized_storage_bytes",
    "quantized_weight_bytes",
]

NESTED_BLOCKSIZE = 256
NESTED_CODE_BYTES = 256 * 4  # each layer's state2 keeps its own copy of the 256-entry fp32 dynamic code
CODE4_BYTES = 16 * 4  # each layer's 16-entry fp32 4-bit code (get_4bit_type, a fresh tensor per layer)
OFFSET_BYTES = 4  # the 0-dim fp32 mean of the block absmax values (double quantization)


@dataclass(frozen=True)
class QuantizedBytes:
    """Storage of quantized weights, by part (bytes; each tensor rounded like the CUDA allocator if asked)."""

    codes: int  # packed 4-bit codes, or int8 weights
    scales: int  # block absmax (fp32, or uint8 with double quantization), or 8-bit row scales
    nested: int  # double quantization: fp32 absmax per 256 blocks, the 256-entry code copy, the offset
    constants: int  # the 16-entry 4-bit code of each layer
    tensors: int  # number of allocations

    @property
    def total(self) -> int:
        return self.codes + self.scales + self.nested + self.constants


def quantized_weight_bytes(out_features: int, in_features: int, setting: QuantSetting, *,
                           rounded: bool = True) -> QuantizedBytes:
    """Bytes bitsandbytes stores for one quantized weight of ``out_features x in_features``.

    4-bit: (n + 1) // 2 code bytes; ceil(n / blocksize) blocks with an fp32 absmax each, or with double
    quantization a uint8 each plus fp32 per 256 blocks, a private 256-entry fp32 code and a 0-dim fp32 offset;
    a 16-entry fp32 code. 8-bit: n int8 + one fp32 scale per row."""
    r = allocator_size if rounded else (lambda n: n)
    n = out_features * in_features
    if setting.bits == 8:
        return QuantizedBytes(codes=r(n), scales=r(out_features * 4), nested=0, constants=0, tensors=2)
    blocks = -(-n // setting.blocksize)
    if setting.double_quant:
        nested_blocks = -(-blocks // NESTED_BLOCKSIZE)
        return QuantizedBytes(codes=r((n + 1) // 2), scales=r(blocks),
                              nested=r(nested_blocks * 4) + r(NESTED_CODE_BYTES) + r(OFFSET_BYTES),
                              constants=r(CODE4_BYTES), tensors=6)
    return QuantizedBytes(codes=r((n + 1) // 2), scales=r(blocks * 4), nested=0, constants=r(CODE4_BYTES), tensors=3)


def quantized_storage_bytes(shapes: Iterable[tuple[int, int]], setting: QuantSetting, *, rounded: bool = True) -> int:
    """Total storage of quantized weights of these (out_features, in_features) shapes."""
    return sum(quantized_weight_bytes(o, i, setting, rounded=rounded).total for o, i in shapes)


@dataclass(frozen=True)
class DequantTemporaries:
    """Bytes one quantized linear briefly holds beyond its inputs and outputs (allocator-rounded)."""

    forward: int
    backward: int


def dequant_temporaries(out_features: int, in_features: int, setting: QuantSetting, *, tokens: int,
                        input_dtype: torch.dtype = torch.float32, gpu: tuple[int, int, int] = (9, 0, 132)
                        ) -> DequantTemporaries:
    """Peak transient bytes of one quantized linear's forward and backward (bitsandbytes 0.50.2 on CUDA).

    4-bit forward (unfused GEMM: more than 1536 rows, or as the dispatch decides for the GPU ``gpu`` = (major,
    minor, SMs)): two fp32 absmax vectors (double quantization) + the weight in the compute dtype; fused: none.
    4-bit backward: one fp32 absmax vector (double quantization) + the weight in the compute dtype.
    8-bit forward: the larger of (fp16 input copy + int8 input + fp32 row scales) and (int8 input + row scales
    + int32 and fp16 results); 8-bit backward: the weight in the input dtype + the fp32 row-scale factor.
    Input casts to the compute dtype and output casts back are the layer's activations, not counted here."""
    r = allocator_size
    n = out_features * in_features
    if setting.bits == 4:
        cd = setting.torch_compute_dtype
        cb = torch.empty((), dtype=cd).element_size()
        blocks = -(-n // setting.blocksize)
        absmax = r(blocks * 4) if setting.double_quant else 0
        fused = gemm_4bit_uses_fused_kernel(tokens, out_features, in_features, cd, setting.blocksize,
                                            major=gpu[0], minor=gpu[1], num_sms=gpu[2])
        forward = 0 if fused else 2 * absmax + r(n * cb)
        return DequantTemporaries(forward=forward, backward=absmax + r(n * cb))
    ab = torch.empty((), dtype=input_dtype).element_size()
    m, k, o = tokens, in_features, out_features
    quant = r(m * k) + r(m * 4)
    fp16_copy = r(m * k * 2) if input_dtype != torch.float16 else 0
    forward = max(fp16_copy + quant, quant + r(m * o * 4) + r(m * o * 2))
    return DequantTemporaries(forward=forward, backward=r(n * ab) + r(out_features * 4))


def dequant_traffic_bytes(out_features: int, in_features: int, setting: QuantSetting, *, tokens: int = 0,
                          input_dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """(forward, backward) bytes the quantization kernels move for one linear, beyond the GEMMs themselves.

    4-bit, each pass: read the codes (n/2) and scales, write the dequantized weight (n x compute bytes); double
    quantization adds the absmax dequantization (read blocks + nested, write and re-read fp32 blocks). The GEMM
    then reads the dequantized weight as it would read a full-precision one. 8-bit forward: cast the input to
    fp16, quantize it per row, write and re-read the int32 and fp16 results, cast to the input dtype; backward:
    read the int8 weight and write/re-read it in the input dtype."""
    n = out_features * in_features
    if setting.bits == 4:
        cb = torch.empty((), dtype=setting.torch_compute_dtype).element_size()
        blocks = -(-n // setting.blocksize)
        if setting.double_quant:
            # dequantize_blockwise reads the uint8 scales, nested absmax and code and writes fp32 scales; "+ offset"
            # reads and writes them again; dequantize_4bit reads them once more
            scales = blocks + (-(-blocks // NESTED_BLOCKSIZE)) * 4 + NESTED_CODE_BYTES + 4 * blocks * 4
        else:
            scales = blocks * 4
        one = (n + 1) // 2 + scales + n * cb
        return one, one
    ab = torch.empty((), dtype=input_dtype).element_size()
    m, k, o = tokens, in_features, out_features
    cast_in, quant = m * k * ab + m * k * 2, m * k * 2 + m * k + m * 4
    forward = cast_in + quant + (m * o * 4 + m * o * 2) + (m * o * 2 + m * o * ab)
    backward = n + 3 * n * ab + o * 4
    return forward, backward


def dequant_time_s(shapes: Iterable[tuple[int, int]], setting: QuantSetting, hbm_bandwidth: float, *,
                   tokens: int = 0, input_dtype: torch.dtype = torch.float32, forward_passes: int = 1,
                   backward_passes: int = 1) -> float:
    """Seconds the quantization kernels add to one micro-batch: their bytes moved at ``hbm_bandwidth`` (bytes/s).

    ``forward_passes``: 2 for recomputed (checkpointed) layers. A lower bound: the kernels are memory-bound."""
    total = 0
    for o, i in shapes:
        f, b = dequant_traffic_bytes(o, i, setting, tokens=tokens, input_dtype=input_dtype)
        total += f * forward_passes + b * backward_passes
    return total / hbm_bandwidth
