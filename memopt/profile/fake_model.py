"""A fake-tensor copy of the user's model: same structure, no memory, never touching the original.

``fake_copy`` deep-copies the module tree with every parameter and buffer replaced by a meta tensor
(so a real 70B model costs nothing to copy), then materializes them as fake tensors on the traced
device inside ``FakeTensorMode``. ``to_empty`` unties shared weights; ties are recorded first and
restored after. Optionally a stack of identical blocks is truncated to a few blocks: the profile
traces those and composes the rest.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Sequence

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
    try:
        clone = copy.deepcopy(model, memo=memo)
    except Exception as exc:
        raise ValueError(
            f"memopt could not copy the model for tracing ({type(exc).__name__}: {exc}). "
            "Build the model on the meta device (with torch.device('meta'): model = ...) and pass that, "
            "or make the module deep-copyable"
        ) from exc
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
