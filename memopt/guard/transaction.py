"""All-or-nothing optimizer steps: ``StepTransaction`` lets a step whose optimizer update ran out of memory be
retried (by ``OOMGuard`` and by ``memopt.integrations.trainer_optimizer_step``).

Atomicity of the optimizer step
-------------------------------
Forward and backward change nothing but gradients, which are discarded. The optimizer step changes
parameters and optimizer states in place, so an OOM inside it could leave them half-updated. The guard
finds out where the OOM happened: the train step's phase callback ("optimizer" is announced before
unscaling, clipping and the update) and hooks on the optimizer (``register_step_pre_hook`` /
``register_step_post_hook``) say whether ``optimizer.step()`` was entered or completed; inside it, the
traceback says whether the error came from the optimizer's state initialisation of its first parameter
group (``_init_group``: torch.optim creates every state of a group before updating any parameter, so
nothing was changed yet; the states it created are removed). In those cases no copy is needed.

Anything else inside the step (the update itself, a later group, the copy back to bf16 weights) needs a
pre-step copy: ``StepTransaction`` then restores parameters, master weights and optimizer states from
copies taken in the optimizer's pre-step hook, in pinned CPU memory. The copies are enqueued on the
current CUDA stream before the update kernels, so they cost one transfer of the parameters and optimizer
states over the host link per step (and as much pinned host memory) but no host synchronisation. Because
that is not free, they are taken only when the step is at risk: ``transaction="always"``, or ``"auto"``
(the default) when the plan predicts its peak inside the optimizer step, or once an OOM has hit an
optimizer step in this run. Without a copy, an OOM
that may have changed parameters is not retried: ``MemoptOOMError`` says so (never silently continue with
half-updated weights). Version counters were considered and rejected: fused AdamW and bitsandbytes kernels
do not bump them.
"""

from __future__ import annotations

import re
import traceback
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["StepTransaction"]


# -- the transaction ---------------------------------------------------------------------------------
_UPDATE_FN = re.compile(r"^_(single_tensor|multi_tensor|fused)_|^_fused|^adamw?$|^sgd$")


def _state_init_of_first_group(tb: Any, optimizer: torch.optim.Optimizer) -> bool:
    """The traceback ends in torch.optim's state initialisation of the optimizer's first parameter group,
    before any update function (torch.optim initialises a group's states before updating it)."""
    init_group = None
    for frame, _ in traceback.walk_tb(tb):
        code = frame.f_code
        if "torch/optim/" not in code.co_filename.replace("\\", "/"):
            continue
        if _UPDATE_FN.search(code.co_name):
            return False
        if code.co_name == "_init_group":
            init_group = frame
    if init_group is None:
        return False
    group = init_group.f_locals.get("group")
    return bool(optimizer.param_groups) and group is optimizer.param_groups[0]


def _copy(t: torch.Tensor, buf: torch.Tensor | None) -> torch.Tensor:
    if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
        pin = t.device.type == "cuda"
        buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    buf.copy_(t.detach(), non_blocking=buf.is_pinned())
    return buf


