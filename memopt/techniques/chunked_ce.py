"""Chunked (fused linear + cross-entropy) loss for large vocabularies.

A causal LM's head makes logits of batch x sequence x vocabulary (128k for Llama 3): with the fp32
upcast and its gradient that is several bytes per logit, often the largest tensor of the step. Here
the head and the loss run chunk by chunk over the tokens: each chunk's logits, softmax gradient and
contributions to the hidden-state and weight gradients are computed in the forward pass and the
logits are dropped, so at most one chunk of logits exists at a time. The gradient is exact (the
same math as ``F.cross_entropy`` over the whole sequence, summed in a different order), including the scale or
softcap a head declares (``memopt.techniques.lm_head``). Whether it is exact for a model is the profile's
question (``memopt.profile.head_probe.head_refusal``), since it traces the model's head.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memopt.models.hf_task import peft_unwrapped
from memopt.techniques.liger_ce import liger_linear_cross_entropy
from memopt.techniques.lm_head import HeadTransform, head_transform, static_head_refusal

__all__ = ["causal_lm_chunked_loss", "fused_linear_cross_entropy"]


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunks, ignore_index, transform):
        n = hidden.shape[0]
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if weight.requires_grad else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        count = (labels != ignore_index).sum()
        denom = count.clamp(min=1).float()
        step = -(-n // chunks)
        for start in range(0, n, step):
            h = hidden[start:start + step]
            y = labels[start:start + step]
            logits, tanh = transform.forward((h @ weight.t()).float())
            total = total + F.cross_entropy(logits, y, ignore_index=ignore_index, reduction="sum")
            g = torch.softmax(logits, dim=-1)
            del logits
            valid = (y != ignore_index).unsqueeze(-1)
            g.scatter_add_(1, y.clamp(min=0).unsqueeze(-1), -valid.to(g.dtype))
            g.mul_(valid)
            g = transform.grad(g, tanh)
            del tanh
            g = (g / denom).to(h.dtype)
            grad_hidden[start:start + step] = g @ weight.to(h.dtype)
            if grad_weight is not None:
                grad_weight += (g.t() @ h).float()
            del g
        ctx.save_for_backward(grad_hidden, grad_weight if grad_weight is not None else torch.empty(0))
        ctx.weight_dtype = weight.dtype
        ctx.weight_requires_grad = weight.requires_grad
        return total / denom

    @staticmethod
    def backward(ctx, grad_out):
        grad_hidden, grad_weight = ctx.saved_tensors
        gh = grad_hidden * grad_out
        gw = (grad_weight * grad_out).to(ctx.weight_dtype) if ctx.weight_requires_grad else None
        return gh, gw, None, None, None, None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunks: int,
                               ignore_index: int = -100, transform: HeadTransform | None = None) -> torch.Tensor:
    """Mean cross-entropy of ``transform(hidden @ weight.T)`` against ``labels`` without materializing all
    logits (``transform``: the head's scale and softcap, none by default)."""
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    return _FusedLinearCE.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunks,
                                ignore_index, transform or HeadTransform())


def causal_lm_chunked_loss(model: nn.Module, batch: dict[str, Any], *, chunks: int,
                           kernel: str = "memopt") -> torch.Tensor:
    """The causal-LM loss of ``model`` on ``batch`` with a fused head (labels shifted as HF does): memopt's
    chunked loss in ``chunks`` chunks, or Liger-kernel's fused linear cross-entropy (``kernel="liger"``, which
    picks its own chunks; :mod:`memopt.techniques.liger_ce`)."""
    model = peft_unwrapped(model)  # a user's PeftModel: its adapters are in the inner model's layers
    reason = static_head_refusal(model)
    if reason is not None:
        raise ValueError(f"a fused cross-entropy head is not exact here: {reason}; plan with chunked_ce=0")
    transform = head_transform(model)
    assert isinstance(transform, HeadTransform)
    labels = batch["labels"]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    hidden = model.base_model(**inputs).last_hidden_state
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    weight = model.get_output_embeddings().weight
    if kernel == "liger":
        return liger_linear_cross_entropy(hidden, weight, shifted, transform=transform)
    if kernel != "memopt":
        raise ValueError(f"unknown cross-entropy kernel {kernel!r}; choose 'memopt' or 'liger'")
    return fused_linear_cross_entropy(hidden, weight, shifted, chunks=chunks, transform=transform)
