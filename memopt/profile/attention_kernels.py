"""What CUDA's attention kernels allocate, reproduced on CPU (fake) tensors.

``scaled_dot_product_attention`` on CUDA picks a fused kernel (flash, memory-efficient, cuDNN) by the
rules of ``sdp_utils.cpp`` (``memopt.profile.attention_select``); on a CPU it runs a different path that saves
different tensors. Here each CUDA backend is a custom op whose forward and backward allocate exactly the outputs,
saved tensors and scratch buffers of the CUDA kernel (shapes, dtypes and layouts), so a tracker sees the GPU's
bytes. On real CPU tensors they also compute the right values (``memopt.profile.attention_reference``), so tests
can check them numerically.
"""

from __future__ import annotations

from typing import Any

import torch

from memopt.profile.attention_reference import math_reference, reference_grads
from memopt.profile.attention_select import AttentionPolicy, choose_backend, round_up
from memopt.profile.tracker import report_scratch
from memopt.units import allocator_size

__all__ = ["emulated_sdpa"]


def _blhd(b: int, length: int, h: int, d: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A (B, H, L, D) view of a (B, L, H, D) buffer: the layout the fused kernels write."""
    return torch.empty(b, length, h, d, dtype=dtype, device=device).transpose(1, 2)


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(allocator_size(t.untyped_storage().nbytes()) for t in tensors)


# --- flash attention (FA2 in PyTorch): saves q, k, v, out, logsumexp (B, H, Lq) fp32 ---------------
@torch.library.custom_op("memopt::cuda_flash_attention", mutates_args=())
def _flash_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, is_causal: bool,
               scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    out, lse, seed, offset = _flash_fwd_fake(q, k, v, dropout_p, is_causal, scale)
    ref_out, ref_lse = math_reference(q, k, v, None, is_causal, scale)
    out.copy_(ref_out)
    lse.copy_(ref_lse)
    return out, lse, seed, offset


@_flash_fwd.register_fake
def _flash_fwd_fake(q, k, v, dropout_p, is_causal, scale):
    b, h, lq, _ = q.shape
    out = _blhd(b, lq, h, v.shape[-1], q.dtype, q.device)
    lse = torch.empty(b, h, lq, dtype=torch.float32, device=q.device)
    return out, lse, *_rng_state(q)


def _rng_state(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash and cuDNN attention keep a philox seed and offset (one int64 each) for backward, dropout or not
    (measured: 2 x 512 B retained per call on an H200)."""
    return (torch.empty((), dtype=torch.int64, device=q.device), torch.empty((), dtype=torch.int64, device=q.device))


@torch.library.custom_op("memopt::cuda_flash_attention_backward", mutates_args=())
def _flash_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor, is_causal: bool, scale: float | None, round_q: int, round_d: int,
               dq_accum: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = _flash_bwd_fake(grad_out, q, k, v, out, lse, is_causal, scale, round_q, round_d, dq_accum)
    gq, gk, gv, _ = reference_grads(q, k, v, None, is_causal, scale, grad_out)
    if k.shape[1] != q.shape[1]:
        g = q.shape[1] // k.shape[1]
        gk = gk.unflatten(1, (k.shape[1], g)).sum(2)
        gv = gv.unflatten(1, (k.shape[1], g)).sum(2)
    dq.copy_(gq)
    dk.copy_(gk)
    dv.copy_(gv)
    return dq, dk, dv


@_flash_bwd.register_fake
def _flash_bwd_fake(grad_out, q, k, v, out, lse, is_causal, scale, round_q, round_d, dq_accum):
    b, h, lq, d = q.shape
    hk, lk, dv_ = k.shape[1], k.shape[2], v.shape[-1]
    dq = _blhd(b, lq, h, d, q.dtype, q.device)
    dk = _blhd(b, lk, hk, d, k.dtype, k.device)
    dv = _blhd(b, lk, hk, dv_, v.dtype, v.device)
    scratch = 4 * b * h * round_up(lq, round_q)  # softmax_d, fp32
    if dq_accum:
        scratch += 4 * b * round_up(lq, round_q) * h * round_up(d, round_d)
    if hk != h:  # GQA: gradients of every query head, reduced into the kv heads afterwards
        scratch += q.element_size() * b * lk * h * (d + dv_)
    if grad_out.stride(-1) != 1:
        scratch += grad_out.numel() * grad_out.element_size()
    report_scratch(_nbytes(dq, dk, dv) + scratch, "flash_attention_backward.scratch")
    return dq, dk, dv


def _flash_setup(ctx, inputs, output) -> None:
    q, k, v, _dropout_p, is_causal, scale = inputs
    out, lse, seed, offset = output
    ctx.mark_non_differentiable(lse, seed, offset)
    ctx.set_materialize_grads(False)  # as for native ops: no zero gradients for outputs nobody used
    ctx.save_for_backward(q, k, v, out, lse, seed, offset)
    ctx.is_causal, ctx.scale = is_causal, scale
    ctx.round_q, ctx.round_d, ctx.dq_accum = _ACTIVE_POLICY[-1]


def _flash_backward(ctx, grad_out, grad_lse, grad_seed, grad_offset):
    q, k, v, out, lse, _seed, _offset = ctx.saved_tensors
    dq, dk, dv = _flash_bwd(grad_out, q, k, v, out, lse, ctx.is_causal, ctx.scale, ctx.round_q, ctx.round_d,
                            ctx.dq_accum)
    return dq, dk, dv, None, None, None


_flash_fwd.register_autograd(_flash_backward, setup_context=_flash_setup)


# --- memory-efficient attention: saves q, k, v, bias, out, logsumexp (B, H, ceil32(Lq)) fp32 ---------
@torch.library.custom_op("memopt::cuda_efficient_attention", mutates_args=())
def _eff_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, dropout_p: float,
             is_causal: bool, scale: float | None, lse_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _eff_fwd_fake(q, k, v, bias, dropout_p, is_causal, scale, lse_pad)
    ref_out, _ = math_reference(q, k, v, bias, is_causal, scale)
    out.copy_(ref_out)
    lse.zero_()
    return out, lse


@_eff_fwd.register_fake
def _eff_fwd_fake(q, k, v, bias, dropout_p, is_causal, scale, lse_pad):
    b, h, lq, _ = q.shape
    out = _blhd(b, lq, h, v.shape[-1], q.dtype, q.device)
    lse = torch.empty(b, h, round_up(lq, lse_pad), dtype=torch.float32, device=q.device)
    return out, lse


@torch.library.custom_op("memopt::cuda_efficient_attention_backward", mutates_args=())
def _eff_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
             out: torch.Tensor, lse: torch.Tensor, is_causal: bool, scale: float | None,
             bias_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, dbias = _eff_bwd_fake(grad_out, q, k, v, bias, out, lse, is_causal, scale, bias_grad)
    gq, gk, gv, ds = reference_grads(q, k, v, bias, is_causal, scale, grad_out)
    if k.shape[1] != q.shape[1]:
        g = q.shape[1] // k.shape[1]
        gk = gk.unflatten(1, (k.shape[1], g)).sum(2)
        gv = gv.unflatten(1, (k.shape[1], g)).sum(2)
    dq.copy_(gq)
    dk.copy_(gk)
    dv.copy_(gv)
    if bias_grad:
        dbias.copy_(ds)
    return dq, dk, dv, dbias


@_eff_bwd.register_fake
def _eff_bwd_fake(grad_out, q, k, v, bias, out, lse, is_causal, scale, bias_grad):
    b, h, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    dq = _blhd(b, lq, h, d, q.dtype, q.device)
    dk = _blhd(b, lk, hk, d, k.dtype, k.device)
    dv = _blhd(b, lk, hk, v.shape[-1], v.dtype, v.device)
    # the bias gradient is one full (B, H, Lq, Lk) tensor, its last dim padded to 16 as the kernel writes it
    dbias = (torch.empty(b, h, lq, round_up(lk, 16), dtype=bias.dtype, device=q.device)[..., :lk] if bias_grad
             else q.new_empty(0))
    # delta (fp32, B x H x Lq), an fp32 dq accumulator over 64 x 64 tiles (Lq and D each rounded up to 64: a
    # 49-token window of head dim 32 takes 64 x 64) and 256 B per (batch, head); measured on an H200 with torch
    # 2.11 (scripts/sdpa_mask_grad_probe_gpu.py and the probe's sdpa backends)
    scratch = 4 * b * h * lq + 4 * b * h * round_up(lq, 64) * round_up(d, 64) + 256 * b * h
    report_scratch(_nbytes(dq, dk, dv, dbias) + scratch, "efficient_attention_backward.scratch")
    return dq, dk, dv, dbias


def _eff_setup(ctx, inputs, output) -> None:
    q, k, v, bias, _dropout_p, is_causal, scale, _lse_pad = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, bias, out, lse)
    ctx.is_causal, ctx.scale = is_causal, scale
    ctx.bias_grad = bias is not None and bias.requires_grad


