"""bitsandbytes' block-wise 8-bit AdamW, plain and paged: the optimizers of the ``8bit_optimizer`` fidelity class.

Tensors of fewer than 4096 values keep two fp32 states; larger ones two uint8 states plus an fp32 absmax per 256
values each, and the two 256-entry fp32 quantization maps exist once. The paged variant puts the state buffers of
tensors with at least 100,000 values in paged (unified) memory, outside the caching allocator and its cap; their
absmax values and smaller tensors' states stay on the device. bitsandbytes' constructor calls ``.tolist()``, so a
fake-tensor trace steps ``Fake8bitAdamW``, which allocates the same layout and skips the math.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from memopt.techniques.bitsandbytes_import import bitsandbytes
from memopt.techniques.optimizer_variant import HALF_AND_SINGLE, OptimizerVariant, StandInOptimizer
from memopt.units import allocator_size

__all__ = ["BNB_BLOCKSIZE", "BNB_MIN_8BIT_SIZE", "BNB_MIN_PAGED_SIZE", "VARIANTS", "Fake8bitAdamW"]

BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes keeps fp32 optimizer states for smaller tensors
BNB_BLOCKSIZE = 256  # 8-bit optimizer states: one fp32 absmax per 256 values
BNB_MIN_PAGED_SIZE = 100_000  # paged optimizers page only state buffers of tensors this large
_INSTALL = "pip install 'memopt[bnb]'"


def _build(paged: bool) -> Any:
    def build(params: Any, **options: Any) -> torch.optim.Optimizer:
        bnb = bitsandbytes(f"optimizer {'paged_adamw8bit' if paged else 'adamw8bit'!r}")
        cls = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit
        return cls(params, **options)

    return build


def _state_bytes(paged: bool) -> Any:
    def state_bytes(numels: Sequence[int], dtype: torch.dtype, rounded: bool) -> tuple[int, int]:
        r = allocator_size if rounded else (lambda n: n)
        device = on_pages = 0
        any_8bit = False
        for n in numels:
            paged_here = paged and n >= BNB_MIN_PAGED_SIZE
            if n < BNB_MIN_8BIT_SIZE:
                state = 2 * r(n * 4)
                if paged_here:
                    on_pages += state
                else:
                    device += state
                continue
            any_8bit = True
            device += 2 * r(-(-n // BNB_BLOCKSIZE) * 4)
            if paged_here:
                on_pages += 2 * n
            else:
                device += 2 * r(n)
        if any_8bit:
            device += 2 * r(256 * 4)
        return device, on_pages

    return state_bytes


def _floor(numels: Sequence[int], item: int) -> int:
    """Two one-byte states a parameter (smaller tensors keep fp32 ones: more)."""
    return sum(allocator_size(n * 2) for n in numels)


class Fake8bitAdamW(StandInOptimizer):
    """bitsandbytes AdamW8bit's state layout (block-wise), allocated on the first step; no math."""

    stepped = ("state1", "state2")

    def __init__(self, params: Any, paged: bool = False, state_device: str | None = None, **defaults: Any) -> None:
        super().__init__(params, **defaults)
        self.paged = paged
        self.state_device = state_device  # paged states live outside the allocator (host/unified memory)
        self.qmaps: dict[str, torch.Tensor] = {}

    def init_state(self, p: torch.Tensor, state: dict[str, Any]) -> None:
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


def _stand_in(paged: bool) -> Any:
    return lambda params, state_device, **options: Fake8bitAdamW(params, paged=paged, state_device=state_device,
                                                                 **options)


VARIANTS = tuple(
    OptimizerVariant(name, summary, "8bit_optimizer", _build(paged), _state_bytes(paged), _floor, 0.5,
                     requires="bitsandbytes", install=_INSTALL, offered=True, trace_stand_in=_stand_in(paged),
                     trainer_optim=trainer, paged=paged, param_dtypes=HALF_AND_SINGLE)
    for name, summary, paged, trainer in (
        ("adamw8bit", "bitsandbytes AdamW8bit, block-wise 8-bit states", False, "adamw_bnb_8bit"),
        ("paged_adamw8bit", "bitsandbytes PagedAdamW8bit, its states in paged (unified) memory", True,
         "paged_adamw_8bit"),
    ))
