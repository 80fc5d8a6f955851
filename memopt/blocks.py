"""Finding a model's repeated blocks: the natural units of checkpointing, offload and sharding.

A *stack* is an ``nn.ModuleList``, ``nn.Sequential`` or ``nn.ModuleDict`` of two or more children of one class, e.g.
``model.model.layers`` of a Llama, ``encoder.layer`` of BERT, or torchtitan's ``layers`` (a ``ModuleDict`` keyed by
layer id, "0" to "n-1", so that pipeline stages can drop layers without renumbering; a ``ModuleDict`` keyed by name,
of experts or task heads, is a collection the forward picks from, not a stack).
Stacks nested inside another stack's blocks are not reported.

A container that mixes other layers with its blocks (``nn.Sequential(embedding, *blocks, norm, head)``, torchvision's
MobileNet ``features``) holds a stack in each *run*: two or more consecutive distinct children of one class, each
a module of modules with parameters, none holding a stack of its own (a run of stages, each a stack of blocks, is
left to its stages' stacks; runs inside the blocks are not reported, as stacks inside a stack's blocks are not).
Such a stack's ``path`` names the run (``"net[1:5]"``); ``container_path`` the container. The fake copy traces a
run whole (a stack made of a whole container is cut to a few blocks).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize

__all__ = ["BlockStack", "block_signature", "find_block_stacks", "hookable", "module_class", "persistent_buffers",
           "scripted_stacks", "tied_parameter_groups"]

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


@dataclass(frozen=True)
class BlockStack:
    """One list of repeated blocks inside a model."""

    path: str  # dotted name of the list, e.g. "model.layers"; a run in a mixed container: "net[1:5]"
    parent: nn.Module
    attr: str
    blocks: tuple[nn.Module, ...]
    start: int | None = None  # a run's first position in its container; None: the blocks are the whole container

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def container_path(self) -> str:
        """The dotted name of the container that holds the blocks."""
        return self.path.partition("[")[0]

    def block_name(self, i: int) -> str:
        """The dotted name of block ``i`` of the stack."""
        index = str(i + (self.start or 0))
        return f"{self.container_path}.{index}" if self.container_path else index

    @property
    def block_class(self) -> str:
        return module_class(self.blocks[0]).__name__

    @property
    def uniform_tail(self) -> bool:
        """Blocks 1..N-1 share one signature (so tracing a few of them stands for all)."""
        if len(self.blocks) < 3:
            return True
        ref = block_signature(self.blocks[1])
        return all(block_signature(b) == ref for b in self.blocks[2:])


def persistent_buffers(model: nn.Module, skip: tuple[type, ...] = ()) -> dict[str, torch.Tensor]:
    """The persistent buffers by name (a shared one under its first name), outside modules of the ``skip`` types:
    the state a forward may update. Non-persistent buffers are constants (masks, rotary frequencies) or caches rebuilt
    from constants, which no forward's result depends on having been written."""
    found: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        if skip and isinstance(module, skip):
            continue
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set and id(b) not in seen:
                seen.add(id(b))
                found[f"{mod_name}.{name}" if mod_name else name] = b
    return found


def module_class(module: nn.Module) -> type:
    """The class a module was built as. ``torch.nn.utils.parametrize`` (``weight_norm``, ``spectral_norm``,
    ``orthogonal``) swaps each parametrized module's class for a fresh subclass of its own, so n weight-normed
    ``nn.Conv1d`` are n different classes; they are still one kind of block."""
    cls = type(module)
    return cls.__bases__[0] if parametrize.is_parametrized(module) else cls


def block_signature(module: nn.Module) -> tuple:
    """What makes two blocks interchangeable: class and every parameter's name, shape and dtype."""
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters())
    return (module_class(module).__qualname__, params)


def _children(container: nn.Module) -> list[nn.Module]:
    """The modules a container holds, in order (a ``ModuleDict`` iterates its keys, not its modules)."""
    return list(container.values()) if isinstance(container, nn.ModuleDict) else list(container)


def hookable(module: nn.Module) -> bool:
    """Whether ``module`` takes forward hooks: a ``torch.jit.script``-ed one (and each module inside it) does not,
    so checkpointing, the trace's markers and the attribution pass it by."""
    return not isinstance(module, torch.jit.ScriptModule)