def _eff_backward(ctx, grad_out, grad_lse):
    q, k, v, bias, out, lse = ctx.saved_tensors
    dq, dk, dv, dbias = _eff_bwd(grad_out, q, k, v, bias, out, lse, ctx.is_causal, ctx.scale, ctx.bias_grad)
    return dq, dk, dv, dbias if ctx.bias_grad else None, None, None, None, None


_eff_fwd.register_autograd(_eff_backward, setup_context=_eff_setup)


# --- cuDNN attention: saves q, k, v, out, softmax stats (B, H, Lq, 1) fp32 ----------------------------
@torch.library.custom_op("memopt::cuda_cudnn_attention", mutates_args=())
def _cudnn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, dropout_p: float,
               is_causal: bool, scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    out, stats, seed, offset = _cudnn_fwd_fake(q, k, v, bias, dropout_p, is_causal, scale)
    ref_out, ref_lse = math_reference(q, k, v, bias, is_causal, scale)
    out.copy_(ref_out)
    stats.copy_(ref_lse.unsqueeze(-1))
    return out, stats, seed, offset


@_cudnn_fwd.register_fake
def _cudnn_fwd_fake(q, k, v, bias, dropout_p, is_causal, scale):
    b, h, lq, _ = q.shape
    out = _blhd(b, lq, h, v.shape[-1], q.dtype, q.device)
    stats = torch.empty(b, h, lq, 1, dtype=torch.float32, device=q.device)
    report_scratch(_nbytes(out, stats) + 512, "cudnn_attention.scratch")
    return out, stats, *_rng_state(q)


