"""Chunked (fused linear + cross-entropy) loss for large vocabularies.

A causal LM's head makes logits of batch x sequence x vocabulary (128k for Llama 3): with the fp32
upcast and its gradient that is several bytes per logit, often the largest tensor of the step. Here
the head and the loss run chunk by chunk over the tokens: each chunk's logits, softmax gradient and
contributions to the hidden-state and weight gradients are computed in the forward pass and the
logits are dropped, so at most one chunk of logits exists at a time. The gradient is exact (the
same math as ``F.cross_entropy`` over the whole sequence, summed in a different order).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["causal_lm_chunked_loss", "chunked_ce_refusal", "fused_linear_cross_entropy", "supports_chunked_ce"]


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunks, ignore_index):
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
            logits = (h @ weight.t()).float()
            total = total + F.cross_entropy(logits, y, ignore_index=ignore_index, reduction="sum")
            g = torch.softmax(logits, dim=-1)
            del logits
            valid = (y != ignore_index).unsqueeze(-1)
            g.scatter_add_(1, y.clamp(min=0).unsqueeze(-1), -valid.to(g.dtype))
            g.mul_(valid)
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
        return gh, gw, None, None, None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunks: int,
                               ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``labels`` without materializing all logits."""
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    return _FusedLinearCE.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunks,
                                ignore_index)


# config fields of transformers heads that change the logits after ``hidden @ W.T`` (neutral value)
_HEAD_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0,
                    "lm_head_multiplier": 1.0, "output_multiplier_scale": 1.0, "logit_softcapping": None}


def _static_refusal(model: nn.Module) -> str | None:
    from memopt.models.hf_task import hf_task

    if hf_task(model) != "causal_lm":
        return f"{type(model).__name__} is not a Hugging Face causal LM"
    head = getattr(model, "get_output_embeddings", lambda: None)()
    base = getattr(model, "base_model", None)
    if not isinstance(head, nn.Linear) or base is None or base is model:
        return f"{type(model).__name__}'s head is not a linear layer over a base model"
    if head.bias is not None:
        return f"{type(model).__name__}'s head has a bias"
    config = getattr(model, "config", None)
    for name, neutral in _HEAD_TRANSFORMS.items():
        value = getattr(config, name, neutral)
        if value is not None and value != neutral:
            return f"{type(model).__name__}'s head applies {name}={value} to its logits"
    if getattr(config, "output_router_logits", False):
        return f"{type(model).__name__}'s loss adds the router's auxiliary loss (output_router_logits=True)"
    return None


def _probe_refusal(model: nn.Module) -> str | None:
    """Run the model's forward once on a one-block fake copy and check that its loss is exactly the standard
    causal-LM cross-entropy of ``lm_head(base_model(...).last_hidden_state)``, nothing before or after."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memopt.profile.fake_model import fake_copy
    from memopt.profile.hf_compat import grouped_mm_in_any_float, real_code_paths
    from memopt.profile.tracker import MemoryTracker

    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return "transformers' causal-LM loss is not available to compare with"
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    clone = fake_copy(model, mode, "cpu", keep_blocks=1)
    seen: dict[str, Any] = {"loss_calls": []}

    def spy(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, **kwargs: Any) -> torch.Tensor:
        out = ForCausalLMLoss(logits, labels, vocab_size, **kwargs)
        seen["loss_calls"].append((logits, out, sorted(k for k, v in kwargs.items() if v is not None)))
        return out

    head = clone.get_output_embeddings()
    hooks = [head.register_forward_hook(lambda m, a, o: seen.update(head_in=a[0], head_out=o)),
             clone.base_model.register_forward_hook(lambda m, a, o: seen.update(base_out=o))]
    clone.loss_function = spy
    try:
        # the tracker answers the boolean checks models make on masks (fake tensors have no values)
        # grouped-GEMM experts run in fp32 here, as the trace runs them
        with mode, real_code_paths(), grouped_mm_in_any_float(), torch.no_grad(), MemoryTracker("cpu", record=False):
            ids = torch.zeros(1, 4, dtype=torch.long)
            out = clone(input_ids=ids, labels=ids, use_cache=False)
    except Exception as exc:  # any failure: the structure could not be verified
        return f"its head could not be checked ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
    finally:
        for h in hooks:
            h.remove()

    def same(a: Any, b: Any) -> bool:
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.untyped_storage()._cdata == b.untyped_storage()._cdata)

    name = type(model).__name__
    hidden = getattr(seen.get("base_out"), "last_hidden_state", None)
    calls = seen["loss_calls"]
    if "head_out" not in seen or not same(seen["head_in"], hidden):
        return f"{name}'s head does not take the base model's last hidden state unchanged"
    if len(calls) != 1 or not same(calls[0][0], seen["head_out"]):
        return f"{name} changes the logits between its head and its loss"
    if getattr(out, "loss", None) is not calls[0][1]:
        return f"{name}'s loss is more than the cross-entropy of its logits"
    extra = [k for k in calls[0][2] if k not in ("num_items_in_batch",)]
    if extra:
        return f"{name} passes {extra} to its loss"
    return None


def chunked_ce_refusal(model: nn.Module, *, probe: bool = True) -> str | None:
    """Why chunked cross-entropy would not be exact for ``model`` (None: it is). Exact means the model's own
    loss is the standard causal-LM cross-entropy of ``base_model(...).last_hidden_state @ lm_head.weight.T``:
    no head bias, softcapping, logit scaling, auxiliary loss or custom loss. ``probe`` also runs the forward of
    a one-block fake copy to check that structure (no memory, no values)."""
    reason = _static_refusal(model)
    if reason is None and probe:
        reason = _probe_refusal(model)
    return reason


def supports_chunked_ce(model: nn.Module) -> bool:
    """Chunked cross-entropy gives exactly ``model``'s own loss and gradients (see :func:`chunked_ce_refusal`)."""
    return chunked_ce_refusal(model) is None


def causal_lm_chunked_loss(model: nn.Module, batch: dict[str, Any], *, chunks: int) -> torch.Tensor:
    """The causal-LM loss of ``model`` on ``batch`` with the chunked head (labels shifted as HF does)."""
    reason = _static_refusal(model)
    if reason is not None:
        raise ValueError(f"chunked cross-entropy is not exact here: {reason}; plan with chunked_ce=0")
    labels = batch["labels"]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    hidden = model.base_model(**inputs).last_hidden_state
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return fused_linear_cross_entropy(hidden, model.get_output_embeddings().weight, shifted, chunks=chunks)
