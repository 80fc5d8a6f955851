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
           "optimizer_fidelity", "pinned_variant_refusal", "states_per_item", "variant"]

VARIANTS: dict[str, OptimizerVariant] = {v.name: v for v in (*optim_torch.VARIANTS, *optim_bnb.VARIANTS,
                                                             *optim_torchao.VARIANTS)}
USER = "user"
#: every name a strategy's ``optimizer`` may hold
OPTIMIZER_NAMES: tuple[str, ...] = (*VARIANTS, USER)

_DEFAULTS: dict[str, Any] = {"lr": 1e-4, "weight_decay": 0.0}
# the algorithm of a user's optimizer, by class name (torch's, bitsandbytes' and torchao's spell them alike); torch's
# Adam is not AdamW (its weight decay is an L2 term in the gradient)
_ALGORITHMS = {"AdamW": "adamw", "AdamW8bit": "adamw", "PagedAdamW8bit": "adamw", "AdamW4bit": "adamw",
               "SGD": "sgd"}
# group flags torch's own optimizers honour that the other families' kernels would ignore without a word
_TORCH_ONLY_FLAGS = ("amsgrad", "maximize", "nesterov")


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


def build_optimizer(name: str, params: Iterable[torch.nn.Parameter] | list[dict[str, Any]], *,
                    trace_on: str | None = None, **kwargs: Any) -> torch.optim.Optimizer:
    """An optimizer by memopt name over ``params`` (or param groups). Keyword arguments (lr, weight_decay, betas,
    momentum) pass through.
    ``trace_on``: for a fake-tensor trace, whose host-side states go to that device: the variant's stand-in where
    the real optimizer needs real values (nothing is imported then)."""
    chosen = variant(name)
    params = list(params)
    if not (params and isinstance(params[0], dict)):  # param groups are the caller's own choice of parameters
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


def pinned_variant_refusal(user_optimizer: Any, pinned: Any) -> str | None:
    """Why pin ``optimizer=pinned`` cannot go with the optimizer the user passed (``user_optimizer``: a callable, or
    the recipe ``memopt.techniques.optimizer_instance.optimizer_factory`` made of an instance), or None. A variant
    of the instance's own algorithm is built from its groups and hyper-parameters; anything else would train
    another optimizer than the user's, so it is refused rather than trained at memopt's defaults."""
    if pinned not in VARIANTS or user_optimizer is None:
        return None
    chosen = VARIANTS[pinned]
    source = getattr(user_optimizer, "built_from", None)
    if source is None:
        return (f"pin optimizer={pinned!r} conflicts with the optimizer callable passed as optimizer=, which it would "
                "replace: drop the pin, or build that optimizer in the callable")
    name = type(source).__name__
    if _ALGORITHMS.get(name) != chosen.algorithm:
        return (f"pin optimizer={pinned!r} ({chosen.summary}) conflicts with the {name} passed as optimizer=, "
                f"another algorithm: drop the pin, or pass optimizer={pinned!r} with its lr/weight_decay/betas")
    if chosen.requires is not None:
        flags = sorted({k for g in source.param_groups for k in _TORCH_ONLY_FLAGS if g.get(k)})
        if flags:
            return (f"pin optimizer={pinned!r} ({chosen.summary}) cannot follow the {name} passed as optimizer=: its "
                    f"{', '.join(flags)} would be ignored; drop the pin")
        if source.state:
            return (f"pin optimizer={pinned!r} ({chosen.summary}) cannot take the state of the {name} passed as "
                    "optimizer= (its moments are stored another way): drop the pin, or pin it on a fresh optimizer")
    return None