@torch.library.custom_op("memopt::cuda_cudnn_attention_backward", mutates_args=())
def _cudnn_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
               out: torch.Tensor, stats: torch.Tensor, is_causal: bool,
               scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = _cudnn_bwd_fake(grad_out, q, k, v, bias, out, stats, is_causal, scale)
    gq, gk, gv, _ = reference_grads(q, k, v, bias, is_causal, scale, grad_out)
    if k.shape[1] != q.shape[1]:
        g = q.shape[1] // k.shape[1]
        gk = gk.unflatten(1, (k.shape[1], g)).sum(2)
        gv = gv.unflatten(1, (k.shape[1], g)).sum(2)
    dq.copy_(gq)
    dk.copy_(gk)
    dv.copy_(gv)
    return dq, dk, dv


@_cudnn_bwd.register_fake
def _cudnn_bwd_fake(grad_out, q, k, v, bias, out, stats, is_causal, scale):
    b, h, lq, d = q.shape
    hk, lk, dv_ = k.shape[1], k.shape[2], v.shape[-1]
    dq = _blhd(b, lq, h, d, q.dtype, q.device)
    dk = _blhd(b, lk, hk, d, k.dtype, k.device)
    dv = _blhd(b, lk, hk, dv_, v.dtype, v.device)
    # measured on an H200 (cuDNN 9.19): softmax_d and a dq accumulator, both fp32 and unpadded (a 49-token
    # window takes 49 rows, not 128), plus 512 B
    scratch = 4 * b * h * lq * (d + 1) + 512
    if hk != h:
        scratch += q.element_size() * b * lk * h * (d + dv_)
    report_scratch(_nbytes(dq, dk, dv) + scratch, "cudnn_attention_backward.scratch")
    return dq, dk, dv


