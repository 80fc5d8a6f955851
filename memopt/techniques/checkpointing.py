"""Activation checkpointing on the model's repeated blocks (non-reentrant ``torch.utils.checkpoint``).

"full" keeps only each checkpointed block's inputs and recomputes the block in backward. "selective"
keeps the outputs of matmuls and attention kernels and recomputes the cheap element-wise ops between
them (PyTorch's selective activation checkpointing). Applying replaces each chosen block's
``forward`` with a checkpointed call of the original; the returned undo puts the original back.

:func:`coarse_options` is the sharded planner's grid of checkpointing values (the single-GPU search's finer one is
the registry entry's ``options``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memopt.blocks import BlockStack, persistent_buffers
from memopt.strategy import Checkpointing
from memopt.techniques.model_change import ModelChange, Undo

__all__ = ["COARSE_FRACTIONS", "SELECTIVE_SAVE_OPS", "apply_checkpointing", "change_model", "checkpointing_refusal",
           "coarse_options", "selective_policy"]

# attention kernels by op name: CUDA's own, and the profile's emulations of them
# (memopt.profile.attention_kernels registers its ops under these names so the same policy applies when tracing)
ATTENTION_KERNEL_OPS = (
    "cuda_flash_attention", "cuda_efficient_attention", "cuda_cudnn_attention",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
)
# matmuls and attention: expensive to recompute, so selective checkpointing keeps their outputs
SELECTIVE_SAVE_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_addmm_activation", "_grouped_mm",
                                *ATTENTION_KERNEL_OPS})


#: the sharded planner's coarse grid: full checkpointing of all, 3/4, 1/2 and 1/4 of the blocks. It is coarser than
#: the single-GPU search's eighths because the sharded planner evaluates each point for every engine setting and
#: micro-batch, then bisects between the coarse points that fit and those that do not (memopt.plan.sharded)
COARSE_FRACTIONS = (1.0, 0.75, 0.5, 0.25)


def coarse_options(n_blocks: int, fractions: Sequence[float] = COARSE_FRACTIONS) -> list[Checkpointing]:
    """No checkpointing, then full checkpointing of ``floor(f * n_blocks)`` blocks of a stack of ``n_blocks`` for each
    fraction ``f`` in ``fractions``, most blocks first, without repeats or zero (all of them as ``num_blocks=None``).
    The default fractions are exact in binary, so the counts are ``n``, ``3n // 4``, ``n // 2`` and ``n // 4``."""
    counts = sorted({int(n_blocks * f) for f in fractions} - {0}, reverse=True)
    return [Checkpointing(mode="none")] + [Checkpointing(mode="full", num_blocks=None if k == n_blocks else k)
                                           for k in counts]


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    name = getattr(getattr(op, "_overloadpacket", op), "__name__", str(op))
    if name in SELECTIVE_SAVE_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(selective_policy)


def _state_buffers(block: nn.Module) -> list[torch.Tensor]:
    """The block's persistent buffers (state a forward may update); non-persistent ones are constants (masks,
    rotary frequencies) that no forward writes."""
    return list(persistent_buffers(block).values())


@contextlib.contextmanager
def _snapshotting(buffers: list[torch.Tensor], written: dict[int, torch.Tensor], inner: Any) -> Iterator[None]:
    """Around the forward pass: the state buffers the forward writes in place (their version moves: a spectral
    norm's power-iteration vectors) are kept as the forward found them, in ``written``, since the forward read them:
    its recomputation must start from the same state to compute the same values. Cloned outside selective
    checkpointing's dispatch mode, whose cache would otherwise take the copies."""
    before = [(b, b._version, b.clone()) for b in buffers]
    with inner:
        yield
    for b, version, value in before:
        if b._version != version:
            written[id(b)] = value