class StepTransaction:
    """Makes one optimizer step all-or-nothing (see the module docstring): knows whether the step was
    entered and completed, keeps pre-step copies when asked, and puts things back."""

    MODES = ("auto", "always", "never")

    def __init__(self, mode: str = "auto") -> None:
        self.mode = self.check_mode(mode)
        self.step: Any = None
        self._handles: list[Any] = []
        self._buffers: list[torch.Tensor | None] = []
        self.snapshot_bytes = 0
        self._reset()

    @classmethod
    def check_mode(cls, mode: str) -> str:
        if mode not in cls.MODES:
            raise ValueError(f"transaction={mode!r}: use one of {', '.join(cls.MODES)} (when parameters and "
                             "optimizer states are copied before an optimizer step, to undo an OOM inside it)")
        return mode

    def _reset(self) -> None:
        self.want_snapshot = False
        self.entered = False
        self.completed = False
        self.n_states_before: int | None = None
        self._saved: dict[str, Any] | None = None
        self._cheap: dict[str, Any] = {}

    def bind(self, step: Any) -> None:
        for h in self._handles:
            h.remove()
        self.step = step
        opt = step.optimizer
        self._handles = [opt.register_step_pre_hook(self._pre), opt.register_step_post_hook(self._post)]
        self._buffers = []

    def unbind(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def begin(self, *, at_risk: bool) -> None:
        """An attempt starts: note the cheap state (scaler, scheduler, step counter)."""
        self._reset()
        self.want_snapshot = self.mode == "always" or (self.mode == "auto" and at_risk)
        step = self.step
        scaler = getattr(step, "scaler", None)
        if scaler is not None and getattr(scaler, "_scale", None) is not None:
            self._cheap["scaler"] = (scaler._scale.clone(), scaler._growth_tracker.clone())
        sched = getattr(step, "lr_scheduler", None)
        if sched is not None:
            self._cheap["scheduler"] = sched.state_dict()
        self._cheap["steps_done"] = getattr(step, "steps_done", None)

    # -- optimizer hooks -------------------------------------------------------------------------
    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.want_snapshot:
            with _disable_current_modes():  # host copies: not device memory, not ops of the step
                self._snapshot(optimizer)
        self.n_states_before = len(optimizer.state)
        self.entered = True  # after the copy: an error inside it has changed nothing

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.completed = True

    def _params(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        master = getattr(self.step, "master", None)
        if master is not None:
            params = params + list(master.params)  # the bf16 weights that masters_to_params writes
        return params

    def _snapshot(self, optimizer: torch.optim.Optimizer) -> None:
        tensors: list[torch.Tensor] = self._params(optimizer)
        states: dict[Any, dict[str, Any]] = {}
        for p, st in optimizer.state.items():
            entry = {}
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    entry[k] = ("t", v, len(tensors))
                    tensors.append(v)
                else:
                    entry[k] = ("v", v, None)
            states[p] = entry
        while len(self._buffers) < len(tensors):
            self._buffers.append(None)
        copies = []
        for i, t in enumerate(tensors):
            self._buffers[i] = _copy(t, self._buffers[i])
            copies.append(self._buffers[i])
        self.snapshot_bytes = sum(b.numel() * b.element_size() for b in copies)
        self._saved = {"tensors": tensors, "copies": copies, "states": states, "keys": list(optimizer.state.keys())}

    # -- outcome ---------------------------------------------------------------------------------
    def classify(self, tb: Any) -> str:
        """Where an error raised now (with traceback ``tb``) left the step."""
        if self.completed:
            return "after_optimizer"
        if not self.entered:
            return "before_optimizer"
        if _state_init_of_first_group(tb, self.step.optimizer):
            return "optimizer_state_init"
        return "optimizer"

    def can_restore(self, location: str) -> bool:
        if location in ("before_optimizer", "optimizer_state_init", "peer"):
            return True
        return self._saved is not None

    def rollback(self, location: str) -> None:
        """Undo what the attempt changed (call ``can_restore`` first)."""
        step = self.step
        opt = step.optimizer
        if location == "optimizer_state_init" and self.n_states_before is not None:
            for p in list(opt.state.keys())[self.n_states_before:]:
                del opt.state[p]
        elif location in ("optimizer", "after_optimizer", "completed") and self._saved is not None:
            with _disable_current_modes():
                self._restore(opt)
        scaler = getattr(step, "scaler", None)
        if "scaler" in self._cheap:
            scale, growth = self._cheap["scaler"]
            scaler._scale.copy_(scale)
            scaler._growth_tracker.copy_(growth)
        if scaler is not None and hasattr(scaler, "_per_optimizer_states"):
            from torch.amp.grad_scaler import _refresh_per_optimizer_state

            scaler._per_optimizer_states.clear()
            scaler._per_optimizer_states.default_factory = _refresh_per_optimizer_state
        if "scheduler" in self._cheap:
            step.lr_scheduler.load_state_dict(self._cheap["scheduler"])
        if self._cheap.get("steps_done") is not None:
            step.steps_done = self._cheap["steps_done"]

    def _restore(self, opt: torch.optim.Optimizer) -> None:
        saved = self._saved
        with torch.no_grad():
            for t, c in zip(saved["tensors"], saved["copies"]):
                t.copy_(c, non_blocking=c.is_pinned())
        keys = set(map(id, saved["keys"]))
        for p in list(opt.state.keys()):
            if id(p) not in keys:
                del opt.state[p]
        for p, entry in saved["states"].items():
            opt.state[p] = {k: v for k, (_kind, v, _i) in entry.items()}

    def commit(self) -> None:
        self._saved = None
        self._cheap = {}
