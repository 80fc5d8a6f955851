"""What a causal LM's head does between ``hidden @ W.T`` and its loss, and whether a fused head + loss can
reproduce it exactly.

A fused loss (memopt's chunked cross-entropy, Liger's fused linear cross-entropy) computes the logits itself,
chunk by chunk, from the base model's last hidden state and the head's weight; it is exact only when the model's
own loss is the standard causal-LM cross-entropy of those logits after a transform the fused loss applies too.
The transforms transformers' heads declare in their config are a scale (Granite divides by ``logits_scaling``,
Cohere multiplies by ``logit_scale``) and a tanh softcap (Gemma-2's ``final_logit_softcapping``). The config
says what the head should do; a probe (one forward of a one-block fake copy, no memory, no values) checks what it
does: the aten ops between the head and the loss must be exactly the declared transform, applied to the head's
output and feeding the loss, so a subclass that changes the logits with no config field saying so is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HeadTransform", "head_refusal", "head_transform", "static_head_refusal"]

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
    from memopt.models.hf_task import hf_task

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


class _OpLog(TorchDispatchMode):
    """The aten ops run while ``on``: name, the scalar argument (if any), the tensor input and the output."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False
        self.ops: list[tuple[str, float | None, Any, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.on:
            scalar = next((a for a in args[1:] if isinstance(a, (int, float)) and not isinstance(a, bool)), None)
            self.ops.append((str(func), None if scalar is None else float(scalar), args[0] if args else None, out))
        return out


def _same(a: Any, b: Any) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.untyped_storage()._cdata == b.untyped_storage()._cdata)


def _probe_refusal(model: nn.Module, transform: HeadTransform) -> str | None:
    """Run the model's forward once on a one-block fake copy and check that its loss is exactly the standard
    causal-LM cross-entropy of ``transform(lm_head(base_model(...).last_hidden_state))``, nothing else."""
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
    log = _OpLog()

    def spy(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, **kwargs: Any) -> torch.Tensor:
        log.on = False
        out = ForCausalLMLoss(logits, labels, vocab_size, **kwargs)
        seen["loss_calls"].append((logits, out, sorted(k for k, v in kwargs.items() if v is not None)))
        return out

    def head_hook(m: nn.Module, a: Any, o: Any) -> None:
        seen.update(head_in=a[0], head_out=o)
        log.ops.clear()
        log.on = True

    head = clone.get_output_embeddings()
    hooks = [head.register_forward_hook(head_hook),
             clone.base_model.register_forward_hook(lambda m, a, o: seen.update(base_out=o))]
    clone.loss_function = spy
    try:
        # the tracker answers the boolean checks models make on masks (fake tensors have no values)
        # grouped-GEMM experts run in fp32 here, as the trace runs them
        with (mode, real_code_paths(), grouped_mm_in_any_float(), torch.no_grad(),
              MemoryTracker("cpu", record=False), log):
            ids = torch.zeros(1, 4, dtype=torch.long)
            out = clone(input_ids=ids, labels=ids, use_cache=False)
    except Exception as exc:  # any failure: the structure could not be verified
        return f"its head could not be checked ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
    finally:
        for h in hooks:
            h.remove()

    name = type(model).__name__
    hidden = getattr(seen.get("base_out"), "last_hidden_state", None)
    calls = seen["loss_calls"]
    if "head_out" not in seen or not _same(seen["head_in"], hidden):
        return f"{name}'s head does not take the base model's last hidden state unchanged"
    if len(calls) != 1:
        return f"{name} changes the logits between its head and its loss"
    ran = [(op, scalar) for op, scalar, _, _ in log.ops]
    chained = all(_same(inp, prev) for (_, _, inp, _), prev in
                  zip(log.ops, [seen["head_out"]] + [o for _, _, _, o in log.ops]))
    last = log.ops[-1][3] if log.ops else seen["head_out"]
    if ran != transform.expected_ops() or not chained or not _same(calls[0][0], last):
        return f"{name} changes the logits between its head and its loss"
    if getattr(out, "loss", None) is not calls[0][1]:
        return f"{name}'s loss is more than the cross-entropy of its logits"
    extra = [k for k in calls[0][2] if k not in ("num_items_in_batch",)]
    if extra:
        return f"{name} passes {extra} to its loss"
    return None


def head_refusal(model: nn.Module, *, probe: bool = True) -> str | None:
    """Why a fused head + loss would not be exact for ``model`` (None: it is, with ``head_transform(model)``).
    Exact means the model's own loss is the standard causal-LM cross-entropy of the transformed
    ``base_model(...).last_hidden_state @ lm_head.weight.T``: no head bias, auxiliary loss or custom loss, and no
    transform but a declared scale or softcap. ``probe`` also runs a one-block fake copy to check that structure."""
    reason = static_head_refusal(model)
    if reason is None and probe:
        transform = head_transform(model)
        assert isinstance(transform, HeadTransform)
        reason = _probe_refusal(model, transform)
    return reason
