"""Precision: what dtype weights are stored in and what dtype the math runs in.

=============== ======== =========== ================================ ===================
setting         weights  compute     optimizer                        fidelity
=============== ======== =========== ================================ ===================
fp32            fp32     fp32 (tf32) fp32 states                      exact
bf16_autocast   fp32     bf16        fp32 states                      mixed precision
fp16_autocast   fp32     fp16        fp32 states, dynamic loss scale  mixed precision
bf16_master     bf16     bf16        fp32 master weights + states     mixed precision
bf16_pure       bf16     bf16        bf16 states                      lossy (opt-in)
=============== ======== =========== ================================ ===================
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from memopt.techniques.model_change import ModelChange, Undo

__all__ = [
    "FIDELITY",
    "MasterWeights",
    "autocast_dtype",
    "cast_model",
    "change_model",
    "forward_context",
    "uses_grad_scaler",
]

FIDELITY = {
    "fp32": "exact",
    "bf16_autocast": "mixed_precision",
    "fp16_autocast": "mixed_precision",
    "bf16_master": "mixed_precision",
    "bf16_pure": "lossy_precision",
}


def autocast_dtype(precision: str) -> torch.dtype | None:
    return {"bf16_autocast": torch.bfloat16, "fp16_autocast": torch.float16}.get(precision)


def weight_dtype(precision: str) -> torch.dtype:
    """The dtype memopt stores floating weights in under ``precision``; float32 means "as the model has them"."""
    return torch.bfloat16 if precision in ("bf16_master", "bf16_pure") else torch.float32


def stored_dtype(weight: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """The dtype a parameter or buffer of ``dtype`` is stored in where the precision's weight dtype is ``weight``.
    memopt casts floating weights only to a 16-bit dtype (``cast_model``); under the other settings the model keeps
    its own dtypes, as its unwrapped loop trains them (an fp64 model, or one loaded in bf16)."""
    return weight if dtype.is_floating_point and weight != torch.float32 else dtype


def uses_grad_scaler(precision: str) -> bool:
    return precision == "fp16_autocast"


@contextlib.contextmanager
def forward_context(precision: str, device_type: str) -> Iterator[None]:
    """The context the forward pass (and loss) runs in: autocast for the autocast settings."""
    dtype = autocast_dtype(precision)
    if dtype is None:
        yield
    else:
        with torch.autocast(device_type=device_type, dtype=dtype):
            yield


def _convert(model: nn.Module, dtype_of: Callable[[torch.Tensor], torch.dtype | None]) -> None:
    """Replace parameters and buffers by converted copies, keeping shared (tied) tensors shared.

    Done by hand rather than with ``model.to``: that swaps tensor subclasses in place, which fake
    tensors (used to simulate the step) do not allow.
    """
    converted: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or dtype_of(p) is None:
                continue
            if id(p) not in converted:
                with torch.no_grad():
                    converted[id(p)] = nn.Parameter(p.detach().to(dtype_of(p)), requires_grad=p.requires_grad)
                _share_hooks(p, converted[id(p)])
            module._parameters[name] = converted[id(p)]
        for name, b in list(module._buffers.items()):
            if b is None or dtype_of(b) is None:
                continue
            if id(b) not in converted:
                converted[id(b)] = b.to(dtype_of(b))
            module._buffers[name] = converted[id(b)]


# where torch keeps the hooks a user registers on a tensor: ``register_hook`` and
# ``register_post_accumulate_grad_hook``; assigning one of these dicts to a tensor registers its hooks with autograd
_PARAM_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def _share_hooks(source: torch.Tensor, target: torch.Tensor) -> None:
    """Have ``target`` (the converted parameter that trains in ``source``'s place) run ``source``'s hooks.

    The very dicts are shared, not copies: a hook the user registers on, or removes from (its handle), the
    original parameter later is one on the converted parameter too, as it would be on the one parameter of the
    unwrapped loop. The originals keep their hooks, for the undo to put them back as they were."""
    for attr in _PARAM_HOOKS:
        hooks = getattr(source, attr, None)
        if hooks is not None:
            setattr(target, attr, hooks)


def change_model(change: ModelChange) -> Undo:
    """The precision's change to the model: weights stored in its dtype; for bf16_master the trainable fp32 weights
    are kept first (``change.originals``), to become the optimizer's master copies without a rounding step. With
    adapters the trained parameters are new adapter weights, whose masters start from themselves."""
    strategy = change.strategy
    if strategy.precision != "bf16_master" or strategy.extra("adapters") is not None:
        return cast_model(change.model, strategy.precision)
    change.originals = [p for p in change.model.parameters() if p.requires_grad]
    uncast = cast_model(change.model, strategy.precision)

    def undo() -> None:
        # the masters hold the fp32 values the optimizer stepped, the bf16 weights only their rounding (a master
        # may share the original's storage: it is copied before the cast's undo touches the original)
        masters = change.master.masters if change.master is not None else []
        if change.master is not None:
            change.master.follow_params()  # weights written since the last step are what the originals get
        with torch.no_grad():
            for p, master in zip(change.originals, masters):
                p.copy_(master.detach().to(device=p.device, dtype=p.dtype))
        uncast(trained_values=not masters)

    return undo


def _cast_inputs(value: Any, dtype: torch.dtype) -> Any:
    """fp32/fp64 tensors in ``value`` (nested in tuples, lists and dicts) cast to ``dtype``; the rest as given."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.dtype in (torch.float32, torch.float64) else value
    if isinstance(value, dict):
        return {k: _cast_inputs(v, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_cast_inputs(v, dtype) for v in value)
    return value


def cast_float_inputs(model: nn.Module, dtype: torch.dtype) -> Callable[[], None]:
    """Have ``model`` take its fp32/fp64 inputs (positional and keyword, nested in tuples, lists and dicts) in
    ``dtype``, through a forward pre-hook; returns the undo. For weights stored in ``dtype`` with no autocast around
    the forward: memopt's own bf16 weights, and DeepSpeed's bf16/fp16 engines, which cast the weights but not the
    inputs (FSDP2's mixed-precision policy casts them itself)."""
    # a partial of a module-level function, not a lambda: torch.save(model) pickles the hooks with the model
    hook = model.register_forward_pre_hook(functools.partial(_cast_input_hook, dtype), with_kwargs=True)
    return hook.remove


def _cast_input_hook(dtype: torch.dtype, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
    return _cast_inputs(args, dtype), _cast_inputs(kwargs, dtype)


def cast_model(model: nn.Module, precision: str) -> Callable[..., None]:
    """Store floating-point weights in the setting's dtype, and have the model take its floating-point inputs in
    that dtype too, as a hand-written bf16 loop casts them (a bf16 layer refuses fp32 input; integer ids, masks
    and labels stay as they are, and the loss function still reads the batch as given). Returns an undo that
    restores each dtype and the model's inputs."""
    target = weight_dtype(precision)
    if target == torch.float32:
        return lambda: None
    original: dict[str, torch.dtype] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and t.dtype != target:
            original[name] = t.dtype
    # the user's own Parameter objects, to be put back: an EMA, an optimizer or a hook of the user's holds them
    slots = [(module, name, p) for module in model.modules() for name, p in module._parameters.items()
             if p is not None and p.is_floating_point() and p.dtype != target]
    _convert(model, lambda t: target if t.is_floating_point() and t.dtype != target else None)
    uncast = cast_float_inputs(model, target)

    def undo(trained_values: bool = True) -> None:
        """``trained_values``: copy what each trainable weight holds back into the original (False where the
        caller restores them from elsewhere: bf16_master's masters)."""
        uncast()
        names = {id(t): n for n, t in model.named_buffers()}
        _convert(model, lambda t: original.get(names.get(id(t), "")) if not isinstance(t, nn.Parameter) else None)
        with torch.no_grad():
            for module, name, p in slots:
                now = module._parameters[name]
                if trained_values and now is not p and p.requires_grad:  # trained in the cast dtype
                    p.copy_(now.detach().to(device=p.device, dtype=p.dtype))
                module._parameters[name] = p  # a frozen one was never changed: exactly as given

    return undo


class MasterWeights:
    """fp32 master copies of bf16 parameters for ``bf16_master``: the optimizer steps the masters.

    Before each step every bf16 gradient is copied into its master's fp32 ``.grad`` (freed after the
    step); after the step the masters are copied back into the bf16 weights.

    The bf16 weights stay the user's to write: a ``model.load_state_dict``, a re-initialization or a clamp after the
    wrap writes them in place, and the masters follow (``follow_params``) before the step, a checkpoint or the
    unwrap reads them, rather than copying their stale values back over what was written. Each weight's version
    counter, recorded after memopt's own copy, tells a written weight apart at the cost of an integer compare per
    tensor; only a written one is compared element by element.
    """

    def __init__(self, params: list[nn.Parameter], sources: list[torch.Tensor] | None = None) -> None:
        self.params = [p for p in params if p.requires_grad]
        if sources is not None and len(sources) != len(self.params):
            raise ValueError("MasterWeights: one fp32 source per trainable parameter is needed")
        self.masters = [nn.Parameter(src.float() if src is not None else p.detach().float(), requires_grad=True)
                        for p, src in zip(self.params, sources or [None] * len(self.params))]
        self._versions = [p._version for p in self.params]

    def follow_params(self) -> None:
        """Take into each master what was written into its bf16 weight since memopt last copied the masters there.
        Only the elements that no longer hold their master's bf16 rounding are replaced: a master restored together
        with its weight (a checkpoint's load, a rolled-back step) keeps the fp32 digits the rounding dropped."""
        with torch.no_grad():
            for i, (p, m) in enumerate(zip(self.params, self.masters)):
                if p._version == self._versions[i]:
                    continue
                written = p.detach().to(device=m.device)
                m.copy_(torch.where(written == m.to(p.dtype), m, written.float()))
                self._versions[i] = p._version

    def grads_to_masters(self) -> None:
        self.follow_params()
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()

    def masters_to_params(self) -> None:
        with torch.no_grad():
            for i, (p, m) in enumerate(zip(self.params, self.masters)):
                p.copy_(m)
                m.grad = None
                self._versions[i] = p._version

    def state_dict(self) -> dict[str, Any]:
        self.follow_params()
        return {"masters": [m.detach() for m in self.masters]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for m, saved in zip(self.masters, state["masters"]):
                m.copy_(saved)
