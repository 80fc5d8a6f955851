"""What a causal LM's head does between ``hidden @ W.T`` and its loss, and whether a fused head + loss can
reproduce it exactly.

A fused loss (memopt's chunked cross-entropy, Liger's fused linear cross-entropy) computes the logits itself,
chunk by chunk, from the base model's last hidden state and the head's weight; it is exact only when the model's
own loss is the standard causal-LM cross-entropy of those logits after a transform the fused loss applies too.
The transforms transformers' heads declare in their config are a scale (Granite divides by ``logits_scaling``,
Cohere multiplies by ``logit_scale``) and a tanh softcap (Gemma-2's ``final_logit_softcapping``). The config
says what the head should do; a probe (one forward of a one-block fake copy, no memory, no values) checks what it
does: the aten ops between the head and the loss must be exactly the declared transform, applied to the head's
output and feeding the loss, so a subclass that changes the logits with no config field saying so is refused. The
probe traces the model, so it lives with the traces (``memopt.profile.head_probe``); this module holds what the
techniques need to run the transform.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from memopt.models.hf_task import hf_task, peft_unwrapped

__all__ = ["HeadTransform", "head_transform", "static_head_refusal"]

# config fields that scale the logits: the aten op the head applies with the field's value
_SCALES = {"logit_scale": "mul", "logits_scaling": "div"}
_SOFTCAPS = ("final_logit_softcapping",)
# config fields of heads that change the logits in a way no fused loss here reproduces (neutral value)
_UNSUPPORTED = {"lm_head_multiplier": 1.0, "output_multiplier_scale": 1.0, "logit_softcapping": None}


@dataclass(frozen=True)
class HeadTransform:
    """``logits = softcap * tanh((raw <op> factor) / softcap)`` where ``raw = hidden @ W.T``; each step optional."""

    op: str | None = None  # "mul" | "div": the scale, as the head applies it
    factor: float = 1.0
    softcap: float | None = None

    @property
    def identity(self) -> bool:
        return self.op is None and self.softcap is None

    def expected_ops(self) -> list[tuple[str, float | None]]:
        """The aten ops (and their scalar) the head runs between its matmul and its loss."""
        ops: list[tuple[str, float | None]] = [] if self.op is None else [(f"aten.{self.op}.Tensor", self.factor)]
        if self.softcap is not None:
            ops += [("aten.div.Tensor", self.softcap), ("aten.tanh.default", None), ("aten.mul.Tensor", self.softcap)]
        return ops

    def forward(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits of ``raw`` and what ``grad`` needs (the tanh; None without a softcap)."""
        x = raw if self.op is None else (raw * self.factor if self.op == "mul" else raw / self.factor)
        if self.softcap is None:
            return x, None
        t = torch.tanh(x / self.softcap)
        return t * self.softcap, t

    def grad(self, g: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
        """The gradient w.r.t. ``raw`` from the gradient ``g`` w.r.t. the logits, in place."""
        if t is not None:
            g.mul_(1.0 - t * t)
        if self.op == "mul":
            g.mul_(self.factor)
        elif self.op == "div":
            g.div_(self.factor)
        return g


def head_transform(model: nn.Module) -> HeadTransform | str:
    """The transform ``model``'s config declares for its head, or why no fused loss reproduces its head."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    for field, neutral in _UNSUPPORTED.items():
        value = getattr(config, field, neutral)
        if value is not None and value != neutral:
            return f"{name}'s head applies {field}={value} to its logits"
    scales = [(f, getattr(config, f)) for f in _SCALES if getattr(config, f, None) not in (None, 1.0)]
    caps = [getattr(config, f) for f in _SOFTCAPS if getattr(config, f, None) is not None]
    if len(scales) + len(caps) > 1:
        return f"{name}'s head applies more than one transform to its logits ({[f for f, _ in scales]}, softcap)"
    for field, value in scales:
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value == 0:
            return f"{name}'s head applies {field}={value} to its logits"
        return HeadTransform(op=_SCALES[field], factor=float(value))
    if caps:
        if not isinstance(caps[0], (int, float)) or caps[0] <= 0:
            return f"{name}'s head applies a softcap of {caps[0]} to its logits"
        return HeadTransform(softcap=float(caps[0]))
    return HeadTransform()


def static_head_refusal(model: nn.Module) -> str | None:
    """Why no fused loss reproduces ``model``'s head, from its classes and config alone (None: none found)."""
    model = peft_unwrapped(model)
    name = type(model).__name__
    if hf_task(model) != "causal_lm":
        return f"{name} is not a Hugging Face causal LM"
    head = getattr(model, "get_output_embeddings", lambda: None)()
    base = getattr(model, "base_model", None)
    if not isinstance(head, nn.Linear) or base is None or base is model:
        return f"{name}'s head is not a linear layer over a base model"
    if head.bias is not None:
        return f"{name}'s head has a bias"
    if getattr(getattr(model, "config", None), "output_router_logits", False):
        return f"{name}'s loss adds the router's auxiliary loss (output_router_logits=True)"
    transform = head_transform(model)
    return transform if isinstance(transform, str) else None