def _cudnn_setup(ctx, inputs, output) -> None:
    q, k, v, bias, _dropout_p, is_causal, scale = inputs
    out, stats, seed, offset = output
    ctx.mark_non_differentiable(stats, seed, offset)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, bias, out, stats, seed, offset)
    ctx.is_causal, ctx.scale = is_causal, scale


def _cudnn_backward(ctx, grad_out, grad_stats, grad_seed, grad_offset):
    q, k, v, bias, out, stats, _seed, _offset = ctx.saved_tensors
    dq, dk, dv = _cudnn_bwd(grad_out, q, k, v, bias, out, stats, ctx.is_causal, ctx.scale)
    return dq, dk, dv, None, None, None, None


_cudnn_fwd.register_autograd(_cudnn_backward, setup_context=_cudnn_setup)

# The flash backward's rounding facts travel from the active policy to setup_context through this stack.
_ACTIVE_POLICY: list[tuple[int, int, bool]] = [(128, 32, True)]

def _additive(mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """``scaled_dot_product_attention``'s conversion of a mask before a fused kernel: a bool mask becomes a new
    additive one in the queries' dtype, as large as the mask's shape (a broadcast view materialized), which the kernel
    keeps for backward: on an H100, 64 MiB per call for a (8, 1, 2048, 2048) bool mask, none for an additive mask
    already in the queries' dtype (``scripts/sdpa_bool_mask_probe_gpu.py``)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    return mask.to(q.dtype) if mask.dtype != q.dtype else mask


def _efficient_bias(mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """CUDA's preprocessing of a mask for the memory-efficient kernel: additive, last dim padded to 16."""
    bias = _additive(mask, q)
    if bias is None:
        return None
    lk = k.shape[-2]
    if lk % 16:
        padded = torch.empty(*bias.shape[:-1], round_up(lk, 16), dtype=bias.dtype, device=bias.device)
        padded[..., :lk].copy_(bias.expand(*bias.shape[:-1], lk))
        bias = padded[..., :lk]
    return bias.expand(q.shape[0], q.shape[1], q.shape[2], lk)


def emulated_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                  dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
                  enable_gqa: bool = False, policy: AttentionPolicy, on_choice: Any = None) -> torch.Tensor:
    """``scaled_dot_product_attention`` with the memory behaviour of the CUDA backend it would use."""
    backend = choose_backend(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, policy)
    if on_choice is not None:
        on_choice(backend)
    if backend == "flash":
        _ACTIVE_POLICY.append((policy.flash_round_q, policy.flash_round_d, policy.flash_bwd_dq_accum))
        try:
            return torch.ops.memopt.cuda_flash_attention(q, k, v, dropout_p, is_causal, scale)[0]
        finally:
            _ACTIVE_POLICY.pop()
    if backend == "efficient":
        bias = _efficient_bias(attn_mask, q, k)
        return torch.ops.memopt.cuda_efficient_attention(q, k, v, bias, dropout_p, is_causal, scale,
                                                          policy.efficient_lse_pad)[0]
    if backend == "cudnn":
        return torch.ops.memopt.cuda_cudnn_attention(q, k, v, _additive(attn_mask, q), dropout_p, is_causal,
                                                      scale)[0]
    return torch.ops.aten._scaled_dot_product_attention_math.default(
        q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]
