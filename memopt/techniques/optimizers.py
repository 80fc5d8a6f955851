"""The optimizers memopt builds, estimates and plans: one registry of ``OptimizerVariant`` records.

Each family is one module that declares its variants (``memopt.techniques.optimizer_variant`` says what a variant
holds); registering it here is all it takes for the planner, the configs' checks, the traces, the byte models and the
Trainer integration to know it. ``"user"`` is not a variant: it is the optimizer instance or callable a user passes,
traced as it is.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from memopt.techniques import optim_bnb, optim_torch, optim_torchao
from memopt.techniques.optimizer_variant import OptimizerVariant

__all__ = ["OPTIMIZER_NAMES", "USER", "VARIANTS", "bnb_installed", "build_optimizer", "optimizer_choice",
           "optimizer_fidelity", "states_per_item", "variant"]

VARIANTS: dict[str, OptimizerVariant] = {v.name: v for v in (*optim_torch.VARIANTS, *optim_bnb.VARIANTS,
                                                             *optim_torchao.VARIANTS)}
USER = "user"
#: every name a strategy's ``optimizer`` may hold
OPTIMIZER_NAMES: tuple[str, ...] = (*VARIANTS, USER)

_DEFAULTS: dict[str, Any] = {"lr": 1e-4, "weight_decay": 0.0}


def variant(name: str) -> OptimizerVariant:
    """The registered variant ``name``; ValueError listing them for any other name."""
    found = VARIANTS.get(name)
    if found is None:
        raise ValueError(f"unknown optimizer {name!r}; choose one of: {', '.join(VARIANTS)}, or pass a callable that "
                         "takes the parameters")
    return found


def optimizer_fidelity(name: str) -> str:
    """The policy allowance a run with optimizer ``name`` needs (the user's own optimizer: "exact")."""
    return "exact" if name == USER else variant(name).fidelity


def states_per_item(name: str) -> float:
    """State bytes per trained parameter per byte of its dtype, roughly (the user's own: AdamW's 2)."""
    return 2.0 if name == USER else variant(name).states_per_item


def bnb_installed() -> bool:
    """Whether bitsandbytes is installed, without importing it (its import compiles kernels: seconds). The
    planner only needs to know which optimizers exist; it traces 8-bit states with a stand-in."""
    return VARIANTS["adamw8bit"].installed()


def build_optimizer(name: str, params: Iterable[torch.nn.Parameter], *, trace_on: str | None = None,
                    **kwargs: Any) -> torch.optim.Optimizer:
    """An optimizer by memopt name. Keyword arguments (lr, weight_decay, betas, momentum) pass through.
    ``trace_on``: for a fake-tensor trace, whose host-side states go to that device: the variant's stand-in where
    the real optimizer needs real values (nothing is imported then)."""
    chosen = variant(name)
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters (every parameter has requires_grad=False)")
    options = {**_DEFAULTS, **kwargs}
    if trace_on is not None:
        return chosen.trace_optimizer(params, trace_on, **options)
    chosen.require()
    return chosen.build(params, **options)


def optimizer_choice(optimizer: Any) -> tuple[dict[str, Any], Any]:
    """(pins for the planner, the callable for 'user') for an ``optimizer=`` argument: a variant's name pins it;
    'adamw' (or 'adam', 'auto', None) lets the planner pick the AdamW variant; a callable is the user's."""
    if callable(optimizer) and not isinstance(optimizer, str):
        return {"optimizer": USER}, optimizer
    if optimizer in (None, "auto", "adamw", "adam"):
        return {}, None
    if optimizer in VARIANTS:
        return {"optimizer": optimizer}, None
    raise ValueError(f"unknown optimizer {optimizer!r}: use 'adamw' (memopt picks the AdamW variant), one of "
                     f"{', '.join(v for v in VARIANTS if v != 'adamw')}, or a callable taking the parameters")
