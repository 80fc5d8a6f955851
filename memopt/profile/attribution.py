"""Which module and op made each allocation, in a traced step and in a measured one.

``ModuleAttribution`` keeps a module-path stack with forward pre/post hooks on every module of a model, so an
allocation made in forward belongs to the innermost module running. Backward allocations belong to the module
whose forward made the autograd node that allocates them: each node a module's forward creates is labelled
with the module's path (in the node's own ``metadata``, so nothing extra keeps the graph alive), and during
backward ``torch._C._current_autograd_node()`` names the node running. A checkpointed block's recomputation
runs its submodules' forwards again, inside backward: their hooks put them back on the stack, so the recompute
belongs to the checkpointed block.

Labelling: when a module's forward ends, the nodes reachable from its outputs that carry no label yet are its
own (its children labelled theirs when they ended); when a module's forward begins, unlabelled nodes reachable
from its inputs were made by the module around it (code between two children), and get that module's path.

Module groups (:func:`group_of`) are derived from the module tree and the step's phase markers, not per model:
each repeated block stack (``memopt.blocks``) is a group; code that runs before the first block is the
``embedding``, after the last one ``head and loss``, between two stacks ``between stacks``; the optimizer step
is ``optimizer``; memory that belongs to no module (cuBLAS workspaces, the caching allocator's slack, the CUDA
runtime) is ``runtime``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from memopt.blocks import hookable

__all__ = [
    "BETWEEN",
    "EMBEDDING",
    "HEAD",
    "OPTIMIZER",
    "RUNTIME",
    "ModuleAttribution",
    "block_pattern",
    "group_of",
    "iter_tensors_shallow",
]

EMBEDDING, HEAD, BETWEEN, OPTIMIZER, RUNTIME = "embedding", "head and loss", "between stacks", "optimizer", "runtime"
_KEY = "memopt_module"
OUTSIDE = "(train step)"  # no module running and no autograd node: the train step's own code (loss bookkeeping)
_ACC = "torch::autograd::AccumulateGrad"


def iter_tensors_shallow(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors in nested tuples, lists and mappings (a Hugging Face ``ModelOutput`` included)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 6:
        return
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors_shallow(v, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors_shallow(v, depth + 1)
    elif hasattr(obj, "to_tuple"):
        yield from iter_tensors_shallow(obj.to_tuple(), depth + 1)


def _label(values: Any, name: str) -> None:
    todo = [t.grad_fn for t in iter_tensors_shallow(values) if t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None:
            continue
        md = node.metadata
        if _KEY in md or node.name() == _ACC:
            continue
        md[_KEY] = name
        todo.extend(n for n, _ in node.next_functions if n is not None)


class ModuleAttribution:
    """The module path that is running now (``current()``), forward and backward; ``first_phase`` records the
    phase (``phase_fn()``) in which each module's forward first ran."""

    def __init__(self, model: nn.Module, phase_fn: Callable[[], str] | None = None) -> None:
        self.stack: list[str] = []
        self.first_phase: dict[str, str] = {}
        self.order: list[str] = [name for name, _ in model.named_modules()]
        self._phase_fn = phase_fn
        self._handles: list[Any] = []
        for name, module in model.named_modules():
            if not hookable(module):  # a scripted module's allocations go to the module that called it
                continue
            self._handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post(name), with_kwargs=True, always_call=True))

    def _pre(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if torch.is_grad_enabled():
                _label((args, kwargs), self.stack[-1] if self.stack else "")
            self.stack.append(name)
            if name not in self.first_phase and self._phase_fn is not None:
                self.first_phase[name] = self._phase_fn()
        return hook

    def _post(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if torch.is_grad_enabled():
                _label(output, name)
            if self.stack and self.stack[-1] == name:
                self.stack.pop()
            elif name in self.stack:  # an exception unwound inner modules without their hooks
                del self.stack[self.stack.index(name):]
        return hook

    def current(self) -> str:
        if self.stack:
            return self.stack[-1]
        node = torch._C._current_autograd_node()
        if node is not None:
            return node.metadata.get(_KEY, "")
        return OUTSIDE

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.stack = []


def block_pattern(path: str, stack_paths: Sequence[str]) -> tuple[int, int | None, str]:
    """(stack index or -1, block index or None, the path with the block index as ``*``)."""
    for s, sp in enumerate(stack_paths):
        if path.startswith(sp + "."):
            rest = path[len(sp) + 1:]
            head, _, tail = rest.partition(".")
            if head.isdigit():
                return s, int(head), f"{sp}.*" + (f".{tail}" if tail else "")
    return -1, None, path


_PHASE = re.compile(r"^(fwd|bwd):s(\d+)\.b\d+")
_GAP = re.compile(r"^(fwd|bwd):gap\.s(\d+)")


def phase_group(phase: str, stack_paths: Sequence[str]) -> str:
    """The group of code that runs in no module of its own (the root, a container of the stacks), by the phase."""
    last = len(stack_paths) - 1
    m = _PHASE.match(phase)
    if m:
        return stack_paths[int(m.group(2))]
    m = _GAP.match(phase)
    if m:
        s = int(m.group(2))
        if m.group(1) == "fwd":
            return HEAD if s == last else BETWEEN
        return EMBEDDING if s == 0 else BETWEEN
    if phase.startswith("forward"):
        return EMBEDDING if stack_paths else HEAD
    if phase.startswith(("opt", "zero_grad")):
        return OPTIMIZER
    return HEAD


def group_of(path: str, phase: str, stack_paths: Sequence[str], first_phase: dict[str, str] | None = None,
             order: Sequence[str] | None = None) -> str:
    """The module group of an allocation made by module ``path`` (``""``: no module) in ``phase``."""
    s, _, _ = block_pattern(path, stack_paths)
    if s >= 0:
        return stack_paths[s]
    if path == OUTSIDE:  # before the model's forward it is the input's, after it the loss's
        return HEAD if phase.startswith(("bwd", "backward")) else phase_group(phase, stack_paths)
    if path == "" or any(sp == path or sp.startswith(path + ".") for sp in stack_paths):
        return phase_group(phase, stack_paths)
    first = (first_phase or {}).get(path)
    if first is None:
        # never ran in forward (a parameter of an unused module): by its place in the module tree
        first = phase
        if order is not None and stack_paths and path in order:
            firsts = [order.index(sp) for sp in stack_paths if sp in order]
            if firsts:
                first = "forward" if order.index(path) < min(firsts) else f"fwd:gap.s{len(stack_paths) - 1}"
    return phase_group(first, stack_paths)


# -- what a trace records ------------------------------------------------------------------------------
def trace_record(model: nn.Module, stack_paths: Sequence[str], tracker: Any, attrib: ModuleAttribution,
                 alloc_op: dict[int, str]) -> dict[str, Any]:
    """The attribution a traced pass keeps (JSON-ready): per allocation key its module and op, the module of
    every parameter, buffer and gradient, and when each module first ran (for its group)."""
    modules: list[str] = [""]
    index: dict[str, int] = {"": 0}
    ops: list[str] = []
    op_index: dict[str, int] = {}

    def mi(path: str) -> int:
        if path not in index:
            index[path] = len(modules)
            modules.append(path)
        return index[path]

    def oi(op: str) -> int:
        if op not in op_index:
            op_index[op] = len(ops)
            ops.append(op)
        return op_index[op]

    alloc = [[key, mi(tracker.run.alloc_module.get(key, "")), oi(op)] for key, op in alloc_op.items()]
    params = [[mi(name.rpartition(".")[0]), list(p.shape), str(p.dtype).removeprefix("torch."), bool(p.requires_grad)]
              for name, p in model.named_parameters()]
    buffers = [[mi(name.rpartition(".")[0]), list(b.shape), str(b.dtype).removeprefix("torch.")]
               for name, b in model.named_buffers()]
    grads = []
    for name, p in model.named_parameters():
        key = tracker.key_of(p.grad) if p.grad is not None else None
        if key is not None:
            grads.append([key, mi(name.rpartition(".")[0])])
    return {"modules": modules, "ops": ops, "alloc": alloc, "params": params, "buffers": buffers, "grads": grads,
            "first_phase": [[mi(k), v] for k, v in attrib.first_phase.items()],
            "order": attrib.order, "stacks": list(stack_paths)}


def merge_record(one: dict[str, Any] | None, two: dict[str, Any] | None, keys: set[int], unmatched: int
                 ) -> dict[str, Any] | None:
    """One record for an aligned pair of traces: the first trace's, plus the allocations only the second has
    (their keys offset by ``unmatched``, as the alignment names them); only ``keys`` that the segments use."""
    if one is None:
        return None
    out = dict(one)
    alloc = [e for e in one["alloc"] if e[0] in keys]
    if two is not None:
        modules, ops = list(one["modules"]), list(one["ops"])
        mindex = {m: i for i, m in enumerate(modules)}
        oindex = {o: i for i, o in enumerate(ops)}
        for key, m, o in two["alloc"]:
            if key + unmatched not in keys:
                continue
            name, op = two["modules"][m], two["ops"][o]
            if name not in mindex:
                mindex[name] = len(modules)
                modules.append(name)
            if op not in oindex:
                oindex[op] = len(ops)
                ops.append(op)
            alloc.append([key + unmatched, mindex[name], oindex[op]])
        out["modules"], out["ops"] = modules, ops
    out["alloc"] = alloc
    return out


def attribution_with_ops(record: dict[str, Any], tracker: Any, op_of: dict[int, str]) -> dict[str, Any]:
    """``record`` with every allocation of the traced step (``op_of``: key -> op) given its module and op."""
    modules = list(record["modules"])
    index = {m: i for i, m in enumerate(modules)}
    ops: list[str] = []
    op_index: dict[str, int] = {}
    alloc = []
    for key, op in op_of.items():
        path = tracker.run.alloc_module.get(key, "")
        if path not in index:
            index[path] = len(modules)
            modules.append(path)
        if op not in op_index:
            op_index[op] = len(ops)
            ops.append(op)
        alloc.append([key, index[path], op_index[op]])
    return {**record, "modules": modules, "ops": ops, "alloc": alloc}
