"""The checks and choices ``memopt.wrap`` makes before planning: the optimizer argument, what the target is, a
model it cannot train as planned."""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from memopt.errors import InputError
from memopt.profile.api import lazy_module_refusal
from memopt.techniques.micro_batching import micro_batch_refusal
from memopt.units import format_bytes, parse_budget

__all__ = ["WRAPPED_BY", "WrappedBy", "check_model", "is_trainer", "micro_batch_warning", "refuse_plan_overrides",
           "refuse_trainer_ignored", "wrapper_of"]


def is_trainer(obj: Any) -> bool:
    return hasattr(obj, "args") and hasattr(obj, "model") and hasattr(obj, "create_optimizer")


#: the attribute a wrapped model holds its wrapper under (in a ``WrappedBy``), from the wrap until its unwrap(): a
#: second wrap of the same module would plan its already-changed weights (bf16 with the first wrapper's fp32 masters)
#: as the user's own
WRAPPED_BY = "memopt_wrapper"


class WrappedBy:
    """What a wrapped module holds its wrapper by. A copy of the module (``copy.deepcopy``: an EMA, an
    ``AveragedModel``, a best-model snapshot) or a pickle of it (``torch.save(model)``) holds None instead: the
    wrapper's optimizer states, guard and profile are the run's, not the module's, and a copy is a module of its own,
    which nothing trains until it is wrapped."""

    __slots__ = ("wrapper",)

    def __init__(self, wrapper: Any) -> None:
        self.wrapper = wrapper

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return type(None), ()  # unpickles as None, with nothing of memopt's to import


def wrapper_of(model: nn.Module) -> Any:
    """The wrapper that wrapped ``model`` and has not unwrapped it, or None."""
    marker = model.__dict__.get(WRAPPED_BY)
    return marker.wrapper if isinstance(marker, WrappedBy) else None


def check_model(model: nn.Module, *, weights_pending: bool = False) -> None:
    lazy = lazy_module_refusal(model)
    if lazy is not None:
        raise InputError([lazy])
    if wrapper_of(model) is not None:
        raise ValueError("this model is already wrapped by memopt.wrap: train through that wrapper, or call its "
                         "unwrap() first to wrap the model again")
    # torch.compile(model) wraps it; model.compile() (of it or of a block) compiles in place
    if type(model).__name__ == "OptimizedModule" or hasattr(model, "_orig_mod") or any(
            getattr(m, "_compiled_call_impl", None) is not None for m in model.modules()):
        raise ValueError("memopt.wrap does not support torch.compile'd models: compiled graphs allocate memory "
                         "that memopt's plan does not account for. Wrap the uncompiled model")
    if not weights_pending and any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError("the model has parameters on the meta device (no weights): load or initialize the weights "
                         "first, pass checkpoint=<safetensors file(s)> to load them under the plan, or use "
                         "memopt.plan(...) for a dry run without weights")


def micro_batch_warning(model: nn.Module, micro: int, global_batch: int, profiled: str | None = None) -> None:
    """A plan that micro-batches a model the planner would not split (only when the user pinned the micro-batch):
    BatchNorm, or ``profiled``, the profile's reason (a batch whose dim 0 is not the samples), changes training:
    say so where the user runs it."""
    reason = micro_batch_refusal(model) or profiled
    if reason is not None and micro < global_batch:
        warnings.warn(f"the plan splits each batch of {global_batch} into micro-batches of {micro}, but {reason}; "
                      f"pin micro_batch_size={global_batch} (or leave it unpinned) to keep training exact",
                      stacklevel=3)


# where a Trainer script sets what memopt.wrap(model) takes as an argument
_TRAINER_SETS = {
    "optimizer": "TrainingArguments(optim=...) or Trainer(optimizers=(optimizer, scheduler))",
    "lr": "TrainingArguments(learning_rate=...)",
    "weight_decay": "TrainingArguments(weight_decay=...)",
    "betas": "TrainingArguments(adam_beta1=..., adam_beta2=...)",
    "optimizer_kwargs": "TrainingArguments(optim_args=...)",
    "loss_fn": "Trainer(compute_loss_func=...) or a compute_loss override",
    "training_step": "Trainer(compute_loss_func=...) or a compute_loss override",
    "lr_scheduler": "TrainingArguments(lr_scheduler_type=...) or Trainer(optimizers=(optimizer, scheduler))",
    "max_grad_norm": "TrainingArguments(max_grad_norm=...)",
    "loss_reduction": "the Trainer's loss (its own accumulation)",
    "run_dir": "TrainingArguments(output_dir=...): memopt writes to <output_dir>/memopt",
    "device": "the Trainer's own device placement",
    "checkpoint": "the model's weights, loaded before the Trainer is built",
    "autotune": "nothing: the Trainer path does not autotune",
    "calibration": "nothing: the Trainer path plans without stored calibration",
}


def refuse_trainer_ignored(given: dict[str, Any]) -> None:
    """One line naming the arguments ``memopt.wrap(trainer)`` was given that a Trainer takes from its script
    (``given``: each such argument that differs from its default), and where the script sets each."""
    if given:
        where = "; ".join(f"{name}: {_TRAINER_SETS[name]}" for name in given)
        raise ValueError(f"memopt.wrap(trainer) does not take {', '.join(given)}: the Trainer runs its own loop, so "
                         f"set them in the script ({where})")


def refuse_plan_overrides(plan: Any, given: dict[str, Any]) -> None:
    """A saved plan is applied as it was made: arguments that would plan otherwise (``given``: each one passed,
    with its value) are refused in one line, as is a plan that does not fit its budget."""
    if not plan.fits:
        raise ValueError("the saved plan does not fit its budget (it was saved from an infeasible planning): plan "
                         "again with a larger budget, or with memopt.wrap(model, budget=...)")
    conflicts = []
    for name, value in given.items():
        if name == "budget":
            try:
                same = parse_budget(value, device_total_bytes=None) == plan.budget_bytes
            except ValueError:  # a percentage: of a device the plan names, not this one
                same = False
            if not same:
                conflicts.append(f"budget={value!r} (the plan's is {format_bytes(plan.budget_bytes)})")
        elif name == "optimizer":
            if value != plan.strategy.optimizer:
                conflicts.append(f"optimizer={value!r} (the plan's is {plan.strategy.optimizer!r})")
        else:
            conflicts.append(f"{name}={value!r}")
    if conflicts:
        raise ValueError(f"a saved plan= is applied as it was made, but {', '.join(conflicts)} would plan otherwise: "
                         "drop them, or plan again with memopt.wrap(model, budget=..., ...) instead of plan=")
