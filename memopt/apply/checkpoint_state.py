"""A one-GPU checkpoint of ``Wrapped``: the training state it holds (model, optimizer, fp32 masters, gradient scaler,
learning-rate schedule), written whole or not at all, read back and checked against the wrapped model before
anything is loaded: a checkpoint that fails half-way through loading would leave new weights beside the old
optimizer state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from memopt.step.prepare import Prepared

__all__ = ["read_checkpoint", "restore_training_state", "state_mismatch", "training_state", "write_checkpoint"]


def training_state(model: nn.Module, prepared: Prepared, **counters: Any) -> dict[str, Any]:
    """What a checkpoint holds of a prepared model besides ``counters`` (the steps done, the data position, the
    plan): the user's model and the optimizer, and the fp32 masters, gradient scaler and schedule where they exist."""
    step = prepared.step
    state = {"model": model.state_dict(), "optimizer": prepared.optimizer.state_dict(), **counters}
    if step.master is not None:
        state["master_weights"] = step.master.state_dict()
    if step.scaler is not None and hasattr(step.scaler, "state_dict"):
        state["grad_scaler"] = step.scaler.state_dict()
    if step.lr_scheduler is not None:
        state["lr_scheduler"] = step.lr_scheduler.state_dict()
    return state


def restore_training_state(model: nn.Module, prepared: Prepared, state: dict[str, Any]) -> None:
    """Load ``training_state``'s dict into ``model`` and ``prepared``; nothing is loaded from another model's."""
    mismatch = state_mismatch(model, prepared.optimizer, state)
    if mismatch is not None:
        raise ValueError(f"this checkpoint was saved from another model or optimizer ({mismatch}): load it into "
                         "the model and optimizer it was saved from")
    step = prepared.step
    model.load_state_dict(state["model"])
    prepared.optimizer.load_state_dict(state["optimizer"])
    if "master_weights" in state and step.master is not None:
        step.master.load_state_dict(state["master_weights"])
    if "grad_scaler" in state and step.scaler is not None:
        step.scaler.load_state_dict(state["grad_scaler"])
    if "lr_scheduler" in state and step.lr_scheduler is not None:
        step.lr_scheduler.load_state_dict(state["lr_scheduler"])


def write_checkpoint(file: Path, state: dict[str, Any]) -> None:
    """``state`` into ``file`` through a temporary beside it, so that a save that fails never leaves a half-written
    checkpoint where the last good one was."""
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(file.suffix + ".tmp")
    torch.save(state, tmp)
    tmp.replace(file)


def read_checkpoint(file: Path) -> dict[str, Any]:
    """The state ``Wrapped.save`` wrote to ``file``; one-line errors for a file that is not one."""
    try:
        state = torch.load(file, weights_only=False)
    except Exception as exc:  # truncated, overwritten, or another format: the reason is torch's own
        raise ValueError(f"the memopt checkpoint {file} cannot be read ({type(exc).__name__}: {exc}): it is "
                         "truncated or not a file wrapped.save wrote; resume from another checkpoint") from exc
    if not isinstance(state, dict) or not {"model", "optimizer"} <= set(state):
        raise ValueError(f"{file} is not a memopt checkpoint (wrapped.save writes a dict holding 'model' and "
                         "'optimizer'); load a model's own state_dict with model.load_state_dict before memopt.wrap")
    return state


def _listed(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def state_mismatch(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> str | None:
    """Why ``state`` cannot be loaded into ``model`` and ``optimizer`` whole (None: it can): the parameters and
    buffers it names and their shapes, and the sizes of the optimizer's parameter groups."""
    mine = model.state_dict()
    theirs = state["model"]
    problems = []
    missing = [k for k in mine if k not in theirs]
    extra = [k for k in theirs if k not in mine]
    shapes = [f"{k} {tuple(theirs[k].shape)} vs {tuple(v.shape)}" for k, v in mine.items()
              if k in theirs and isinstance(theirs[k], torch.Tensor) and theirs[k].shape != v.shape]
    if missing:
        problems.append(f"it lacks {_listed(missing)}")
    if extra:
        problems.append(f"it has {_listed(extra)}, which the model has not")
    if shapes:
        problems.append(f"shapes differ: {_listed(shapes)}")
    groups = [len(g["params"]) for g in state["optimizer"].get("param_groups", [])]
    own = [len(g["params"]) for g in optimizer.param_groups]
    if not problems and groups != own:
        problems.append(f"its optimizer has parameter groups of {groups} parameters, this one {own}")
    return "; ".join(problems) or None
