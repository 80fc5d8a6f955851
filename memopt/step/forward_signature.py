"""How a batch meets ``model.forward``'s signature: which of a dict batch's keys it takes, whether it takes the
dict whole, whether a tuple batch's elements fit its positional parameters.

The batch contract (``memopt.step.batch.compute_loss``) calls the model with the batch's pieces; what it passes
depends on what ``forward`` declares, read through the wrappers that hide it (DDP's and DeepSpeed's ``module``,
peft's base model) and through a Hugging Face model's ``**kwargs``. A batch that does not fit is a one-line error
here, before the call would fail deep inside the model.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from torch import nn

from memopt.models.hf_task import hf_forward_kwargs, is_hf_model, peft_unwrapped

__all__ = ["check_takes", "forward_kwargs", "takes_the_whole_dict"]


def _accepts(model: nn.Module) -> set[str] | None:
    """The keyword names ``model.forward`` takes; None when it takes any (``**kwargs``). A Hugging Face model's
    ``**kwargs`` are its ``TransformersKwargs`` (flash-attention lengths, ``num_items_in_batch``, ...): those and the
    named parameters are what it takes, so a target kept beside its inputs is not sent down its layers."""
    forward = model.forward
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return None
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if any(p.kind is p.VAR_KEYWORD for p in params):
        if not is_hf_model(model):
            return None
        names |= hf_forward_kwargs()
    return names


def forward_kwargs(model: nn.Module, batch: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of a dict batch that ``model.forward`` accepts (all of them when it takes ``**kwargs``)."""
    names = _accepts(_unwrapped(model))
    if names is None:
        return dict(batch)
    kept = {k: v for k, v in batch.items() if k in names}
    if not kept:
        raise ValueError(f"none of the batch's keys {sorted(batch)} is a parameter of {type(model).__name__}."
                         f"forward ({', '.join(sorted(names)) or 'no keyword parameters'}): name the keys after "
                         "forward's parameters, or pass training_step=(model, batch) -> loss to call it yourself")
    return kept


def takes_the_whole_dict(model: nn.Module, batch: Mapping[str, Any]) -> bool:
    """Whether ``forward`` takes the dict itself (``def forward(self, batch)``, as many Lightning-style modules do):
    one required parameter, no ``**kwargs``, and none of the batch's keys among its parameters' names."""
    try:
        params = list(inspect.signature(_unwrapped(model).forward).parameters.values())
    except (TypeError, ValueError):
        return False
    if any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in params) or any(p.name in batch for p in params):
        return False
    required = [p for p in params if p.default is p.empty]
    return len(required) == 1 and required[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                       inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _unwrapped(model: nn.Module) -> nn.Module:
    """The user's module inside a wrapper that forwards ``*args, **kwargs`` to it (DDP's and DeepSpeed's
    ``module``, peft's base model), whose signature says nothing."""
    inner = model
    for _ in range(4):
        peft_inner = peft_unwrapped(inner)  # a PeftModel: its forward(*args, **kwargs) calls the base model
        candidate = peft_inner if peft_inner is not inner else getattr(inner, "module", None)
        if not isinstance(candidate, nn.Module) or candidate is inner:
            break
        try:
            params = inspect.signature(type(inner).forward).parameters.values()
        except (TypeError, ValueError):
            break
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
        inner = candidate
    return inner


def _looks_like_rows(batch: Any) -> bool:
    """A list of dataset rows not yet collated: two or more dicts with the same keys."""
    return (isinstance(batch, (list, tuple)) and len(batch) >= 2 and all(isinstance(b, Mapping) for b in batch)
            and len({tuple(b) for b in batch}) == 1)


def check_takes(model: nn.Module, batch: list[Any] | tuple[Any, ...], count: int) -> None:
    """A one-line error when a tuple batch's first ``count`` elements (all but the target, under a ``loss_fn``) do
    not fit ``forward``."""
    name = type(_unwrapped(model)).__name__
    target_held_back = count < len(batch)
    try:
        inspect.signature(_unwrapped(model).forward).bind(*range(count))
    except TypeError:
        if _looks_like_rows(batch):
            raise ValueError(f"the batch is a list of {len(batch)} dicts with the same keys, which {name}.forward "
                             "does not take: dataset rows not yet collated? memopt takes one collated batch (every "
                             "tensor with the samples along dim 0), e.g. torch.utils.data.default_collate(rows) or "
                             "next(iter(loader))") from None
        if target_held_back:
            raise ValueError(f"{name}.forward does not take the {count} input(s) of the (inputs..., target) batch: "
                             "with loss_fn the last element is the target and is not passed to the model; to pass it "
                             "too, give training_step=(model, batch) -> loss, or a dict batch whose keys are "
                             "forward's parameters") from None
        raise ValueError(f"{name}.forward does not take the batch's {count} elements: for an (inputs..., target) "
                         "batch pass loss_fn=(output, batch) -> loss (the target is then not passed to the model) "
                         "or training_step=(model, batch) -> loss") from None
    except ValueError:  # no signature to read: let the call say
        return
