"""Phase markers: which block of the model each allocation belongs to, forward and backward.

Forward pre/post hooks on every block mark where a block's forward begins and ends; gradient hooks on
a block's output mark where its backward begins, and on its input where its backward ends. Phases are
named ``fwd:pre``, ``fwd:s0.b3``, ``fwd:gap.s0``, ``fwd:post``, ``bwd:post``, ``bwd:s0.b3``,
``bwd:gap.s0`` (after block 0 of stack 0 in backward: the embedding's backward), ...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from memopt.blocks import BlockStack

__all__ = ["install_markers"]


def _first_grad_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value if value.requires_grad else None
    if isinstance(value, (tuple, list)):
        for v in value:
            t = _first_grad_tensor(v)
            if t is not None:
                return t
    if isinstance(value, dict):
        for v in value.values():
            t = _first_grad_tensor(v)
            if t is not None:
                return t
    if hasattr(value, "to_tuple"):
        return _first_grad_tensor(value.to_tuple())
    return None


def install_markers(stacks: list[BlockStack], set_phase: Callable[[str], None]) -> Callable[[], None]:
    """Hook every block of ``stacks`` so ``set_phase`` is called at each boundary; returns the remover."""
    handles: list[RemovableHandle] = []

    for s, stack in enumerate(stacks):
        last = len(stack) - 1
        for i, block in enumerate(stack.blocks):
            def pre(module: Any, args: Any, kwargs: Any, s: int = s, i: int = i) -> None:
                set_phase(f"fwd:s{s}.b{i}")
                if not torch.is_grad_enabled():
                    return
                inp = _first_grad_tensor((args, kwargs))
                if inp is not None:
                    # the gradient of a block's input is complete when that block's backward is done
                    inp.register_hook(lambda g, s=s, i=i: set_phase(f"bwd:gap.s{s}" if i == 0 else f"bwd:s{s}.b{i-1}.x"))

            def post(module: Any, args: Any, kwargs: Any, output: Any, s: int = s, i: int = i) -> None:
                set_phase(f"fwd:gap.s{s}" if i == last else f"fwd:s{s}.b{i}.x")
                if not torch.is_grad_enabled():
                    return
                out = _first_grad_tensor(output)
                if out is not None:
                    out.register_hook(lambda g, s=s, i=i: set_phase(f"bwd:s{s}.b{i}"))

            handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(block.register_forward_hook(post, with_kwargs=True))

    def remove() -> None:
        for h in handles:
            h.remove()

    return remove
