"""Activation checkpointing on the model's repeated blocks (non-reentrant ``torch.utils.checkpoint``).

"full" keeps only each checkpointed block's inputs and recomputes the block in backward. "selective"
keeps the outputs of matmuls and attention kernels and recomputes the cheap element-wise ops between
them (PyTorch's selective activation checkpointing). Applying replaces each chosen block's
``forward`` with a checkpointed call of the original; the returned undo puts the original back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memopt.blocks import BlockStack
from memopt.profile.attention_kernels import SAVE_FOR_SELECTIVE_AC
from memopt.strategy import Checkpointing

__all__ = ["SELECTIVE_SAVE_OPS", "apply_checkpointing", "selective_policy"]

# matmuls and attention: expensive to recompute, so selective checkpointing keeps their outputs
SELECTIVE_SAVE_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_addmm_activation", "_grouped_mm",
                                *SAVE_FOR_SELECTIVE_AC})


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    name = getattr(getattr(op, "_overloadpacket", op), "__name__", str(op))
    if name in SELECTIVE_SAVE_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(selective_policy)


def _checkpointed(forward: Callable[..., Any], selective: bool, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    extra = {"context_fn": _selective_context} if selective else {}
    return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)


def apply_checkpointing(stacks: Sequence[BlockStack], setting: Checkpointing) -> Callable[[], None]:
    """Checkpoint the blocks ``setting`` names in every stack; returns the undo."""
    if setting.mode == "none":
        return lambda: None
    if setting.mode not in ("full", "selective"):
        raise ValueError(f"unknown checkpointing mode {setting.mode!r}; choose 'none', 'full' or 'selective'")
    wrapped: list[tuple[nn.Module, bool, Any]] = []
    for stack in stacks:
        for i in setting.blocks(len(stack)):
            block = stack.blocks[i]
            had_own = "forward" in block.__dict__
            previous = block.__dict__.get("forward")
            block.forward = functools.partial(_checkpointed, block.forward, setting.mode == "selective")
            wrapped.append((block, had_own, previous))

    def undo() -> None:
        for block, had_own, previous in wrapped:
            if had_own:
                block.forward = previous
            else:
                del block.forward

    return undo