@contextlib.contextmanager
def _restoring(buffers: list[torch.Tensor], written: dict[int, torch.Tensor], inner: Any) -> Iterator[None]:
    """Around the recomputation: the buffers the forward wrote start as the forward found them, and afterwards every
    state buffer is put back as the forward pass left them (BatchNorm's running statistics, or any buffer a forward
    updates in place, would otherwise be updated twice per step), also when the recomputation stops early. Entered
    outside selective checkpointing's dispatch mode, as the snapshot is."""
    # every state buffer, not only those whose version moved: kernels such as batch norm update their running
    # statistics in place without bumping the version counter
    saved = [(b, b.clone()) for b in buffers]
    with torch.no_grad():
        for b in buffers:
            if id(b) in written:
                b.copy_(written[id(b)])
    try:
        with inner:
            yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


def _contexts(buffers: list[torch.Tensor], selective: bool) -> Callable[[], tuple[Any, Any]]:
    """checkpoint's ``context_fn``: (context of the forward pass, context of the recomputation)."""

    def make() -> tuple[Any, Any]:
        forward_ctx, recompute_ctx = (_selective_context() if selective
                                      else (contextlib.nullcontext(), contextlib.nullcontext()))
        if not buffers:
            return forward_ctx, recompute_ctx
        written: dict[int, torch.Tensor] = {}  # this call's: what its forward found in the buffers it wrote
        return _snapshotting(buffers, written, forward_ctx), _restoring(buffers, written, recompute_ctx)

    return make


class _CheckpointedForward(functools.partial):
    """A block's forward under checkpointing: ``partial(_checkpointed, forward, contexts)``. A copy of the block
    (``copy.deepcopy``: an EMA of the model) or a pickle of it (``torch.save(model)``) gets the block's own forward:
    checkpointing is the wrapped run's, which the copy is not part of (and its contexts cannot be pickled)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return copy.deepcopy(self.args[0], memo)  # a bound forward is bound to the block's copy

    def __reduce__(self) -> tuple[Any, ...]:
        return self.args[0].__reduce__()


def _checkpointed(forward: Callable[..., Any], context_fn: Callable[[], tuple[Any, Any]], *args: Any,
                  **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def checkpointing_refusal(model: nn.Module) -> str | None:
    """Why recomputing this model's blocks would not be exact (None: it would): peft's prefix tuning hands every
    attention layer its virtual tokens as a key/value cache that the layer appends its own keys and values to, so a
    recomputed block would append them a second time and attend over other keys than its first pass did."""
    if not type(model).__module__.startswith("peft."):
        return None
    config = getattr(model, "active_peft_config", None)
    kind = getattr(getattr(config, "peft_type", None), "value", getattr(config, "peft_type", None))
    if kind in ("PREFIX_TUNING", "CARTRIDGE"):
        return (f"peft {str(kind).lower()} gives each attention layer its virtual tokens as a key/value cache the "
                "layer appends to, so a recomputed block would append its keys and values twice")
    return None


def change_model(change: ModelChange) -> Undo:
    """Checkpointing's change: the planned blocks of every stack recompute their forward in backward."""
    setting = change.strategy.checkpointing
    why = checkpointing_refusal(change.model) if setting.mode != "none" else None
    if why is not None:
        raise ValueError(f"activation checkpointing refused: {why}; use checkpointing mode 'none'")
    if setting.mode != "none" and not change.stacks:
        raise ValueError("activation checkpointing needs repeated blocks (an nn.ModuleList, nn.Sequential or "
                         "nn.ModuleDict of two or more distinct layers of one class), and this model has none; use "
                         "checkpointing mode 'none'")
    return apply_checkpointing(change.stacks, setting)


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
            contexts = _contexts(_state_buffers(block), setting.mode == "selective")
            block.forward = _CheckpointedForward(_checkpointed, block.forward, contexts)
            wrapped.append((block, had_own, previous))

    def undo() -> None:
        for block, had_own, previous in wrapped:
            if had_own:
                block.forward = previous
            else:
                del block.forward

    return undo