def scripted_stacks(model: nn.Module) -> list[str]:
    """The containers that would be stacks but for their blocks being ``torch.jit.script``-ed (said in the plan)."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, _CONTAINERS) and len(module) >= 2:
            children = _children(module)
            if not hookable(children[0]) and all(type(c) is type(children[0]) for c in children):
                found.append(name or "(root)")
    return found


def _is_stack(container: nn.Module) -> bool:
    """Two or more distinct children of one class with parameters. The first block may own extra parameters
    (T5's relative position bias lives in block 0); ``BlockStack.uniform_tail`` says whether blocks
    1..N-1 are interchangeable. One module listed several times (``nn.ModuleList([layer] * n)``: a layer applied
    n times with one set of weights) is not a stack: its applications are not modules memopt can wrap one by one."""
    if not isinstance(container, _CONTAINERS) or len(container) < 2:
        return False
    if isinstance(container, nn.ModuleDict) and list(container.keys()) != [str(i) for i in range(len(container))]:
        # keyed by name (experts, task heads): a collection the forward picks from, not layers run in order
        return False
    children = _children(container)
    if len({id(c) for c in children}) < len(children) or not hookable(children[0]):
        return False
    cls = module_class(children[0])
    if not any(True for _ in children[0].parameters()):  # parameter-free lists (activations, dropouts)
        return False
    return all(module_class(c) is cls for c in children[1:])


def _runs(container: nn.Module) -> list[tuple[int, int]]:
    """The runs ``[start, end)`` of a list or sequential that is not a stack as a whole (see the module's doc)."""
    if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(container) < 3:
        return []
    children = list(container)
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(children) + 1):
        if i < len(children) and module_class(children[i]) is module_class(children[start]):
            continue
        if i - start >= 2 and _is_run(children[start:i]):
            runs.append((start, i))
        start = i
    return runs


def _is_run(blocks: list[nn.Module]) -> bool:
    """Distinct modules of modules with parameters, none holding a stack of its own."""
    if len({id(b) for b in blocks}) < len(blocks) or not any(True for _ in blocks[0].parameters()) \
            or not hookable(blocks[0]):
        return False
    if not all(any(True for _ in b.children()) for b in blocks):
        return False  # single layers (two convolutions in a row) are layers, not blocks
    # a block holding a stack of its own is a stage of blocks, left to that stack; a run inside a block (two
    # convolution-norm-activation units in a row) does not make it one
    return not any(_is_stack(m) for b in blocks for m in b.modules())


def find_block_stacks(model: nn.Module) -> list[BlockStack]:
    """The outermost stacks of repeated blocks, in module order."""
    stacks: list[BlockStack] = []
    inside: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in inside):
            continue
        parent_name, _, attr = name.rpartition(".")
        if _is_stack(module):
            parent = model.get_submodule(parent_name) if parent_name else model
            stacks.append(BlockStack(path=name, parent=parent, attr=attr, blocks=tuple(_children(module))))
            inside.append(name)
            continue
        for lo, hi in _runs(module):
            parent = model.get_submodule(parent_name) if parent_name else model
            stacks.append(BlockStack(path=f"{name}[{lo}:{hi}]", parent=parent, attr=attr,
                                     blocks=tuple(list(module)[lo:hi]), start=lo))
            inside.extend(f"{name}.{i}" if name else str(i) for i in range(lo, hi))
    return stacks


def count_params(module: nn.Module, *, trainable_only: bool = False) -> int:
    seen: set[int] = set()
    total = 0
    for p in module.parameters():
        if id(p) in seen or (trainable_only and not p.requires_grad):
            continue
        seen.add(id(p))
        total += p.numel()
    return total


def param_bytes_by_dtype(module: nn.Module) -> dict[str, int]:
    seen: set[int] = set()
    out: dict[str, int] = {}
    for p in module.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        key = str(p.dtype).removeprefix("torch.")
        out[key] = out.get(key, 0) + p.numel() * p.element_size()
    return out


_ = torch  # re-exported type context for annotations


def tied_parameter_groups(model: nn.Module) -> list[list[str]]:
    """Names of parameters that are one tensor (e.g. input embedding and LM head), groups of 2+."""
    by_id: dict[int, list[str]] = defaultdict(list)
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id[id(p)].append(name)
    return [names for names in by_id.values() if len(names) > 1]
