"""Memory-equivalent stand-ins for pieces that cannot run on fake tensors.

``GradScaler.step`` reads ``found_inf.item()`` and bitsandbytes' linear layers quantize real weights: both need
real values. In a fake-tensor simulation they are replaced by stand-ins that allocate exactly what the originals
allocate on the GPU (same shapes, dtypes, order) and skip the math. (An optimizer that needs real values brings its
own stand-in: ``memopt.techniques.optimizer_variant``.)
"""

from __future__ import annotations

import torch

from memopt.profile.quant_stand_ins import stand_in_linear
from memopt.step.prepare import StandIns

__all__ = ["TRACE_STAND_INS", "FakeGradScaler"]


class FakeGradScaler:
    """GradScaler's memory: a scale and a found-inf flag per device; unscaling is in place."""

    def __init__(self, device: str) -> None:
        self._scale = torch.full((), 65536.0, dtype=torch.float32, device=device)
        self._found_inf = torch.zeros((), dtype=torch.float32, device=device)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale.to(loss.dtype)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        inv = self._scale.double().reciprocal().float()
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, self._found_inf, inv)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def update(self) -> None:
        pass


# what a traced step (memopt.step.prepare) runs in place of the real pieces
TRACE_STAND_INS = StandIns(grad_scaler=FakeGradScaler, quantized_linear=stand_in_linear)
