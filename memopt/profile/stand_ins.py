"""Memory-equivalent stand-ins for pieces that cannot run on fake tensors.

``GradScaler.step`` reads ``found_inf.item()`` and bitsandbytes' optimizers call ``.tolist()`` in their
constructors: both need real values. In a fake-tensor simulation they are replaced by stand-ins that
allocate exactly what the originals allocate on the GPU (same shapes, dtypes, order) and skip the math.
"""

from __future__ import annotations

from typing import Any

import torch

from memopt.profile.quant_stand_ins import stand_in_linear
from memopt.step.prepare import StandIns

__all__ = ["BNB_BLOCKSIZE", "BNB_MIN_8BIT_SIZE", "BNB_MIN_PAGED_SIZE", "TRACE_STAND_INS", "Fake8bitAdamW",
           "FakeGradScaler"]

BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes keeps fp32 states for smaller tensors
BNB_BLOCKSIZE = 256  # block-wise quantization: one fp32 absmax per 256 values
BNB_MIN_PAGED_SIZE = 100_000  # smaller state buffers are ordinary device tensors even when paged


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


class Fake8bitAdamW(torch.optim.Optimizer):
    """bitsandbytes AdamW8bit's state layout (block-wise), allocated on the first step; no math."""

    def __init__(self, params: Any, paged: bool = False, state_device: str | None = None, **defaults: Any) -> None:
        super().__init__(params, {"lr": defaults.get("lr", 1e-3)})
        self.paged = paged
        self.state_device = state_device  # paged states live outside the allocator (host/unified memory)
        self.qmaps: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                # the update reads and writes the weight, reads the gradient and rewrites both states: an
                # in-place op over those tensors costs the same memory traffic (and allocates nothing)
                torch.ops.aten.add_.Tensor(p, p.grad, alpha=0.0)
                torch.ops.aten.add_.Tensor(state["state1"], state["state1"])
                torch.ops.aten.add_.Tensor(state["state2"], state["state2"])
        return None

    def _init_state(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        # bitsandbytes pages only state buffers of tensors with >= 1e5 elements
        paged = self.paged and self.state_device is not None and p.numel() >= BNB_MIN_PAGED_SIZE
        device = self.state_device if paged else p.device
        if "dynamic" not in self.qmaps:
            self.qmaps["dynamic"] = torch.zeros(256, dtype=torch.float32, device=p.device)
            self.qmaps["udynamic"] = torch.zeros(256, dtype=torch.float32, device=p.device)
        state["step"] = 0
        if p.numel() < BNB_MIN_8BIT_SIZE:
            state["state1"] = torch.zeros(p.shape, dtype=torch.float32, device=device)
            state["state2"] = torch.zeros(p.shape, dtype=torch.float32, device=device)
            return
        blocks = -(-p.numel() // BNB_BLOCKSIZE)
        state["state1"] = torch.zeros(p.shape, dtype=torch.uint8, device=device)
        state["qmap1"] = self.qmaps["dynamic"]
        state["state2"] = torch.zeros(p.shape, dtype=torch.uint8, device=device)
        state["qmap2"] = self.qmaps["udynamic"]
        state["absmax1"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)
        state["absmax2"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)


# what a traced step (memopt.step.prepare) runs in place of the real pieces
TRACE_STAND_INS = StandIns(grad_scaler=FakeGradScaler, adamw8bit=Fake8bitAdamW, quantized_linear=stand_in_linear)
