"""Forward hooks that measure a step's model: bytes of its outputs and what each top module's forward left.

``Telemetry`` installs them on the model it follows (``record_outputs``, ``record_modules``): the per-module
figures are taken on the repeated blocks and the other top modules (:func:`top_modules`), so a record names
where a step's memory grew. ``ForwardHooksMixin`` holds these methods of ``Telemetry``; they read the
attributes ``Telemetry.__init__`` sets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from memopt.blocks import find_block_stacks, hookable

__all__ = ["ForwardHooksMixin", "top_modules"]


def top_modules(model: nn.Module, max_depth: int = 2) -> list[tuple[str, nn.Module]]:
    """The repeated blocks (``memopt.blocks``) and the deepest modules with parameters of depth <= ``max_depth``
    outside them (embeddings, final norm, head), in the model's order."""
    stacks = find_block_stacks(model)
    blocks = {id(b): s.block_name(i) for s in stacks for i, b in enumerate(s.blocks)}
    containers = [s.path for s in stacks]

    def related(name: str) -> bool:  # a block list, inside one, or an ancestor of one
        return any(name == c or name.startswith(c + ".") or c.startswith(name + ".") for c in containers)

    others = [(n, m) for n, m in model.named_modules()
              if n and n.count(".") < max_depth and not related(n) and any(True for _ in m.parameters())]
    names = [n for n, _ in others]
    keep = {n for n in names if not any(o.startswith(n + ".") for o in names)}
    out = []
    for n, m in model.named_modules():
        if (id(m) in blocks and n == blocks[id(m)]) or n in keep:
            out.append((n, m))
    return out



class ForwardHooksMixin:
    """``Telemetry``'s forward hooks on the model: outputs' bytes and each top module's forward."""

    def _install_hooks(self) -> None:
        if self._hooks or self.model is None or self.memory is None:
            return
        if self.record_outputs:
            self._hooks.append(self.model.register_forward_hook(self._output_hook))
        if self.record_modules:
            for name, module in top_modules(self.model):
                if not hookable(module):
                    continue
                self._hooks.append(module.register_forward_pre_hook(self._module_pre))
                self._hooks.append(module.register_forward_hook(self._module_post(name)))

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _output_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        self._output_bytes += self.memory.tensor_bytes(output)

    def _module_pre(self, module: nn.Module, args: Any) -> None:
        self._module_stack.append(self.memory.allocated_bytes())

    def _module_post(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            before = self._module_stack.pop() if self._module_stack else None
            if before is None or not (self._phase.startswith("forward") or not self._phase):
                return  # recomputation inside backward (checkpointing) is not the forward's memory
            self._module_bytes[name] = self._module_bytes.get(name, 0) + self.memory.allocated_bytes() - before
        return hook
