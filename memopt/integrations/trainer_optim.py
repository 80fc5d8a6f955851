"""The optimizer a Trainer script chose, kept by the plan.

``TrainingArguments.optim`` (or an optimizer handed to the Trainer) is the script's choice of update, as ``bf16`` is
its choice of numerics: the plan keeps it rather than putting AdamW in its place. An AdamW the Trainer builds
(``adamw_torch``, ``adamw_torch_fused``) leaves memopt the choice among its AdamW implementations (the same update);
an optimizer memopt has a variant of (SGD, the 8-bit AdamWs) is pinned to that variant where the plan's fidelity
allows it (a warning says when it does not); any other (Adafactor, Lion, RMSprop, ...) is planned as the user's own
optimizer: the one the Trainer would build, traced for its states, and left to the Trainer to build."""

from __future__ import annotations

import warnings
from typing import Any

from memopt.plan.policy import FIDELITY_PRESETS, Policy
from memopt.techniques.optimizer_instance import optimizer_factory
from memopt.techniques.optimizers import USER, VARIANTS

__all__ = ["ADAMW_OPTIMS", "TRAINER_OPTIM", "kept_optimizer", "script_optimizer"]

#: memopt's optimizer name -> ``TrainingArguments.optim``, for the variants a Trainer can build
TRAINER_OPTIM = {v.name: v.trainer_optim for v in VARIANTS.values() if v.trainer_optim is not None}
#: the Trainer's torch AdamW: any of memopt's exact AdamW variants runs the same update
ADAMW_OPTIMS = frozenset({"adamw_torch", "adamw_torch_fused"})
# the Trainer's name -> memopt's variant (two Trainer names build bitsandbytes' AdamW8bit); the AdamWs above aside
_VARIANT_OF = {**{optim: name for name, optim in TRAINER_OPTIM.items() if optim not in ADAMW_OPTIMS},
               "adamw_8bit": "adamw8bit"}


def _optim_name(args: Any) -> str:
    optim = getattr(args, "optim", "adamw_torch")
    return str(getattr(optim, "value", optim))


def script_optimizer(trainer: Any, policy: Policy) -> tuple[dict[str, Any], Any]:
    """(pins for the planner, the optimizer callable the profile traces or None) for the optimizer ``trainer``'s
    script chose: see the module's docstring."""
    given = getattr(trainer, "optimizer", None)
    if given is not None:  # Trainer(optimizers=(optimizer, scheduler)): the Trainer uses it as it is
        return {"optimizer": USER}, optimizer_factory(given, trainer.model)
    cls_and_kwargs = getattr(trainer, "optimizer_cls_and_kwargs", None)
    name = _optim_name(trainer.args)
    if cls_and_kwargs is None:
        if name in ADAMW_OPTIMS:
            return {}, None
        variant = _VARIANT_OF.get(name)
        if variant is not None:
            if policy.allows("optimizer", variant):
                return {"optimizer": variant}, None
            needs = next(p for p, allow in FIDELITY_PRESETS.items() if VARIANTS[variant].fidelity in allow)
            warnings.warn(f"the Trainer's arguments ask for optim={name!r} (memopt's {variant}), which the plan's "
                          f"fidelity does not allow: the plan chooses the optimizer; fidelity={needs!r} keeps the "
                          "script's", stacklevel=4)
            return {}, None
        try:
            cls_and_kwargs = type(trainer).get_optimizer_cls_and_kwargs(trainer.args, trainer.model)
        except Exception as exc:  # a package it needs is missing, or arguments it refuses
            raise ValueError(f"the Trainer cannot build its optimizer optim={name!r} ({type(exc).__name__}: "
                             f"{str(exc)[:200]}); fix the script's optim, or use optim='adamw_torch'") from None
    cls, kwargs = cls_and_kwargs

    def build(params: Any) -> Any:
        return cls(params, **kwargs)

    return {"optimizer": USER}, build


def kept_optimizer(trainer: Any) -> str:
    """The script's optimizer in words: the class handed to the Trainer, or its ``optim`` argument."""
    given = getattr(trainer, "optimizer", None)
    if given is not None:
        return type(given).__name__
    cls_and_kwargs = getattr(trainer, "optimizer_cls_and_kwargs", None)
    if cls_and_kwargs is not None:
        return getattr(cls_and_kwargs[0], "__name__", str(cls_and_kwargs[0]))
    return f"optim={_optim_name(trainer.args)!r}"
