"""Liger-kernel's fused linear cross-entropy as the kernel of memopt's fused head + loss (``ce_kernel="liger"``).

Liger (``liger_kernel.ops.fused_linear_cross_entropy``) runs the head and the loss over chunks of about
``tokens x hidden / vocab`` tokens, so one chunk of logits is about as large as the hidden state; a Triton kernel
writes each row's loss and its softmax gradient over the logits in place, and the hidden-state and weight
gradients are made in the forward pass. It runs on CUDA only. It takes a tanh softcap (Gemma-2) but no logit
scale, so it is refused for heads that scale their logits (memopt's own chunked loss takes both).

Tracing cannot run Triton on fake tensors: the trace runs :class:`_LigerShaped` instead, the same algorithm in
torch ops that allocates and launches what Liger does (the gradient buffers, one fp32 loss per token, one chunk
of logits in the compute dtype, one op per chunk for the loss and its gradient, the weight gradient accumulated
in place), so the estimate reads Liger's memory and kernel count. Its values are right too: the CPU runs it when
the kernel is pinned there (its per-row op then uses fp32 temporaries, which Liger keeps in registers).
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from memopt.techniques.lm_head import HeadTransform, head_transform

__all__ = ["liger_chunk_size", "liger_installed", "liger_linear_cross_entropy", "liger_refusal"]


def liger_installed() -> bool:
    """Whether liger-kernel and Triton are installed (without importing them: the planner only needs to know)."""
    return all(importlib.util.find_spec(name) is not None for name in ("liger_kernel", "triton"))


def liger_refusal(model: nn.Module, head_refused: str | None) -> str | None:
    """Why Liger's fused loss would not be exact for ``model`` (None: it is); ``head_refused`` is the fused-head
    refusal (:func:`memopt.profile.head_probe.head_refusal`) already found for it."""
    if head_refused is not None:
        return head_refused
    transform = head_transform(model)
    if isinstance(transform, HeadTransform) and transform.op is not None:
        return f"{type(model).__name__}'s head scales its logits, which Liger's fused loss cannot"
    return None


def liger_chunk_size(tokens: int, hidden: int, vocab: int) -> int:
    """Liger's chunk (tokens): the power of two near ``tokens / ceil(vocab / hidden)``, at most ``tokens``."""
    inc = -(-vocab // hidden)
    want = max(1, -(-tokens // inc))
    return min(1 << (want - 1).bit_length(), tokens)


@torch.library.custom_op("memopt::ce_rows_", mutates_args=("z",))
def _ce_rows_(z: torch.Tensor, y: torch.Tensor, count: torch.Tensor, softcap: float | None,
              ignore_index: int) -> torch.Tensor:
    """Per-row loss of ``softcap(z)`` against ``y``; ``z`` is overwritten with the gradient w.r.t. itself, divided
    by ``count``: what Liger's Triton kernel does, as one op (one launch, no temporaries, in a trace too)."""
    valid = (y != ignore_index).unsqueeze(-1)
    target = y.clamp(min=0).unsqueeze(-1)
    x = z.float()
    tanh = None
    if softcap is not None:
        tanh = torch.tanh(x / softcap)
        x = tanh * softcap
    loss = (torch.logsumexp(x, dim=-1, keepdim=True) - x.gather(1, target)) * valid
    g = torch.softmax(x, dim=-1)
    g.scatter_add_(1, target, -valid.to(g.dtype))
    if tanh is not None:
        g.mul_(1.0 - tanh * tanh)
    z.copy_(g.mul_(valid).div_(count))
    return (loss / count).squeeze(-1)


@_ce_rows_.register_fake
def _(z: torch.Tensor, y: torch.Tensor, count: torch.Tensor, softcap: float | None,
      ignore_index: int) -> torch.Tensor:
    return z.new_empty(z.shape[0], dtype=torch.float32)


@torch.library.custom_op("memopt::acc_matmul_", mutates_args=("acc",))
def _acc_matmul_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` in ``acc``'s dtype with no product-sized temporary (Liger's fp32 weight-gradient
    accumulation from bf16 chunks: ``addmm`` with ``out_dtype``, which fake tensors cannot run). The trace's cost
    model counts it as a matmul (``memopt.profile.costs``)."""
    if a.dtype == acc.dtype and b.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:  # the CPU has no mixed-dtype addmm: this runs only where the stand-in trains (values, not memory)
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


@_acc_matmul_.register_fake
def _(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    return None


class _LigerShaped(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, softcap, ignore_index):
        tokens, hidden = x.shape
        step = liger_chunk_size(tokens, hidden, weight.shape[0])
        grad_input = torch.zeros_like(x)
        grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
        loss_1d = torch.zeros(tokens, dtype=torch.float32, device=x.device)
        count = (target != ignore_index).sum().clamp(min=1).float()
        for start in range(0, tokens, step):
            xc, yc = x[start:start + step], target[start:start + step]
            z = xc @ weight.t()
            loss_1d[start:start + step] = _ce_rows_(z, yc, count, softcap, ignore_index)
            grad_input[start:start + step] = z @ weight
            if grad_weight is not None:
                _acc_matmul_(grad_weight, z.t(), xc.to(z.dtype))
            del z
        ctx.save_for_backward(grad_input, grad_weight if grad_weight is not None else torch.empty(0))
        ctx.weight_requires_grad = weight.requires_grad
        return loss_1d.sum()

    @staticmethod
    def backward(ctx, grad_out):
        grad_input, grad_weight = ctx.saved_tensors
        grad_input.mul_(grad_out)
        if ctx.weight_requires_grad:
            grad_weight.mul_(grad_out)
        return grad_input, grad_weight if ctx.weight_requires_grad else None, None, None, None


def liger_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                               transform: HeadTransform, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of ``transform(hidden @ weight.T)`` by Liger's kernel on a CUDA tensor, by its stand-in
    in a trace (fake tensors) or on the CPU."""
    if transform.op is not None:
        raise ValueError("Liger's fused linear cross-entropy has no logit scale; plan with ce_kernel='memopt'")
    x, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if x.is_cuda and not isinstance(x, FakeTensor):
        try:
            from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
        except ImportError as exc:
            raise ValueError(f"ce_kernel='liger' needs liger-kernel ({exc}): pip install liger-kernel, or plan "
                             "with ce_kernel='memopt'") from None
        return LigerFusedLinearCrossEntropyFunction.apply(x, weight, y, None, None, ignore_index, 0.0, 0.0, "mean",
                                                          transform.softcap)[0]
    return _LigerShaped.apply(x, weight, y, transform.softcap, ignore_index)
