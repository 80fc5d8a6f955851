"""Phase markers: which block of the model each allocation belongs to, forward and backward.

Forward pre/post hooks on every block mark where a block's forward begins and ends. In backward, a
gradient hook on a block's output marks where its backward begins, and one on its input where it
ends. One tensor is usually both (block ``i-1``'s output is block ``i``'s input): its gradient marks
the start of block ``i-1``'s backward, which wins over "block ``i`` ended"; only when no block starts
there (the embedding below block 0, or code between blocks) does an end mark open a gap phase.

Phases: ``fwd:s0.b3`` (forward of block 3 of stack 0), ``fwd:s0.b3.x`` (after it, before block 4),
``fwd:gap.s0`` (after the last block), ``bwd:s0.b3``, ``bwd:s0.b2.x`` (after block 3's backward, before
block 2's), ``bwd:gap.s0`` (after block 0's backward).
"""

from __future__ import annotations

import weakref
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
    # tensor id -> its labels; no strong reference, so the markers never keep an activation alive
    labels: dict[int, dict[str, tuple[int, int]]] = {}

    def fire(tensor_labels: dict[str, tuple[int, int]]) -> None:
        if "start" in tensor_labels:
            s, i = tensor_labels["start"]
            set_phase(f"bwd:s{s}.b{i}")
        elif "end" in tensor_labels:
            s, i = tensor_labels["end"]
            set_phase(f"bwd:gap.s{s}" if i == 0 else f"bwd:s{s}.b{i - 1}.x")

    def attach(t: torch.Tensor, kind: str, s: int, i: int) -> None:
        entry = labels.get(id(t))
        if entry is None:
            entry = {}
            labels[id(t)] = entry
            weakref.finalize(t, labels.pop, id(t), None)
            t.register_hook(lambda g, entry=entry: fire(entry))
        entry[kind] = (s, i)

    for s, stack in enumerate(stacks):
        last = len(stack) - 1
        for i, block in enumerate(stack.blocks):
            def pre(module: Any, args: Any, kwargs: Any, s: int = s, i: int = i) -> None:
                set_phase(f"fwd:s{s}.b{i}")
                if torch.is_grad_enabled():
                    inp = _first_grad_tensor((args, kwargs))
                    if inp is not None:
                        attach(inp, "end", s, i)

            def post(module: Any, args: Any, kwargs: Any, output: Any, s: int = s, i: int = i) -> None:
                set_phase(f"fwd:gap.s{s}" if i == last else f"fwd:s{s}.b{i}.x")
                if torch.is_grad_enabled():
                    out = _first_grad_tensor(output)
                    if out is not None:
                        attach(out, "start", s, i)

            handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(block.register_forward_hook(post, with_kwargs=True))

    def remove() -> None:
        for h in handles:
            h.remove()

    return remove
