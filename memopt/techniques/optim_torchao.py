"""torchao's low-bit AdamW: block-wise 8-bit and 4-bit states (``torchao.optim.AdamW8bit`` / ``AdamW4bit``).

Each state of a tensor of at least 4096 values (and a multiple of the block) is a tensor subclass of three
device tensors: the codes (one byte a value in 8 bits, half a byte in 4), an fp32 scale per block (256 values in
8 bits, 128 in 4) and its quantization map (256 or 16 fp32 entries, per state); smaller tensors keep two plain
states in the parameter dtype. The step count and the learning rate are CPU tensors. The update is one compiled
kernel per parameter, so a fake-tensor trace steps ``FakeLowBitAdamW``, which allocates the same layout and
skips the math. 8-bit states are the ``8bit_optimizer`` class (like bitsandbytes'); 4-bit states lose more than
bf16 states do, so they need ``lossy``. Not proposed by the planner unpinned until their time is measured
on a GPU (pin ``optimizer``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from memopt.techniques.optimizer_variant import HALF_AND_SINGLE, OptimizerVariant, StandInOptimizer
from memopt.units import allocator_size

__all__ = ["MIN_QUANTIZED", "VARIANTS", "FakeLowBitAdamW", "LowBitLayout"]

MIN_QUANTIZED = 4096  # torchao quantizes only states of tensors this large (as bitsandbytes does)
_INSTALL = "pip install 'memopt[torchao]'"


class LowBitLayout:
    """The layout of one low-bit state: bits per value, values per fp32 scale, entries of the quantization map."""

    def __init__(self, bits: int, block: int, qmap: int) -> None:
        self.bits, self.block, self.qmap = bits, block, qmap

    def quantized(self, numel: int) -> bool:
        return numel >= MIN_QUANTIZED and numel % self.block == 0

    def tensors(self, numel: int) -> tuple[tuple[int, torch.dtype], ...]:
        """(numel, dtype) of the device tensors one quantized state holds."""
        return ((numel * self.bits // 8, torch.uint8), (numel // self.block, torch.float32),
                (self.qmap, torch.float32))


_EIGHT, _FOUR = LowBitLayout(8, 256, 256), LowBitLayout(4, 128, 16)


def _build(cls_name: str) -> Any:
    def build(params: Any, **options: Any) -> torch.optim.Optimizer:
        try:
            import torchao.optim as tao
        except Exception as exc:
            raise ValueError(f"torchao's {cls_name} could not be imported ({type(exc).__name__}: {exc}): "
                             f"{_INSTALL}") from None
        return getattr(tao, cls_name)(params, **options)

    return build


def _state_bytes(layout: LowBitLayout) -> Any:
    def state_bytes(numels: Sequence[int], dtype: torch.dtype, rounded: bool) -> tuple[int, int]:
        r = allocator_size if rounded else (lambda n: n)
        size = torch.empty((), dtype=dtype).element_size()
        device = 0
        for n in numels:
            if layout.quantized(n):
                device += 2 * sum(r(count * torch.empty((), dtype=d).element_size()) for count, d in layout.tensors(n))
            else:
                device += 2 * r(n * size)
        return device, 0

    return state_bytes


def _floor(layout: LowBitLayout) -> Any:
    return lambda numels, item: 2 * sum(allocator_size(n * layout.bits // 8) for n in numels)


class FakeLowBitAdamW(StandInOptimizer):
    """torchao's low-bit AdamW state layout, allocated on the first step on the parameters' device; no math."""

    stepped = ("exp_avg", "exp_avg_sq")

    def __init__(self, params: Any, layout: LowBitLayout, state_device: str | None = None, **defaults: Any) -> None:
        super().__init__(params, **defaults)
        self.layout = layout

    def init_state(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        for name in self.stepped:
            state.update(self._new_state(name, p))

    def _new_state(self, name: str, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """One state as the tensors torchao's subclass holds (each its own entry: the trace counts state tensors)."""
        if not self.layout.quantized(p.numel()):
            return {name: torch.zeros_like(p)}
        codes, scale, qmap = (torch.zeros(count, dtype=dtype, device=p.device)
                              for count, dtype in self.layout.tensors(p.numel()))
        return {name: codes, f"{name}_scale": scale, f"{name}_qmap": qmap}


def _stand_in(layout: LowBitLayout) -> Any:
    return lambda params, state_device, **options: FakeLowBitAdamW(params, layout, state_device, **options)


VARIANTS = tuple(
    OptimizerVariant(name, summary, fidelity, _build(cls_name), _state_bytes(layout), _floor(layout),
                     layout.bits / 16, requires="torchao", install=_INSTALL, trace_stand_in=_stand_in(layout),
                     trainer_optim=trainer, param_dtypes=HALF_AND_SINGLE)
    for name, summary, fidelity, cls_name, layout, trainer in (
        ("torchao_adamw8bit", "torchao AdamW8bit, block-wise 8-bit states", "8bit_optimizer", "AdamW8bit", _EIGHT,
         "adamw_torch_8bit"),
        ("torchao_adamw4bit", "torchao AdamW4bit, block-wise 4-bit states", "lossy", "AdamW4bit", _FOUR,
         "adamw_torch_4bit"),
    ))
