"""A ``Strategy``: one complete choice of techniques for a training run (what a plan applies).

Each field is owned by one technique module under ``memopt/techniques``; the planner enumerates
strategies, the estimator predicts their memory and time, ``wrap`` applies one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["ATTENTION_BACKENDS", "CE_KERNELS", "PRECISIONS", "Checkpointing", "Strategy", "register_labeller"]

Precision = Literal["fp32", "bf16_autocast", "fp16_autocast", "bf16_master", "bf16_pure"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16_autocast", "fp16_autocast", "bf16_master", "bf16_pure")
CE_KERNELS: tuple[str, ...] = ("memopt", "liger")
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "flash", "efficient", "cudnn", "math", "flash_attn")
CheckpointMode = Literal["none", "full", "selective"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Checkpointing:
    """Activation checkpointing: which blocks, and what they keep.

    mode "full" recomputes the whole block in backward; "selective" keeps the outputs of matmuls and
    attention and recomputes the cheap ops between them. ``num_blocks`` blocks (of each stack) are
    checkpointed, spread evenly (all of them when None): with 32 blocks, 16 is "every 2nd block".
    """

    mode: CheckpointMode = "none"
    num_blocks: int | None = None

    def blocks(self, total: int) -> list[int]:
        """Indices (0-based) of the checkpointed blocks in a stack of ``total`` blocks."""
        if self.mode == "none" or total == 0:
            return []
        n = total if self.num_blocks is None else max(0, min(self.num_blocks, total))
        if n == 0:
            return []
        # evenly spread: block i is checkpointed when floor((i+1)*n/total) > floor(i*n/total)
        return [i for i in range(total) if ((i + 1) * n) // total > (i * n) // total]

    def count(self, total: int) -> int:
        """How many blocks of a stack of ``total`` are checkpointed."""
        return len(self.blocks(total))

    def label(self) -> str:
        if self.mode == "none" or self.num_blocks == 0:
            return "none"
        return self.mode if self.num_blocks is None else f"{self.mode}[{self.num_blocks}]"


@dataclass(frozen=True, kw_only=True, slots=True)
class Strategy:
    """Everything a plan decides. Defaults are the do-nothing choices (fp32, nothing saved, one micro-batch)."""

    precision: Precision = "fp32"
    checkpointing: Checkpointing = field(default_factory=Checkpointing)
    activation_offload: bool = False
    attention: str = "auto"
    chunked_ce: int = 0  # number of chunks for a fused linear + cross-entropy head; 0 = off
    # the fused head's kernel: memopt's chunked loss ("memopt") or Liger-kernel's ("liger", CUDA only, its own
    # chunks: chunked_ce > 0 only switches it on)
    ce_kernel: str = "memopt"
    optimizer: str = "adamw_fused"  # a name of memopt.techniques.optimizers (their registry), or "user"
    micro_batch_size: int = 1
    grad_accum_steps: int = 1
    expandable_segments: bool = True
    # room for later techniques (sharding, offload, quantization, adapters): name -> settings
    extras: tuple[tuple[str, Any], ...] = ()

    def replace(self, **changes: Any) -> Strategy:
        return dataclasses.replace(self, **changes)

    def extra(self, name: str, default: Any = None) -> Any:
        return dict(self.extras).get(name, default)

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["checkpointing"] = dataclasses.asdict(self.checkpointing)
        d["extras"] = {k: v for k, v in self.extras}
        if d["ce_kernel"] == "memopt":  # written only when chosen: a plan saved before the field reads the same
            del d["ce_kernel"]
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Strategy:
        data = dict(data)
        data["checkpointing"] = Checkpointing(**data.get("checkpointing", {}))
        extras = data.get("extras", {})
        data["extras"] = tuple(sorted(extras.items())) if isinstance(extras, dict) else tuple(extras)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown strategy fields {unknown}; valid fields: {sorted(known)}")
        return cls(**data)

    def label(self) -> str:
        """A short label naming every choice, for plan tables and logs: each technique writes its own part
        (``memopt.techniques.registry.strategy_label``, which that module registers)."""
        if _labeller is None:
            raise RuntimeError("no strategy labeller is registered: import memopt (or memopt.techniques.registry)")
        return _labeller(self)


# Each technique's label lives with the technique, in a layer above this one: the techniques' registry registers
# the function that joins them, so this module imports nothing of memopt.
_labeller: Callable[[Strategy], str] | None = None


def register_labeller(labeller: Callable[[Strategy], str]) -> None:
    """Make ``Strategy.label()`` call ``labeller`` (the techniques' registry does, when it is imported)."""
    global _labeller
    _labeller = labeller
