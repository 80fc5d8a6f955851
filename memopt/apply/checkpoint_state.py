"""Reading a one-GPU checkpoint back, and checking that it belongs to the wrapped model before anything is loaded:
a checkpoint that fails half-way through loading would leave new weights beside the old optimizer state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["read_checkpoint", "state_mismatch"]


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
