"""A fake-tensor copy of the user's model: same structure, no memory, never touching the original.

``fake_copy`` copies the module tree with every parameter and buffer replaced by a meta tensor
(so a real 70B model costs nothing to copy; attributes that cannot be copied, such as an open file, are
shared), then materializes them as fake tensors on the traced device inside ``FakeTensorMode``. ``to_empty``
unties shared weights; ties are recorded first and restored after. Optionally a stack of identical blocks is
truncated to a few blocks: the profile traces those and composes the rest.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memopt.blocks import BlockStack, find_block_stacks

__all__ = ["fake_copy", "tied_parameter_groups", "truncate_stacks"]


def tied_parameter_groups(model: nn.Module) -> list[list[str]]:
    """Names of parameters that are one tensor (e.g. input embedding and LM head), groups of 2+."""
    by_id: dict[int, list[str]] = defaultdict(list)
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id[id(p)].append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _meta_memo(model: nn.Module) -> dict[int, object]:
    memo: dict[int, object] = {}
    for p in model.parameters(recurse=True):
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                       requires_grad=p.requires_grad)
    for b in model.buffers(recurse=True):
        if id(b) not in memo:
            memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    return memo


def _retie(model: nn.Module, groups: list[list[str]]) -> None:
    for names in groups:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            setattr(owner, attr, first)


def _copy_value(value: Any, memo: dict[int, Any]) -> Any:
    """A deep copy of a module attribute; what cannot be copied (an open file, a lock, a bound method of an object
    holding one) is shared with the original, its containers copied around it: the trace only reads such things."""
    known = len(memo)
    try:
        return copy.deepcopy(value, memo)
    except Exception:  # any object may refuse to be copied, in any way
        # forget the half-built copies the failed attempt left in the memo (dicts keep insertion order), or a later
        # reference to the same object would get one of them
        for key in list(memo)[known:]:
            if key != id(memo):  # deepcopy's keep-alive list: its objects' ids must stay taken
                del memo[key]
        if isinstance(value, dict):
            out = copy.copy(value)  # keeps the type (OrderedDict of hooks, a config dict)
            for k, v in value.items():
                out[k] = _copy_value(v, memo)
            return out
        if isinstance(value, list):
            return [_copy_value(v, memo) for v in value]
        return value


def _copy_module(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """The module tree copied one module at a time: parameters and buffers from ``memo`` (meta tensors), child
    modules recursively, every other attribute by :func:`_copy_value`. A whole-model ``deepcopy`` would fail on
    the first attribute that cannot be pickled (a log file kept on the model, a handle a hook holds)."""
    found = memo.get(id(module))
    if found is not None:
        return found
    clone = module.__class__.__new__(module.__class__)
    memo[id(module)] = clone
    state: dict[str, Any] = {}
    for key, value in module.__dict__.items():
        if key == "_modules":
            state[key] = {n: (None if c is None else _copy_module(c, memo)) for n, c in value.items()}
        elif key in ("_parameters", "_buffers"):
            state[key] = {n: (None if t is None else memo.get(id(t), t)) for n, t in value.items()}
        else:
            state[key] = _copy_value(value, memo)
    clone.__dict__.update(state)
    return clone


class _Dropped(nn.Module):
    """Stands in, during the copy, for blocks that a truncated copy will not keep."""


def fake_copy(model: nn.Module, fake_mode: FakeTensorMode, device: str | torch.device,
              keep_blocks: int | None = None) -> nn.Module:
    """A structural copy of ``model`` whose parameters and buffers are fake tensors on ``device``.

    With ``keep_blocks``, stacks of interchangeable blocks keep only their first ``keep_blocks`` blocks; the
    others are never copied (an 80-block model costs what a 4-block one does).
    """
    groups = tied_parameter_groups(model)
    memo = _meta_memo(model)
    cut: list[str] = []
    if keep_blocks is not None:
        dropped = _Dropped()
        for stack in find_block_stacks(model):
            if len(stack) > keep_blocks and stack.uniform_tail:
                cut.append(stack.path)
                for block in stack.blocks[keep_blocks:]:
                    memo[id(block)] = dropped
    clone = _copy_module(model, memo)
    for path in cut:
        parent_name, _, attr = path.rpartition(".")
        parent = clone.get_submodule(parent_name) if parent_name else clone
        container = getattr(parent, attr)
        kept = [b for b in container if not isinstance(b, _Dropped)]
        setattr(parent, attr, type(container)(*kept) if isinstance(container, nn.Sequential) else nn.ModuleList(kept))
    if cut:
        groups = [[n for n in names if _resolvable(clone, n)] for names in groups]
        groups = [g for g in groups if len(g) > 1]
    with fake_mode:
        clone.to_empty(device=device)
    _retie(clone, groups)
    return clone


def _resolvable(model: nn.Module, name: str) -> bool:
    try:
        model.get_parameter(name)
    except AttributeError:
        return False
    return True


def truncate_stacks(model: nn.Module, keep: int = 3) -> list[tuple[BlockStack, int]]:
    """Shorten every stack of identical blocks to ``keep`` blocks in place; returns (stack, full length).

    A stack whose blocks after the first are not interchangeable is left whole."""
    truncated: list[tuple[BlockStack, int]] = []
    for stack in find_block_stacks(model):
        full = len(stack)
        if full > keep and stack.uniform_tail:
            container = getattr(stack.parent, stack.attr)
            kept: Sequence[nn.Module] = list(stack.blocks[:keep])
            setattr(stack.parent, stack.attr, type(container)(*kept) if isinstance(container, nn.Sequential)
                    else nn.ModuleList(kept))
        truncated.append((stack, full))
    return truncated
