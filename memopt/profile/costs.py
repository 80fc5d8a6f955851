"""What each traced op costs in arithmetic and memory traffic, for the step-time model.

Per phase of a trace: matmul FLOPs by compute dtype, attention FLOPs, the bytes that non-matmul ops
read and write (inputs + outputs; views and in-place metadata ops move nothing), the op count
(kernel launches), and the calls of bitsandbytes' 4-bit linear (see ``BNB4_CALL_OPS``). The time model
turns these into seconds with the hardware's peaks.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from memopt.kernel_ops import FREE_OPS
from memopt.profile.recurrent_kernels import recurrent_cost

__all__ = ["ATTENTION_OPS", "BNB4_CALL_OPS", "CostRecorder", "PhaseCost"]

ATTENTION_OPS = {
    "cuda_flash_attention", "cuda_efficient_attention", "cuda_cudnn_attention",
    "cuda_flash_attention_backward", "cuda_efficient_attention_backward", "cuda_cudnn_attention_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_cudnn_attention_backward",
}
# One of these per pass of a bitsandbytes 4-bit linear: ``dequantize_4bit`` in the unfused forward (more than 1536
# rows, ``memopt.profile.quant_gemm_4bit``), in every backward (``MatMul4Bit.backward``) and in a recomputed
# forward; ``gemm_4bit`` where the stand-in shows the GEMM as one op (under selective checkpointing). The fused
# forward kernel (a few rows only) is traced as a plain ``linear`` and not counted. DoRA's per-forward
# ``dequantize()`` counts as one more.
BNB4_CALL_OPS = {"bitsandbytes::dequantize_4bit", "bitsandbytes::gemm_4bit"}
_MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "_addmm_activation", "addmv", "mv", "_grouped_mm", "convolution",
               "convolution_backward", "_scaled_mm"}


def _dtype_key(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, "fp32")


@dataclass
class PhaseCost:
    """Cost of one phase of a trace."""

    matmul_flops: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    attention_flops: float = 0.0
    attention_dtype: str = "bf16"
    memory_bytes: float = 0.0
    num_ops: int = 0
    bnb4_calls: int = 0  # passes through a bitsandbytes 4-bit linear (BNB4_CALL_OPS)
    # kernels a library launches inside one host call, one after another (cuDNN's recurrent time steps): GPU time
    # per launch, no host time; and the matmul FLOPs they run (by dtype), which overlap with that serial chain
    library_kernels: int = 0
    library_flops: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def to_dict(self) -> dict[str, Any]:
        return {"matmul_flops": dict(self.matmul_flops), "attention_flops": self.attention_flops,
                "attention_dtype": self.attention_dtype, "memory_bytes": self.memory_bytes, "num_ops": self.num_ops,
                "bnb4_calls": self.bnb4_calls, "library_kernels": self.library_kernels,
                "library_flops": dict(self.library_flops)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PhaseCost:
        c = cls()
        c.matmul_flops.update(d.get("matmul_flops", {}))
        c.attention_flops = d.get("attention_flops", 0.0)
        c.attention_dtype = d.get("attention_dtype", "bf16")
        c.memory_bytes = d.get("memory_bytes", 0.0)
        c.num_ops = d.get("num_ops", 0)
        c.bnb4_calls = d.get("bnb4_calls", 0)
        c.library_kernels = d.get("library_kernels", 0)
        c.library_flops.update(d.get("library_flops", {}))
        return c


def _attention_flops(name: str, args: tuple) -> float:
    """Dense attention FLOPs: 4 B H Lq Lk D forward (two GEMMs), 2.5x that backward; causal halves both."""
    if name.endswith("_backward"):
        q, k = args[1], args[2]
        factor = 2.5
    else:
        q, k = args[0], args[1]
        factor = 1.0
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        return 0.0
    b, h, lq, d = q.shape
    lk = k.shape[-2]
    causal = any(a is True for a in args[3:8])
    flops = 4.0 * b * h * lq * lk * d * factor
    return flops / 2 if causal else flops


def _grouped_mm_flops(args: tuple, out: Any) -> float:
    """2 x (output elements) x (reduced dimension): grouped GEMMs reduce over mat_a's last dimension. In the
    weight-gradient product (2-D x 2-D -> 3-D: ``(m, k_total) x (k_total, n)`` split into groups along k) each group
    reduces over its own share of ``k_total``: 2 x m x n x k_total in all, not per group."""
    a = args[0]
    if not isinstance(out, torch.Tensor) or not isinstance(a, torch.Tensor):
        return 0.0
    if out.dim() == 3 and a.dim() == 2:
        return 2.0 * (out.numel() // out.shape[0]) * a.shape[-1]
    return 2.0 * out.numel() * a.shape[-1]


class CostRecorder:
    """A tracker op hook: accumulates a ``PhaseCost`` per phase index."""

    def __init__(self, phase_of: Any) -> None:
        self.phase_of = phase_of  # callable returning the current phase index
        self.costs: dict[int, PhaseCost] = defaultdict(PhaseCost)

    def __call__(self, func: Any, args: tuple, out: Any) -> None:
        packet = getattr(func, "_overloadpacket", None)
        name = packet.__name__ if packet is not None else getattr(func, "__name__", "")
        if name in FREE_OPS:
            return
        cost = self.costs[self.phase_of()]
        cost.num_ops += 1
        if packet is not None and getattr(packet, "_qualified_op_name", "") in BNB4_CALL_OPS:
            cost.bnb4_calls += 1  # and, below, the bytes it moves like any memory-bound op
        if name in ATTENTION_OPS:
            cost.attention_flops += _attention_flops(name, args)
            q = args[0] if not name.endswith("_backward") else args[1]
            if isinstance(q, torch.Tensor):
                cost.attention_dtype = _dtype_key(q.dtype)
            return
        if name == "_grouped_mm":
            flops = _grouped_mm_flops(args, out)
            cost.matmul_flops[_dtype_key(args[0].dtype)] += flops
            return
        rnn = recurrent_cost(func, args)
        if rnn is not None:  # one host call; cuDNN runs its time steps one after another on the GPU
            dtype, flops, serial = rnn
            cost.library_flops[_dtype_key(dtype)] += flops
            cost.library_kernels += serial
            return
        if name == "acc_matmul_":  # memopt.techniques.liger_ce's in-place ``acc += a @ b``
            a, b = args[1], args[2]
            cost.matmul_flops[_dtype_key(a.dtype)] += 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
            return
        if name in _MATMUL_OPS and packet in flop_registry:
            try:
                flops = flop_registry[packet](*args, out_val=out)
            except Exception:
                flops = 0
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            cost.matmul_flops[_dtype_key(first.dtype) if first is not None else "fp32"] += float(flops)
            return
        cost.memory_bytes += _tensor_bytes(args) + _tensor_bytes(out)


def _tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in ``obj`` (nested tuples, lists and dicts): pytree's flatten, without its cost per
    op (this runs on every traced op)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(o) for o in obj.values())
    return 0
