"""Optimizer variants and the bytes of state each keeps per parameter.

================= ============================================ ================================
name              what                                         states per trainable parameter
================= ============================================ ================================
adamw_fused       torch AdamW, fused CUDA kernel               2 x param dtype (+ a step tensor)
adamw_foreach     torch AdamW, multi-tensor (torch's default)  2 x param dtype; a temporary copy
adamw             torch AdamW, one tensor at a time            2 x param dtype
adamw8bit         bitsandbytes AdamW8bit, block-wise 8-bit     2 x 1 byte + fp32 scale per 256
paged_adamw8bit   the same in paged (unified) memory           same, outside the allocator
sgd               torch SGD with momentum                      1 x param dtype
user              the user's own optimizer instance            traced
================= ============================================ ================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from memopt.strategy import EIGHT_BIT_OPTIMIZERS

__all__ = ["OPTIMIZER_FIDELITY", "bnb_available", "build_optimizer"]

OPTIMIZER_FIDELITY = {
    "adamw_fused": "exact",
    "adamw_foreach": "exact",
    "adamw": "exact",
    "sgd": "exact",
    "user": "exact",
    "adamw8bit": "8bit_optimizer",
    "paged_adamw8bit": "8bit_optimizer",
}

_DEFAULTS: dict[str, Any] = {"lr": 1e-4, "weight_decay": 0.0}


def bnb_available() -> bool:
    try:
        import bitsandbytes  # noqa: F401
    except Exception:
        return False
    return True


def bnb_installed() -> bool:
    """Whether bitsandbytes is installed, without importing it (its import compiles kernels: seconds). The
    planner only needs to know which optimizers exist; it traces 8-bit states with a stand-in."""
    import importlib.util

    return importlib.util.find_spec("bitsandbytes") is not None


def build_optimizer(name: str, params: Iterable[torch.nn.Parameter], **kwargs: Any) -> torch.optim.Optimizer:
    """An optimizer by memopt name. Keyword arguments (lr, weight_decay, betas, momentum) pass through."""
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters (every parameter has requires_grad=False)")
    options = {**_DEFAULTS, **kwargs}
    if name == "adamw_fused":
        return torch.optim.AdamW(params, fused=True, **options)
    if name == "adamw_foreach":
        return torch.optim.AdamW(params, foreach=True, **options)
    if name == "adamw":
        return torch.optim.AdamW(params, foreach=False, **options)
    if name == "sgd":
        options.setdefault("momentum", 0.9)
        return torch.optim.SGD(params, **options)
    if name in EIGHT_BIT_OPTIMIZERS:
        if not bnb_available():
            raise ValueError(f"optimizer {name!r} needs bitsandbytes: pip install 'memopt[bnb]'")
        import bitsandbytes as bnb

        cls = bnb.optim.AdamW8bit if name == "adamw8bit" else bnb.optim.PagedAdamW8bit
        return cls(params, **options)
    raise ValueError(f"unknown optimizer {name!r}; choose one of: adamw_fused, adamw_foreach, adamw, sgd, "
                     "adamw8bit, paged_adamw8bit, or pass a callable that takes the parameters")


def optimizer_factory(spec: str | Callable[..., torch.optim.Optimizer], **kwargs: Any
                      ) -> Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]:
    """Normalize a name or a callable into ``params -> optimizer``."""
    if callable(spec):
        return lambda params: spec(params)
    return lambda params: build_optimizer(spec, params, **kwargs)
