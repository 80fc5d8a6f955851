"""The GradScaler of an fp16 plan, seen from a hand-written loop (``wrapped.backward`` / ``wrapped.optimizer_step``).

memopt's own step scales every micro-batch's loss, accumulates the scaled gradients and unscales them once, in
``optimizer_step``. A hand-written loop reads the gradients between ``backward`` and ``optimizer_step`` (clipping,
a grad-norm log), where a torch AMP loop calls ``scaler.unscale_(optimizer)`` first; the loop cannot, as the scaler
is memopt's. So the hand-written ``backward`` unscales before it returns (``TrainStep.backward_unscaled``), and
``optimizer_step`` does not unscale again: ``scaler.step`` then skips the update when that unscale found an inf or
NaN, as in torch's loop. A second ``backward`` before the optimizer step (accumulating by hand) multiplies the
unscaled gradients back by the scale first, so the sum is unscaled once, as torch's loop unscales it; the scale is a
power of two, so the round trip is exact, and an inf or NaN stays one.

Whether ``unscale_`` ran since the last ``update`` is the scaler's own per-optimizer stage (private to
``torch.amp.GradScaler``; the stand-in scaler of a trace has none, and is never unscaled ahead).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["forget_unscale", "grads_unscaled", "rescale_"]


def _stages(scaler: Any) -> dict[int, dict[str, Any]] | None:
    return getattr(scaler, "_per_optimizer_states", None)


def grads_unscaled(scaler: Any, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``scaler.unscale_(optimizer)`` ran since the scaler's last ``update``."""
    stages = _stages(scaler)
    if stages is None:
        return False
    from torch.amp.grad_scaler import OptState

    state = stages.get(id(optimizer))  # .get: the defaultdict would record a stage for an optimizer never unscaled
    return state is not None and state.get("stage") is OptState.UNSCALED


def forget_unscale(scaler: Any, optimizer: torch.optim.Optimizer) -> None:
    """The scaler's stage for ``optimizer`` back to ready: the gradients that ``unscale_`` divided are gone (cleared,
    or multiplied back by ``rescale_``), and the next ones are to be unscaled again."""
    stages = _stages(scaler)
    if stages is not None:
        stages.pop(id(optimizer), None)


@torch.no_grad()
def rescale_(scaler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Multiply the gradients ``unscale_`` divided back by the scale, and mark them scaled."""
    grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                grads.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
    for (device, _), same in grads.items():
        # scaler.scale(1) is the scale as a tensor on the gradients' device, without reading it back to the host
        scale = scaler.scale(torch.ones((), dtype=torch.float32, device=device))
        torch._foreach_mul_(same, scale)
    forget_unscale(scaler, optimizer)
