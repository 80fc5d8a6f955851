"""A prepared model's training state carried to the same model under another strategy: the optimizer state (same
optimizer kind), fp32 master weights, gradient scaler, LR scheduler and step counter, held on the host in between
(an OOM re-plan, ``memopt.guard.reapply``; the autotune's plan, ``memopt.apply.wrapped_autotune``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memopt.step.prepare import Prepared, prepare
from memopt.strategy import Strategy

__all__ = ["HeldState", "hold_state", "prepare_holding"]

log = logging.getLogger(__name__)


def _to_host(obj: Any) -> Any:
    """A state dict with its device tensors copied to host memory (host tensors are kept as they are)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True) if obj.device.type != "cpu" else obj
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_host(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_host(v) for v in obj)
    return obj


@dataclass
class HeldState:
    """A prepared model's training state on the host: what a re-applied plan carries over (``hold_state``)."""

    optimizer_name: str
    optimizer: dict[str, Any]
    masters: list[torch.Tensor] | None
    lr_scheduler: dict[str, Any] | None
    scaler: dict[str, Any] | None
    steps_done: int

    def load_into(self, new: Prepared) -> None:
        """Into ``new`` (the same model under another plan); the optimizer state only where ``new`` runs the same
        optimizer (another one's state has another layout: it starts afresh, with a warning)."""
        if self.masters is not None and new.step.master is not None:
            new.step.master.load_state_dict({"masters": self.masters})
        if new.step.strategy.optimizer == self.optimizer_name:
            new.optimizer.load_state_dict(self.optimizer)
        else:
            log.warning("optimizer changed from %s to %s: its state starts afresh", self.optimizer_name,
                        new.step.strategy.optimizer)
        if self.lr_scheduler is not None and new.step.lr_scheduler is not None:
            new.step.lr_scheduler.load_state_dict(self.lr_scheduler)
        if self.scaler is not None and new.step.scaler is not None and hasattr(new.step.scaler, "load_state_dict"):
            new.step.scaler.load_state_dict(self.scaler)
        new.step.steps_done = self.steps_done


def hold_state(prepared: Prepared) -> HeldState:
    """``prepared``'s optimizer state (then cleared on the device), master weights, gradient scaler, LR scheduler
    and step counter, copied to the host: the device never holds two plans' optimizer states and master weights
    at once (the next plan's load from the host copies)."""
    old = prepared.step
    held = HeldState(
        optimizer_name=old.strategy.optimizer, optimizer=_to_host(prepared.optimizer.state_dict()),
        masters=[m.detach().to("cpu", copy=True) for m in old.master.state_dict()["masters"]]
        if old.master is not None else None,
        lr_scheduler=old.lr_scheduler.state_dict() if old.lr_scheduler is not None else None,
        scaler=old.scaler.state_dict() if old.scaler is not None and hasattr(old.scaler, "state_dict") else None,
        steps_done=old.steps_done)
    prepared.optimizer.state.clear()
    return held


def prepare_holding(model: nn.Module, strategy: Strategy, held: HeldState, **prepare_kwargs: Any) -> Prepared:
    """``prepare`` with ``held`` loaded into what it built, all or nothing: a load that fails undoes the plan."""
    new: Prepared = prepare(model, strategy, **prepare_kwargs)
    try:
        held.load_into(new)
    except BaseException:
        new.undo()
        raise
    return new
