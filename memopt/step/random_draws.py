"""Which ops of a forward draw random numbers per element: what makes the same samples give other values from one
pass to the next (dropout masks, noise a training step adds, timesteps it samples)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["DrawLog"]

# aten ops that draw from a random generator
_RANDOM_OPS = frozenset({"bernoulli", "bernoulli_", "native_dropout", "_fused_dropout", "rand", "rand_like", "randn",
                         "randn_like", "randint", "randint_like", "randperm", "multinomial", "normal", "normal_",
                         "uniform_", "exponential_", "geometric_", "cauchy_", "log_normal_", "random_",
                         "rrelu_with_noise", "poisson"})
# fused attention kernels that draw their dropout inside: the position of dropout_p among their arguments
_ATTENTION_DROPOUT_ARG = {"_scaled_dot_product_flash_attention": 3, "_scaled_dot_product_flash_attention_for_cpu": 3,
                          "_scaled_dot_product_efficient_attention": 5, "_scaled_dot_product_cudnn_attention": 5,
                          "_flash_attention_forward": 5, "_efficient_attention_forward": 6}


def _drawn_with(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> str | None:
    """The name of the random op ``func`` is when it drew more than one number (None otherwise). A single number
    drawn is a per-step decision (LayerDrop's "skip this layer?", which OPT and BART draw even at layerdrop 0, where
    nothing depends on it); per-element draws are what change with the samples."""
    packet = getattr(func, "_overloadpacket", None)
    name = packet.__name__ if packet is not None else str(func)
    if name in _RANDOM_OPS:
        drawn = out if isinstance(out, torch.Tensor) else next((a for a in args if isinstance(a, torch.Tensor)), None)
        return name if drawn is None or drawn.numel() > 1 else None
    if name in _ATTENTION_DROPOUT_ARG:
        i = _ATTENTION_DROPOUT_ARG[name]
        p = args[i] if len(args) > i else kwargs.get("dropout_p", 0.0)
        if isinstance(p, (int, float)) and p > 0:
            return f"{name}(dropout_p={p:g})"
    return None


def _one_number_drawn(func: Any, args: tuple[Any, ...], out: Any) -> str | None:
    """The name of the random op ``func`` is when it drew exactly one number (None otherwise)."""
    packet = getattr(func, "_overloadpacket", None)
    name = packet.__name__ if packet is not None else str(func)
    if name not in _RANDOM_OPS:
        return None
    drawn = out if isinstance(out, torch.Tensor) else next((a for a in args if isinstance(a, torch.Tensor)), None)
    return name if drawn is not None and drawn.numel() == 1 else None


class DrawLog(TorchDispatchMode):
    """Records, in ``seen``, the random ops the code run under it draws with (:func:`_drawn_with`), and in
    ``single`` those that drew one number: a per-step decision, or a per-sample draw (timm's drop path,
    ``torch.rand(B, 1)``) on a batch of one sample, which only a forward of more samples tells apart."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()
        self.single: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = _drawn_with(func, args, kwargs or {}, out)
        if name is not None:
            self.seen.add(name)
        elif (one := _one_number_drawn(func, args, out)) is not None:
            self.single.add(one)
        return out
