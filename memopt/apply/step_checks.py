"""What ``Wrapped.step`` checks before a step changes anything, each in one line: a caller under
``torch.inference_mode()`` (no tensor made there can take part in a backward pass), a wrapper already closed or
unwrapped, parameters that require grad but that no param group of memopt's optimizer holds (a backbone unfrozen after
the wrap: they would never train, their gradients piling up), and what the script does to the optimizer it passed to
``memopt.wrap``, which memopt only built its own from: a learning rate it keeps writing there (a warning, once), and a
state loaded into it (``opt.load_state_dict``, the usual resume line), refused once, since the moments and step
counts it loads would be ignored and the run would go on from other ones.

The checks run every step, so they read little: the parameters the model had when last looked at and their
``requires_grad`` flags, the optimizer's parameter count, and a process-wide count of parameter and submodule
registrations (a head added after the wrap). The model is walked again only when one of those changed.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from memopt.errors import InputError

__all__ = ["StepChecks", "refuse_inference_mode"]

#: parameters and submodules registered on any module of the process so far (``[count]``), once a wrapper watches
_registrations: list[int] = []


def _registered(*_: Any) -> None:
    _registrations[0] += 1


def _watch_registrations() -> None:
    """Count every parameter and submodule registered from now on (two process-wide hooks, installed once; they
    return None, so nothing registered is changed)."""
    if not _registrations:
        _registrations.append(0)
        register_module_parameter_registration_hook(_registered)
        register_module_module_registration_hook(_registered)


def refuse_inference_mode(where: str) -> None:
    """One line when ``where`` (the call that trains or plans training) runs under ``torch.inference_mode()``."""
    if torch.is_inference_mode_enabled():
        raise InputError([f"{where} was called under torch.inference_mode(), where no tensor can take part in a "
                          "backward pass, so no training step can run: call it outside inference_mode (inside "
                          "torch.no_grad() is fine: memopt turns gradients on for its own passes)"])


def _hyper_parameters(opt: Any) -> list[dict[str, Any]]:
    """Each param group's plain hyper-parameters (a tensor learning rate is left out: reading it could sync a GPU)."""
    return [{k: v for k, v in g.items() if k != "params" and isinstance(v, (bool, int, float, str, tuple))}
            for g in opt.param_groups]


class StepChecks:
    """The checks of one wrapper, with what they remember between steps. ``optimizer`` is wrap's optimizer argument:
    a recipe built from the user's optimizer instance carries that instance as ``built_from``
    (``memopt.techniques.optimizer_instance.optimizer_factory``), whose hyper-parameters are watched."""

    def __init__(self, model: nn.Module, optimizer: Any) -> None:
        _watch_registrations()
        self.unwrapped = False  # unwrap() gave the model back: the optimizer state went with the techniques
        self.closed = False  # close() ended the run: its telemetry and calibration are final
        self._model = model
        self._source = getattr(optimizer, "built_from", None)
        self._source_hp = _hyper_parameters(self._source) if self._source is not None else None
        # load_state_dict gives an optimizer a new state dict object (as does any reset of it): its identity tells a
        # load apart at no cost, where comparing the states would read every moment
        self._source_state = self._source.state if self._source is not None else None
        self._seen: tuple[int, int, int] | None = None
        self._params: list[nn.Parameter] = []
        self._flags: list[bool] = []

    def require_wrapped(self) -> None:
        if self.unwrapped:
            # training on would re-plan and build a fresh optimizer: its state (moments, step count) lost silently
            raise ValueError("this memopt.wrap was unwrapped (unwrap() removed its techniques and its optimizer): "
                             "wrap the model again to train it, after save(dir) first if its optimizer state matters")

    def before_planning(self) -> None:
        """What refuses a step before it plans: inference mode, an unwrapped or closed wrapper."""
        refuse_inference_mode("wrapped.step")
        self.require_wrapped()
        if self.closed:
            raise ValueError("this memopt.wrap was closed (close() ends the run: telemetry flushed, the calibration "
                             "stored, OOM recovery released) and trains no more: call close() after the last step; "
                             "to train on, save(path) it, then unwrap(), wrap the model again and load(path)")

    def before_step(self, optimizer: torch.optim.Optimizer, master: Any = None, *, stacklevel: int = 4) -> None:
        """Refuse parameters the step would not train, and (once) a state loaded into the user's optimizer; warn
        (once) of hyper-parameters set on it. ``master``: the fp32 masters (``MasterWeights``) the optimizer holds in
        place of the bf16 weights. ``stacklevel``: the script's line for the warning (4: above ``Wrapped.step`` and
        the enable_grad decorator around it)."""
        key = (_registrations[0], id(optimizer), sum(len(g["params"]) for g in optimizer.param_groups))
        if key != self._seen or [p.requires_grad for p in self._params] != self._flags:
            self._check_trainable(optimizer, master)
            self._seen = key
        if self._source_state is not None and self._source.state is not self._source_state:
            self._source_state = None  # refused once: a step retried after loading where it trains goes on
            self._source_hp = None if self._source_hp is None else _hyper_parameters(self._source)
            raise InputError(["the optimizer passed to memopt.wrap had a state loaded since the wrap "
                              "(opt.load_state_dict?), but memopt trains with its own optimizer, built from it at the "
                              "wrap, so the loaded moments and step counts would be ignored: load it with "
                              "wrapped.optimizer.load_state_dict(...) instead (or into the optimizer before "
                              "memopt.wrap; a memopt checkpoint with wrapped.load(path))"])
        if self._source_hp is not None and _hyper_parameters(self._source) != self._source_hp:
            self._source_hp = None  # warned once
            warnings.warn("the optimizer passed to memopt.wrap had its param_groups changed since the wrap (a "
                          "learning rate set by hand?), but memopt trains with its own optimizer, built from it at "
                          "the wrap: set them on wrapped.optimizer.param_groups instead (or pass "
                          "lr_scheduler=<scheduler>)", UserWarning, stacklevel=stacklevel)

    def _check_trainable(self, optimizer: torch.optim.Optimizer, master: Any) -> None:
        named = list(self._model.named_parameters())
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if master is not None:
            held |= {id(p) for p, m in zip(master.params, master.masters) if id(m) in held}
        missing = [name for name, p in named if p.requires_grad and id(p) not in held]
        if missing:
            names = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            raise InputError([f"{len(missing)} parameter tensor(s) of the model require grad but no param group of "
                              f"wrapped.optimizer holds them ({names}: frozen when memopt built its optimizer, or "
                              "added since), so no step would train them: add them with "
                              "wrapped.optimizer.add_param_group({'params': [...]}), freeze them with "
                              "requires_grad_(False), or unwrap() and wrap the model again"])
        self._params = [p for _, p in named]
        self._flags = [p.requires_grad for p in self._params]
