"""Attention's real values on real tensors, for the emulated CUDA kernels (``memopt.profile.attention_kernels``):
a custom op's kernel runs without autograd, so the gradients are the closed form."""

from __future__ import annotations

import math

import torch

__all__ = ["math_reference", "reference_grads"]


def _repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query keys and values repeated to one per query head."""
    if k.shape[1] == q.shape[1]:
        return k, v
    rep = q.shape[1] // k.shape[1]
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
            scale: float | None) -> torch.Tensor:
    """Scaled, masked attention scores in fp32 (k already repeated to q's heads)."""
    scores = (q.float() @ k.float().transpose(-2, -1)) * _scale(q, scale)
    if is_causal:
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    return scores


def math_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
                   scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Real values for real tensors (no dropout: values are only checked in tests without it)."""
    k, v = _repeat_kv(q, k, v)
    scores = _scores(q, k, mask, is_causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ v.float()
    return out.to(q.dtype), lse


def reference_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
                    scale: float | None, grad_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Attention gradients by the closed form (autograd is off inside a custom op's kernel). With grouped
    query heads the key/value gradients are per query head; callers sum them into the kv heads."""
    k, v = _repeat_kv(q, k, v)
    qf, kf, vf, go = q.float(), k.float(), v.float(), grad_out.float()
    s = _scale(q, scale)
    scores = _scores(q, k, mask, is_causal, scale)
    p = torch.softmax(scores, dim=-1)
    dv = p.transpose(-2, -1) @ go
    dp = go @ vf.transpose(-2, -1)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    return (ds @ kf) * s, (ds.transpose(-2, -1) @ qf) * s, dv, ds
